#!/usr/bin/env python
"""Write the student version of every chapter, the way ``nbgrader generate_assignment`` does.

    python scripts/make_student_versions.py                    # notebooks/*.ipynb -> student/
    python scripts/make_student_versions.py --out /tmp/release notebooks/00_welcome.ipynb

The notebooks in ``notebooks/`` are the instructor versions. A student version has

* every region between ``### BEGIN SOLUTION`` and ``### END SOLUTION`` replaced by
  ``# YOUR CODE HERE`` / ``raise NotImplementedError()`` (``YOUR ANSWER HERE`` in Markdown);
* every region between ``### BEGIN HIDDEN TESTS`` and ``### END HIDDEN TESTS`` removed;
* all outputs cleared, graded and read-only cells locked, and nbgrader's checksums recorded.

It runs nbgrader's own preprocessors (``LockCells``, ``ClearSolutions``, ``ClearOutput``,
``ClearHiddenTests``, ``ClearMarkScheme``, ``ComputeChecksums``, ``CheckCellMetadata``) through an
nbconvert exporter, so no nbgrader course folder or database is needed. nbgrader's own pipeline
also saves the cells to its database; a course that grades with nbgrader runs
``nbgrader generate_assignment`` on these same notebooks (see book/how_to_use.md).

``scripts/check_student_versions.py`` imports ``student_version`` from here.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import nbformat
from nbconvert.exporters import NotebookExporter
from nbformat import NotebookNode
from nbgrader.preprocessors import (
    CheckCellMetadata,
    ClearHiddenTests,
    ClearMarkScheme,
    ClearOutput,
    ClearSolutions,
    ComputeChecksums,
    LockCells,
)
from traitlets.config import Config

sys.path.insert(0, str(Path(__file__).resolve().parent))
from execute_notebooks import ROOT, find_notebooks  # noqa: E402

# nbgrader generate_assignment's order, less the steps that need a course (header/footer files,
# the database). The checksums must be computed after the hidden tests are gone.
PREPROCESSORS = [
    LockCells,
    ClearSolutions,
    ClearOutput,
    CheckCellMetadata,
    ClearHiddenTests,
    ClearMarkScheme,
    ComputeChecksums,
    CheckCellMetadata,
]


def nbgrader_metadata(cell: NotebookNode) -> dict:
    return dict(cell.get("metadata", {}).get("nbgrader", {}))


def graded_cells(nb: NotebookNode) -> list[tuple[int, NotebookNode]]:
    """(index, cell) of every autograded test cell of a notebook."""
    return [(i, cell) for i, cell in enumerate(nb.cells) if nbgrader_metadata(cell).get("grade")]


def has_exercises(nb: NotebookNode) -> bool:
    return any(nbgrader_metadata(cell) for cell in nb.cells)


def student_version(nb: NotebookNode) -> NotebookNode:
    """The student version of an instructor notebook (a new notebook; ``nb`` is left alone)."""
    exporter = NotebookExporter(config=Config())
    for preprocessor in PREPROCESSORS:
        exporter.register_preprocessor(preprocessor(), enabled=True)
    body, _ = exporter.from_notebook_node(nb)  # works on a deep copy
    student = nbformat.reads(body, as_version=4)
    leaked = [
        marker
        for cell in student.cells
        for marker in ("BEGIN SOLUTION", "END SOLUTION", "BEGIN HIDDEN TESTS", "END HIDDEN TESTS")
        if marker in cell.source
    ]
    if leaked:
        raise RuntimeError(f"student version still contains {sorted(set(leaked))}")
    return student


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", help="notebooks or folders (default: notebooks/)")
    parser.add_argument("--out", type=Path, default=ROOT / "student", help="output folder (default: student/)")
    args = parser.parse_args(argv)

    args.out.mkdir(parents=True, exist_ok=True)
    for path in find_notebooks(args.paths):
        nb = nbformat.read(path, as_version=4)
        student = student_version(nb)
        target = args.out / path.name
        nbformat.write(student, target)
        exercises = len(graded_cells(nb))
        points = sum(float(nbgrader_metadata(c).get("points", 0)) for _, c in graded_cells(nb))
        note = f"{exercises} graded cells, {points:g} points" if exercises else "no exercises"
        print(f"{path.name} -> {target} ({note})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
