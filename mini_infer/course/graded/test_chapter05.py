"""Graded tests (chapter 05): the slot mapping, storing K/V into the pool and gathering it back."""

from __future__ import annotations

import random

import pytest
import torch
from graded_helpers import dense_causal, small_config

from mini_infer.kv.block_pool import BlockTable, slot_for, slot_mapping
from mini_infer.kv.paged_attention import PagedAttention, PagedKVCache, _gather, _pool_rows, build_metadata

BLOCK = 4


@pytest.mark.points(2)
def test_slot_mapping_by_hand():
    table = [7, 2, 5]
    assert slot_mapping(table, 0, 12, 4) == [28, 29, 30, 31, 8, 9, 10, 11, 20, 21, 22, 23]
    assert slot_mapping(table, 3, 6, 4) == [31, 8, 9]
    assert slot_mapping(table, 5, 5, 4) == []
    assert slot_mapping([3, 0], 2, 5, 3) == [11, 0, 1]
    assert slot_for(table, 9, 4) == 21
    assert BlockTable([4, 1]).slots(1, 3, 2) == [9, 2]


@pytest.mark.points(1)
def test_slot_mapping_refuses_positions_outside_the_table():
    for start, end in [(0, 13), (11, 13), (-1, 2), (5, 4)]:
        with pytest.raises(IndexError):
            slot_mapping([7, 2, 5], start, end, 4)
    assert slot_mapping([7, 2, 5], 12, 12, 4) == []


@pytest.mark.points(1)
def test_pool_rows():
    assert _pool_rows(torch.tensor([3, 1]), 2, 5).tolist() == [3, 1, 8, 6]
    assert _pool_rows(torch.tensor([0, 4, 2]), 3, 6).tolist() == [0, 4, 2, 6, 10, 8, 12, 16, 14]


@pytest.mark.points(2)
def test_gather_copies_whole_blocks_head_by_head():
    torch.manual_seed(0)
    pool = torch.randn(2, 5, 4, 3)  # [kv_heads, blocks, block_size, D]
    blocks = [3, 1, 4]
    got = _gather(pool, _pool_rows(torch.tensor(blocks), 2, 5))
    assert got.shape == (2, 12, 3)
    for h in range(2):
        assert torch.equal(got[h], torch.cat([pool[h, b] for b in blocks]))


@pytest.mark.points(4)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_store_then_attend_through_the_pool(seed):
    """A ragged step (chunks with and without cached context, a decode group): every new token's
    K/V lands in its slot, in the layer attended, and attention equals dense causal attention."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    heads, kv_heads = [(4, 2), (2, 2), (6, 1)][seed]
    cache = PagedKVCache(
        small_config(heads, kv_heads), num_blocks=48, block_size=BLOCK, dtype=torch.float32, device="cpu"
    )
    free = list(range(48))
    rng.shuffle(free)
    sequences: list[tuple[int, int, list[int], torch.Tensor, torch.Tensor]] = []  # (context_len, num_new, table, k, v)
    for num_new in [rng.randint(2, 9), rng.randint(2, 9), 1, 1, 1]:
        cached = 0 if len(sequences) == 0 else rng.randint(1, 10)
        ctx = cached + num_new
        table = [free.pop() for _ in range(-(-ctx // BLOCK))]
        k, v = torch.randn(ctx, kv_heads, 8), torch.randn(ctx, kv_heads, 8)
        for pos in range(cached):
            cache.k[1, :, table[pos // BLOCK], pos % BLOCK] = k[pos]
            cache.v[1, :, table[pos // BLOCK], pos % BLOCK] = v[pos]
        sequences.append((ctx, num_new, table, k, v))
    prefills, batch = sequences[:2], sequences[2:]
    meta = build_metadata(
        prefills=[(n, c, t) for c, n, t, _, _ in prefills],
        batch=[(c, t) for c, _, t, _, _ in batch],
        batch_query_len=1,
        cache=cache,
        num_heads=heads,
    )
    q = torch.randn(sum(s[1] for s in sequences), heads, 8)
    new_k = torch.cat([k[c - n :] for c, n, _, k, _ in sequences])
    new_v = torch.cat([v[c - n :] for c, n, _, _, v in sequences])
    layer0_before = cache.k[0].clone()
    out = PagedAttention(cache, meta)(1, q, new_k, new_v)
    assert torch.equal(cache.k[0], layer0_before), "another layer's pool was written"
    start = 0
    for ctx, num_new, table, k, v in sequences:
        for pos in range(ctx):
            assert torch.equal(cache.k[1, :, table[pos // BLOCK], pos % BLOCK], k[pos])
            assert torch.equal(cache.v[1, :, table[pos // BLOCK], pos % BLOCK], v[pos])
        expected = dense_causal(q[start : start + num_new], k, v)
        torch.testing.assert_close(out[start : start + num_new], expected, atol=1e-5, rtol=1e-5)
        start += num_new
