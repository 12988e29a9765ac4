"""servebench beside SGLang's client: reading both result files and the ratio (chapter 12).

The servebench files are written the way ``servebench --json`` writes them (``RunResult.to_dict``
of hand-made timelines); the SGLang lines carry the keys ``bench_serving.py --output-file`` writes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mini_infer.bench.serve.metrics import RequestRecord, compute_metrics
from mini_infer.bench.serve.peer import format_table, load, main, ratios, server_ttft_ms
from mini_infer.bench.serve.runner import RunResult


def write_servebench(path: Path, scale: float, failed: int = 0) -> None:
    # two requests, TTFT 0.1 s and 0.3 s (times scale), ITL gaps 0.1 s, 4 tokens each, over 1 s (times scale)
    records = [
        RequestRecord(0, 0.0, 1.0 * scale, [0.1 * scale, 0.2 * scale], prompt_tokens=8, output_tokens=2),
        RequestRecord(1, 0.0, 1.0 * scale, [0.3 * scale, 0.4 * scale], prompt_tokens=8, output_tokens=2),
    ]
    records += [RequestRecord(2 + i, 0.0, 0.5, success=False, error="HTTP 500: boom") for i in range(failed)]
    run = RunResult(float("inf"), None, 0, records, compute_metrics(records)).to_dict()
    path.write_text(json.dumps({"servebench_format": 1, "runs": [run]}))


def write_sglang(path: Path, output_throughput: float, completed: int = 2) -> None:
    run = {
        "backend": "vllm",
        "completed": completed,
        "total_input_tokens": 16,
        "output_throughput": output_throughput,
        "request_throughput": output_throughput / 2,
        "mean_ttft_ms": 250.0,
        "median_ttft_ms": 250.0,
        "mean_itl_ms": 100.0,
        "median_itl_ms": 100.0,
    }
    # bench_serving.py appends: an earlier line in the file is an earlier run, not this one
    path.write_text(json.dumps(run | {"output_throughput": 1.0}) + "\n" + json.dumps(run) + "\n")


def test_figures_order_and_ratio(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_servebench(tmp_path / "servebench_1.json", 1.0)  # 4 tokens in 1 s; TTFT mean 200 ms
    write_servebench(tmp_path / "servebench_2.json", 2.0)  # 4 tokens in 2 s; TTFT mean 400 ms
    write_sglang(tmp_path / "sglang_1.jsonl", 4.0)
    write_sglang(tmp_path / "sglang_2.jsonl", 2.0)
    rows = load(tmp_path)
    assert [(client, i) for client, i, _ in rows] == [
        ("servebench", 1),
        ("sglang", 1),
        ("servebench", 2),
        ("sglang", 2),
    ]
    assert rows[0][2]["output tok/s"] == pytest.approx(4.0)
    assert rows[2][2]["mean TTFT ms"] == pytest.approx(400.0)
    assert rows[1][2]["output tok/s"] == pytest.approx(4.0)  # the file's last line, not its first
    r = ratios(rows)
    assert r["input tokens"] == pytest.approx(1.0)  # 2 x 8 prompt tokens on both sides
    assert r["output tok/s"] == pytest.approx(3.0 / 3.0)  # means: (4 + 2) / 2 over (4 + 2) / 2
    assert r["mean TTFT ms"] == pytest.approx(300.0 / 250.0)
    assert r["median ITL ms"] == pytest.approx(150.0 / 100.0)  # ITL 100 ms, then 200 ms
    assert "ratio ours/sgl" in format_table(rows)
    assert main([str(tmp_path)]) == 0
    assert "servebench 2" in capsys.readouterr().out


def test_failed_requests_and_missing_files_are_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_servebench(tmp_path / "servebench_1.json", 1.0)
    with pytest.raises(ValueError, match="sglang_"):
        load(tmp_path)
    write_sglang(tmp_path / "sglang_1.jsonl", 4.0, completed=1)
    with pytest.raises(ValueError, match="completed different numbers"):
        load(tmp_path)
    write_servebench(tmp_path / "servebench_1.json", 1.0, failed=1)
    with pytest.raises(ValueError, match="1 requests failed"):
        load(tmp_path)
    assert main([str(tmp_path)]) == 2
    assert "peer: error" in capsys.readouterr().err
    assert main([]) == 2


def test_server_ttft_from_histogram_snapshots(tmp_path: Path) -> None:
    write_servebench(tmp_path / "servebench_1.json", 1.0)
    write_sglang(tmp_path / "sglang_1.jsonl", 4.0)
    # snapshots after: server start, servebench 1 (3 requests, 0.6 s in all), sglang 1 (3, 0.3 s)
    lines = [
        "start 0 mini_infer:time_to_first_token_seconds_count 0.0",
        "start 0 mini_infer:time_to_first_token_seconds_sum 0.0",
        'servebench 1 mini_infer:time_to_first_token_seconds_count{model_name="tiny"} 3.0',
        'servebench 1 mini_infer:time_to_first_token_seconds_sum{model_name="tiny"} 0.6',
        "sglang 1 mini_infer:time_to_first_token_seconds_count 6.0",
        "sglang 1 mini_infer:time_to_first_token_seconds_sum 0.9",
    ]
    (tmp_path / "server_ttft.txt").write_text("\n".join(lines) + "\n")
    assert server_ttft_ms(tmp_path / "server_ttft.txt") == {
        ("servebench", 1): pytest.approx(200.0),
        ("sglang", 1): pytest.approx(100.0),
    }
    rows = load(tmp_path)
    assert ratios(rows)["server TTFT ms"] == pytest.approx(2.0)
    assert "server TTFT ms" in format_table(rows)
    (tmp_path / "server_ttft.txt").write_text("start 0 oops\n")
    with pytest.raises(ValueError, match="client run metric value"):
        load(tmp_path)
