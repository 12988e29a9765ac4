"""Tensor-parallel engines on this CPU, two ranks on gloo (chapter 14): the same greedy tokens as one
rank and as ``transformers`` under preemption, chunked prefill and the prefix cache; the flag on
the command line; the server streaming from two ranks; a killed worker
failing the engine instead of hanging it; no process left behind; the refusals."""

from __future__ import annotations

import gc
import json
import multiprocessing
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, redirect_stdout
from io import StringIO
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from mini_infer import LLM, SamplingParams
from mini_infer.cli import main as cli_main
from mini_infer.config import ModelConfig
from mini_infer.engine_builder import EngineConfig, ResolvedModels
from mini_infer.model_source import resolve_model
from mini_infer.parallel.bench import rank_reports, trace_ranks
from mini_infer.parallel.shards import ShardedQwen2Model
from mini_infer.parallel.workers import TensorParallelRunner, WorkerDiedError, launch
from mini_infer.server import BackgroundServer, ServerConfig, build_app
from mini_infer.tiny_corpus import TASKS, held_out_questions
from tests.engine_checks import assert_all_blocks_back, run_checked, transformers_greedy
from tests.server_checks import on_engine

pytestmark = pytest.mark.timeout(180)  # a hung collective fails its test, not the run

MAX_TOKENS = 24
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
# A pool too small for every request at once (preemption), a token budget that cuts prompts
# mid-block (chunked prefill), and prompts that share a prefix (the prefix cache).
TIGHT: dict[str, Any] = dict(
    dtype="float32", num_kv_blocks=16, max_num_batched_tokens=13, max_num_seqs=6, show_progress=False
)


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    shared = [rng.randrange(vocab) for _ in range(40)]
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (1, 2, 17, 150, 33, 60)]
    return prompts + [shared + [rng.randrange(vocab) for _ in range(n)] for n in (3, 9, 20)]


def _runner(llm: LLM) -> TensorParallelRunner:
    runner = llm.engine.runner
    assert isinstance(runner, TensorParallelRunner)
    return runner


def _all_ended(processes: list[Any]) -> bool:
    return all(not p.is_alive() for p in processes) and not multiprocessing.active_children()


@pytest.fixture(scope="module")
def tight_case(tiny_model_dir: Path) -> tuple[Path, list[list[int]], list[list[int]]]:
    prompts = _prompts(ModelConfig.from_model_dir(tiny_model_dir).vocab_size)
    return tiny_model_dir, prompts, transformers_greedy(tiny_model_dir, prompts, MAX_TOKENS)


def test_two_ranks_decode_like_one_rank_and_transformers(tight_case: Any) -> None:
    model_dir, prompts, expected = tight_case
    with LLM(str(model_dir), tensor_parallel_size=2, **TIGHT) as llm:
        trace_ranks(_runner(llm))
        outputs = run_checked(llm.engine, prompts, GREEDY)
        stats = llm.stats()
        assert_all_blocks_back(llm.engine)
        reports = rank_reports(_runner(llm))
        processes = list(_runner(llm).workers.processes)
    assert [o.token_ids for o in outputs] == expected
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > 0
    one_rank = LLM(str(model_dir), **TIGHT)
    assert [o.token_ids for o in run_checked(one_rank.engine, prompts, GREEDY)] == expected
    assert one_rank.stats() == stats  # the same schedule, step for step
    # Each rank holds half the heads and its own pool of the same blocks, built its own batch from
    # the same inputs (as many gather rows as rank 0: one KV head each), and took part in every collective.
    config = ModelConfig.from_model_dir(model_dir)
    assert [(r.rank, r.num_heads, r.num_kv_heads) for r in reports] == [(0, 2, 1), (1, 2, 1)]
    pool = (config.num_hidden_layers, 1, TIGHT["num_kv_blocks"] + 1, 16, config.head_dim)
    assert reports[0].kv_pool_shape == reports[1].kv_pool_shape == pool
    assert reports[0].last_step == reports[1].last_step
    assert reports[0].last_step.steps == stats["steps"] and reports[0].pid != reports[1].pid
    assert _all_ended(processes)


def test_the_command_line_flag_splits_an_untied_model(model_dirs: dict[str, Path]) -> None:
    model_dir = str(model_dirs["untied-gqa4"])  # 8 heads, 2 KV heads, its own output projection
    argv = ["generate", "--model", model_dir, "--dtype", "float32", "--num-kv-blocks", "64", "--json"]
    argv += ["--prompt", "hello world", "--prompt", "the cache", "--max-tokens", "12", "--no-enable-prefix-caching"]

    def run(*extra: str) -> list[dict[str, Any]]:
        out = StringIO()
        with redirect_stdout(out):
            assert cli_main(argv + list(extra)) == 0
        return [json.loads(line) for line in out.getvalue().splitlines()]

    two_ranks = run("--tensor-parallel-size", "2")
    assert two_ranks == run() and len(two_ranks) == 2
    assert not multiprocessing.active_children()


def test_a_draft_runs_whole_on_rank_0_and_keeps_the_greedy_tokens() -> None:
    # The shipped pair (a draft that learned the target's text, so that guesses are often kept),
    # with a pool small enough to preempt and a budget that chunks the prompts.
    chats = [[{"role": "user", "content": held_out_questions(task)[0].prompt}] for task in TASKS]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    options: dict[str, Any] = dict(
        dtype="float32", num_kv_blocks=10, max_num_batched_tokens=13, generation_config="vllm", show_progress=False
    )

    def run(**extra: Any) -> tuple[list[list[int]], dict[str, int], LLM]:
        with LLM("tiny", **options, **extra) as llm:
            outputs = llm.chat(chats, params, use_tqdm=False)
            assert_all_blocks_back(llm.engine)
            return [o.token_ids for o in outputs], llm.stats(), llm

    alone, _, _ = run()
    one_rank, one_rank_stats, _ = run(draft_model="tiny-draft")
    two_ranks, stats, llm = run(draft_model="tiny-draft", tensor_parallel_size=2)
    assert two_ranks == one_rank == alone
    assert stats == one_rank_stats  # the same schedule and the same verdicts, step for step
    assert 0 < stats["num_accepted_draft_tokens"] < stats["num_draft_tokens"]
    assert stats["num_preemptions"] > 0
    # The target is split (rank 0 holds half its heads), the draft is whole, in a plain runner of
    # rank 0, with a pool of the same block ids as the target's.
    target, draft = _runner(llm), llm.engine.drafter.runner  # type: ignore[union-attr]
    assert not isinstance(draft, TensorParallelRunner)
    draft_config = ModelConfig.from_model_dir(resolve_model("tiny-draft"))
    assert isinstance(target.model, ShardedQwen2Model)
    assert target.model.config.num_attention_heads == target.model.whole.num_attention_heads // 2
    assert target.model.config.vocab_size == target.model.whole.vocab_size  # the logits are whole
    assert draft.model.config == draft_config
    assert draft.kv_cache.num_blocks == target.kv_cache.num_blocks == options["num_kv_blocks"]
    assert _all_ended(target.workers.processes)


@contextmanager
def _tp_server(model_dir: Path) -> Iterator[BackgroundServer]:
    engine = dict(dtype="float32", num_kv_blocks=128, tensor_parallel_size=2)
    config = ServerConfig(model=str(model_dir), served_model_name="tp", engine_kwargs=engine, show_progress=False)
    with BackgroundServer(build_app(config)) as server:
        server.wait_ready(timeout=120)
        yield server


def test_the_server_streams_from_two_ranks_and_its_stop_ends_the_workers(tiny_model_dir: Path) -> None:
    prompts = ["hello world", "the cache is", "a"]
    expected = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=128, show_progress=False).generate(
        prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), use_tqdm=False
    )
    with _tp_server(tiny_model_dir) as server:
        processes = on_engine(server, lambda engine: list(engine.runner.workers.processes))

        def stream(prompt: str) -> str:
            body = {"model": "tp", "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
            with (
                httpx.Client(base_url=server.base_url, timeout=60) as http,
                http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response,
            ):
                events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            return "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])

        with ThreadPoolExecutor(3) as pool:
            assert list(pool.map(stream, prompts)) == [o.text for o in expected]
        assert all(p.is_alive() for p in processes)
    assert _all_ended(processes)  # the server's stop closed the engine


def test_the_server_reports_a_worker_that_died_while_it_idled(tiny_model_dir: Path) -> None:
    with _tp_server(tiny_model_dir) as server:
        processes = on_engine(server, lambda engine: list(engine.runner.workers.processes))
        processes[0].kill()
        deadline = time.monotonic() + 15
        with httpx.Client(base_url=server.base_url, timeout=10) as http:
            while (health := http.get("/health")).status_code == 200:
                assert time.monotonic() < deadline, "/health still says ok after a worker died"
                time.sleep(0.1)
            assert health.status_code == 503 and "rank 1" in health.json()["error"]["message"]
            refused = http.post("/v1/completions", json={"model": "tp", "prompt": "hi", "max_tokens": 2})
            assert refused.status_code == 503
    assert _all_ended(processes)


def test_a_worker_killed_mid_stream_ends_the_stream_with_an_error(tiny_model_dir: Path) -> None:
    long = {"model": "tp", "prompt": "hello", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with _tp_server(tiny_model_dir) as server:
        processes = on_engine(server, lambda engine: list(engine.runner.workers.processes))
        with (
            httpx.Client(base_url=server.base_url, timeout=60) as http,
            http.stream("POST", "/v1/completions", json=long) as response,
        ):
            lines = (line for line in response.iter_lines() if line)
            assert json.loads(next(lines).removeprefix("data: "))["object"] == "text_completion"
            processes[0].kill()
            rest = list(lines)
            assert rest[-1] == "data: [DONE]"  # one error event, then the end: the client never hangs
            error = json.loads(rest[-2].removeprefix("data: "))["error"]["message"]
            assert "worker rank 1" in error and "exited with code -9" in error
            assert http.get("/health").status_code == 503
    assert _all_ended(processes)


def test_a_worker_killed_mid_generation_fails_the_engine_at_once(tiny_model_dir: Path) -> None:
    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=64, tensor_parallel_size=2, show_progress=False)
    try:
        worker = _runner(llm).workers.processes[0]
        outputs = llm.stream([1, 2, 3], SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True))
        started = time.monotonic()
        with pytest.raises(WorkerDiedError, match=r"worker rank 1 \(pid \d+\) exited with code -9"):
            for i, _ in enumerate(outputs):
                if i == 3:
                    worker.kill()
        assert time.monotonic() - started < 30
        with pytest.raises(WorkerDiedError):  # for good: the next request fails too, without waiting
            llm.generate([[4, 5]], SamplingParams(max_tokens=2), use_tqdm=False)
        with pytest.raises(WorkerDiedError):
            llm.engine.check_health()
        assert not llm.engine.has_unfinished_requests()
    finally:
        llm.close()  # even when an assertion failed: an open engine would fail the next tests' engines
    assert _all_ended([worker])


def test_close_and_garbage_collection_end_the_workers(tiny_model_dir: Path) -> None:
    threads = torch.get_num_threads()
    options: dict[str, Any] = dict(dtype="float32", num_kv_blocks=32, tensor_parallel_size=2, show_progress=False)
    llm = LLM(str(tiny_model_dir), **options)
    processes = list(_runner(llm).workers.processes)
    assert torch.get_num_threads() == max(1, threads // 2) and all(p.is_alive() for p in processes)
    del llm
    gc.collect()
    assert _all_ended(processes) and torch.get_num_threads() == threads
    with LLM(str(tiny_model_dir), **options) as llm:
        processes = list(_runner(llm).workers.processes)
    assert _all_ended(processes)
    llm.close()  # twice is fine
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate([[1, 2]], use_tqdm=False)


def test_a_worker_ends_when_rank_0_dies(tiny_model_dir: Path) -> None:
    script = (
        "import os, signal\n"
        "from mini_infer import LLM\n"
        "if __name__ == '__main__':\n"
        f"    llm = LLM({str(tiny_model_dir)!r}, dtype='float32', num_kv_blocks=16, tensor_parallel_size=2,"
        " show_progress=False)\n"
        "    print(llm.engine.runner.workers.processes[0].pid, flush=True)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    pid = int(done.stdout.split()[0])
    deadline = time.monotonic() + 15
    while Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]:
        assert time.monotonic() < deadline, f"worker {pid} outlived its rank 0"
        time.sleep(0.1)


def test_what_cannot_work_is_refused_before_any_process_starts(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 must divide num_attention_heads \(4\)"):
        LLM(str(tiny_model_dir), tensor_parallel_size=3, show_progress=False)

    def start(device: str, **options: Any) -> None:
        config = EngineConfig(model=str(tiny_model_dir), tensor_parallel_size=2, **options)
        launch(config, ResolvedModels(tiny_model_dir, None, torch.float16, torch.device(device), 2048))

    with pytest.raises(ValueError, match=r"CUDA graphs .* pass enforce_eager=True \(--enforce-eager\)"):
        start("cuda")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"needs one GPU per rank \(cuda:0 to cuda:1\), but this machine has 1"):
        start("cuda", enforce_eager=True)
    with pytest.raises(ValueError, match="CPUs .gloo. or CUDA GPUs .NCCL., not on mps"):
        start("mps")
    assert not multiprocessing.active_children()


def test_the_benchmark_compares_two_ranks_with_one(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "tp.json"
    argv = ["bench", "offline", "--model", str(tiny_model_dir), "--dtype", "float32", "--tensor-parallel-size", "2"]
    argv += ["--num-prompts", "3", "--input-len", "4", "8", "--output-len", "3", "--decode-len", "3"]
    argv += ["--prefill-len", "40", "--max-num-batched-tokens", "16", "--json", str(out)]
    printed = StringIO()
    with redirect_stdout(printed):
        assert cli_main(argv) == 0
    results = json.loads(out.read_text())
    # The decode workload: a 128-token prompt in chunks of 16, then two more tokens, one step each.
    assert results["decode_prefill"]["steps"] == 8 and results["decode_decode"]["steps"] == 2
    # The prefill workload: 40 tokens in chunks of 16, 16 and 8, and no decode step at all.
    assert results["prefill_prefill"]["steps"] == 3 and "prefill_decode" not in results
    assert {"throughput_prefill", "throughput_decode"} <= results.keys()
    for row in (v for v in results.values() if isinstance(v, dict)):
        assert row["one_rank_ms"] > 0 and row["ranks_ms"] > 0
        assert 0 < row["all_reduce_share"] < 1 and 0 < row["all_gather_share"] < 1
    assert "all-reduce" in printed.getvalue() and "decode decode" in printed.getvalue()
    assert not multiprocessing.active_children()
