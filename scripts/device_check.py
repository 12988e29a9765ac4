"""The Python half of scripts/device_check.sh: each step of the device check, and its report.

    python scripts/device_check.py imports LOGS             # every import the check needs, and the machine
    python scripts/device_check.py roofline LOGS            # bandwidth and matmul peak (CUDA events)
    python scripts/device_check.py kernel LOGS              # chapter 05c's Triton kernel: choice, parity, time
    python scripts/device_check.py bench LOGS NAME [ARGS]   # mini-infer bench offline's workloads, one at a time
    python scripts/device_check.py report LOGS OUT          # LOGS -> OUT/device_check.json and .txt

Every step writes its figures to ``LOGS/<step>.json`` as soon as it has them (a bench after each
workload), so a step killed by its time limit keeps what it finished; ``report`` rebuilds the JSON
and the text summary from whatever is in ``LOGS`` and is run after every step.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

IMPORTS = [
    "torch",
    "transformers",
    "safetensors",
    "tokenizers",
    "pydantic",
    "llguidance",
    "fastapi",
    "uvicorn",
    "httpx",
    "prometheus_client",
    "pytest",
    "hypothesis",
    "mini_infer",
    "mini_infer.engine_builder",
    "mini_infer.structured_output",
    "mini_infer.server.app",
    "mini_infer.bench.offline",
    "mini_infer.bench.roofline",
]


def write(path: Path, data: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(path)


def imports(logs: Path) -> int:
    import importlib

    versions: dict[str, str] = {}
    failed: dict[str, str] = {}
    for name in IMPORTS:
        try:
            module = importlib.import_module(name)
            versions[name] = str(getattr(module, "__version__", ""))
        except Exception as error:  # noqa: BLE001  (reported, and the step fails)
            failed[name] = f"{type(error).__name__}: {error}"
    env: dict[str, Any] = {"python": sys.version.split()[0], "versions": versions, "import_errors": failed}
    import torch

    if torch.cuda.is_available():
        from mini_infer.device import cuda_unsupported

        env |= {
            "gpu": torch.cuda.get_device_name(0),
            "capability": list(torch.cuda.get_device_capability(0)),
            "memory_GiB": torch.cuda.get_device_properties(0).total_memory / 2**30,
            "arch_list": torch.cuda.get_arch_list(),
            "unsupported": cuda_unsupported(0),
        }
    write(logs / "imports.json", env)
    print(json.dumps(env, indent=2))
    return 1 if failed else 0


def roofline(logs: Path) -> int:
    import torch

    from mini_infer.bench.roofline import measure_bandwidth, measure_matmul_flops

    device = torch.device("cuda")
    result: dict[str, Any] = {"bandwidth_GB_s": measure_bandwidth(device) / 1e9}
    write(logs / "roofline.json", result)
    for dtype in (torch.bfloat16, torch.float16):
        result[f"peak_TFLOP_s_{str(dtype).removeprefix('torch.')}"] = measure_matmul_flops(device, dtype) / 1e12
        write(logs / "roofline.json", result)
    print(json.dumps(result, indent=2))
    return 0


def _gather_then_sdpa(q: Any, k_pool: Any, v_pool: Any, tables: Any, lens: Any) -> Any:
    """Chapter 05's way, for comparison: every row's blocks gathered, padded, then one SDPA call."""
    import torch
    import torch.nn.functional as F

    kv_heads, rows, head_dim = k_pool.shape[0], tables.shape[0], k_pool.shape[-1]
    keys = k_pool[:, tables].reshape(kv_heads, rows, -1, head_dim)
    values = v_pool[:, tables].reshape(kv_heads, rows, -1, head_dim)
    visible = torch.arange(keys.shape[2], device=q.device)[None, :] < lens[:, None]
    queries = q.view(rows, kv_heads, -1, head_dim).permute(1, 0, 2, 3)
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=visible[None, :, None, :])
    return out.permute(1, 0, 2, 3).reshape(q.shape)


def kernel(logs: Path) -> int:
    """What ``attention_backend="auto"`` chooses on this card and why, and the Triton kernel against
    the gather + SDPA path on one layer's decode attention: 64 sequences of 150-650 tokens at the
    0.5B head layout, in bfloat16 and float16 (max error and median time of 50 calls each, CUDA events)."""
    import torch

    from mini_infer.kv.attention_backend import choose_attention, reference_attention

    device = torch.device("cuda")
    result: dict[str, Any] = {}
    for dtype in (torch.bfloat16, torch.float16):
        name = str(dtype).removeprefix("torch.")
        attend, why = choose_attention("auto", device, dtype, 14, 2, 64)
        result[name] = {"chosen": why}
        write(logs / "kernel.json", result)
        if attend is None:
            continue
        generator = torch.Generator().manual_seed(0)
        lens = torch.randint(150, 651, (64,), generator=generator)
        width = int(-(-lens.max() // 16))
        k_pool, v_pool = (
            torch.randn(2, 64 * width + 1, 16, 64, generator=generator).to(device, dtype) for _ in range(2)
        )
        tables = torch.randperm(64 * width, generator=generator)[: 64 * width].view(64, width).to(device)
        q = torch.randn(64, 14, 64, generator=generator).to(device, dtype)
        lens = lens.to(device)

        args = (q, k_pool, v_pool, tables, lens)
        gathered = functools.partial(_gather_then_sdpa, *args)
        in_place = functools.partial(attend, *args, 1)

        error = (in_place().float() - reference_attention(q, k_pool, v_pool, tables, lens, 1).float()).abs().max()
        times = {}
        for label, function in (("gathered_us", gathered), ("in_place_us", in_place)):
            function()
            samples = []
            for _ in range(50):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                function()
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end) * 1e3)
            times[label] = sorted(samples)[len(samples) // 2]
        result[name] |= {
            "max_error": error.item(),
            **times,
            "gathered_over_in_place": times["gathered_us"] / times["in_place_us"],
        }
        write(logs / "kernel.json", result)
    print(json.dumps(result, indent=2))
    return 0


def bench(logs: Path, name: str, argv: list[str]) -> int:
    """``mini-infer bench offline`` with ``argv``, its workloads run one at a time and written after
    each, with what the decode graphs did (shapes captured, shapes left eager)."""
    from mini_infer.bench.offline import Bench, add_arguments, roofline_summary

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(argv)
    out = logs / f"bench_{name}.json"
    b = Bench(args)
    results = b.results | {"args": argv}
    write(out, results)
    workloads = args.workloads.split(",")
    if "roofline" in workloads or "throughput" in workloads:
        b.read_roofline()
    for workload in workloads:
        if workload == "roofline":
            continue
        results[workload] = {"throughput": b.throughput, "decode": b.decode, "prefill": b.prefill}[workload]()
        graphs = b.llm.engine.runner.static_decode
        if graphs is not None:
            results["decode_graphs"] = {
                "captured": sorted(map(list, graphs.steps)),
                "eager_only": sorted(map(list, graphs.eager_only)),
            }
        results["roofline"] = roofline_summary(b.roofline_readings)
        write(out, results)
        print(workload, json.dumps(results[workload]), flush=True)
    return 0


def junit_counts(path: Path) -> dict[str, Any]:
    """Passed / failed / skipped per test file, and the half-precision parity tests per dtype."""
    per_file: dict[str, dict[str, int]] = {}
    parity: dict[str, dict[str, int]] = {}
    failures = []
    for case in ET.parse(path).getroot().iter("testcase"):
        file = case.get("classname", "").split(".")[1] if "." in case.get("classname", "") else "?"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
                failures.append(f"{case.get('classname')}::{case.get('name')}")
            elif child.tag == "skipped":
                outcome = "skipped"
        per_file.setdefault(file, {"passed": 0, "failed": 0, "skipped": 0})[outcome] += 1
        dtype = re.search(r"(float16|bfloat16)", case.get("name", ""))
        if file in ("test_half_precision", "test_numerics") and dtype:
            parity.setdefault(dtype.group(1), {"passed": 0, "failed": 0, "skipped": 0})[outcome] += 1
    return {"per_file": per_file, "half_precision_parity": parity, "failures": failures}


def report(logs: Path, out: Path) -> int:
    data: dict[str, Any] = {"steps": {}}
    for status in sorted(logs.glob("step_*.json")):
        data["steps"][status.stem.removeprefix("step_")] = json.loads(status.read_text())
    for name in ("imports", "roofline", "kernel"):
        if (logs / f"{name}.json").is_file():
            data[name] = json.loads((logs / f"{name}.json").read_text())
    if (logs / "cuda_tests.xml").is_file():
        try:
            data["cuda_tests"] = junit_counts(logs / "cuda_tests.xml")
        except ET.ParseError as error:
            data["cuda_tests"] = {"error": f"junit file unreadable: {error}"}
    benches = {p.stem.removeprefix("bench_"): json.loads(p.read_text()) for p in sorted(logs.glob("bench_*.json"))}
    data["bench"] = benches
    data["derived"] = derived(benches, data.get("roofline"))
    write(out / "device_check.json", data)
    (out / "device_check.txt").write_text(summary(data))
    return 0


def derived(benches: dict[str, Any], roofline: dict[str, Any] | None) -> dict[str, Any]:
    """Graphs against eager, and batch-1 decode against the HBM roofline (weight bytes / bandwidth)."""
    from mini_infer.bench.roofline import weight_bytes_read
    from mini_infer.config import ModelConfig

    result: dict[str, Any] = {}
    for name, b in benches.items():
        if name.endswith("_eager"):
            graphs = benches.get(name.removesuffix("_eager") + "_graphs", {})
            for workload in ("throughput", "decode"):
                if workload in graphs and workload in b:
                    ratio = graphs[workload]["mini_infer_tok_s"] / b[workload]["mini_infer_tok_s"]
                    result[f"{name.removesuffix('_eager')}_{workload}_graphs_over_eager"] = ratio
        decode = b.get("decode")
        if decode and roofline and Path(b["model"], "config.json").is_file():
            config = ModelConfig.from_model_dir(b["model"])
            itemsize = 4 if b["dtype"] == "float32" else 2
            floor_s = weight_bytes_read(config, itemsize) / (roofline["bandwidth_GB_s"] * 1e9)
            result[f"{name}_batch1_decode_tok_s"] = decode["mini_infer_tok_s"]
            result[f"{name}_batch1_decode_fraction_of_hbm_roofline"] = decode["mini_infer_tok_s"] * floor_s
    return result


def summary(data: dict[str, Any]) -> str:
    lines = []
    env = data.get("imports", {})
    if env:
        lines.append(
            f"{env.get('gpu', 'no GPU')} capability {env.get('capability')} | python {env.get('python')} | "
            f"torch {env['versions'].get('torch')} | transformers {env['versions'].get('transformers')}"
        )
        if env.get("import_errors"):
            lines.append(f"IMPORT ERRORS: {env['import_errors']}")
    for step, status in data["steps"].items():
        lines.append(
            f"step {step}: exit {status['exit']} in {status['seconds']} s{' (TIMED OUT)' if status['timed_out'] else ''}"
        )
    tests = data.get("cuda_tests", {})
    for file, counts in sorted(tests.get("per_file", {}).items()):
        lines.append(f"  {file}: {counts}")
    if tests.get("half_precision_parity"):
        lines.append(f"half-precision parity tests: {tests['half_precision_parity']}")
    for failure in tests.get("failures", [])[:20]:
        lines.append(f"  FAILED {failure}")
    if data.get("roofline"):
        lines.append("roofline: " + ", ".join(f"{k} {v:.1f}" for k, v in data["roofline"].items()))
    for dtype, k in data.get("kernel", {}).items():
        lines.append(f"kernel {dtype}: {k}")
    for name, b in data.get("bench", {}).items():
        for workload in ("throughput", "decode", "prefill"):
            if workload in b:
                r = b[workload]
                hf = f", transformers {r['hf_tok_s']:.0f} tok/s ({r['speedup_vs_hf']:.2f}x)" if "hf_tok_s" in r else ""
                lines.append(f"{name} {workload}: mini-infer {r['mini_infer_tok_s']:.0f} tok/s{hf}")
        if "decode_graphs" in b:
            lines.append(f"{name} graphs: {b['decode_graphs']}")
    for key, value in data.get("derived", {}).items():
        lines.append(f"{key}: {value:.3f}")
    return "\n".join(lines) + "\n"


def main() -> int:
    step, logs = sys.argv[1], Path(sys.argv[2])
    if step == "imports":
        return imports(logs)
    if step == "roofline":
        return roofline(logs)
    if step == "kernel":
        return kernel(logs)
    if step == "bench":
        return bench(logs, sys.argv[3], sys.argv[4:])
    if step == "report":
        return report(logs, Path(sys.argv[3]))
    raise SystemExit(f"unknown step {step!r}: use imports, roofline, kernel, bench or report")


if __name__ == "__main__":
    sys.exit(main())
