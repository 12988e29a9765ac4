"""Structured outputs (chapter 09b): the request's shape, grammars that do not compile, the bitmask
on the device, and the engine on the shipped tiny model: every output matches its grammar,
through batching with other requests, preemption, forks, the prefix cache and a draft model.

The tiny model never saw JSON in training: inside a string it rarely writes the closing quote.
The schemas here bound their strings (``maxLength``, ``enum``) so that every output completes;
an unbounded string is the subject of ``test_a_cut_output_is_a_prefix_the_grammar_allows``.
"""

from __future__ import annotations

import json
import re
from types import SimpleNamespace
from typing import Any

import jsonschema
import llguidance
import pytest
import torch

from mini_infer import LLM, SamplingParams, StructuredOutputsParams
from mini_infer.sampling import Sampler
from mini_infer.sequence import Sequence
from mini_infer.structured_output import (
    StructuredOutputs,
    apply_bitmask,
    check_grammar,
    grammar_of,
    token_bitmask,
)
from tests.engine_checks import run_checked

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "units": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "days", "units"],
    "additionalProperties": False,
}
QUESTIONS = [
    "What is the weather in Paris?",
    "Reverse this list: cat, dog, sun.",
    "What is 34 + 57?",
    "Count the items: cat, cat, sun.",
    "What is the capital of Peru?",
    "Repeat these words: red, owl.",
]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny", dtype="float32", num_kv_blocks=256, show_progress=False)


@pytest.fixture(scope="module")
def prompts(llm: LLM) -> list[str]:
    return [llm.engine.tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]


def constrained(spec: StructuredOutputsParams, **fields: Any) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 80, "temperature": 0.0, **fields}, structured_outputs=spec)


# ------------------------------------------------------------------ the request's shape
@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({}, "exactly one of .* got none"),
        ({"json": WEATHER, "regex": "a"}, "exactly one of .* got json, regex"),
        ({"json": 3}, "structured_outputs.json must be a JSON Schema"),
        ({"regex": ""}, "structured_outputs.regex must be a non-empty string"),
        ({"choice": []}, "structured_outputs.choice must be a non-empty list"),
        ({"choice": ["a", 2]}, "structured_outputs.choice must be a non-empty list"),
        ({"json_object": 1}, "structured_outputs.json_object must be a bool, got 1"),
    ],
)
def test_structured_outputs_params_refuse_bad_shapes(fields: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        StructuredOutputsParams(**fields)


def test_sampling_params_refuse_what_would_leave_no_token() -> None:
    spec = StructuredOutputsParams(json_object=True)
    with pytest.raises(ValueError, match="ignore_eos cannot be combined with structured_outputs"):
        SamplingParams(structured_outputs=spec, ignore_eos=True)
    with pytest.raises(ValueError, match="min_tokens cannot be combined with structured_outputs"):
        SamplingParams(structured_outputs=spec, min_tokens=2)
    with pytest.raises(ValueError, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"json": {}})  # type: ignore[arg-type]
    assert SamplingParams(structured_outputs=spec).changes_logits
    assert not SamplingParams().changes_logits


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        (
            StructuredOutputsParams(json={"type": "nonsense"}),
            r"(?s)structured_outputs.json does not compile: .*nonsense",
        ),
        (StructuredOutputsParams(json="{not json"), "structured_outputs.json is not valid JSON"),
        (StructuredOutputsParams(regex="a(b"), "(?s)structured_outputs.regex does not compile: .*unclosed group"),
        (
            StructuredOutputsParams(grammar="start: missing"),
            "(?s)structured_outputs.grammar does not compile: .*missing",
        ),
    ],
)
def test_a_grammar_that_does_not_compile_is_refused_with_its_problem(llm: LLM, spec, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        check_grammar(spec)
    with pytest.raises(ValueError, match=match):  # and by the engine, before anything is scheduled
        llm.engine.add_request("hi", SamplingParams(structured_outputs=spec))
    assert not llm.engine.has_unfinished_requests()


def test_choices_are_literal_strings() -> None:
    tricky = ['a "quoted" word', "back\\slash", "é"]
    grammar = grammar_of(StructuredOutputsParams(choice=tricky))
    assert llguidance.LLMatcher.validate_grammar(grammar) == ""


# ------------------------------------------------------------------ the bitmask
def test_apply_bitmask_keeps_exactly_the_set_bits() -> None:
    g = torch.Generator().manual_seed(0)
    rows, vocab = 3, 70  # not a multiple of 32: the last word is cut
    allowed = torch.rand(rows, vocab, generator=g) < 0.3
    allowed[0, 31] = allowed[1, 63] = True  # bit 31: the sign bit of an int32 word
    bitmask = torch.stack([token_bitmask(row.nonzero().flatten().tolist(), vocab) for row in allowed])
    logits = torch.randn(rows, vocab, generator=g)
    expected = logits.masked_fill(~allowed, -float("inf"))
    apply_bitmask(logits, bitmask)
    assert torch.equal(logits, expected)


def test_a_matcher_in_error_allows_only_the_end(llm: LLM) -> None:
    mask = StructuredOutputs(llm.engine.tokenizer, 704, [2])
    matcher = mask.matcher_for(StructuredOutputsParams(choice=["yes"]))
    matcher.consume_token(5)  # a token the grammar forbids: the matcher is in error for good
    assert matcher.is_error()
    row = torch.full((1, 22), -1, dtype=torch.int32)
    mask._fill_row(matcher, row, 0)
    assert torch.equal(row[0], token_bitmask([2], 704))


# ------------------------------------------------------------------ the engine
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_json_schema_outputs_parse_and_validate(llm: LLM, prompts: list[str], temperature: float) -> None:
    params = constrained(StructuredOutputsParams(json=WEATHER), temperature=temperature, seed=7)
    for out in run_checked(llm.engine, [llm.engine.tokenizer.encode(p) for p in prompts], params):
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), WEATHER)


def test_regex_choice_and_grammar_outputs_match(llm: LLM, prompts: list[str]) -> None:
    cases = [
        (StructuredOutputsParams(regex=r"-?[0-9]{1,3}"), lambda text: re.fullmatch(r"-?[0-9]{1,3}", text)),
        (StructuredOutputsParams(choice=["yes", "no", "maybe"]), lambda text: text in ("yes", "no", "maybe")),
        (
            StructuredOutputsParams(grammar='start: "The answer is " /[a-z]{2,8}/ "."'),
            lambda text: re.fullmatch(r"The answer is [a-z]{2,8}\.", text),
        ),
    ]
    for spec, holds in cases:
        for out in llm.generate(prompts, constrained(spec, temperature=0.8, seed=1), use_tqdm=False):
            assert out.finish_reason == "stop" and holds(out.text), (spec, out.text)


def test_a_cut_output_is_a_prefix_the_grammar_allows(llm: LLM, prompts: list[str]) -> None:
    """JSON mode (any object): the tiny model may open a key and never close it; at max_tokens the
    output is cut ("length"), but every token it wrote was allowed."""
    spec = StructuredOutputsParams(json_object=True)
    for out in llm.generate(prompts, constrained(spec, max_tokens=24), use_tqdm=False):
        matcher = llm.engine.sampler.mask.matcher_for(spec)  # type: ignore[attr-defined]
        assert matcher.consume_tokens(out.token_ids[:-1] if out.finish_reason == "stop" else out.token_ids)
        if out.finish_reason == "stop":
            assert isinstance(json.loads(out.text), dict)


def test_requests_without_a_grammar_pay_nothing_and_keep_their_tokens(llm: LLM, prompts: list[str]) -> None:
    free = SamplingParams(max_tokens=16, temperature=0.0)
    mask = llm.engine.sampler.mask  # type: ignore[attr-defined]
    before = mask.num_masked_rows
    alone = llm.generate(prompts, free, use_tqdm=False)
    assert mask.num_masked_rows == before  # no row masked, no mask built

    # Side by side with constrained requests, in the same batches: the same tokens.
    params = [free, constrained(StructuredOutputsParams(json=WEATHER))] * len(prompts)
    mixed = llm.generate([p for p in prompts for _ in range(2)], params, use_tqdm=False)
    assert [o.token_ids for o in mixed[::2]] == [o.token_ids for o in alone]
    assert mask.num_masked_rows > before
    for out in mixed[1::2]:
        jsonschema.validate(json.loads(out.text), WEATHER)


def test_preemption_keeps_the_grammar_state(prompts: list[str]) -> None:
    """A pool too small for every request at once: sequences are preempted and recomputed, and
    their outputs are the ones of an unpressured run."""
    params = constrained(StructuredOutputsParams(json=WEATHER))
    roomy = LLM("tiny", dtype="float32", num_kv_blocks=256, show_progress=False)
    tight = LLM("tiny", dtype="float32", num_kv_blocks=16, show_progress=False)
    expected = [o.token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    ids = [tight.engine.tokenizer.encode(p) for p in prompts]
    assert [o.token_ids for o in run_checked(tight.engine, ids, params)] == expected
    assert tight.engine.scheduler.num_preemptions > 0


def test_a_lost_state_is_rebuilt_from_the_tokens(llm: LLM, prompts: list[str]) -> None:
    params = constrained(StructuredOutputsParams(json=WEATHER))
    expected = llm.generate(prompts[:1], params, use_tqdm=False)[0].token_ids
    engine = llm.engine
    request_id = engine.add_request(prompts[0], params)
    seq = engine.outputs.requests[request_id].seq
    final = None
    mask = engine.sampler.mask  # type: ignore[attr-defined]
    while final is None:
        mask._states.pop(seq, None)  # every step: the state is made anew from the kept tokens
        final = next((o for o in engine.step() if o.request_id == request_id and o.finished), None)
    assert final.token_ids == expected


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_forks_each_follow_the_grammar(prefix_caching: bool) -> None:
    llm = LLM("tiny", dtype="float32", num_kv_blocks=128, enable_prefix_caching=prefix_caching, show_progress=False)
    engine = llm.engine
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": QUESTIONS[0]}])
    spec = StructuredOutputsParams(json=WEATHER)
    for round_ in range(2):  # the second round finds the prompt in the prefix cache
        engine.add_request(prompt, constrained(spec, temperature=1.0, seed=10), f"a{round_}")
        for i in range(3):
            engine.add_request(
                prompt, constrained(spec, temperature=1.0, seed=11 + i), f"f{round_}{i}", fork_of=f"a{round_}"
            )
        finals = {}
        while engine.has_unfinished_requests():
            finals.update({o.request_id: o for o in engine.step() if o.finished})
            engine.scheduler.check_invariants()
        texts = [o.text for o in finals.values()]
        for text in texts:
            jsonschema.validate(json.loads(text), WEATHER)
        assert len(set(texts)) > 1  # four seeds, four states: not one copy of the same output
    if prefix_caching:
        assert engine.scheduler.blocks.prefix_cache_hit_tokens > 0


def test_a_draft_model_s_guesses_are_verified_against_the_grammar(prompts: list[str]) -> None:
    """Greedy: the same tokens as without a draft, with guesses verified (and some kept)."""
    params = constrained(StructuredOutputsParams(json=WEATHER))
    plain = LLM("tiny", dtype="float32", num_kv_blocks=256, show_progress=False)
    spec = LLM("tiny", dtype="float32", draft_model="tiny-draft", num_kv_blocks=256, show_progress=False)
    expected = [o.token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    outputs = spec.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outputs] == expected
    stats = spec.stats()
    assert stats["num_draft_tokens"] > 0 and stats["num_accepted_draft_tokens"] > 0
    # Sampled: rejection sampling against the masked target; every output still validates.
    for out in spec.generate(prompts, constrained(StructuredOutputsParams(json=WEATHER), temperature=0.9, seed=3)):
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), WEATHER)


def test_a_forbidden_guess_is_rejected_and_later_rows_are_left_alone(llm: LLM) -> None:
    """Rows of one sequence with guesses: row j is masked with the state after j guesses."""
    mask = StructuredOutputs(llm.engine.tokenizer, 704, [2])
    tok = llm.engine.tokenizer
    spec = StructuredOutputsParams(choice=["yes"])
    y, e, bad = tok.encode("y")[0], tok.encode("e")[0], tok.encode("z")[0]
    seq = Sequence("r", [1, 2, 3], SamplingParams(structured_outputs=spec), arrival=0)
    batch = SimpleNamespace(rows_of=[range(0, 4)], draft_token_ids=[[y, bad, e]], num_logits=4)
    logits = torch.zeros(4, 704)
    mask.apply(logits, batch, [seq])  # type: ignore[arg-type]
    allowed = [(row > -float("inf")).nonzero().flatten().tolist() for row in logits]
    assert allowed[0] == [y] and allowed[1] == [e]  # "y", then "e" after the guess "y"
    assert len(allowed[2]) == 704 and len(allowed[3]) == 704  # after the forbidden "z": never used
    state = mask.state_of(seq)
    assert state.num_consumed == 0 and not state.matcher.is_error()  # rolled back


def test_the_sampler_refuses_a_grammar_without_a_mask() -> None:
    with pytest.raises(ValueError, match="structured_outputs needs constrained decoding"):
        Sampler().check(SamplingParams(structured_outputs=StructuredOutputsParams(regex="a")))
