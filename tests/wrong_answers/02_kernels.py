"""Chapter 02's exercises answered wrongly, as a student plausibly would (see scripts/wrong_answers.py)."""

WRONG_ANSWERS = {
    "fold-norm-solution": [
        # Scales the rows of W (its output features) instead of the columns that read x's features.
        "return W * norm_weight[:, None]",
        # Divides by the weight, as if undoing the norm instead of moving it.
        "return W / norm_weight[None, :]",
        # Right numbers, but scales W in place: every other user of W now gets a wrong matrix.
        "W.mul_(norm_weight[None, :])\nreturn W",
    ],
    "rope-solution": [
        # Rotates adjacent pairs (2i, 2i + 1), the original paper's layout, not Qwen2's halves.
        """
head_dim = x.shape[-1]
inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
angles = torch.outer(positions.float(), inv_freq)[:, None, :]
cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
x1, x2 = x[..., 0::2], x[..., 1::2]
return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
""",
        # Forgets the factor 2 in the exponent: pair i turns by position * theta ** (-i / head_dim).
        """
head_dim = x.shape[-1]
inv_freq = 1.0 / (theta ** (torch.arange(head_dim // 2, dtype=torch.float32) / head_dim))
angles = torch.outer(positions.float(), inv_freq)
angles = torch.cat((angles, angles), dim=-1)[:, None, :]
return x * angles.cos().to(x.dtype) + rotate_half(x) * angles.sin().to(x.dtype)
""",
        # Computes the angles in x's dtype: in bfloat16, position * frequency loses whole radians.
        """
head_dim = x.shape[-1]
inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
angles = torch.outer(positions.to(x.dtype), inv_freq.to(x.dtype))
angles = torch.cat((angles, angles), dim=-1)[:, None, :]
return x * angles.cos() + rotate_half(x) * angles.sin()
""",
        # Calls the package's own RoPE instead of writing it.
        """
rope = RotaryEmbedding(x.shape[-1], int(positions.max()) + 1, theta)
cos, sin = rope.cos_sin(positions, x.dtype)
return apply_rope(x, cos, sin)
""",
    ],
    "kv-head-solution": [
        # Interleaves the groups: query head h reads KV head h % num_kv_heads.
        "return head % num_kv_heads",
        # Divides by the number of KV heads instead of the group size.
        "return head // num_kv_heads",
        # Off by one: counts heads from 1 when cutting them into groups.
        "return (head + 1) * num_kv_heads // num_heads",
    ],
}
