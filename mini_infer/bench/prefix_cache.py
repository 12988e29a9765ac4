"""``python -m mini_infer.bench.prefix_cache``: what the radix prefix cache saves (chapter 12; read in chapter 08).

Workload (SGLang's shared-prefix benchmark, scaled down for a CPU): ``--groups`` groups of
``--prompts-per-group`` prompts; the prompts of one group start with the same system prompt of
``--system-len`` random token ids and end with a question of their own, ``--question-len``
random ids long. Every prompt is submitted at once, greedy, ``--max-tokens`` output tokens each
(``ignore_eos``), on a random-weight model at ``--shape`` (speed does not depend on the
weights' values) or on ``--model``.

**Shareable tokens** are what a perfect prefix cache could serve. For prompt ``i`` of a group
(in submission order), with ``lcp`` the length of the longest common prefix of two token lists
and ``B`` the KV block size::

    shareable(p_i) = B * floor(min(max_{j < i} lcp(p_i, p_j), len(p_i) - 1) / B)

and 0 for the first prompt of a group: only whole blocks are ever shared, only with prompts
submitted earlier, and the engine always computes a prompt's last token itself, to have logits
to sample from. The **hit fraction** is the engine's ``prefix_cache_hit_tokens`` over the
shareable tokens.

The same workload runs with the cache on and off in the same process, on two engines with the
same settings and a pool large enough that nothing is evicted or preempted, their runs
interleaved so that a drifting machine slows both alike. With ``--tensor-parallel-size`` N > 1
(chapter 14) the engines are split over N ranks; a process holds one tensor-parallel engine at a
time (one ``torch.distributed`` world), so the runs are sequential instead: every run without the
cache on the first engine, closed, then every run with it on the second (the output says which
order it used). Each timed run starts from an empty cache, so every hit comes from within the
workload. Reported: the hit
tokens and fraction, the prompt tokens computed, the time until every request has its first
token (the prefill phase of this offline batch) and until all are done, medians of
``--repeats`` runs with the individual runs beside them, the speed-ups, and whether the greedy
outputs are identical. The exit status is 1 when the hit fraction is below ``--min-hit-fraction``
or the outputs differ (expect exact equality in float32; bf16 and fp16 may round differently
when the cache changes how a prompt is cut into chunks).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mini_infer.bench.common import (
    ComparisonSetup,
    add_tensor_parallel_argument,
    run_script,
    write_results,
)
from mini_infer.config import ModelConfig
from mini_infer.device import synchronize
from mini_infer.kv.block_pool import num_blocks_for
from mini_infer.kv.radix_cache import RadixCache
from mini_infer.llm import LLM
from mini_infer.offline_models import random_model_dir
from mini_infer.sampling_params import SamplingParams

__all__ = [
    "RunResult",
    "add_arguments",
    "common_prefix_len",
    "main",
    "run",
    "shareable_tokens",
    "shared_prefix_workload",
]


def shared_prefix_workload(
    vocab_size: int,
    groups: int,
    prompts_per_group: int,
    system_len: int,
    question_len: tuple[int, int],
    seed: int = 0,
) -> tuple[list[list[int]], list[int]]:
    """Prompts grouped by system prompt, group after group; returns (prompts, group of each)."""
    rng = random.Random(seed)
    lo, hi = question_len
    prompts: list[list[int]] = []
    group_of: list[int] = []
    for g in range(groups):
        system = [rng.randrange(vocab_size) for _ in range(system_len)]
        for _ in range(prompts_per_group):
            prompts.append(system + [rng.randrange(vocab_size) for _ in range(rng.randint(lo, hi))])
            group_of.append(g)
    return prompts, group_of


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def shareable_tokens(prompts: Sequence[Sequence[int]], group_of: Sequence[int], block_size: int) -> list[int]:
    """For each prompt, the whole-block prefix it shares with an earlier prompt of its group."""
    out = []
    for i, prompt in enumerate(prompts):
        shared = max((common_prefix_len(prompt, prompts[j]) for j in range(i) if group_of[j] == group_of[i]), default=0)
        shared = min(shared, len(prompt) - 1)  # the last prompt token is always computed
        out.append(shared - shared % block_size)
    return out


@dataclass
class RunResult:
    prefill_s: float  # submission to the last request's first token
    total_s: float  # submission to the last request's last token
    hit_tokens: int
    hits_per_request: list[int]
    steps: int
    preemptions: int
    outputs: list[list[int]]


def run_once(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> RunResult:
    """Submit every prompt at once and step the engine to the end, from an empty cache."""
    engine = llm.engine
    if isinstance(engine.scheduler.blocks.prefix_cache, RadixCache):
        engine.scheduler.blocks.prefix_cache.reset()
    before = engine.stats()
    synchronize(engine.runner.device)
    start = time.perf_counter()
    ids = [engine.add_request(p, params) for p in prompts]
    first_token_s: dict[str, float] = {}
    finals = {}
    while engine.has_unfinished_requests():
        # A step returns after the sampler's host sync: its tokens are on the host, so the clock
        # reads after the step's work is done.
        for out in engine.step():
            first_token_s.setdefault(out.request_id, time.perf_counter() - start)
            if out.finished:
                finals[out.request_id] = out
    total = time.perf_counter() - start
    after = engine.stats()
    outputs = [finals[i] for i in ids]
    return RunResult(
        prefill_s=max(first_token_s.values()),
        total_s=total,
        hit_tokens=after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"],
        hits_per_request=[o.num_cached_tokens for o in outputs],
        steps=after["steps"] - before["steps"],
        preemptions=after["num_preemptions"] - before["num_preemptions"],
        outputs=[list(o.token_ids) for o in outputs],
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="a model directory (default: random weights at --shape)")
    parser.add_argument(
        "--shape", default="small-test", help="named shape of the random model (e.g. small-test, qwen2.5-0.5b)"
    )
    parser.add_argument(
        "--dtype", default="float32", help="float32 (outputs must match exactly), bfloat16, float16 or auto"
    )
    parser.add_argument("--device", default="auto")
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--prompts-per-group", type=int, default=8)
    parser.add_argument("--system-len", type=int, default=400, help="tokens of each group's system prompt")
    parser.add_argument("--question-len", type=int, nargs=2, default=[10, 40], metavar=("LO", "HI"))
    parser.add_argument("--max-tokens", type=int, default=16, help="output tokens per prompt")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="timed runs per setting (median), cache on and off interleaved (sequential on several ranks)",
    )
    parser.add_argument(
        "--min-hit-fraction", type=float, default=0.8, help="exit 1 below this fraction of the shareable tokens"
    )
    add_tensor_parallel_argument(
        parser, "split both engines over N ranks (chapter 14); N > 1 runs them one after the other, not interleaved"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the results to this file")


def _seconds(runs: list[RunResult], field: str) -> tuple[float, str]:
    values = [getattr(r, field) for r in runs]
    return statistics.median(values), ", ".join(f"{v:.2f}" for v in values)


def run(args: argparse.Namespace) -> int:
    if args.groups < 1 or args.prompts_per_group < 1 or args.system_len < 0 or args.repeats < 1 or args.max_tokens < 1:
        raise SystemExit("--groups, --prompts-per-group, --repeats and --max-tokens must be >= 1, --system-len >= 0")
    lo, hi = args.question_len
    if not 1 <= lo <= hi:
        raise SystemExit("--question-len LO HI needs 1 <= LO <= HI (every prompt has a question of its own)")
    setup = ComparisonSetup.from_args(args)
    device, dtype, ranks = setup.device, setup.dtype, setup.ranks
    model_dir = Path(args.model) if args.model else random_model_dir(args.shape, setup.dtype_name)
    model_name = str(model_dir) if args.model else f"random-weight {args.shape}"

    def make_llm(enable_prefix_caching: bool, num_kv_blocks: int) -> LLM:
        return LLM(
            str(model_dir),
            dtype=dtype,
            device=device,
            block_size=args.block_size,
            num_kv_blocks=num_kv_blocks,
            max_num_batched_tokens=args.max_num_batched_tokens,
            enable_prefix_caching=enable_prefix_caching,
            enforce_eager=ranks > 1,  # tensor parallelism runs eagerly on CUDA (no CUDA graphs)
            tensor_parallel_size=ranks,
            seed=args.seed,
            generation_config="vllm",  # plain greedy prefills, whatever the model's defaults
            show_progress=False,
        )

    vocab = ModelConfig.from_model_dir(model_dir).vocab_size
    prompts, group_of = shared_prefix_workload(
        vocab, args.groups, args.prompts_per_group, args.system_len, (lo, hi), args.seed
    )
    # Room for every request at once, so that neither setting evicts or preempts.
    num_blocks = sum(num_blocks_for(len(p) + args.max_tokens, args.block_size) for p in prompts)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    warm_up = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)  # first calls allocate, pick kernels
    shareable = shareable_tokens(prompts, group_of, args.block_size)

    on_ranks = (
        "" if setup.interleaved else f", split over {ranks} ranks ({max(1, setup.threads // ranks)} threads each)"
    )
    print(
        f"prefix-cache benchmark: {model_name}, {setup.dtype_name} on {device} ({setup.threads} threads){on_ranks}, "
        f"block size {args.block_size}, budget {args.max_num_batched_tokens} tokens a step"
    )
    print(
        f"workload: {args.groups} groups x {args.prompts_per_group} prompts, system prompt {args.system_len} tokens, "
        f"questions {lo}-{hi} tokens, {args.max_tokens} output tokens each (greedy), all submitted at once",
        flush=True,
    )
    order = (
        f"cache off and on interleaved, {args.repeats} runs each"
        if setup.interleaved
        else f"sequential: {args.repeats} run(s) with the cache off, then {args.repeats} with it on, one "
        f"{ranks}-rank engine at a time (a process holds one tensor-parallel engine), so not interleaved"
    )
    print(f"runs: {order}", flush=True)
    runs: dict[str, list[RunResult]] = {"off": [], "on": []}
    if setup.interleaved:
        with make_llm(False, num_blocks) as off, make_llm(True, num_blocks) as on:
            for llm in (off, on):
                run_once(llm, prompts[:2], warm_up)
            for _ in range(args.repeats):
                runs["off"].append(run_once(off, prompts, params))
                runs["on"].append(run_once(on, prompts, params))
    else:
        for setting in ("off", "on"):
            with make_llm(setting == "on", num_blocks) as llm:  # closed (its workers ended) before the next
                run_once(llm, prompts[:2], warm_up)
                runs[setting] = [run_once(llm, prompts, params) for _ in range(args.repeats)]

    first_on, first_off = runs["on"][0], runs["off"][0]
    prompt_tokens = sum(map(len, prompts))
    total_shareable = sum(shareable)
    hit = first_on.hit_tokens
    hit_fraction = hit / total_shareable if total_shareable else 1.0
    # Every run on a cold cache schedules the same way, so the hits must not change between runs.
    consistent = all(r.hit_tokens == hit for r in runs["on"])
    outputs_equal = all(r.outputs == first_off.outputs for r in runs["on"] + runs["off"])
    mismatched = sum(a != b for a, b in zip(first_on.outputs, first_off.outputs))
    prefill_off, prefill_off_runs = _seconds(runs["off"], "prefill_s")
    prefill_on, prefill_on_runs = _seconds(runs["on"], "prefill_s")
    total_off, total_off_runs = _seconds(runs["off"], "total_s")
    total_on, total_on_runs = _seconds(runs["on"], "total_s")
    per_place = [
        statistics.mean(first_on.hits_per_request[k :: args.prompts_per_group]) for k in range(args.prompts_per_group)
    ]

    hit_ok = hit_fraction >= args.min_hit_fraction and consistent
    rows = [
        ("prompt tokens", f"{prompt_tokens:,}"),
        ("shareable tokens", f"{total_shareable:,}  (whole blocks shared with an earlier prompt of the group)"),
        ("prefix-cache hit tokens", f"{hit:,}" + ("" if consistent else "  (CHANGED between runs)")),
        (
            "hit fraction",
            f"{100 * hit_fraction:.1f}% of the shareable tokens  (>= {100 * args.min_hit_fraction:.0f}%: {'PASS' if hit_ok else 'FAIL'})",
        ),
        ("hits by place in group", ", ".join(f"{h:.0f}" for h in per_place) + "  (tokens, mean over groups)"),
        (
            "prompt tokens computed",
            f"{prompt_tokens:,} off, {prompt_tokens - hit:,} on  ({prompt_tokens / max(prompt_tokens - hit, 1):.2f}x fewer)",
        ),
        ("engine steps", f"{first_off.steps} off, {first_on.steps} on"),
        ("preemptions", f"{first_off.preemptions} off, {first_on.preemptions} on"),
        (
            "prefill (last 1st token)",
            f"{prefill_off:.2f} s off, {prefill_on:.2f} s on: {prefill_off / prefill_on:.2f}x faster  (runs: off {prefill_off_runs}; on {prefill_on_runs})",
        ),
        (
            "total",
            f"{total_off:.2f} s off, {total_on:.2f} s on: {total_off / total_on:.2f}x faster  (runs: off {total_off_runs}; on {total_on_runs})",
        ),
        (
            "outputs equal (greedy)",
            f"{'yes' if outputs_equal else 'NO'}  ({len(prompts) - mismatched} of {len(prompts)} requests identical)",
        ),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")

    if args.json:
        results: dict[str, Any] = {
            "model": model_name,
            **setup.description(args),
            "prompt_tokens": prompt_tokens,
            "shareable_tokens": total_shareable,
            "hit_tokens": hit,
            "hit_fraction": hit_fraction,
            "prefill_s": {"off": prefill_off, "on": prefill_on},
            "total_s": {"off": total_off, "on": total_on},
            "outputs_equal": outputs_equal,
            "runs": {k: [{f: v for f, v in asdict(r).items() if f != "outputs"} for r in rs] for k, rs in runs.items()},
        }
        write_results(args.json, results)
    return 0 if hit_ok and outputs_equal else 1


def main(argv: list[str] | None = None) -> int:
    return run_script("python -m mini_infer.bench.prefix_cache", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
