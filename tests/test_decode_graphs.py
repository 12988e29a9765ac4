"""The padded, shape-static decode step that CUDA graphs record (chapter 05), run eagerly on this
CPU: the same tokens as the unpadded step, whatever the batch size, under preemption, with the
prefix cache, and for speculative verification (several tokens per sequence)."""

import random

import pytest
import torch

from mini_infer import LLM, SamplingParams
from mini_infer.config import ModelConfig
from mini_infer.decode_graphs import DecodeGraphs, captured_batch_sizes
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
            max_model_len=engine.max_model_len,
            capture=False,
        )
        graphs.served = 0
        original = graphs.run

        def counting(batch, original=original, graphs=graphs):
            logits = original(batch)
            graphs.served += logits is not None
            return logits

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
    free = llm.engine.pool._free  # ...and never into a block no sequence used
    never_used = [b for b in free if b >= 3 * 4]
    assert all(torch.equal(cache.k[:, :, b], untouched) for b in never_used)


def test_a_graph_that_does_not_reproduce_the_eager_step_never_serves(case, monkeypatch):
    """The recording path with CUDA's graph calls faked on this CPU, and a recording that comes
    out wrong: the replay is checked against the eager step, a warning says so, and that shape
    runs eagerly from then on; every token is still right."""
    import contextlib

    target, _, prompts, expected = case
    recording = {"now": False}

    @contextlib.contextmanager
    def fake_graph(graph, pool=None):
        recording["now"] = True
        yield
        recording["now"] = False

    class Fake:
        def wait_stream(self, other):
            pass

        def replay(self):
            pass

    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "Stream", Fake)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Fake)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Fake())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "graph", fake_graph)
    eager_forward = DecodeGraphs._forward
    monkeypatch.setattr(
        DecodeGraphs, "_forward", lambda self, key: eager_forward(self, key) * (0 if recording["now"] else 1)
    )

    llm = LLM(str(target), dtype="float32", num_kv_blocks=256, max_num_seqs=16, show_progress=False)
    engine = llm.engine
    graphs = DecodeGraphs(
        engine.model, engine.runner.kv_cache, max_num_seqs=16, max_model_len=engine.max_model_len, capture=True
    )
    engine.runner.static_decode = graphs
    with pytest.warns(RuntimeWarning, match="did not reproduce the eager step"):
        outputs = run_checked(engine, prompts, GREEDY)
    assert [o.token_ids for o in outputs] == expected
    assert graphs.eager_only and graphs.eager_only == set(graphs.steps)

    # A recording that fails outright (a kernel that cannot be captured) is no error either.
    def failing_graph(graph, pool=None):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(torch.cuda, "graph", failing_graph)
    graphs = DecodeGraphs(
        engine.model, engine.runner.kv_cache, max_num_seqs=16, max_model_len=engine.max_model_len, capture=True
    )
    engine.runner.static_decode = graphs
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
