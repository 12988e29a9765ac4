"""The syllabus page (book/syllabus.md) lists every chapter once, with its real exercise count.

The exercise column is what a reader plans with and an instructor grades by, so it must follow
the notebooks: each row's graded cells and points are counted from the notebook's nbgrader
metadata, and every chapter of ``_toc.yml`` has exactly one row linking its notebook.
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
SYLLABUS = ROOT / "book" / "syllabus.md"
ROW = re.compile(
    r"^\| (\w+) \| \[[^\]]+\]\(\.\./(notebooks/[\w.]+\.ipynb)\) \| ([\d.]+) \| ([^|]+) \| (\d+) \((\d+)\) \|$"
)


def rows() -> dict[str, tuple[str, ...]]:
    found: dict[str, tuple[str, ...]] = {}
    for line in SYLLABUS.read_text(encoding="utf-8").splitlines():
        match = ROW.match(line)
        if match:
            number, notebook, hours, runs_on, cells, points = match.groups()
            assert notebook not in found, f"syllabus: {notebook} has two rows"
            found[notebook] = (number, hours, runs_on.strip(), cells, points)
    return found


def toc_notebooks() -> list[str]:
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text(encoding="utf-8"))
    files = [chapter["file"] for part in toc["parts"] for chapter in part["chapters"]]
    return [f"{file}.ipynb" for file in files if (ROOT / f"{file}.ipynb").is_file()]


def graded(notebook: str) -> tuple[int, int]:
    nb = nbformat.read(ROOT / notebook, as_version=4)
    cells = [cell.metadata.get("nbgrader", {}) for cell in nb.cells]
    graded_cells = [meta for meta in cells if meta.get("grade")]
    return len(graded_cells), sum(int(meta.get("points", 0)) for meta in graded_cells)


def test_every_chapter_has_one_row_and_no_row_names_another_file() -> None:
    assert set(rows()) == set(toc_notebooks())


@pytest.mark.parametrize("notebook", toc_notebooks())
def test_exercise_column_counts_the_notebooks_graded_cells(notebook: str) -> None:
    number, hours, runs_on, cells, points = rows()[notebook]
    assert (int(cells), int(points)) == graded(notebook), (
        f"syllabus row {number}: says {cells} ({points}) exercises, the notebook has {graded(notebook)}"
    )
    assert 0 < float(hours) <= 8 and runs_on, f"syllabus row {number}: a time in hours and what it runs on"
