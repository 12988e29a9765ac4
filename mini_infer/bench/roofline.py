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


@dataclass(frozen=True)
class Operation:
    """One operation of a step, summed over the model's layers: its FLOPs and the bytes it moves
    (weights read, activations read and written, K/V read and written). ``flops / bytes`` is its
    arithmetic intensity: below the device's ``peak / bandwidth`` it is bound by memory."""

    name: str
    flops: float
    bytes: float

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes if self.bytes else float("inf")


def step_operations(
    config: ModelConfig, num_tokens: int, num_logits: int, context_tokens: int, kv_tokens: int, itemsize: int
) -> list[Operation]:
    """The matmuls and the attention of a step, each summed over the layers.

    ``num_tokens`` new tokens go through every layer, ``num_logits`` rows through the LM head;
    ``context_tokens`` is the sum over new tokens of the keys each attends to (its FLOPs), and
    ``kv_tokens`` the cached tokens whose K and V the step reads, once per sequence and layer (its
    bytes: a decode row reads its whole context; a prefill chunk reads its context once for all its
    queries, as a tiled kernel does). Norms, RoPE and the activation are left out: they move
    ``num_tokens`` rows of activations and compute almost nothing.
    """
    h, i, q, kv, layers = (
        config.hidden_size,
        config.intermediate_size,
        config.q_size,
        config.kv_size,
        config.num_hidden_layers,
    )

    def matmul(name: str, rows: int, inputs: int, outputs: int, times: int = layers) -> Operation:
        # [rows, inputs] @ [inputs, outputs]: read the weight and the input rows, write the output rows.
        moved = inputs * outputs + rows * (inputs + outputs)
        return Operation(name, times * 2.0 * rows * inputs * outputs, times * moved * itemsize)

    attention = Operation(
        "attention",
        layers * 4.0 * config.num_attention_heads * config.head_dim * context_tokens,  # QK^T and PV
        # read the cached K/V, read Q, write the output and the new tokens' K/V
        layers * (2 * kv * kv_tokens + num_tokens * (2 * q + 2 * kv)) * itemsize,
    )
    return [
        matmul("qkv_proj", num_tokens, h, q + 2 * kv),
        attention,
        matmul("o_proj", num_tokens, q, h),
        matmul("gate_up_proj", num_tokens, h, 2 * i),
        matmul("down_proj", num_tokens, i, h),
        matmul("lm_head", num_logits, h, config.vocab_size, times=1),
    ]


def weight_bytes_read(config: ModelConfig, itemsize: int) -> int:
    """Bytes of weights a step reads: every layer and the LM head (the embedding table is only
    indexed, a few rows per token; the norms' weights are a few kilobytes)."""
    return sum(int(op.bytes) for op in step_operations(config, 0, 0, 0, 0, itemsize))


def step_flops(config: ModelConfig, num_tokens: int, num_logits: int, context_tokens: int) -> float:
    """Matmul FLOPs of a step: projections and MLP for every new token, the LM head for the
    sampled rows, and attention (QK^T and PV) over ``context_tokens`` summed over new tokens."""
    return sum(op.flops for op in step_operations(config, num_tokens, num_logits, context_tokens, 0, 1))


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
