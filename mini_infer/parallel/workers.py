"""Tensor-parallel workers: ranks 1..N-1 in processes of their own, driven by rank 0 step by step (chapter 14).

``launch`` is what ``engine_builder.build_engine`` calls for ``tensor_parallel_size`` N > 1:

1. rank 0 (the engine's process) refuses what cannot work (a size that does not divide the heads,
   more ranks than GPUs, CUDA graphs), opens a TCP store on a free port and spawns ranks 1..N-1
   with ``torch.multiprocessing``'s spawn context (a fresh interpreter each, so it works from a
   notebook cell too; daemonic, so they end with rank 0's interpreter);
2. every rank loads its shard (``shards.load_shard``) and marks it in the store; rank 0 waits for
   the marks while watching the workers, so that one that dies while loading is an error at once;
3. they join two process groups: the tensors' (the default group: gloo on CPUs, NCCL for CUDA
   tensors; its collectives give up after ``COLLECTIVE_TIMEOUT``) and a gloo group for control
   messages, where workers wait between steps for as long as the engine idles;
4. they agree on the KV pool: each rank sizes its part (on a CPU the ranks share one memory and
   size the pool as one process would; on GPUs each rank on its own card) and the smallest count
   wins; each allocates its part: its KV heads, the same block ids.

A draft model (speculative decoding, chapter 10) is not split: rank 0 loads it whole while the
workers load their shards, sizes the pool with the draft's blocks counted too (its share of the
memory, and on a GPU its activation peak), and gives it a pool of its own with the agreed number of
blocks, as one process would. Its passes run on rank 0 alone, between the target's steps; the
workers see only the target's steps, whose inputs carry the guesses to verify.

Every step (``TensorParallelRunner.execute``): rank 0 checks that every worker is alive, broadcasts
the step's ``SequenceInput``s on the control group and runs its shard; each worker prepares its own
``ForwardBatch`` from the same inputs (its gather rows follow its own KV heads) and runs its shard.
The model's collectives keep the ranks in step; every rank ends with the logits; rank 0 samples.

Rank 0 can also run a function on every rank between steps (``TensorParallelRunner.on_every_rank``,
a picklable function of each rank's ``ModelRunner``): the benchmark traces and describes the ranks
with it (``parallel.bench``).

Lifecycle: ``close`` (from ``LLM.close``, the engine's ``close``, the server's stop, or garbage
collection through ``weakref.finalize``) tells the workers to stop, joins them, ends those that do
not leave, destroys the process groups and gives rank 0 its CPU threads back. A worker that dies
fails the next step, or the collective it was in, with ``WorkerDiedError`` naming it and its own
error (a spawned worker writes it to the store as it dies); one that died before running any of
this module failed in re-running the main module, and the error says that a script must build a
tensor-parallel ``LLM`` under ``if __name__ == "__main__":``. Nothing waits on a dead worker. A
worker whose rank 0 has gone sees its control group fail, and a watchdog thread ends it if its
parent process is gone.
"""

from __future__ import annotations

import datetime
import itertools
import multiprocessing
import os
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mini_infer.config import ModelConfig
from mini_infer.engine_builder import EngineConfig, ResolvedModels, load_model, size_kv_pool
from mini_infer.faults import WORKER_FAULT_ENV
from mini_infer.kv.paged_attention import PagedKVCache
from mini_infer.model import Qwen2Model
from mini_infer.model_runner import ForwardBatch, ModelRunner, SequenceInput
from mini_infer.parallel.shards import RankGroup, ShardedQwen2Model, load_shard, shard_config

# The ranks run the same step, so a collective's partners arrive within a layer's time of each
# other; one that waits longer than this gives up. Workers wait for the next step on the control
# group, which has no practical limit: an engine may idle for days.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=5)
IDLE_TIMEOUT = datetime.timedelta(days=365)
STOP_TIMEOUT_S = 10.0  # how long a worker may take to leave after being told to stop
WORKER_EXIT_GRACE_S = 1.0  # after a failed step, how long to wait for a worker's death to explain it
WORKER_REAP_TIMEOUT_S = 10.0  # a worker seen exiting: how long to wait until its exit code can be read


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker died, or a step failed on some rank: this engine cannot go on."""


# Messages and specs are frozen dataclasses without slots: Python 3.10 cannot unpickle frozen ones with slots.
@dataclass(frozen=True)
class RankSpec:
    """What every rank needs to build its part of the engine."""

    config: EngineConfig
    model_dir: Path
    dtype: torch.dtype
    device: torch.device  # rank 0's; on CUDA rank r uses the r-th GPU after it
    max_model_len: int
    num_threads: int  # torch threads of each rank on a CPU: the cores shared out


@dataclass(frozen=True)
class _Step:
    """A step's inputs, as the fields of each ``SequenceInput``."""

    inputs: tuple[tuple[Any, ...], ...]

    @classmethod
    def of(cls, inputs: tuple[SequenceInput, ...]) -> _Step:
        return cls(tuple((s.token_ids, s.start, s.block_ids, s.samples, s.draft_token_ids) for s in inputs))

    def sequence_inputs(self) -> list[SequenceInput]:
        return [SequenceInput(*fields) for fields in self.inputs]


class _Stop:
    pass


def launch(config: EngineConfig, resolved: ResolvedModels) -> list[ModelRunner]:
    """Start ranks 1..N-1 and return rank 0's runner, then the draft's when ``resolved`` has one
    (see the module docstring)."""
    model_dir, draft_dir, dtype, device = resolved.model_dir, resolved.draft_dir, resolved.dtype, resolved.device
    size = config.tensor_parallel_size
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise RuntimeError(f"a spawned tensor-parallel worker re-ran the main module, which builds one: {_GUARD}")
    _refuse_what_cannot_work(config, ModelConfig.from_model_dir(model_dir), device)
    threads = torch.get_num_threads()
    spec = RankSpec(config, model_dir, dtype, device, resolved.max_model_len, max(1, threads // size))
    if dist.is_initialized():
        raise RuntimeError(
            "this process already belongs to a torch.distributed group (is another tensor-parallel engine "
            "still open? close it: llm.close(), or use `with LLM(...) as llm`)"
        )
    store = dist.TCPStore("127.0.0.1", 0, size, True, wait_for_workers=False, timeout=COLLECTIVE_TIMEOUT)
    context = mp.get_context("spawn")
    processes: list[BaseProcess] = [
        context.Process(
            target=_spawned_worker, args=(r, size, store.port, spec), name=f"mini-infer-rank{r}", daemon=True
        )
        for r in range(1, size)
    ]
    for process in processes:
        process.start()
    workers = Workers(processes, store, threads_before=threads)
    try:
        if device.type == "cpu":
            torch.set_num_threads(spec.num_threads)
        model = _load(spec, 0, size)
        drafts = [] if draft_dir is None else [load_model(draft_dir, dtype, model.device, config.show_progress)]
        _wait_until_loaded(store, workers, size)
        workers.control = control = _join(device, 0, size, store)
        cache, *draft_caches = _allocate_kv_caches(spec, model, drafts, control)
    except BaseException as exc:
        workers.failed(exc)
        workers.close()
        raise
    runner = TensorParallelRunner(model, cache, workers)
    return [runner, *(ModelRunner(d, c) for d, c in zip(drafts, draft_caches))]


class TensorParallelRunner(ModelRunner):
    """Rank 0's runner: every step goes to the workers first, then through rank 0's own shard."""

    def __init__(self, model: ShardedQwen2Model, kv_cache: PagedKVCache, workers: Workers) -> None:
        super().__init__(model, kv_cache)
        self.group, self.workers = model.group, workers
        # Garbage collection and the interpreter's exit close the workers too.
        self._finalizer = weakref.finalize(self, workers.close)

    def execute(self, batch: ForwardBatch) -> torch.Tensor:
        self.workers.check()
        try:
            self.workers.send(_Step.of(batch.inputs))
            return super().execute(batch)
        except Exception as exc:  # a rank died mid-step, or the ranks are out of step: either is fatal
            raise self.workers.failed(exc) from exc

    def check_health(self) -> None:
        self.workers.check()

    def close(self) -> None:
        self._finalizer()

    def on_every_rank(self, function: Callable[[ModelRunner], Any]) -> list[Any]:
        """``function(runner)`` on every rank, between steps, with each rank's own ``ModelRunner``;
        the results in rank order. ``function`` must be picklable: a module's function."""
        self.workers.check()
        try:
            self.workers.send(function)
            gathered: list[Any] = [None] * self.group.size
            dist.gather_object(function(self), gathered, dst=0, group=self.workers.control)
            return gathered
        except Exception as exc:
            raise self.workers.failed(exc) from exc


class Workers:
    """Ranks 1..N-1 as rank 0 sees them: their processes, the control group, the first failure,
    and how they end."""

    def __init__(self, processes: list[BaseProcess], store: dist.Store, *, threads_before: int) -> None:
        self.processes = processes
        self.store = store  # where spawned workers say that they started, and why they failed
        self.threads_before = threads_before
        self.control: dist.ProcessGroup | None = None
        self.error: str | None = None
        self.closed = False

    def send(self, message: object) -> None:
        dist.broadcast_object_list([message], src=0, group=self.control)

    def check(self) -> None:
        """Raise ``WorkerDiedError`` if a worker has died or a step has failed (then for good)."""
        if self.closed:
            raise RuntimeError("this tensor-parallel engine is closed: build a new one")
        if self.error is None:
            for rank, process in enumerate(self.processes, start=1):
                if not process.is_alive():
                    self.error = self._death_of(rank, process)
                    break
        if self.error is not None:
            raise WorkerDiedError(f"{self.error}; this engine cannot run any more: close it and build a new one")

    def _death_of(self, rank: int, process: BaseProcess) -> str:
        """A dead worker, with its own error when it told the store one, or why it never started."""
        died = f"tensor-parallel worker rank {rank} (pid {process.pid}) exited with code {process.exitcode}"
        with suppress(Exception):  # the store is rank 0's: it answers unless rank 0 is closing
            if self.store.check([f"error/{rank}"]):
                return f"{died}: {self.store.get(f'error/{rank}').decode()}"
            if not self.store.check([f"started/{rank}"]):
                return f"{died} before it started: {_why_not_started()}"
        return died

    def failed(self, exc: BaseException) -> WorkerDiedError:
        """Record a failure (a dead worker, if one explains it) and return the error to raise."""
        if self.error is None and self.processes:
            # A dying worker closes its sockets (our collective fails) and its sentinel pipe in the
            # same moment, but becomes reapable (``is_alive`` False) only a little later, and on a
            # busy machine "a little" can be long: wait for the sentinel, then for the exit itself.
            ready = wait([p.sentinel for p in self.processes], timeout=WORKER_EXIT_GRACE_S)
            for process in self.processes:
                if process.sentinel in ready:
                    process.join(WORKER_REAP_TIMEOUT_S)
        try:
            self.check()
        except WorkerDiedError as died:
            return died
        self.error = f"a tensor-parallel step failed on rank 0 ({type(exc).__name__}: {exc})"
        return WorkerDiedError(self.error)

    def close(self) -> None:
        """Stop the workers (end those that do not leave), destroy the groups; idempotent."""
        if self.closed:
            return
        healthy = self.error is None and all(p.is_alive() for p in self.processes)
        self.closed = True
        if healthy and self.control is not None:
            with suppress(Exception):
                self.send(_Stop())
            for process in self.processes:
                process.join(STOP_TIMEOUT_S)
        for process in self.processes:
            if process.is_alive():
                process.terminate()
                process.join(5)
            if process.is_alive():
                process.kill()
                process.join()
        if dist.is_initialized():
            with suppress(Exception):
                dist.destroy_process_group()
        torch.set_num_threads(self.threads_before)


def _refuse_what_cannot_work(config: EngineConfig, model_config: ModelConfig, device: torch.device) -> None:
    size = config.tensor_parallel_size
    shard_config(model_config, size)  # a size that does not divide the heads: ValueError naming them
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"tensor parallelism runs on CPUs (gloo) or CUDA GPUs (NCCL), not on {device.type}")
    if config.attention_backend == "triton":
        raise ValueError(
            "the ranks of a tensor-parallel engine attend with SDPA (chapter 05c's kernel is not wired into "
            "them): use attention_backend='sdpa' or 'auto', which means SDPA here"
        )
    if device.type != "cuda":
        return
    if not config.enforce_eager:
        raise ValueError(
            "CUDA graphs are not combined with tensor parallelism (an all-reduce inside a recorded graph is not "
            "supported here): pass enforce_eager=True (--enforce-eager); a tensor-parallel engine runs eagerly"
        )
    first, count = device.index or 0, torch.cuda.device_count()
    if first + size > count:
        raise ValueError(
            f"tensor_parallel_size={size} needs one GPU per rank (cuda:{first} to cuda:{first + size - 1}), "
            f"but this machine has {count}: use tensor_parallel_size={max(count - first, 1)} or fewer"
        )


def _spawned_worker(rank: int, size: int, port: int, spec: RankSpec) -> None:
    """A spawned worker's life: load its shard, join the groups, serve steps until told to stop."""
    _exit_with_parent()
    store = dist.TCPStore("127.0.0.1", port, size, False, timeout=COLLECTIVE_TIMEOUT)
    store.set(f"started/{rank}", "1")
    try:
        if spec.device.type == "cpu":
            torch.set_num_threads(spec.num_threads)
        model = _load(spec, rank, size)
        store.set(f"loaded/{rank}", "1")
        control = _join(spec.device, rank, size, store)
        (cache,) = _allocate_kv_caches(spec, model, [], control)
        runner = ModelRunner(model, cache)
        if os.environ.get(WORKER_FAULT_ENV):  # a test's injected fault (``faults``)
            runner.execute = _failing_at(int(os.environ[WORKER_FAULT_ENV]), runner.execute)  # type: ignore[method-assign,assignment]
        _serve(runner, control)
    except BaseException as exc:
        with suppress(Exception):  # rank 0 reads it when it sees this process gone
            store.set(f"error/{rank}", _summary(exc))
        raise
    dist.destroy_process_group()


_GUARD = (
    "spawned workers re-run the main module, as in any spawn-based Python program (vLLM documents the same): "
    'a script must build a tensor-parallel LLM under `if __name__ == "__main__":`'
)


def _why_not_started() -> str:
    """Why a worker died before running any of this module: it failed in re-running the main module."""
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    if path is not None and not os.path.exists(path):
        return f"the main module was read from {path}, which a spawned worker cannot read again: save it to a file; {_GUARD}"
    return f"it failed while re-running the main module {path or ''} (its traceback is on stderr); {_GUARD}"


def _summary(exc: BaseException) -> str:
    """An exception in a line: its type, message and where it was raised."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (at {frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name})" if frames else ""
    return f"{type(exc).__name__}: {exc}"[:1000] + where


def _failing_at(step: int, execute: Callable[[ForwardBatch], torch.Tensor]) -> Callable[[ForwardBatch], torch.Tensor]:
    steps = itertools.count(1)

    def failing(batch: ForwardBatch) -> torch.Tensor:
        if next(steps) == step:
            raise RuntimeError(f"injected fault in a worker's step {step}")
        return execute(batch)

    return failing


def _exit_with_parent() -> None:
    """End this process when its parent (rank 0) is gone, whatever it is doing."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="mini-infer-parent-watch", daemon=True).start()


def _load(spec: RankSpec, rank: int, size: int) -> ShardedQwen2Model:
    device = spec.device  # every rank on the CPU; on CUDA the rank-th GPU from rank 0's
    if device.type == "cuda":
        device = torch.device("cuda", (device.index or 0) + rank)
        torch.cuda.set_device(device)
    group = RankGroup(rank, size)  # on the default group, joined before the first collective
    config = ModelConfig.from_model_dir(spec.model_dir)
    show_progress = spec.config.show_progress and rank == 0
    return load_shard(spec.model_dir, config, spec.dtype, device, group, show_progress)


def _wait_until_loaded(store: dist.Store, workers: Workers, size: int) -> None:
    keys = [f"loaded/{rank}" for rank in range(1, size)]
    while not store.check(keys):
        workers.check()  # a worker that died while loading is an error now, not a hang
        time.sleep(0.05)


def _join(device: torch.device, rank: int, size: int, store: dist.Store) -> dist.ProcessGroup:
    """Join the default group (the tensors') and return the control group."""
    backend = "gloo" if device.type == "cpu" else "cpu:gloo,cuda:nccl"
    prefixed = dist.PrefixStore("mini-infer", store)
    dist.init_process_group(backend, store=prefixed, rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT)
    control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    assert control is not None
    return control


def _allocate_kv_caches(
    spec: RankSpec, model: ShardedQwen2Model, drafts: list[Qwen2Model], control: dist.ProcessGroup
) -> list[PagedKVCache]:
    """This rank's part of the KV pool (``model``, its shard) and, on rank 0 with a draft, the
    draft's whole pool, with the block count all ranks agree on (the smallest)."""
    config, device, models = spec.config, model.device, [model, *drafts]
    # One shared memory (size as one process would), or a card each (this rank's shard); a draft
    # is whole wherever it runs. On GPUs every rank measures its peak at once: the target's
    # measured step (first, before rank 0's draft) has collectives that need them all.
    kept = [model.whole if device.type == "cpu" else model.config] + [d.config for d in drafts]
    blocks = size_kv_pool(config, models, kept, spec.max_model_len)
    agreed = torch.tensor([blocks])
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=control)
    return [PagedKVCache(m.config, int(agreed.item()), config.block_size, spec.dtype, device) for m in models]


def _receive(control: dist.ProcessGroup) -> object:
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0, group=control)
    return box[0]


def _serve(runner: ModelRunner, control: dist.ProcessGroup) -> None:
    """A worker's loop: run each step rank 0 sends, until it says stop."""
    while not isinstance(message := _receive(control), _Stop):
        if isinstance(message, _Step):
            runner.execute(runner.prepare(message.sequence_inputs()))
        else:  # a function of the runner, for every rank (``TensorParallelRunner.on_every_rank``)
            assert callable(message)
            dist.gather_object(message(runner), None, dst=0, group=control)
