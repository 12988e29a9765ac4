import math

import pytest
import torch
from transformers import Qwen2Config
from transformers.models.qwen2 import modeling_qwen2 as hf

from mini_infer.layers import RotaryEmbedding, apply_rope, attention, rms_norm, silu_and_mul


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rms_norm_matches_transformers(dtype):
    x = torch.randn(5, 64).to(dtype) * 3
    norm = hf.Qwen2RMSNorm(64, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64))
        expected = norm(x)
    torch.testing.assert_close(rms_norm(x, norm.weight, 1e-6), expected, rtol=0, atol=0)


def test_rms_norm_fp16_does_not_overflow():
    # Squares of 300 overflow fp16's 65504 if summed in fp16; the reduction must be in fp32.
    x = torch.full((1, 4096), 300.0, dtype=torch.float16)
    out = rms_norm(x, torch.ones(4096, dtype=torch.float16), 1e-6)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), torch.ones(1, 4096), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("head_dim, theta", [(64, 1e6), (32, 1e4), (128, 1e6)])
def test_rope_matches_transformers(head_dim, theta):
    config = Qwen2Config(hidden_size=head_dim * 4, num_attention_heads=4, rope_theta=theta, max_position_embeddings=512)
    config.rope_parameters = {"rope_theta": theta, "rope_type": "default"}
    reference = hf.Qwen2RotaryEmbedding(config)
    positions = torch.tensor([0, 1, 7, 100, 511])
    q = torch.randn(len(positions), 4, head_dim)
    k = torch.randn(len(positions), 2, head_dim)
    cos_ref, sin_ref = reference(q, positions[None])
    q_ref, k_ref = hf.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos_ref, sin_ref)
    rope = RotaryEmbedding(head_dim, 512, theta)
    cos, sin = rope.cos_sin(positions, torch.float32)
    torch.testing.assert_close(apply_rope(q, cos, sin), q_ref[0].transpose(0, 1))
    torch.testing.assert_close(apply_rope(k, cos, sin), k_ref[0].transpose(0, 1))


def test_rope_preserves_norm_and_relative_angle():
    rope = RotaryEmbedding(64, 256, 1e4)
    q, k = torch.randn(1, 1, 64), torch.randn(1, 1, 64)

    def rotated_dot(m: int, n: int) -> float:
        cq, sq = rope.cos_sin(torch.tensor([m]), torch.float32)
        ck, sk = rope.cos_sin(torch.tensor([n]), torch.float32)
        return float((apply_rope(q, cq, sq) * apply_rope(k, ck, sk)).sum())

    cq, sq = rope.cos_sin(torch.tensor([37]), torch.float32)
    torch.testing.assert_close(apply_rope(q, cq, sq).norm(), q.norm())
    # The score depends only on the distance between positions: that is RoPE's point.
    assert math.isclose(rotated_dot(10, 3), rotated_dot(107, 100), rel_tol=1e-4)


def test_silu_and_mul():
    gate, up = torch.randn(3, 8), torch.randn(3, 8)
    torch.testing.assert_close(silu_and_mul(torch.cat([gate, up], -1)), torch.nn.functional.silu(gate) * up)


def _naive_attention(q, k, v, offset):
    """Expand K/V to every query head (repeat_kv) and mask by absolute positions."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    visible = torch.arange(k.shape[0])[None, :] <= (torch.arange(q.shape[0])[:, None] + offset)
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2), (14, 2), (12, 1)])
@pytest.mark.parametrize("num_queries, num_keys", [(1, 1), (1, 9), (5, 5), (3, 20)])
def test_gqa_attention_matches_naive(heads, kv_heads, num_queries, num_keys):
    q = torch.randn(num_queries, heads, 16)
    k, v = torch.randn(num_keys, kv_heads, 16), torch.randn(num_keys, kv_heads, 16)
    expected = _naive_attention(q, k, v, offset=num_keys - num_queries)
    torch.testing.assert_close(attention(q, k, v, causal=True), expected, rtol=1e-5, atol=1e-5)
