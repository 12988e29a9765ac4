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

The tracing lives here, not in the engine: ``trace_ranks`` wraps every rank's step and collectives
(through ``TensorParallelRunner.on_every_rank``) so that they count what goes through them, and
``rank_reports`` collects each rank's description of itself and of its last step. Chapter 14 reads
both.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from mini_infer.bench.common import write_results
from mini_infer.device import resolve_device, resolve_dtype, synchronize
from mini_infer.llm import LLM
from mini_infer.model_runner import ForwardBatch, ModelRunner
from mini_infer.offline_models import random_model_dir, random_prompts
from mini_infer.parallel.shards import ShardedQwen2Model
from mini_infer.parallel.workers import TensorParallelRunner
from mini_infer.sampling_params import SamplingParams

WORKLOADS = ("throughput", "decode", "prefill")


@dataclass(slots=True)
class StepTrace:
    """What a rank did: steps, and its last step's tokens, gather rows and collectives."""

    steps: int = 0
    num_tokens: int = 0
    gather_rows: int = 0
    collectives: int = 0
    payload_bytes: int = 0


@dataclass(frozen=True)
class RankReport:
    """One rank, as it describes itself (``rank_reports``)."""

    rank: int
    pid: int
    device: str
    num_heads: int  # query heads it holds
    num_kv_heads: int
    kv_pool_shape: tuple[int, ...]  # its K pool (V is the same): [layers, kv_heads, blocks + 1, block_size, D]
    last_step: StepTrace


class _Counters:
    """A rank's collectives, counted (and, when ``timed``, timed) as they go through its group."""

    def __init__(self) -> None:
        self.collectives = 0
        self.payload_bytes = 0  # what this rank contributes, summed over the collectives
        self.timed = False
        self.seconds = {"all_reduce": 0.0, "all_gather": 0.0}
        self.trace = StepTrace()

    @contextmanager
    def counted(self, kind: str, x: torch.Tensor) -> Iterator[None]:
        """Count one collective; with ``timed``, also its seconds, synchronising the device around
        it (so only for measurements): waiting for the slowest rank included."""
        self.collectives += 1
        self.payload_bytes += (
            x.numel() * x.element_size() * (2 if kind == "all_reduce" and x.dtype == torch.float16 else 1)
        )
        if not self.timed:
            yield
            return
        synchronize(x.device)
        start = time.perf_counter()
        yield
        synchronize(x.device)
        self.seconds[kind] += time.perf_counter() - start


def _counters(runner: ModelRunner) -> _Counters:
    counters = getattr(runner, "_bench_counters", None)
    assert isinstance(counters, _Counters), "trace_ranks(runner) first"
    return counters


def _install(runner: ModelRunner) -> None:
    """On one rank: wrap its group's collectives and its runner's step so that they count."""
    if hasattr(runner, "_bench_counters"):
        return
    model = runner.model
    assert isinstance(model, ShardedQwen2Model)
    counters = _Counters()
    group, execute = model.group, runner.execute

    def wrap(kind: str, collective: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
        def counted(x: torch.Tensor) -> torch.Tensor:
            with counters.counted(kind, x):
                return collective(x)

        return counted

    def traced(batch: ForwardBatch) -> torch.Tensor:
        collectives, payload = counters.collectives, counters.payload_bytes
        logits = execute(batch)
        meta, trace = batch.attention, counters.trace
        trace.steps += 1
        trace.num_tokens = batch.num_tokens
        if meta is not None:  # None: the static decode step served the batch (chapter 05)
            trace.gather_rows = sum(s.pool_rows.numel() for s in meta.prefills if s.pool_rows is not None)
            trace.gather_rows += sum(b.pool_rows.numel() for b in meta.buckets)
        trace.collectives = counters.collectives - collectives
        trace.payload_bytes = counters.payload_bytes - payload
        return logits

    group.all_reduce = wrap("all_reduce", group.all_reduce)  # type: ignore[method-assign,assignment]
    group.all_gather = wrap("all_gather", group.all_gather)  # type: ignore[method-assign,assignment]
    runner.execute = traced  # type: ignore[method-assign]
    runner._bench_counters = counters  # type: ignore[attr-defined]


def _report(runner: ModelRunner) -> RankReport:
    config = runner.model.config  # a shard's: its own heads and KV heads
    counters = getattr(runner, "_bench_counters", None) or _Counters()  # an untraced rank: no steps
    assert isinstance(runner.model, ShardedQwen2Model)
    return RankReport(
        runner.model.group.rank,
        os.getpid(),
        str(runner.device),
        config.num_attention_heads,
        config.num_key_value_heads,
        tuple(runner.kv_cache.k.shape),
        replace(counters.trace),
    )


def trace_ranks(runner: TensorParallelRunner) -> None:
    """From now on every rank counts its steps and collectives (``rank_reports`` reads them)."""
    runner.on_every_rank(_install)


def rank_reports(runner: TensorParallelRunner) -> list[RankReport]:
    """Every rank's description of itself and of its last step traced since ``trace_ranks`` (an
    empty ``StepTrace`` before), rank 0 first."""
    return runner.on_every_rank(_report)


def timed_steps(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[dict[str, Any]]:
    """Run ``prompts`` to the end, one ``engine.step()`` at a time: per step its kind (decode when
    every new token samples; a step with any prompt token is a prefill step), its seconds and, on
    N ranks, rank 0's seconds in each collective."""
    engine = llm.engine
    runner = engine.runner
    group = None
    if isinstance(runner, TensorParallelRunner):
        trace_ranks(runner)
        group = _counters(runner)  # rank 0's: its seconds in each collective
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
