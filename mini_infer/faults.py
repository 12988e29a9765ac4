"""A fault stays with its request, and a hook that injects faults in tests (chapter 06).

An exception in one request's own work (its admission, its grammar, its detokenization, its stop
checks, its output) fails that request alone: the engine finishes it with ``finish_reason``
``"error"`` and the cause in ``RequestOutput.error``, frees its blocks, and goes on with every
other request. ``RequestError`` carries such an exception out of a stage that works on many
requests at once (the sampler, through a request's grammar), naming the request it belongs to.

What can have corrupted state the requests share ends the engine instead: a forward pass that
fails (its K/V writes, a tensor-parallel worker's collectives, a CUDA error that poisons the
device), out of memory, and an exception of the sampler's batched code that names no request.

The test hook, ``inject``, is plain Python state of this process, set by tests only: no request
field, HTTP route or command-line option reaches it. Stages, and where each raises:

* ``admission``: ``LLMEngine.add_request``, before anything changes;
* ``grammar_compile``: compiling a grammar, at admission or in a step (it names no request);
* ``grammar_advance``: a grammar consuming a request's kept tokens, in the sampler's mask;
* ``grammar_mask``: a grammar computing the mask of a request's rows (its guesses tried, then
  rolled back);
* ``detokenize``, ``stop_check``: ``OutputProcessor`` on a request's new token;
* ``output``: building a request's ``RequestOutput``;
* ``sample``: the sampler, for a request (as a grammar's failure reaches it: ``RequestError``);
* ``forward``: the engine's next forward pass (the runner's ``execute``).

The first seven call ``hit(stage, request_id)`` where they work, one dictionary look-up while
nothing is armed; ``sample`` and ``forward`` are batch stages, armed on an engine
(``inject(..., engine=engine)``) by wrapping its sampler's or runner's method for the block. A
tensor-parallel worker's step (chapter 14) runs in another process: ``WORKER_FAULT_ENV`` names the
step at which it raises.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

HIT_STAGES = ("admission", "grammar_compile", "grammar_advance", "grammar_mask", "detokenize", "stop_check", "output")
ENGINE_STAGES = ("sample", "forward")
# A tensor-parallel worker (chapter 14) raises RuntimeError at its step number N (1: its first
# step) when this environment variable holds N as the engine spawns it. For tests only.
WORKER_FAULT_ENV = "MINI_INFER_TEST_WORKER_FAULT_AT_STEP"


class RequestError(Exception):
    """Request ``request_id``'s own work failed at ``stage``; ``__cause__`` is what was raised."""

    def __init__(self, request_id: str, stage: str, cause: BaseException) -> None:
        super().__init__(f"{stage} failed: {type(cause).__name__}: {cause}")
        self.request_id, self.stage = request_id, stage
        self.__cause__ = cause


@dataclass(slots=True)
class ArmedFault:
    """What ``inject`` armed: for which request (an id, a test on ids, or None: any), what to
    raise, how often."""

    request_id: str | Callable[[str | None], bool] | None
    error: Callable[[], BaseException]
    times_left: int
    times_raised: int = 0

    def fire(self, request_id: str | None) -> None:
        target = self.request_id
        if self.times_left > 0 and (
            target is None or (target(request_id) if callable(target) else target == request_id)
        ):
            self.times_left -= 1
            self.times_raised += 1
            raise self.error()


_armed: dict[str, ArmedFault] = {}


@contextmanager
def inject(
    stage: str,
    error: Callable[[], BaseException],
    request_id: str | Callable[[str | None], bool] | None = None,
    *,
    times: int = 1,
    engine: Any = None,
) -> Iterator[ArmedFault]:
    """While the block runs, ``stage`` raises ``error()``, ``times`` times at most, for request
    ``request_id`` (or the requests whose id passes it, when it is a function; None: whichever
    comes first). ``sample`` and ``forward`` need the ``engine``.
    Yields the armed fault: its ``times_raised`` tells a test that the fault was reached."""
    armed = ArmedFault(request_id, error, times)
    if stage in HIT_STAGES:
        _armed[stage] = armed
        try:
            yield armed
        finally:
            _armed.pop(stage, None)
        return
    if stage not in ENGINE_STAGES:
        raise ValueError(f"unknown stage {stage!r}: one of {', '.join(HIT_STAGES + ENGINE_STAGES)}")
    if engine is None:
        raise ValueError(f"stage {stage!r} is armed on an engine: pass engine=")
    owner, name = (engine.sampler, "sample") if stage == "sample" else (engine.runner, "execute")
    method = getattr(owner, name)

    def sample(logits: Any, batch: Any, seqs: Any) -> Any:
        for seq in seqs:
            try:
                armed.fire(seq.request_id)
            except Exception as exc:
                raise RequestError(seq.request_id, "sampling", exc) from exc
        return method(logits, batch, seqs)

    def execute(batch: Any) -> Any:
        armed.fire(None)
        return method(batch)

    setattr(owner, name, sample if stage == "sample" else execute)
    try:
        yield armed
    finally:
        delattr(owner, name)  # the class's method again


def hit(stage: str, request_id: str | None = None) -> None:
    """Raise the fault armed for ``stage`` and this request, if any (a no-op outside tests)."""
    armed = _armed.get(stage) if _armed else None
    if armed is not None:
        armed.fire(request_id)
