"""A Triton kernel for paged attention that reads the KV blocks in place (chapter 05c).

This module imports ``triton`` and is itself imported only by ``kv.attention_backend`` when the
Triton backend is chosen: the package never needs Triton. With ``TRITON_INTERPRET=1`` set before
Triton is imported, the same kernel runs on CPU tensors through Triton's interpreter (slowly: it
is for teaching and tests).

One *program* computes one (sequence, KV head, split) of a batched group whose sequences each
bring ``QUERY_LEN`` new tokens (1: decode; ``k + 1``: speculative verification). Its tile of
queries is every query head that shares the KV head (grouped-query attention), for every new
token: ``GROUP * QUERY_LEN`` rows, padded to ``BLOCK_M``. It walks its share of the sequence's
block table, one 16-token block at a time, loading that block's K and V straight from the pool
(no gathered copy), and keeps FlashAttention's running maximum ``row_max``, running sum ``row_sum`` and
unnormalised output ``acc`` (online softmax). A sequence's context can be cut into ``splits``
(flash-decoding): each split writes its partial ``(row_max, row_sum, acc)`` and ``attention_backend``
combines them, so that a small batch with long contexts still gives the GPU enough programs.

Invariants: the query at row ``i`` of a sequence sits at position ``context_len - QUERY_LEN + i``
and sees keys ``0 .. context_len - QUERY_LEN + i``; keys past it get weight exactly 0, and slots past
the context (the rest of the last block) are never loaded; a split with no visible key leaves
``row_max = -inf``, ``row_sum = 0`` and ``acc = 0``.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def paged_attention_kernel(
    q_ptr,  # [tokens, heads, head_dim], tokens = sequences * QUERY_LEN
    k_ptr,  # one layer's K pool [kv_heads, blocks, BLOCK_SIZE, head_dim]
    v_ptr,  # one layer's V pool, the same strides
    tables_ptr,  # [sequences, width] block tables
    context_lens_ptr,  # [sequences]
    row_max_ptr,  # [sequences, kv_heads, splits, BLOCK_M] running maxima, out
    row_sum_ptr,  # [sequences, kv_heads, splits, BLOCK_M] running sums, out
    acc_ptr,  # [sequences, kv_heads, splits, BLOCK_M, BLOCK_D] unnormalised outputs, out
    stride_q_token,
    stride_q_head,
    stride_k_head,
    stride_k_block,
    stride_k_slot,
    stride_table,
    blocks_per_split,
    scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    QUERY_LEN: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,  # multiply in float32: the interpreter's bfloat16 tl.dot is wrong
):
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    num_kv_heads, num_splits = tl.num_programs(1), tl.num_programs(2)
    context_len = tl.load(context_lens_ptr + seq)

    # Row r of the tile is query token r // GROUP, query head kv_head * GROUP + r % GROUP.
    rows = tl.arange(0, BLOCK_M)
    query = rows // GROUP
    row_ok = rows < QUERY_LEN * GROUP
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    token, head = seq * QUERY_LEN + query, kv_head * GROUP + rows % GROUP
    q_offsets = token[:, None] * stride_q_token + head[:, None] * stride_q_head
    q = tl.load(q_ptr + q_offsets + dims[None, :], mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    last_visible = context_len - QUERY_LEN + query  # the causal rule: position of each row's query

    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    slots = tl.arange(0, BLOCK_SIZE)
    first = split * blocks_per_split
    last = tl.minimum(first + blocks_per_split, tl.cdiv(context_len, BLOCK_SIZE))
    for index in range(first, last):
        block = tl.load(tables_ptr + seq * stride_table + index)
        kv_offsets = kv_head * stride_k_head + block * stride_k_block + slots[:, None] * stride_k_slot + dims[None, :]
        # Slots past the context are never loaded: stale data there (even NaN) cannot leak in.
        loaded = ((index * BLOCK_SIZE + slots) < context_len)[:, None] & dim_ok[None, :]
        k = tl.load(k_ptr + kv_offsets, mask=loaded, other=0.0)
        v = tl.load(v_ptr + kv_offsets, mask=loaded, other=0.0)
        if UPCAST:
            k, v = k.to(tl.float32), v.to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        visible = (index * BLOCK_SIZE + slots)[None, :] <= last_visible[:, None]
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(row_max, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
        p = tl.exp(scores - m_safe[:, None])
        rescale = tl.exp(row_max - m_safe)
        row_sum = row_sum * rescale + tl.sum(p, 1)
        acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        row_max = m_new

    partial = ((seq * num_kv_heads + kv_head) * num_splits + split) * BLOCK_M + rows
    tl.store(row_max_ptr + partial, row_max)
    tl.store(row_sum_ptr + partial, row_sum)
    tl.store(acc_ptr + partial[:, None] * BLOCK_D + dims[None, :], acc)
