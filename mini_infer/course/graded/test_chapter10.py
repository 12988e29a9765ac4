"""Graded tests (chapter 10): rejection sampling keeps the target's distribution exactly."""

from __future__ import annotations

import pytest
import torch

from mini_infer.speculative import rejection_sample


def rows(*values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


@pytest.mark.points(3)
def test_accept_while_the_uniform_is_below_p_over_q():
    target = rows([0.6, 0.4], [0.6, 0.4], [0.6, 0.4], [0.6, 0.4])
    draft = rows([0.3, 0.7], [0.3, 0.7], [0.3, 0.7], [0.3, 0.7])
    guesses = torch.tensor([0, 1, 1, 1])
    uniforms = torch.tensor([0.99, 0.5, 0.58, 0.56])  # p/q = 2 for token 0, 4/7 = 0.571... for token 1
    accepted, _ = rejection_sample(target, draft, guesses, uniforms, torch.ones(4, 2))
    assert accepted.tolist() == [True, True, False, True]
    # u is drawn from [0, 1): accept when u < p/q, so u == p/q (here exactly 0.5) rejects.
    accepted, _ = rejection_sample(
        rows([0.25, 0.75]), rows([0.5, 0.5]), torch.tensor([0]), torch.tensor([0.5]), torch.ones(1, 2)
    )
    assert accepted.tolist() == [False]


@pytest.mark.points(2)
def test_a_rejected_row_draws_from_the_residual():
    target = rows([0.6, 0.4, 0.0], [0.2, 0.5, 0.3])
    draft = rows([0.3, 0.7, 0.0], [0.5, 0.1, 0.4])
    # Residuals: [0.3, 0, 0] and [0, 0.4, 0]: one possible token each, whatever the exponentials.
    for exponentials in (torch.ones(2, 3), rows([5.0, 0.01, 0.01], [0.01, 5.0, 0.01])):
        accepted, recovered = rejection_sample(
            target, draft, torch.tensor([1, 0]), torch.tensor([0.9, 0.9]), exponentials
        )
        assert accepted.tolist() == [False, False]
        assert recovered.tolist() == [0, 1]


@pytest.mark.points(2)
def test_a_bonus_row_is_never_accepted_and_draws_from_the_target():
    target = rows([0.1, 0.9, 0.0], [0.7, 0.3, 0.0])
    draft = torch.zeros(2, 3)  # bonus rows: no guess
    exponentials = rows([1.0, 1.0, 1.0], [0.1, 1.0, 0.001])
    accepted, recovered = rejection_sample(target, draft, torch.tensor([1, 2]), torch.tensor([0.0, 0.0]), exponentials)
    assert accepted.tolist() == [False, False]
    assert recovered.tolist() == [1, 0]  # 0.9 / 1 wins; 0.7 / 0.1 beats 0.3 / 1 (and p = 0 never wins)


@pytest.mark.points(1)
def test_an_empty_residual_falls_back_to_the_target():
    target = draft = rows([0.25, 0.75])
    exponentials = rows([1.0, 0.2])
    accepted, recovered = rejection_sample(target, draft, torch.tensor([0]), torch.tensor([0.999]), exponentials)
    assert accepted.tolist() == [True]
    assert recovered.tolist() == [1]


@pytest.mark.points(4)
def test_the_emitted_token_follows_the_target_distribution():
    """Guesses drawn from q, accepted or recovered: the token kept at a position is distributed
    as p, whatever q is (the theorem of speculative sampling)."""
    torch.manual_seed(0)
    n = 60_000
    p = torch.tensor([0.5, 0.1, 0.3, 0.1, 0.0])
    q = torch.tensor([0.1, 0.4, 0.2, 0.2, 0.1])
    guesses = torch.multinomial(q, n, replacement=True)
    accepted, recovered = rejection_sample(
        p.expand(n, 5).contiguous(),
        q.expand(n, 5).contiguous(),
        guesses,
        torch.rand(n),
        torch.empty(n, 5).exponential_(),
    )
    emitted = torch.where(accepted, guesses, recovered)
    freq = torch.bincount(emitted, minlength=5).float() / n
    torch.testing.assert_close(freq, p, atol=0.01, rtol=0)
    acceptance = accepted.float().mean().item()
    assert acceptance == pytest.approx(float(torch.minimum(p, q).sum()), abs=0.01)  # sum of min(p, q)
