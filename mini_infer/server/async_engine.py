"""The engine thread and the queues between it and the event loop (chapter 11).

``LLMEngine`` is not thread-safe, and its ``step`` is long, blocking work (a forward pass).
The event loop that serves HTTP must never wait on it, so the two meet only through queues::

    request handlers (event loop)  --commands-->  engine thread: submit, abort, call, stop
    engine thread  --one batch of events per iteration-->  event loop (call_soon_threadsafe)
    event loop: each output goes to the asyncio.Queue of the API call it belongs to

One batch per iteration (not one wake-up per token) keeps the cost of crossing threads
independent of how many requests are in flight. An API call is a ``RequestStream``: its ``n``
choices (times its prompts) are separate engine requests, forks of the first choice of their
prompt, so that they share its full prompt blocks by reference count.

Invariants:

* Exactly one thread, the engine thread, touches the ``LLMEngine``, from building it (model
  loading) to its last step. Everything else reaches it through the command queue, including
  reads (``call``).
* Every request ends, and its KV blocks are freed: the engine finishes it (stop, length); its
  handler aborts it when the client goes away (``RequestStream.abort``, called from the
  handler's ``finally``); or the engine dies and every waiting stream gets an error.
* A fault stays with its request (``faults``): an exception while adding one refuses that call
  alone (a 400 for a ValueError, the request's fault; a 500 naming the cause for any other); one
  in a request's own work inside a step reaches its stream as an output with ``finish_reason``
  ``"error"`` (``RequestFailedError``). Only an exception of the engine loop itself (a forward
  pass, out of memory, a dead worker) kills the engine (``why_the_engine_failed``).
* When no request is in flight the engine thread sleeps in its queue's ``get()``: no busy loop.
  It wakes every ``HEALTH_CHECK_INTERVAL_S`` to ask the engine whether it is still whole (a
  tensor-parallel worker may die while the server idles, chapter 14): a dead part kills the
  engine, and ``/health`` says so.
* The engine thread closes the engine when it leaves, however it leaves: a tensor-parallel
  engine's worker processes end with the server.
* Handlers own a tokenizer of their own (``AsyncEngine.tokenizer``, used by one worker thread),
  so that rendering and tokenizing prompts never shares the engine's tokenizer across threads.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import enum
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch

from mini_infer.engine import LLMEngine
from mini_infer.outputs import RequestOutput
from mini_infer.sampling_params import SamplingParams
from mini_infer.tokenizer import Tokenizer

logger = logging.getLogger("mini_infer.server")

T = TypeVar("T")

HEALTH_CHECK_INTERVAL_S = 1.0


class EngineState(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    DEAD = "dead"  # failed to load, failed while running, or stopped


class EngineUnavailableError(RuntimeError):
    """The engine cannot take requests: still loading, or dead (the message says which)."""


class RequestRejectedError(ValueError):
    """The engine refused a submission: ``add_request`` raised ValueError (a bad request,
    ``status`` 400) or another exception (a bug of ours, or of a library: 500, naming it)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class RequestFailedError(RuntimeError):
    """One engine request of the call failed on its own (its grammar, its detokenization: see
    ``faults``); the engine goes on with the others. The message names the cause."""


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What handlers need to know about the engine, copied once when it is ready."""

    model_dir: Path
    max_model_len: int
    max_pool_tokens: int  # the whole KV pool, in tokens: no request can be longer
    vocab_size: int
    block_size: int
    num_kv_blocks: int
    prefix_caching: bool
    sampling_defaults: dict[str, Any]  # the model's, for the fields a request leaves unset


@dataclass(slots=True)
class Choice:
    """One engine request of an API call."""

    prompt_token_ids: list[int]
    params: SamplingParams
    fork_of: int | None = None  # an earlier choice with the same prompt, whose blocks it shares


class RequestObserver(Protocol):
    """Latency figures, taken as outputs reach the event loop (see ``metrics.ServerMetrics``)."""

    def first_token(self, seconds: float) -> None: ...
    def inter_token(self, seconds: float) -> None: ...
    def finished(self, seconds: float, reason: str) -> None: ...


# ---- commands: event loop -> engine thread


@dataclass(slots=True)
class _Submit:
    group: str
    request_ids: list[str]
    choices: list[Choice]


@dataclass(slots=True)
class _Abort:
    request_ids: list[str]


@dataclass(slots=True)
class _Call:
    fn: Callable[[LLMEngine], Any]
    future: concurrent.futures.Future[Any]


class _Stop:
    pass


_Command = _Submit | _Abort | _Call | _Stop

# ---- events: engine thread -> event loop


@dataclass(slots=True)
class _Accepted:
    group: str


@dataclass(slots=True)
class _Rejected:
    group: str
    message: str
    status: int = 400


@dataclass(slots=True)
class _Failed:
    message: str


_Event = RequestOutput | _Accepted | _Rejected


class RequestStream:
    """The event-loop side of one API call: the outputs of its engine requests, as they come."""

    def __init__(self, engine: AsyncEngine, request_ids: list[str], observer: RequestObserver | None) -> None:
        self._engine = engine
        self.request_ids = request_ids
        self._queue: asyncio.Queue[tuple[int, RequestOutput] | _Accepted | _Rejected | _Failed] = asyncio.Queue()
        self._unfinished = set(range(len(request_ids)))
        self._observer = observer
        self._arrival = time.perf_counter()
        self._last_token: list[float | None] = [None] * len(request_ids)
        self._aborted = False

    @property
    def finished(self) -> bool:
        """Every choice's last output has been taken by ``next_batch``."""
        return not self._unfinished

    async def _wait_accepted(self) -> None:
        event = await self._queue.get()
        if isinstance(event, _Rejected):
            raise RequestRejectedError(event.message, event.status)
        if isinstance(event, _Failed):
            raise EngineUnavailableError(event.message)

    async def next_batch(self) -> list[tuple[int, RequestOutput]]:
        """Wait for at least one output, then take all that are already here.

        A client that fell behind catches up with one chunk instead of one per token. Raises
        ``EngineUnavailableError`` when the engine died meanwhile, and ``RequestFailedError`` when
        one of the call's requests failed on its own.
        """
        items = [await self._queue.get()]
        while True:
            try:
                items.append(self._queue.get_nowait())
            except asyncio.QueueEmpty:
                break
        batch: list[tuple[int, RequestOutput]] = []
        for item in items:
            if isinstance(item, _Failed):
                self._unfinished.clear()
                raise EngineUnavailableError(item.message)
            if isinstance(item, tuple):
                if item[1].finished:
                    # Counted when taken, not when delivered: ``finished`` means "all read".
                    self._unfinished.discard(item[0])
                if item[1].finish_reason == "error":
                    raise RequestFailedError(item[1].error or "the request failed")
                batch.append(item)
        return batch

    def abort(self) -> None:
        """Abort whatever is unfinished (a no-op when all is finished, or already aborted)."""
        if self._unfinished and not self._aborted:
            self._aborted = True
            self._engine._abort(self)

    def _put(self, index: int, out: RequestOutput, now: float) -> None:
        observer = self._observer
        if observer is not None:
            if out.new_token_ids:
                last = self._last_token[index]
                if last is None:
                    observer.first_token(now - self._arrival)
                else:
                    observer.inter_token(now - last)
                self._last_token[index] = now
            if out.finished and out.finish_reason != "abort":
                observer.finished(now - self._arrival, out.finish_reason or "stop")
        self._queue.put_nowait((index, out))


class AsyncEngine:
    """Runs an ``LLMEngine`` in its own thread and serves it to asyncio handlers."""

    def __init__(self, factory: Callable[[], LLMEngine], observer: RequestObserver | None = None) -> None:
        self._factory = factory
        self._observer = observer
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread_dead = threading.Event()  # set by the engine thread itself, before it exits
        self._settled: asyncio.Event | None = None
        # Loop-side state: touched only on the event loop.
        self.state = EngineState.LOADING
        self.error: str | None = None
        self.info: EngineInfo | None = None
        self.tokenizer: Tokenizer | None = None
        self._routes: dict[str, tuple[RequestStream, int]] = {}
        self._pending: dict[str, RequestStream] = {}  # submitted, not yet accepted

    # ----------------------------------------------------------------- event-loop side
    def start(self) -> None:
        """Start the engine thread (it builds the engine); call from the running event loop."""
        if self._thread is not None:
            raise RuntimeError("the engine thread is already started")
        self._loop = asyncio.get_running_loop()
        self._settled = asyncio.Event()
        self._thread = threading.Thread(target=self._main, name="mini-infer-engine", daemon=True)
        self._thread.start()

    async def wait_settled(self) -> EngineState:
        """Wait until the engine is ready or dead."""
        assert self._settled is not None, "start() first"
        await self._settled.wait()
        return self.state

    async def shutdown(self, timeout: float = 10.0) -> None:
        thread = self._thread
        if thread is None:
            return
        self._commands.put(_Stop())
        await asyncio.get_running_loop().run_in_executor(None, thread.join, timeout)
        self._on_dead("the server is shutting down")

    def unavailable(self) -> str | None:
        """Why the engine cannot take a request now, or None when it can."""
        if self.state is EngineState.LOADING:
            return "the model is still loading; try again when /health answers 200"
        if self.state is EngineState.DEAD:
            return f"the engine is not running ({self.error})"
        return None

    async def submit(self, choices: list[Choice], group: str) -> RequestStream:
        """Hand an API call's engine requests to the engine; returns once it has accepted them.

        Raises ``RequestRejectedError`` (a bad request: 400) or ``EngineUnavailableError`` (503).
        """
        reason = self.unavailable()
        if reason is not None:
            raise EngineUnavailableError(reason)
        request_ids = [f"{group}-{i}" for i in range(len(choices))]
        stream = RequestStream(self, request_ids, self._observer)
        for index, request_id in enumerate(request_ids):
            self._routes[request_id] = (stream, index)
        self._pending[group] = stream
        self._commands.put(_Submit(group, request_ids, choices))
        try:
            await stream._wait_accepted()
        except BaseException:
            # Refused, or the client left while we waited: nothing of it may stay in the engine.
            self._pending.pop(group, None)
            stream.abort()
            raise
        return stream

    def call(self, fn: Callable[[LLMEngine], T]) -> concurrent.futures.Future[T]:
        """Run ``fn(engine)`` on the engine thread, between two steps; safe from any thread.

        For reads that must see a consistent engine (metrics, tests' block accounting).
        """
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        if self._thread is None or self._thread_dead.is_set():
            future.set_exception(EngineUnavailableError("the engine thread is not running"))
            return future
        self._commands.put(_Call(fn, future))
        if self._thread_dead.is_set():
            # It died while we queued: nobody will answer the command, so answer it here.
            _fail_future(future, EngineUnavailableError("the engine thread is not running"))
        return future

    def _abort(self, stream: RequestStream) -> None:
        for request_id in stream.request_ids:
            self._routes.pop(request_id, None)
        self._commands.put(_Abort(list(stream.request_ids)))

    def _deliver(self, events: list[_Event]) -> None:
        now = time.perf_counter()
        for event in events:
            if isinstance(event, RequestOutput):
                route = self._routes.get(event.request_id)
                if route is None:
                    continue  # aborted after the engine produced it
                if event.finished:
                    del self._routes[event.request_id]
                route[0]._put(route[1], event, now)
            else:
                stream = self._pending.pop(event.group, None)
                if stream is not None:
                    stream._queue.put_nowait(event)

    def _on_ready(self, info: EngineInfo, tokenizer: Tokenizer) -> None:
        self.info, self.tokenizer = info, tokenizer
        if self.state is EngineState.LOADING:
            self.state = EngineState.READY
        assert self._settled is not None
        self._settled.set()

    def _on_dead(self, message: str) -> None:
        if self.state is not EngineState.DEAD:
            self.state, self.error = EngineState.DEAD, message
        streams = {id(s): s for s, _ in self._routes.values()} | {id(s): s for s in self._pending.values()}
        self._routes.clear()
        self._pending.clear()
        for stream in streams.values():
            stream._queue.put_nowait(_Failed(message))
        assert self._settled is not None
        self._settled.set()

    # ----------------------------------------------------------------- engine thread
    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(fn, *args)

    def _main(self) -> None:
        try:
            started = time.perf_counter()
            engine = self._factory()
            # The handlers' own tokenizer, loaded here so that loading is one phase.
            tokenizer = Tokenizer(engine.tokenizer.model_dir)
            blocks = engine.scheduler.blocks
            info = EngineInfo(
                model_dir=engine.tokenizer.model_dir,
                max_model_len=engine.scheduler.max_model_len,
                max_pool_tokens=blocks.pool.num_blocks * blocks.pool.block_size,
                vocab_size=engine.runner.model.config.vocab_size,
                block_size=blocks.pool.block_size,
                num_kv_blocks=blocks.pool.num_blocks,
                prefix_caching=blocks.prefix_cache is not None,
                sampling_defaults=dict(engine.sampling_defaults),
            )
        except BaseException as exc:
            logger.exception("loading the model failed")
            self._die(f"loading the model failed: {type(exc).__name__}: {exc}")
            return
        logger.info(
            "engine ready in %.1f s: %d KV blocks of %d tokens, max_model_len %d",
            time.perf_counter() - started,
            info.num_kv_blocks,
            info.block_size,
            info.max_model_len,
        )
        try:
            self._post(self._on_ready, info, tokenizer)
            self._run(engine)
        except _LoopClosed:
            self._thread_dead.set()
        except BaseException as exc:
            logger.exception("the engine loop failed; the server is now dead")
            self._die(why_the_engine_failed(exc))
        else:
            self._die("the server is shutting down")
        finally:
            engine.close()

    def _run(self, engine: LLMEngine) -> None:
        events: list[_Event] = []
        while True:
            if not engine.has_unfinished_requests():
                try:
                    command = self._commands.get(timeout=HEALTH_CHECK_INTERVAL_S)
                except queue.Empty:
                    engine.check_health()  # raises when a part has died: the engine is dead
                    continue
                if not self._handle(engine, command, events):
                    return  # idle: slept in get() until a command came; it was stop
            while True:
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    break
                if not self._handle(engine, command, events):
                    return
            if engine.has_unfinished_requests():
                events.extend(engine.step())
            if events:
                try:
                    self._post(self._deliver, events)
                except RuntimeError as exc:  # the event loop is closed: nobody is listening
                    raise _LoopClosed from exc
                events = []

    def _handle(self, engine: LLMEngine, command: _Command, events: list[_Event]) -> bool:
        """Carry out one command; False for stop."""
        if isinstance(command, _Submit):
            added: list[str] = []
            try:
                for request_id, choice in zip(command.request_ids, command.choices):
                    fork_of = None if choice.fork_of is None else command.request_ids[choice.fork_of]
                    engine.add_request(choice.prompt_token_ids, choice.params, request_id, fork_of=fork_of)
                    added.append(request_id)
            except Exception as exc:  # this call's alone: the engine goes on
                for request_id in added:
                    engine.abort_request(request_id)
                if isinstance(exc, ValueError):  # includes RequestTooLongError: the request's fault
                    events.append(_Rejected(command.group, str(exc)))
                else:
                    logger.exception("adding request %s failed", command.group)
                    message = f"adding the request failed: {type(exc).__name__}: {exc}"
                    events.append(_Rejected(command.group, message, 500))
            else:
                events.append(_Accepted(command.group))
        elif isinstance(command, _Abort):
            for request_id in command.request_ids:
                engine.abort_request(request_id)  # frees its blocks now; unknown ids are ignored
        elif isinstance(command, _Call):
            if command.future.set_running_or_notify_cancel():
                try:
                    command.future.set_result(command.fn(engine))
                except Exception as exc:
                    command.future.set_exception(exc)
        else:
            return False
        return True

    def _die(self, message: str) -> None:
        """The engine thread's last act: tell the loop, and answer every queued call."""
        self._thread_dead.set()
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, _Call):
                _fail_future(command.future, EngineUnavailableError(message))
        with contextlib.suppress(RuntimeError):  # the loop may be closed already
            self._post(self._on_dead, message)


class _LoopClosed(Exception):
    pass


def why_the_engine_failed(exc: BaseException) -> str:
    """What ``/health`` and every request in flight hear when the engine loop raised.

    Out of memory in a step ends the engine, on purpose, as vLLM does: the step's tensors were
    sized by the engine's own limits (``max_num_batched_tokens``, ``max_num_seqs``, the KV pool
    sized from ``gpu_memory_utilization``), so an out-of-memory error means those limits do not
    fit this device beside what else runs on it, and the next step, of the same size, would fail
    again: retrying smaller would hide a misconfiguration behind slow, unpredictable service. A
    dead engine fails every request in flight at once and answers 503 (no hang, no partial answer
    passed as whole), and the message says which limit to lower.
    """
    # torch.OutOfMemoryError is torch 2.5's name; torch.cuda's is the same class and older (the floor is 2.4).
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return (
            f"the engine ran out of device memory in a step and stopped (OutOfMemoryError: {exc}); restart it "
            "with a smaller --max-num-batched-tokens or --max-num-seqs, or a lower --gpu-memory-utilization"
        )
    return f"the engine failed: {type(exc).__name__}: {exc}"


def _fail_future(future: concurrent.futures.Future[Any], exc: BaseException) -> None:
    with contextlib.suppress(concurrent.futures.InvalidStateError):  # answered meanwhile
        future.set_exception(exc)
