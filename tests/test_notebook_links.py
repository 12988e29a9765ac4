"""Links inside the notebooks work where readers open them: Colab, Kaggle and the website.

A notebook opened on Colab or Kaggle is a lone file, so a relative link such as
``../book/setup.md`` or ``05_paged_attention.ipynb`` leads nowhere there. Links inside notebooks
therefore use the website's absolute URLs, ``<html.baseurl>book/setup.html`` (``html.baseurl`` in
``_config.yml``). This test refuses relative links and checks that every link into the website
names a page the book builds from a file that exists; ``tests/test_book_site.py`` checks the same
links, anchors included, in a built site.
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
# [text](target) and [text](target "title"); images ![..](..) included. Targets inside code spans
# are not links, so code spans are removed first.
LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
CODE_SPAN = re.compile(r"`[^`\n]*`")


def site_url() -> str:
    return str(yaml.safe_load((ROOT / "_config.yml").read_text(encoding="utf-8"))["html"]["baseurl"])


def toc_pages() -> set[str]:
    """Every page of _toc.yml, as a path without suffix ('notebooks/05_paged_attention')."""
    pages: set[str] = set()

    def walk(node: object) -> None:
        if isinstance(node, dict):
            for key in ("root", "file"):
                if key in node:
                    pages.add(str(node[key]).removesuffix(".md").removesuffix(".ipynb"))
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(yaml.safe_load((ROOT / "_toc.yml").read_text(encoding="utf-8")))
    return pages


def markdown_links(path: Path) -> list[str]:
    nb = nbformat.read(path, as_version=4)
    text = "\n".join(CODE_SPAN.sub("", cell.source) for cell in nb.cells if cell.cell_type == "markdown")
    return LINK.findall(text)


def problems_of_link(target: str, base: str, pages: set[str]) -> str | None:
    """Why ``target`` would not work on Colab, Kaggle or the website, or None when it does."""
    if target.startswith("#") or target.startswith(("mailto:", "attachment:")):
        return None  # same-notebook anchors and attachments travel with the notebook
    if target.startswith(base):
        page = target[len(base) :].split("#")[0]
        if page in ("", "index.html"):
            return None
        if not page.endswith(".html"):
            return f"{target}: a page of the website ends in .html"
        stem = page.removesuffix(".html")
        if stem not in pages:
            return f"{target}: no page {stem} in _toc.yml"
        if not any((ROOT / f"{stem}{suffix}").is_file() for suffix in (".md", ".ipynb")):
            return f"{target}: neither {stem}.md nor {stem}.ipynb exists"
        return None
    if re.match(r"https?://", target):
        return None  # another website
    return f"{target}: relative links break on Colab and Kaggle; use {base}<page>.html"


def test_problems_of_link_catches_each_kind_of_broken_link() -> None:
    base = "https://example.org/course/"
    pages = {"book/setup", "notebooks/05_paged_attention"}
    assert problems_of_link("../book/setup.md", base, pages) is not None
    assert problems_of_link("05_paged_attention.ipynb#slots", base, pages) is not None
    assert problems_of_link(f"{base}book/nowhere.html", base, pages) is not None
    assert problems_of_link(f"{base}book/setup.md", base, pages) is not None
    assert problems_of_link(f"{base}book/setup.html#gpus", base, pages) is None
    assert problems_of_link("https://arxiv.org/abs/2309.06180", base, pages) is None
    assert problems_of_link("#exercises", base, pages) is None


def test_link_pattern_reads_markdown_links() -> None:
    text = 'See [a](../book/a.md), ![b](img.png "t") and `[c](not-a-link)` plus [d](<x.md>).'
    assert LINK.findall(CODE_SPAN.sub("", text)) == ["../book/a.md", "img.png", "x.md"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_links_work_on_colab_kaggle_and_the_website(path: Path) -> None:
    base, pages = site_url(), toc_pages()
    problems = [p for target in markdown_links(path) if (p := problems_of_link(target, base, pages))]
    assert not problems, f"{path.name}:\n" + "\n".join(problems)


def test_readme_badges_open_the_site_and_chapter_0_from_the_configured_places() -> None:
    config = yaml.safe_load((ROOT / "_config.yml").read_text(encoding="utf-8"))
    repository = str(config["repository"]["url"]).rstrip("/")
    blob = f"{repository}/blob/{config['repository'].get('branch', 'main')}/reader/00_welcome.ipynb"  # no hidden tests
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    links = set(re.findall(r"\]\(([^)\s]+)\)", readme))  # badges nest an image in a link
    assert site_url() in links, "README: the website badge must link html.baseurl"
    assert f"https://colab.research.google.com/github/{blob.removeprefix('https://github.com/')}" in links
    assert f"https://kaggle.com/kernels/welcome?src={blob}" in links
    for image in re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", readme):
        if not image.startswith("http"):
            assert (ROOT / image).is_file(), f"README shows {image}, which does not exist"


# --- reader/: the chapters less their hidden tests, which Colab and Kaggle open ---------------------


def reader_tools() -> tuple[object, object]:
    import importlib
    import sys

    for folder in (ROOT / "book" / "_ext", ROOT / "scripts"):
        if str(folder) not in sys.path:
            sys.path.insert(0, str(folder))
    return importlib.import_module("reader_notebooks"), importlib.import_module("make_reader_versions")


def test_hidden_test_regions_are_removed_whole_lines_and_unclosed_ones_refused() -> None:
    reader_notebooks, _ = reader_tools()
    strip = reader_notebooks.strip_hidden_tests  # type: ignore[attr-defined]
    cell = "assert f(1) == 2\n### BEGIN HIDDEN TESTS\nassert f(3) == 4\n### END HIDDEN TESTS\nprint('ok')"
    assert strip(cell) == "assert f(1) == 2\nprint('ok')"
    assert strip("a = 1\n    ### BEGIN HIDDEN TESTS\n    b = 2\n    ### END HIDDEN TESTS") == "a = 1"
    two = "x\n### BEGIN HIDDEN TESTS\ny\n### END HIDDEN TESTS\nz\n### BEGIN HIDDEN TESTS\nw\n### END HIDDEN TESTS\n"
    assert strip(two) == "x\nz\n"
    with pytest.raises(ValueError, match="not closed"):
        strip("a\n### BEGIN HIDDEN TESTS\nb\n")


def test_nbval_markers_are_removed_whole_lines_and_nothing_else() -> None:
    reader_notebooks, _ = reader_tools()
    strip = reader_notebooks.strip_nbval_markers  # type: ignore[attr-defined]
    assert strip("# NBVAL_CHECK_OUTPUT\nprint(1)") == "print(1)"
    assert (
        strip("# NBVAL_SKIP\nx = 1\n# NBVAL_IGNORE_OUTPUT is a marker\n")
        == "x = 1\n# NBVAL_IGNORE_OUTPUT is a marker\n"
    )
    assert strip("print('# NBVAL_CHECK_OUTPUT')") == "print('# NBVAL_CHECK_OUTPUT')"
    assert strip("x = 1\n# NBVAL_CHECK_OUTPUT") == "x = 1"


def test_reader_copies_are_the_chapters_less_their_hidden_tests() -> None:
    """``reader/`` is current (``python scripts/make_reader_versions.py`` writes it) and carries the
    chapters' solutions and outputs but none of their hidden tests and nbval markers."""
    reader_notebooks, make_reader_versions = reader_tools()
    assert not make_reader_versions.stale_copies(ROOT), make_reader_versions.stale_copies(ROOT)  # type: ignore[attr-defined]
    for path in NOTEBOOKS:
        instructor = nbformat.read(path, as_version=4)
        reader = nbformat.read(ROOT / "reader" / path.name, as_version=4)
        assert [c.cell_type for c in reader.cells] == [c.cell_type for c in instructor.cells], path.name
        assert not any("HIDDEN TESTS" in c.source or "# NBVAL_" in c.source for c in reader.cells), path.name
        for mine, theirs in zip(instructor.cells, reader.cells):
            if "HIDDEN TESTS" not in mine.source:
                mine.source = reader_notebooks.strip_nbval_markers(mine.source)  # type: ignore[attr-defined]
                assert mine == theirs, f"{path.name}: cell {mine.get('id')} differs from the chapter's"
