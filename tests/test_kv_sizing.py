"""Sizing the KV pool from a memory budget (chapter 05): the arithmetic, the draft's share, the cap."""

import pytest
import torch

from mini_infer.config import ModelConfig
from mini_infer.kv.paged_attention import PagedKVCache
from mini_infer.kv.sizing import kv_blocks_for_memory


def _config(layers: int, kv_heads: int, head_dim: int) -> ModelConfig:
    return ModelConfig(
        vocab_size=100, hidden_size=kv_heads * head_dim, intermediate_size=8, num_hidden_layers=layers,
        num_attention_heads=kv_heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        max_position_embeddings=4096, rope_theta=1e4, rms_norm_eps=1e-6, tie_word_embeddings=True, torch_dtype=None,
    )  # fmt: skip


QWEN_1_5B = _config(28, 2, 128)  # the Qwen2.5-1.5B target's KV shape
QWEN_0_5B = _config(24, 2, 64)  # the Qwen2.5-0.5B draft's


def blocks(configs, memory, **overrides):
    settings = dict(block_size=16, dtype=torch.float16, device=torch.device("cpu"), max_num_seqs=256)
    settings |= dict(max_model_len=4096, max_num_batched_tokens=512, kv_cache_memory=memory) | overrides
    return kv_blocks_for_memory(configs, **settings)


def test_bytes_per_block_of_the_real_shapes():
    # 2 (K, V) x 28 layers x 2 KV heads x 16 slots x 128 dims x 2 bytes
    assert PagedKVCache.bytes_per_block(QWEN_1_5B, 16, torch.float16) == 458_752
    assert PagedKVCache.bytes_per_block(QWEN_0_5B, 16, torch.float16) == 196_608


def test_a_draft_makes_every_block_cost_both_pools():
    gib = 2**30
    assert blocks([QWEN_1_5B], gib) == gib // 458_752
    assert blocks([QWEN_1_5B, QWEN_0_5B], gib) == gib // (458_752 + 196_608)


def test_never_more_blocks_than_the_sequences_can_use():
    assert blocks([QWEN_1_5B], 2**40, max_num_seqs=3, max_model_len=100) == 3 * 7  # ceil(100 / 16) = 7 each


def test_a_budget_without_room_for_one_block_is_a_clear_error():
    with pytest.raises(MemoryError, match="num_kv_blocks"):
        blocks([QWEN_1_5B], 1000)
