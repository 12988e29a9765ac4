"""The built website, every page of it, as a browser shows it.

Builds the book into a temporary folder with the same command as ``scripts/build_book.sh``
(``jupyter-book build . -W -n --keep-going``: execution is off, so this takes seconds), then opens
every page of ``_toc.yml`` in headless Chromium, driven by Playwright, and checks what a reader
gets:

* no JavaScript error and no console error on any page;
* every image loaded (a figure that 404s shows as an empty box, which nothing else notices);
* every formula typeset by MathJax (a page whose MathJax fails shows raw ``\\(`` TeX);
* the Colab and Kaggle launch links on every chapter, derived from ``repository.url`` in
  ``_config.yml``, and none on the prose pages; they open the chapter's reader copy in ``reader/``;
* no hidden test (``### BEGIN HIDDEN TESTS`` ... ``### END HIDDEN TESTS``) on a chapter page, in
  its ``.ipynb`` download or in the reader copy its links open, while the tests' visible part
  and the solutions stay (``book/_ext/reader_notebooks.py``; no browser needed);
* a "Student version" line on every chapter with exercises, whose Colab and Kaggle links open
  ``student/<chapter>.ipynb`` and whose download link is the site's copy of it; that notebook (on
  the site and in the repository, where Colab reads it) shows no solution;
* every interactive widget has a static figure in the same cell, because the website has no
  kernel and the widgets' JavaScript comes from a CDN that may not load;
* a screenshot of the top of every page, kept in ``$MINI_INFER_SITE_SCREENSHOTS`` when set (the
  GitHub workflow uploads them as an artifact), and not blank.

The check is hermetic: the pages load from ``file://`` and no request leaves the machine.
MathJax, which the pages load from jsDelivr, is served from the same release's npm package
(downloaded once from the npm registry into ``~/.cache/mini-infer``, or found in
``$MINI_INFER_MATHJAX_DIR``); every other outside request (the widget manager's CDN scripts) is
refused, which is what a reader offline, or behind a strict firewall, gets. Skipped, with the
reason, when no Chromium or no Playwright is installed (``apt-get install chromium``; Playwright
is in the ``dev`` extra).
"""

from __future__ import annotations

import html as html_module
import io
import os
import re
import shutil
import subprocess
import sys
import tarfile
import urllib.request
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nbformat
import pytest
import yaml

from tests.test_student_notebooks import leaked_solutions

ROOT = Path(__file__).resolve().parent.parent
BROWSERS = ["chromium", "chromium-browser", "google-chrome", "google-chrome-stable"]
MATHJAX_CDN = "https://cdn.jsdelivr.net/npm/mathjax@3/"
MATHJAX_NPM = "https://registry.npmjs.org/mathjax/-/mathjax-3.2.2.tgz"
MATHJAX_CACHE = Path.home() / ".cache" / "mini-infer" / "mathjax-3.2.2"
CONTENT_TYPES = {".js": "application/javascript", ".woff": "font/woff", ".json": "application/json"}

pytestmark = pytest.mark.slow


def find_browser() -> str | None:
    for name in BROWSERS:
        found = shutil.which(name)
        if found:
            return found
    return "/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None


def toc_pages() -> list[str]:
    """Every page of the book, as its path without suffix (``notebooks/00_welcome``)."""
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text(encoding="utf-8"))
    pages = [toc["root"]]
    for part in toc.get("parts", []):
        pages += [chapter["file"] for chapter in part.get("chapters", [])]
    return pages


def is_notebook(page: str) -> bool:
    return (ROOT / f"{page}.ipynb").is_file()


def branch() -> str:
    config = yaml.safe_load((ROOT / "_config.yml").read_text(encoding="utf-8"))
    return str(config["repository"].get("branch", "main"))


def reader_path(page: str) -> str:
    """``notebooks/00_x`` -> ``reader/00_x.ipynb``: the chapter less its hidden tests, which readers open."""
    return f"reader/{page.rsplit('/', 1)[-1]}.ipynb"


def launch_links(path_in_repo: str) -> tuple[str, str]:
    """The Colab and Kaggle links that open a notebook of the repository, from _config.yml's repository.url."""
    config = yaml.safe_load((ROOT / "_config.yml").read_text(encoding="utf-8"))
    repository = str(config["repository"]["url"]).rstrip("/")
    colab = str(config["launch_buttons"]["colab_url"]).rstrip("/")
    blob = f"{repository}/blob/{branch()}/{path_in_repo}"
    return (
        f"{colab}/github/{blob.removeprefix('https://github.com/')}",
        f"https://kaggle.com/kernels/welcome?src={blob}",
    )


def expected_links(page: str) -> tuple[str, str]:
    """The "Run this chapter" links of a notebook page: its reader copy in ``reader/``."""
    return launch_links(reader_path(page))


def expected_student_links(page: str) -> tuple[str, str]:
    """The student version's Colab and Kaggle links: ``student/<chapter>.ipynb``."""
    return launch_links(f"student/{page.rsplit('/', 1)[-1]}.ipynb")


def has_exercises(page: str) -> bool:
    cells = nbformat.read(ROOT / f"{page}.ipynb", as_version=4).cells
    return any("nbgrader" in cell.get("metadata", {}) for cell in cells)


def mathjax_dir() -> Path | None:
    """MathJax 3's ``es5`` folder: from $MINI_INFER_MATHJAX_DIR, the cache, or the npm registry."""
    configured = os.environ.get("MINI_INFER_MATHJAX_DIR")
    if configured:
        return Path(configured)
    if (MATHJAX_CACHE / "es5" / "tex-mml-chtml.js").is_file():
        return MATHJAX_CACHE
    try:
        with urllib.request.urlopen(MATHJAX_NPM, timeout=60) as response:
            archive = response.read()
    except OSError:
        return None
    partial = MATHJAX_CACHE.with_name(MATHJAX_CACHE.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        for member in tar.getmembers():
            if member.isfile() and member.name.startswith("package/es5/"):
                target = partial / member.name.removeprefix("package/")
                target.parent.mkdir(parents=True, exist_ok=True)
                source = tar.extractfile(member)
                assert source is not None
                target.write_bytes(source.read())
    shutil.rmtree(MATHJAX_CACHE, ignore_errors=True)
    partial.rename(MATHJAX_CACHE)
    return MATHJAX_CACHE


@dataclass
class PageVisit:
    """What a browser saw while loading one page."""

    page: str
    errors: list[str] = field(default_factory=list)  # uncaught exceptions and console errors
    refused: list[str] = field(default_factory=list)  # outside requests this test refused
    failed: list[str] = field(default_factory=list)  # requests that failed on their own
    facts: dict[str, Any] = field(default_factory=dict)
    screenshot: Path | None = None


# Everything the checks need from a page, read in the page once MathJax is done.
READ_PAGE = """() => {
  const cells = [...document.querySelectorAll('div.cell')];
  const widgetCells = cells.filter(c => c.querySelector('script[type="application/vnd.jupyter.widget-view+json"]'));
  return {
    images: [...document.images].map(i => ({src: i.getAttribute('src'), ok: i.complete && i.naturalWidth > 0})),
    math: document.querySelectorAll('.math').length,
    typeset: document.querySelectorAll('.math mjx-container, mjx-container.MathJax').length,
    rawTex: [...document.querySelectorAll('.math')].filter(m => !m.querySelector('mjx-container')
        && /\\\\\\(|\\\\\\[|\\$\\$/.test(m.textContent)).length,
    mathjaxError: document.querySelectorAll('mjx-merror').length,
    runLine: [...document.querySelectorAll('.mi-run-line:not(.mi-student-line) a')].map(a => a.href),
    studentLine: [...document.querySelectorAll('.mi-student-line a')].map(a => a.href),
    studentLineText: [...document.querySelectorAll('.mi-student-line')].map(p => p.innerText).join(' '),
    launchMenu: [...document.querySelectorAll('.dropdown-launch-buttons a')].map(a => a.href),
    codeCells: document.querySelectorAll('div.cell_input').length,
    outputs: document.querySelectorAll('div.cell_output').length,
    highlighted: document.querySelectorAll('div.cell_input div.highlight').length,
    widgetCells: widgetCells.length,
    widgetCellsWithoutFigure: widgetCells.filter(c => !c.querySelector('.cell_output img')).length,
    // Wide content must scroll (or fit): content wider than its box, with no way to reach it, is cut.
    clipped: [...document.querySelectorAll('article pre, article table, article img')].filter(e => {
      const style = getComputedStyle(e);
      const cut = e.scrollWidth > e.clientWidth + 1 && !['auto', 'scroll'].includes(style.overflowX);
      let outside = false;
      for (let a = e.parentElement; a && a.tagName !== 'ARTICLE'; a = a.parentElement) {
        if (['hidden', 'clip'].includes(getComputedStyle(a).overflowX)
            && e.getBoundingClientRect().right > a.getBoundingClientRect().right + 1) { outside = true; break; }
      }
      return cut || outside;
    }).map(e => e.tagName + ': ' + (e.innerText || e.getAttribute('src') || '').slice(0, 60)),
    scrolling: [...document.querySelectorAll('article pre, article table')].filter(e => e.scrollWidth > e.clientWidth + 1).length,
    figuresTooWide: [...document.querySelectorAll('article img')].filter(i =>
        i.getBoundingClientRect().right > document.querySelector('article').getBoundingClientRect().right + 1).length,
  };
}"""


@pytest.fixture(scope="module")
def built_html(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("book")
    command = [
        sys.executable, "-c", "from jupyter_book.cli.main import main; main()",
        "build", str(ROOT), "--path-output", str(out), "-W", "-n", "--keep-going",
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"book build failed:\n{result.stdout[-5000:]}\n{result.stderr[-5000:]}"
    return out / "_build" / "html"


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    executable = find_browser()
    if executable is None:
        pytest.skip("no Chromium on this machine (apt-get install chromium): the rendered pages are not checked")
    playwright = pytest.importorskip("playwright.sync_api", reason="Playwright is in the dev extra")
    with playwright.sync_playwright() as driver:
        launched = driver.chromium.launch(executable_path=executable, args=["--no-sandbox", "--disable-gpu"])
        yield launched
        launched.close()


@pytest.fixture(scope="module")
def mathjax() -> Path:
    found = mathjax_dir()
    if found is None:
        pytest.skip(f"MathJax could not be fetched from {MATHJAX_NPM} (set MINI_INFER_MATHJAX_DIR to its es5 folder)")
    return found


@pytest.fixture(scope="module")
def visits(built_html: Path, browser: Any, mathjax: Path) -> dict[str, PageVisit]:
    shots_env = os.environ.get("MINI_INFER_SITE_SCREENSHOTS")
    shots = Path(shots_env) if shots_env else built_html.parent / "screenshots"
    shots.mkdir(parents=True, exist_ok=True)
    return {page: visit(browser, built_html, page, mathjax, shots) for page in toc_pages()}


def visit(browser: Any, html: Path, page: str, mathjax: Path, shots: Path) -> PageVisit:
    seen = PageVisit(page)
    context = browser.new_context(viewport={"width": 1280, "height": 1600})

    def route(request_route: Any) -> None:
        url = request_route.request.url
        if url.startswith(MATHJAX_CDN):
            local = mathjax / url.removeprefix(MATHJAX_CDN).split("?")[0]
            if local.is_file():
                content_type = CONTENT_TYPES.get(local.suffix, "application/octet-stream")
                request_route.fulfill(body=local.read_bytes(), content_type=content_type)
                return
        seen.refused.append(url)
        request_route.abort()

    context.route("http*://**/*", route)
    tab = context.new_page()
    tab.on("pageerror", lambda error: seen.errors.append(f"uncaught: {error}"))
    tab.on("console", lambda message: message.type == "error" and seen.errors.append(f"console: {message.text}"))
    tab.on("requestfailed", lambda request: seen.failed.append(request.url))
    tab.goto((html / f"{page}.html").as_uri(), wait_until="load")
    # MathJax typesets after the load event; its startup promise resolves when it is done.
    tab.wait_for_function("() => !window.MathJax || (window.MathJax.startup && window.MathJax.startup.promise)")
    tab.evaluate("() => window.MathJax && window.MathJax.startup ? window.MathJax.startup.promise : null")
    seen.facts = tab.evaluate(READ_PAGE)
    seen.screenshot = shots / f"{page.replace('/', '__')}.png"
    tab.screenshot(path=str(seen.screenshot))
    context.close()
    # A refused outside request shows as a console error too; only those are forgiven.
    refused = set(seen.refused)
    seen.failed = [url for url in seen.failed if url not in refused]
    if seen.refused:
        forgiven = len(seen.refused)
        kept = []
        for error in seen.errors:
            if forgiven and error.startswith("console: Failed to load resource: net::ERR_FAILED"):
                forgiven -= 1
            else:
                kept.append(error)
        seen.errors = kept
    return seen


PAGES = toc_pages()
CHAPTERS = [page for page in PAGES if is_notebook(page)]


def test_every_page_of_the_toc_is_checked() -> None:
    assert len(CHAPTERS) >= 13 and len(PAGES) > len(CHAPTERS), (PAGES, CHAPTERS)


@pytest.mark.parametrize("page", PAGES)
def test_page_loads_without_errors(visits: dict[str, PageVisit], page: str) -> None:
    seen = visits[page]
    assert not seen.errors, f"{page}: errors in the browser console:\n" + "\n".join(seen.errors)
    assert not seen.failed, f"{page}: files of the site that did not load: {seen.failed}"


@pytest.mark.parametrize("page", PAGES)
def test_page_images_load(visits: dict[str, PageVisit], page: str) -> None:
    broken = [image["src"] for image in visits[page].facts["images"] if not image["ok"]]
    assert not broken, f"{page}: images that did not load: {broken}"


@pytest.mark.parametrize("page", PAGES)
def test_page_math_is_typeset(visits: dict[str, PageVisit], page: str) -> None:
    facts = visits[page].facts
    assert facts["rawTex"] == 0, f"{page}: {facts['rawTex']} formulas left as raw TeX"
    assert facts["mathjaxError"] == 0, f"{page}: MathJax could not parse {facts['mathjaxError']} formulas"
    assert facts["typeset"] >= facts["math"], f"{page}: {facts['typeset']} of {facts['math']} formulas typeset"


@pytest.mark.parametrize("page", CHAPTERS)
def test_chapter_has_colab_and_kaggle_links(visits: dict[str, PageVisit], page: str) -> None:
    colab, kaggle = expected_links(page)
    facts = visits[page].facts
    assert colab in facts["runLine"] and kaggle in facts["runLine"], f"{page}: 'Run this chapter' line {facts}"
    assert colab in facts["launchMenu"] and kaggle in facts["launchMenu"], f"{page}: launch menu {facts}"


@pytest.mark.parametrize("page", [page for page in CHAPTERS if has_exercises(page)])
def test_chapter_has_student_version_links(visits: dict[str, PageVisit], built_html: Path, page: str) -> None:
    colab, kaggle = expected_student_links(page)
    facts = visits[page].facts
    assert "Student version" in facts["studentLineText"], f"{page}: no visible 'Student version' line"
    assert colab in facts["studentLine"] and kaggle in facts["studentLine"], f"{page}: student line {facts}"
    assert colab not in facts["runLine"], f"{page}: the 'Run this chapter' line must open the reader copy"
    site_copy = built_html / "student" / f"{page.rsplit('/', 1)[-1]}.ipynb"
    assert site_copy.as_uri() in facts["studentLine"], f"{page}: no download link to {site_copy}"


@pytest.mark.parametrize("page", [page for page in CHAPTERS if has_exercises(page)])
def test_linked_student_notebook_has_no_solutions(built_html: Path, page: str) -> None:
    colab, _ = expected_student_links(page)
    config = yaml.safe_load((ROOT / "_config.yml").read_text(encoding="utf-8"))
    path_in_repo = colab.split(f"/blob/{config['repository'].get('branch', 'main')}/", 1)[1]
    in_repo = ROOT / path_in_repo  # what GitHub serves Colab and Kaggle once this commit is pushed
    on_site = built_html / "student" / Path(path_in_repo).name
    assert on_site.read_bytes() == in_repo.read_bytes(), f"{page}: the site's student notebook differs from {in_repo}"
    instructor = nbformat.read(ROOT / f"{page}.ipynb", as_version=4)
    student = nbformat.read(on_site, as_version=4)
    assert any(c.get("metadata", {}).get("nbgrader", {}).get("grade") for c in student.cells), f"{page}: no exercises"
    assert not leaked_solutions(instructor, student)


@pytest.mark.parametrize("page", [page for page in PAGES if page not in CHAPTERS])
def test_prose_page_has_no_notebook_launch_links(visits: dict[str, PageVisit], page: str) -> None:
    facts = visits[page].facts
    assert not facts["runLine"], f"{page} is not a notebook but has a 'Run this chapter' line"
    assert not facts["studentLine"], f"{page} is not a notebook but has a 'Student version' line"
    assert not any("kaggle.com/kernels" in href for href in facts["launchMenu"])


@pytest.mark.parametrize("page", CHAPTERS)
def test_chapter_shows_code_and_outputs(visits: dict[str, PageVisit], page: str) -> None:
    facts = visits[page].facts
    assert facts["codeCells"] >= 5 and facts["outputs"] >= 4, f"{page}: {facts['codeCells']} cells"
    assert facts["highlighted"] >= facts["codeCells"] // 2, f"{page}: code cells are not syntax-highlighted"
    assert any(image["src"].endswith(".png") for image in facts["images"]), f"{page}: no figure"


@pytest.mark.parametrize("page", PAGES)
def test_wide_listings_tables_and_figures_are_never_cut(visits: dict[str, PageVisit], page: str) -> None:
    """At 1280 px, a listing or table wider than the column scrolls (its overflow is reachable) and
    no figure runs past the column."""
    facts = visits[page].facts
    assert not facts["clipped"], f"{page}: content cut off at 1280 px: {facts['clipped']}"
    assert facts["figuresTooWide"] == 0, f"{page}: {facts['figuresTooWide']} figure(s) wider than the column"


def test_the_clipping_check_sees_wide_listings(visits: dict[str, PageVisit]) -> None:
    """The check above looks at real wide content: the setup listing of every chapter is wider than
    the column, so each chapter has at least one scrolling listing."""
    assert all(visits[page].facts["scrolling"] >= 1 for page in CHAPTERS)


@pytest.mark.parametrize("page", CHAPTERS)
def test_widgets_have_a_static_figure(visits: dict[str, PageVisit], page: str) -> None:
    facts = visits[page].facts
    assert facts["widgetCellsWithoutFigure"] == 0, (
        f"{page}: {facts['widgetCellsWithoutFigure']} of {facts['widgetCells']} widget cells show no static figure;"
        " the website cannot run a widget (see notebook_env.explore)"
    )


@pytest.mark.parametrize("page", PAGES)
def test_page_screenshot_is_not_blank(visits: dict[str, PageVisit], page: str) -> None:
    image_module = pytest.importorskip("PIL.Image")
    shot = visits[page].screenshot
    assert shot is not None and shot.is_file(), f"{page}: no screenshot"
    image = image_module.open(shot).convert("RGB")
    assert image.size == (1280, 1600)
    colours = image.resize((160, 200)).getcolors(maxcolors=1_000_000) or []
    assert len(colours) > 50, f"{page}: the screenshot {shot} is (nearly) blank"


# --- what the built site publishes (no browser needed) --------------------------------------------


def site_url() -> str:
    return str(yaml.safe_load((ROOT / "_config.yml").read_text(encoding="utf-8"))["html"]["baseurl"])


def test_site_publishes_the_wheel_every_first_cell_installs(built_html: Path) -> None:
    import mini_infer
    from mini_infer.notebook_env import release_wheel_name

    wheel = built_html / "wheels" / release_wheel_name(mini_infer.__version__)
    assert wheel.is_file(), f"the site has no {wheel.relative_to(built_html)}: book/_ext/release_wheel.py did not run"
    assert sorted(p.name for p in wheel.parent.iterdir()) == [wheel.name], "exactly one wheel, this version's"
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    assert "mini_infer/__init__.py" in names and "mini_infer/notebook_env.py" in names
    assert any(name.startswith("mini_infer/models/") for name in names), "the wheel must ship the tiny models"


def test_links_into_the_website_resolve_in_the_built_site(built_html: Path) -> None:
    """Every absolute link to the website (notebooks use them, for Colab and Kaggle) names a page
    of this build and, when it has one, an anchor that exists on that page."""
    base = site_url()
    pattern = re.compile(r'href="(' + re.escape(base) + r'[^"]*)"')
    broken = []
    for page in built_html.rglob("*.html"):
        if "_static" in page.parts or "_sources" in page.parts:
            continue
        for url in set(pattern.findall(page.read_text(encoding="utf-8"))):
            path, _, anchor = html_module.unescape(url)[len(base) :].partition("#")
            target = built_html / (path or "index.html")
            if not target.is_file():
                broken.append(f"{page.relative_to(built_html)}: {url} (no {path})")
            elif anchor and f'id="{anchor}"' not in target.read_text(encoding="utf-8"):
                broken.append(f"{page.relative_to(built_html)}: {url} (no id {anchor!r} on {path})")
    assert not broken, "links into the website that do not resolve:\n" + "\n".join(sorted(broken))


# --- hidden tests stay hidden (no browser needed) -------------------------------------------------

HIDDEN_REGION = re.compile(r"### BEGIN HIDDEN TESTS[^\n]*\n(.*?)### END HIDDEN TESTS", re.DOTALL)
TAG = re.compile(r"<[^>]+>")


def hidden_tests(page: str) -> list[str]:
    """The hidden-test regions of a chapter's instructor notebook, each as its lines of code."""
    cells = nbformat.read(ROOT / f"{page}.ipynb", as_version=4).cells
    return [region for cell in cells if cell.cell_type == "code" for region in HIDDEN_REGION.findall(cell.source)]


def page_text(path: Path) -> str:
    """What a page shows, near enough: its HTML without tags, entities decoded (code keeps its lines)."""
    return html_module.unescape(TAG.sub("", path.read_text(encoding="utf-8")))


def test_no_chapter_page_or_notebook_of_the_site_holds_a_hidden_test_marker(built_html: Path) -> None:
    """The markers themselves: on every chapter page and in every notebook the site serves (the
    prose pages that explain nbgrader's conventions name them, and may)."""
    served = [built_html / f"{page}.html" for page in CHAPTERS] + sorted(built_html.rglob("*.ipynb"))
    assert len(served) > 2 * len(CHAPTERS), "the site must serve each chapter's .ipynb download and student version"
    leaks = [str(path.relative_to(built_html)) for path in served if "HIDDEN TESTS" in path.read_text(encoding="utf-8")]
    assert not leaks, f"files of the site that print hidden tests: {leaks}"


@pytest.mark.parametrize("page", CHAPTERS)
def test_chapter_page_shows_its_tests_but_not_the_hidden_ones(built_html: Path, page: str) -> None:
    regions = hidden_tests(page)
    assert regions, f"{page}: no hidden tests in the instructor notebook, so this test checks nothing"
    shown = page_text(built_html / f"{page}.html")
    leaked = [region for region in regions if region.strip() in shown]
    assert not leaked, f"{page}: the page shows {len(leaked)} hidden-test regions, first:\n{leaked[0]}"
    # The visible part of a test cell stays: a reader still sees what is checked in the open.
    cells = nbformat.read(ROOT / f"{page}.ipynb", as_version=4).cells
    visible = [HIDDEN_REGION.split(c.source)[0].strip() for c in cells if "### BEGIN HIDDEN TESTS" in c.source]
    assert any(part and part.splitlines()[-1].strip() in shown for part in visible), f"{page}: test cells not shown"


@pytest.mark.parametrize("page", CHAPTERS)
def test_download_copy_of_a_chapter_has_no_hidden_tests(built_html: Path, page: str) -> None:
    copy = built_html / "_sources" / f"{page}.ipynb"
    assert copy.is_file(), f"{page}: the page's .ipynb download {copy} is missing"
    instructor = nbformat.read(ROOT / f"{page}.ipynb", as_version=4)
    served = nbformat.read(copy, as_version=4)
    assert len(served.cells) == len(instructor.cells)
    assert not any("HIDDEN TESTS" in cell.source for cell in served.cells), f"{page}: {copy} holds hidden tests"
    solutions = [c.source for c in instructor.cells if "### BEGIN SOLUTION" in c.source]
    assert all(any(s == c.source for c in served.cells) for s in solutions), f"{page}: solutions must stay"


@pytest.mark.parametrize("page", CHAPTERS)
def test_launch_links_open_the_reader_copy_without_hidden_tests(built_html: Path, page: str) -> None:
    colab, kaggle = expected_links(page)
    path_in_repo = reader_path(page)
    assert colab.endswith(f"/{path_in_repo}") and kaggle.endswith(f"/{path_in_repo}")
    page_html = html_module.unescape((built_html / f"{page}.html").read_text(encoding="utf-8"))
    for link in (colab, kaggle):  # the run line and the launch menu
        assert page_html.count(f'href="{link}"') >= 2, f"{page}: {link} is not both in the run line and the menu"
    assert f"/blob/{branch()}/{page}.ipynb" not in page_html, f"{page}: a link opens the instructors' copy"
    reader = nbformat.read(ROOT / path_in_repo, as_version=4)  # what GitHub serves Colab and Kaggle
    assert not any("HIDDEN TESTS" in cell.source for cell in reader.cells), f"{path_in_repo} holds hidden tests"
