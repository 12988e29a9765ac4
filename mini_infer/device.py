"""Choosing the device and the dtype (chapter 00; chapter 02 explains the numerics).

``device="auto"``: the device named by the environment variable ``MINI_INFER_DEVICE`` when it is
set (``cpu`` keeps a GPU machine on the CPU without changing code; the test suite runs on the
device ``MINI_INFER_TEST_DEVICE`` names this way), else CUDA when present *and this torch has
kernels for the card*, then Apple's MPS, else the CPU. A CUDA build of PyTorch ships machine code
(``sm_XY``) for a list of architectures and sometimes PTX (``compute_XY``) that the driver
compiles for newer cards; a card outside both gets "no kernel image is available" at its first
operation (Kaggle's torch has no ``sm_60``, so a P100 fails that way). ``cuda_unsupported``
checks the card's compute capability against ``torch.cuda.get_arch_list()``, then runs one small
operation on it; when either fails, ``auto`` warns, naming the card and the reason, and uses the
CPU. Asking for ``cuda`` explicitly is not second-guessed.

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
import warnings
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
            problem = cuda_unsupported()
            if not problem:
                return torch.device("cuda")
            warnings.warn(f"device='auto' runs on the CPU: {problem}", RuntimeWarning, stacklevel=2)
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


def arch_runs_on(arch: str, capability: tuple[int, int]) -> bool:
    """Whether code compiled for ``arch`` (an entry of ``torch.cuda.get_arch_list()``) runs on a card
    of compute ``capability``. ``sm_XY`` machine code runs on the same major version from minor
    ``Y`` up (``sm_XYa``, architecture-specific, on ``X.Y`` only); ``compute_XY`` PTX is compiled by
    the driver for any card of capability ``X.Y`` or more."""
    kind, _, number = arch.partition("_")
    exact = number.endswith("a")
    digits = number.rstrip("af")
    if kind not in ("sm", "compute") or not digits.isdigit() or len(digits) < 2:
        return False
    built = (int(digits[:-1]), int(digits[-1]))
    if kind == "compute":
        return capability >= built
    return capability == built if exact else capability[0] == built[0] and capability[1] >= built[1]


def cuda_unsupported(index: int | None = None) -> str:
    """Why this torch cannot run on CUDA card ``index`` (the current one when None), or "" when it
    can: the card's compute capability against the architectures torch was built for, then one
    small operation on the card (which catches what the list cannot say, such as a driver too old
    for the build)."""
    index = torch.cuda.current_device() if index is None else index
    name = torch.cuda.get_device_name(index)
    major, minor = torch.cuda.get_device_capability(index)
    archs = torch.cuda.get_arch_list()
    if archs and not any(arch_runs_on(arch, (major, minor)) for arch in archs):
        return (
            f"this torch {torch.__version__} has no kernels for the {name} (compute capability {major}.{minor}, "
            f"sm_{major}{minor}; it was built for {' '.join(archs)}): use a GPU it supports, such as a T4, "
            "or a torch build for this card"
        )
    try:
        first_cuda_operation(index)
    except RuntimeError as error:  # "no kernel image is available", a driver too old, ...
        return f"a first operation on the {name} (compute capability {major}.{minor}) failed: {error}"
    return ""


def first_cuda_operation(index: int) -> None:
    """One small kernel on card ``index``, waited for: it raises where this torch cannot run there."""
    (torch.ones(2, device=f"cuda:{index}") + 1).sum().item()


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
