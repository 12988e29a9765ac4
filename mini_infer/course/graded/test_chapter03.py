"""Graded tests (chapter 03): a contiguous KV cache gives the same attention as recomputing."""

from __future__ import annotations

import pytest
import torch
from graded_helpers import dense_causal, small_config

from mini_infer.model import ContiguousKVCache


@pytest.mark.points(3)
def test_prefill_then_decode_equals_attention_over_everything():
    torch.manual_seed(0)
    cache = ContiguousKVCache(small_config(max_positions=64), max_len=16, dtype=torch.float32, device="cpu")
    k_all, v_all = torch.randn(2, 9, 2, 8), torch.randn(2, 9, 2, 8)
    q_all = torch.randn(2, 9, 4, 8)
    for start, end in [(0, 5), (5, 6), (6, 7), (7, 9)]:
        for layer in range(2):
            out = cache(layer, q_all[layer, start:end], k_all[layer, start:end], v_all[layer, start:end])
            expected = dense_causal(q_all[layer, start:end], k_all[layer, :end], v_all[layer, :end])
            torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
        cache.advance(end - start)
        assert cache.length == end
    for layer in range(2):
        torch.testing.assert_close(cache.k[layer, :9], k_all[layer])
        torch.testing.assert_close(cache.v[layer, :9], v_all[layer])


@pytest.mark.points(1)
def test_layers_are_stored_apart():
    cache = ContiguousKVCache(small_config(max_positions=64), max_len=4, dtype=torch.float32, device="cpu")
    ones, twos = torch.ones(2, 2, 8), torch.full((2, 2, 8), 2.0)
    cache(0, torch.zeros(2, 4, 8), ones, ones)
    cache(1, torch.zeros(2, 4, 8), twos, twos)
    cache.advance(2)
    assert cache.k[0, :2].eq(1).all() and cache.k[1, :2].eq(2).all()
    assert cache.v[0, :2].eq(1).all() and cache.v[1, :2].eq(2).all()


@pytest.mark.points(1)
def test_a_cache_refuses_more_than_it_holds():
    cache = ContiguousKVCache(small_config(layers=1, max_positions=64), max_len=3, dtype=torch.float32, device="cpu")
    cache(0, torch.zeros(3, 4, 8), torch.zeros(3, 2, 8), torch.zeros(3, 2, 8))
    cache.advance(3)
    with pytest.raises(ValueError):
        cache(0, torch.zeros(1, 4, 8), torch.zeros(1, 2, 8), torch.zeros(1, 2, 8))
