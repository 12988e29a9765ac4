"""Figures for the serving benchmark (chapter 12), drawn from the ``--json`` result layout.

* ``plot_run``: one run's latency distributions, as CDFs of TTFT, TPOT, ITL and E2E with the
  median and p99 marked. A CDF shows the tail that a mean hides: the p99 is where the curve
  reaches 0.99.
* ``plot_sweep``: a sweep's throughput and latency against the offered request rate. The
  classic serving curve: throughput grows with the rate until the server saturates, and from
  there on only the latencies (first TTFT, through queueing) keep growing.
* ``plot_compare``: several result files side by side (one line per file, or grouped bars
  when every file holds a single run).

Figures are built with ``matplotlib.figure.Figure`` rather than pyplot, so no GUI backend and
no global state are involved and plots can be drawn from any thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from mini_infer.bench.serve.metrics import RequestRecord

LATENCIES = [("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E latency")]


def records_of(run: dict[str, Any]) -> list[RequestRecord]:
    return [RequestRecord(**row) for row in run["requests"]]


def latencies_ms(records: Sequence[RequestRecord]) -> dict[str, list[float]]:
    ok = [r for r in records if r.success]
    return {
        "ttft": [t * 1000 for r in ok if (t := r.ttft) is not None],
        "tpot": [t * 1000 for r in ok if (t := r.tpot) is not None],
        "itl": [gap * 1000 for r in ok for gap in r.itls],
        "e2el": [r.e2el * 1000 for r in ok],
    }


def rate_label(run: dict[str, Any]) -> str:
    rate = run["request_rate"]
    label = rate if isinstance(rate, str) else f"{rate:g}"
    if run.get("max_concurrency"):
        label += f" (c={run['max_concurrency']})"
    return label


def rate_value(run: dict[str, Any]) -> float:
    return float(run["request_rate"])  # float("inf") reads the "inf" that JSON stores


def _label_order(label: str, runs: Sequence[dict[str, Any]]) -> tuple[float, int]:
    run = next(r for r in runs if rate_label(r) == label)
    return rate_value(run), run.get("max_concurrency") or 0


def _cdf(ax: Axes, values: Sequence[float], label: str | None = None) -> None:
    if not values:
        ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", va="center")
        return
    xs = np.sort(np.asarray(values))
    ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), drawstyle="steps-post", label=label)


def plot_run(run: dict[str, Any], path: str | Path, title: str = "") -> None:
    """CDFs of TTFT, TPOT, ITL and E2E for one run."""
    values = latencies_ms(records_of(run))
    fig = Figure(figsize=(10, 7), layout="constrained")
    axes = fig.subplots(2, 2)
    for ax, (key, name) in zip(axes.flat, LATENCIES):
        _cdf(ax, values[key])
        if values[key]:
            p50, p99 = np.percentile(values[key], [50, 99])
            ax.axvline(p50, color="tab:green", linestyle="--", label=f"p50 {p50:.1f} ms")
            ax.axvline(p99, color="tab:red", linestyle="--", label=f"p99 {p99:.1f} ms")
            ax.legend(loc="lower right")
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of requests" if key != "itl" else "fraction of gaps")
        ax.grid(alpha=0.3)
    metrics = run["metrics"]
    fig.suptitle(
        f"{title + ': ' if title else ''}request rate {rate_label(run)}, {metrics['completed']} requests, "
        f"{metrics['output_throughput']:.1f} output tok/s"
    )
    fig.savefig(path, dpi=120)


def _metric(run: dict[str, Any], key: str, stat: str | None = None) -> float:
    value = run["metrics"][key] if stat is None else run["metrics"][key][stat]
    return float("nan") if value is None else float(value)


def _sweep_axes(fig: Figure) -> Any:
    axes = fig.subplots(1, 3)
    titles = ["throughput", "time to first token", "time per output token"]
    ylabels = ["output tokens/s", "TTFT (ms)", "TPOT (ms)"]
    for ax, t, y in zip(axes, titles, ylabels):
        ax.set_title(t)
        ax.set_ylabel(y)
        ax.set_xlabel("request rate (req/s)")
        ax.grid(alpha=0.3)
    return axes


def _draw_sweep(
    axes: Any, runs: Sequence[dict[str, Any]], positions: Sequence[int], label: str = "", color: str = "C0"
) -> None:
    # One color per result file; the median solid and the p99 dashed.
    prefix = f"{label} " if label else ""
    axes[0].plot(
        positions, [_metric(r, "output_throughput") for r in runs], marker="o", color=color, label=label or None
    )
    for stat, style in (("median", "-"), ("p99", "--")):
        for ax, key in ((axes[1], "ttft_ms"), (axes[2], "tpot_ms")):
            values = [_metric(r, key, stat) for r in runs]
            ax.plot(positions, values, style, marker="o", color=color, label=f"{prefix}{stat}")


def _categorical_rates(axes: Any, labels: Sequence[str]) -> None:
    # The rates are drawn evenly spaced with their own labels: a sweep is usually geometric
    # (1, 2, 4, ...) and ends with "inf", which no numeric axis can place.
    for ax in axes:
        ax.set_xticks(range(len(labels)), list(labels))
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")


def plot_sweep(runs: Sequence[dict[str, Any]], path: str | Path, title: str = "") -> None:
    """Throughput, TTFT (p50, p99) and TPOT (p50, p99) against the request rate."""
    fig = Figure(figsize=(15, 4.5), layout="constrained")
    axes = _sweep_axes(fig)
    _draw_sweep(axes, runs, range(len(runs)))
    _categorical_rates(axes, [rate_label(r) for r in runs])
    fig.suptitle(title or "servebench sweep")
    fig.savefig(path, dpi=120)


def plot_compare(results: Sequence[tuple[str, dict[str, Any]]], path: str | Path) -> None:
    """Several result files side by side: lines against the rate, or bars for single runs."""
    fig = Figure(figsize=(15, 4.5), layout="constrained")
    if all(len(result["runs"]) == 1 for _, result in results):
        axes = fig.subplots(1, 3)
        names = [name for name, _ in results]
        runs = [result["runs"][0] for _, result in results]
        x = np.arange(len(runs))
        axes[0].bar(x, [_metric(r, "output_throughput") for r in runs])
        axes[0].set_ylabel("output tokens/s")
        axes[0].set_title("throughput")
        for ax, key, name in ((axes[1], "ttft_ms", "TTFT"), (axes[2], "tpot_ms", "TPOT")):
            ax.bar(x - 0.2, [_metric(r, key, "median") for r in runs], width=0.4, label="p50")
            ax.bar(x + 0.2, [_metric(r, key, "p99") for r in runs], width=0.4, label="p99")
            ax.set_ylabel(f"{name} (ms)")
            ax.set_title(name)
            ax.legend(fontsize="small")
        for ax in axes:
            ax.set_xticks(x, [f"{n}\n@ {rate_label(r)}" for n, r in zip(names, runs)], fontsize="small")
            ax.grid(alpha=0.3, axis="y")
    else:
        axes = _sweep_axes(fig)
        every_run = [run for _, result in results for run in result["runs"]]
        labels = sorted({rate_label(r) for r in every_run}, key=lambda label: _label_order(label, every_run))
        for i, (name, result) in enumerate(results):
            runs = result["runs"]
            _draw_sweep(axes, runs, [labels.index(rate_label(r)) for r in runs], name, color=f"C{i % 10}")
        _categorical_rates(axes, labels)
    fig.suptitle("servebench: " + " vs ".join(name for name, _ in results))
    fig.savefig(path, dpi=120)
