"""Graded tests (chapter 02): RMSNorm, RoPE, SwiGLU, masks and grouped-query attention.

Every expected value is computed here from the formulas of the chapter, head by head and query
by query, with plain loops where that is clearer than speed.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from mini_infer.layers import (
    RotaryEmbedding,
    apply_rope,
    attention,
    causal_mask,
    folded_attention,
    folded_bias,
    rms_norm,
    rotate_half,
    silu_and_mul,
)


def reference_attention(q, k, v, visible):
    """Head by head: softmax(q k^T / sqrt(D) masked by ``visible``) v, query head h reading KV head h // group."""
    num_queries, heads, dim = q.shape
    group = heads // k.shape[1]
    out = torch.empty_like(q)
    for h in range(heads):
        scores = q[:, h] @ k[:, h // group].T / math.sqrt(dim)
        scores = scores.masked_fill(~visible, float("-inf"))
        out[:, h] = scores.softmax(-1) @ v[:, h // group]
    return out


def causal_visible(num_queries, num_keys):
    return torch.tensor([[key <= num_keys - num_queries + i for key in range(num_keys)] for i in range(num_queries)])


@pytest.mark.points(2)
def test_rms_norm_matches_the_formula():
    torch.manual_seed(0)
    x, weight = torch.randn(5, 16) * 3, torch.randn(16)
    x3 = torch.randn(2, 3, 16)  # the statistics are over the last axis, whatever the rank
    torch.testing.assert_close(
        rms_norm(x3, weight, 1e-6), weight * x3 / torch.sqrt((x3 * x3).mean(-1, keepdim=True) + 1e-6)
    )
    for eps in (1e-6, 0.5):
        expected = weight * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
        torch.testing.assert_close(rms_norm(x, weight, eps), expected)


@pytest.mark.points(1)
def test_rms_norm_statistics_in_float32_result_in_the_weights_dtype():
    x = torch.full((2, 8), 300.0, dtype=torch.float16)  # 300**2 overflows a float16 sum
    weight = torch.ones(8, dtype=torch.float16)
    out = rms_norm(x, weight, 1e-6)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out, torch.ones(2, 8, dtype=torch.float16))
    assert rms_norm(torch.randn(3, 8), torch.ones(8, dtype=torch.bfloat16), 1e-6).dtype == torch.bfloat16


@pytest.mark.points(1)
def test_silu_and_mul():
    torch.manual_seed(1)
    gate_up = torch.randn(4, 3, 10)
    gate, up = gate_up[..., :5], gate_up[..., 5:]
    expected = gate * torch.sigmoid(gate) * up
    out = silu_and_mul(gate_up)
    assert out.shape == (4, 3, 5)
    torch.testing.assert_close(out, expected)


@pytest.mark.points(1)
def test_rotate_half():
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]])
    assert rotate_half(x).tolist() == [[-4.0, -5.0, -6.0, 1.0, 2.0, 3.0]]


@pytest.mark.points(2)
def test_rope_table():
    head_dim, theta = 8, 500.0
    rope = RotaryEmbedding(head_dim, 12, theta)
    assert rope.cos.shape == rope.sin.shape == (12, head_dim)
    for position in (0, 1, 7, 11):
        for i in range(head_dim // 2):
            angle = position * theta ** (-2 * i / head_dim)
            for column in (i, i + head_dim // 2):
                assert rope.cos[position, column].item() == pytest.approx(math.cos(angle), abs=1e-5)
                assert rope.sin[position, column].item() == pytest.approx(math.sin(angle), abs=1e-5)


@pytest.mark.points(2)
def test_apply_rope_rotates_each_pair():
    torch.manual_seed(2)
    head_dim = 8
    rope = RotaryEmbedding(head_dim, 32, 10000.0)
    x = torch.randn(3, 2, head_dim)
    positions = torch.tensor([0, 5, 31])
    cos, sin = rope.cos_sin(positions, torch.float32)
    out = apply_rope(x, cos, sin)
    half = head_dim // 2
    for t, position in enumerate(positions.tolist()):
        for i in range(half):
            angle = position * 10000.0 ** (-2 * i / head_dim)
            a, b = x[t, :, i], x[t, :, i + half]
            torch.testing.assert_close(out[t, :, i], a * math.cos(angle) - b * math.sin(angle), atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(
                out[t, :, i + half], a * math.sin(angle) + b * math.cos(angle), atol=1e-5, rtol=1e-5
            )


@pytest.mark.points(1)
def test_rope_scores_depend_only_on_the_distance():
    torch.manual_seed(3)
    rope = RotaryEmbedding(16, 64, 10000.0)
    q, k = torch.randn(1, 1, 16), torch.randn(1, 1, 16)

    def score(pq, pk):
        cq, sq = rope.cos_sin(torch.tensor([pq]), torch.float32)
        ck, sk = rope.cos_sin(torch.tensor([pk]), torch.float32)
        return (apply_rope(q, cq, sq) * apply_rope(k, ck, sk)).sum().item()

    assert score(10, 7) == pytest.approx(score(40, 37), abs=1e-4)
    assert score(10, 7) != pytest.approx(score(10, 2), abs=1e-3)


@pytest.mark.points(2)
def test_causal_mask():
    assert causal_mask(3, 3).tolist() == causal_visible(3, 3).tolist()
    assert causal_mask(2, 5).tolist() == [[True, True, True, True, False], [True, True, True, True, True]]
    assert causal_mask(1, 4).tolist() == [[True] * 4]
    assert causal_mask(4, 6).dtype == torch.bool
    per_context = causal_mask(2, 4, context_lens=torch.tensor([3, 4]))  # a batch: keys past a context are masked
    assert per_context.tolist() == [
        [[True, True, False, False], [True, True, True, False]],
        [[True] * 3 + [False], [True] * 4],
    ]


@pytest.mark.points(2)
def test_folded_bias():
    mask = torch.tensor([[True, False, True], [False, True, True]])
    bias = folded_bias(mask, 3, torch.float32)
    assert bias.shape == (6, 3)  # the rows once per query head of the group
    expected = torch.tensor([[0.0, float("-inf"), 0.0], [float("-inf"), 0.0, 0.0]]).repeat(3, 1)
    assert torch.equal(bias, expected)
    single = folded_bias(torch.tensor([[True, False]]), 4, torch.float16)
    assert single.shape == (1, 2) and single.dtype == torch.float16  # one row broadcasts
    assert torch.equal(folded_bias(mask, 1, torch.float32), expected[:2])
    batched = torch.stack([mask, ~mask])[None]  # [1, 2, 2, 3]: a batch of masks, as paged attention folds them
    bias = folded_bias(batched, 2, torch.float32)
    assert bias.shape == (1, 2, 4, 3)
    assert torch.equal(bias[0, 1], torch.where(~mask, 0.0, float("-inf")).repeat(2, 1))


@pytest.mark.points(2)
@pytest.mark.parametrize("case", [(4, 2, 3, 7), (6, 1, 5, 5), (2, 2, 1, 9), (8, 2, 4, 4), (4, 4, 2, 6)])
def test_attention_causal(case):
    heads, kv_heads, num_queries, num_keys = case
    torch.manual_seed(sum(case))
    q = torch.randn(num_queries, heads, 8)
    k, v = torch.randn(num_keys, kv_heads, 8), torch.randn(num_keys, kv_heads, 8)
    expected = reference_attention(q, k, v, causal_visible(num_queries, num_keys))
    torch.testing.assert_close(attention(q, k, v, causal=True), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.points(2)
def test_attention_under_a_mask_and_without_one():
    torch.manual_seed(4)
    q, k, v = torch.randn(3, 4, 8), torch.randn(6, 2, 8), torch.randn(6, 2, 8)
    visible = torch.rand(3, 6) > 0.4
    visible[:, 0] = True
    torch.testing.assert_close(attention(q, k, v, causal=True, mask=visible), reference_attention(q, k, v, visible))
    square = torch.rand(6, 6) > 0.5  # as many queries as keys: the mask still rules, not the causal shortcut
    square[:, 2] = True
    q6 = torch.randn(6, 4, 8)
    torch.testing.assert_close(attention(q6, k, v, causal=True, mask=square), reference_attention(q6, k, v, square))
    everything = torch.ones(3, 6, dtype=torch.bool)
    torch.testing.assert_close(attention(q, k, v, causal=False), reference_attention(q, k, v, everything))


@pytest.mark.points(2)
def test_folded_attention_with_a_bias():
    torch.manual_seed(5)
    q, k, v = torch.randn(3, 6, 8), torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    visible = causal_visible(3, 5)
    bias = folded_bias(visible, 3, torch.float32)[None, None]
    torch.testing.assert_close(folded_attention(q, k, v, bias), reference_attention(q, k, v, visible))
    everything = torch.ones(3, 5, dtype=torch.bool)
    torch.testing.assert_close(folded_attention(q, k, v), reference_attention(q, k, v, everything))
    # A batch of 3 sequences of 2 queries, keys kv-heads outermost ([Hkv, B, keys, D]), one mask each.
    q, k, v = torch.randn(6, 6, 8), torch.randn(2, 3, 5, 8), torch.randn(2, 3, 5, 8)
    visible = causal_mask(2, 5, context_lens=torch.tensor([3, 5, 4]))
    got = folded_attention(q, k, v, folded_bias(visible[None], 3, torch.float32))
    for b in range(3):
        keys, values = k[:, b].transpose(0, 1), v[:, b].transpose(0, 1)
        expected = reference_attention(q[2 * b : 2 * b + 2], keys, values, visible[b])
        torch.testing.assert_close(got[2 * b : 2 * b + 2], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.points(1)
def test_attention_keeps_the_dtype():
    q, k, v = (torch.randn(4, 2, 8, dtype=torch.bfloat16) for _ in range(3))
    out = attention(q, k, v, causal=True)
    assert out.shape == (4, 2, 8) and out.dtype == torch.bfloat16
    expected = F.scaled_dot_product_attention(
        q.float().transpose(0, 1), k.float().transpose(0, 1), v.float().transpose(0, 1), is_causal=True
    ).transpose(0, 1)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)
