"""``mini-infer bench speculative``: acceptance against speedup for a draft model (chapter 10).

Workload: chat questions, greedy, ``--max-tokens`` each, submitted ``--batch-size`` at a time (1,
the default, is the latency-bound case speculative decoding is for). The questions are the tiny
pair's held-out ones (``tiny_corpus``), real text the shipped pair was trained on, or the lines of
``--prompts-file`` for any other model pair. Random weights would be no use here: acceptance
only means something for two models that learned the same text.

For every ``k`` of ``--k``, an engine with the draft runs the workload alternately with an engine
without one, ``--repeats`` times each, in the same process (the target's weights are loaded
twice). With ``--tensor-parallel-size`` N > 1 (chapter 14) the target is split over N ranks and
the draft runs whole on rank 0; a process holds one tensor-parallel engine at a time, so the runs
are sequential instead: the target alone first, then each ``k``'s engine, each closed before the
next is built (the output says which order it used). Reported per ``k``: the acceptance rate (``num_accepted_draft_tokens /
num_draft_tokens``), target steps and tokens per step, the median wall times and their ratio,
and whether the outputs equal the target's alone. The exit status is 1 when they differ in
float32, where they must be identical; in bf16 or fp16 verification batches positions
differently from one-token decoding, so a near tie may round the other way, and a difference is
only reported.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mini_infer.bench.common import (
    ComparisonSetup,
    add_tensor_parallel_argument,
    run_script,
    write_results,
)
from mini_infer.device import synchronize
from mini_infer.llm import LLM
from mini_infer.sampling_params import SamplingParams
from mini_infer.tiny_corpus import TASKS, held_out_questions
from mini_infer.tokenizer import Message

__all__ = ["Run", "add_arguments", "main", "run", "run_once", "workload"]


@dataclass(slots=True)
class Run:
    seconds: float
    generated_tokens: int
    steps: int
    draft_tokens: int
    accepted_tokens: int
    outputs: list[list[int]]


def workload(prompts_file: str | None, num_prompts: int) -> list[list[Message]]:
    """One single-turn chat per question: the file's non-empty lines, or the tiny pair's
    held-out questions, every task in turn."""
    if prompts_file:
        lines = [line.strip() for line in Path(prompts_file).read_text().splitlines() if line.strip()]
        if not lines:
            raise SystemExit(f"--prompts-file {prompts_file} has no non-empty line")
    else:
        per_task = [held_out_questions(task) for task in TASKS]
        lines = [
            questions[i].prompt for i in range(max(map(len, per_task))) for questions in per_task if i < len(questions)
        ]
    return [[{"role": "user", "content": line}] for line in lines[:num_prompts]]


def run_once(llm: LLM, chats: list[list[Message]], params: SamplingParams, batch_size: int) -> Run:
    """The chats, ``batch_size`` at a time, timed from the first submission to the last token."""
    engine = llm.engine
    before = engine.stats()
    synchronize(engine.runner.device)
    start = time.perf_counter()
    outputs = []
    for i in range(0, len(chats), batch_size):
        outputs += llm.chat(chats[i : i + batch_size], params, use_tqdm=False)
    synchronize(engine.runner.device)
    seconds = time.perf_counter() - start
    after = engine.stats()

    def delta(key: str) -> int:
        return after[key] - before[key]

    return Run(
        seconds,
        delta("generated_tokens"),
        delta("steps"),
        delta("num_draft_tokens"),
        delta("num_accepted_draft_tokens"),
        [list(o.token_ids) for o in outputs],
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny", help="the target model (default: the shipped tiny chat model)")
    parser.add_argument("--draft-model", default="tiny-draft", help="the draft model, with the target's tokenizer")
    parser.add_argument("--k", default="1,2,4,6", help="comma-separated num_speculative_tokens values to measure")
    parser.add_argument(
        "--prompts-file", default=None, help="one question per line (default: the tiny pair's held-out questions)"
    )
    parser.add_argument("--num-prompts", type=int, default=24)
    parser.add_argument("--batch-size", type=int, default=1, help="questions submitted together (1: one at a time)")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    parser.add_argument("--device", default="auto")
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="timed runs per setting (median), with and without the draft alternating (sequential on several ranks)",
    )
    add_tensor_parallel_argument(
        parser, "split the target over N ranks, the draft whole on rank 0 (chapter 14); N > 1 runs the engines in turn"
    )
    parser.add_argument("--json", default=None, help="write the results to this file")


def run(args: argparse.Namespace) -> int:
    try:
        ks = sorted({int(k) for k in args.k.split(",")})
    except ValueError:
        raise SystemExit(f"--k must be comma-separated positive integers, got {args.k!r}") from None
    if not ks or ks[0] < 1 or args.num_prompts < 1 or args.batch_size < 1 or args.max_tokens < 1 or args.repeats < 1:
        raise SystemExit("--k values, --num-prompts, --batch-size, --max-tokens and --repeats must be >= 1")
    setup = ComparisonSetup.from_args(args)
    device, dtype, ranks = setup.device, setup.dtype, setup.ranks
    chats = workload(args.prompts_file, args.num_prompts)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)

    def make_llm(draft_k: int | None) -> LLM:
        # The prefix cache is off: every run computes the same tokens from scratch.
        speculation: dict[str, Any] = (
            {} if draft_k is None else {"draft_model": args.draft_model, "num_speculative_tokens": draft_k}
        )
        # generation_config="vllm": a real model's repetition penalty would leave every request without drafts.
        return LLM(
            args.model,
            dtype=dtype,
            device=device,
            enable_prefix_caching=False,
            generation_config="vllm",
            enforce_eager=ranks > 1,  # tensor parallelism runs eagerly on CUDA (no CUDA graphs)
            tensor_parallel_size=ranks,
            show_progress=False,
            **speculation,
        )

    on_ranks = "" if setup.interleaved else f"; target split over {ranks} ranks, draft on rank 0"
    print(
        f"speculative-decoding benchmark: target {args.model}, draft {args.draft_model}, {setup.dtype_name} on {device} "
        f"({setup.threads} threads{on_ranks})"
    )
    print(
        f"workload: {len(chats)} chat questions, {args.batch_size} at a time, greedy, up to {args.max_tokens} tokens each",
        flush=True,
    )
    order = (
        "with and without the draft alternating"
        if setup.interleaved
        else f"sequential: the target alone first, then each k's engine, one {ranks}-rank engine at a time "
        "(a process holds one tensor-parallel engine), so not interleaved"
    )
    print(f"runs: {order}, {args.repeats} each", flush=True)

    def measured(llm: LLM) -> list[Run]:
        run_once(llm, chats[:2], params, args.batch_size)  # warm-up: first calls allocate and pick kernels
        return [run_once(llm, chats, params, args.batch_size) for _ in range(args.repeats)]

    plain = make_llm(None)
    if setup.interleaved:
        run_once(plain, chats[:2], params, args.batch_size)
    else:
        with plain:  # closed (its workers ended) before the first engine with a draft is built
            sequential_alone_runs = measured(plain)
    header = f"{'k':>3} | {'acceptance':>10} | {'steps':>6} | {'tokens/step':>11} | {'draft s':>8} | {'alone s':>8} | {'speedup':>7} | same outputs"
    print(header)
    rows: list[dict[str, Any]] = []
    all_equal = True
    for k in ks:
        with make_llm(k) as spec:
            if setup.interleaved:
                run_once(spec, chats[:2], params, args.batch_size)
                alone_runs, spec_runs = [], []
                for _ in range(args.repeats):
                    alone_runs.append(run_once(plain, chats, params, args.batch_size))
                    spec_runs.append(run_once(spec, chats, params, args.batch_size))
            else:
                alone_runs, spec_runs = sequential_alone_runs, measured(spec)
        first, reference = spec_runs[0], alone_runs[0]
        same = all(r.outputs == reference.outputs for r in spec_runs)
        all_equal &= same
        spec_s = statistics.median(r.seconds for r in spec_runs)
        alone_s = statistics.median(r.seconds for r in alone_runs)
        acceptance = first.accepted_tokens / max(first.draft_tokens, 1)
        tokens_per_step = first.generated_tokens / max(first.steps, 1)
        row = {
            "k": k,
            "acceptance": acceptance,
            "steps": first.steps,
            "steps_alone": reference.steps,
            "tokens_per_step": tokens_per_step,
            "seconds": spec_s,
            "seconds_alone": alone_s,
            "speedup": alone_s / spec_s,
            "same_outputs": same,
            "runs_s": [r.seconds for r in spec_runs],
            "runs_alone_s": [r.seconds for r in alone_runs],
        }
        rows.append(row)
        print(
            f"{k:>3} | {100 * acceptance:>9.1f}% | {first.steps:>6} | {tokens_per_step:>11.2f} | {spec_s:>8.3f} | "
            f"{alone_s:>8.3f} | {alone_s / spec_s:>6.2f}x | {'yes' if same else 'NO'} (alone: {reference.steps} steps)",
            flush=True,
        )
    plain.close()  # a no-op when already closed
    must_match = dtype == torch.float32
    if not all_equal:
        print(
            "outputs differ from the target's alone"
            + (": FAIL (float32 must match exactly)" if must_match else " (rounding in low precision)")
        )
    if args.json:
        results = {
            "target": args.model,
            "draft": args.draft_model,
            **setup.description(args),
            "rows": rows,
        }
        write_results(args.json, results)
    return 1 if must_match and not all_equal else 0


def main(argv: list[str] | None = None) -> int:
    return run_script("python -m mini_infer.bench.speculative", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
