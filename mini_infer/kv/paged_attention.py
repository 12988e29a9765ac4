"""Paged attention: K/V stored in 16-token blocks, one flat forward for every kind of step (chapter 05).

The KV cache of every layer lives in one tensor allocated once (``PagedKVCache``), shaped
``[kv_heads, num_blocks, block_size, head_dim]`` per layer for K and for V. A sequence owns a
*block table*: its logical block ``i`` (positions ``16 i .. 16 i + 15``) lives in physical block
``block_table[i]``. Token ``p`` of a sequence therefore lives in slot
``block_table[p // 16] * 16 + p % 16``: the *slot mapping* of the new tokens tells the cache
where to write them.

One forward serves a flat batch of ``T`` new tokens from many sequences. ``PagedAttentionMetadata``
describes it, and is passed explicitly (no global context):

* ``slot_mapping[T]``: where each new token's K and V are written, in every layer;
* ``prefills``: sequences computed with more than one query (prompt chunks, possibly after a
  cached prefix); each is attended on its own, causally, with the query offset by the cached
  context. When a chunk has no cached context it attends over its own fresh K/V directly.
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
head 0, then for head 1, ...) is one contiguous copy per block, 2-3x faster on CPU than
``index_select`` over the pool's block axis. The result is kv-heads outermost, already in the
``[kv_heads, batch, context, head_dim]`` order attention wants: no transpose copy. The rows to
gather and each bucket's additive mask are computed once per step, not once per layer; with both,
a decode step of the 0.5B-shaped model at 64 sequences took 12-13% less time (two runs,
alternating the old and the new code step by step).

Invariant: attending through the pool gives the same result as dense causal attention over each
sequence's full K/V (tests/test_paged_attention.py checks it on ragged batches, chunks that
start mid-block included).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from mini_infer.config import ModelConfig
from mini_infer.kv.block_pool import num_blocks_for
from mini_infer.layers import attention, causal_mask, folded_attention, folded_bias


class PagedKVCache:
    """The K and V pools of every layer: ``[layers, kv_heads, num_blocks, block_size, head_dim]``."""

    def __init__(
        self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        shape = (config.num_hidden_layers, config.num_key_value_heads, num_blocks, block_size, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_blocks = num_blocks
        self.block_size = block_size

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        """Bytes one block costs across all layers, K and V: what a memory budget divides by."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * config.num_hidden_layers * config.num_key_value_heads * block_size * config.head_dim * itemsize

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


@dataclass(slots=True)
class PrefillSpan:
    """One sequence attended on its own: ``num_tokens`` new queries at the end of ``context_len``."""

    token_start: int
    num_tokens: int
    context_len: int
    # The blocks that hold its context_len tokens; None when the chunk has no cached context to read back.
    block_table: torch.Tensor | None


# A bucket is worth its extra gather and SDPA call only with enough rows in it.
MIN_ROWS_PER_BUCKET = 16
MAX_BUCKETS = 4


@dataclass(slots=True)
class BatchBucket:
    """Rows ``[start, end)`` of the batched group, padded only to their own longest context."""

    start: int
    end: int
    block_ids: torch.Tensor  # [(end - start) * num_blocks] long: the rows' padded tables, flattened
    mask: torch.Tensor  # [1, end - start, Q, num_blocks * block_size] bool, True = attend


@dataclass(slots=True)
class PagedAttentionMetadata:
    slot_mapping: torch.Tensor  # [T] long
    prefills: list[PrefillSpan] = field(default_factory=list)
    batch_start: int = 0  # first token of the batched group
    batch_query_len: int = 1  # Q new tokens per sequence of the group
    batch_block_tables: torch.Tensor | None = None  # [B, max_blocks] long, padded with block 0
    batch_mask: torch.Tensor | None = None  # [1, B, Q, max_blocks * block_size] bool, True = attend
    batch_buckets: list[BatchBucket] = field(default_factory=list)  # consecutive rows, one SDPA call each

    @property
    def batch_size(self) -> int:
        return 0 if self.batch_block_tables is None else self.batch_block_tables.shape[0]


def build_metadata(
    *,
    prefills: Sequence[tuple[int, int, Sequence[int]]],
    batch: Sequence[tuple[int, Sequence[int]]],
    batch_query_len: int,
    block_size: int,
    device: torch.device | str,
) -> PagedAttentionMetadata:
    """Metadata for a flat batch: ``prefills`` then ``batch``.

    ``prefills``: ``(num_new_tokens, context_len, block_table)`` per sequence, where
    ``context_len`` counts the new tokens too. ``batch``: ``(context_len, block_table)`` per
    sequence of the batched group, each bringing ``batch_query_len`` new tokens. Everything is
    assembled in Python lists and sent to the device once.
    """
    slots: list[int] = []
    spans: list[PrefillSpan] = []
    token = 0
    for num_new, context_len, table in prefills:
        for pos in range(context_len - num_new, context_len):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
        read_back = context_len > num_new
        table_tensor = torch.tensor(list(table[: num_blocks_for(context_len, block_size)]), dtype=torch.long, device=device) if read_back else None
        spans.append(PrefillSpan(token, num_new, context_len, table_tensor))
        token += num_new
    metadata = PagedAttentionMetadata(slot_mapping=torch.empty(0), prefills=spans, batch_start=token, batch_query_len=batch_query_len)
    if batch:
        q = batch_query_len
        blocks_needed = [num_blocks_for(ctx, block_size) for ctx, _ in batch]
        max_blocks = max(blocks_needed)
        padded_tables = []
        context_lens = []
        for (context_len, table), used_blocks in zip(batch, blocks_needed):
            for pos in range(context_len - q, context_len):
                slots.append(table[pos // block_size] * block_size + pos % block_size)
            used = list(table[:used_blocks])
            padded_tables.append(used + [0] * (max_blocks - len(used)))
            context_lens.append(context_len)
        metadata.batch_block_tables = torch.tensor(padded_tables, dtype=torch.long, device=device)
        ctx = torch.tensor(context_lens, dtype=torch.long, device=device)
        keys = torch.arange(max_blocks * block_size, device=device)
        # Query i of a sequence sits at position ctx - q + i and may see keys up to there;
        # keys past the sequence's own context (padding blocks) are masked out by the same rule.
        last_visible = ctx[:, None] - q + torch.arange(q, device=device)[None, :]  # [B, Q]
        metadata.batch_mask = (keys[None, None, :] <= last_visible[:, :, None]).unsqueeze(0)
        for start, end in _bucket_bounds(len(batch)):
            width = max(blocks_needed[start:end])
            tables = metadata.batch_block_tables[start:end, :width].reshape(-1)
            mask = metadata.batch_mask[:, start:end, :, : width * block_size].contiguous()
            metadata.batch_buckets.append(BatchBucket(start, end, tables, mask))
    metadata.slot_mapping = torch.tensor(slots, dtype=torch.long, device=device)
    return metadata


def _bucket_bounds(num_rows: int) -> list[tuple[int, int]]:
    """``[start, end)`` of equal runs of consecutive rows: one bucket per ``MIN_ROWS_PER_BUCKET``
    rows, at most ``MAX_BUCKETS``."""
    count = max(1, min(MAX_BUCKETS, num_rows // MIN_ROWS_PER_BUCKET))
    bounds = [round(i * num_rows / count) for i in range(count + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


class PagedAttention:
    """The attention backend of a paged forward: ``model.forward(ids, positions, PagedAttention(cache, meta))``.

    Built once per step: everything that is the same in every layer (where the new tokens go,
    which rows of the pool each gather reads, the masks of the chunks and buckets in SDPA's
    additive form) is computed once, not per layer.
    """

    def __init__(self, cache: PagedKVCache, metadata: PagedAttentionMetadata) -> None:
        self.cache = cache
        self.meta = metadata
        self._block_of_slot = metadata.slot_mapping // cache.block_size
        self._offset_of_slot = metadata.slot_mapping % cache.block_size
        kv_heads = cache.k.shape[1]
        self._span_rows = [None if span.block_table is None else _pool_rows(span.block_table, kv_heads, cache.num_blocks) for span in metadata.prefills]
        self._bucket_rows = [_pool_rows(bucket.block_ids, kv_heads, cache.num_blocks) for bucket in metadata.batch_buckets]
        # Masks in the fold's row order need the number of query heads per KV head, which the
        # first layer's q tells: built then, and reused by every other layer.
        self._group = 0
        self._span_bias: list[torch.Tensor | None] = []
        self._bucket_bias: list[torch.Tensor] = []

    def _build_masks(self, group: int, dtype: torch.dtype) -> None:
        device = self.meta.slot_mapping.device
        self._span_bias = [
            # A single query after its prefix sees every key: no mask at all.
            None if rows is None or span.num_tokens == 1 else folded_bias(causal_mask(span.num_tokens, span.context_len, device), group, dtype)[None, None]
            for span, rows in zip(self.meta.prefills, self._span_rows)
        ]
        self._bucket_bias = [folded_bias(bucket.mask, group, dtype) for bucket in self.meta.batch_buckets]
        self._group = group

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_pool, v_pool = self.cache.k[layer], self.cache.v[layer]  # [Hkv, blocks, bs, D]
        # Write every new token's K/V into its slot first: a chunk then reads itself back
        # through the same blocks as its cached prefix.
        k_pool[:, self._block_of_slot, self._offset_of_slot] = k.transpose(0, 1)
        v_pool[:, self._block_of_slot, self._offset_of_slot] = v.transpose(0, 1)

        group = q.shape[1] // k.shape[1]
        if group != self._group:
            self._build_masks(group, q.dtype)
        out = torch.empty_like(q)
        for span, pool_rows, bias in zip(self.meta.prefills, self._span_rows, self._span_bias):
            rows = slice(span.token_start, span.token_start + span.num_tokens)
            if pool_rows is None:
                out[rows] = attention(q[rows], k[rows], v[rows], causal=True)
            else:
                # [Hkv, blocks * bs, D] -> the first context_len keys, [context_len, Hkv, D]
                keys = _gather(k_pool, pool_rows)[:, : span.context_len].transpose(0, 1)
                values = _gather(v_pool, pool_rows)[:, : span.context_len].transpose(0, 1)
                out[rows] = folded_attention(q[rows], keys, values, bias)
        q_len = self.meta.batch_query_len
        for bucket, pool_rows, bias in zip(self.meta.batch_buckets, self._bucket_rows, self._bucket_bias):
            rows = slice(self.meta.batch_start + bucket.start * q_len, self.meta.batch_start + bucket.end * q_len)
            out[rows] = self._batched(q[rows], bucket.end - bucket.start, _gather(k_pool, pool_rows), _gather(v_pool, pool_rows), bias)
        return out

    def _batched(self, q: torch.Tensor, batch: int, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """Attention for a bucket of B sequences with Q new tokens each: one SDPA call over their
        gathered blocks (``keys``, ``values``: ``[Hkv, B * ctx, D]``)."""
        num_q = self.meta.batch_query_len
        kv_heads, _, head_dim = keys.shape
        heads = q.shape[1]
        group = heads // kv_heads
        keys = keys.view(kv_heads, batch, -1, head_dim)  # a view: the gather is kv-heads outermost
        values = values.view(kv_heads, batch, -1, head_dim)
        # q: [B*Q, H, D] -> [Hkv, B, g*Q, D]: the g query heads sharing a KV head become rows.
        qf = q.view(batch, num_q, kv_heads, group, head_dim).permute(2, 0, 3, 1, 4).reshape(kv_heads, batch, group * num_q, head_dim)
        out = F.scaled_dot_product_attention(qf, keys, values, attn_mask=bias)
        # [Hkv, B, g*Q, D] -> [B*Q, H, D]
        return out.view(kv_heads, batch, group, num_q, head_dim).permute(1, 3, 0, 2, 4).reshape(batch * num_q, heads, head_dim)


def _pool_rows(block_ids: torch.Tensor, kv_heads: int, num_blocks: int) -> torch.Tensor:
    """Rows of one layer's pool viewed as ``[kv_heads * num_blocks, block_size * D]`` that hold
    ``block_ids``, head by head: ``[kv_heads * len(block_ids)]``.

    Gathering whole rows of that 2-D view is one contiguous copy per block, 2-3x faster on CPU
    than ``index_select`` over the pool's second axis, and the result is still kv-heads outermost.
    """
    heads = torch.arange(kv_heads, device=block_ids.device)[:, None] * num_blocks
    return (heads + block_ids[None, :]).reshape(-1)


def _gather(pool: torch.Tensor, pool_rows: torch.Tensor) -> torch.Tensor:
    """The blocks at ``pool_rows`` (see ``_pool_rows``) of one layer's pool, as ``[kv_heads, blocks * bs, D]``."""
    kv_heads, num_blocks, block_size, head_dim = pool.shape
    rows = pool.view(kv_heads * num_blocks, block_size * head_dim).index_select(0, pool_rows)
    return rows.view(kv_heads, -1, head_dim)
