"""servebench beside SGLang's benchmark client, on the same server and workload (chapter 12).

``scripts/compare_servebench.sh`` runs both clients alternately and leaves, in one folder,
``servebench_<i>.json`` (servebench's ``--json``) and ``sglang_<i>.jsonl`` (``bench_serving.py
--output-file``: one JSON object per run). ``python -m mini_infer.bench.serve.peer DIR`` prints one
line per run, in the order they ran, and the ratio servebench / SGLang of the means over the runs.

The two clients define the compared figures the same way (SGLang's ``calculate_metrics``, from
vLLM's ``benchmark_serving``; ours in ``metrics.py``): TTFT is the first chunk carrying text minus
the send time; ITL the gaps between successive text chunks, pooled over requests; throughputs
divide totals over successful requests by the run's duration.

``server_ttft.txt`` (when the script left one) holds the server's own TTFT histogram (``sum`` and
``count`` of ``mini_infer:time_to_first_token_seconds`` on ``/metrics``) after each run: the
difference between two snapshots is the mean TTFT the server measured for that run, from each
request's arrival in the server (its warm-up request included). It shows on which side of the
server a gap between the clients' TTFT lies.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path

# (label, servebench's key path in a run's metrics, SGLang's key)
FIGURES = (
    ("input tokens", ("total_input_tokens",), "total_input_tokens"),  # the same workload: equal
    ("output tok/s", ("output_throughput",), "output_throughput"),
    ("req/s", ("request_throughput",), "request_throughput"),
    ("mean TTFT ms", ("ttft_ms", "mean"), "mean_ttft_ms"),
    ("median TTFT ms", ("ttft_ms", "median"), "median_ttft_ms"),
    ("mean ITL ms", ("itl_ms", "mean"), "mean_itl_ms"),
    ("median ITL ms", ("itl_ms", "median"), "median_itl_ms"),
)


SERVER_TTFT = "server TTFT ms"


def _index(path: Path) -> int:
    match = re.search(r"_(\d+)\.jsonl?$", path.name)
    if match is None:
        raise ValueError(f"{path.name}: expected a name ending in _<run number>.json or .jsonl")
    return int(match.group(1))


def servebench_figures(path: Path) -> dict[str, float]:
    """The compared figures of the (single) run in a servebench result file."""
    data = json.loads(path.read_text())
    runs = data.get("runs") if isinstance(data, dict) else None
    if not runs or len(runs) != 1:
        raise ValueError(f"{path}: expected a servebench result file with one run")
    metrics = runs[0]["metrics"]
    if metrics["failed"]:
        raise ValueError(f"{path}: {metrics['failed']} requests failed, e.g. {metrics['errors'][:1]}")
    figures = {"completed": float(metrics["completed"])}
    for label, keys, _ in FIGURES:
        value = metrics
        for key in keys:
            value = value[key]
        figures[label] = float(value)
    return figures


def sglang_figures(path: Path) -> dict[str, float]:
    """The compared figures of the last run in a bench_serving.py ``--output-file`` (JSON lines)."""
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    if not lines:
        raise ValueError(f"{path}: empty; bench_serving.py writes one JSON line per run")
    run = json.loads(lines[-1])
    # It records no failures, only how many completed: ``load`` checks that against servebench.
    return {"completed": float(run["completed"])} | {label: float(run[key]) for label, _, key in FIGURES}


def server_ttft_ms(path: Path) -> dict[tuple[str, int], float]:
    """(client, run) -> the server's mean TTFT over that run, from consecutive histogram snapshots."""
    snapshots: dict[tuple[str, int], dict[str, float]] = {}
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) != 4:
            raise ValueError(f"{path}: expected 'client run metric value', got {line!r}")
        client, run, metric, value = parts
        field = metric.split("{")[0].rsplit("_", 1)[1]  # sum or count
        snapshots.setdefault((client, int(run)), {})[field] = float(value)
    out = {}
    order = list(snapshots)  # in the order the script took them: start, then each run
    for before, after in zip(order, order[1:]):
        count = snapshots[after]["count"] - snapshots[before]["count"]
        if count > 0:
            out[after] = 1000.0 * (snapshots[after]["sum"] - snapshots[before]["sum"]) / count
    return out


def load(folder: Path) -> list[tuple[str, int, dict[str, float]]]:
    """Every run in ``folder`` as (client, run number, figures), servebench before SGLang in a pair."""
    rows = [("servebench", _index(p), servebench_figures(p)) for p in folder.glob("servebench_*.json")]
    rows += [("sglang", _index(p), sglang_figures(p)) for p in folder.glob("sglang_*.jsonl")]
    if not any(r[0] == "servebench" for r in rows) or not any(r[0] == "sglang" for r in rows):
        raise ValueError(f"{folder}: needs servebench_<i>.json and sglang_<i>.jsonl files (see compare_servebench.sh)")
    if (folder / "server_ttft.txt").exists():
        server = server_ttft_ms(folder / "server_ttft.txt")
        for client, index, figures in rows:
            if (client, index) in server:
                figures[SERVER_TTFT] = server[(client, index)]
    completed = {r[2]["completed"] for r in rows}
    if len(completed) != 1:
        raise ValueError(f"{folder}: the runs completed different numbers of requests {sorted(completed)}: some failed")
    return sorted(rows, key=lambda r: (r[1], r[0] != "servebench"))


def labels_of(rows: Sequence[tuple[str, int, dict[str, float]]]) -> list[str]:
    labels = [label for label, _, _ in FIGURES]
    return labels + [SERVER_TTFT] if all(SERVER_TTFT in r[2] for r in rows) else labels


def ratios(rows: Sequence[tuple[str, int, dict[str, float]]]) -> dict[str, float]:
    """servebench / SGLang of each figure's mean over the runs."""
    out = {}
    for label in labels_of(rows):
        ours = [r[2][label] for r in rows if r[0] == "servebench"]
        theirs = [r[2][label] for r in rows if r[0] == "sglang"]
        out[label] = (sum(ours) / len(ours)) / (sum(theirs) / len(theirs))
    return out


def format_table(rows: Sequence[tuple[str, int, dict[str, float]]]) -> str:
    labels = labels_of(rows)
    lines = [f"{'run':<16}" + "".join(f"{label:>16}" for label in labels)]
    for client, index, figures in rows:
        lines.append(f"{client + ' ' + str(index):<16}" + "".join(f"{figures[label]:>16.2f}" for label in labels))
    for client in ("servebench", "sglang"):
        mine = [r[2] for r in rows if r[0] == client]
        means = {label: sum(f[label] for f in mine) / len(mine) for label in labels}
        lines.append(f"{client + ' mean':<16}" + "".join(f"{means[label]:>16.2f}" for label in labels))
    ratio = ratios(rows)
    lines.append(f"{'ratio ours/sgl':<16}" + "".join(f"{ratio[label]:>16.3f}" for label in labels))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m mini_infer.bench.serve.peer DIR (written by scripts/compare_servebench.sh)")
        return 2
    try:
        print(format_table(load(Path(args[0]))))
    except (OSError, ValueError, KeyError) as e:
        print(f"peer: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
