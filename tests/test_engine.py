"""The engine against Hugging Face greedy decoding, under every scheduling regime (chapters 06, 07)."""

import random

import numpy as np
import pytest
import torch

from mini_infer import LLM, SamplingParams, StructuredOutputsParams
from mini_infer.config import ModelConfig
from mini_infer.engine import LLMEngine
from mini_infer.greedy import GreedySampler
from mini_infer.kv.block_pool import BlockPool
from mini_infer.kv.paged_attention import PagedKVCache
from mini_infer.model import Qwen2Model
from mini_infer.model_runner import ModelRunner
from mini_infer.scheduler import RequestTooLongError, Scheduler
from mini_infer.tokenizer import Tokenizer
from tests.engine_checks import assert_all_blocks_back, run_checked, transformers_greedy

MAX_TOKENS = 32
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def _prompts(vocab: int, n: int = 18, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, 2, 15, 16, 17, 150] + [rng.randint(3, 90) for _ in range(n - 6)]
    return [[rng.randrange(vocab) for _ in range(length)] for length in lengths]


@pytest.fixture(scope="module", params=["tied-gqa2", "untied-gqa4"])
def case(request, model_dirs):
    model_dir = model_dirs[request.param]
    prompts = _prompts(ModelConfig.from_model_dir(model_dir).vocab_size)
    return model_dir, prompts, transformers_greedy(model_dir, prompts, MAX_TOKENS)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_greedy_equals_transformers_with_roomy_pool(case, prefix_caching):
    model_dir, prompts, expected = case
    llm = LLM(
        str(model_dir), dtype="float32", num_kv_blocks=512, enable_prefix_caching=prefix_caching, show_progress=False
    )
    outputs = run_checked(llm.engine, prompts, GREEDY)
    assert [o.token_ids for o in outputs] == expected
    assert all(o.finish_reason == "length" for o in outputs)
    assert llm.stats()["num_preemptions"] == 0
    assert_all_blocks_back(llm.engine)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_greedy_unchanged_by_preemption(case, prefix_caching):
    model_dir, prompts, expected = case
    # The longest request needs 12 blocks alone; 16 blocks for 18 requests forces preemptions.
    llm = LLM(
        str(model_dir), dtype="float32", num_kv_blocks=16, enable_prefix_caching=prefix_caching, show_progress=False
    )
    outputs = run_checked(llm.engine, prompts, GREEDY)
    assert llm.stats()["num_preemptions"] > 0
    assert [o.token_ids for o in outputs] == expected
    assert_all_blocks_back(llm.engine)


def test_greedy_unchanged_by_chunked_prefill(case):
    model_dir, prompts, expected = case
    # A budget of 7 tokens chunks every prompt longer than 7, mid-block, over many steps.
    llm = LLM(
        str(model_dir),
        dtype="float32",
        num_kv_blocks=512,
        max_num_batched_tokens=7,
        max_num_seqs=4,
        show_progress=False,
    )
    outputs = run_checked(llm.engine, prompts, GREEDY)
    assert [o.token_ids for o in outputs] == expected
    assert llm.stats()["steps"] > len(prompts) * MAX_TOKENS / 4
    assert_all_blocks_back(llm.engine)


def test_seeded_sampling_independent_of_the_batch(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=256, show_progress=False)
    seeded = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = llm.generate([[5, 6, 7, 8]], seeded, use_tqdm=False)[0].token_ids
    others = [SamplingParams(max_tokens=24, temperature=0.8, ignore_eos=True) for _ in range(7)]
    prompts = [[9, 10, 11]] * 3 + [[5, 6, 7, 8]] + [[1, 2]] * 4
    busy = llm.generate(prompts, others[:3] + [seeded] + others[3:], use_tqdm=False)
    assert busy[3].token_ids == alone
    # Unseeded rows draw from the engine's generator and are not all identical.
    assert len({tuple(o.token_ids) for o in busy[:3]}) > 1


def test_outputs_in_prompt_order_with_text(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=256, show_progress=False)
    outs = llm.generate(
        ["hello world", "the cache", "a"], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True), use_tqdm=False
    )
    assert [o.prompt for o in outs] == ["hello world", "the cache", "a"]
    tokenizer = llm.engine.tokenizer
    for o in outs:
        assert o.prompt_token_ids == tokenizer.encode(o.prompt)
        assert o.text == tokenizer.decode(o.token_ids)


def test_stop_token_and_eos(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=256, show_progress=False)
    free_run = llm.generate([[3, 4, 5]], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), use_tqdm=False)[
        0
    ]
    stop_at = free_run.token_ids[4]
    first = free_run.token_ids.index(stop_at)
    out = llm.generate(
        [[3, 4, 5]], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop_at]), use_tqdm=False
    )[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at
    assert out.token_ids == free_run.token_ids[: first + 1]


def test_abort_frees_blocks(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=64, enable_prefix_caching=False, show_progress=False)
    engine = llm.engine
    rid = engine.add_request(list(range(40)), SamplingParams(max_tokens=100, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.scheduler.blocks.pool.num_free_blocks < 64
    out = engine.abort_request(rid)
    assert out is not None and out.finish_reason == "abort" and out.finished
    assert engine.scheduler.blocks.pool.num_free_blocks == 64 and not engine.has_unfinished_requests()


def test_stream_yields_increments(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=64, show_progress=False)
    pieces = list(llm.stream([1, 2, 3], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)))
    assert [len(p.new_token_ids) for p in pieces] == [1] * 6
    assert pieces[-1].finished and pieces[-1].token_ids == sum((p.new_token_ids for p in pieces), [])
    assert "".join(p.new_text for p in pieces) == pieces[-1].text


def test_requests_that_cannot_fit_are_refused(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=4, show_progress=False)
    with pytest.raises(RequestTooLongError, match="KV blocks"):
        llm.generate([list(range(60))], SamplingParams(max_tokens=10), use_tqdm=False)
    with pytest.raises(RequestTooLongError, match="maximum context length is 2048"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=5000), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "prompt, match",
    [
        ([], "empty"),
        ([1, 2, 10**6], "outside the vocabulary"),
        ([[1, 2], 3.5], "prompt 1"),
        ([[1, True]], r"prompt 0 .* holding True \(bool\)"),
        ([[1, 2.0]], r"prompt 0 .* holding 2.0 \(float\)"),
    ],
)
def test_bad_prompts_refused(tiny_model_dir, prompt, match):
    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=16, show_progress=False)
    with pytest.raises((ValueError, TypeError), match=match):
        llm.generate(prompt if prompt and isinstance(prompt[0], list) else [prompt], use_tqdm=False)


def test_chat_applies_template(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=64, show_progress=False)
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)[0]
    assert out.prompt.endswith("<|im_start|>assistant\n")


def test_max_model_len_may_shorten_the_context_but_not_lengthen_it(tiny_model_dir):
    short = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=16, max_model_len=100, show_progress=False)
    assert short.engine.scheduler.max_model_len == 100
    with pytest.raises(RequestTooLongError, match="maximum context length is 100"):
        short.generate([[1, 2, 3]], SamplingParams(max_tokens=98), use_tqdm=False)
    with pytest.raises(ValueError, match=r"max_model_len=4096 is longer than the model's context \(2048 tokens"):
        LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=16, max_model_len=4096, show_progress=False)


def test_integer_scalars_of_numpy_are_token_ids(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=64, show_progress=False)
    greedy = SamplingParams(max_tokens=4, temperature=0)
    from_numpy = llm.generate([list(np.arange(1, 9))], greedy, use_tqdm=False)[0]
    assert from_numpy.token_ids == llm.generate([list(range(1, 9))], greedy, use_tqdm=False)[0].token_ids


def test_engine_refuses_a_token_id_that_is_not_an_integer(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=64, show_progress=False)
    for prompt in ([1, 2.7], [True, 2]):  # int() would truncate 2.7 and read True as 1
        with pytest.raises(TypeError, match=r"prompt token [01] must be an int token id"):
            llm.engine.add_request(prompt, SamplingParams(max_tokens=2))
        with pytest.raises(TypeError, match="must be an int token id"):
            next(llm.stream(prompt, SamplingParams(max_tokens=2)))
    assert not llm.engine.has_unfinished_requests()


def test_chat_takes_openai_text_parts_and_refuses_malformed_messages(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=64, show_progress=False)
    greedy = SamplingParams(max_tokens=3, temperature=0)
    parts = [{"type": "text", "text": "What is "}, {"type": "text", "text": "2 + 3?"}]
    as_parts = llm.chat([{"role": "user", "content": parts}], greedy, use_tqdm=False)[0]
    as_text = llm.chat([{"role": "user", "content": "What is 2 + 3?"}], greedy, use_tqdm=False)[0]
    assert as_parts.prompt == as_text.prompt and as_parts.token_ids == as_text.token_ids
    user = {"role": "user", "content": "hi"}
    bad = [
        ([], "the conversation is empty"),
        ("hi", "a conversation must be a list of"),
        ([{"content": "hi"}], "message 0 needs a 'role'"),
        ([user, {"role": "user"}], "message 1 needs 'content'"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "content parts must be"),
        ([[user], [{"role": "user", "content": 5}]], "conversation 1: message 0: content must be a string"),
    ]
    for messages, match in bad:
        with pytest.raises(ValueError, match=match):
            llm.chat(messages, greedy, use_tqdm=False)
    # An assistant turn that only calls tools has no content.
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 2}}}
    history = [user, {"role": "assistant", "content": None, "tool_calls": [call]}, {"role": "tool", "content": "5"}]
    assert llm.chat(history, greedy, use_tqdm=False)[0].prompt.endswith("<|im_start|>assistant\n")
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_forks_share_the_prompt_blocks(tiny_model_dir, prefix_caching):
    llm = LLM(
        str(tiny_model_dir),
        dtype="float32",
        num_kv_blocks=64,
        enable_prefix_caching=prefix_caching,
        show_progress=False,
    )
    engine = llm.engine
    prompt = list(range(1, 41))  # 40 tokens: two full blocks and a partial one
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    engine.add_request(prompt, greedy, "a")
    engine.add_request(prompt, greedy, "b", fork_of="a")
    engine.add_request(prompt, greedy, "c", fork_of="a")
    first = engine.scheduler.schedule()
    assert [s.seq.request_id for s in first.scheduled] == ["a"]  # the forks wait for the prompt
    engine.scheduler.update(first.scheduled, [[7]])
    second = engine.scheduler.schedule()
    forks = {s.seq.request_id: s for s in second.scheduled if s.seq.request_id != "a"}
    assert {rid: s.num_new_tokens for rid, s in forks.items()} == {"b": 8, "c": 8}  # only the partial block
    shared = engine.scheduler.running[0].block_table.block_ids[:2]
    assert all(engine.scheduler.blocks.pool.ref_count(b) == 3 + prefix_caching for b in shared)
    engine.scheduler.update(second.scheduled, [[7] if s.seq.request_id == "a" else [] for s in second.scheduled])
    engine.scheduler.check_invariants()


def test_forks_give_the_same_greedy_text(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=64, enable_prefix_caching=False, show_progress=False)
    engine = llm.engine
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompt = list(range(3, 40))
    reference = llm.generate([prompt], greedy, use_tqdm=False)[0].token_ids
    engine.add_request(prompt, greedy, "p")
    engine.add_request(prompt, greedy, "q", fork_of="p")
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
        engine.scheduler.check_invariants()
    assert finals == {"p": reference, "q": reference}
    with pytest.raises(ValueError, match="not a request in flight"):
        engine.add_request(prompt, greedy, "r", fork_of="p")


def _chapter_06_engine(model_dir, num_blocks: int = 64) -> LLMEngine:
    """The engine as chapter 06 builds it: from its parts, with nothing of chapters 08-10."""
    model = Qwen2Model.from_pretrained(model_dir, torch.float32, show_progress=False)
    config = model.config
    runner = ModelRunner(model, PagedKVCache(config, num_blocks, 16, torch.float32, "cpu"))
    scheduler = Scheduler(BlockPool(num_blocks, 16), max_num_batched_tokens=64, max_num_seqs=8, max_model_len=512)
    return LLMEngine(runner, scheduler, Tokenizer(model_dir), eos_token_ids=config.eos_token_ids)


def test_the_chapter_06_engine_from_its_parts_decodes_like_transformers(case):
    """No prefix cache, the greedy sampler, no draft: the same tokens as the whole engine."""
    model_dir, prompts, expected = case
    engine = _chapter_06_engine(model_dir)
    assert (
        isinstance(engine.sampler, GreedySampler)
        and engine.scheduler.blocks.prefix_cache is None
        and engine.drafter is None
    )
    outputs = run_checked(engine, prompts[:8], GREEDY)
    assert [o.token_ids for o in outputs] == expected[:8]
    assert engine.scheduler.blocks.pool.num_free_blocks == engine.scheduler.blocks.pool.num_blocks


def test_the_greedy_sampler_refuses_what_only_chapter_09_can_do(tiny_model_dir):
    engine = _chapter_06_engine(tiny_model_dir)
    for params in (
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=0.0, logprobs=2),
        SamplingParams(temperature=0.0, repetition_penalty=1.2),
        SamplingParams(temperature=0.0, min_tokens=2),
        SamplingParams(temperature=0.0, logit_bias={5: 1.0}),
        SamplingParams(temperature=0.0, structured_outputs=StructuredOutputsParams(regex="a")),
    ):
        with pytest.raises(ValueError, match="greedily only"):
            engine.add_request([1, 2, 3], params)
    assert (
        not engine.has_unfinished_requests()
        and engine.scheduler.blocks.pool.num_free_blocks == engine.scheduler.blocks.pool.num_blocks
    )


def test_per_request_state_goes_with_the_request(monkeypatch):
    """Later chapters keep their per-request state in their own components (block bookkeeping,
    the draft's cache, the grammars), keyed by the sequence: once requests finish, abort or
    fail, none of it is left, however many ran."""
    import gc
    import logging

    from mini_infer import faults

    # A logged failure's traceback holds the frames of its step, with their sequences, for as long
    # as the test's log capture keeps the record: not logged here.
    monkeypatch.setattr(logging.getLogger("mini_infer.engine"), "disabled", True)

    llm = LLM("tiny", dtype="float32", draft_model="tiny-draft", num_kv_blocks=24, show_progress=False)
    engine = llm.engine
    grammar = StructuredOutputsParams(choice=["yes", "no", "maybe"])
    for i in range(12):
        params = SamplingParams(max_tokens=12, temperature=0.8, seed=i, structured_outputs=grammar if i % 2 else None)
        engine.add_request(f"question {i} " * (i + 1), params, f"r{i}")
        engine.add_request(f"question {i} " * (i + 1), params, f"f{i}", fork_of=f"r{i}")
    engine.abort_request("r3")
    with faults.inject("stop_check", lambda: RuntimeError("broken"), "r5"):  # fails that request alone
        while engine.has_unfinished_requests():
            engine.step()
    assert engine.stats()["num_preemptions"] > 0 and engine.stats()["failed_requests"] == 1
    gc.collect()
    blocks, drafter = engine.scheduler.blocks, engine.drafter
    maps = {
        "parents": blocks._parents,
        "blocks offered": blocks._offered,
        "cache hits": blocks._cache_hits,
        "draft's cache": drafter._draft_computed,  # type: ignore[union-attr]
        "grammars": drafter.sampler.mask._states,  # type: ignore[union-attr]
    }
    assert {name: len(m) for name, m in maps.items()} == dict.fromkeys(maps, 0)
