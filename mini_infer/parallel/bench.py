"""``mini-infer bench offline --tensor-parallel-size N``: N ranks against one, step by step (chapter 14).

The same model (random weights at ``--shape``, or ``--model``) is built twice in one run: on one
rank, then on N ranks. Each workload of ``--workloads`` runs on both, stepping the engine by hand
so that every step is timed on its own:

* **throughput**: ``--num-prompts`` random prompts, ``--output-len`` tokens each; its prefill
  steps (chunks of ``--max-num-batched-tokens``) and its decode steps are reported apart;
* **decode**: one prompt of 128 tokens, ``--decode-len`` tokens: the step of one sequence, where
  the collectives weigh most against the arithmetic;
* **prefill**: one prompt of ``--prefill-len`` tokens, in chunks.

Per kind of step: the median step time on one rank and on N, the speedup, and on N ranks the
share of rank 0's step spent inside the all-reduces (and the logits' all-gather). That time
counts from entering the collective to leaving it, so it includes waiting for the slowest rank:
on a CPU whose cores the ranks share it is mostly waiting; on GPUs it is mostly the transfer.
There is no ``transformers`` baseline here: the other workloads of ``bench offline`` give it.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from mini_infer.bench.common import write_results
from mini_infer.device import resolve_device, resolve_dtype
from mini_infer.llm import LLM
from mini_infer.offline_models import random_model_dir, random_prompts
from mini_infer.parallel.workers import TensorParallelRunner
from mini_infer.sampling_params import SamplingParams

WORKLOADS = ("throughput", "decode", "prefill")


def timed_steps(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[dict[str, Any]]:
    """Run ``prompts`` to the end, one ``engine.step()`` at a time: per step its kind (decode when
    every new token samples; a step with any prompt token is a prefill step), its seconds and, on
    N ranks, rank 0's seconds in each collective."""
    engine = llm.engine
    runner = engine.runner
    group = runner.group if isinstance(runner, TensorParallelRunner) else None
    if group is not None:
        group.timed = True
    engine.step_log = []
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for prompt in prompts:
        engine.add_request(prompt, params)
    steps: list[dict[str, Any]] = []
    while engine.has_unfinished_requests():
        before = dict(group.seconds) if group is not None else {}
        logged = len(engine.step_log)
        start = time.perf_counter()
        engine.step()
        seconds = time.perf_counter() - start
        if len(engine.step_log) == logged:  # nothing was scheduled: no forward pass to time
            continue
        record = engine.step_log[-1]
        step = {"kind": "decode" if record.num_tokens == record.num_logits else "prefill", "s": seconds}
        if group is not None:
            step.update({kind: group.seconds[kind] - before[kind] for kind in before})
        steps.append(step)
    engine.step_log = None
    if group is not None:
        group.timed = False
    return steps


def summarise(one: list[dict[str, Any]], many: list[dict[str, Any]], kind: str) -> dict[str, Any] | None:
    """Median step times of ``kind`` on one rank and on N, and the collectives' share on N ranks."""
    ones = [s for s in one if s["kind"] == kind]
    manys = [s for s in many if s["kind"] == kind]
    if not ones or not manys:
        return None
    total = sum(s["s"] for s in manys)
    one_ms, many_ms = 1e3 * statistics.median(s["s"] for s in ones), 1e3 * statistics.median(s["s"] for s in manys)
    return {
        "steps": len(manys),
        "one_rank_ms": one_ms,
        "ranks_ms": many_ms,
        "speedup": one_ms / many_ms,
        "all_reduce_share": sum(s["all_reduce"] for s in manys) / total,
        "all_gather_share": sum(s["all_gather"] for s in manys) / total,
    }


def workload_prompts(name: str, args: argparse.Namespace, vocab: int) -> tuple[list[list[int]], int]:
    rng = random.Random(args.seed + 1)
    if name == "throughput":
        return random_prompts(vocab, args.num_prompts, args.input_len, args.seed), args.output_len
    if name == "decode":
        return [[rng.randrange(vocab) for _ in range(128)]], args.decode_len
    if name == "prefill":
        return [[rng.randrange(vocab) for _ in range(args.prefill_len)]], 1
    raise ValueError(f"unknown workload {name!r} for --tensor-parallel-size > 1: choose among {', '.join(WORKLOADS)}")


def format_row(name: str, kind: str, r: dict[str, Any], size: int) -> str:
    return (
        f"{name + ' ' + kind:<19} {r['steps']:>5} {r['one_rank_ms']:>10.1f} {r['ranks_ms']:>10.1f} "
        f"{r['speedup']:>7.2f}x {100 * r['all_reduce_share']:>10.0f}% {100 * r['all_gather_share']:>10.0f}%"
    )


def main(args: argparse.Namespace) -> int:
    size = args.tensor_parallel_size
    workloads = [w for w in args.workloads.split(",") if w != "roofline"]
    for name in workloads:  # refuse a bad name before loading anything
        workload_prompts(name, args, 2)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    dtype_name = str(dtype).removeprefix("torch.")
    model_dir = Path(args.model) if args.model else random_model_dir(args.shape, dtype_name)
    options: dict[str, Any] = dict(
        dtype=dtype,
        device=device,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        enable_prefix_caching=False,  # random prompts share nothing
        enforce_eager=True,  # tensor parallelism runs eagerly; one rank too, for a fair comparison
        show_progress=False,
    )
    results: dict[str, Any] = {"model": str(model_dir), "device": str(device), "dtype": dtype_name, "ranks": size}
    runs: dict[int, dict[str, list[dict[str, Any]]]] = {}
    for ranks in (1, size):
        with LLM(str(model_dir), tensor_parallel_size=ranks, **options) as llm:
            results[f"threads_per_rank_{ranks}"] = torch.get_num_threads()
            vocab = llm.engine.runner.model.config.vocab_size
            runs[ranks] = {}
            for name in workloads:
                prompts, max_tokens = workload_prompts(name, args, vocab)
                timed_steps(llm, [p[:8] for p in prompts[:2]], 2)  # warm-up
                runs[ranks][name] = timed_steps(llm, prompts, max_tokens)
    backend = "gloo" if device.type == "cpu" else "NCCL"
    print(f"tensor parallelism: {model_dir.name} {dtype_name} on {device}, {size} ranks ({backend}) against 1 rank")
    print(
        f"{'step':<19} {'steps':>5} {'1 rank ms':>10} {f'{size} ranks ms':>10} {'speedup':>8} "
        f"{'all-reduce':>11} {'all-gather':>11}"
    )
    for name in workloads:
        for kind in ("prefill", "decode"):
            row = summarise(runs[1][name], runs[size][name], kind)
            if row is not None:
                results[f"{name}_{kind}"] = row
                print(format_row(name, kind, row, size))
    print("(median step times; all-reduce and all-gather: share of rank 0's step inside them, waiting included)")
    if args.json:
        write_results(args.json, results)
    return 0
