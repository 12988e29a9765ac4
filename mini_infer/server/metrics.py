"""Prometheus metrics with vLLM's names under a ``mini_infer:`` prefix (chapter 11).

Two kinds of figure, gathered two ways:

* **Engine state and counters** (requests running and waiting, KV cache usage, prompt and
  generated tokens, preemptions, prefix-cache queries and hits, draft tokens verified and
  accepted) belong to the engine, which only the engine thread may touch. ``/metrics`` asks that thread for an ``EngineSnapshot``
  (``AsyncEngine.call(take_snapshot)``) and a custom collector exposes the snapshot, so
  counters are the engine's own totals rather than a second count kept beside them.
* **Latencies** (time to first token, inter-token latency, end-to-end latency) are measured on
  the event loop as outputs reach the API call that waits for them: what a client sees, minus
  the network. They are ordinary ``Histogram`` objects.

Each app has its own ``CollectorRegistry``, so several servers (tests, notebooks) can live in
one process.

``kv_cache_usage_perc`` is a fraction in [0, 1], as in vLLM: blocks that requests hold, over
all blocks. Blocks that only the prefix cache holds are reusable at once, so they do not count.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from mini_infer.engine import LLMEngine
from mini_infer.kv.radix_cache import RadixCache

PREFIX = "mini_infer:"

# Seconds. Wide enough for a CPU (a step can take a second) and fine enough for a GPU.
_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
_E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0)
# The latency histograms: name (exposed as ``mini_infer:<name>_seconds``) -> (documentation, buckets).
_LATENCIES = {
    "time_to_first_token": ("Time from arrival to the first token.", _TTFT_BUCKETS),
    "inter_token_latency": ("Time between two tokens of one request.", _ITL_BUCKETS),
    "e2e_request_latency": ("Time from arrival to the last token.", _E2E_BUCKETS),
}


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    num_requests_running: int
    num_requests_waiting: int
    kv_blocks_total: int
    kv_blocks_free: int
    kv_blocks_cached: int  # held by the prefix cache (some may also be used by requests)
    kv_blocks_cache_only: int  # held only by the prefix cache: evictable now
    prompt_tokens: int
    generation_tokens: int
    num_preemptions: int
    prefix_cache_queries: int  # prompt tokens looked up
    prefix_cache_hits: int  # prompt tokens found
    spec_decode_num_draft_tokens: int  # speculative decoding (chapter 10): drafts verified
    spec_decode_num_accepted_tokens: int  # ... and kept

    @property
    def kv_cache_usage_perc(self) -> float:
        used = self.kv_blocks_total - self.kv_blocks_free - self.kv_blocks_cache_only
        return used / self.kv_blocks_total if self.kv_blocks_total else 0.0


def take_snapshot(engine: LLMEngine) -> EngineSnapshot:
    """Read the engine's figures; run it on the engine thread (``AsyncEngine.call``)."""
    stats = engine.stats()
    cache = engine.scheduler.blocks.prefix_cache
    cache = cache if isinstance(cache, RadixCache) else None
    return EngineSnapshot(
        num_requests_running=stats["num_running"],
        num_requests_waiting=stats["num_waiting"],
        kv_blocks_total=stats["kv_blocks_total"],
        kv_blocks_free=stats["kv_blocks_free"],
        kv_blocks_cached=cache.num_cached_blocks if cache is not None else 0,
        kv_blocks_cache_only=cache.num_evictable_blocks if cache is not None else 0,
        prompt_tokens=stats["prompt_tokens"],
        generation_tokens=stats["generated_tokens"],
        num_preemptions=stats["num_preemptions"],
        prefix_cache_queries=stats["prefix_cache_query_tokens"],
        prefix_cache_hits=stats["prefix_cache_hit_tokens"],
        spec_decode_num_draft_tokens=stats["num_draft_tokens"],
        spec_decode_num_accepted_tokens=stats["num_accepted_draft_tokens"],
    )


# What ``/metrics`` shows of a snapshot, under ``PREFIX``: each name is the snapshot's field (or
# property) of that name, with its documentation.
_ENGINE_GAUGES = {
    "num_requests_running": "Requests running in the engine (scheduled this step).",
    "num_requests_waiting": "Requests waiting for admission (or preempted).",
    "kv_cache_usage_perc": "Fraction of KV blocks held by requests (0 to 1).",
    "kv_blocks_total": "KV blocks in the pool.",
    "kv_blocks_free": "KV blocks on the free list.",
    "kv_blocks_cached": "KV blocks held by the prefix cache.",
}
_ENGINE_COUNTERS = {
    "prompt_tokens": "Prompt tokens submitted.",
    "generation_tokens": "Tokens generated.",
    "num_preemptions": "Preemptions (a request's blocks freed, to be recomputed).",
    "prefix_cache_queries": "Prompt tokens looked up in the prefix cache.",
    "prefix_cache_hits": "Prompt tokens found in the prefix cache.",
    "spec_decode_num_draft_tokens": "Draft tokens verified (speculative decoding).",
    "spec_decode_num_accepted_tokens": "Draft tokens accepted (speculative decoding).",
}


class _EngineCollector(Collector):
    def __init__(self) -> None:
        self.snapshot: EngineSnapshot | None = None

    def collect(self) -> Iterator[Metric]:
        s = self.snapshot
        if s is None:
            return  # still loading (or dead before it ever answered): nothing to report
        for name, doc in _ENGINE_GAUGES.items():
            yield GaugeMetricFamily(PREFIX + name, doc, value=getattr(s, name))
        for name, doc in _ENGINE_COUNTERS.items():
            yield CounterMetricFamily(PREFIX + name, doc, value=getattr(s, name))  # exposed with a _total suffix


class ServerMetrics:
    """The registry of one app; also the ``RequestObserver`` of its ``AsyncEngine``."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._engine = _EngineCollector()
        self.registry.register(self._engine)
        latencies = {
            name: Histogram(PREFIX + name + "_seconds", documentation, buckets=buckets, registry=self.registry)
            for name, (documentation, buckets) in _LATENCIES.items()
        }
        self.time_to_first_token = latencies["time_to_first_token"]
        self.inter_token_latency = latencies["inter_token_latency"]
        self.e2e_request_latency = latencies["e2e_request_latency"]
        self.request_success = Counter(
            PREFIX + "request_success",
            "Requests finished, by reason (aborted ones are not counted).",
            ["finished_reason"],
            registry=self.registry,
        )
        self.request_failure = Counter(
            PREFIX + "request_failure",
            "Engine requests ended by a fault of their own (finish_reason error: a 500 or an error event).",
            registry=self.registry,
        )

    # RequestObserver
    def first_token(self, seconds: float) -> None:
        self.time_to_first_token.observe(seconds)

    def inter_token(self, seconds: float) -> None:
        self.inter_token_latency.observe(seconds)

    def finished(self, seconds: float, reason: str) -> None:
        if reason == "error":  # not a success, and its latency is not a served request's
            self.request_failure.inc()
            return
        self.e2e_request_latency.observe(seconds)
        self.request_success.labels(finished_reason=reason).inc()

    def render(self, snapshot: EngineSnapshot | None) -> bytes:
        """The text exposition format, engine figures from ``snapshot`` (or the last one)."""
        if snapshot is not None:
            self._engine.snapshot = snapshot
        return generate_latest(self.registry)
