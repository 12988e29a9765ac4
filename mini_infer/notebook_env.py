"""What every chapter's first cell calls: where am I, on what device, with which model (chapter 00).

Every notebook of the book starts with the same cell (``first_cell()`` renders it; the book's
contributing page shows it; ``tests/test_notebook_env.py`` checks every notebook against it)::

    # Setup: installs mini-infer when missing (Colab, Kaggle), then picks the device and a model.
    try:
        import mini_infer
    except ImportError:
        import glob, importlib, os  # Kaggle without internet: the wheels dataset attached (book: setup)
        wheels = [w for depth in range(1, 5) for w in glob.glob("/kaggle/input/" + "*/" * depth + "<wheel>")]
        if wheels:
            %pip install -q --no-index --find-links {os.path.dirname(wheels[0])} "mini-infer[notebook]==<version>"
        else:
            %pip install -q "mini-infer[notebook] @ <html.baseurl>wheels/<wheel>"
        importlib.invalidate_caches()
        try:
            import mini_infer
        except ImportError:
            raise RuntimeError("mini-infer <version> could not be installed from <address>: turn the "
                               "Internet on ..., or attach the mini-infer-wheels dataset ...") from None
    from mini_infer.notebook_env import setup
    env = setup()

The cell installs the package *release that produced the stored outputs*: the website publishes
the wheel built from the same commit as its pages (``book/_ext/release_wheel.py``), at the address
made of ``html.baseurl`` in ``_config.yml`` and ``mini_infer.__version__``; never GitHub's moving
``main``. On Kaggle with the internet off, a dataset holding that wheel and the wheels of the
``notebook`` extra (``scripts/kaggle_wheels.sh``) is found under ``/kaggle/input`` and installed
without an index; the search looks one to four folders deep (a dataset mounts at
``/kaggle/input/<slug>`` or ``/kaggle/input/datasets/<owner>/<slug>``), never through every file
of every attached model. When neither route installs it (``%pip`` reports its failure but raises
nothing), the cell stops with what to do (turn the Internet on, or attach the wheels dataset)
instead of a bare ``ModuleNotFoundError`` two lines later. IPython expands ``{...}`` in a ``%pip``
line.

``setup()`` answers the questions that let one notebook run unchanged on Colab, Kaggle, a laptop
and CI, and makes the rest of the notebook reproducible:

* ``platform``: ``"colab"``, ``"kaggle"`` or ``"local"`` (read from the environment variables
  those services set);
* ``device`` and ``dtype``: the engine's own ``"auto"`` rules (``mini_infer.device``);
* ``online``: whether huggingface.co answers within about two seconds. ``HF_HUB_OFFLINE=1`` (or
  ``TRANSFORMERS_OFFLINE=1``) means offline without trying; CI sets it so that notebooks
  produce the same outputs everywhere;
* ``model``: the hub id a chapter asks for with ``setup(prefer_real_model="Qwen/...")`` when the
  hub is reachable, else ``"tiny"``, the small trained model shipped inside the package. The
  environment variable ``MINI_INFER_MODEL`` overrides both (a hub id, a local directory or a
  shipped name).

It also seeds ``random``, NumPy and torch, sets the book's matplotlib defaults and prints one
summary line. ``show_source(obj)`` displays the package's real source of a function, class or
module in a notebook: chapters show the code that runs, never a copy that can drift.
``on_your_own(*functions)`` (and ``without(answer, *functions)``) make an exercise's graded
test refuse answers that call the code they are checked against.

Two helpers shape a chapter's pictures and prose the same way in every chapter:

* ``explore(draw, static, **controls)``: a figure a reader can step through. The static picture
  (one state, or a small grid of states) is always drawn, so that the website, GitHub and any
  runtime whose front end shows no widgets still show it; then, where ipywidgets is installed,
  controls redraw the same ``draw`` live.
* ``glue(name, value)``: stores a measured number in the cell's outputs, as MyST-NB's ``glue``
  does, so that the prose beside it quotes the number the cell printed
  (``{glue:text}`name``` in a Markdown cell) instead of a copy that drifts. Without MyST-NB
  (Colab, Kaggle) it writes the very same output.
"""

from __future__ import annotations

import functools
import inspect
import os
import random
import re
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

OFFLINE_MODEL = "tiny"
HUB_TIMEOUT_S = 2.0
KAGGLE_WORKING_DIR = Path("/kaggle/working")

FIRST_CELL_TEMPLATE = """\
# Setup: installs mini-infer when missing (Colab, Kaggle), then picks the device and a model.
try:
    import mini_infer
except ImportError:
    import glob, importlib, os  # Kaggle without internet: the wheels dataset attached (book: setup)
    wheels = [w for depth in range(1, 5) for w in glob.glob("/kaggle/input/" + "*/" * depth + "{wheel}")]
    if wheels:
        %pip install -q --no-index --find-links {{os.path.dirname(wheels[0])}} "mini-infer[notebook]=={version}"
    else:
        %pip install -q "mini-infer[notebook] @ {site_url}wheels/{wheel}"
    importlib.invalidate_caches()  # site-packages was listed before pip wrote to it
    try:
        import mini_infer
    except ImportError:
        raise RuntimeError(
            "mini-infer {version} could not be installed from {site_url}wheels/{wheel}: turn the Internet on "
            "(Kaggle: Settings, Internet on), or attach the mini-infer-wheels dataset (Kaggle: Add Input; how "
            "to make it: {site_url}book/setup.html#run-chapter-13-on-kaggle), then run this cell again."
        ) from None
from mini_infer.notebook_env import setup
env = setup({arguments})"""


def release_wheel_name(version: str) -> str:
    """The file name of mini-infer's wheel for ``version``, as pip builds it."""
    return f"mini_infer-{version}-py3-none-any.whl"


def first_cell(site_url: str, version: str, arguments: str = "") -> str:
    """The canonical first cell of a chapter: installs ``version`` from the website at ``site_url``
    (``html.baseurl`` in ``_config.yml``) or from a Kaggle dataset; ``arguments`` go into ``setup(...)``."""
    return FIRST_CELL_TEMPLATE.format(
        site_url=site_url.rstrip("/") + "/", version=version, wheel=release_wheel_name(version), arguments=arguments
    )


@dataclass(frozen=True)
class NotebookEnv:
    platform: str  # "colab" | "kaggle" | "local"
    device: str  # "cuda" | "mps" | "cpu"
    dtype: str  # "bfloat16" | "float16" | "float32": what dtype="auto" picks on this device
    online: bool  # huggingface.co reachable (and not switched off with HF_HUB_OFFLINE=1)
    model: str  # what the chapter should pass to mini_infer.LLM(...)
    seed: int

    def summary(self) -> str:
        from mini_infer import __version__

        network = "online" if self.online else "offline"
        return (
            f"mini-infer {__version__} | {self.platform} | device={self.device} dtype={self.dtype} | "
            f"{network} | model={self.model} | seed={self.seed}"
        )


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


def detect_platform() -> str:
    if "google.colab" in sys.modules or "COLAB_RELEASE_TAG" in os.environ or "COLAB_GPU" in os.environ:
        return "colab"
    if "KAGGLE_KERNEL_RUN_TYPE" in os.environ or "KAGGLE_URL_BASE" in os.environ:
        return "kaggle"
    if KAGGLE_WORKING_DIR.is_dir():
        return "kaggle"
    return "local"


def hub_offline_requested() -> bool:
    return _env_flag("HF_HUB_OFFLINE") or _env_flag("TRANSFORMERS_OFFLINE")


def hub_reachable(timeout: float = HUB_TIMEOUT_S) -> bool:
    """True when the Hugging Face hub answers an HTTP request within ``timeout`` seconds.

    Any HTTP answer counts, even an error status: the question is whether a download could
    start, not whether this URL exists. The request runs in a daemon thread so that a slow DNS
    lookup, which a socket timeout does not cover, cannot hold the notebook up either.
    """
    if hub_offline_requested():
        return False
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    answered: list[bool] = []

    def probe() -> None:
        request = urllib.request.Request(endpoint, method="HEAD", headers={"User-Agent": "mini-infer"})
        try:
            with urllib.request.urlopen(request, timeout=timeout):
                answered.append(True)
        except urllib.error.HTTPError:
            answered.append(True)
        except (OSError, ValueError):
            answered.append(False)

    thread = threading.Thread(target=probe, name="mini-infer-hub-probe", daemon=True)
    thread.start()
    thread.join(timeout)
    return bool(answered and answered[0])


def choose_model(prefer_real_model: str | None, online: bool) -> str:
    override = os.environ.get("MINI_INFER_MODEL", "").strip()
    if override:
        return override
    if prefer_real_model and online:
        return prefer_real_model
    return OFFLINE_MODEL


def seed_everything(seed: int) -> None:
    import torch

    random.seed(seed)
    torch.manual_seed(seed)  # seeds every CUDA device too
    try:
        import numpy as np
    except ImportError:
        return
    np.random.seed(seed)


def style_matplotlib() -> None:
    """The book's figure defaults; a no-op where matplotlib is not installed."""
    try:
        import matplotlib as mpl
        import matplotlib.pyplot  # noqa: F401  (activates the notebook backend before we set rcParams)
    except ImportError:
        return
    mpl.rcParams.update(
        {
            "figure.figsize": (7.0, 3.5),
            "figure.dpi": 100,
            "savefig.dpi": 100,
            "figure.constrained_layout.use": True,
            "font.size": 10,
            "axes.titlesize": "medium",
            "axes.spines.top": False,
            "axes.spines.right": False,
            "axes.grid": True,
            "grid.alpha": 0.3,
            "legend.frameon": False,
        }
    )


def setup(prefer_real_model: str | None = None, *, seed: int = 0) -> NotebookEnv:
    """Detect platform, device and network; choose a model; seed; style figures; print one line.

    ``prefer_real_model``: a hub id (e.g. ``"Qwen/Qwen2.5-0.5B-Instruct"``) the chapter would
    rather use when the hub is reachable; offline, the chapter gets ``"tiny"`` instead, so every
    chapter must also make sense with the tiny model.
    """
    from mini_infer.device import resolve_device, resolve_dtype

    device = resolve_device("auto")
    dtype = resolve_dtype("auto", device)
    online = hub_reachable()
    env = NotebookEnv(
        platform=detect_platform(),
        device=device.type,
        dtype=str(dtype).removeprefix("torch."),
        online=online,
        model=choose_model(prefer_real_model, online),
        seed=seed,
    )
    seed_everything(seed)
    style_matplotlib()
    print(env.summary())
    return env


@dataclass(frozen=True)
class SourceCode:
    """Source text that notebooks render as a highlighted Python block (and text as itself)."""

    text: str

    def _repr_markdown_(self) -> str:
        longest_run = max((len(run) for run in re.findall(r"`+", self.text)), default=0)
        fence = "`" * max(3, longest_run + 1)
        return f"{fence}python\n{self.text}\n{fence}"

    def __repr__(self) -> str:
        return self.text


# The student track's region markers (``mini_infer.course.regions``): tooling, not code to read.
_STUDENT_MARKER = re.compile(r"^[ \t]*# student: (begin chapter \d\d: .*|end)\n", re.MULTILINE)


def show_source(obj: Any) -> SourceCode:
    """The package's real source of ``obj`` (function, class or module), for a notebook to show.

    Jupyter, Colab, Kaggle, GitHub and the book's website render it as a highlighted code block.
    The student track's ``# student:`` marker lines are left out: the lines between them are the
    chapter's assignment in the student package (the instructors' page says how), not something a
    reader of the code needs to see.
    """
    return SourceCode(_STUDENT_MARKER.sub("", inspect.getsource(obj)).rstrip("\n"))


def _refuse(*args: Any, _name: str = "", **kwargs: Any) -> Any:
    raise AssertionError(f"{_name} would do this exercise for you: write your own code")


@contextmanager
def on_your_own(*functions: Any) -> Iterator[None]:
    """While the block runs, each of ``functions`` raises when called, by whatever name or
    reference (a module global, an import under another name, a method, a property): a graded
    test runs the student's answer inside the block, so an answer that calls the very code it is
    checked against fails with a clear message; the expected values are computed outside it.

    Give Python functions, methods (``Class.method``), properties or classmethods, of the
    package, of the notebook or of a library. Each function's code is swapped for a refusal and
    put back afterwards; a method that calls ``super()`` is replaced in its class instead, and
    other closures are refused (give the function that calls them).
    """
    with ExitStack() as stack:
        for target in functions:
            function = getattr(target, "fget", None) or getattr(target, "__func__", None) or target
            code = getattr(function, "__code__", None)
            if code is None:
                raise TypeError(f"on_your_own needs Python functions or methods, got {target!r}")
            name = function.__qualname__
            if code.co_freevars:  # a closure: its code cannot be swapped
                if "__class__" not in code.co_freevars:
                    raise TypeError(f"on_your_own cannot refuse {name}, a closure: give the function that calls it")
                # A method that calls super(): the closure's __class__ is its class; replace it there.
                owner = function.__closure__[code.co_freevars.index("__class__")].cell_contents
                stack.enter_context(mock.patch.object(owner, function.__name__, functools.partial(_refuse, _name=name)))
                continue
            stack.callback(setattr, function, "__code__", code)
            stack.callback(setattr, function, "__kwdefaults__", function.__kwdefaults__)
            function.__code__, function.__kwdefaults__ = _refuse.__code__, {"_name": name}
        yield


def without(answer: Callable[..., Any], *functions: Callable[..., Any]) -> Callable[..., Any]:
    """``answer``, run with ``on_your_own(*functions)`` each time it is called."""

    def call(*args: Any, **kwargs: Any) -> Any:
        with on_your_own(*functions):
            return answer(*args, **kwargs)

    return call


# --- figures a reader can explore, and numbers the prose quotes ------------------------------

GLUE_PREFIX = "application/papermill.record/"  # MyST-NB's prefix for a glued value that is not shown


def glue(name: str, value: Any) -> None:
    """Store ``value`` under ``name`` in this cell's outputs for the book's prose to quote.

    A Markdown cell of the same notebook writes the number where it belongs, in a span naming the
    key, ``<span data-glue="name">1.5</span>`` (``name:.2f`` for a format spec), which Jupyter, Colab,
    Kaggle and the website all show as text; ``tests/test_glue.py`` fails when the number written
    is not the value stored, so the sentence and the measurement cannot disagree unnoticed. Nothing
    is shown in the notebook (the cell prints the number itself). Glue a Python number or a short string; a NumPy or torch scalar
    is turned into a Python number first, because MyST-NB formats the value's ``repr``.

    Uses ``myst_nb.glue`` where MyST-NB is installed (the book's build); elsewhere (Colab,
    Kaggle) it writes the same display output by hand, so a notebook runs everywhere.
    """
    item = getattr(value, "item", None)
    if callable(item) and getattr(value, "ndim", None) == 0:
        value = item()
    try:
        from myst_nb import glue as myst_glue
    except ImportError:
        from IPython.core.formatters import format_display_data
        from IPython.display import display

        bundle, metadata = format_display_data(value)
        metadata = {**metadata, "scrapbook": {"name": name, "mime_prefix": GLUE_PREFIX}}
        display({GLUE_PREFIX + mime: data for mime, data in bundle.items()}, raw=True, metadata=metadata)
        return
    myst_glue(name, value, display=False)


WIDGETS_MISSING = "(ipywidgets is not installed: the figure above is all there is; pip install ipywidgets to explore)"


def explore(
    draw: Callable[..., Any],
    static: Mapping[str, Any] | Sequence[Mapping[str, Any]],
    *,
    figsize: tuple[float, float] | None = None,
    ncols: int = 1,
    title: str | None = None,
    **controls: Any,
) -> None:
    """Draw a figure a reader can explore: a static picture first, always, then live controls.

    ``draw(fig, **state)`` draws one state of the picture into ``fig``, a matplotlib ``Figure``
    or ``SubFigure`` (``fig.subplots(...)`` gives it axes). ``static`` is the state drawn in the
    static picture, or a list of states drawn side by side in a grid of ``ncols`` columns, under
    ``title``; ``figsize`` is the size of one state's picture (default: the book's figure size).
    The static picture is a plain PNG in the cell's output: the website, GitHub and runtimes
    whose front end shows no widgets show it, and so does a reader without ipywidgets.

    Each keyword in ``controls`` names an argument of ``draw`` and the values it may take:
    a ``range`` or a tuple ``(min, max)`` / ``(min, max, step)`` of numbers gives a slider
    (floats: a float slider), a list gives buttons (up to six choices) or a drop-down, and its
    items may be ``(label, value)`` pairs. The controls start at the first static state's values
    (or, where it has none, at ``draw``'s defaults).
    Where ``ipywidgets`` imports (7.7 or 8), they are shown under the static picture and every
    change redraws ``draw`` with their values; elsewhere one line says so. A state of the static
    picture may carry arguments that no control sets (say, where a legend goes).
    """
    import matplotlib.pyplot as plt

    states = [static] if isinstance(static, Mapping) else list(static)
    if not states:
        raise ValueError("explore needs at least one static state")
    width, height = figsize or tuple(plt.rcParams["figure.figsize"])
    columns = min(ncols, len(states))
    rows = -(-len(states) // columns)
    fig = plt.figure(figsize=(width * columns, height * rows))
    if len(states) == 1:
        draw(fig, **states[0])
    else:
        for panel, state in zip(fig.subfigures(rows, columns, squeeze=False).flat, states):
            draw(panel, **state)
    if title:
        fig.suptitle(title)
    plt.show()
    if not controls:
        return
    try:
        import ipywidgets as widgets
        from IPython.display import display
    except ImportError:
        print(WIDGETS_MISSING)
        return

    defaults = {name: p.default for name, p in inspect.signature(draw).parameters.items() if p.default is not p.empty}
    start = {**defaults, **states[0]}
    made = {name: _control(widgets, name, spec, start.get(name)) for name, spec in controls.items()}

    def redraw(**values: Any) -> None:
        live = plt.figure(figsize=(width, height))
        try:
            draw(live, **values)
        except BaseException:
            plt.close(live)  # no half-drawn figure left for the next cell's output
            raise
        plt.show()

    display(widgets.VBox([*made.values(), widgets.interactive_output(redraw, made)]))


def _control(widgets: Any, name: str, spec: Any, value: Any) -> Any:
    """The ipywidgets control for one of ``explore``'s ``controls`` (see there)."""
    style = {"description_width": "initial"}
    numbers = isinstance(spec, tuple) and len(spec) in (2, 3) and all(isinstance(x, (int, float)) for x in spec)
    if isinstance(spec, widgets.Widget):
        control = spec
    elif isinstance(spec, range):
        control = widgets.IntSlider(min=spec.start, max=spec[-1], step=spec.step, style=style)
    elif numbers and all(isinstance(x, int) for x in spec):
        control = widgets.IntSlider(min=spec[0], max=spec[1], step=spec[2] if len(spec) == 3 else 1, style=style)
    elif numbers:
        step = spec[2] if len(spec) == 3 else (spec[1] - spec[0]) / 100
        control = widgets.FloatSlider(min=spec[0], max=spec[1], step=step, style=style)
    else:
        options = list(spec)
        if not options:
            raise ValueError(f"explore: the control {name!r} has no values")
        kind = widgets.ToggleButtons if len(options) <= 6 else widgets.Dropdown
        control = kind(options=options, style=style)
    control.description = name
    if value is not None:
        control.value = value
    return control
