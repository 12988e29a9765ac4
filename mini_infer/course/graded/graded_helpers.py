"""What several chapters' graded tests share (appendix): a small model shape, the dense causal
attention that cached and paged attention must equal, and a fake engine loop that drives the
scheduler with a "model" whose next token is a function of the sequence.

Copied beside the graded tests wherever they run (``grade.copy_graded_tests``): the grader's
temporary folder and a student package's ``tests/``. It is never imported from the package being
graded, so a student's copy of it cannot change what the tests expect.
"""

from __future__ import annotations

import math
import random
from typing import TYPE_CHECKING, Any

import torch

from mini_infer.config import ModelConfig

if TYPE_CHECKING:  # the fake engine's chapters (06, 07) import these; earlier chapters must not
    from mini_infer.scheduler import Scheduler, SchedulerOutput


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


def fake_token(token_ids: list[int]) -> int:
    """The 'model': a next token that depends on the whole sequence."""
    return (sum(token_ids) * 31 + len(token_ids)) % 97


def expected_output(prompt: list[int], max_tokens: int) -> list[int]:
    """What the fake model generates for ``prompt`` with nothing else running."""
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(fake_token(tokens))
    return tokens[len(prompt) :]


def random_requests(rng: random.Random, count: int, longest: int) -> dict[str, tuple[list[int], int]]:
    """``count`` requests named "0", "1", ...: (prompt, max_tokens), a prompt of 1 to ``longest``
    tokens below 50, and 1 to ``longest`` output tokens."""
    return {
        str(i): ([rng.randrange(50) for _ in range(rng.randint(1, longest))], rng.randint(1, longest))
        for i in range(count)
    }


def check_unpressured_outputs(seqs: dict[str, Any], requests: dict[str, tuple[list[int], int]]) -> None:
    """Every request ended with what the fake model generates for it with nothing else running."""
    for name, (prompt, max_tokens) in requests.items():
        assert seqs[name].output_token_ids == expected_output(prompt, max_tokens), name


def fake_step(scheduler: Scheduler) -> SchedulerOutput:
    """One engine step with the fake model: schedule, keep one token per sampling sequence, finish
    those that reached ``max_tokens``, check the scheduler's invariants."""
    # Imported here: a chapter 03 grade must not depend on the student's chapter 06 module importing.
    from mini_infer.sequence import SequenceStatus

    out = scheduler.schedule()
    kept = [[fake_token(s.seq.token_ids)] if s.samples else [] for s in out.scheduled]
    scheduler.update(out.scheduled, kept)
    for item in out.scheduled:
        seq = item.seq
        if seq.status is SequenceStatus.RUNNING and seq.num_output_tokens >= seq.params.max_tokens:
            scheduler.finish(seq, "length")
    scheduler.check_invariants()
    return out


def ids(seqs: object) -> list[str]:
    return [s.request_id for s in seqs]  # type: ignore[attr-defined]
