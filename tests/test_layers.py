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


def test_attention_kernels_are_chosen_per_gpu_and_dtype(monkeypatch):
    """A T4 (sm_75) in float16 gets the memory-efficient kernel, Ampere and later flash first,
    a CPU its own flash kernel; math is always the last resort. The capability is mocked."""
    from torch.nn.attention import SDPBackend

    from mini_infer.layers import sdpa_backends

    flash, efficient, math = SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH
    cuda = torch.device("cuda")
    assert sdpa_backends(torch.device("cpu"), torch.bfloat16) == [flash, math]
    cases = {
        ((7, 5), torch.float16): [efficient, math],  # a T4: no flash kernel before sm_80
        ((7, 5), torch.float32): [efficient, math],
        ((8, 0), torch.bfloat16): [flash, efficient, math],  # A100
        ((8, 9), torch.float16): [flash, efficient, math],  # L4
        ((9, 0), torch.float32): [efficient, math],  # flash kernels take half precision only
    }
    for (capability, dtype), kernels in cases.items():
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert sdpa_backends(cuda, dtype) == kernels, (capability, dtype)
        assert sdpa_backends(cuda, dtype, capability) == kernels
    with pytest.raises(ValueError, match="float16"):
        sdpa_backends(cuda, torch.bfloat16, (7, 5))


def test_the_fold_runs_on_each_chosen_cpu_kernel():
    """The layout the engine uses (the fold, with an additive mask) on the CPU's kernels, flash
    and math alike, equals attention with K/V expanded to every query head."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from mini_infer.layers import attention

    q, k, v = torch.randn(5, 6, 16), torch.randn(9, 2, 16), torch.randn(9, 2, 16)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.transpose(0, 1).repeat_interleave(3, 0),
        v.transpose(0, 1).repeat_interleave(3, 0),
        attn_mask=torch.ones(5, 9, dtype=torch.bool).tril(diagonal=4),
    ).transpose(0, 1)
    for kernel in (SDPBackend.FLASH_ATTENTION, SDPBackend.MATH):
        with sdpa_kernel([kernel]):
            torch.testing.assert_close(attention(q, k, v, causal=True), expected)
