"""Speculative decoding (chapter 10): the verification rules, and the engine with a draft model
against Hugging Face greedy decoding and against itself without one."""

import random

import pytest
import torch

from mini_infer import LLM, SamplingParams
from mini_infer.config import ModelConfig
from mini_infer.greedy import accepted_prefix
from mini_infer.speculative import rejection_sample
from tests.engine_checks import assert_all_blocks_back, run_checked, transformers_greedy

MAX_TOKENS = 24


# ------------------------------------------------------------------ the rules, on their own
def test_greedy_verification_keeps_the_agreeing_prefix_and_one_more():
    assert accepted_prefix([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]  # all kept, plus the bonus
    assert accepted_prefix([5, 9, 7, 8], [5, 6, 7]) == [5, 9]  # first disagreement: the target's token
    assert accepted_prefix([4, 6, 7, 8], [5, 6, 7]) == [4]
    assert accepted_prefix([3], []) == [3]  # no guesses: plain decoding


def test_accepted_prefix_stops_at_the_first_rejection():
    assert accepted_prefix([10, 11, 12, 13], [1, 2, 3], [True, False, True, False]) == [1, 11]
    assert accepted_prefix([10, 11, 12, 13], [1, 2, 3], [True, True, True, False]) == [1, 2, 3, 13]
    assert accepted_prefix([10, 11, 12, 13], [1, 2, 3], [False, True, True, False]) == [10]


def _distribution_cases():
    g = torch.Generator().manual_seed(0)
    p = torch.rand(6, generator=g)
    q = torch.rand(6, generator=g)
    top2 = torch.tensor([0.0, 0.0, 0.7, 0.3, 0.0, 0.0])  # a draft filtered to another support
    return {
        "random": (p / p.sum(), q / q.sum()),
        "draft equals target": (p / p.sum(), p / p.sum()),
        "draft one-hot": (p / p.sum(), torch.eye(6)[1]),
        "supports differ": (torch.tensor([0.5, 0.5, 0.0, 0.0, 0.0, 0.0]), top2),
    }


@pytest.mark.parametrize("case", list(_distribution_cases()))
def test_rejection_sampling_gives_the_target_distribution(case):
    """Whatever the draft, the emitted token is distributed as the target's p."""
    p, q = _distribution_cases()[case]
    n, vocab = 60_000, p.shape[0]
    g = torch.Generator().manual_seed(1)
    drafts = torch.multinomial(q, n, replacement=True, generator=g)
    accepted, recovered = rejection_sample(
        p.expand(n, vocab).contiguous(),
        q.expand(n, vocab).contiguous(),
        drafts,
        torch.rand(n, generator=g),
        torch.empty(n, vocab).exponential_(generator=g),
    )
    emitted = torch.where(accepted, drafts, recovered)
    freq = torch.bincount(emitted, minlength=vocab).float() / n
    sigma = (p * (1 - p) / n).sqrt()
    assert torch.all((freq - p).abs() <= 5 * sigma + 1e-9), (freq, p)
    # Acceptance happens at the rate the theory says: sum over x of min(p(x), q(x)).
    rate = accepted.float().mean()
    assert abs(rate - torch.minimum(p, q).sum()) < 0.01


def test_a_bonus_row_is_drawn_from_the_target():
    p = torch.tensor([0.1, 0.6, 0.3])
    n = 30_000
    g = torch.Generator().manual_seed(2)
    accepted, recovered = rejection_sample(
        p.expand(n, 3).contiguous(),
        torch.zeros(n, 3),
        torch.zeros(n, dtype=torch.long),
        torch.rand(n, generator=g),
        torch.empty(n, 3).exponential_(generator=g),
    )
    assert not accepted.any()
    freq = torch.bincount(recovered, minlength=3).float() / n
    assert torch.allclose(freq, p, atol=0.015)


# ------------------------------------------------------------------ the engine
def _prompts(vocab: int, n: int = 16, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, 2, 15, 16, 17, 100] + [rng.randint(3, 70) for _ in range(n - 6)]
    return [[rng.randrange(vocab) for _ in range(length)] for length in lengths]


@pytest.fixture(scope="module")
def case(model_dirs):
    """Target tied-gqa2; draft: the 3-layer random model of the same shape and seed (it shares
    the target's vocabulary and some of its weights, so it agrees only part of the time)."""
    target, draft = model_dirs["tied-gqa2"], model_dirs["sharded"]
    prompts = _prompts(ModelConfig.from_model_dir(target).vocab_size)
    return target, draft, prompts, transformers_greedy(target, prompts, MAX_TOKENS)


GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize(
    "setting",
    [
        dict(num_kv_blocks=512),
        dict(num_kv_blocks=512, enable_prefix_caching=False),
        dict(num_kv_blocks=512, num_speculative_tokens=1),
        dict(num_kv_blocks=512, num_speculative_tokens=7),
        dict(num_kv_blocks=16),  # preemptions
        dict(num_kv_blocks=512, max_num_batched_tokens=8),  # every prompt chunked; few draft slots fit
    ],
    ids=["roomy", "no-prefix-cache", "k1", "k7", "preemption", "chunked"],
)
def test_greedy_with_a_draft_equals_transformers(case, setting):
    target, draft, prompts, expected = case
    llm = LLM(str(target), dtype="float32", draft_model=str(draft), show_progress=False, **setting)
    outputs = run_checked(llm.engine, prompts, GREEDY)
    assert [o.token_ids for o in outputs] == expected
    stats = llm.stats()
    assert 0 < stats["num_accepted_draft_tokens"] < stats["num_draft_tokens"]  # both verdicts happened
    if setting["num_kv_blocks"] == 16:
        assert stats["num_preemptions"] > 0
    assert stats["generated_tokens"] == MAX_TOKENS * len(prompts)
    assert_all_blocks_back(llm.engine)


def test_a_draft_identical_to_the_target_is_always_accepted(case):
    target, _, prompts, _ = case
    for params in (GREEDY, SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, ignore_eos=True, seed=5)):
        llm = LLM(str(target), dtype="float32", draft_model=str(target), num_kv_blocks=512, show_progress=False)
        run_checked(llm.engine, prompts[:6], params)
        stats = llm.stats()
        # Sampled: p and q agree to float rounding, so the ratio is 1 up to about 1e-6.
        assert stats["num_accepted_draft_tokens"] >= 0.99 * stats["num_draft_tokens"] > 0


def test_seeded_sampling_with_a_draft_does_not_depend_on_the_batch(case):
    target, draft, prompts, _ = case
    seeded = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, top_k=20, seed=11, ignore_eos=True)
    others = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, ignore_eos=True)
    alone = LLM(str(target), dtype="float32", draft_model=str(draft), num_kv_blocks=512, show_progress=False)
    expected = alone.generate([prompts[3]], seeded, use_tqdm=False)[0].token_ids
    busy = LLM(str(target), dtype="float32", draft_model=str(draft), num_kv_blocks=512, show_progress=False)
    outs = busy.generate(
        prompts[:3] + [prompts[3]] + prompts[4:8], [others] * 3 + [seeded] + [others] * 4, use_tqdm=False
    )
    assert outs[3].token_ids == expected
    assert len(expected) == MAX_TOKENS


def test_stops_inside_an_accepted_draft(model_dirs):
    """A stop token, stop string or max_tokens reached among accepted drafts ends the request
    there, exactly as without a draft; nothing after it is kept."""
    target = str(model_dirs["tied-gqa2"])
    plain = LLM(target, dtype="float32", num_kv_blocks=256, show_progress=False)
    spec = LLM(target, dtype="float32", draft_model=target, num_kv_blocks=256, show_progress=False)
    prompts = _prompts(plain.engine.runner.model.config.vocab_size, n=8, seed=3)
    reference = plain.generate(prompts, GREEDY, use_tqdm=False)
    stop_token = reference[0].token_ids[5]
    text = reference[1].text
    cases = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (1, 2, 3, 5, 6)]
    cases.append(SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, stop_token_ids=[stop_token]))
    if len(text) > 6:
        cases.append(SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, stop=[text[3:6]], ignore_eos=True))
    for params in cases:
        want = plain.generate(prompts, params, use_tqdm=False)
        # Stepped by hand: after every step no sequence counts more computed tokens than it has,
        # though the target computed the K/V of guesses that a stop then cut.
        got = run_checked(spec.engine, prompts, params)
        assert [(o.token_ids, o.text, o.finish_reason, o.stop_reason) for o in got] == [
            (o.token_ids, o.text, o.finish_reason, o.stop_reason) for o in want
        ], params
    assert_all_blocks_back(spec.engine)


def test_streaming_with_a_draft_adds_up_and_abort_frees_blocks(case):
    target, draft, prompts, expected = case
    llm = LLM(str(target), dtype="float32", draft_model=str(draft), num_kv_blocks=512, show_progress=False)
    pieces = [out.new_token_ids for out in llm.stream(prompts[2], GREEDY)]
    assert sum(pieces, []) == expected[2]
    assert max(len(p) for p in pieces) > 1  # some steps gave several tokens
    engine = llm.engine
    request = engine.add_request(prompts[5], GREEDY)
    engine.step()
    engine.step()
    engine.abort_request(request)
    assert not engine.has_unfinished_requests()
    assert_all_blocks_back(engine)


def test_requests_with_logprobs_or_penalties_are_served_without_drafts(case):
    target, draft, prompts, _ = case
    plain = LLM(str(target), dtype="float32", num_kv_blocks=512, show_progress=False)
    spec = LLM(str(target), dtype="float32", draft_model=str(draft), num_kv_blocks=512, show_progress=False)
    for params in (
        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, repetition_penalty=1.3),
    ):
        want = plain.generate(prompts[:4], params, use_tqdm=False)
        got = spec.generate(prompts[:4], params, use_tqdm=False)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert [o.logprobs for o in got] == [o.logprobs for o in want]
    assert spec.stats()["num_draft_tokens"] == 0


def test_tiny_pair_greedy_answers_unchanged():
    """The shipped pair: the draft changes how fast, never what the chat model answers."""
    prompts = [
        [{"role": "user", "content": q}] for q in ("What is 12 + 30?", "What is the capital of Egypt?", "Spell cat")
    ]
    params = SamplingParams(max_tokens=32, temperature=0.0)
    plain = LLM("tiny", show_progress=False).chat(prompts, params)
    spec = LLM("tiny", draft_model="tiny-draft", show_progress=False)
    got = spec.chat(prompts, params)
    assert [o.text for o in got] == [o.text for o in plain]
    assert spec.stats()["num_accepted_draft_tokens"] > 0


def test_bad_draft_settings_are_refused(model_dirs):
    target = str(model_dirs["tied-gqa2"])
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(target, dtype="float32", draft_model=str(model_dirs["untied-gqa4"]), num_kv_blocks=64, show_progress=False)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(
            target, dtype="float32", draft_model=target, num_speculative_tokens=0, num_kv_blocks=64, show_progress=False
        )
    with pytest.raises(ValueError, match="without a draft model"):
        LLM(target, dtype="float32", num_speculative_tokens=6, num_kv_blocks=64, show_progress=False)


def test_draft_slots_only_take_what_prompts_and_decodes_leave():
    """With a tight token budget, prompts are still admitted and chunked, and every decoding
    sequence gets its token each step; drafts only use what is left of the budget."""
    from mini_infer.kv.block_pool import BlockPool
    from mini_infer.scheduler import Scheduler
    from mini_infer.sequence import Sequence

    class FourGuesses:
        def num_draft_slots(self, seq):
            return 4

        def num_cacheable_tokens(self, seq):
            return seq.num_computed_tokens

    scheduler = Scheduler(
        BlockPool(64, 16), max_num_batched_tokens=7, max_num_seqs=8, max_model_len=256, speculation=FourGuesses()
    )
    seqs = [Sequence(str(i), [1, 2, 3], SamplingParams(max_tokens=50, temperature=0.0), arrival=i) for i in range(5)]
    for seq in seqs:
        scheduler.add(seq)
    checked = 0
    for step in range(12):
        out = scheduler.schedule()
        if step < 2:  # 15 prompt tokens: two full steps of prefill (and decodes), no drafts
            assert out.num_tokens == 7 and not any(item.num_draft_tokens for item in out.scheduled)
        if all(not s.is_prefilling for s in seqs) and all(s in scheduler.running for s in seqs):
            assert sorted(item.seq.request_id for item in out.scheduled) == [s.request_id for s in seqs]
            assert out.num_tokens == 7 and sum(item.num_draft_tokens for item in out.scheduled) == 2
            checked += 1
        scheduler.update(out.scheduled, [[0] if item.samples else [] for item in out.scheduled])
        scheduler.check_invariants()
    assert checked >= 5


def test_forks_with_a_draft_share_the_prompt_and_give_the_targets_tokens(case):
    """The n choices of one request decode with drafts to the target's own greedy tokens. The
    draft is the target itself, so every guess is kept only if the prompt blocks the fork shares
    hold the draft's K/V too."""
    target, _, prompts, expected = case
    llm = LLM(str(target), dtype="float32", draft_model=str(target), num_kv_blocks=64, show_progress=False)
    engine = llm.engine
    parent = engine.add_request(prompts[5], GREEDY)
    child = engine.add_request(prompts[5], GREEDY, fork_of=parent)
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out.token_ids
        engine.scheduler.check_invariants()
    assert finals[parent] == finals[child] == expected[5]
    stats = llm.stats()
    assert stats["num_accepted_draft_tokens"] == stats["num_draft_tokens"] > 0
    assert_all_blocks_back(engine)


def test_a_draft_whose_vocabulary_is_padded_differently(tmp_path):
    """One tokenizer, two padded vocabulary sizes (as Qwen2.5-0.5B drafting for Qwen2.5-7B): the
    draft's distributions are cut or padded to the target's width; outputs stay the target's."""
    from mini_infer.offline_models import write_random_model

    def model(name: str, tokenizer_vocab_size: int = 300, **overrides):
        return str(
            write_random_model(
                tmp_path / name,
                "tiny-test",
                seed=1,
                dtype="float32",
                init_std=0.1,
                tokenizer_vocab_size=tokenizer_vocab_size,
                **overrides,
            )
        )

    target = model("target")  # 512 rows
    prompts = _prompts(300, n=6, seed=4)
    want = LLM(target, dtype="float32", num_kv_blocks=128, show_progress=False).generate(
        prompts, GREEDY, use_tqdm=False
    )
    sampled = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, top_p=0.9, seed=3, ignore_eos=True)
    for draft in (
        model("wider", vocab_size=640, num_hidden_layers=1),
        model("narrower", vocab_size=384, num_hidden_layers=1),
    ):
        llm = LLM(target, dtype="float32", num_kv_blocks=128, draft_model=draft, show_progress=False)
        got = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        outs = run_checked(llm.engine, prompts, sampled)
        assert all(len(o.token_ids) == MAX_TOKENS and max(o.token_ids) < 512 for o in outs)
        assert llm.stats()["num_accepted_draft_tokens"] > 0
    other_tokenizer = model("other", vocab_size=640, num_hidden_layers=1, tokenizer_vocab_size=250)
    with pytest.raises(ValueError, match="another tokenizer"):
        LLM(target, dtype="float32", num_kv_blocks=128, draft_model=other_tokenizer, show_progress=False)
