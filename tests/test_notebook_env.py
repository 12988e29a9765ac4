"""The chapters' first cell and ``mini_infer.notebook_env.setup()`` (chapter 00).

* Every notebook's first code cell is the canonical one (``first_cell()``): it installs the wheel
  of this package's version from the website (``html.baseurl`` in ``_config.yml``, the one place
  that names the site), or from a Kaggle dataset with the internet off; both branches are run in
  IPython with ``%pip`` recorded. The contributing guide shows the same cell.
* ``setup()`` works offline: the network check is monkeypatched, never performed.
"""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

import nbformat
import pytest
import torch
import yaml

import mini_infer
from mini_infer import notebook_env
from mini_infer.notebook_env import NotebookEnv, first_cell, release_wheel_name, setup, show_source

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted(p for p in (ROOT / "notebooks").glob("*.ipynb") if not p.name.startswith("_"))
PLATFORM_VARIABLES = ["COLAB_RELEASE_TAG", "COLAB_GPU", "KAGGLE_KERNEL_RUN_TYPE", "KAGGLE_URL_BASE"]


def site_url() -> str:
    config = yaml.safe_load((ROOT / "_config.yml").read_text(encoding="utf-8"))
    return str(config["html"]["baseurl"])


def canonical_first_cell(arguments: str = "") -> str:
    return first_cell(site_url(), mini_infer.__version__, arguments=arguments)


# --- the first cell of every chapter ---------------------------------------------------------


def test_there_are_notebooks() -> None:
    assert NOTEBOOKS, "notebooks/ holds no chapter"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_first_code_cell_is_the_canonical_setup_cell(path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    code_positions = [i for i, cell in enumerate(nb.cells) if cell.cell_type == "code"]
    assert code_positions, f"{path.name} has no code cell"
    first = code_positions[0]
    assert first <= 1, f"{path.name}: only a title Markdown cell may come before the setup cell"
    source = nb.cells[first].source
    # The only freedom: the arguments of setup(...), e.g. prefer_real_model="Qwen/...".
    match = re.search(r"^env = setup\((.*)\)$", source, flags=re.MULTILINE)
    assert match, f"{path.name}: the first code cell must end with env = setup(...)"
    expected = canonical_first_cell(arguments=match.group(1))
    assert source == expected, (
        f"{path.name}: the first code cell differs from the canonical setup cell "
        f"(scripts/sync_first_cells.py rewrites it).\nExpected:\n{expected}\n\nFound:\n{source}"
    )


def test_the_package_version_is_the_one_pyproject_builds() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert f'\nversion = "{mini_infer.__version__}"\n' in pyproject, "mini_infer.__version__ and pyproject.toml differ"


def test_site_url_is_an_absolute_https_folder() -> None:
    assert re.fullmatch(r"https://[^\s/]+/(\S+/)?", site_url()), "html.baseurl must be https://host/path/"


def run_first_cell(
    monkeypatch: pytest.MonkeyPatch, kaggle_wheels: list[str], pip_installs: bool = True
) -> tuple[list[str], Any]:
    """Runs the canonical first cell in IPython as a fresh Colab/Kaggle runtime would (mini_infer
    not importable until ``%pip`` installs it, and never when ``pip_installs`` is False: no
    internet, no dataset), with glob answering ``kaggle_wheels`` for the pattern that names the
    wheel's folder depth; returns the %pip lines and the cell's result."""
    import builtins
    import glob

    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    pip_lines: list[str] = []
    shell.register_magic_function(lambda line: pip_lines.append(line), magic_kind="line", magic_name="pip")
    real_import = builtins.__import__

    def refuse_mini_infer(name: str, *args: object, **kwargs: object) -> object:
        if (name == "mini_infer" or name.startswith("mini_infer.")) and not (pip_installs and pip_lines):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)  # type: ignore[arg-type]

    seen: list[tuple[str, bool]] = []

    def fake_glob(pattern: str, recursive: bool = False) -> list[str]:
        seen.append((pattern, recursive))
        depth = pattern.removeprefix("/kaggle/input/").count("/")
        return [w for w in kaggle_wheels if w.removeprefix("/kaggle/input/").count("/") == depth]

    monkeypatch.setattr(glob, "glob", fake_glob)
    monkeypatch.setattr(builtins, "__import__", refuse_mini_infer)
    cell = canonical_first_cell().split("from mini_infer.notebook_env import setup")[0]  # up to the install
    try:
        result = shell.run_cell(cell)
    finally:
        monkeypatch.setattr(builtins, "__import__", real_import)
        InteractiveShell.clear_instance()
    # The search under /kaggle/input is bounded: a few folder depths, never a recursive walk of
    # every attached dataset and model.
    wheel = release_wheel_name(mini_infer.__version__)
    assert seen and all(not recursive and "**" not in pattern for pattern, recursive in seen), seen
    assert all(p.startswith("/kaggle/input/") and p.endswith("/" + wheel) and p.count("/") <= 8 for p, _ in seen)
    return pip_lines, result


def test_first_cell_installs_this_version_from_the_website(monkeypatch: pytest.MonkeyPatch) -> None:
    version = mini_infer.__version__
    pip_lines, result = run_first_cell(monkeypatch, kaggle_wheels=[])
    result.raise_error()
    assert pip_lines == [
        f'install -q "mini-infer[notebook] @ {site_url()}wheels/mini_infer-{version}-py3-none-any.whl"'
    ]


@pytest.mark.parametrize(
    "folder",
    ["/kaggle/input/mini-infer-wheels", "/kaggle/input/datasets/someone/mini-infer-wheels"],
)
def test_first_cell_installs_the_attached_kaggle_wheels_without_an_index(
    monkeypatch: pytest.MonkeyPatch, folder: str
) -> None:
    version = mini_infer.__version__
    wheel = f"{folder}/mini_infer-{version}-py3-none-any.whl"
    pip_lines, result = run_first_cell(monkeypatch, kaggle_wheels=[wheel])
    result.raise_error()
    assert pip_lines == [f'install -q --no-index --find-links {folder} "mini-infer[notebook]=={version}"']


def test_first_cell_tells_the_reader_what_to_do_when_the_wheel_cannot_be_reached(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Kaggle with the internet off and no dataset attached: %pip fails and installs nothing.
    pip_lines, result = run_first_cell(monkeypatch, kaggle_wheels=[], pip_installs=False)
    assert len(pip_lines) == 1
    error = result.error_in_exec
    assert error is not None and not isinstance(error, ImportError), repr(error)  # not a bare ModuleNotFoundError
    message = str(error)
    assert "Internet" in message and "mini-infer-wheels" in message and "Add Input" in message, message
    assert f"{site_url()}wheels/{release_wheel_name(mini_infer.__version__)}" in message
    assert f"{site_url()}book/setup.html#run-chapter-13-on-kaggle" in message


def test_contributing_guide_shows_the_canonical_cell() -> None:
    guide = (ROOT / "book" / "contributing.md").read_text(encoding="utf-8")
    assert canonical_first_cell() in guide, "book/contributing.md must show first_cell() exactly"


# --- setup() ----------------------------------------------------------------------------------


@pytest.fixture
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in [*PLATFORM_VARIABLES, "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "MINI_INFER_MODEL"]:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(notebook_env, "KAGGLE_WORKING_DIR", Path("/nonexistent/kaggle/working"))
    return monkeypatch


def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(notebook_env, "hub_reachable", lambda timeout=2.0: False)


def online(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(notebook_env, "hub_reachable", lambda timeout=2.0: True)


def test_setup_offline_uses_the_tiny_model(clean_environment: pytest.MonkeyPatch, capsys) -> None:
    offline(clean_environment)
    env = setup(prefer_real_model="Qwen/Qwen2.5-0.5B-Instruct")
    assert isinstance(env, NotebookEnv)
    assert env.online is False
    assert env.model == "tiny"
    assert env.platform == "local"
    assert env.device in {"cuda", "mps", "cpu"}
    assert env.dtype in {"float32", "bfloat16", "float16"}
    printed = capsys.readouterr().out.strip().splitlines()
    assert printed == [env.summary()], "setup() prints exactly one summary line"
    assert "offline" in printed[0] and "model=tiny" in printed[0]


def test_setup_online_uses_the_model_the_chapter_asks_for(clean_environment: pytest.MonkeyPatch) -> None:
    online(clean_environment)
    assert setup(prefer_real_model="Qwen/Qwen2.5-0.5B-Instruct").model == "Qwen/Qwen2.5-0.5B-Instruct"
    assert setup().model == "tiny", "without a request, the tiny model even when online"


def test_model_override_from_the_environment(clean_environment: pytest.MonkeyPatch) -> None:
    offline(clean_environment)
    clean_environment.setenv("MINI_INFER_MODEL", "/models/my-qwen")
    assert setup(prefer_real_model="Qwen/Qwen2.5-0.5B-Instruct").model == "/models/my-qwen"


def test_hf_hub_offline_means_offline_without_trying(clean_environment: pytest.MonkeyPatch) -> None:
    clean_environment.setenv("HF_HUB_OFFLINE", "1")

    def no_network(*args, **kwargs):
        raise AssertionError("HF_HUB_OFFLINE=1 must not touch the network")

    clean_environment.setattr(notebook_env.urllib.request, "urlopen", no_network)
    assert notebook_env.hub_reachable() is False
    assert setup(prefer_real_model="Qwen/Qwen2.5-0.5B-Instruct").model == "tiny"


def test_hub_probe_counts_any_http_answer_and_no_answer(clean_environment: pytest.MonkeyPatch) -> None:
    import email.message
    import urllib.error

    def http_error(request, timeout):
        raise urllib.error.HTTPError(request.full_url, 403, "Forbidden", email.message.Message(), None)

    def unreachable(request, timeout):
        raise urllib.error.URLError("no route to host")

    clean_environment.setattr(notebook_env.urllib.request, "urlopen", http_error)
    assert notebook_env.hub_reachable(timeout=1.0) is True
    clean_environment.setattr(notebook_env.urllib.request, "urlopen", unreachable)
    assert notebook_env.hub_reachable(timeout=1.0) is False


def test_hub_probe_gives_up_after_its_timeout(clean_environment: pytest.MonkeyPatch) -> None:
    import threading
    import time

    release = threading.Event()

    def hangs(request, timeout):
        release.wait(5)
        raise OSError("too late")

    clean_environment.setattr(notebook_env.urllib.request, "urlopen", hangs)
    start = time.perf_counter()
    try:
        assert notebook_env.hub_reachable(timeout=0.2) is False
        assert time.perf_counter() - start < 2.0
    finally:
        release.set()


@pytest.mark.parametrize(
    ("variable", "platform"),
    [("COLAB_RELEASE_TAG", "colab"), ("KAGGLE_KERNEL_RUN_TYPE", "kaggle"), (None, "local")],
)
def test_platform_detection(clean_environment: pytest.MonkeyPatch, variable: str | None, platform: str) -> None:
    offline(clean_environment)
    if variable is not None:
        clean_environment.setenv(variable, "1")
    assert setup().platform == platform


def test_setup_seeds_everything(clean_environment: pytest.MonkeyPatch) -> None:
    offline(clean_environment)
    setup(seed=7)
    first = (random.random(), torch.rand(3))
    setup(seed=7)
    second = (random.random(), torch.rand(3))
    assert first[0] == second[0]
    assert torch.equal(first[1], second[1])
    assert setup(seed=7).seed == 7


def test_setup_sets_the_book_figure_style(clean_environment: pytest.MonkeyPatch) -> None:
    mpl = pytest.importorskip("matplotlib")
    offline(clean_environment)
    mpl.rcParams["axes.spines.top"] = True
    setup()
    assert mpl.rcParams["axes.spines.top"] is False
    assert tuple(mpl.rcParams["figure.figsize"]) == (7.0, 3.5)


def test_dtype_string_matches_the_engine_auto_rule(clean_environment: pytest.MonkeyPatch) -> None:
    from mini_infer.device import resolve_device, resolve_dtype

    offline(clean_environment)
    env = setup()
    device = resolve_device("auto")
    assert env.device == device.type
    assert env.dtype == str(resolve_dtype("auto", device)).removeprefix("torch.")


def test_show_source_is_the_real_source() -> None:
    shown = show_source(notebook_env.choose_model)
    assert repr(shown).startswith("def choose_model(")
    markdown = shown._repr_markdown_()
    assert markdown.startswith("```python\ndef choose_model(") and markdown.endswith("\n```")


def test_show_source_leaves_out_the_student_tracks_markers_and_nothing_else() -> None:
    import inspect

    from mini_infer.kv import block_pool

    real = inspect.getsource(block_pool.num_blocks_for)
    assert "# student: begin chapter 04:" in real and "# student: end" in real
    shown = repr(show_source(block_pool.num_blocks_for))
    assert "# student:" not in shown
    kept = [line for line in real.rstrip("\n").splitlines() if not line.strip().startswith("# student:")]
    assert shown.splitlines() == kept


def test_show_source_fence_outlasts_backticks_in_the_source() -> None:
    shown = notebook_env.SourceCode("x = '````'")
    assert shown._repr_markdown_().startswith("`````python\n")


def test_on_your_own_refuses_the_code_an_answer_must_not_call_by_any_name():
    from mini_infer.bench.serve.metrics import RequestRecord
    from mini_infer.kv import block_pool
    from mini_infer.kv.block_pool import slot_mapping as renamed
    from mini_infer.notebook_env import on_your_own, without
    from mini_infer.server.protocol import CompletionRequest
    from mini_infer.stop_strings import StopStringChecker

    def notebook_helper() -> int:
        return 1

    held = {"helper": notebook_helper}  # a reference no module global knows about
    record = RequestRecord(0, 0.0, 1.0, [0.25, 0.5], output_tokens=3)
    with on_your_own(block_pool.slot_mapping, notebook_helper, RequestRecord.tpot, StopStringChecker.push):
        with pytest.raises(AssertionError, match="slot_mapping would do this exercise"):
            block_pool.slot_for([3, 1], 5, 4)  # calls slot_mapping through the module's global
        with pytest.raises(AssertionError, match="slot_mapping"):
            renamed([3], 0, 1, 4)
        with pytest.raises(AssertionError, match="notebook_helper"):
            held["helper"]()
        with pytest.raises(AssertionError, match="RequestRecord.tpot"):
            _ = record.tpot  # a property
        with pytest.raises(AssertionError, match="StopStringChecker.push"):
            StopStringChecker(["x"]).push("abc")
        assert block_pool.num_blocks_for(5, 4) == 2 and record.itls  # everything else still works
    assert block_pool.slot_for([3, 1], 5, 4) == 5 and held["helper"]() == 1 and record.tpot == 0.375  # all back
    # A classmethod of a library, and a method that calls super() (a closure: replaced in its class).
    with on_your_own(CompletionRequest.model_validate), pytest.raises(AssertionError, match="model_validate"):
        CompletionRequest.model_validate({"model": "m", "prompt": "hi"})
    assert CompletionRequest.model_validate({"model": "m", "prompt": "hi"}).prompt == "hi"

    class Base:
        def size(self) -> int:
            return 1

    class Child(Base):
        def size(self) -> int:
            return super().size() + 1

    with on_your_own(Child.size), pytest.raises(AssertionError, match="Child.size"):
        Child().size()
    assert Child().size() == 2
    answer = without(lambda blocks: block_pool.slot_for(blocks, 0, 4), block_pool.slot_mapping)
    with pytest.raises(AssertionError, match="slot_mapping"):
        answer([3])
    with pytest.raises(TypeError, match="Python functions"), on_your_own(len):
        pass


# --- explore(): a static picture always, live controls where ipywidgets is ----------------------


@pytest.fixture
def pictures(monkeypatch: pytest.MonkeyPatch) -> dict[str, list]:
    """Records what explore() shows: the figures plt.show() would display, and displayed widgets."""
    mpl = pytest.importorskip("matplotlib")
    mpl.use("Agg")
    import IPython.display
    import matplotlib.pyplot as plt

    shown: dict[str, list] = {"figures": [], "displayed": []}

    def show() -> None:
        for number in plt.get_fignums():
            shown["figures"].append(plt.figure(number))
            plt.close(number)

    monkeypatch.setattr(plt, "show", show)
    monkeypatch.setattr(IPython.display, "display", lambda *objects, **kwargs: shown["displayed"].extend(objects))
    return shown


def recording_draw(calls: list):
    def draw(fig, step: int = 0, legend: bool = False) -> None:
        calls.append((type(fig).__name__, step, legend))
        fig.subplots().plot([0, step])

    return draw


def test_explore_shows_the_static_picture_then_controls_that_redraw_it(pictures: dict[str, list]) -> None:
    pytest.importorskip("ipywidgets")
    calls: list = []
    notebook_env.explore(recording_draw(calls), {"step": 3, "legend": True}, figsize=(4.0, 2.0), step=range(12))
    static = pictures["figures"][0]
    assert calls[0] == ("Figure", 3, True), "the static picture comes first, drawn with its state"
    assert tuple(static.get_size_inches()) == (4.0, 2.0)
    (box,) = pictures["displayed"]
    slider, output = box.children
    assert type(slider).__name__ == "IntSlider" and slider.description == "step"
    assert (slider.min, slider.max, slider.value) == (0, 11, 3)
    assert calls[1] == ("Figure", 3, False), "the live figure starts at the static state; only controls are passed"
    slider.value = 7
    assert calls[-1] == ("Figure", 7, False), "moving the control redraws"
    assert type(output).__name__ == "Output"
    pictures["displayed"].clear()

    def draw_from_four(fig, step: int = 4) -> None:
        calls.append(("default", step))

    notebook_env.explore(draw_from_four, {}, step=(0, 9))
    (box,) = pictures["displayed"]
    assert box.children[0].value == 4 and calls[-1] == ("default", 4), "no static value: draw's default"


def test_explore_draws_several_static_states_as_a_grid(pictures: dict[str, list]) -> None:
    calls: list = []
    states = [{"step": s} for s in (1, 2, 3)] + [{"step": 4, "legend": True}]
    notebook_env.explore(recording_draw(calls), states, figsize=(3.0, 2.0), ncols=2, title="four states")
    assert calls == [("SubFigure", 1, False), ("SubFigure", 2, False), ("SubFigure", 3, False), ("SubFigure", 4, True)]
    (grid,) = pictures["figures"]
    assert tuple(grid.get_size_inches()) == (6.0, 4.0), "figsize is one state's size: 2 columns x 2 rows"
    assert grid.get_suptitle() == "four states"
    assert pictures["displayed"] == [], "no controls asked for, none shown"


def test_explore_without_ipywidgets_says_so_in_one_line(
    pictures: dict[str, list], monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "ipywidgets", None)  # import ipywidgets now raises ImportError
    calls: list = []
    notebook_env.explore(recording_draw(calls), {"step": 2}, step=range(5))
    assert calls == [("Figure", 2, False)] and len(pictures["figures"]) == 1, "the static picture is still there"
    assert capsys.readouterr().out.strip() == notebook_env.WIDGETS_MISSING
    assert pictures["displayed"] == []


def test_explore_controls_from_ranges_tuples_and_lists() -> None:
    widgets = pytest.importorskip("ipywidgets")
    control = notebook_env._control
    slider = control(widgets, "temperature", (0.05, 3.0, 0.05), 1.0)
    assert isinstance(slider, widgets.FloatSlider)
    assert (slider.min, slider.max, slider.step, slider.value) == (0.05, 3.0, 0.05, 1.0)
    ints = control(widgets, "top_k", (-1, 20), None)
    assert isinstance(ints, widgets.IntSlider) and (ints.min, ints.max, ints.step) == (-1, 20, 1)
    every_other = control(widgets, "step", range(0, 10, 2), 4)
    assert isinstance(every_other, widgets.IntSlider)
    assert (every_other.max, every_other.step, every_other.value) == (8, 2, 4)
    buttons = control(widgets, "sequence", [("seq 0", 0), ("seq 1", 1)], 1)
    assert isinstance(buttons, widgets.ToggleButtons) and buttons.value == 1 and buttons.description == "sequence"
    assert isinstance(control(widgets, "n", list(range(10)), None), widgets.Dropdown)
    with pytest.raises(ValueError, match="no values"):
        control(widgets, "empty", [], None)
    with pytest.raises(ValueError, match="at least one"):
        notebook_env.explore(lambda fig: None, [])


# --- glue(): the number a cell measured, for the prose beside it ---------------------------------


def test_glue_writes_what_myst_nb_writes_with_or_without_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    import IPython.display

    displayed: list = []
    monkeypatch.setattr(IPython.display, "display", lambda *objects, **kwargs: displayed.append((objects, kwargs)))
    monkeypatch.setitem(sys.modules, "myst_nb", None)  # as on Colab and Kaggle
    notebook_env.glue("speedup", torch.tensor(1.25))  # a 0-d tensor becomes a Python float
    notebook_env.glue("label", "1.1x")
    (bundle,), kwargs = displayed[0]
    assert bundle == {notebook_env.GLUE_PREFIX + "text/plain": "1.25"}
    scrapbook = {"name": "speedup", "mime_prefix": notebook_env.GLUE_PREFIX}
    assert kwargs == {"raw": True, "metadata": {"scrapbook": scrapbook}}
    assert displayed[1][0][0] == {notebook_env.GLUE_PREFIX + "text/plain": "'1.1x'"}
    monkeypatch.delitem(sys.modules, "myst_nb")
    glue_module = pytest.importorskip("myst_nb.ext.glue")
    monkeypatch.setattr(glue_module, "ipy_display", lambda *objects, **kwargs: displayed.append((objects, kwargs)))
    notebook_env.glue("speedup", torch.tensor(1.25))
    notebook_env.glue("label", "1.1x")
    assert displayed[2:] == displayed[:2], "the fallback writes exactly MyST-NB's output"


def test_wheel_addresses_in_the_book_name_this_version() -> None:
    pages = [*(ROOT / "book").glob("*.md"), ROOT / "README.md"]
    found = {
        (page.name, version)
        for page in pages
        for version in re.findall(r"wheels/mini_infer-([^-\s]+)-py3-none-any\.whl", page.read_text(encoding="utf-8"))
    }
    assert found, "the book shows the release wheel's address somewhere (how_to_use.md's nbgrader set-up)"
    stale = sorted(f"{name}: {version}" for name, version in found if version != mini_infer.__version__)
    assert not stale, f"wheel addresses of another version than {mini_infer.__version__}: {stale}"
