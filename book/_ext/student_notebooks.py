"""Student versions of the chapters, published with the website, with their own Colab and Kaggle links.

A chapter page's "Run this chapter" links (``kaggle_launch.py``) open the chapter's reader copy,
solutions included (hidden tests left out: ``reader_notebooks.py``). Under them this extension
adds a "Student version" line whose Colab and Kaggle links open ``student/<chapter>.ipynb`` on
GitHub instead: the same chapter as ``nbgrader generate_assignment`` releases it (solutions replaced by ``raise
NotImplementedError()``, hidden tests removed, outputs cleared), so a student sent there never
sees a solution. Colab and Kaggle open notebooks from GitHub paths and the website is deployed
without a branch, hence ``student/`` is committed; ``scripts/make_student_versions.py`` writes it.
The line's third link downloads the same file from the website, which publishes it under
``<site>/student/``.

Invariants the build enforces (a warning, so an error under ``-W``):

* every chapter page with nbgrader cells has a student version in ``student/``;
* that version was generated from the chapter's current cells: its metadata records the
  fingerprint of the instructor notebook (:func:`instructor_fingerprint`: cells and notebook
  metadata, not outputs), and a chapter edited since makes the build fail, naming the command to
  run, rather than publish a student version of another chapter.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

from docutils import nodes
from sphinx.application import Sphinx
from sphinx.util import logging
from sphinx.util.osutil import relative_uri

LOGGER = logging.getLogger(__name__)
STUDENT_DIR = "student"
STAMP_KEY = "mini_infer_student_version"
REGENERATE = "python scripts/make_student_versions.py"


def instructor_fingerprint(nb: dict[str, Any]) -> str:
    """SHA-256 of what a student version is made from: every cell less its outputs, and the metadata."""
    cells = [{k: v for k, v in cell.items() if k not in ("outputs", "execution_count")} for cell in nb["cells"]]
    payload = {"cells": cells, "metadata": nb.get("metadata", {}), "nbformat": [nb["nbformat"], nb["nbformat_minor"]]}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, ensure_ascii=False).encode("utf-8")).hexdigest()


def has_exercises(nb: dict[str, Any]) -> bool:
    return any("nbgrader" in cell.get("metadata", {}) for cell in nb["cells"])


def stale_reason(instructor: Path, student: Path) -> str | None:
    """Why ``student`` is not the current student version of ``instructor``; None when it is."""
    if not student.is_file():
        return f"{student.name} is missing"
    stamp = json.loads(student.read_text(encoding="utf-8")).get("metadata", {}).get(STAMP_KEY)
    if not isinstance(stamp, dict):
        return f"{student.name} has no {STAMP_KEY} metadata: it was not written by {REGENERATE}"
    fingerprint = instructor_fingerprint(json.loads(instructor.read_text(encoding="utf-8")))
    if stamp.get("instructor_fingerprint") != fingerprint:
        return f"{student.name} was generated from an older {instructor.name}"
    return None


def student_version_of(app: Sphinx, docname: str) -> tuple[Path | None, str | None]:
    """(the chapter's student notebook, why it cannot be published): (None, None) for a page
    that needs none (not a notebook, or no exercises), (path, None) for a current one."""
    instructor = Path(app.env.doc2path(docname))
    if instructor.suffix != ".ipynb" or not has_exercises(json.loads(instructor.read_text(encoding="utf-8"))):
        return None, None
    student = Path(app.srcdir) / STUDENT_DIR / instructor.name
    reason = stale_reason(instructor, student)
    return (None, reason) if reason is not None else (student, None)


def student_path_in_repo(notebook_path_in_repo: str) -> str:
    """``notebooks/00_x.ipynb`` -> ``student/00_x.ipynb`` (both relative to the repository root)."""
    parts = notebook_path_in_repo.split("/")
    return "/".join([*parts[:-2], STUDENT_DIR, parts[-1]])


def add_student_line(app: Sphinx, doctree: nodes.document, docname: str) -> None:
    """Insert the "Student version" line after the "Run this chapter" line of a chapter page."""
    from kaggle_launch import (
        launch_urls,
        notebook_path_in_repo,
        run_line_links,
        theme_options,
        title_section,
        warn_not_github,
    )

    student, _ = student_version_of(app, docname)
    if student is None:  # none needed, or a stale one, which publish() reports once per build
        return
    path_in_repo = student_path_in_repo(str(notebook_path_in_repo(app, docname)))
    links = launch_urls(theme_options(app), path_in_repo)
    if links is None:
        warn_not_github()
        return
    section = title_section(doctree)
    if section is None:
        return
    here = app.builder.get_target_uri(docname)
    download = relative_uri(here, f"{STUDENT_DIR}/{student.name}")
    line = (
        '<p class="mi-run-line mi-student-line">'
        '<span class="mi-run-label">Student version (exercises without solutions):</span>'
        + run_line_links(here, *links)
        + f'<a class="mi-run-link mi-download" href="{download}" download>'
        f'<i class="fas fa-download" aria-hidden="true"></i> {student.name}</a></p>'
    )
    # Right after kaggle_launch's "Run this chapter" line, which sits right under the title.
    after = 1
    for index, child in enumerate(section.children):
        if isinstance(child, nodes.raw) and 'class="mi-run-line"' in child.astext():
            after = index + 1
    section.insert(after, nodes.raw("", line, format="html"))


def publish(app: Sphinx, exception: Exception | None) -> None:
    """Copy the current student version of every chapter page into ``<site>/student/``."""
    if exception is not None or app.builder.format != "html":
        return
    out = Path(app.outdir) / STUDENT_DIR
    shutil.rmtree(out, ignore_errors=True)  # only this build's chapters, never a removed one's
    out.mkdir(parents=True)
    published = 0
    for docname in sorted(app.env.all_docs):
        # Every page, written in this build or not: an incremental build rewrites only changed
        # pages, but a stale student version must fail every build until it is regenerated.
        student, reason = student_version_of(app, docname)
        if reason is not None:
            LOGGER.warning(
                "student_notebooks: %s has no current student version (%s): run %s and commit student/",
                docname,
                reason,
                REGENERATE,
                type="student_notebooks",
            )
        if student is not None:
            shutil.copyfile(student, out / student.name)
            published += 1
    LOGGER.info("student_notebooks: %d student notebooks in %s", published, out)


def setup(app: Sphinx) -> dict[str, Any]:
    app.setup_extension("kaggle_launch")
    app.connect("doctree-resolved", add_student_line, priority=600)  # after kaggle_launch's run line
    app.connect("build-finished", publish)
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}
