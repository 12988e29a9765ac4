"""A fault stays with its request, in the engine (``mini_infer.faults``, chapter 06).

For every stage of a request's own work, a fault injected for one request fails that request
alone (``finish_reason`` ``"error"``, the cause in ``error``), every other request finishes with
the tokens it has without the fault, and every block comes back. A fault that can have corrupted
shared state (a forward pass, out of memory) goes on up to the caller.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from mini_infer import LLM, SamplingParams, StructuredOutputsParams
from mini_infer.engine import LLMEngine
from mini_infer.faults import inject
from mini_infer.outputs import RequestOutput
from tests.engine_checks import assert_all_blocks_back

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"type": "integer", "maximum": 9}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
QUESTIONS = ["What is the weather in Paris?", "Count: cat, dog.", "What is 3 + 4?", "Name a red fruit."]
TARGET = "1"  # the request every fault is aimed at: the one with a grammar


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny", dtype="float32", num_kv_blocks=64, show_progress=False)


def requests(llm: LLM) -> list[tuple[str, str, SamplingParams]]:
    """Four requests side by side: plain, with a grammar (the target), with stop strings, plain."""
    template = llm.engine.tokenizer.apply_chat_template
    prompts = [template([{"role": "user", "content": q}]) for q in QUESTIONS]
    plain = SamplingParams(max_tokens=12, temperature=0.0)
    grammar = SamplingParams(max_tokens=24, temperature=0.0, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    stops = SamplingParams(max_tokens=12, temperature=0.0, stop=["zzz"])
    return [(str(i), p, sp) for i, (p, sp) in enumerate(zip(prompts, [plain, grammar, stops, plain]))]


def run(engine: LLMEngine, todo: list[tuple[str, str, SamplingParams]]) -> dict[str, RequestOutput]:
    """Add every request, step to the end checking the block invariants; the final outputs."""
    for request_id, prompt, params in todo:
        engine.add_request(prompt, params, request_id)
    finals: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        engine.scheduler.check_invariants()
    return finals


@pytest.fixture(scope="module")
def expected(llm: LLM) -> dict[str, list[int]]:
    finals = run(llm.engine, requests(llm))
    assert all(out.finish_reason in ("stop", "length") for out in finals.values())
    assert len(finals[TARGET].token_ids) > 2  # the grammar is advanced at least once
    return {request_id: out.token_ids for request_id, out in finals.items()}


def boom(kind: type[Exception] = RuntimeError) -> Callable[[], Exception]:
    return lambda: kind("injected fault")


@pytest.mark.parametrize(
    ("stage", "cause"),
    [
        ("grammar_advance", "its grammar failed: TypeError: injected fault"),
        ("grammar_mask", "its grammar's mask failed: TypeError: injected fault"),
        ("detokenize", "detokenizing or checking stops failed: RuntimeError: injected fault"),
        ("stop_check", "detokenizing or checking stops failed: RuntimeError: injected fault"),
        ("output", "building its output failed: RuntimeError: injected fault"),
        ("sample", "sampling failed: RuntimeError: injected fault"),
    ],
)
def test_a_fault_in_a_request_s_own_work_fails_it_alone(
    llm: LLM, expected: dict[str, list[int]], stage: str, cause: str
) -> None:
    engine = llm.engine
    failed_before = engine.stats()["failed_requests"]
    kind = TypeError if stage.startswith("grammar") else RuntimeError  # llguidance's TypeError, as seen on Kaggle
    with inject(stage, boom(kind), TARGET, engine=engine if stage == "sample" else None) as armed:
        finals = run(engine, requests(llm))
    assert armed.times_raised == 1
    failed = finals.pop(TARGET)
    assert (failed.finished, failed.finish_reason, failed.error) == (True, "error", cause)
    assert {request_id: out.token_ids for request_id, out in finals.items()} == {
        request_id: tokens for request_id, tokens in expected.items() if request_id != TARGET
    }
    assert all(out.error is None for out in finals.values())
    assert engine.stats()["failed_requests"] == failed_before + 1
    assert not engine.outputs.requests  # nothing of the failed request is left
    assert_all_blocks_back(engine)


def test_a_grammar_that_fails_to_compile_in_a_step_fails_its_request_alone(
    llm: LLM, expected: dict[str, list[int]]
) -> None:
    """The compiled grammar is gone from the cache when the request first runs (as after an
    eviction): it is compiled in the step, and llguidance raising there fails that request alone."""
    engine = llm.engine
    mask = engine.sampler.mask  # type: ignore[attr-defined]
    todo = requests(llm)
    for request_id, prompt, params in todo:
        engine.add_request(prompt, params, request_id)
    mask._compiled.clear()
    finals: dict[str, RequestOutput] = {}
    with inject("grammar_compile", boom(TypeError)) as armed:
        while engine.has_unfinished_requests():
            finals |= {out.request_id: out for out in engine.step() if out.finished}
            engine.scheduler.check_invariants()
    assert armed.times_raised == 1
    assert finals.pop(TARGET).error == "its grammar failed: TypeError: injected fault"
    assert {i: out.token_ids for i, out in finals.items()} == {i: t for i, t in expected.items() if i != TARGET}
    assert_all_blocks_back(engine)


@pytest.mark.parametrize(("stage", "kind"), [("admission", TypeError), ("grammar_compile", TypeError)])
def test_a_fault_at_admission_refuses_that_request_and_leaves_nothing(
    llm: LLM, expected: dict[str, list[int]], stage: str, kind: type[Exception]
) -> None:
    engine = llm.engine
    engine.sampler.mask._compiled.clear()  # type: ignore[attr-defined]  # compiled at admission
    todo = requests(llm)
    target = next(r for r in todo if r[0] == TARGET)
    with inject(stage, boom(kind)) as armed, pytest.raises(kind, match="injected fault"):
        engine.add_request(target[1], target[2], TARGET)
    assert armed.times_raised == 1
    assert not engine.has_unfinished_requests() and not engine.outputs.requests
    finals = run(engine, [r for r in todo if r[0] != TARGET])
    assert {i: out.token_ids for i, out in finals.items()} == {i: t for i, t in expected.items() if i != TARGET}
    assert_all_blocks_back(engine)


@pytest.mark.parametrize("error", [boom(RuntimeError), lambda: torch.OutOfMemoryError("CUDA out of memory")])
def test_a_failed_forward_pass_goes_up_to_the_caller(llm: LLM, error: Callable[[], Exception]) -> None:
    """A forward pass that raises may have left the KV cache (or the device) half written: the
    engine does not guess; the caller (the server) ends it."""
    engine = LLM("tiny", dtype="float32", num_kv_blocks=64, show_progress=False).engine
    for request_id, prompt, params in requests(llm):
        engine.add_request(prompt, params, request_id)
    with inject("forward", error, engine=engine), pytest.raises(type(error())):
        engine.step()
    assert engine.runner.execute.__func__ is type(engine.runner).execute  # type: ignore[attr-defined]


def test_inject_refuses_what_it_cannot_arm(llm: LLM) -> None:
    with pytest.raises(ValueError, match="unknown stage 'nowhere'"), inject("nowhere", boom()):
        pass
    with pytest.raises(ValueError, match="pass engine="), inject("forward", boom()):
        pass
