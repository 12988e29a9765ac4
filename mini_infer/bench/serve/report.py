"""servebench's printed report (chapter 12).

One run in the layout of vLLM's ``benchmark_serving``; one line per run for a sweep or a
comparison of result files.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def format_run(run: dict[str, Any]) -> str:
    """One run's summary, laid out like vLLM's benchmark_serving."""
    m = run["metrics"]
    rate = run["request_rate"]
    lines = [f"{' Serving Benchmark Result ':=^56}"]

    def row(name: str, value: Any) -> None:
        lines.append(f"{name:<40}{value:>16}")

    row("Request rate (req/s):", rate if isinstance(rate, str) else f"{rate:g}")
    row("Max concurrency:", run["max_concurrency"] or "none")
    row("Successful requests:", m["completed"])
    row("Failed requests:", m["failed"])
    row("Benchmark duration (s):", f"{m['duration_s']:.2f}")
    row("Total input tokens:", m["total_input_tokens"])
    row("Total generated tokens:", m["total_output_tokens"])
    row("Request throughput (req/s):", f"{m['request_throughput']:.2f}")
    if m["request_goodput"] is not None:
        row("Request goodput (req/s):", f"{m['request_goodput']:.2f}")
        row("Requests meeting the SLOs:", f"{m['good_requests']}/{m['completed']}")
    row("Input token throughput (tok/s):", f"{m['input_throughput']:.2f}")
    row("Output token throughput (tok/s):", f"{m['output_throughput']:.2f}")
    row("Total token throughput (tok/s):", f"{m['total_token_throughput']:.2f}")
    row("Mean concurrency (Little's law):", f"{m['mean_concurrency']:.2f}")
    hit = m["prefix_cache_hit_rate"]
    row("Prefix cache hit rate:", "n/a" if hit is None else f"{100 * hit:.1f}% ({m['prefix_cache_source']})")
    source = m["token_count_source"]
    row("Token counts from:", "estimate (chars/4)" if source == "estimate" else source)
    for key, title, short in (
        ("ttft_ms", "Time to First Token", "TTFT"),
        ("tpot_ms", "Time per Output Token (excl. 1st token)", "TPOT"),
        ("itl_ms", "Inter-token Latency", "ITL"),
        ("e2el_ms", "End-to-end Latency", "E2EL"),
    ):
        lines.append(f"{' ' + title + ' ':-^56}")
        for stat, label in (("mean", "Mean"), ("median", "Median"), ("p90", "P90"), ("p99", "P99")):
            row(f"{label} {short} (ms):", _ms(m[key][stat]))
    lines.append("=" * 56)
    if m["errors"]:
        lines.append("first errors:")
        lines.extend(f"  {e}" for e in m["errors"])
    short_outputs = sum(
        1
        for r in run["requests"]
        if r["success"]
        and r["requested_output_len"]
        and r["output_tokens"] is not None
        and r["output_tokens"] < r["requested_output_len"]
    )
    if short_outputs:
        lines.append(f"note: {short_outputs} requests produced fewer tokens than asked (stopped at an end token?)")
    return "\n".join(lines)


SUMMARY_COLUMNS = [
    ("rate", lambda r: str(r["request_rate"]) if isinstance(r["request_rate"], str) else f"{r['request_rate']:g}"),
    ("ok", lambda r: str(r["metrics"]["completed"])),
    ("fail", lambda r: str(r["metrics"]["failed"])),
    ("req/s", lambda r: f"{r['metrics']['request_throughput']:.2f}"),
    ("out tok/s", lambda r: f"{r['metrics']['output_throughput']:.1f}"),
    ("TTFT p50", lambda r: _ms(r["metrics"]["ttft_ms"]["median"])),
    ("TTFT p99", lambda r: _ms(r["metrics"]["ttft_ms"]["p99"])),
    ("TPOT p50", lambda r: _ms(r["metrics"]["tpot_ms"]["median"])),
    ("TPOT p99", lambda r: _ms(r["metrics"]["tpot_ms"]["p99"])),
    ("ITL p50", lambda r: _ms(r["metrics"]["itl_ms"]["median"])),
    ("E2E p50", lambda r: _ms(r["metrics"]["e2el_ms"]["median"])),
    (
        "hit rate",
        lambda r: (
            "n/a"
            if r["metrics"]["prefix_cache_hit_rate"] is None
            else f"{100 * r['metrics']['prefix_cache_hit_rate']:.1f}%"
        ),
    ),
]


def format_summary(rows: Sequence[tuple[str, dict[str, Any]]]) -> str:
    """One line per (label, run): a sweep, or several files side by side. Latencies in ms."""
    header = ["", *(name for name, _ in SUMMARY_COLUMNS)]
    table = [header] + [[label, *(fn(run) for _, fn in SUMMARY_COLUMNS)] for label, run in rows]
    if not any(label for label, _ in rows):
        table = [line[1:] for line in table]  # a sweep: the rate column says which run is which
    widths = [max(len(line[i]) for line in table) for i in range(len(table[0]))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(line, widths)).rstrip() for line in table)
