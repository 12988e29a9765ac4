"""Hidden tests stay hidden: the website, and every notebook it sends a reader to, carry none.

The chapters in ``notebooks/`` are the instructors' copy: a graded test cell may hold, between
``### BEGIN HIDDEN TESTS`` and ``### END HIDDEN TESTS``, checks that nbgrader runs when it grades
but never hands to students. Readers meet a chapter in three places, and none may show them:

* the rendered page: the ``source-read`` hook strips the hidden regions from a notebook's text
  before MyST-NB parses it, so no page, search index or page source shows them;
* the page's download buttons (``.ipynb`` and source), which serve ``<site>/_sources/``: Sphinx
  copies the original file there, so :func:`strip_published_sources` rewrites each copy;
* the Colab and Kaggle links ("Run this chapter", the launch menu, the README's badges, the
  Kaggle kernel of chapter 13): they open ``reader/<chapter>.ipynb`` on GitHub
  (``book/_ext/kaggle_launch.py``), the chapter with its solutions and outputs but without its
  hidden tests. Colab and Kaggle open notebooks from GitHub paths, hence ``reader/`` is committed;
  ``python scripts/make_reader_versions.py`` writes it from ``notebooks/``.

A region is removed as nbgrader's ``ClearHiddenTests`` removes it: from the line of the BEGIN
marker through the line of the END marker. An unclosed region is an error, never a silent leak.
The same three places also leave out nbval's cell markers (``# NBVAL_CHECK_OUTPUT`` and the
others, always a whole line): they tell CI which stored outputs to compare and mean nothing to a
reader.

Invariants the build enforces (a warning, so an error under ``-W``): every chapter page has a
reader copy, and that copy is exactly :func:`reader_version` of the chapter's current file.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import nbformat
from sphinx.application import Sphinx
from sphinx.util import logging

LOGGER = logging.getLogger(__name__)
READER_DIR = "reader"
REGENERATE = "python scripts/make_reader_versions.py"
BEGIN, END = "### BEGIN HIDDEN TESTS", "### END HIDDEN TESTS"
HIDDEN_REGION = re.compile(r"^[^\n]*" + BEGIN + r".*?" + END + r"[^\n]*(\n|$)", re.MULTILINE | re.DOTALL)
NBVAL_MARKER = re.compile(r"^[ \t]*# NBVAL_[A-Z_]+[ \t]*(\n|$)", re.MULTILINE)


def strip_hidden_tests(source: str) -> str:
    """``source`` without its hidden-test regions (whole lines, markers included)."""
    stripped = HIDDEN_REGION.sub("", source)
    if not source.endswith("\n"):  # a region that ended the cell leaves no blank last line
        stripped = stripped.rstrip("\n")
    if BEGIN in stripped or END in stripped:
        raise ValueError(f"a hidden-test region is not closed (or not opened): {BEGIN!r} and {END!r} must pair up")
    return stripped


def strip_nbval_markers(source: str) -> str:
    """``source`` without nbval's marker lines."""
    stripped = NBVAL_MARKER.sub("", source)
    return stripped.rstrip("\n") if not source.endswith("\n") else stripped


def strip_notebook(nb: dict[str, Any]) -> bool:
    """Strip the hidden tests and nbval markers of every code cell of ``nb`` in place; True when
    any were there."""
    changed = False
    for cell in nb.get("cells", []):
        if cell.get("cell_type") != "code":
            continue
        source = cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])
        stripped = strip_nbval_markers(strip_hidden_tests(source))
        if stripped != source:
            cell["source"] = stripped
            changed = True
    return changed


def reader_version(instructor_text: str) -> str:
    """The reader's copy of a chapter, as the text ``reader/`` holds: the chapter less its hidden
    tests and nbval markers."""
    nb = nbformat.reads(instructor_text, as_version=4)
    strip_notebook(nb)
    text = nbformat.writes(nb)
    return text if text.endswith("\n") else text + "\n"  # as nbformat.write ends a file


def reader_path_in_repo(notebook_path_in_repo: str) -> str:
    """``notebooks/00_x.ipynb`` -> ``reader/00_x.ipynb`` (both relative to the repository root)."""
    parts = notebook_path_in_repo.split("/")
    return "/".join([*parts[:-2], READER_DIR, parts[-1]])


def stale_reason(instructor: Path, reader: Path) -> str | None:
    """Why ``reader`` is not the current reader copy of ``instructor``; None when it is."""
    if not reader.is_file():
        return f"{READER_DIR}/{reader.name} is missing"
    if reader.read_text(encoding="utf-8") != reader_version(instructor.read_text(encoding="utf-8")):
        return f"{READER_DIR}/{reader.name} is not {instructor.name} less its hidden tests"
    return None


def strip_page_source(app: Sphinx, docname: str, source: list[str]) -> None:
    """``source-read``: a notebook page is parsed without its hidden tests and nbval markers."""
    if Path(app.env.doc2path(docname)).suffix != ".ipynb":
        return
    nb = json.loads(source[0])
    if strip_notebook(nb):
        source[0] = json.dumps(nb, ensure_ascii=False)


def strip_published_sources(app: Sphinx, exception: Exception | None) -> None:
    """``build-finished``: strip the site's copies of the notebooks, and check ``reader/``."""
    if exception is not None or app.builder.format != "html":
        return
    for copy in sorted((Path(app.outdir) / "_sources").rglob("*.ipynb")):
        nb = json.loads(copy.read_text(encoding="utf-8"))
        if strip_notebook(nb):
            copy.write_text(json.dumps(nb, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    for docname in sorted(app.env.all_docs):  # every page, rewritten in this build or not
        instructor = Path(app.env.doc2path(docname))
        if instructor.suffix != ".ipynb":
            continue
        reason = stale_reason(instructor, Path(app.srcdir) / READER_DIR / instructor.name)
        if reason is not None:
            LOGGER.warning(
                "reader_notebooks: %s: %s; the Colab and Kaggle links open it: run %s and commit %s/",
                docname,
                reason,
                REGENERATE,
                READER_DIR,
                type="reader_notebooks",
            )


def setup(app: Sphinx) -> dict[str, Any]:
    app.connect("source-read", strip_page_source)
    app.connect("build-finished", strip_published_sources)
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}
