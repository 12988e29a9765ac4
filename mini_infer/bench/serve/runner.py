"""Load generation for the serving benchmark (chapter 12): arrivals, a concurrency cap, sweeps.

A run sends its prompts at the times of a Poisson process of mean rate lambda (``--request-rate``):
the gaps between successive requests are independent and exponential with mean 1/lambda, the
model of many users who do not coordinate. ``inf`` sends them all at once, the offline limit.
``--max-concurrency`` caps the requests in flight on top of that: a request whose time has
come waits in the client for a free slot, and its send time (from which TTFT and E2E count) is
when it leaves the client. So with a cap the latencies measure the server, not the queue in
front of it, and Little's law (mean concurrency = throughput x mean latency) tells whether
the cap or the rate was the binding constraint.

Before measuring, ``--warmup-requests`` requests (from a differently seeded copy of the
dataset, so they do not put the measured prompts into the prefix cache) open connections and
let the server compile or allocate whatever it does lazily. A sweep (``--request-rate
1,2,4,inf``) runs the rates in order with a fresh dataset seed each (seed + i), for the same
reason: the second rate must not find the first rate's prompts in the cache.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import httpx
from tqdm import tqdm

from mini_infer.bench.serve.client import ClientConfig, read_prefix_cache_counters, send_request
from mini_infer.bench.serve.datasets import BenchRequest
from mini_infer.bench.serve.metrics import Metrics, RequestRecord, compute_metrics

# The warm-up prompts come from the dataset built with this seed offset: far from the seeds
# of the measured runs (seed + 0, 1, 2, ...), so they never coincide.
WARMUP_SEED_OFFSET = 1_000_003


class BenchmarkError(RuntimeError):
    """The benchmark cannot go on (for example: the server fails every warm-up request)."""


def poisson_arrival_times(num_requests: int, rate: float, seed: int) -> list[float]:
    """Send times (seconds from the start) of a Poisson process with mean ``rate`` per second.

    The first request goes at 0, as in vLLM's benchmark, so that a run does not begin idle;
    every later gap is exponential with mean 1 / rate. ``rate = inf`` sends everything at 0.
    """
    if not rate > 0:
        raise ValueError(f"the request rate must be positive, got {rate}")
    if math.isinf(rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    times, t = [], 0.0
    for i in range(num_requests):
        if i > 0:
            t += rng.expovariate(rate)
        times.append(t)
    return times


def format_rate(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


@dataclass(slots=True)
class RunResult:
    """One measured run: its load, its requests' timelines and the metrics computed from them."""

    request_rate: float
    max_concurrency: int | None
    dataset_seed: int
    records: list[RequestRecord]
    metrics: Metrics

    def to_dict(self) -> dict[str, Any]:
        # Times are written relative to the run's first send, so that files from different runs
        # line up and the absolute values of perf_counter (meaningless elsewhere) never appear.
        start = min((r.send_time for r in self.records), default=0.0)
        requests = []
        for record in self.records:
            row = asdict(record)
            row["send_time"] = record.send_time - start
            row["end_time"] = record.end_time - start
            row["chunk_times"] = [t - start for t in record.chunk_times]
            requests.append(row)
        return {
            # JSON has no infinity: the rate "inf" is written as a string.
            "request_rate": format_rate(self.request_rate) if math.isinf(self.request_rate) else self.request_rate,
            "max_concurrency": self.max_concurrency,
            "dataset_seed": self.dataset_seed,
            "num_prompts": len(self.records),
            "metrics": self.metrics.to_dict(),
            "requests": requests,
        }


def http_client(max_concurrency: int | None, timeout_s: float) -> httpx.AsyncClient:
    # The streams go over aiohttp, a session each (client.send_request), which takes only the
    # timeouts from this client; it carries GET /v1/models and /metrics itself. httpx caps a
    # client at 100 connections by default, a hidden queue for anything sent through it per
    # request; allow one connection per slot.
    limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 30.0)))


async def send_all(
    client: httpx.AsyncClient,
    config: ClientConfig,
    requests: Sequence[BenchRequest],
    arrival_times: Sequence[float],
    max_concurrency: int | None,
    count_tokens: Callable[[str], int] | None = None,
    progress: tqdm | None = None,
) -> list[RequestRecord]:
    """Send ``requests[i]`` at ``arrival_times[i]`` (seconds from now), at most ``max_concurrency`` at once."""
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    start = time.perf_counter()

    async def one(index: int, request: BenchRequest, at: float) -> RequestRecord:
        # Sleep to an absolute time rather than by successive gaps, so that lateness in one
        # wake-up does not push every later arrival back.
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        if slots is None:
            record = await send_request(client, config, request, index, count_tokens)
        else:
            async with slots:
                record = await send_request(client, config, request, index, count_tokens)
        if progress is not None:
            progress.update(1)
        return record

    return list(await asyncio.gather(*(one(i, r, t) for i, (r, t) in enumerate(zip(requests, arrival_times)))))


async def run_sweep(
    client: httpx.AsyncClient,
    config: ClientConfig,
    make_dataset: Callable[[int], list[BenchRequest]],
    request_rates: Sequence[float],
    *,
    max_concurrency: int | None,
    seed: int,
    warmup_requests: int = 0,
    goodput_limits_ms: dict[str, float] | None = None,
    count_tokens: Callable[[str], int] | None = None,
    show_progress: bool = True,
    on_result: Callable[[RunResult], None] | None = None,
) -> list[RunResult]:
    """Warm up once, then run each request rate on its own freshly seeded dataset."""
    if warmup_requests > 0:
        warmup = make_dataset(seed + WARMUP_SEED_OFFSET)
        chosen = [warmup[i % len(warmup)] for i in range(warmup_requests)]
        records = await send_all(client, config, chosen, [0.0] * len(chosen), max_concurrency, count_tokens)
        failed = [r for r in records if not r.success]
        if len(failed) == len(records):
            # A server that fails every warm-up request will fail the run too; say why now.
            raise BenchmarkError(f"every warm-up request failed, the first with: {failed[0].error}")
    results = []
    for i, rate in enumerate(request_rates):
        dataset_seed = seed + i
        requests = make_dataset(dataset_seed)
        arrivals = poisson_arrival_times(len(requests), rate, dataset_seed)
        before = await read_prefix_cache_counters(client, config.base_url)
        desc = f"rate {format_rate(rate)}"
        with tqdm(total=len(requests), desc=desc, unit="req", disable=not show_progress, leave=False) as bar:
            records = await send_all(client, config, requests, arrivals, max_concurrency, count_tokens, bar)
        after = await read_prefix_cache_counters(client, config.base_url)
        counters = None
        if before is not None and after is not None:
            counters = (after[0] - before[0], after[1] - before[1])
        metrics = compute_metrics(records, goodput_limits_ms=goodput_limits_ms, prefix_cache_counters=counters)
        result = RunResult(rate, max_concurrency, dataset_seed, records, metrics)
        if on_result is not None:
            on_result(result)
        results.append(result)
    return results
