"""Graded tests (chapter 09): penalties, top-k, top-p, min-p, the exponential race, seeded draws."""

from __future__ import annotations

import pytest
import torch

from mini_infer.sampling import (
    Sampler,
    SamplingParams,
    apply_min_p,
    apply_penalties,
    apply_top_k,
    apply_top_p,
    exponential_race,
)

INF = float("-inf")


def kept(logits: torch.Tensor) -> list[list[bool]]:
    return (logits > INF).tolist()


def log_probs(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(rows).log()


@pytest.mark.points(2)
def test_top_k_keeps_the_k_largest_and_their_ties():
    logits = torch.tensor([[1.0, 5.0, 3.0, 5.0, 2.0], [4.0, 3.0, 2.0, 1.0, 0.0], [0.0, 1.0, 2.0, 3.0, 4.0]])
    out = apply_top_k(logits, torch.tensor([2, 3, 1]))
    assert kept(out) == [[False, True, False, True, False], [True, True, True, False, False], [False] * 4 + [True]]
    assert torch.equal(out[out > INF], logits[out > INF])  # kept logits are unchanged
    out = apply_top_k(logits, torch.tensor([3, 1, 4]), max_k=4)
    assert kept(out) == [
        [False, True, True, True, False],
        [True, False, False, False, False],
        [False, True, True, True, True],
    ]


@pytest.mark.points(1)
def test_top_k_disabled_below_one_and_clamped_above_the_vocabulary():
    logits = torch.tensor([[1.0, 5.0, 3.0], [2.0, 0.0, 1.0], [3.0, 1.0, 2.0]])
    out = apply_top_k(logits, torch.tensor([0, -1, 7]))
    assert torch.equal(out, logits)
    assert kept(apply_top_k(logits, torch.tensor([3, 2, 1]))) == [[True] * 3, [True, False, True], [True, False, False]]
    # top_k == vocab keeps the whole row even when max_k (the largest enabled top_k) is smaller.
    out = apply_top_k(logits, torch.tensor([3, 1, 0]), max_k=1)
    assert kept(out) == [[True] * 3, [True, False, False], [True] * 3]
    # max_k = 0 (no row enabled) and a one-token vocabulary: nothing to filter, and no error.
    assert torch.equal(apply_top_k(logits, torch.tensor([0, -1, 0]), max_k=0), logits)
    assert torch.equal(
        apply_top_k(torch.tensor([[0.5], [2.0]]), torch.tensor([1, 0]), max_k=1), torch.tensor([[0.5], [2.0]])
    )


@pytest.mark.points(3)
def test_top_p_keeps_the_nucleus():
    logits = log_probs([0.5, 0.3, 0.15, 0.05], [0.05, 0.15, 0.3, 0.5])
    assert kept(apply_top_p(logits, torch.tensor([0.79, 0.79]))) == [
        [True, True, False, False],
        [False, False, True, True],
    ]
    assert kept(apply_top_p(logits, torch.tensor([0.81, 0.5]))) == [
        [True, True, True, False],
        [False, False, False, True],
    ]
    assert kept(apply_top_p(logits, torch.tensor([0.51, 0.97]))) == [
        [True, True, False, False],
        [True, True, True, True],
    ]
    assert kept(apply_top_p(logits, torch.tensor([1e-9, 1.0]))) == [[True, False, False, False], [True] * 4]
    # 1e-300 is 0 in float32: the most likely token is still kept.
    assert kept(apply_top_p(logits, torch.tensor([1e-300, 1.0]))) == [[True, False, False, False], [True] * 4]
    # float32 rounds 1 - 1e-13 to 1: the mass before the tiny token already "reaches" 1, yet
    # top_p = 1 keeps every token.
    assert kept(apply_top_p(torch.tensor([[0.0, -30.0]]), torch.tensor([1.0]))) == [[True, True]]
    out = apply_top_p(logits, torch.tensor([0.79, 1.0]))
    assert torch.equal(out[out > INF], logits[out > INF])


@pytest.mark.points(1)
def test_top_p_keeps_ties_of_the_last_member():
    logits = log_probs([0.4, 0.2, 0.2, 0.2])
    assert kept(apply_top_p(logits, torch.tensor([0.5]))) == [[True, True, True, True]]


@pytest.mark.points(2)
def test_min_p():
    logits = log_probs([0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25])
    assert kept(apply_min_p(logits, torch.tensor([0.3, 0.9]))) == [[True, True, True, False], [True] * 4]
    assert kept(apply_min_p(logits, torch.tensor([0.61, 0.0]))) == [[True, False, False, False], [True] * 4]
    assert kept(apply_min_p(logits, torch.tensor([0.59, 1.0]))) == [[True, True, False, False], [True] * 4]
    out = apply_min_p(logits, torch.tensor([0.3, 0.0]))
    assert torch.equal(out[out > INF], logits[out > INF])


@pytest.mark.points(3)
def test_penalties_by_hand():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5, -0.5, 0.0, 3.0, -3.0]] * 2)
    prompt = torch.tensor([[1, 0, 0, 1, 1, 0, 0, 0], [0] * 8])
    output = torch.tensor([[0, 2, 1, 0, 0, 0, 0, 0], [3, 0, 1, 0, 0, 0, 0, 0]])
    out = apply_penalties(
        logits, prompt, output, torch.tensor([2.0, 1.0]), torch.tensor([0.5, 0.25]), torch.tensor([0.1, 0.2])
    )
    # Row 0: tokens 0, 3, 4 seen in the prompt, 1 and 2 in the output: a positive logit is
    # divided by 2, a negative one multiplied; then -0.1 per output occurrence and -0.5 once.
    # Tokens 5, 6 and 7, seen nowhere, keep their logits.
    # Row 1: no repetition penalty; token 0: 2.0 - 0.2 * 3 - 0.25; token 2: 1.0 - 0.2 - 0.25.
    expected = torch.tensor(
        [[1.0, -4.7, -0.1, 0.25, -1.0, 0.0, 3.0, -3.0], [1.15, -2.0, 0.55, 0.5, -0.5, 0.0, 3.0, -3.0]]
    )
    torch.testing.assert_close(out, expected)


@pytest.mark.points(2)
def test_exponential_race_by_hand():
    probs = torch.tensor([[0.2, 0.8, 0.0], [0.2, 0.8, 0.0], [0.0, 0.0, 1.0], [0.5, 0.0, 0.5]])
    exponentials = torch.tensor([[1.0, 1.0, 1.0], [0.1, 1.0, 1.0], [0.001, 0.001, 5.0], [3.0, 0.0, 1.0]])
    assert exponential_race(probs, exponentials).tolist() == [1, 0, 2, 2]
    # Rows of any rank race on their last axis: one row alone, or a batch of batches.
    assert exponential_race(probs[1], exponentials[1]).tolist() == 0
    assert exponential_race(probs.view(2, 2, 3), exponentials.view(2, 2, 3)).tolist() == [[1, 0], [2, 2]]


@pytest.mark.points(2)
def test_exponential_race_draws_from_the_distribution():
    torch.manual_seed(0)
    p = torch.tensor([0.1, 0.6, 0.0, 0.3])
    n = 40_000
    draws = exponential_race(p.expand(n, 4), torch.empty(n, 4).exponential_())
    freq = torch.bincount(draws, minlength=4).float() / n
    assert freq[2] == 0
    torch.testing.assert_close(freq, p, atol=0.012, rtol=0)


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.points(3)
def test_a_seeded_row_draws_from_its_own_generator_whatever_the_batch():
    vocab = 6
    seeded, plain = SamplingParams(temperature=1.0, seed=7), SamplingParams(temperature=1.0)
    greedy = SamplingParams(temperature=0.0)
    alone = Sampler.exponentials(torch.Size((1, vocab)), [seeded], [generator(7)], generator(0), torch.device("cpu"))
    expected = torch.empty(vocab).exponential_(generator=generator(7))
    torch.testing.assert_close(alone[0], expected)
    mixed = Sampler.exponentials(
        torch.Size((3, vocab)), [plain, greedy, seeded], [None, None, generator(7)], generator(1), torch.device("cpu")
    )
    torch.testing.assert_close(mixed[2], expected)
    shared = torch.empty(3, vocab).exponential_(generator=generator(1))
    torch.testing.assert_close(mixed[0], shared[0])  # unseeded rows: one draw for the batch
    assert (mixed > 0).all()


@pytest.mark.points(1)
def test_unseeded_rows_share_one_draw():
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7)]
    out = Sampler.exponentials(torch.Size((2, 5)), params, [None, None], generator(4), torch.device("cpu"))
    torch.testing.assert_close(out, torch.empty(2, 5).exponential_(generator=generator(4)))


@pytest.mark.points(1)
def test_greedy_rows_alone_draw_nothing():
    shared = generator(3)
    state = shared.get_state()
    out = Sampler.exponentials(
        torch.Size((2, 5)),
        [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, seed=2)],
        [None, generator(2)],
        shared,
        torch.device("cpu"),
    )
    assert torch.equal(out, torch.ones(2, 5))
    assert torch.equal(shared.get_state(), state)


@pytest.mark.points(2)
def test_seeded_sampling_end_to_end_is_reproducible():
    torch.manual_seed(1)
    logits = torch.randn(4, 50)
    logits[2] = logits[0]
    params = [SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=s) for s in (1, 2, 1, 3)]

    def draw(shared_seed: int) -> list[int]:
        gens = [generator(p.seed or 0) for p in params]
        out = Sampler(seed=shared_seed)(logits, params, gens, [[]] * 4, [[]] * 4)
        return out.token_ids.tolist()

    first = draw(0)
    assert first == draw(1)  # every row is seeded: the shared generator plays no part
    assert first[0] == first[2]  # same seed, same logits: the same token, in any row
    for row, token in enumerate(first):
        assert token in logits[row].topk(20).indices.tolist()
