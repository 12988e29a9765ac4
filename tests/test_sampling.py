"""Tests for mini_infer.sampling (chapter 09): each filter against a from-scratch reference,
sampling against the distribution it claims, seeded rows against the batch around them, and
stop strings against every way of chunking the same text."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from mini_infer.greedy import argmax_rows
from mini_infer.sampling import (
    Sampler,
    SamplingParams,
    apply_min_p,
    apply_penalties,
    apply_top_k,
    apply_top_p,
    exponential_race,
    make_generator,
    probs_from_logits,
)
from mini_infer.stop_strings import StopStringChecker
from tests.conftest import TEST_DEVICE

# The sampling tests below run on the test device (MINI_INFER_TEST_DEVICE; the DEVICE by default).
DEVICE = TEST_DEVICE


# --------------------------------------------------------------------------------------------
# SamplingParams
# --------------------------------------------------------------------------------------------

BAD_PARAMS = [
    ("max_tokens", 0),
    ("max_tokens", -3),
    ("max_tokens", 1.5),
    ("max_tokens", True),
    ("max_tokens", "16"),
    ("max_tokens", None),
    ("temperature", -1.0),
    ("temperature", -1e-9),
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("temperature", "1"),
    ("temperature", True),
    ("temperature", None),
    ("top_p", 0.0),
    ("top_p", -0.1),
    ("top_p", 1.0001),
    ("top_p", math.nan),
    ("top_p", "0.9"),
    ("top_k", 0),
    ("top_k", -2),
    ("top_k", 1.5),
    ("top_k", True),
    ("top_k", "5"),
    ("min_p", -0.1),
    ("min_p", 1.1),
    ("min_p", math.inf),
    ("min_p", False),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("repetition_penalty", math.nan),
    ("presence_penalty", 2.5),
    ("presence_penalty", -2.01),
    ("presence_penalty", "0"),
    ("frequency_penalty", 3),
    ("frequency_penalty", -math.inf),
    ("logprobs", -1),
    ("logprobs", 21),
    ("logprobs", 2.0),
    ("logprobs", True),
    ("seed", 1.5),
    ("seed", "7"),
    ("seed", -1),
    ("seed", 2**64),
    ("seed", True),
    ("stop", ""),
    ("stop", [""]),
    ("stop", ["ok", ""]),
    ("stop", [1]),
    ("stop", 5),
    ("stop", b"x"),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", [True]),
    ("stop_token_ids", "1"),
    ("stop_token_ids", [1.0]),
    ("stop_token_ids", 3),
    ("ignore_eos", 1),
    ("ignore_eos", "yes"),
    ("ignore_eos", None),
    ("include_stop_str_in_output", 0),
]


@pytest.mark.parametrize(("field", "value"), BAD_PARAMS)
def test_bad_params_name_the_field_and_the_value(field: str, value: object) -> None:
    with pytest.raises(ValueError) as error:
        SamplingParams(**{field: value})  # type: ignore[arg-type]
    message = str(error.value)
    assert message.startswith(f"{field} must be"), message
    assert "got" in message


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("temperature", -1, "temperature must be >= 0, got -1.0"),
        ("top_p", 0, "top_p must be in (0, 1], got 0.0"),
        ("top_k", 0, "top_k must be -1 (disabled) or >= 1, got 0"),
        ("min_p", 2, "min_p must be in [0, 1], got 2.0"),
        ("logprobs", 21, "logprobs must be None or in [0, 20], got 21"),
        ("temperature", True, "temperature must be a number, got True"),
    ],
)
def test_messages_state_the_allowed_range(field: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=f"^{__import__('re').escape(message)}$"):
        SamplingParams(**{field: value})  # type: ignore[arg-type]


def test_defaults_and_normalisation() -> None:
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (16, 1.0, 1.0, -1, 0.0)
    assert p.stop == [] and p.stop_token_ids == [] and p.logprobs is None and p.seed is None
    assert not p.greedy and not p.needs_penalties
    assert SamplingParams(stop="\n").stop == ["\n"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]  # type: ignore[arg-type]
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=1e-7).greedy  # vLLM treats tiny temperatures as 0
    assert not SamplingParams(temperature=0.01).greedy
    # ints are fine where floats belong, and are stored as floats
    p = SamplingParams(temperature=1, top_p=1, seed=3, logprobs=0, presence_penalty=-2, frequency_penalty=2)
    assert isinstance(p.temperature, float) and isinstance(p.top_p, float) and p.seed == 3
    assert SamplingParams(repetition_penalty=1.2).needs_penalties


# --------------------------------------------------------------------------------------------
# Filters against from-scratch references (plain Python on one row)
# --------------------------------------------------------------------------------------------


def softmax(row: list[float]) -> list[float]:
    finite = [x for x in row if x != -math.inf]
    top = max(finite)
    e = [math.exp(x - top) if x != -math.inf else 0.0 for x in row]
    return [x / sum(e) for x in e]


def ref_top_k(row: list[float], k: int) -> list[bool]:
    if k < 1 or k >= len(row):
        return [True] * len(row)
    kth = sorted(row, reverse=True)[k - 1]
    return [x >= kth for x in row]


def ref_top_p(row: list[float], p: float) -> list[bool]:
    probs = softmax(row)
    mass, threshold = 0.0, 1.0
    for q in sorted(probs, reverse=True):
        threshold = q
        mass += q
        if mass >= p:
            break
    return [q >= threshold for q in probs]


def ref_min_p(row: list[float], min_p: float) -> list[bool]:
    probs = softmax(row)
    return [q >= min_p * max(probs) for q in probs]


def kept(logits: torch.Tensor) -> list[list[bool]]:
    return (logits != -math.inf).tolist()


def logits_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor([probs]).log()


@pytest.mark.parametrize(
    ("probs", "k", "expected"),
    [
        ([0.1, 0.4, 0.2, 0.3], 2, [False, True, False, True]),
        ([0.1, 0.4, 0.2, 0.3], 1, [False, True, False, False]),
        ([0.3, 0.3, 0.1, 0.3], 2, [True, True, False, True]),  # ties with the k-th are kept
        ([0.1, 0.4, 0.2, 0.3], 4, [True] * 4),
        ([0.1, 0.4, 0.2, 0.3], 100, [True] * 4),  # larger than the vocabulary: clamped
        ([0.1, 0.4, 0.2, 0.3], -1, [True] * 4),  # disabled
    ],
)
def test_top_k_hand_cases(probs: list[float], k: int, expected: list[bool]) -> None:
    assert kept(apply_top_k(logits_of(probs), torch.tensor([k])))[0] == expected
    assert ref_top_k(logits_of(probs)[0].tolist(), k) == expected


@pytest.mark.parametrize(
    ("probs", "p", "expected"),
    [
        ([0.1, 0.4, 0.2, 0.3], 0.35, [False, True, False, False]),
        ([0.1, 0.4, 0.2, 0.3], 0.6, [False, True, False, True]),
        ([0.1, 0.4, 0.2, 0.3], 0.75, [False, True, True, True]),
        ([0.1, 0.4, 0.2, 0.3], 1.0, [True] * 4),
        ([0.3, 0.2, 0.2, 0.2, 0.1], 0.4, [True, True, True, True, False]),  # ties at the edge are kept
        ([0.25, 0.25, 0.25, 0.25], 0.1, [True] * 4),  # all tied: all kept
        ([0.97, 0.01, 0.01, 0.01], 0.5, [True, False, False, False]),
    ],
)
def test_top_p_hand_cases(probs: list[float], p: float, expected: list[bool]) -> None:
    assert kept(apply_top_p(logits_of(probs), torch.tensor([p])))[0] == expected
    assert ref_top_p(logits_of(probs)[0].tolist(), p) == expected


@pytest.mark.parametrize(
    ("probs", "min_p", "expected"),
    [
        ([0.1, 0.4, 0.2, 0.3], 0.0, [True] * 4),
        ([0.1, 0.4, 0.2, 0.3], 0.3, [False, True, True, True]),
        ([0.1, 0.4, 0.2, 0.3], 0.6, [False, True, False, True]),
        ([0.1, 0.4, 0.2, 0.4], 1.0, [False, True, False, True]),  # ties with the maximum survive
    ],
)
def test_min_p_hand_cases(probs: list[float], min_p: float, expected: list[bool]) -> None:
    assert kept(apply_min_p(logits_of(probs), torch.tensor([min_p])))[0] == expected
    assert ref_min_p(logits_of(probs)[0].tolist(), min_p) == expected


def test_top_p_stops_when_the_mass_reaches_p_exactly() -> None:
    # softmax([ln 2, 0, 0]) is exactly [0.5, 0.25, 0.25] in float32: the first token alone
    # reaches top_p = 0.5, so the nucleus is that token ("reaches", not "exceeds").
    logits = torch.tensor([[math.log(2.0), 0.0, 0.0]])
    assert logits.softmax(-1).tolist() == [[0.5, 0.25, 0.25]]
    assert kept(apply_top_p(logits, torch.tensor([0.5]))) == [[True, False, False]]
    assert kept(apply_top_p(logits, torch.tensor([0.5001]))) == [[True, True, True]]


def test_top_p_one_keeps_everything_despite_rounding() -> None:
    # In float32 the first probability rounds to exactly 1.0, so the mass before the others is
    # already 1.0: only the explicit top_p == 1 rule keeps them (they can still be sampled).
    logits = torch.tensor([[0.0, -20.0, -20.0]])
    assert logits.softmax(-1)[0, 0].item() == 1.0
    assert kept(apply_top_p(logits, torch.tensor([1.0]))) == [[True, True, True]]


def test_filters_batched_match_the_reference_row_by_row() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 50, generator=gen) * 2
    logits[::7, 10:20] = 1.5  # some exact ties
    top_k = torch.randint(-1, 60, (64,), generator=gen).masked_fill(torch.arange(64) % 5 == 0, -1)
    top_p = torch.rand(64, generator=gen).clamp_min(0.01).masked_fill(torch.arange(64) % 6 == 0, 1.0)
    min_p = torch.rand(64, generator=gen) * 0.5
    rows = logits.tolist()
    expected_top_k = [ref_top_k(r, int(k)) for r, k in zip(rows, top_k, strict=True)]
    assert kept(apply_top_k(logits, top_k)) == expected_top_k
    # The sampler's fast path: topk of the largest enabled k instead of a sort of every row.
    max_k = max(int(k) for k in top_k if 0 < k < logits.shape[1])
    assert kept(apply_top_k(logits, top_k, max_k=max_k)) == expected_top_k
    assert kept(apply_top_p(logits, top_p)) == [ref_top_p(r, float(p)) for r, p in zip(rows, top_p, strict=True)]
    assert kept(apply_min_p(logits, min_p)) == [ref_min_p(r, float(m)) for r, m in zip(rows, min_p, strict=True)]


def test_filters_keep_the_values_they_keep() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, -1.0]])
    out = apply_top_k(logits, torch.tensor([2]))
    assert out.tolist() == [[-math.inf, 3.0, 2.0, -math.inf]]
    assert logits.tolist() == [[1.0, 3.0, 2.0, -1.0]]  # the input is not modified


def test_probs_from_logits_applies_temperature_then_filters_in_order() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 30, generator=gen)
    params = [
        SamplingParams(temperature=0.7, top_k=10, top_p=0.8, min_p=0.05),
        SamplingParams(temperature=1.3),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.5, min_p=0.2),
    ]
    probs = probs_from_logits(logits.to(torch.bfloat16), params)
    assert probs.dtype == torch.float32
    assert torch.allclose(probs.sum(-1), torch.ones(4))
    for i, p in enumerate(params):
        row = logits[i].to(torch.bfloat16).float()
        if p.greedy:
            assert probs[i].tolist() == torch.nn.functional.one_hot(row.argmax(), 30).float().tolist()
            continue
        scaled = (row / p.temperature).tolist()
        keep = ref_top_k(scaled, p.top_k)
        scaled = [x if k else -math.inf for x, k in zip(scaled, keep, strict=True)]
        keep = ref_top_p(scaled, p.top_p)
        scaled = [x if k else -math.inf for x, k in zip(scaled, keep, strict=True)]
        keep = ref_min_p(scaled, p.min_p)
        scaled = [x if k else -math.inf for x, k in zip(scaled, keep, strict=True)]
        assert probs[i].tolist() == pytest.approx(softmax(scaled), abs=1e-6)
    assert (probs[0] > 0).sum() < 10  # the filters really removed something


# --------------------------------------------------------------------------------------------
# Penalties on hand-computed examples
# --------------------------------------------------------------------------------------------


def test_penalties_hand_computed() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    prompt = torch.tensor([[1.0, 0, 0, 0]])  # token 0 in the prompt
    output = torch.tensor([[0.0, 2, 1, 0]])  # token 1 twice, token 2 once in the output
    out = apply_penalties(logits, prompt, output, torch.tensor([2.0]), torch.tensor([0.5]), torch.tensor([0.25]))
    # repetition: 2 -> 1, -1 -> -2, 0.5 -> 0.25 (seen); 3 unseen. Then frequency and presence on
    # the output only: token 1: -2 - 2 * 0.25 - 0.5; token 2: 0.25 - 0.25 - 0.5.
    assert out.tolist() == [[1.0, -3.0, -0.5, 3.0]]


def test_sampler_penalties_from_token_lists() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0], [2.0, -1.0, 0.5, 3.0]])
    params = [SamplingParams(temperature=0, repetition_penalty=10.0), SamplingParams(temperature=0)]
    # Row 0 saw token 3 in its output: 3 / 10 = 0.3 < 2.0, so the argmax moves to token 0.
    # Row 1 saw it too but has no penalty: its token ids are not even read.
    out = Sampler(seed=0)(logits, params, prompt_token_ids=[[1], [3]], output_token_ids=[[3, 3], [3]])
    assert out.token_ids.tolist() == [0, 3]
    with pytest.raises(ValueError, match="prompt_token_ids"):
        Sampler(seed=0)(logits, params)
    # No penalty anywhere: the token lists are not needed.
    assert Sampler(seed=0)(logits, [SamplingParams(temperature=0)] * 2).token_ids.tolist() == [3, 3]


def test_presence_and_frequency_penalties_ignore_the_prompt() -> None:
    logits = torch.tensor([[1.0, 1.0, 1.0]])
    p = SamplingParams(temperature=0, presence_penalty=1.0, frequency_penalty=1.0)
    out = Sampler(seed=0)(logits, [p], prompt_token_ids=[[0, 0, 0]], output_token_ids=[[1]])
    assert out.token_ids.tolist() == [0]  # token 0 only in the prompt: not penalised, wins the tie


# --------------------------------------------------------------------------------------------
# Sampling
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_greedy_is_argmax(dtype: torch.dtype) -> None:
    logits = torch.randn(16, 100, generator=torch.Generator().manual_seed(2)).to(DEVICE, dtype)
    params = [SamplingParams(temperature=0, top_k=3, top_p=0.1, seed=i) for i in range(16)]
    gens = [make_generator(i, DEVICE) for i in range(16)]
    out = Sampler(seed=0)(logits, params, gens)
    assert out.token_ids.dtype == torch.long
    assert out.token_ids.tolist() == logits.float().argmax(-1).tolist()
    # Greedy rows draw nothing from their generators.
    assert all(torch.equal(g.get_state(), make_generator(i, DEVICE).get_state()) for i, g in enumerate(gens))


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 5),
    vocab=st.sampled_from([1, 7, 16, 17, 128, 300, 704, 1024, 151936 // 8]),
    levels=st.integers(1, 4),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    seed=st.integers(0, 1000),
)
def test_argmax_rows_is_the_first_maximum(rows: int, vocab: int, levels: int, dtype: torch.dtype, seed: int) -> None:
    # Few distinct values make ties common, across blocks and inside one.
    logits = torch.randint(0, levels, (rows, vocab), generator=torch.Generator().manual_seed(seed)).to(dtype)
    assert argmax_rows(logits).tolist() == logits.float().argmax(-1).tolist()


def test_greedy_rows_of_a_low_precision_batch_skip_the_float32_copy() -> None:
    logits = torch.randn(4, 256, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    logits[1, 7] = logits[1, 200] = 50.0  # a tie: the first wins, as with argmax
    plain = Sampler(seed=0)(logits, [SamplingParams(temperature=0)] * 4)
    with_logprobs = Sampler(seed=0)(logits, [SamplingParams(temperature=0, logprobs=1)] * 4)
    assert plain.token_ids.tolist() == with_logprobs.token_ids.tolist() == logits.float().argmax(-1).tolist()
    assert plain.token_ids[1].item() == 7 and plain.logprobs is None and with_logprobs.logprobs is not None


def empirical(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens.cpu(), minlength=vocab).float() / tokens.numel()


def test_temperature_sampling_matches_softmax() -> None:
    vocab, draws = 6, 40_000
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -3.0])
    params = SamplingParams(temperature=0.7)
    out = Sampler(seed=1234)(logits.to(DEVICE).expand(draws, vocab), [params] * draws)
    # 40,000 draws: the standard error of a frequency is at most 0.0025, so 0.012 is ~5 sigma.
    expected = (logits / 0.7).softmax(-1)
    assert (empirical(out.token_ids, vocab) - expected).abs().max() < 0.012
    # The tolerance is tight enough to tell temperatures apart.
    assert ((logits / 1.0).softmax(-1) - expected).abs().max() > 0.05


def test_filtered_sampling_matches_probs_from_logits() -> None:
    vocab, draws = 12, 40_000
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(temperature=1.5, top_k=8, top_p=0.9, min_p=0.1)
    out = Sampler(seed=99)(logits.to(DEVICE).expand(draws, vocab), [params] * draws)
    expected = probs_from_logits(logits[None], [params])[0]
    freq = empirical(out.token_ids, vocab)
    assert (freq - expected).abs().max() < 0.012
    assert torch.all(freq[expected == 0] == 0)  # filtered tokens are never drawn
    assert (expected == 0).any()


def test_the_race_draws_from_probs_normalised_or_not() -> None:
    probs = torch.tensor([0.5, 0.0, 0.2, 0.3], device=DEVICE).expand(40_000, 4)
    exponentials = torch.empty(40_000, 4, device=DEVICE).exponential_(generator=make_generator(5, DEVICE))
    tokens = exponential_race(probs, exponentials)
    assert (empirical(tokens, 4) - probs[0].cpu()).abs().max() < 0.012
    unnormalised = exponential_race(probs * 7.0, exponentials)
    assert torch.equal(tokens, unnormalised)  # the race does not care about normalisation


def run_alone(logits: list[torch.Tensor], params: SamplingParams) -> list[int]:
    sampler, gen = Sampler(seed=0), make_generator(params.seed, DEVICE)
    return [int(sampler(step[None].to(DEVICE), [params], [gen]).token_ids[0]) for step in logits]


def test_seeded_row_is_independent_of_the_batch() -> None:
    steps, vocab = 30, 64
    data = torch.Generator().manual_seed(4)
    mine = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=7)
    my_logits = [torch.randn(vocab, generator=data) for _ in range(steps)]
    alone = run_alone(my_logits, mine)
    assert len(set(alone)) > 5  # the row really samples: the check below could fail

    others = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.5, top_k=5),
        SamplingParams(top_p=0.9),
        SamplingParams(seed=8, min_p=0.1, logprobs=3),
        SamplingParams(temperature=1.2, repetition_penalty=1.3, presence_penalty=0.5),
        SamplingParams(seed=7, temperature=2.0),  # same seed, its own generator
        SamplingParams(temperature=0, seed=1),
    ]
    sampler = Sampler(seed=12345)
    my_gen = make_generator(7, DEVICE)
    other_gens = [None if p.seed is None else make_generator(p.seed, DEVICE) for p in others]
    in_batch = []
    for step in range(steps):
        where = step % 8  # the row moves around the batch
        params = others[:where] + [mine] + others[where:]
        gens = other_gens[:where] + [my_gen] + other_gens[where:]
        logits = torch.randn(8, vocab, generator=data)
        logits[where] = my_logits[step]
        out = sampler(logits.to(DEVICE), params, gens, prompt_token_ids=[[1, 2]] * 8, output_token_ids=[[3]] * 8)
        in_batch.append(int(out.token_ids[where]))
    assert in_batch == alone
    # And the generator moved by exactly one [V] draw per token.
    fresh = make_generator(7, DEVICE)
    for _ in range(steps):
        torch.empty(vocab, device=DEVICE).exponential_(generator=fresh)
    assert torch.equal(my_gen.get_state(), fresh.get_state())


def test_different_seeds_differ_and_equal_seeds_agree() -> None:
    logits = [torch.zeros(1000)] * 5
    a = run_alone(logits, SamplingParams(seed=1))
    assert a == run_alone(logits, SamplingParams(seed=1))
    assert a != run_alone(logits, SamplingParams(seed=2))


def test_unseeded_rows_vary_and_follow_the_sampler_seed() -> None:
    logits = torch.zeros(2, 1000, device=DEVICE)
    params = [SamplingParams(), SamplingParams()]
    sampler = Sampler(seed=3)
    first, second = sampler(logits, params).token_ids.tolist(), sampler(logits, params).token_ids.tolist()
    assert first[0] != first[1]  # two identical rows in one step
    assert first != second  # one row across two steps
    replay = Sampler(seed=3)
    assert replay(logits, params).token_ids.tolist() == first


def test_seed_without_generator_is_rejected() -> None:
    with pytest.raises(ValueError, match="make_generator"):
        Sampler()(torch.zeros(1, 4), [SamplingParams(seed=1)])
    with pytest.raises(ValueError, match="one generator"):
        Sampler()(torch.zeros(2, 4), [SamplingParams()] * 2, [None])
    with pytest.raises(ValueError, match="logits"):
        Sampler()(torch.zeros(3, 4), [SamplingParams()] * 2)


# --------------------------------------------------------------------------------------------
# Logprobs
# --------------------------------------------------------------------------------------------


def test_logprobs_come_from_penalised_tempered_logits() -> None:
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 40, generator=gen).to(torch.float16)
    params = [
        SamplingParams(temperature=0.5, top_k=3, logprobs=4, repetition_penalty=1.5),
        SamplingParams(temperature=0, logprobs=0),
        SamplingParams(temperature=0.8),  # asks for none; gets the batch's columns anyway
    ]
    prompt, output = [[0, 1, 2], [5], [6]], [[3, 3], [], [7]]
    out = Sampler(seed=0)(logits, params, prompt_token_ids=prompt, output_token_ids=output)
    assert out.logprobs is not None and out.top_token_ids is not None and out.top_logprobs is not None
    assert out.top_token_ids.shape == (3, 4)

    counts = torch.zeros(3, 2, 40)
    for row, ids in enumerate(prompt):
        for t in ids:
            counts[row, 0, t] += 1
    for row, ids in enumerate(output):
        for t in ids:
            counts[row, 1, t] += 1
    penalised = apply_penalties(
        logits.float(), counts[:, 0], counts[:, 1], torch.tensor([1.5, 1.0, 1.0]), torch.zeros(3), torch.zeros(3)
    )
    expected = (penalised / torch.tensor([[0.5], [1.0], [0.8]])).log_softmax(-1)
    chosen = out.token_ids
    assert torch.allclose(out.logprobs, expected.gather(1, chosen[:, None])[:, 0])
    top = expected.topk(4, dim=-1)
    assert torch.equal(out.top_token_ids, top.indices)
    assert torch.allclose(out.top_logprobs, top.values)
    assert int(chosen[1]) == int(penalised[1].argmax())
    assert int(chosen[0]) in penalised[0].topk(3).indices.tolist()  # top-k limited the draw...
    assert out.logprobs[0] > -math.inf  # ...but not the logprobs, which come before the filters

    per_row = out.to_token_logprobs()
    assert per_row[2] is None  # did not ask
    assert per_row[0] is not None and per_row[1] is not None
    assert per_row[0].token_id == int(chosen[0]) and per_row[0].logprob == pytest.approx(float(out.logprobs[0]))
    assert list(per_row[0].top) == top.indices[0].tolist()  # its own k = 4, most likely first
    assert per_row[1].top == {}  # logprobs=0: the chosen token's logprob only


def test_no_logprobs_unless_asked_and_to_host() -> None:
    out = Sampler(seed=0)(torch.randn(2, 10), [SamplingParams()] * 2)
    assert out.logprobs is None and out.top_token_ids is None and out.top_logprobs is None
    assert out.to_token_logprobs() == [None, None]
    host = out.to_host()
    assert host.token_ids.device.type == "cpu" and torch.equal(host.token_ids, out.token_ids)
    small = Sampler(seed=0)(torch.randn(1, 3), [SamplingParams(logprobs=20)])
    assert small.top_token_ids is not None and small.top_token_ids.shape == (1, 3)  # clamped to V


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_step_never_syncs_on_cuda() -> None:
    device = torch.device("cuda")
    logits = torch.randn(8, 1000, device=device)
    params = [
        SamplingParams(),
        SamplingParams(temperature=0),
        SamplingParams(seed=1, top_k=5, top_p=0.9),
        SamplingParams(min_p=0.1, logprobs=3),
        SamplingParams(repetition_penalty=1.2, frequency_penalty=1),
    ] + [SamplingParams(top_p=0.5)] * 3
    gens = [None, None, make_generator(1, device)] + [None] * 5
    sampler = Sampler(seed=0)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = sampler(logits, params, gens, prompt_token_ids=[[1, 2]] * 8, output_token_ids=[[3]] * 8)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.to_host().token_ids.device.type == "cpu"


# --------------------------------------------------------------------------------------------
# Stop strings
# --------------------------------------------------------------------------------------------


def non_streaming(text: str, stop: list[str], include: bool) -> tuple[str, bool]:
    """The answer with all the text at once: the occurrence completed first wins."""
    best: tuple[int, int] | None = None
    for s in stop:
        for start in range(len(text) - len(s) + 1):
            if text.startswith(s, start):
                candidate = (start + len(s), start)
                best = candidate if best is None else min(best, candidate)
    if best is None:
        return text, False
    end, start = best
    return (text[:end] if include else text[:start]), True


def stream(text: str, cuts: list[int], stop: list[str], include: bool) -> tuple[list[str], bool, str | None]:
    checker = StopStringChecker(stop, include)
    bounds = [0, *sorted(c % (len(text) + 1) for c in cuts), len(text)]
    chunks: list[str] = []
    for a, b in zip(bounds, bounds[1:], strict=False):
        emitted, stopped = checker.push(text[a:b])
        chunks.append(emitted)
        if stopped:
            return chunks, True, checker.matched
    chunks.append(checker.flush())
    return chunks, False, checker.matched


@settings(max_examples=400, deadline=None)
@example(text="abcab", stop=["abc", "b"], cuts=[], include=False)
@example(text="aaab", stop=["aab", "ab"], cuts=[1, 2], include=True)
@given(
    text=st.text(alphabet="abc\n", max_size=30),
    stop=st.lists(st.text(alphabet="abc\n", min_size=1, max_size=4), max_size=3),
    cuts=st.lists(st.integers(min_value=0, max_value=40), max_size=12),
    include=st.booleans(),
)
def test_stop_strings_do_not_depend_on_chunking(text: str, stop: list[str], cuts: list[int], include: bool) -> None:
    chunks, stopped, matched = stream(text, cuts, stop, include)
    expected, expected_stopped = non_streaming(text, stop, include)
    assert ("".join(chunks), stopped) == (expected, expected_stopped)
    assert (matched is not None) == stopped
    if matched is not None:
        assert matched in stop and non_streaming(text, [matched], include) == (expected, True)
        if include:
            # The stop string that ended the text arrived whole, in the last chunk.
            assert chunks[-1].endswith(matched)
    if not include:
        assert not any(s in "".join(chunks) for s in stop)


def test_stop_string_spanning_many_pushes() -> None:
    checker = StopStringChecker(["<|end|>"])
    pieces = ["Hello <", "|", "e", "nd", " not yet <|e", "nd|>", " after"]
    out = [checker.push(p) for p in pieces[:-1]]
    assert out == [("Hello ", False), ("", False), ("", False), ("", False), ("<|end not yet ", False), ("", True)]
    assert checker.flush() == "" and checker.matched == "<|end|>"
    with pytest.raises(RuntimeError):
        checker.push(pieces[-1])


def test_the_first_completed_stop_string_wins_even_inside_one_chunk() -> None:
    # Token by token, "b" completes before "abc" does; one chunk must give the same answer.
    checker = StopStringChecker(["abc", "b"])
    assert checker.push("xabc") == ("xa", True) and checker.matched == "b"
    assert StopStringChecker(["abc", "b"], include_stop_str_in_output=True).push("xabc") == ("xab", True)
    # Two completing together: the longer one (it started first) is the stop string.
    assert StopStringChecker(["bc", "abc"], include_stop_str_in_output=False).push("xabc") == ("x", True)


def test_overlapping_candidates_and_flush() -> None:
    checker = StopStringChecker(["aab", "ac"], include_stop_str_in_output=True)
    assert checker.push("a") == ("", False)
    assert checker.push("a") == ("", False)
    assert checker.push("a") == ("a", False)  # "aa" may still become "aab"
    assert checker.flush() == "aa"  # the request ended another way: nothing is lost
    checker = StopStringChecker(["aab", "ac"], include_stop_str_in_output=True)
    assert checker.push("aaac") == ("aaac", True)
    assert StopStringChecker([]).push("anything") == ("anything", False)
    with pytest.raises(ValueError):
        StopStringChecker([""])


def test_extreme_but_valid_values_do_not_break_the_sampler():
    """Found by the server's hostile-input tests: both used to kill the engine thread."""
    logits = torch.randn(2, 50)
    params = [SamplingParams(temperature=1.0, top_p=1e-300), SamplingParams(temperature=1.0, top_k=2**70)]
    out = Sampler()(logits, params, [None, None])
    assert out.token_ids[0].item() == logits[0].argmax().item()  # the nucleus is the top token alone
    assert 0 <= out.token_ids[1].item() < 50


# ---------------------------------------------------------------------------------------------
# What a request does to its logits first: logit_bias, min_tokens (Sampler.restrict)
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_llm():
    from mini_infer import LLM

    return LLM("tiny", dtype="float32", num_kv_blocks=64, show_progress=False)


def _chat(llm, question: str) -> list[int]:
    return llm.engine.tokenizer.encode(
        llm.engine.tokenizer.apply_chat_template([{"role": "user", "content": question}])
    )


def test_logit_bias_moves_the_greedy_choice(tiny_llm):
    prompt = _chat(tiny_llm, "What is 34 + 57?")
    greedy = SamplingParams(max_tokens=6, temperature=0)
    plain = tiny_llm.generate([prompt], greedy, use_tqdm=False)[0].token_ids
    forced = SamplingParams(max_tokens=6, temperature=0, logit_bias={300: 100})
    assert tiny_llm.generate([prompt], forced, use_tqdm=False)[0].token_ids == [300] * 6
    banned = SamplingParams(max_tokens=6, temperature=0, logit_bias={plain[0]: -100})
    assert tiny_llm.generate([prompt], banned, use_tqdm=False)[0].token_ids[0] != plain[0]
    with pytest.raises(ValueError, match=r"logit_bias token id 704 is outside the vocabulary \[0, 704\)"):
        tiny_llm.engine.add_request(prompt, SamplingParams(logit_bias={704: 1.0}))


@pytest.mark.parametrize(
    ("bias", "match"),
    [
        ({-1: 1.0}, "logit_bias must be keyed by token ids >= 0"),
        ({5: 101}, r"logit_bias\[5\] must be in \[-100, 100\]"),
    ],
)
def test_logit_bias_is_checked(bias, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(logit_bias=bias)


def test_min_tokens_holds_back_every_stop(tiny_llm):
    prompt = _chat(tiny_llm, "What is 34 + 57?")
    short = tiny_llm.generate([prompt], SamplingParams(max_tokens=40, temperature=0), use_tqdm=False)[0]
    assert short.finish_reason == "stop" and len(short.token_ids) < 20  # ends early on its own
    eos = tiny_llm.engine.outputs.eos_token_ids
    longer = SamplingParams(max_tokens=40, temperature=0, min_tokens=20, stop=["="])
    out = tiny_llm.generate([prompt], longer, use_tqdm=False)[0]
    assert len(out.token_ids) >= 20 and not eos & set(out.token_ids[:20])
    assert "=" in tiny_llm.engine.tokenizer.decode(out.token_ids[:20])  # a stop string too waits for min_tokens
    with pytest.raises(ValueError, match=r"min_tokens must be <= max_tokens \(4\), got 5"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_restrict_forbids_stops_on_rows_before_min_tokens():
    """With guesses, row j predicts output token num_output_tokens + j: only rows before
    min_tokens forbid the stops."""
    from types import SimpleNamespace

    sampler = Sampler(eos_token_ids=[2])
    params = SamplingParams(min_tokens=3, stop_token_ids=[4])
    seq = SimpleNamespace(params=params, num_output_tokens=1)
    batch = SimpleNamespace(rows_of=[range(0, 4)])
    logits = sampler.restrict(torch.zeros(4, 8), batch, [seq])
    forbidden = [(row == -math.inf).nonzero().flatten().tolist() for row in logits]
    assert forbidden == [[2, 4], [2, 4], [], []]
    untouched = torch.zeros(4, 8, dtype=torch.bfloat16)
    assert sampler.restrict(untouched, batch, [SimpleNamespace(params=SamplingParams())]) is untouched


def test_skip_special_tokens(tiny_llm):
    prompt = _chat(tiny_llm, "What is 34 + 57?")
    start = tiny_llm.engine.tokenizer.hf.convert_tokens_to_ids("<|im_start|>")
    params = {"max_tokens": 2, "temperature": 0, "logit_bias": {start: 100}}
    skipped = tiny_llm.generate([prompt], SamplingParams(**params), use_tqdm=False)[0]
    kept = tiny_llm.generate([prompt], SamplingParams(**params, skip_special_tokens=False), use_tqdm=False)[0]
    assert skipped.token_ids == kept.token_ids == [start, start]
    assert skipped.text == "" and kept.text == "<|im_start|><|im_start|>"
