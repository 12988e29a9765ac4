"""Tensor-parallel workers that die say why (chapter 14; ``mini_infer.faults``).

A worker that fails while serving is reported with its own error, not only its exit code; one
that dies before running any of the worker's code (a script without the ``__main__`` guard, or
one read from stdin, re-run by the spawned interpreter) gets a message that says so. So is one
that fails in a function rank 0 runs on every rank (``TensorParallelRunner.on_every_rank``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mini_infer import LLM, SamplingParams
from mini_infer.faults import WORKER_FAULT_ENV
from mini_infer.model_runner import ModelRunner
from mini_infer.parallel.workers import TensorParallelRunner, WorkerDiedError

pytestmark = pytest.mark.timeout(180)


def script(model_dir: Path) -> str:
    """A script that builds a tensor-parallel LLM at module level: no ``__main__`` guard."""
    return (
        "from mini_infer import LLM\n"
        f"llm = LLM({str(model_dir)!r}, dtype='float32', num_kv_blocks=16, tensor_parallel_size=2, show_progress=False)\n"
        "print(llm.generate(['hi'], use_tqdm=False)[0].text)\n"
    )


def test_a_script_without_the_main_guard_is_told_so(tiny_model_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "unguarded.py"
    path.write_text(script(tiny_model_dir))
    done = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=150, cwd=tmp_path)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert "worker rank 1" in last and "exited with code 1 before it started" in last, done.stderr[-2000:]
    assert f"re-running the main module {path}" in last and 'if __name__ == "__main__":' in last
    # The worker's own traceback ends with the same advice.
    assert "a spawned tensor-parallel worker re-ran the main module" in done.stderr


def test_a_script_read_from_stdin_is_told_so(tiny_model_dir: Path, tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-"], input=script(tiny_model_dir), capture_output=True, text=True, timeout=150, cwd=tmp_path
    )
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert "exited with code 1 before it started" in last, done.stderr[-2000:]
    assert "the main module was read from <stdin>" in last and "save it to a file" in last


def test_a_worker_that_fails_a_step_is_reported_with_its_own_error(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(WORKER_FAULT_ENV, "1")
    with (
        LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=16, tensor_parallel_size=2, show_progress=False) as llm,
        pytest.raises(WorkerDiedError) as died,
    ):
        llm.generate(["hello"], SamplingParams(max_tokens=4), use_tqdm=False)
    message = str(died.value)
    assert "tensor-parallel worker rank 1" in message and "exited with code 1" in message
    assert "RuntimeError: injected fault in a worker's step 1 (at " in message


def _fails_on_a_worker(runner: ModelRunner) -> int:
    """Raises on every rank but rank 0 (whose runner is the ``TensorParallelRunner``)."""
    if not isinstance(runner, TensorParallelRunner):
        raise ValueError("this function fails on the workers")
    return 0


def test_a_function_that_fails_on_a_worker_is_reported_with_its_own_error(tiny_model_dir: Path) -> None:
    with LLM(
        str(tiny_model_dir), dtype="float32", num_kv_blocks=16, tensor_parallel_size=2, show_progress=False
    ) as llm:
        runner = llm.engine.runner
        assert isinstance(runner, TensorParallelRunner)
        assert (pids := runner.on_every_rank(_pid))[0] == os.getpid() != pids[1]
        with pytest.raises(WorkerDiedError) as died:
            runner.on_every_rank(_fails_on_a_worker)
        message = str(died.value)
        assert "tensor-parallel worker rank 1" in message and "exited with code 1" in message
        assert "ValueError: this function fails on the workers (at " in message
        with pytest.raises(WorkerDiedError):  # for good
            llm.generate(["hello"], SamplingParams(max_tokens=2), use_tqdm=False)


def _pid(runner: ModelRunner) -> int:
    return os.getpid()
