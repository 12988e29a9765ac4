"""The prefix cache inside the engine (chapter 08): same outputs, fewer tokens computed.

``tests/test_radix_cache.py`` checks the tree alone and ``tests/test_scheduler.py`` the scheduler
with a fake model; here the whole engine runs a real (random-weight) model on workloads whose
prompts share prefixes: groups of prompts with one system prompt each, and conversations whose
next turn repeats the previous one. With greedy sampling the cache must change nothing but the
work done, with or without memory pressure, and every block must come back.
"""

from __future__ import annotations

import random

import pytest

from mini_infer import LLM, SamplingParams
from tests.engine_checks import assert_all_blocks_back, run_checked

BLOCK = 16
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def shared_prefix_prompts(
    vocab: int, groups: int = 3, per_group: int = 3, system_len: int = 40, seed: int = 0
) -> list[list[int]]:
    """``groups`` system prompts of ``system_len`` tokens, each followed by ``per_group`` questions."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(groups):
        system = [rng.randrange(vocab) for _ in range(system_len)]
        for _ in range(per_group):
            prompts.append(system + [rng.randrange(vocab) for _ in range(rng.randint(3, 20))])
    return prompts


def make_llm(model_dir, **kwargs) -> LLM:
    kwargs.setdefault("num_kv_blocks", 256)
    return LLM(str(model_dir), dtype="float32", show_progress=False, **kwargs)


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """Outputs with the cache off and a roomy pool: what every other run must reproduce."""
    llm = make_llm(tiny_model_dir, enable_prefix_caching=False)
    prompts = shared_prefix_prompts(llm.engine.runner.model.config.vocab_size)
    outputs = run_checked(llm.engine, prompts, GREEDY)
    assert llm.stats()["prefix_cache_hit_tokens"] == 0
    assert_all_blocks_back(llm.engine)
    return prompts, [o.token_ids for o in outputs]


def test_cache_on_equals_cache_off_and_counts_hits(tiny_model_dir, reference):
    prompts, expected = reference
    # A budget of 32 tokens a step cuts every prompt into chunks; each block of the first prompt
    # of a group is cached as soon as it is computed, so the next prompt, admitted with the
    # first one's last chunk, already finds the system prompt's two whole blocks.
    llm = make_llm(tiny_model_dir, enable_prefix_caching=True, max_num_batched_tokens=32)
    outputs = run_checked(llm.engine, prompts, GREEDY)
    assert [o.token_ids for o in outputs] == expected
    stats = llm.stats()
    assert stats["prefix_cache_query_tokens"] == stats["prompt_tokens"] == sum(map(len, prompts))
    # Whole blocks of the 40-token system prompt only (the questions are random).
    assert [o.num_cached_tokens for o in outputs] == [0, 32, 32] * 3
    assert stats["prefix_cache_hit_tokens"] == 6 * 32
    assert_all_blocks_back(llm.engine)


def test_sequential_requests_hit_every_shared_block(tiny_model_dir, reference):
    """One request at a time: every later prompt of a group is served its shareable blocks."""
    prompts, expected = reference
    llm = make_llm(tiny_model_dir, enable_prefix_caching=True)
    outputs = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts]
    assert [o.token_ids for o in outputs] == expected
    assert [o.num_cached_tokens for o in outputs] == [0, 32, 32] * 3
    assert llm.stats()["prefix_cache_hit_tokens"] == 6 * 32
    assert_all_blocks_back(llm.engine)


def test_cache_on_equals_cache_off_under_preemption(tiny_model_dir, reference):
    prompts, expected = reference
    # Each request needs up to 5 blocks; 7 blocks for 9 requests forces preemptions, and the
    # scheduler must evict cache-only blocks before it preempts anyone.
    llm = make_llm(tiny_model_dir, enable_prefix_caching=True, num_kv_blocks=7)
    outputs = run_checked(llm.engine, prompts, GREEDY)
    assert llm.stats()["num_preemptions"] > 0
    assert [o.token_ids for o in outputs] == expected
    assert_all_blocks_back(llm.engine)


def test_a_request_arriving_while_its_sharer_runs_gets_hits(tiny_model_dir):
    """Blocks are cached as soon as they are computed, not when their request finishes."""
    llm = make_llm(tiny_model_dir, enable_prefix_caching=True, max_num_batched_tokens=32)
    engine = llm.engine
    rng = random.Random(1)
    system = [rng.randrange(500) for _ in range(80)]  # five whole blocks
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    engine.add_request(system + [1, 2, 3], params, "first")  # prefilled 32 tokens a step
    first = engine.scheduler.waiting[0]
    engine.step()
    engine.add_request(system + [4, 5], params, "mid-prefill")
    # The newcomer is admitted once "first" leaves budget over: with its last chunk (step 3),
    # when 64 of its 83 prompt tokens are computed, and cached.
    engine.step()
    assert first.num_computed_tokens == 64 and first.is_prefilling
    engine.step()
    assert [s.request_id for s in engine.scheduler.running] == ["first", "mid-prefill"]
    engine.step()
    assert first.num_output_tokens > 0 and not first.is_finished  # decoding now
    engine.add_request(system + [6, 7, 8, 9], params, "while-decoding")
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
        engine.scheduler.check_invariants()
    assert finals["first"].num_cached_tokens == 0
    assert finals["mid-prefill"].num_cached_tokens == 4 * BLOCK  # what "first" had computed
    assert finals["while-decoding"].num_cached_tokens == 5 * BLOCK  # the whole system prompt
    assert llm.stats()["prefix_cache_hit_tokens"] == 9 * BLOCK
    assert_all_blocks_back(engine)


def test_the_next_turn_of_a_conversation_reuses_the_answer_too(tiny_model_dir):
    """Generated tokens are cached as their blocks fill, so a follow-up reuses prompt and answer."""
    llm = make_llm(tiny_model_dir, enable_prefix_caching=True)
    turn1 = list(range(10, 50))  # 40 tokens
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    answer = llm.generate([turn1], params, use_tqdm=False)[0].token_ids
    # The K/V of every token but the last sampled one was computed: 40 + 29 = 69 -> 4 blocks.
    turn2 = turn1 + answer + [7, 8, 9]
    second = llm.generate([turn2], params, use_tqdm=False)[0]
    assert second.num_cached_tokens == 4 * BLOCK
    off = make_llm(tiny_model_dir, enable_prefix_caching=False)
    assert second.token_ids == off.generate([turn2], params, use_tqdm=False)[0].token_ids
    assert_all_blocks_back(llm.engine)


def test_idle_cache_blocks_are_evicted_for_new_work(tiny_model_dir):
    """A full cache never refuses work: cache-only blocks are evicted, least recently used first."""
    llm = make_llm(tiny_model_dir, enable_prefix_caching=True, num_kv_blocks=10)
    engine, cache = llm.engine, llm.engine.scheduler.blocks.prefix_cache
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    old, recent = list(range(100, 164)), list(range(200, 264))  # 4 whole blocks each
    llm.generate([old], params, use_tqdm=False)
    llm.generate([recent], params, use_tqdm=False)
    assert cache.num_cached_blocks == 8 and engine.scheduler.blocks.pool.num_free_blocks == 2
    out = llm.generate([list(range(300, 360))], params, use_tqdm=False)[0]  # needs 4 blocks
    assert out.finish_reason == "length" and llm.stats()["num_preemptions"] == 0
    assert cache.match_prefix(recent).num_tokens == 4 * BLOCK  # untouched
    assert cache.match_prefix(old).num_tokens == 2 * BLOCK  # the LRU leaf, trimmed from its end
    assert_all_blocks_back(engine)


def test_identical_prompts_in_a_pool_for_one_request_take_the_cached_copies(tiny_model_dir):
    """The second of two identical requests recomputes the last prompt block (its last token must
    give logits) and then the same answer: blocks the tree already holds. It must run on the
    tree's copies, or those copies sit unevictable above its own and it runs out of blocks."""
    prompt = list(range(30, 78))  # 3 whole blocks
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)  # 68 tokens: 5 blocks
    llm = make_llm(tiny_model_dir, enable_prefix_caching=True, num_kv_blocks=5, max_num_seqs=1)
    outputs = run_checked(llm.engine, [prompt, prompt], params)
    off = make_llm(tiny_model_dir, enable_prefix_caching=False)
    expected = off.generate([prompt], params, use_tqdm=False)[0].token_ids
    assert [o.token_ids for o in outputs] == [expected, expected]
    assert outputs[1].num_cached_tokens == 2 * BLOCK
    assert llm.stats()["num_preemptions"] == 0
    assert_all_blocks_back(llm.engine)


def test_a_request_preempted_during_its_prefill_is_counted_once(tiny_model_dir):
    """Hit and query counters count each request's prompt once, even when it is recomputed.

    "first" decodes into a third block while "second" is still ingesting its prompt in chunks;
    the pool is short, so "second" (the later arrival) is preempted before it sampled anything.
    When it runs again, the blocks it had cached itself match: that is recomputation saved,
    not a cache hit of the workload, and its prompt must not be counted a second time.
    """
    llm = make_llm(tiny_model_dir, enable_prefix_caching=True, num_kv_blocks=5, max_num_batched_tokens=16)
    engine = llm.engine
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    engine.add_request(list(range(1, 31)), params, "first")
    engine.step()
    engine.step()
    engine.add_request(list(range(100, 148)), params, "second")
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
        engine.scheduler.check_invariants()
    stats = llm.stats()
    assert stats["num_preemptions"] > 0
    assert stats["prefix_cache_query_tokens"] == stats["prompt_tokens"] == 78
    assert (
        stats["prefix_cache_hit_tokens"] == finals["first"].num_cached_tokens + finals["second"].num_cached_tokens == 0
    )
    assert_all_blocks_back(engine)


# -- the chapter's benchmark script -----------------------------------------------------------


def test_shareable_tokens_counts_whole_blocks_shared_within_a_group():
    from mini_infer.bench.prefix_cache import shareable_tokens

    a, b = list(range(40)), list(range(40)) + [99]
    prompts = [a, b, a[:20] + [7] * 30, list(range(33)), list(range(17))]
    groups = [0, 0, 0, 0, 1]
    # b: 40 shared -> 2 blocks; the third: 20 -> 1 block; the fourth shares 33 with a but keeps
    # its last token to compute: 32; the fifth is alone in its group.
    assert shareable_tokens(prompts, groups, BLOCK) == [0, 32, 16, 32, 0]


def test_benchmark_smoke(tiny_model_dir, tmp_path, capsys):
    import json

    from mini_infer.bench.prefix_cache import main

    out = tmp_path / "prefix.json"
    # A budget of 32 tokens admits the prompts one after another, so that most find their group's
    # system prompt cached; the script exits 1 below 80% of the shareable tokens.
    workload = "--groups 2 --prompts-per-group 3 --system-len 32 --question-len 3 8 --max-tokens 2 --repeats 1"
    args = ["--model", str(tiny_model_dir), *workload.split(), "--max-num-batched-tokens", "32", "--json", str(out)]
    assert main(args) == 0
    results = json.loads(out.read_text())
    assert results["outputs_equal"] and 0.8 <= results["hit_fraction"] <= 1
    assert 0 < results["hit_tokens"] <= results["shareable_tokens"]
    assert "hit fraction" in capsys.readouterr().out
