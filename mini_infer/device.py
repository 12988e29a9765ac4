"""Choosing the device and the dtype (chapter 00; chapter 02 explains the numerics).

``device="auto"``: the device named by the environment variable ``MINI_INFER_DEVICE`` when it is
set (``cpu`` keeps a GPU machine on the CPU without changing code; the test suite runs on the
device ``MINI_INFER_TEST_DEVICE`` names this way), else CUDA when present, then Apple's MPS, else
the CPU.

``dtype="auto"``: bfloat16 where the hardware computes it natively, float16 on GPUs without
bf16 (a T4 is Turing: compute capability 7.5), float32 otherwise. On a CPU, bf16 is only fast
with native bf16 matrix instructions (AVX512-BF16 or AMX on x86, BF16 on Arm); without them
PyTorch emulates it and float32 is faster, so ``auto`` picks float32 there. float32 is always
the reference the tests compare against.
"""

from __future__ import annotations

import functools
import os
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

DEVICE_ENV = "MINI_INFER_DEVICE"
DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    if isinstance(device, torch.device):
        return device
    if device == "auto" and os.environ.get(DEVICE_ENV):
        return resolve_device(os.environ[DEVICE_ENV])
    if device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"device={device!r} is not a device: use 'auto', 'cpu', 'cuda', 'cuda:N' or 'mps'") from exc
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but CUDA is not available on this machine; use device='cpu' or 'auto'")
    return resolved


def to_device(values: Sequence[Any], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of host ``values`` on ``device``, without making the host wait for it.

    A copy from ordinary (pageable) host memory to a GPU first waits until the GPU has finished
    everything queued before it: a host sync. A copy from pinned memory is queued like a kernel.
    Every tensor the engine builds from host lists during a step goes through here, so that a
    step's only host sync is the one that reads its sampled tokens.
    """
    cpu = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return cpu.pin_memory().to(device, non_blocking=True)
    return cpu.to(device)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA runs asynchronously; a CPU has nothing queued):
    what a timer needs before it reads the clock."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@functools.lru_cache(maxsize=1)
def cpu_has_native_bf16() -> bool:
    """True when this CPU has bf16 matrix instructions (read from /proc/cpuinfo on Linux)."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        flags = cpuinfo.read_text(errors="ignore")
        return any(flag in flags for flag in ("avx512_bf16", "amx_bf16", " bf16"))
    return platform.machine() == "arm64" and platform.system() == "Darwin"  # Apple M2 and later


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype={dtype} is not supported: use float32, bfloat16 or float16")
        return dtype
    if dtype != "auto":
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r} is not supported: use 'auto', 'float32', 'bfloat16' or 'float16'")
        return DTYPES[dtype]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else torch.float16
    if device.type == "mps":
        return torch.float16
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
