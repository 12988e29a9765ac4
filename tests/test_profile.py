"""``mini-infer profile`` (mini_infer/bench/profile.py): a trace that names every phase of the step.

The command's outputs are checked as a reader would use them: ``trace.json`` parses as Chrome
trace JSON and holds a range for every phase of the engine step and every decoder layer;
``phases.json`` agrees with it; the timeline is a PNG. Naming the phases must not change what the
engine computes, and leaves the engine as it was.
"""

import json

import pytest
import torch

from mini_infer import LLM, SamplingParams
from mini_infer.bench.profile import PHASE_NAMES, STEP, Workload, phase_ranges
from mini_infer.cli import main
from tests.engine_checks import assert_all_blocks_back


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    out = tmp_path_factory.mktemp("profile")
    argv = ["profile", "--model", "tiny", "--draft-model", "tiny-draft", "--workload", "mixed"]
    argv += ["--steps", "3", "--batch-size", "2", "--prompt-len", "40", "--out", str(out)]
    assert main(argv) == 0
    return out


def test_the_trace_is_chrome_trace_json_with_every_phase_and_layer(profiled):
    trace = json.loads((profiled / "trace.json").read_text())
    ranges = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    assert all({"name", "ts", "dur", "pid", "tid"} <= e.keys() for e in ranges)
    names = {e["name"] for e in ranges}
    missing = {STEP, *PHASE_NAMES, "layer.0", "layer.3"} - names
    assert not missing, f"no range named {sorted(missing)} in the trace"
    assert sum(e["name"] == STEP for e in ranges) == 3
    assert any(name.startswith("aten::") for name in names)  # the operators themselves


def test_the_phase_table_agrees_with_the_trace(profiled):
    summary = json.loads((profiled / "phases.json").read_text())
    rows = {row["name"]: row for row in summary["phases"]}
    assert set(rows) == {STEP, *PHASE_NAMES, "layer"}
    assert rows[STEP]["share_of_step"] == pytest.approx(1.0)
    # The phases run one after another inside the step: their shares add up to at most the step.
    assert 0 < sum(rows[p]["share_of_step"] for p in PHASE_NAMES) <= 1.0 + 1e-9
    assert rows["forward"]["device_ops_per_step"] > rows["sample"]["device_ops_per_step"] > 0
    assert rows["layer"]["host_ms_per_step"] <= rows["forward"]["host_ms_per_step"]
    assert summary["overhead"] == pytest.approx(summary["step_ms_profiled"] / summary["step_ms_unprofiled"])
    assert (profiled / "phases.txt").read_text().splitlines()[0].split()[0] == "phase"
    assert (profiled / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_naming_the_phases_changes_no_token_and_leaves_the_engine_as_it_was():
    llm = LLM("tiny", show_progress=False)
    engine = llm.engine
    layers = engine.runner.model.layers
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = ["What is 12 + 30?", "What is 7 + 5?"]
    plain = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    with phase_ranges(engine), torch.profiler.profile() as prof:
        named = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert engine.runner.model.layers is not layers
    assert named == plain
    assert {"forward", "layer.0"} <= {e.name for e in prof.events()}
    assert engine.runner.model.layers is layers
    for part in (engine, engine.scheduler, engine.runner, engine.sampler, engine.outputs):
        assert not {"step", "schedule", "prepare", "execute", "sample", "take", "update"} & vars(part).keys()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kind": "train"}, "--workload must be one of decode, prefill, mixed"),
        ({"steps": 0}, "--steps must be at least 1"),
        ({"batch_size": 0}, "--batch-size must be at least 1"),
    ],
)
def test_a_bad_workload_is_refused_naming_the_flag(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Workload(**({"kind": "decode", "batch_size": 2, "prompt_len": 8, "steps": 2} | kwargs))


def test_each_workload_profiles_steps_of_its_kind():
    llm = LLM("tiny", show_progress=False)
    engine = llm.engine
    engine.step_log = []
    Workload("decode", batch_size=3, prompt_len=20, steps=4).run(engine, 4)
    assert [(r.num_tokens, r.num_logits) for r in engine.step_log[-4:]] == [(3, 3)] * 4
    engine.step_log = []
    Workload("prefill", batch_size=1, prompt_len=100, steps=3).run(engine, 3)
    assert [r.num_tokens for r in engine.step_log] == [100] * 3  # one whole prompt a step
    assert not engine.has_unfinished_requests()
    assert_all_blocks_back(engine)  # what the workload left running was aborted
