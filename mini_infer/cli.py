"""The ``mini-infer`` command line: every command of the course (chapter 12).

    mini-infer generate --model tiny --prompt "What is 2 + 3?" --chat
    mini-infer chat --model tiny                    (an interactive chat, streamed)
    mini-infer serve --model tiny --port 8000       (chapter 11: the OpenAI-compatible server)
    mini-infer random-model OUT_DIR --shape qwen2.5-0.5b
    mini-infer bench offline            (chapter 06: the engine against transformers and the roofline)
    mini-infer bench prefix-cache       (chapter 08: prefix-cache hits and prefill time saved)
    mini-infer bench speculative        (chapter 10: a draft's acceptance rate against its speedup)
    mini-infer bench serve              (chapter 12: servebench against any OpenAI-compatible server)
    mini-infer profile --workload decode (where a step's time goes: a trace, a timeline, a table)
    mini-infer course student OUT       (the student track: the package with assignments blanked)
    mini-infer course grade 04 --package OUT   (a chapter's graded tests against OUT/mini_infer)

Each subcommand is a thin layer over the package's public API.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from mini_infer.cli_options import add_engine_args, engine_kwargs

if TYPE_CHECKING:
    from mini_infer.sampling_params import SamplingParams

# The sampling flags of ``generate`` and ``chat``: SamplingParams' field -> (flag, type, what applies
# when neither the flag nor the model's generation config sets it; max_tokens' is the command's).
# Greedy by default, unlike the API.
_SAMPLING_FLAGS: dict[str, tuple[str, type, float | int | None]] = {
    "max_tokens": ("--max-tokens", int, None),
    "temperature": ("--temperature", float, 0.0),
    "top_p": ("--top-p", float, None),
    "top_k": ("--top-k", int, None),
    "min_p": ("--min-p", float, None),
    "repetition_penalty": ("--repetition-penalty", float, None),
}


def requested_params(args: argparse.Namespace) -> SamplingParams:
    """The sampling flags given on the command line, validated (nothing else filled in)."""
    from mini_infer.sampling_params import SamplingParams

    given = {name: getattr(args, name) for name in _SAMPLING_FLAGS if getattr(args, name) is not None}
    if args.sampling_seed is not None:
        given["seed"] = args.sampling_seed
    return SamplingParams(**given)


def generate_params(args: argparse.Namespace, model_defaults: dict[str, Any]) -> SamplingParams:
    """The request of ``generate`` and ``chat``: the flags given, then the model's defaults (none
    with ``--generation-config vllm``), then the command's own fallbacks (greedy; 64 tokens for
    ``generate``, 512 for ``chat``)."""
    fallback = {name: value for name, (_, _, value) in _SAMPLING_FLAGS.items() if value is not None}
    fallback["max_tokens"] = args.fallback_max_tokens
    return requested_params(args).with_defaults(fallback | model_defaults)


def _generate(args: argparse.Namespace) -> int:
    from mini_infer import LLM

    params = requested_params(args)  # refuses bad sampling settings before loading anything
    # Closing the engine ends a tensor-parallel engine's worker processes (chapter 14), on an error too.
    with LLM(args.model, **engine_kwargs(args)) as llm:
        params = generate_params(args, llm.engine.sampling_defaults)
        prompts = args.prompt or ["What is 12 + 30?"]
        if args.chat:
            outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
        else:
            outputs = llm.generate(prompts, params, use_tqdm=False)
        for prompt, out in zip(prompts, outputs):
            if args.json:
                print(
                    json.dumps(
                        {
                            "prompt": prompt,
                            "text": out.text,
                            "token_ids": out.token_ids,
                            "finish_reason": out.finish_reason,
                        }
                    )
                )
            else:
                print(f">>> {prompt}\n{out.text}\n[{len(out.token_ids)} tokens, finish_reason={out.finish_reason}]")
    return 0


def _chat(args: argparse.Namespace) -> int:
    from mini_infer import LLM
    from mini_infer.chat_cli import run_chat

    requested_params(args)  # refuses bad sampling settings before loading anything
    with LLM(args.model, **engine_kwargs(args)) as llm:  # closing ends tensor-parallel workers (chapter 14)
        run_chat(llm, generate_params(args, llm.engine.sampling_defaults), system=args.system)
    return 0


def _add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    """The sampling flags ``generate`` and ``chat`` share; ``max_tokens`` is the command's own
    fallback when neither ``--max-tokens`` nor the model's generation config sets it."""
    for name, (flag, kind, fallback) in _SAMPLING_FLAGS.items():
        fallback = max_tokens if name == "max_tokens" else fallback
        otherwise = "" if fallback is None else f", else {fallback}"
        parser.add_argument(
            flag, dest=name, type=kind, default=None, help=f"default: the model's generation config{otherwise}"
        )
    parser.add_argument("--sampling-seed", type=int, default=None, help="seed of these requests' sampling")
    parser.set_defaults(fallback_max_tokens=max_tokens)


def _random_model(args: argparse.Namespace) -> int:
    from mini_infer.offline_models import write_random_model

    try:
        path = write_random_model(args.out, args.shape, seed=args.seed, dtype=args.dtype)
    except ValueError as exc:
        print(f"mini-infer random-model: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote a random-weight {args.shape} model to {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mini-infer", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text offline")
    add_engine_args(gen)
    gen.add_argument("--prompt", action="append", help="a prompt (repeat for several)")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user turn with the chat template")
    _add_sampling_args(gen, max_tokens=64)
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt")
    gen.set_defaults(func=_generate)

    chat = sub.add_parser("chat", help="an interactive chat in the terminal, streamed (/reset, /quit)")
    add_engine_args(chat)
    _add_sampling_args(chat, max_tokens=512)
    chat.add_argument("--system", default=None, help="a system prompt to start every conversation with")
    chat.set_defaults(func=_chat)

    from mini_infer.server import cli as serve_cli  # light: FastAPI is imported only when serving

    serve = sub.add_parser("serve", help="an OpenAI-compatible server (chat, completions, SSE streaming)")
    serve_cli.add_arguments(serve)
    serve.set_defaults(func=serve_cli.main)

    bench = sub.add_parser("bench", help="benchmarks that print figures")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    from mini_infer.bench import offline as offline_bench
    from mini_infer.bench import prefix_cache as prefix_bench
    from mini_infer.bench import speculative as speculative_bench
    from mini_infer.bench.serve import cli as serve_bench

    benchmarks = [
        ("offline", offline_bench, offline_bench.main, "throughput, decode and prefill against transformers and the roofline"),
        ("prefix-cache", prefix_bench, prefix_bench.run, "hit rate and prefill time saved on a shared-prefix workload"),
        ("speculative", speculative_bench, speculative_bench.run, "a draft model's acceptance rate against its speedup (chapter 10)"),
        ("serve", serve_bench, serve_bench.main, "servebench: load any OpenAI-compatible server and measure it"),
    ]  # fmt: skip
    for name, module, func, summary in benchmarks:
        bench_parser = bench_sub.add_parser(name, help=summary)
        module.add_arguments(bench_parser)
        bench_parser.set_defaults(func=func)

    from mini_infer.bench import profile as profile_command

    prof = sub.add_parser("profile", help="profile engine steps: trace.json, a timeline and time per phase")
    profile_command.add_arguments(prof)
    prof.set_defaults(func=profile_command.main)

    from mini_infer.course import cli as course_cli  # light: reads the package's files as text

    course = sub.add_parser("course", help="the student track: student package, grader, mutation check")
    course_cli.add_arguments(course)

    rnd = sub.add_parser("random-model", help="write a random-weight Qwen2 model directory (offline)")
    rnd.add_argument("out")
    rnd.add_argument(
        "--shape", default="qwen2.5-0.5b", help="qwen2.5-0.5b, qwen2.5-1.5b, tiny-test, small-test, bench-small"
    )
    rnd.add_argument("--dtype", default="bfloat16")
    rnd.add_argument("--seed", type=int, default=0)
    rnd.set_defaults(func=_random_model)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except (ValueError, FileNotFoundError, MemoryError) as exc:
        print(f"mini-infer: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
