"""The machine's roofline, measured in the same run as the benchmark it judges (chapter 12; read in chapter 06).

Two numbers bound any step of the engine from below:

* memory read bandwidth: a decode step must read every weight once, so it takes at least
  ``weight bytes / bandwidth``;
* matrix throughput (bf16 or the model's dtype): a step computing ``T`` tokens does about
  ``2 * matmul_params * T`` floating-point operations (plus attention), so it takes at least
  ``FLOPs / peak``.

A step's floor is the larger of the two; a run's floor is the sum over its steps.

Both are timed by ``seconds_per_call``: on CUDA with CUDA events (the device's clock, without the
host's launch latency), on a CPU with ``perf_counter``.

On a shared machine both numbers drift by 2x or more within minutes (other tenants use the same
cores, caches and memory), so a benchmark reads them several times through its run and uses the
median (``median_roofline``), reporting the spread beside it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from mini_infer.config import ModelConfig
from mini_infer.device import synchronize


@dataclass(frozen=True)
class Roofline:
    bandwidth_bytes_per_s: float
    peak_flops: float

    def step_floor_seconds(
        self, config: ModelConfig, num_tokens: int, num_logits: int, context_tokens: int, itemsize: int
    ) -> float:
        """Lower bound for one engine step computing ``num_tokens`` new tokens."""
        weight_bytes = weight_bytes_read(config, itemsize)
        flops = step_flops(config, num_tokens, num_logits, context_tokens)
        return max(weight_bytes / self.bandwidth_bytes_per_s, flops / self.peak_flops)


def weight_bytes_read(config: ModelConfig, itemsize: int) -> int:
    """Bytes of weights a step reads: every layer, the final norm and the LM head (the
    embedding table is only indexed, a few rows per token)."""
    h, i = config.hidden_size, config.intermediate_size
    per_layer = h * (config.q_size + 2 * config.kv_size) + config.q_size * h + 3 * h * i
    return (config.num_hidden_layers * per_layer + config.vocab_size * h) * itemsize


def step_flops(config: ModelConfig, num_tokens: int, num_logits: int, context_tokens: int) -> float:
    """Matmul FLOPs of a step: projections and MLP for every new token, the LM head for the
    sampled rows, and attention (QK^T and PV) over ``context_tokens`` summed over new tokens."""
    h, i = config.hidden_size, config.intermediate_size
    per_token = (
        config.num_hidden_layers * 2 * (h * (config.q_size + 2 * config.kv_size) + config.q_size * h + 3 * h * i)
    )
    attention = config.num_hidden_layers * 4 * config.num_attention_heads * config.head_dim * context_tokens
    return per_token * num_tokens + 2 * config.vocab_size * h * num_logits + attention


def seconds_per_call(fn: Callable[[], object], device: torch.device, repeats: int = 5, inner: int = 1) -> float:
    """Median seconds of one ``fn()``, over ``repeats`` timings of ``inner`` calls each (after one
    untimed warm-up timing). On CUDA the device's own clock times it: CUDA events recorded on the
    stream before and after the ``inner`` calls, so neither the host's launch latency nor a sync
    is counted (a 2048^3 matmul takes about 22 us on an H100, less than a host round trip); on a
    CPU, ``perf_counter`` around them."""
    times = []
    for _ in range(repeats + 1):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / inner)  # elapsed_time is in milliseconds
        else:
            synchronize(device)
            begin = time.perf_counter()
            for _ in range(inner):
                fn()
            synchronize(device)
            times.append((time.perf_counter() - begin) / inner)
    return statistics.median(times[1:])


def measure_bandwidth(device: torch.device, nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Read bandwidth from summing a large tensor (bytes read per second, median of repeats)."""
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    return nbytes / seconds_per_call(x.sum, device, repeats)


def measure_matmul_flops(device: torch.device, dtype: torch.dtype, n: int = 2048, repeats: int = 5) -> float:
    """Dense ``n x n`` matmul throughput in FLOP/s (median of repeats; on CUDA, 10 matmuls per timing)."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    return 2 * n**3 / seconds_per_call(lambda: a @ b, device, repeats, inner=10 if device.type == "cuda" else 1)


def measure(device: torch.device, dtype: torch.dtype) -> Roofline:
    return Roofline(measure_bandwidth(device), measure_matmul_flops(device, dtype))


def median_roofline(readings: Sequence[Roofline]) -> Roofline:
    """The median bandwidth and the median peak of several readings (each taken separately)."""
    if not readings:
        raise ValueError("median_roofline needs at least one reading")
    return Roofline(
        statistics.median(r.bandwidth_bytes_per_s for r in readings), statistics.median(r.peak_flops for r in readings)
    )
