"""``mini-infer profile``: where a step's time goes, as a trace, a timeline and a table (chapter 12).

    mini-infer profile --model tiny --workload decode --steps 8 --out profile/
    mini-infer profile --model DIR --workload prefill --device cuda --dtype float16

Runs a workload on the engine under ``torch.profiler`` and writes to ``--out``:

* ``trace.json``: the Chrome trace (open it in Perfetto, ui.perfetto.dev, or ``chrome://tracing``);
* ``timeline.png``: the first few profiled steps, one row per level (steps, phases, layers,
  operations; on CUDA also the kernels as the device ran them), phases coloured;
* ``phases.txt`` and ``phases.json``: per phase, host time per step, its share of the step, and
  the device operations it issues per step (top-level ATen operators on a CPU; CUDA kernels on a
  GPU, where CUDA-graph replays show as one launch).

The phases are the engine step's own stages (chapter 06): ``schedule``, ``draft`` (chapter 10),
``prepare`` (the ForwardBatch), ``forward`` (with each decoder layer inside it when it runs
eagerly), ``sample``, ``stops`` (output processing: stop checks, detokenizing) and ``update``.
They are named without touching the step's code: :func:`phase_ranges` wraps, for the profiled
run only, the methods the step calls on its parts, and hooks each decoder layer.

Workloads (``--workload``):

* ``decode``: ``--batch-size`` requests of ``--prompt-len`` tokens (default 32), prefilled before
  the profiled steps, so every profiled step is one decode row per request;
* ``prefill``: a queue kept non-empty of one-token requests whose prompts (default: the token
  budget) arrive as prefill chunks, so every profiled step is prefill;
* ``mixed``: the decode batch, plus a prompt arriving whenever none waits: decode rows and a
  prefill chunk in every step, as under continuous batching.

The profiler costs time of its own: the same workload runs unprofiled first and the report states
the step time with the profiler against without (``overhead``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.autograd.profiler import record_function

if TYPE_CHECKING:
    from mini_infer.engine import LLMEngine

WORKLOADS = ("decode", "prefill", "mixed")
# The engine's parts, the method its step calls on each, and the phase that call is.
PHASES: tuple[tuple[str, str, str], ...] = (
    ("scheduler", "schedule", "schedule"),
    ("drafter", "propose", "draft"),
    ("runner", "prepare", "prepare"),
    ("runner", "execute", "forward"),
    ("sampler", "sample", "sample"),
    ("outputs", "take", "stops"),
    ("scheduler", "update", "update"),
)
PHASE_NAMES = tuple(phase for _, _, phase in PHASES)
STEP = "step"


# ----------------------------------------------------------------- naming the phases
def _ranged(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        with record_function(name):
            return method(*args, **kwargs)

    return call


@contextmanager
def phase_ranges(engine: LLMEngine) -> Iterator[None]:
    """While open, every engine step, phase and eager decoder layer is a named profiler range.

    The wrappers are instance attributes that shadow the class's methods, and the model's layer
    list is swapped for one that names each layer as the forward loops over it; leaving puts
    everything back, so the engine is exactly as before and unprofiled runs pay nothing."""
    targets = [(engine, STEP, STEP)] + [(getattr(engine, part), method, phase) for part, method, phase in PHASES]
    model = engine.runner.model
    layers = getattr(model, "layers", None)
    wrapped: list[tuple[object, str]] = []
    try:
        for obj, method, phase in targets:
            if obj is None:  # no drafter without a draft model
                continue
            setattr(obj, method, _ranged(phase, getattr(obj, method)))
            wrapped.append((obj, method))
        if isinstance(layers, torch.nn.ModuleList):
            # The forward loops over the layers inline (chapter 03) instead of calling each as a
            # module, so module hooks would never fire: the loop's own iteration opens the ranges.
            model.layers = _RangedLayers(layers)
        yield
    finally:
        for obj, method in wrapped:
            delattr(obj, method)
        if isinstance(layers, torch.nn.ModuleList):
            model.layers = layers


class _RangedLayers(torch.nn.ModuleList):
    """The same layers; iterating over them opens range ``layer.{i}`` while layer ``i`` runs
    (the range closes when the loop asks for the next layer, or ends)."""

    def __iter__(self) -> Iterator[torch.nn.Module]:
        for index, layer in enumerate(super().__iter__()):
            with record_function(f"layer.{index}"):
                yield layer


# ----------------------------------------------------------------- workloads
@dataclass
class Workload:
    """A steady state to profile: requests added by :meth:`start`, then more by :meth:`feed`
    before every step, so that each profiled step is of the workload's kind."""

    kind: str
    batch_size: int
    prompt_len: int
    steps: int
    seed: int = 0
    runs: int = 0  # runs so far

    def __post_init__(self) -> None:
        if self.kind not in WORKLOADS:
            raise ValueError(f"--workload must be one of {', '.join(WORKLOADS)}, got {self.kind!r}")
        for name in ("batch_size", "prompt_len", "steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")

    def run(self, engine: LLMEngine, steps: int, around: AbstractContextManager[Any] | None = None) -> list[float]:
        """Bring the engine to the workload's steady state, time ``steps`` steps (seconds each)
        inside ``around`` (the profiler: it sees only those steps), then abort what is left, so
        that every block is back."""
        from mini_infer.sampling_params import SamplingParams

        # Fresh prompts every run: a prompt seen in an earlier run would be a prefix-cache hit.
        rng = random.Random(f"{self.kind}-{self.seed}-{self.runs}")
        self.runs += 1
        vocab = engine.runner.model.config.vocab_size
        added: list[str] = []

        def add(length: int, max_tokens: int) -> None:
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            added.append(engine.add_request([rng.randrange(vocab) for _ in range(length)], params))

        if self.kind in ("decode", "mixed"):
            # Enough tokens to decode through every step, warm-up and prefill included.
            for _ in range(self.batch_size):
                add(self.prompt_len, max_tokens=steps + self.prompt_len + 8)
            produced: set[str] = set()
            while len(produced) < self.batch_size:  # prefill, untimed
                produced |= {out.request_id for out in engine.step() if out.token_ids}
        times = []
        with around or nullcontext():
            for _ in range(steps):
                if self.kind in ("prefill", "mixed") and not engine.scheduler.waiting:
                    add(self.prompt_len, max_tokens=1)
                start = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - start)
        for request_id in added:
            engine.abort_request(request_id)
        return times


# ----------------------------------------------------------------- reading the profile
@dataclass
class PhaseRow:
    name: str
    host_ms_per_step: float
    share_of_step: float
    device_ms_per_step: float
    device_ops_per_step: float


def _walk(event: Any) -> Iterator[Any]:
    yield event
    for child in event.cpu_children:
        yield from _walk(child)


def _device_ops(event: Any, on_gpu: bool) -> int:
    """Operations ``event`` sends to the device: CUDA kernels on a GPU; on a CPU, the ATen
    operators called from Python (an operator called by another operator is part of it)."""
    if on_gpu:
        return sum(len(e.kernels) for e in _walk(event))

    def top_level(e: Any) -> int:
        if e.name.startswith("aten::"):
            return 1
        return sum(top_level(child) for child in e.cpu_children)

    return top_level(event)


def phase_table(events: Any, on_gpu: bool) -> list[PhaseRow]:
    """One row per phase (and ``step`` itself, then ``layer`` for all layers together), averaged
    over the profiled steps."""
    steps = [e for e in events if e.name == STEP]
    if not steps:
        raise RuntimeError("the profile holds no engine step: was the workload empty?")
    step_us = sum(e.cpu_time_total for e in steps)
    rows = []
    for name in (STEP, *PHASE_NAMES, "layer"):
        chosen = [e for e in events if e.name == name or (name == "layer" and e.name.startswith("layer."))]
        host = sum(e.cpu_time_total for e in chosen)
        device = sum(e.device_time_total for e in chosen) if on_gpu else 0.0
        ops = sum(_device_ops(e, on_gpu) for e in chosen)
        rows.append(
            PhaseRow(name, host / 1e3 / len(steps), host / step_us, device / 1e3 / len(steps), ops / len(steps))
        )
    return rows


def format_table(rows: list[PhaseRow], on_gpu: bool) -> str:
    unit = "CUDA kernels" if on_gpu else "ATen ops"
    lines = [f"{'phase':<10} {'host ms/step':>13} {'share':>7} {'device ms/step':>15} {unit + '/step':>16}"]
    for r in rows:
        device = f"{r.device_ms_per_step:15.3f}" if on_gpu else f"{'(host)':>15}"
        lines.append(
            f"{r.name:<10} {r.host_ms_per_step:13.3f} {r.share_of_step:7.1%} {device} {r.device_ops_per_step:16.1f}"
        )
    return "\n".join(lines)


# ----------------------------------------------------------------- the picture
COLOURS = dict(
    zip(PHASE_NAMES, ("#4C72B0", "#8172B3", "#DD8452", "#55A868", "#C44E52", "#937860", "#DA8BC3"), strict=True)
)


def draw_timeline(events: Any, path: Path, *, max_steps: int = 3, title: str = "") -> None:
    """The first ``max_steps`` profiled steps: steps, phases, layers and operations on the host
    (and kernels on the device, on a GPU), on one time axis in milliseconds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = sorted((e for e in events if e.name == STEP), key=lambda e: e.time_range.start)[:max_steps]
    if not steps:
        raise RuntimeError("the profile holds no engine step to draw")
    t0, t1 = steps[0].time_range.start, steps[-1].time_range.end
    inside = [e for e in events if t0 <= e.time_range.start and e.time_range.end <= t1]

    def bars(chosen: list[Any]) -> list[tuple[float, float]]:
        return [((e.time_range.start - t0) / 1e3, (e.time_range.end - e.time_range.start) / 1e3) for e in chosen]

    rows: list[tuple[str, list[Any], Callable[[Any], str]]] = [
        ("host: step", [e for e in inside if e.name == STEP], lambda e: "#BBBBBB"),
        ("host: phases", [e for e in inside if e.name in COLOURS], lambda e: COLOURS[e.name]),
        ("host: layers", [e for e in inside if e.name.startswith("layer.")], lambda e: ("#55A868", "#9BD3A8")[int(e.name[6:]) % 2]),
        ("host: ATen ops", [e for e in inside if e.name.startswith("aten::") and e.cpu_parent is not None and not e.cpu_parent.name.startswith("aten::")], lambda e: "#666666"),
    ]  # fmt: skip
    kernels = [e for e in events if getattr(e.device_type, "name", "") == "CUDA"]
    if kernels:
        rows.append(("device: kernels", [e for e in kernels if t0 <= e.time_range.start <= t1], lambda e: "#333333"))
    fig, ax = plt.subplots(figsize=(11, 0.7 * len(rows) + 1.6), layout="constrained")
    for y, (_, chosen, colour) in enumerate(reversed(rows)):
        colours = [colour(e) for e in chosen]
        ax.broken_barh(bars(chosen), (y - 0.35, 0.7), facecolors=colours, edgecolor="white", linewidth=0.6)
    ax.set_yticks(range(len(rows)), [label for label, _, _ in reversed(rows)])
    ax.set_xlabel("time since the first step began (ms)")
    ax.set_title(title or f"{len(steps)} engine steps")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLOURS.values()]
    fig.legend(handles, COLOURS, ncol=len(COLOURS), loc="outside lower center", fontsize=8)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------- the command
@dataclass
class ProfileResult:
    workload: str
    device: str
    steps: int
    step_ms_unprofiled: float  # median step time without the profiler
    step_ms_profiled: float  # median step time under it
    phases: list[PhaseRow]

    @property
    def overhead(self) -> float:
        return self.step_ms_profiled / self.step_ms_unprofiled


@contextmanager
def _quiet(prof: Any) -> Iterator[Any]:
    """``prof`` entered and left with the process's stderr closed: the profiler's C++ side
    prints a line to it on start and on stop (torch 2.13), noise in a notebook's output."""

    def silently(action: Callable[[], Any]) -> Any:
        sys.stderr.flush()
        saved = os.dup(2)
        try:
            with open(os.devnull, "w") as null:
                os.dup2(null.fileno(), 2)
                return action()
        finally:
            os.dup2(saved, 2)
            os.close(saved)

    entered = silently(prof.__enter__)
    try:
        yield entered
    finally:
        silently(lambda: prof.__exit__(None, None, None))


def profile(engine: LLMEngine, workload: Workload, out: Path) -> ProfileResult:
    """Run ``workload`` three times on ``engine``: to warm up, timed without the profiler, and
    profiled with the phases named; write the trace, the timeline and the table to ``out``."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(engine.runner.device)
    on_gpu = device.type == "cuda"
    workload.run(engine, workload.steps)  # warm-up: first calls, allocator, caches
    plain = workload.run(engine, workload.steps)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    prof = torch_profile(activities=activities)
    with phase_ranges(engine):
        profiled = workload.run(engine, workload.steps, around=_quiet(prof))
    prof.export_chrome_trace(str(out / "trace.json"))
    events = prof.events()
    result = ProfileResult(
        workload.kind,
        str(device),
        workload.steps,
        1e3 * statistics.median(plain),
        1e3 * statistics.median(profiled),
        phase_table(events, on_gpu),
    )
    title = f"{workload.kind} on {device}: {workload.batch_size} rows, {workload.prompt_len}-token prompts"
    draw_timeline(events, out / "timeline.png", title=title)
    table = format_table(result.phases, on_gpu)
    (out / "phases.txt").write_text(table + "\n")
    summary = {k: v for k, v in asdict(result).items() if k != "phases"} | {"overhead": result.overhead}
    (out / "phases.json").write_text(json.dumps(summary | {"phases": [asdict(r) for r in result.phases]}, indent=1))
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from mini_infer.cli_options import add_engine_args

    add_engine_args(parser)
    parser.add_argument("--workload", choices=WORKLOADS, default="decode")
    parser.add_argument("--steps", type=int, default=8, help="engine steps profiled (default 8)")
    parser.add_argument("--batch-size", type=int, default=8, help="decoding requests (decode, mixed; default 8)")
    parser.add_argument(
        "--prompt-len",
        type=int,
        default=None,
        help="prompt tokens (default: 32 to decode; the token budget to prefill)",
    )
    parser.add_argument("--out", type=Path, default=Path("profile"), help="folder for the trace, timeline and table")


def main(args: argparse.Namespace) -> int:
    from mini_infer import LLM
    from mini_infer.cli_options import engine_kwargs

    with LLM(args.model, **engine_kwargs(args)) as llm:
        engine = llm.engine
        prompt_len = args.prompt_len
        if prompt_len is None:
            budget = engine.scheduler.max_num_batched_tokens
            prompt_len = 32 if args.workload == "decode" else min(budget, engine.scheduler.max_model_len - 1)
        workload = Workload(args.workload, args.batch_size, prompt_len, args.steps)
        result = profile(engine, workload, args.out)
    print(f"{result.workload} on {result.device}, {result.steps} steps profiled")
    print(format_table(result.phases, result.device.startswith("cuda")))
    print(
        f"profiler overhead: {result.step_ms_profiled:.2f} ms a step profiled against "
        f"{result.step_ms_unprofiled:.2f} ms without ({result.overhead:.2f}x)"
    )
    print(f"wrote {args.out}/trace.json (Perfetto, chrome://tracing), timeline.png, phases.txt, phases.json")
    return 0
