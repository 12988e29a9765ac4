"""What the graded tests of chapters 03 and 05 share (chapter 03): a small model shape, and the
dense causal attention that cached (03) and paged (05) attention must equal.

Copied beside the graded tests wherever they run (``grade.copy_graded_tests``): the grader's
temporary folder and a student package's ``tests/``. It is never imported from the package being
graded, so a student's copy of it cannot change what the tests expect.
"""

from __future__ import annotations

import math

import torch

from mini_infer.config import ModelConfig


def small_config(heads: int = 4, kv_heads: int = 2, layers: int = 2, max_positions: int = 512) -> ModelConfig:
    """A model shape small enough to reason about: 8 dimensions per head, a 10-token vocabulary."""
    return ModelConfig(
        vocab_size=10,
        hidden_size=heads * 8,
        intermediate_size=8,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=8,
        max_position_embeddings=max_positions,
        rope_theta=1e4,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        torch_dtype=None,
    )


def dense_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The last len(q) positions of len(k) keys, attended causally, head by head."""
    num_queries, heads, dim = q.shape
    group = heads // k.shape[1]
    offset = k.shape[0] - num_queries
    out = torch.empty_like(q)
    for h in range(heads):
        scores = q[:, h] @ k[:, h // group].T / math.sqrt(dim)
        for i in range(num_queries):
            scores[i, offset + i + 1 :] = float("-inf")
        out[:, h] = scores.softmax(-1) @ v[:, h // group]
    return out
