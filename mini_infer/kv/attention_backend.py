"""Attention backends: SDPA over gathered blocks, or a Triton kernel reading them in place (chapter 05c).

``attention_backend="sdpa"`` is chapter 05's path: gather each sequence's blocks into a contiguous
copy, then ``scaled_dot_product_attention`` with a padding mask. It reads the pool, writes the
copy and reads it again. ``"triton"`` runs ``kv.triton_kernel``: each program reads its blocks
straight from the pool through the block table, once. ``"auto"`` picks Triton on a CUDA GPU when
it loads and agrees with SDPA on a start-up check, and SDPA everywhere else; the reason for any
fallback is returned, so the engine can log it. On the CPU, ``"triton"`` runs Triton's
interpreter: correct and very slow, for the chapter and the tests.

Triton is never required. It is imported only here, only when asked for, and only after the
checks that can fail without it (``triton_unavailable``).
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os
import shutil
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

ATTENTION_BACKENDS = ("auto", "sdpa", "triton")


def triton_unavailable(device: torch.device) -> str | None:
    """Why the Triton kernel cannot run on ``device`` in this process, or None when it can."""
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed (pip install triton; the CUDA builds of torch bring it)"
    if device.type == "cpu":
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            return "Triton was imported without TRITON_INTERPRET=1, so it cannot run kernels on the CPU"
        return None
    if device.type != "cuda":
        return f"Triton runs on CUDA GPUs (and, interpreted, on the CPU), not on {device.type}"
    if torch.cuda.get_device_capability(device) < (7, 5):
        return f"Triton needs a GPU of compute capability 7.5 or newer, this one is {torch.cuda.get_device_capability(device)}"
    if not (os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")):
        return "Triton builds a small launcher with the system's C compiler, and none was found (set CC)"
    return None


def load_kernel(device: torch.device) -> Any:
    """The Triton kernel, imported for ``device`` (on the CPU, through the interpreter)."""
    reason = triton_unavailable(device)
    if reason is not None:
        raise RuntimeError(f"attention_backend='triton' cannot run: {reason}; use attention_backend='sdpa'")
    if device.type == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # read when Triton is imported (checked above: not yet)
    from mini_infer.kv.triton_kernel import paged_attention_kernel

    return paged_attention_kernel


def combine_splits(row_max: torch.Tensor, row_sum: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
    """Flash-decoding's last step: softmax over a context cut into splits, from each split's
    running maximum and running sum of exponentials (both ``[..., splits, rows]``) and
    unnormalised output ``acc`` (``[..., splits, rows, dim]``). Returns ``[..., rows, dim]``.

    Each split's numbers are relative to its own maximum; rescaled to the overall maximum, the
    sums and outputs add up. A split that saw no key has maximum ``-inf`` and weighs nothing; a row
    that saw no key at all (a padding row) comes out as zeros, never NaN.
    """
    # student: begin chapter 05: rescale each split to the overall maximum, add them up, normalise
    top = row_max.amax(dim=-2, keepdim=True)
    top = torch.where(top == float("-inf"), torch.zeros_like(top), top)
    weight = torch.exp(row_max - top)
    total = (row_sum * weight).sum(dim=-2)
    out = (acc * weight[..., None]).sum(dim=-3)
    return out / torch.where(total == 0, torch.ones_like(total), total)[..., None]
    # student: end


def num_splits(device: torch.device, num_programs: int, width: int) -> int:
    """How many parts to cut each context into: enough programs to fill a GPU twice over (no more
    parts than blocks), and 1 on the CPU. It depends on shapes only, so a CUDA graph keeps it."""
    if device.type != "cuda":
        return 1
    wanted = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(width, math.ceil(wanted / max(num_programs, 1))))


def paged_attention_triton(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_len: int,
    splits: int | None = None,
    kernel: Callable[..., Any] | None = None,
) -> torch.Tensor:
    """Attention for a batched group read in place from one layer's pools.

    ``q``: ``[sequences * query_len, heads, head_dim]``, each sequence's new tokens together;
    ``k_pool``/``v_pool``: ``[kv_heads, blocks, block_size, head_dim]``; ``block_tables``:
    ``[sequences, width]`` (entries past a sequence's blocks are never read); ``context_lens``:
    ``[sequences]``, the new tokens included. Returns ``[sequences * query_len, heads, head_dim]``.
    """
    kernel = kernel or load_kernel(q.device)
    sequences, width = block_tables.shape
    kv_heads, _, block_size, head_dim = k_pool.shape
    heads = q.shape[1]
    group = heads // kv_heads
    if q.shape[0] != sequences * query_len or heads % kv_heads or q.stride(2) != 1 or k_pool.stride(3) != 1:
        raise ValueError(
            f"q {tuple(q.shape)} must be [{sequences} * {query_len}, heads, head_dim] with heads a multiple of "
            f"{kv_heads} KV heads, and q and the pools contiguous in head_dim"
        )
    splits = splits or num_splits(q.device, sequences * kv_heads, width)
    block_m = max(16, triton_next_power_of_2(group * query_len))
    block_d = max(16, triton_next_power_of_2(head_dim))
    partial = (sequences, kv_heads, splits, block_m)
    row_max = torch.empty(partial, dtype=torch.float32, device=q.device)
    row_sum = torch.empty(partial, dtype=torch.float32, device=q.device)
    acc = torch.empty((*partial, block_d), dtype=torch.float32, device=q.device)
    launch: Any = kernel  # a Triton JITFunction: indexed by its grid
    launch[(sequences, kv_heads, splits)](
        q, k_pool, v_pool, block_tables, context_lens, row_max, row_sum, acc,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2), block_tables.stride(0),
        math.ceil(width / splits), 1.0 / math.sqrt(head_dim),
        HEAD_DIM=head_dim, BLOCK_D=block_d, QUERY_LEN=query_len, GROUP=group, BLOCK_M=block_m,
        BLOCK_SIZE=block_size, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        UPCAST=q.device.type == "cpu",
    )  # fmt: skip
    out = combine_splits(row_max, row_sum, acc)[:, :, : group * query_len, :head_dim]  # [S, Hkv, Q * g, D]
    # Row r of a tile is query token r // g of query head kv_head * g + r % g.
    out = out.reshape(sequences, kv_heads, query_len, group, head_dim).permute(0, 2, 1, 3, 4)
    return out.reshape(sequences * query_len, heads, head_dim).to(q.dtype)


def triton_next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def reference_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_len: int,
) -> torch.Tensor:
    """What ``paged_attention_triton`` computes, one sequence at a time with SDPA over its
    gathered blocks: the definition the kernel is checked against (at start-up and in the tests)."""
    kv_heads, _, _, head_dim = k_pool.shape
    group = q.shape[1] // kv_heads
    exact = torch.promote_types(q.dtype, torch.float32)  # half precision is computed in float32
    out = torch.empty_like(q)
    for seq, context_len in enumerate(context_lens.tolist()):
        blocks = block_tables[seq, : -(-context_len // k_pool.shape[2])]
        keys = k_pool[:, blocks].reshape(kv_heads, -1, head_dim)[:, :context_len]
        values = v_pool[:, blocks].reshape(kv_heads, -1, head_dim)[:, :context_len]
        rows = slice(seq * query_len, (seq + 1) * query_len)
        queries = q[rows].transpose(0, 1)  # [heads, Q, D]
        visible = torch.arange(context_len, device=q.device)[None, :] <= (
            context_len - query_len + torch.arange(query_len, device=q.device)[:, None]
        )
        out[rows] = (
            F.scaled_dot_product_attention(
                queries.to(exact),
                keys.repeat_interleave(group, 0).to(exact),
                values.repeat_interleave(group, 0).to(exact),
                attn_mask=visible,
            )
            .transpose(0, 1)
            .to(q.dtype)
        )
    return out


# How far the kernel may be from the reference at start-up, per dtype (max absolute error on
# unit-variance inputs); float16 and bfloat16 round the output itself.
START_UP_TOLERANCE = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def start_up_check(
    kernel: Any, device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int
) -> str | None:
    """Run the kernel once on a small scattered batch of the model's head layout (a decode step
    and a verification step of 3 tokens, contexts inside one block and across several) and compare
    it with ``reference_attention``: None when it agrees, else what went wrong."""
    generator = torch.Generator().manual_seed(0)
    pool = torch.randn(2, kv_heads, 12, 16, head_dim, generator=generator).to(device, dtype)
    tables = torch.randperm(12, generator=generator)[:10].view(2, 5).to(device)
    lens = torch.tensor([7, 70], device=device)
    for query_len in (1, 3):
        q = torch.randn(2 * query_len, heads, head_dim, generator=generator).to(device, dtype)
        try:
            got = paged_attention_triton(q, pool[0], pool[1], tables, lens, query_len, kernel=kernel)
        except Exception as exc:  # a compiler missing a feature on this card, for example
            return f"{type(exc).__name__}: {exc}"
        error = (got.float() - reference_attention(q, pool[0], pool[1], tables, lens, query_len).float()).abs().max()
        if not error <= START_UP_TOLERANCE.get(dtype, 1e-4):
            return f"max error {error.item():.2e} against SDPA with {query_len} new token(s) in {dtype}"
    return None


def choose_attention(
    backend: str, device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int
) -> tuple[Callable[..., torch.Tensor] | None, str]:
    """What attends a batched group (``PagedAttention``'s ``in_place``): the Triton kernel, or None
    for SDPA over gathered blocks; and a sentence saying which and why, for the engine's log.

    ``"sdpa"``: SDPA. ``"triton"``: the kernel, or an error naming what is missing. ``"auto"``: the
    kernel on a CUDA GPU where Triton loads and the start-up check passes, SDPA everywhere else.
    """
    if backend == "sdpa":
        return None, "attention: SDPA over gathered blocks (attention_backend='sdpa')"
    reason = triton_unavailable(device)
    if backend == "triton":
        if reason is not None:
            raise ValueError(f"attention_backend='triton' cannot run here: {reason}; use 'sdpa' or 'auto'")
        kernel = load_kernel(device)
        slow = " through Triton's interpreter on the CPU: correct and very slow" if device.type == "cpu" else ""
        return functools.partial(paged_attention_triton, kernel=kernel), f"attention: the Triton kernel{slow}"
    if device.type != "cuda":
        return (
            None,
            f"attention: SDPA (the Triton kernel serves CUDA GPUs; on {device.type} ask for 'triton' to interpret it)",
        )
    if reason is not None:
        return None, f"attention: SDPA, since {reason}"
    try:
        kernel = load_kernel(device)
    except Exception as exc:  # Triton present but unusable here (a driver or compiler problem)
        return None, f"attention: SDPA, since Triton did not load ({type(exc).__name__}: {exc})"
    failed = start_up_check(kernel, device, dtype, heads, kv_heads, head_dim)
    if failed is not None:
        return None, f"attention: SDPA, since the Triton kernel failed its start-up check ({failed})"
    return functools.partial(
        paged_attention_triton, kernel=kernel
    ), "attention: the Triton kernel (start-up check passed)"
