"""Paged attention: K/V stored in 16-token blocks, one flat forward for every kind of step (chapter 05).

The KV cache of every layer lives in one tensor allocated once (``PagedKVCache``), shaped
``[kv_heads, num_blocks, block_size, head_dim]`` per layer for K and for V. A sequence owns a
*block table*: its logical block ``i`` (positions ``16 i .. 16 i + 15``) lives in physical block
``block_table[i]``. Token ``p`` of a sequence therefore lives in slot
``block_table[p // 16] * 16 + p % 16``: the *slot mapping* of the new tokens tells the cache
where to write them.

One forward serves a flat batch of ``T`` new tokens from many sequences. ``PagedAttentionMetadata``
describes it; ``build_metadata`` computes all of it once per step, before the first layer runs,
and it is passed explicitly (no global context). Every layer only reads it:

* ``slot_mapping[T]``: where each new token's K and V are written, in every layer;
* ``block_tables``: every sequence's block table, padded into one ``[S, max_blocks]`` tensor;
* ``prefills``: sequences computed with more than one query (prompt chunks, possibly after a
  cached prefix); each is attended on its own, causally, with the query offset by the cached
  context (its mask built here, once per step). When a chunk has no cached context it attends
  over its own fresh K/V directly.
* a *batched group*: sequences that each bring the same number ``Q`` of new tokens (``Q = 1``:
  decode; ``Q = k + 1``: speculative verification), attended together in
  ``scaled_dot_product_attention`` calls over their gathered blocks, with a padding mask.
  Every row of one call is padded to that call's longest context, so a large group is cut
  into a few *buckets* of consecutive rows, each padded only to its own longest context (the
  runner lists the group shortest context first, so a bucket holds similar lengths). With 64
  decodes of contexts spread over 150-650 tokens, four buckets gather about 30% fewer keys than one
  padded call, and a decode step of the 0.5B-shaped model took 8% less time.

Tokens are laid out prefills first, then the batched group. A gather copies whole blocks: one
layer's pool is viewed as a table of ``kv_heads * num_blocks`` rows of ``block_size * head_dim``
numbers, and ``index_select`` over those rows (``_pool_rows``: every block of the table for KV
head 0, then for head 1, ...) is one contiguous copy per block, several times faster on CPU than
``index_select`` over the pool's block axis (chapter 05 measures both). The result is kv-heads
outermost, already in the ``[kv_heads, batch, context, head_dim]`` order attention wants: no
transpose copy. The rows to gather and each bucket's additive mask are computed once per step,
not once per layer; with both, a decode step of the 0.5B-shaped model at 64 sequences took
12-13% less time (two runs, alternating the old and the new code step by step).

Invariant: attending through the pool gives the same result as dense causal attention over each
sequence's full K/V (tests/test_paged_attention.py checks it on ragged batches, chunks that
start mid-block included).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from mini_infer.config import ModelConfig
from mini_infer.device import to_device
from mini_infer.kv.block_pool import num_blocks_for, slot_mapping
from mini_infer.layers import causal_mask, folded_attention, folded_bias


class PagedKVCache:
    """The K and V pools of every layer: ``[layers, kv_heads, num_blocks + 1, block_size, head_dim]``.

    Blocks ``0 .. num_blocks - 1`` are the block pool's. The one more, ``null_block``, belongs to
    no sequence: the padding rows of a shape-static decode step (``decode_graphs``, for CUDA
    graphs) write their K/V there and attend to it, so that padding never touches real data.
    """

    def __init__(
        self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        shape = (config.num_hidden_layers, config.num_key_value_heads, num_blocks + 1, block_size, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_blocks = num_blocks
        self.null_block = num_blocks
        self.block_size = block_size
        self.num_kv_heads = config.num_key_value_heads

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        """Bytes one block costs across all layers, K and V: what a memory budget divides by."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * config.num_hidden_layers * config.num_key_value_heads * block_size * config.head_dim * itemsize

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


@dataclass(frozen=True, slots=True)
class PrefillSpan:
    """One sequence attended on its own: ``num_tokens`` new queries at the end of ``context_len`` keys."""

    token_start: int
    num_tokens: int
    context_len: int
    # Rows of the pool (``_pool_rows``) that hold its context (None when the chunk has no cached
    # context: it attends to its own fresh K/V), and its causal mask in SDPA's folded, additive
    # form (None: a single query sees every key).
    pool_rows: torch.Tensor | None
    bias: torch.Tensor | None


# A bucket is worth its extra gather and SDPA call only with enough rows in it.
MIN_ROWS_PER_BUCKET = 16
MAX_BUCKETS = 4


@dataclass(frozen=True, slots=True)
class BatchBucket:
    """Rows ``[start, end)`` of the batched group, padded only to their own longest context."""

    start: int
    end: int
    pool_rows: torch.Tensor  # the rows' padded block tables, as rows of the pool (``pool_rows``)
    bias: torch.Tensor  # [1, end - start, group * Q, width * block_size]: folded additive mask


@dataclass(frozen=True, slots=True)
class PagedAttentionMetadata:
    """Everything every layer's attention reads, computed once per step (``build_metadata``)."""

    slot_mapping: torch.Tensor  # [T] long: the pool slot of each new token
    block_of_slot: torch.Tensor  # [T] slot_mapping // block_size
    offset_of_slot: torch.Tensor  # [T] slot_mapping % block_size
    block_tables: torch.Tensor  # [S, max_blocks] long, prefills then the batched group, padded with block 0
    context_lens: torch.Tensor  # [S] long, in the same order
    prefills: tuple[PrefillSpan, ...]
    batch_start: int  # first token of the batched group
    batch_query_len: int  # Q new tokens per sequence of the group
    buckets: tuple[BatchBucket, ...]  # consecutive rows of the group, one SDPA call each


def build_metadata(
    *,
    prefills: Sequence[tuple[int, int, Sequence[int]]],
    batch: Sequence[tuple[int, Sequence[int]]],
    batch_query_len: int,
    cache: PagedKVCache,
    num_heads: int,
) -> PagedAttentionMetadata:
    """Metadata for a flat batch laid out as ``prefills`` then ``batch``, for attention over ``cache``.

    ``prefills``: ``(num_new_tokens, context_len, block_table)`` per sequence, where
    ``context_len`` counts the new tokens too. ``batch``: ``(context_len, block_table)`` per
    sequence of the batched group, each bringing ``batch_query_len`` new tokens. ``num_heads``
    (query heads) fixes the fold of the masks. The host lists (``host_tables``) go to the device
    in one copy, without a host sync (``device.to_device``); ``metadata_from_tensors`` does the rest.
    """
    slots, context_lens, tables, width = host_tables(prefills, batch, batch_query_len, cache.block_size)
    staged = to_device([*slots, *context_lens, *tables], torch.long, cache.k.device)
    slot_tensor, context_tensor, table_tensor = staged.split([len(slots), len(context_lens), len(tables)])
    return metadata_from_tensors(
        slot_tensor,
        table_tensor.view(len(context_lens), width),
        context_tensor,
        prefills=[(num_new, context_len) for num_new, context_len, _ in prefills],
        buckets=bucket_widths([context_len for context_len, _ in batch], cache.block_size),
        batch_query_len=batch_query_len,
        cache=cache,
        num_heads=num_heads,
    )


def host_tables(
    prefills: Sequence[tuple[int, int, Sequence[int]]],
    batch: Sequence[tuple[int, Sequence[int]]],
    batch_query_len: int,
    block_size: int,
    width: int = 0,
) -> tuple[list[int], list[int], list[int], int]:
    """The host half of ``build_metadata``: the new tokens' slots, every sequence's context length,
    the block tables padded with block 0 (masked, never read) to the widest or to ``width`` blocks
    if that is wider, flat, row by row, and that width."""
    entries = [*prefills, *((batch_query_len, context_len, table) for context_len, table in batch)]
    width = max([width, *(num_blocks_for(context_len, block_size) for _, context_len, _ in entries)])
    slots: list[int] = []
    tables: list[int] = []
    for num_new, context_len, table in entries:
        slots += slot_mapping(table, context_len - num_new, context_len, block_size)
        used = table[: num_blocks_for(context_len, block_size)]
        tables += [*used, *[0] * (width - len(used))]
    return slots, [context_len for _, context_len, _ in entries], tables, width


def bucket_widths(context_lens: Sequence[int], block_size: int) -> list[tuple[int, int, int]]:
    """``(start, end, width)`` of each bucket of a batched group whose contexts are ``context_lens``:
    equal runs of consecutive rows, one bucket per ``MIN_ROWS_PER_BUCKET`` rows, at most
    ``MAX_BUCKETS``, each as wide as the blocks its longest context needs."""
    count = max(1, min(MAX_BUCKETS, len(context_lens) // MIN_ROWS_PER_BUCKET))
    bounds = [round(i * len(context_lens) / count) for i in range(count + 1)] if context_lens else [0]
    return [
        (start, end, max(num_blocks_for(c, block_size) for c in context_lens[start:end]))
        for start, end in zip(bounds, bounds[1:])
    ]


def metadata_from_tensors(
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    prefills: Sequence[tuple[int, int]],
    buckets: Sequence[tuple[int, int, int]],
    batch_query_len: int,
    cache: PagedKVCache,
    num_heads: int,
) -> PagedAttentionMetadata:
    """The device half of ``build_metadata``, from tensors only (no host data), so that a CUDA
    graph records it too (``decode_graphs``): ``slot_mapping`` ``[T]``, ``block_tables``
    ``[S, W]`` and ``context_lens`` ``[S]`` on the device, prefills then the batched group;
    ``prefills``: ``(num_new_tokens, context_len)`` each; ``buckets``: ``(start, end, width)``
    of rows of the group (``bucket_widths``)."""
    bs, q, device, dtype = cache.block_size, batch_query_len, cache.k.device, cache.k.dtype
    group, kv_heads, pool_blocks = num_heads // cache.num_kv_heads, cache.num_kv_heads, cache.k.shape[2]
    spans, token = [], 0
    for i, (num_new, context_len) in enumerate(prefills):
        # A chunk after a cached prefix reads its context back through the pool; a first chunk
        # attends to its own fresh K/V. Either way its queries are the last of its keys.
        rows = None
        if context_len > num_new:
            rows = _pool_rows(block_tables[i, : num_blocks_for(context_len, bs)], kv_heads, pool_blocks)
        mask = folded_bias(causal_mask(num_new, context_len, device), group, dtype)[None, None] if num_new > 1 else None
        spans.append(PrefillSpan(token, num_new, context_len, rows, mask))
        token += num_new
    first, out = len(prefills), []
    for start, end, width in buckets:
        # Keys past a sequence's own context (padding blocks) are masked by the causal rule too.
        mask = causal_mask(q, width * bs, device, context_lens[first + start : first + end])
        rows = _pool_rows(block_tables[first + start : first + end, :width].reshape(-1), kv_heads, pool_blocks)
        out.append(BatchBucket(start, end, rows, folded_bias(mask[None], group, dtype)))
    return PagedAttentionMetadata(
        slot_mapping,
        slot_mapping // bs,
        slot_mapping % bs,
        block_tables,
        context_lens,
        tuple(spans),
        token,
        q,
        tuple(out),
    )


# Attention of a whole batched group read in place from one layer's pools (chapter 05c's Triton
# kernel, ``kv.attention_backend.paged_attention_triton``): (q, k_pool, v_pool, block_tables,
# context_lens, query_len) -> out. Passed in, so that this chapter imports nothing of 05c.
InPlaceAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


class PagedAttention:
    """The attention backend of a paged forward: ``model.forward(ids, positions, PagedAttention(cache, meta))``.

    Every layer writes its new K/V into their slots, then attends each prefill span and each
    bucket of the batched group through the rows and masks the metadata already holds: nothing
    is computed here that is the same in every layer. With ``in_place`` (chapter 05c), the batched
    group is attended by that kernel instead, through its block tables, and its buckets are unused.
    """

    def __init__(
        self, cache: PagedKVCache, metadata: PagedAttentionMetadata, in_place: InPlaceAttention | None = None
    ) -> None:
        self.cache = cache
        self.meta = metadata
        self.in_place = in_place

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        meta = self.meta
        k_pool, v_pool = self.cache.k[layer], self.cache.v[layer]  # [Hkv, blocks, bs, D]
        # Write every new token's K/V into its slot first: a chunk then reads itself back
        # through the same blocks as its cached prefix.
        # student: begin chapter 05: store each new token's K and V in its slot of this layer's pools
        k_pool[:, meta.block_of_slot, meta.offset_of_slot] = k.transpose(0, 1)
        v_pool[:, meta.block_of_slot, meta.offset_of_slot] = v.transpose(0, 1)
        # student: end
        out = torch.empty_like(q)
        for span in meta.prefills:
            rows = slice(span.token_start, span.token_start + span.num_tokens)
            if span.pool_rows is None:
                out[rows] = folded_attention(q[rows], k[rows], v[rows], span.bias)
            else:  # [Hkv, blocks * bs, D] -> the first context_len keys, [Hkv, 1, context_len, D]
                keys = _gather(k_pool, span.pool_rows)[:, None, : span.context_len]
                values = _gather(v_pool, span.pool_rows)[:, None, : span.context_len]
                out[rows] = folded_attention(q[rows], keys, values, span.bias)
        q_len, first = meta.batch_query_len, len(meta.prefills)
        if self.in_place is not None and meta.block_tables.shape[0] > first:
            group = slice(meta.batch_start, None)
            tables, lens = meta.block_tables[first:], meta.context_lens[first:]
            out[group] = self.in_place(q[group], k_pool, v_pool, tables, lens, q_len)
            return out
        for bucket in meta.buckets:
            rows = slice(meta.batch_start + bucket.start * q_len, meta.batch_start + bucket.end * q_len)
            batch = bucket.end - bucket.start  # [Hkv, B * ctx, D] -> [Hkv, B, ctx, D], a view
            keys = _gather(k_pool, bucket.pool_rows).unflatten(1, (batch, -1))
            values = _gather(v_pool, bucket.pool_rows).unflatten(1, (batch, -1))
            out[rows] = folded_attention(q[rows], keys, values, bucket.bias)
        return out


def _pool_rows(block_ids: torch.Tensor, kv_heads: int, num_blocks: int) -> torch.Tensor:
    """Rows of one layer's pool viewed as ``[kv_heads * num_blocks, block_size * D]`` that hold
    ``block_ids``, head by head: ``[kv_heads * len(block_ids)]``.

    Gathering whole rows of that 2-D view is one contiguous copy per block, several times faster on
    CPU than ``index_select`` over the pool's second axis, and the result is still kv-heads outermost.
    """
    # student: begin chapter 05: the rows of the [kv_heads * num_blocks, ...] view holding block_ids, head by head
    heads = torch.arange(kv_heads, device=block_ids.device)[:, None] * num_blocks
    return (heads + block_ids[None, :]).reshape(-1)
    # student: end


def _gather(pool: torch.Tensor, pool_rows: torch.Tensor) -> torch.Tensor:
    """The blocks at ``pool_rows`` (see ``_pool_rows``) of one layer's pool, as ``[kv_heads, blocks * bs, D]``."""
    # student: begin chapter 05: gather the blocks at pool_rows as [kv_heads, blocks * block_size, D]
    kv_heads, num_blocks, block_size, head_dim = pool.shape
    rows = pool.view(kv_heads * num_blocks, block_size * head_dim).index_select(0, pool_rows)
    return rows.view(kv_heads, -1, head_dim)
    # student: end
