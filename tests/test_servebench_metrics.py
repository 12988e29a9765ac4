"""servebench's metrics on hand-made timelines, against values computed by hand (chapter 12).

Percentiles are numpy's linear interpolation: rank h = (n - 1) p / 100 between sorted values.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mini_infer.bench.serve.metrics import Distribution, RequestRecord, compute_metrics


def timelines() -> list[RequestRecord]:
    return [
        # TTFT 0.1, E2E 0.5, TPOT (0.5 - 0.1) / 4 = 0.1, ITL 0.05, 0.1, 0.15
        RequestRecord(
            0,
            send_time=0.0,
            end_time=0.5,
            chunk_times=[0.1, 0.15, 0.25, 0.4],
            prompt_tokens=10,
            output_tokens=5,
            cached_tokens=5,
        ),
        # failed: counted, excluded from every latency and token total
        RequestRecord(1, send_time=0.2, end_time=0.3, success=False, error="HTTP 500: boom"),
        # TTFT 0.2, E2E 1.5, one token: no TPOT, no ITL; its counts are an estimate
        RequestRecord(
            2,
            send_time=0.5,
            end_time=2.0,
            chunk_times=[0.7],
            prompt_tokens=30,
            output_tokens=1,
            cached_tokens=15,
            token_count_source="estimate",
        ),
        # TTFT 0.3, E2E 0.5, TPOT (0.5 - 0.3) / 1 = 0.2, ITL 0.2
        RequestRecord(3, send_time=1.0, end_time=1.5, chunk_times=[1.3, 1.5], prompt_tokens=20, output_tokens=2),
        RequestRecord(4, send_time=1.1, end_time=1.2, success=False, error="HTTP 500: boom"),
        RequestRecord(5, send_time=1.2, end_time=1.3, success=False, error="ReadTimeout"),
    ]


def test_counts_duration_and_throughput() -> None:
    m = compute_metrics(timelines())
    assert (m.completed, m.failed) == (3, 3)
    assert m.errors == ["HTTP 500: boom", "ReadTimeout"]  # distinct, in order
    assert m.duration_s == pytest.approx(2.0)  # last end 2.0 - first send 0.0
    assert (m.total_input_tokens, m.total_output_tokens) == (60, 8)
    assert m.request_throughput == pytest.approx(1.5)
    assert m.input_throughput == pytest.approx(30.0)
    assert m.output_throughput == pytest.approx(4.0)
    assert m.total_token_throughput == pytest.approx(34.0)
    # Little's law: (0.5 + 1.5 + 0.5) s of requests in flight over 2 s
    assert m.mean_concurrency == pytest.approx(1.25)
    assert m.token_count_source == "estimate"  # the least exact source used


def check(d: Distribution, count: int, mean: float, median: float, p90: float, p99: float) -> None:
    assert d.count == count
    assert (d.mean, d.median, d.p90, d.p99) == pytest.approx((mean, median, p90, p99))


def test_latency_distributions() -> None:
    m = compute_metrics(timelines())
    # TTFT [100, 200, 300] ms: p90 at rank 1.8 -> 200 + 0.8 * 100, p99 at rank 1.98
    check(m.ttft_ms, 3, 200.0, 200.0, 280.0, 298.0)
    # TPOT [100, 200] ms: p90 at rank 0.9
    check(m.tpot_ms, 2, 150.0, 150.0, 190.0, 199.0)
    # ITL [50, 100, 150, 200] ms: median at rank 1.5, p90 at 2.7, p99 at 2.97
    check(m.itl_ms, 4, 125.0, 125.0, 185.0, 198.5)
    # E2E [500, 500, 1500] ms
    check(m.e2el_ms, 3, 2500.0 / 3, 500.0, 1300.0, 1480.0)


def test_goodput() -> None:
    assert compute_metrics(timelines()).good_requests is None
    # ttft <= 250 and tpot <= 150: request 0 passes, 3 fails its TTFT, 2 has no TPOT and passes
    m = compute_metrics(timelines(), goodput_limits_ms={"ttft": 250, "tpot": 150})
    assert m.good_requests == 2
    assert m.request_goodput == pytest.approx(1.0)
    assert compute_metrics(timelines(), goodput_limits_ms={"e2el": 600}).good_requests == 2
    # a request without any text chunk has no TTFT and so fails a TTFT limit
    silent = [RequestRecord(0, send_time=0.0, end_time=1.0, output_tokens=0)]
    assert compute_metrics(silent, goodput_limits_ms={"ttft": 1e9}).good_requests == 0
    with pytest.raises(ValueError, match="unknown goodput"):
        compute_metrics(timelines(), goodput_limits_ms={"latency": 1})


def test_prefix_cache_hit_rate() -> None:
    # from usage: (5 + 15) cached of (10 + 30) prompt tokens over the requests that report it
    m = compute_metrics(timelines(), prefix_cache_counters=(1, 4))
    assert (m.prefix_cache_hit_rate, m.prefix_cache_source) == (pytest.approx(0.5), "usage")
    plain = [r for r in timelines() if r.cached_tokens is None]
    m = compute_metrics(plain, prefix_cache_counters=(30.0, 120.0))
    assert (m.prefix_cache_hit_rate, m.prefix_cache_source) == (pytest.approx(0.25), "metrics")
    m = compute_metrics(plain)
    assert (m.prefix_cache_hit_rate, m.prefix_cache_source) == (None, None)
    assert compute_metrics(plain, prefix_cache_counters=(0.0, 0.0)).prefix_cache_hit_rate is None


def test_empty_and_all_failed_runs() -> None:
    m = compute_metrics([])
    assert (m.completed, m.failed, m.duration_s, m.request_throughput) == (0, 0, 0.0, 0.0)
    assert m.ttft_ms == Distribution(0, None, None, None, None)
    m = compute_metrics([RequestRecord(0, send_time=1.0, end_time=1.0, success=False, error="x")])
    assert (m.completed, m.failed, m.output_throughput) == (0, 1, 0.0)
    assert m.to_dict()["e2el_ms"]["p99"] is None


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(min_value=0.0, max_value=100.0, allow_nan=False), min_size=1, max_size=40))
def test_percentiles_are_linear_interpolation(values: list[float]) -> None:
    d = Distribution.of_seconds(values)
    ms = sorted(v * 1000 for v in values)

    def linear(p: float) -> float:  # the definition, written out
        h = (len(ms) - 1) * p / 100
        lo = math.floor(h)
        hi = min(lo + 1, len(ms) - 1)
        return ms[lo] + (h - lo) * (ms[hi] - ms[lo])

    assert d.median == pytest.approx(linear(50), abs=1e-6)
    assert d.p90 == pytest.approx(linear(90), abs=1e-6)
    assert d.p99 == pytest.approx(linear(99), abs=1e-6)
    assert d.mean == pytest.approx(float(np.mean(ms)), abs=1e-6)
