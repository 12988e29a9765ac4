"""Serving metrics from recorded per-request timelines (chapter 12).

Every number servebench prints comes from ``compute_metrics``, one pure function over the
``RequestRecord`` timelines the client wrote down: when a request was sent, when each chunk
of generated text arrived, when the stream ended, and how many tokens went in and came out.
Nothing is timed here, so the definitions can be checked on hand-made timelines.

Definitions (latencies over successful requests only; all times in the same clock):

* **TTFT** (time to first token) = time of the first chunk that carries generated text
  - send time. It contains queueing in the server, prefill, and the first decode step.
* **TPOT** (time per output token, excluding the first) = (E2E - TTFT) / (output tokens - 1),
  one value per request with at least two output tokens. It is the steady decode pace a
  user sees once text starts to flow.
* **ITL** (inter-token latency) = the gaps between successive text chunks of a request,
  pooled over all requests. A server that sends several tokens per chunk has an ITL larger
  than its TPOT, and chunks that reach the client in the same network read have gap 0.
* **E2E** (end-to-end latency) = end of the stream - send time.
* **Goodput** = successful requests per second that meet every given limit (TTFT, TPOT,
  E2E, in milliseconds). A request with a single output token has no TPOT and passes a TPOT
  limit; one without any text chunk has no TTFT and fails a TTFT limit.
* **Duration** = last end - first send; throughputs divide totals over successful requests
  by it.
* **Mean concurrency** = request throughput x mean E2E: Little's law (L = lambda W), the
  average number of requests inside the server. When it sits at ``--max-concurrency`` the
  client, not the arrival rate, is setting the load.
* **Percentiles** are numpy's default (``method="linear"``, Hyndman-Fan type 7): for n sorted
  values and percentile p, the rank h = (n - 1) p / 100 is interpolated linearly between the
  values at floor(h) and ceil(h). The median is p50.
* **Prefix-cache hit rate** = cached prompt tokens / prompt tokens, from
  ``usage.prompt_tokens_details.cached_tokens`` over the requests that report it, else the
  change in the server's own hit and query counters (``GET /metrics``) across the run.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

# Names accepted by --goodput, and the field of a request each one limits.
GOODPUT_KEYS = ("ttft", "tpot", "e2el")

# Where token counts came from, best first; the summary reports the worst one used.
TOKEN_SOURCES = ("usage", "tokenizer", "estimate")


@dataclass(slots=True)
class RequestRecord:
    """One request's timeline, as the client recorded it (seconds on one monotonic clock)."""

    index: int
    send_time: float
    end_time: float
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk with generated text
    success: bool = True
    error: str = ""
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, when reported
    token_count_source: str = "usage"  # one of TOKEN_SOURCES
    requested_output_len: int | None = None

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.send_time if self.chunk_times else None

    @property
    def e2el(self) -> float:
        return self.end_time - self.send_time

    @property
    def tpot(self) -> float | None:
        ttft = self.ttft
        if ttft is None or self.output_tokens is None or self.output_tokens < 2:
            return None
        return (self.e2el - ttft) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]


@dataclass(slots=True)
class Distribution:
    """Mean, median, p90 and p99 of a list of latencies, in milliseconds."""

    count: int
    mean: float | None
    median: float | None
    p90: float | None
    p99: float | None

    @staticmethod
    def of_seconds(values: Sequence[float]) -> Distribution:
        if not values:
            return Distribution(0, None, None, None, None)
        ms = np.asarray(values, dtype=np.float64) * 1000.0
        p50, p90, p99 = np.percentile(ms, [50, 90, 99])  # numpy's default: linear interpolation
        return Distribution(len(ms), float(ms.mean()), float(p50), float(p90), float(p99))


@dataclass(slots=True)
class Metrics:
    completed: int
    failed: int
    errors: list[str]  # the first few distinct error messages
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # requests/s
    input_throughput: float  # tokens/s
    output_throughput: float  # tokens/s
    total_token_throughput: float  # tokens/s
    mean_concurrency: float  # Little's law: request_throughput * mean E2E
    ttft_ms: Distribution
    tpot_ms: Distribution
    itl_ms: Distribution
    e2el_ms: Distribution
    token_count_source: str  # the least exact source used: "usage", "tokenizer" or "estimate"
    goodput_limits_ms: dict[str, float]
    good_requests: int | None  # None without --goodput
    request_goodput: float | None  # good requests/s
    prefix_cache_hit_rate: float | None
    prefix_cache_source: str | None  # "usage", "metrics" or None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _meets(record: RequestRecord, limits_ms: Mapping[str, float]) -> bool:
    values = {"ttft": record.ttft, "tpot": record.tpot, "e2el": record.e2el}
    for key, limit in limits_ms.items():
        value = values[key]
        if value is None:
            if key == "tpot":
                continue  # a single output token has no TPOT to violate
            return False
        if value * 1000.0 > limit:
            return False
    return True


def compute_metrics(
    records: Sequence[RequestRecord],
    *,
    goodput_limits_ms: Mapping[str, float] | None = None,
    prefix_cache_counters: tuple[float, float] | None = None,
    max_errors: int = 5,
) -> Metrics:
    """Every metric of one run from its request timelines (definitions in the module docstring).

    ``prefix_cache_counters`` is (hits, queries) read from the server's ``/metrics`` as the
    change across the run; it is used only when no request reported ``cached_tokens``.
    """
    limits = dict(goodput_limits_ms or {})
    unknown = set(limits) - set(GOODPUT_KEYS)
    if unknown:
        raise ValueError(f"unknown goodput limits {sorted(unknown)}; use {', '.join(GOODPUT_KEYS)}")
    ok = [r for r in records if r.success]
    failed = [r for r in records if not r.success]
    errors: list[str] = []
    for r in failed:
        if r.error not in errors and len(errors) < max_errors:
            errors.append(r.error)

    # A run with nothing in it, or one where everything failed at once, still has a duration
    # of zero rather than a negative one; rates are then reported as 0.
    duration = max(r.end_time for r in records) - min(r.send_time for r in records) if records else 0.0
    per_s = 1.0 / duration if duration > 0 else 0.0
    input_tokens = sum(r.prompt_tokens or 0 for r in ok)
    output_tokens = sum(r.output_tokens or 0 for r in ok)

    ttfts = [t for r in ok if (t := r.ttft) is not None]
    tpots = [t for r in ok if (t := r.tpot) is not None]
    itls = [gap for r in ok for gap in r.itls]
    e2els = [r.e2el for r in ok]

    sources = {r.token_count_source for r in ok}
    source = max(sources, key=TOKEN_SOURCES.index) if sources else "usage"

    good = sum(_meets(r, limits) for r in ok) if limits else None

    reporting = [r for r in ok if r.cached_tokens is not None and r.prompt_tokens]
    hit_rate: float | None = None
    hit_source: str | None = None
    if reporting:
        hit_rate = sum(r.cached_tokens or 0 for r in reporting) / sum(r.prompt_tokens or 0 for r in reporting)
        hit_source = "usage"
    elif prefix_cache_counters is not None and prefix_cache_counters[1] > 0:
        hit_rate = prefix_cache_counters[0] / prefix_cache_counters[1]
        hit_source = "metrics"

    return Metrics(
        completed=len(ok),
        failed=len(failed),
        errors=errors,
        duration_s=duration,
        total_input_tokens=input_tokens,
        total_output_tokens=output_tokens,
        request_throughput=len(ok) * per_s,
        input_throughput=input_tokens * per_s,
        output_throughput=output_tokens * per_s,
        total_token_throughput=(input_tokens + output_tokens) * per_s,
        mean_concurrency=sum(e2els) * per_s,
        ttft_ms=Distribution.of_seconds(ttfts),
        tpot_ms=Distribution.of_seconds(tpots),
        itl_ms=Distribution.of_seconds(itls),
        e2el_ms=Distribution.of_seconds(e2els),
        token_count_source=source,
        goodput_limits_ms=limits,
        good_requests=good,
        request_goodput=None if good is None else good * per_s,
        prefix_cache_hit_rate=hit_rate,
        prefix_cache_source=hit_source,
    )
