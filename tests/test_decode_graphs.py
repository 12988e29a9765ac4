"""The padded, shape-static decode step that CUDA graphs record (chapter 05), run eagerly on this
CPU: the same tokens as the unpadded step, whatever the batch size, under preemption, with the
prefix cache, and for speculative verification (several tokens per sequence)."""

import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mini_infer import LLM, SamplingParams
from mini_infer.config import ModelConfig
from mini_infer.decode_graphs import MAX_GRAPH_KEYS, DecodeGraphs, captured_batch_sizes
from mini_infer.model_runner import SequenceInput
from tests.engine_checks import assert_all_blocks_back, run_checked, transformers_greedy

MAX_TOKENS = 20
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def test_captured_batch_sizes():
    assert captured_batch_sizes(1) == [1]
    assert captured_batch_sizes(8) == [1, 2, 4, 8]
    assert captured_batch_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert captured_batch_sizes(256)[-3:] == [224, 240, 256]


def static_steps(llm: LLM) -> list[DecodeGraphs]:
    """Give every model of the engine the padded static decode step (no capture on a CPU), and
    count the steps it serves."""
    engine = llm.engine
    runners = [engine.runner] + ([engine.drafter.runner] if engine.drafter is not None else [])
    installed = []
    for runner in runners:
        graphs = DecodeGraphs(
            runner.model,
            runner.kv_cache,
            max_num_seqs=engine.scheduler.max_num_seqs,
            max_model_len=engine.scheduler.max_model_len,
            capture=False,
        )
        graphs.served = 0
        original = graphs.run

        def counting(batch, original=original, graphs=graphs):
            graphs.served += 1
            return original(batch)

        graphs.run = counting
        runner.static_decode = graphs
        installed.append(graphs)
    return installed


def _prompts(vocab: int, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(1, 40))] for _ in range(n)]


@pytest.fixture(scope="module")
def case(model_dirs):
    target = model_dirs["tied-gqa2"]
    prompts = _prompts(ModelConfig.from_model_dir(target).vocab_size, 11, seed=0)
    return target, model_dirs["sharded"], prompts, transformers_greedy(target, prompts, MAX_TOKENS)


@pytest.mark.parametrize(
    "setting",
    [
        dict(num_kv_blocks=256, max_num_seqs=16),  # 11 sequences padded to 16, then fewer as they finish
        dict(num_kv_blocks=256, max_num_seqs=5, enable_prefix_caching=False),  # 5 of 11 at a time
        dict(num_kv_blocks=12, max_num_seqs=16),  # preemptions
    ],
    ids=["padded", "between-sizes", "preemption"],
)
def test_the_static_step_decodes_like_the_unpadded_one(case, setting):
    target, _, prompts, expected = case
    llm = LLM(str(target), dtype="float32", show_progress=False, **setting)
    (graphs,) = static_steps(llm)
    outputs = run_checked(llm.engine, prompts, GREEDY)
    assert [o.token_ids for o in outputs] == expected
    assert graphs.served > 10  # decode steps went through the static step
    assert {size for _, size, _ in graphs.steps} - set(graphs.batch_sizes) == set()
    if setting["num_kv_blocks"] == 12:
        assert llm.stats()["num_preemptions"] > 0
    assert_all_blocks_back(llm.engine)


def test_speculative_verification_through_the_static_step(case):
    target, draft, prompts, expected = case
    llm = LLM(
        str(target),
        dtype="float32",
        draft_model=str(draft),
        num_speculative_tokens=3,
        num_kv_blocks=256,
        show_progress=False,
    )
    target_graphs, draft_graphs = static_steps(llm)
    outputs = run_checked(llm.engine, prompts, GREEDY)
    assert [o.token_ids for o in outputs] == expected
    assert any(q == 4 for q, _, _ in target_graphs.steps)  # verification: 1 + 3 tokens per sequence
    assert draft_graphs.served > 0 and llm.stats()["num_accepted_draft_tokens"] > 0


def test_padding_rows_write_only_the_null_block(case):
    target, _, prompts, _ = case
    llm = LLM(str(target), dtype="float32", num_kv_blocks=64, max_num_seqs=8, show_progress=False)
    (graphs,) = static_steps(llm)
    cache = llm.engine.runner.kv_cache
    llm.generate(prompts[:3], GREEDY, use_tqdm=False)  # 3 sequences padded to 4
    assert graphs.served > 0
    untouched = torch.zeros_like(cache.k[:, :, 0])
    assert cache.k[:, :, cache.null_block].abs().sum() > 0  # padding wrote here...
    free = llm.engine.scheduler.blocks.pool._free  # ...and never into a block no sequence used
    never_used = [b for b in free if b >= 3 * 4]
    assert all(torch.equal(cache.k[:, :, b], untouched) for b in never_used)


def fake_cuda_graphs(monkeypatch) -> dict:
    """CUDA's stream and graph calls faked on this CPU: a "graph" records nothing and its replay
    does nothing (what an engine on cuda:1 got when it captured on cuda:0's stream). Returns what
    the fakes saw: whether a capture is under way, and the devices each call was given."""
    import contextlib

    seen: dict = {"now": False, "streams": [], "current_streams": [], "device_contexts": [], "capture_streams": []}

    class FakeStream:
        def __init__(self, device=None):
            seen["streams"].append(device)

        def wait_stream(self, other):
            pass

    class FakeGraph:
        def replay(self):
            pass

    @contextlib.contextmanager
    def fake_graph(graph, pool=None, stream=None):
        seen["capture_streams"].append(stream)
        seen["now"] = True
        yield
        seen["now"] = False

    @contextlib.contextmanager
    def fake_device(device):
        seen["device_contexts"].append(device)
        yield

    def current_stream(device=None):
        seen["current_streams"].append(device)
        return FakeStream(device)

    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "graph", fake_graph)
    monkeypatch.setattr(torch.cuda, "device", fake_device)
    return seen


def engine_with_recording_graphs(target):
    """An engine over ``target`` whose decode steps go through DecodeGraphs set to record (CUDA's
    graph calls faked by the test), and those graphs."""
    llm = LLM(str(target), dtype="float32", num_kv_blocks=256, max_num_seqs=16, show_progress=False)
    return llm, recording_graphs(llm.engine)


def recording_graphs(engine):
    """Fresh DecodeGraphs set to record, installed as the engine's static decode step."""
    graphs = DecodeGraphs(
        engine.runner.model,
        engine.runner.kv_cache,
        max_num_seqs=16,
        max_model_len=engine.scheduler.max_model_len,
        capture=True,
    )
    engine.runner.static_decode = graphs
    return graphs


def test_an_empty_graph_fails_its_check_and_everything_runs_on_the_models_device(case, monkeypatch):
    """The capture's kernels run eagerly and record nothing (the "graph" replays nothing), so the
    output holds the right logits from the capture itself: a check that compared that output
    without clearing it passed, and the graph served stale logits from then on. The output is
    filled with NaN before the check's replay, so the empty graph is refused. Every stream and
    the capture are made on the model's device, inside torch.cuda.device(model.device)."""
    target, _, prompts, expected = case
    seen = fake_cuda_graphs(monkeypatch)
    llm, graphs = engine_with_recording_graphs(target)
    engine = llm.engine
    with pytest.warns(RuntimeWarning, match="did not reproduce the eager step"):
        outputs = run_checked(engine, prompts, GREEDY)
    assert [o.token_ids for o in outputs] == expected
    assert graphs.steps and graphs.eager_only == set(graphs.steps)  # no empty graph ever served
    device = engine.runner.model.device
    assert len(seen["device_contexts"]) == len(graphs.steps) and set(seen["device_contexts"]) == {device}
    assert seen["streams"] and set(seen["streams"]) == {device}  # side stream, capture stream
    assert set(seen["current_streams"]) == {device}
    assert len(seen["capture_streams"]) == len(graphs.steps) and None not in seen["capture_streams"]


def test_a_graph_that_does_not_reproduce_the_eager_step_never_serves(case, monkeypatch):
    """The recording path with CUDA's graph calls faked on this CPU, and a recording that comes
    out wrong: the replay is checked against the eager step, a warning says so, and that shape
    runs eagerly from then on; every token is still right."""
    target, _, prompts, expected = case
    recording = fake_cuda_graphs(monkeypatch)
    eager_forward = DecodeGraphs._forward
    monkeypatch.setattr(
        DecodeGraphs, "_forward", lambda self, key: eager_forward(self, key) * (0 if recording["now"] else 1)
    )

    llm, graphs = engine_with_recording_graphs(target)
    engine = llm.engine
    with pytest.warns(RuntimeWarning, match="did not reproduce the eager step"):
        outputs = run_checked(engine, prompts, GREEDY)
    assert [o.token_ids for o in outputs] == expected
    assert graphs.eager_only and graphs.eager_only == set(graphs.steps)

    # A recording that fails outright (a kernel that cannot be captured) is no error either.
    def failing_graph(graph, pool=None, stream=None):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(torch.cuda, "graph", failing_graph)
    graphs = recording_graphs(engine)
    with pytest.warns(RuntimeWarning, match="could not be recorded"):
        outputs = run_checked(engine, prompts, GREEDY)
    assert [o.token_ids for o in outputs] == expected and graphs.eager_only == set(graphs.steps)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="records CUDA graphs: needs CUDA")
def test_cuda_graphs_replay_the_eager_decode_steps(case):
    target, draft, prompts, expected = case
    for options in ({}, dict(draft_model=str(draft), num_speculative_tokens=3)):
        llm = LLM(
            str(target),
            dtype="float32",
            device="cuda",
            num_kv_blocks=256,
            max_num_seqs=16,
            show_progress=False,
            **options,
        )
        graphs = llm.engine.runner.static_decode
        assert isinstance(graphs, DecodeGraphs) and graphs.capture  # on by default on CUDA
        outputs = run_checked(llm.engine, prompts, GREEDY)
        assert [o.token_ids for o in outputs] == expected
        assert graphs.steps and not graphs.eager_only  # every recorded graph reproduced its eager step
    eager = LLM(str(target), dtype="float32", device="cuda", num_kv_blocks=256, enforce_eager=True, show_progress=False)
    assert eager.engine.runner.static_decode is None


def test_logits_are_computed_outside_the_static_step_for_the_real_rows_only(case):
    """Three sequences padded to four: the graph's output is the hidden states of all four rows,
    and the LM head runs on three rows, after the step (in the graph it held a [rows, vocab]
    buffer per captured shape)."""
    target, _, prompts, expected = case
    llm = LLM(str(target), dtype="float32", num_kv_blocks=64, max_num_seqs=8, show_progress=False)
    (graphs,) = static_steps(llm)
    model = llm.engine.runner.model
    rows_seen, original = [], model.compute_logits

    def counting(hidden, dtype=torch.float32):
        rows_seen.append(hidden.shape[0])
        return original(hidden, dtype)

    model.compute_logits = counting
    outputs = llm.generate(prompts[:3], GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outputs] == expected[:3]
    assert graphs.served > 0 and {size for _, size, _ in graphs.steps} == {4}
    assert graphs._forward((1, 4, 2)).shape == (4, model.config.hidden_size)  # the step ends at the norm
    assert 4 not in rows_seen and 3 in rows_seen  # never the padding row's logits


class CountingOps(TorchDispatchMode):
    """The operators (views left out: they launch nothing) dispatched while active, except while
    ``paused``."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused and not func.is_view:
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_a_decode_step_is_one_host_copy_and_a_few_operations_outside_the_graph(case, monkeypatch):
    """A decode step through the static step: its host data reach the device in one copy
    (``to_device``), and outside the graph (``_forward``, what a replay runs) it dispatches at
    most 4 operators: with that copy, at most 5 device operations. Before, prepare made six
    copies and built bucket masks and gather rows the graph never read, and loading the static
    buffers took some twenty more: 32 operators outside the graph."""
    import mini_infer.model_runner as model_runner

    target, _, _, _ = case
    llm = LLM(str(target), dtype="float32", num_kv_blocks=64, max_num_seqs=8, show_progress=False)
    (graphs,) = static_steps(llm)
    runner = llm.engine.runner
    counter, copies = CountingOps(), []
    forward = DecodeGraphs._forward

    def graph(self, key):  # what a replay runs: not counted
        counter.paused = True
        try:
            return forward(self, key)
        finally:
            counter.paused = False

    def to_device(values, dtype, device, original=model_runner.to_device):
        copies.append(len(values))
        return original(values, dtype, device)

    monkeypatch.setattr(DecodeGraphs, "_forward", graph)
    monkeypatch.setattr(model_runner, "to_device", to_device)
    inputs = [
        SequenceInput([5], 20, [1, 2], samples=True),
        SequenceInput([6], 33, [3, 4, 5], samples=True),
        SequenceInput([7], 9, [6], samples=True),
    ]
    eager = runner.execute(runner.prepare(inputs))  # the first run of a shape records it
    with counter:
        logits = runner.execute(runner.prepare(inputs))
    assert graphs.served == 2 and torch.equal(logits, eager)
    assert len(copies) == 2  # one per step
    assert len(counter.ops) <= 4, counter.ops


def test_a_static_step_gathers_a_bounded_number_of_keys(case):
    """Every row of a static step gathers the step's padded width: a shape over MAX_GRAPH_KEYS keys
    (rows x width x block size) is left to the eager step, whose buckets gather by the real
    contexts; narrower shapes of the same batch, and long contexts of few rows, still qualify."""
    target, _, _, _ = case
    llm = LLM(str(target), dtype="float32", num_kv_blocks=8, show_progress=False)
    runner = llm.engine.runner
    graphs = DecodeGraphs(runner.model, runner.kv_cache, max_num_seqs=256, max_model_len=32768, capture=False)
    bs = runner.kv_cache.block_size
    widest = MAX_GRAPH_KEYS // (256 * bs)
    assert graphs.shape_for(256, 1, widest) == (1, 256, widest)
    assert graphs.shape_for(256, 1, widest + 1) is None  # its width rounds up to twice as many keys
    assert graphs.shape_for(200, 4, widest + 1) is None
    assert graphs.shape_for(1, 1, 32768 // bs) == (1, 1, 32768 // bs)
    assert graphs.shape_for(3, 1, 9) == (1, 4, 16)
