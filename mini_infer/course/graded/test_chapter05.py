"""Graded tests (chapter 05): the slot mapping, storing K/V into the pool and gathering it back."""

from __future__ import annotations

import random

import pytest
import torch
from graded_attention import dense_causal, small_config

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


def _split_partials(scores: torch.Tensor, values: torch.Tensor, width: int) -> tuple[torch.Tensor, ...]:
    """Each split's running maximum, sum and unnormalised output, as chapter 05c's kernel leaves them:
    scores ``[rows, keys]`` cut into splits of ``width`` keys."""
    maxima, sums, outputs = [], [], []
    for start in range(0, scores.shape[1], width):
        part = scores[:, start : start + width]
        top = part.amax(1, keepdim=True)
        maxima.append(top[:, 0])
        sums.append((part - top).exp().sum(1))
        outputs.append((part - top).exp() @ values[start : start + width])
    return torch.stack(maxima), torch.stack(sums), torch.stack(outputs)


@pytest.mark.points(2)
def test_combine_splits_gives_the_softmax_of_the_whole_context():
    from mini_infer.kv.attention_backend import combine_splits

    generator = torch.Generator().manual_seed(5)
    # The last case has scores in the hundreds: rescaling by anything but exp(max - overall max)
    # overflows there, as it would in a kernel.
    for splits, rows, dim, scale in [(1, 3, 4, 1.0), (3, 2, 5, 8.0), (5, 1, 8, 40.0), (2, 2, 3, 400.0)]:
        scores = torch.randn(rows, splits * 4, generator=generator, dtype=torch.float64) * scale
        values = torch.randn(splits * 4, dim, generator=generator, dtype=torch.float64)
        got = combine_splits(*_split_partials(scores, values, 4))
        torch.testing.assert_close(got, torch.softmax(scores, 1) @ values)
    # Leading dimensions (sequences, KV heads) pass through: [2, 3, splits, rows] -> [2, 3, rows, dim].
    scores = torch.randn(6, 2, 12, generator=generator, dtype=torch.float64)
    values = torch.randn(6, 12, 3, generator=generator, dtype=torch.float64)
    parts = [_split_partials(scores[i], values[i], 4) for i in range(6)]
    stacked = [torch.stack([p[j] for p in parts]).view(2, 3, *parts[0][j].shape) for j in range(3)]
    expected = (torch.softmax(scores, 2) @ values).view(2, 3, 2, 3)
    torch.testing.assert_close(combine_splits(*stacked), expected)


@pytest.mark.points(1)
def test_combine_splits_ignores_empty_splits_and_never_gives_nan():
    from mini_infer.kv.attention_backend import combine_splits

    scores = torch.tensor([[0.5, -1.0, 2.0, 0.0]], dtype=torch.float64)
    values = torch.arange(8, dtype=torch.float64).view(4, 2)
    row_max, row_sum, acc = _split_partials(scores, values, 2)
    empty = (torch.full((1, 1), float("-inf"), dtype=torch.float64), torch.zeros(1, 1, dtype=torch.float64))
    with_empty = (
        torch.cat([row_max, empty[0]]),
        torch.cat([row_sum, empty[1]]),
        torch.cat([acc, torch.zeros(1, 1, 2, dtype=torch.float64)]),
    )
    torch.testing.assert_close(combine_splits(*with_empty), torch.softmax(scores, 1) @ values)
    nothing = combine_splits(empty[0].expand(3, 1), empty[1].expand(3, 1), torch.zeros(3, 1, 2, dtype=torch.float64))
    assert torch.equal(nothing, torch.zeros(1, 2, dtype=torch.float64)), "a row that saw no key is zeros, not NaN"
