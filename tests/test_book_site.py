"""The built website, as a browser shows it.

Builds the book into a temporary folder with the same command as ``scripts/build_book.sh``
(``jupyter-book build . -W -n --keep-going``: execution is off, so this takes seconds), then
loads the chapter-0 page in headless Chromium and checks what a reader sees: code cells, their
stored outputs, the matplotlib figure as an image, and the Colab and Kaggle links, all derived
from ``repository.url`` in ``_config.yml``. Skipped, with the reason, when no Chromium is
installed (``apt-get install chromium``).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
PAGE = "notebooks/00_welcome"
BROWSERS = ["chromium", "chromium-browser", "google-chrome", "google-chrome-stable"]
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
]
VOID_TAGS = {
    "area",
    "base",
    "br",
    "col",
    "embed",
    "hr",
    "img",
    "input",
    "link",
    "meta",
    "source",
    "track",
    "wbr",
}

pytestmark = pytest.mark.slow


def find_browser() -> str | None:
    for name in BROWSERS:
        found = shutil.which(name)
        if found:
            return found
    return "/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None


def expected_links() -> tuple[str, str]:
    config = yaml.safe_load((ROOT / "_config.yml").read_text(encoding="utf-8"))
    repository = str(config["repository"]["url"]).rstrip("/")
    branch = config["repository"].get("branch", "main")
    colab = str(config["launch_buttons"]["colab_url"]).rstrip("/")
    blob = f"{repository}/blob/{branch}/{PAGE}.ipynb"
    return (
        f"{colab}/github/{blob.removeprefix('https://github.com/')}",
        f"https://kaggle.com/kernels/welcome?src={blob}",
    )


class Element:
    def __init__(self, tag: str, attrs: dict[str, str], ancestors: list[Element]) -> None:
        self.tag, self.attrs, self.ancestors = tag, attrs, ancestors

    @property
    def classes(self) -> set[str]:
        return set(self.attrs.get("class", "").split())

    def inside(self, css_class: str) -> bool:
        return any(css_class in a.classes for a in self.ancestors)


class Dom(HTMLParser):
    """Just enough of a DOM: every element with its attributes and its ancestors."""

    def __init__(self, html: str) -> None:
        super().__init__()
        self.elements: list[Element] = []
        self._stack: list[Element] = []
        self.feed(html)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        element = Element(tag, {k: v or "" for k, v in attrs}, list(self._stack))
        self.elements.append(element)
        if tag not in VOID_TAGS:
            self._stack.append(element)

    def handle_endtag(self, tag: str) -> None:
        for depth in range(len(self._stack) - 1, -1, -1):
            if self._stack[depth].tag == tag:
                del self._stack[depth:]
                break

    def find(self, tag: str | None = None, css_class: str | None = None) -> list[Element]:
        return [
            e for e in self.elements if (tag is None or e.tag == tag) and (css_class is None or css_class in e.classes)
        ]


@pytest.fixture(scope="module")
def built_html(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("book")
    command = [
        sys.executable, "-c", "from jupyter_book.cli.main import main; main()",
        "build", str(ROOT), "--path-output", str(out), "-W", "-n", "--keep-going",
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"book build failed:\n{result.stdout[-5000:]}\n{result.stderr[-5000:]}"
    html = out / "_build" / "html"
    assert (html / f"{PAGE}.html").is_file()
    return html


@pytest.fixture(scope="module")
def browser() -> str:
    found = find_browser()
    if found is None:
        pytest.skip("no Chromium on this machine (apt-get install chromium): the rendered page is not checked")
    return found


def run_browser(browser: str, profile: Path, *args: str) -> subprocess.CompletedProcess[str]:
    command = [browser, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=180)


@pytest.fixture(scope="module")
def rendered_dom(built_html: Path, browser: str, tmp_path_factory: pytest.TempPathFactory) -> Dom:
    profile = tmp_path_factory.mktemp("chromium-profile")
    result = run_browser(browser, profile, "--dump-dom", (built_html / f"{PAGE}.html").as_uri())
    assert result.returncode == 0 and "<html" in result.stdout, f"Chromium failed:\n{result.stderr[-3000:]}"
    return Dom(result.stdout)


def test_page_shows_code_cells_and_their_outputs(rendered_dom: Dom) -> None:
    inputs = rendered_dom.find("div", "cell_input")
    outputs = rendered_dom.find("div", "cell_output")
    assert len(inputs) >= 5, f"expected the chapter's code cells, found {len(inputs)}"
    assert len(outputs) >= 4, f"expected stored outputs, found {len(outputs)}"
    highlighted = [e for e in rendered_dom.find("div", "highlight") if e.inside("cell_input")]
    assert highlighted, "code cells are not syntax-highlighted"


def test_page_shows_the_matplotlib_figure(rendered_dom: Dom, built_html: Path) -> None:
    page_dir = (built_html / PAGE).parent
    figures = [
        e for e in rendered_dom.find("img") if e.inside("cell_output") and e.attrs.get("src", "").endswith(".png")
    ]
    assert figures, "no <img> of a notebook figure inside a cell output"
    for figure in figures:
        src = figure.attrs["src"]
        target = Path(src.removeprefix("file://")) if src.startswith("file://") else page_dir / src
        assert target.is_file() and target.stat().st_size > 5_000, f"figure {src} is missing or empty"


def test_page_has_colab_and_kaggle_links(rendered_dom: Dom) -> None:
    colab, kaggle = expected_links()
    hrefs = [e for e in rendered_dom.find("a") if e.attrs.get("href") in {colab, kaggle}]
    assert any(e.attrs["href"] == colab for e in hrefs), f"no Colab link {colab}"
    kaggle_links = [e for e in hrefs if e.attrs["href"] == kaggle]
    assert any(e.inside("dropdown-launch-buttons") for e in kaggle_links), "Kaggle missing from the launch menu"
    assert any(e.inside("mi-run-line") for e in kaggle_links), "Kaggle missing from the 'Run this chapter' line"
    assert any(e.inside("mi-run-line") for e in hrefs if e.attrs["href"] == colab)


def test_prose_pages_have_no_notebook_launch_links(built_html: Path) -> None:
    intro = (built_html / "book" / "intro.html").read_text(encoding="utf-8")
    assert "kaggle.com/kernels/welcome" not in intro
    assert "mi-run-line" not in intro


def test_screenshot_of_the_page(built_html: Path, browser: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    shots = tmp_path_factory.mktemp("screenshots")
    png = shots / "00_welcome.png"
    result = run_browser(
        browser,
        shots / "profile",
        f"--screenshot={png}",
        "--window-size=1280,2400",
        (built_html / f"{PAGE}.html").as_uri(),
    )
    assert result.returncode == 0 and png.is_file(), f"no screenshot:\n{result.stderr[-3000:]}"
    image = pytest.importorskip("PIL.Image").open(png).convert("RGB")
    assert image.size == (1280, 2400)
    colours = image.resize((160, 300)).getcolors(maxcolors=1_000_000) or []
    assert len(colours) > 50, "the screenshot is (nearly) blank"
    print(f"screenshot: {png}")
