"""``mini-infer bench offline``: the engine against Hugging Face and the roofline (chapter 12; read in chapter 06).

Workloads, on a random-weight model at a real Qwen2.5 shape (speed
does not depend on the weights' values), every figure beside its baseline from the same run:

* **throughput**: N prompts with input lengths uniform in [lo, hi], a fixed number of output
  tokens each (ignore_eos, greedy). Baseline: ``transformers`` ``generate`` on the same prompts
  in batches of 16 with left padding. Also: the run's roofline floor, the sum over the engine's
  actual steps of max(weight bytes / bandwidth, FLOPs / peak), with the bandwidth and the peak
  read before the timed runs and after each of them (the median is used, the spread printed:
  this shared machine drifts 2x within minutes).
* **decode**: one prompt of 128 tokens, 128 output tokens; baseline ``generate`` on it.
* **prefill**: one prompt of 2,048 tokens; baseline one Hugging Face forward on the same ids.

Each timing is the median of ``--repeats`` runs after a warm-up.

With ``--tensor-parallel-size`` N > 1 the workloads compare N ranks with one instead, step by
step, with the all-reduce's share of a step: that comparison is chapter 14's, and this chapter
reaches it by module name (``TENSOR_PARALLEL_BENCH``) only when asked, as the engine builder does.
"""

from __future__ import annotations

import argparse
import importlib
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from mini_infer.bench.common import (
    add_tensor_parallel_argument,
    tensor_parallel_size,
    write_results,
)
from mini_infer.bench.roofline import Roofline, measure, median_roofline
from mini_infer.device import resolve_device, resolve_dtype, synchronize
from mini_infer.kv.attention_backend import ATTENTION_BACKENDS
from mini_infer.llm import LLM
from mini_infer.offline_models import add_random_prompt_arguments, random_model_dir, random_prompts
from mini_infer.sampling_params import SamplingParams

TENSOR_PARALLEL_BENCH = "mini_infer.parallel.bench"


def _median_time(
    fn: Callable[[], Any], repeats: int, sync: Callable[[], None], after_each: Callable[[], Any] | None = None
) -> float:
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
        if after_each is not None:
            after_each()  # untimed
    return statistics.median(times)


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.device = resolve_device(args.device)
        self.dtype = resolve_dtype(args.dtype, self.device)
        dtype_name = str(self.dtype).removeprefix("torch.")
        self.model_dir = Path(args.model) if args.model else random_model_dir(args.shape, dtype_name)
        self.llm = LLM(
            str(self.model_dir),
            dtype=self.dtype,
            device=self.device,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            enable_prefix_caching=False,  # random prompts share nothing; keep the comparison plain
            enforce_eager=args.enforce_eager,
            attention_backend=args.attention_backend,
            gpu_memory_utilization=args.gpu_memory_utilization,
            generation_config="vllm",  # greedy as transformers' baseline, whatever the model's defaults
            show_progress=False,
        )
        config = self.llm.engine.runner.model.config
        self.config = config
        self.prompts = random_prompts(config.vocab_size, args.num_prompts, args.input_len, args.seed)
        self._hf: Any = None
        self.roofline_readings: list[Roofline] = []
        self.results: dict[str, Any] = {
            "model": str(self.model_dir),
            "device": str(self.device),
            "dtype": dtype_name,
            "cuda_graphs": self.device.type == "cuda" and not args.enforce_eager,
            "attention": "triton" if self.llm.engine.runner.in_place_attention is not None else "sdpa",
            "threads": torch.get_num_threads(),
        }

    def sync(self) -> None:
        synchronize(self.device)

    @property
    def hf(self) -> Any:
        if self._hf is None:
            from transformers import AutoModelForCausalLM

            model: Any = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=self.dtype)
            model.to(device=self.device)
            self._hf = model.eval()
        return self._hf

    def hf_generate(self, prompts: list[list[int]], max_new_tokens: int, batch_size: int) -> int:
        """Greedy ``generate`` in left-padded batches; returns the number of generated tokens."""
        from transformers import GenerationConfig

        gen_config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
        generated = 0
        for start in range(0, len(prompts), batch_size):
            batch = prompts[start : start + batch_size]
            width = max(map(len, batch))
            ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device=self.device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=self.device)
            with torch.inference_mode():
                out = self.hf.generate(input_ids=ids, attention_mask=mask, generation_config=gen_config)
            generated += (out.shape[1] - width) * len(batch)
        return generated

    def ours(self, prompts: list[list[int]], max_tokens: int) -> int:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        return sum(len(o.token_ids) for o in outputs)

    # ------------------------------------------------------------------ workloads
    def read_roofline(self) -> None:
        self.roofline_readings.append(measure(self.device, self.dtype))

    def throughput(self) -> dict[str, Any]:
        a = self.args
        out_len = a.output_len
        self.ours(self.prompts[:2], 4)  # warm-up
        engine = self.llm.engine
        engine.step_log = []
        # The roofline is read again after every timed run: the run is judged against the
        # median of readings spread through it, not against one moment of a drifting machine.
        ours_s = _median_time(
            lambda: self.ours(self.prompts, out_len), a.repeats, self.sync, after_each=self.read_roofline
        )
        steps = engine.step_log[: len(engine.step_log) // max(a.repeats, 1)]
        engine.step_log = None
        tokens = out_len * len(self.prompts)
        result: dict[str, Any] = {
            "num_prompts": len(self.prompts),
            "input_tokens": sum(map(len, self.prompts)),
            "output_tokens": tokens,
            "mini_infer_s": ours_s,
            "mini_infer_tok_s": tokens / ours_s,
            "steps": len(steps),
        }
        itemsize = torch.empty((), dtype=self.dtype).element_size()

        def floor_s(roofline: Roofline) -> float:
            return sum(
                roofline.step_floor_seconds(
                    self.config, s.num_tokens, s.num_logits, s.attended_tokens // max(s.num_tokens, 1), itemsize
                )
                for s in steps
            )

        floor = floor_s(median_roofline(self.roofline_readings))
        fastest = Roofline(
            max(r.bandwidth_bytes_per_s for r in self.roofline_readings),
            max(r.peak_flops for r in self.roofline_readings),
        )
        result["roofline_floor_s"] = floor
        result["fraction_of_roofline"] = floor / ours_s
        result["fraction_of_fastest_roofline_reading"] = floor_s(fastest) / ours_s
        if not a.skip_hf:
            self.hf_generate(self.prompts[:2], 4, 2)  # warm-up
            hf_s = _median_time(
                lambda: self.hf_generate(self.prompts, out_len, a.hf_batch_size), a.hf_repeats, self.sync
            )
            result.update({"hf_s": hf_s, "hf_tok_s": tokens / hf_s, "speedup_vs_hf": hf_s / ours_s})
        return result

    def decode(self) -> dict[str, Any]:
        a = self.args
        prompt = [self.prompts[0][i % len(self.prompts[0])] for i in range(128)]
        n = a.decode_len
        self.ours([prompt], 4)
        ours_s = _median_time(lambda: self.ours([prompt], n), a.repeats, self.sync)
        result: dict[str, Any] = {"prompt_tokens": 128, "output_tokens": n, "mini_infer_tok_s": n / ours_s}
        if not a.skip_hf:
            hf_s = _median_time(lambda: self.hf_generate([prompt], n, 1), a.hf_repeats, self.sync)
            result.update({"hf_tok_s": n / hf_s, "speedup_vs_hf": hf_s / ours_s})
        return result

    def prefill(self) -> dict[str, Any]:
        a = self.args
        rng = random.Random(a.seed + 1)
        prompt = [rng.randrange(self.config.vocab_size) for _ in range(a.prefill_len)]
        ours_s = _median_time(lambda: self.ours([prompt], 1), a.repeats, self.sync)
        result: dict[str, Any] = {"prompt_tokens": len(prompt), "mini_infer_tok_s": len(prompt) / ours_s}
        if not a.skip_hf:
            ids = torch.tensor([prompt], device=self.device)

            def forward() -> None:
                with torch.inference_mode():
                    self.hf(ids, logits_to_keep=1)

            forward()
            hf_s = _median_time(forward, a.hf_repeats, self.sync)
            result.update({"hf_tok_s": len(prompt) / hf_s, "speedup_vs_hf": hf_s / ours_s})
        return result

    def run(self) -> dict[str, Any]:
        workloads = self.args.workloads.split(",")
        if "roofline" in workloads or "throughput" in workloads:
            self.read_roofline()
        for name in workloads:
            if name == "roofline":
                continue
            print(f"running {name} ...", flush=True)
            self.results[name] = {"throughput": self.throughput, "decode": self.decode, "prefill": self.prefill}[name]()
            print(format_result(name, self.results[name]), flush=True)
        if self.roofline_readings:
            self.results["roofline"] = roofline_summary(self.roofline_readings)
            print(format_roofline(self.results["roofline"], self.results["dtype"]))
        return self.results


def roofline_summary(readings: list[Roofline]) -> dict[str, Any]:
    median = median_roofline(readings)
    return {
        "bandwidth_GB_s": median.bandwidth_bytes_per_s / 1e9,
        "peak_TFLOP_s": median.peak_flops / 1e12,
        "readings": [
            {"bandwidth_GB_s": r.bandwidth_bytes_per_s / 1e9, "peak_TFLOP_s": r.peak_flops / 1e12} for r in readings
        ],
    }


def format_roofline(summary: dict[str, Any], dtype: str) -> str:
    readings = summary["readings"]
    bandwidths = [r["bandwidth_GB_s"] for r in readings]
    peaks = [r["peak_TFLOP_s"] for r in readings]
    return (
        f"roofline: median of {len(readings)} reading(s) through the run: {summary['bandwidth_GB_s']:.1f} GB/s read "
        f"({min(bandwidths):.1f}-{max(bandwidths):.1f}), {summary['peak_TFLOP_s']:.2f} TFLOP/s {dtype} "
        f"({min(peaks):.2f}-{max(peaks):.2f})"
    )


def format_result(name: str, r: dict[str, Any]) -> str:
    parts = [f"{name}: mini-infer {r['mini_infer_tok_s']:.1f} tok/s"]
    if "hf_tok_s" in r:
        parts.append(f"transformers {r['hf_tok_s']:.1f} tok/s ({r['speedup_vs_hf']:.2f}x)")
    if "fraction_of_roofline" in r:
        parts.append(
            f"{100 * r['fraction_of_roofline']:.0f}% of the roofline "
            f"({100 * r['fraction_of_fastest_roofline_reading']:.0f}% of its fastest reading; {r['steps']} steps)"
        )
    return ", ".join(parts)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="a model directory (default: random weights at --shape)")
    parser.add_argument("--shape", default="qwen2.5-0.5b", help="named shape of the random model")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument(
        "--workloads",
        default="throughput,decode,prefill",
        help="comma-separated: throughput, decode, prefill, roofline",
    )
    add_random_prompt_arguments(parser, num_prompts=64, input_len=(64, 512), output_len=128)
    parser.add_argument("--decode-len", type=int, default=128)
    parser.add_argument("--prefill-len", type=int, default=2048)
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=1, help="timed runs of mini-infer per workload (median)")
    parser.add_argument("--hf-repeats", type=int, default=1, help="timed runs of the baseline per workload (median)")
    parser.add_argument("--skip-hf", action="store_true", help="no transformers baseline")
    parser.add_argument("--enforce-eager", action="store_true", help="on CUDA, no CUDA graphs for decode steps")
    parser.add_argument(
        "--attention-backend",
        choices=ATTENTION_BACKENDS,
        default="auto",
        help="how decode steps attend: chapter 05's gather + SDPA, chapter 05c's Triton kernel, or auto",
    )
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="on CUDA, the engine's share of the card; leave room for transformers' copy (a 15 GB T4: 0.6)",
    )
    add_tensor_parallel_argument(
        parser, "N > 1: the workloads' step times on N ranks against 1, with the all-reduce's share (chapter 14)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the results to this file")


def main(args: argparse.Namespace) -> int:
    if tensor_parallel_size(args) > 1:
        return int(importlib.import_module(TENSOR_PARALLEL_BENCH).main(args))
    results = Bench(args).run()
    if args.json:
        write_results(args.json, results)
    return 0
