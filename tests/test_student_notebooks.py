"""The committed student versions (``student/``) and the links that open them.

``scripts/make_student_versions.py`` writes ``student/<chapter>.ipynb`` with ``nbgrader
generate_assignment``; ``book/_ext/student_notebooks.py`` publishes them with the website and
puts a "Student version" line, with Colab and Kaggle links to their GitHub paths, on every
chapter page. Checked here without building the site (``tests/test_book_site.py`` checks the
built pages): the links, that every chapter with exercises has a current student version, that
no student version shows a solution or a hidden test, and (slow) that regenerating them with
nbgrader gives the committed files byte for byte.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import nbformat
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "book" / "_ext"))
from kaggle_launch import launch_urls  # noqa: E402
from student_notebooks import instructor_fingerprint, stale_reason, student_path_in_repo  # noqa: E402

STUDENT = ROOT / "student"
REGION = re.compile(r"### BEGIN (SOLUTION|HIDDEN TESTS)\n(.*?)### END \1", re.DOTALL)


def chapters_with_exercises() -> list[Path]:
    return [
        path
        for path in sorted((ROOT / "notebooks").glob("*.ipynb"))
        if any("nbgrader" in cell.get("metadata", {}) for cell in json.loads(path.read_text("utf-8"))["cells"])
    ]


def theme_options() -> dict:
    """What Jupyter Book hands the theme from _config.yml (the keys the launch links read)."""
    config = yaml.safe_load((ROOT / "_config.yml").read_text(encoding="utf-8"))
    return {
        "repository_url": config["repository"]["url"],
        "repository_branch": config["repository"].get("branch", "main"),
        "path_to_docs": config["repository"].get("path_to_book", ""),
        "launch_buttons": config["launch_buttons"],
    }


def leaked_solutions(instructor: nbformat.NotebookNode, student: nbformat.NotebookNode) -> list[str]:
    """What a student version shows of the instructor's solutions and hidden tests (empty: nothing)."""
    leaks = []
    student_cells = {cell.get("id"): cell for cell in student.cells}
    for cell in instructor.cells:
        shown = student_cells.get(cell.get("id"))
        if shown is None:
            continue
        # A line of a solution or hidden test that the rest of the cell does not also have (a
        # `with on_your_own(...)` both visible and hidden tests use is no leak).
        visible = {line.strip() for line in REGION.sub("", cell.source).splitlines()}
        shown_lines = {line.strip() for line in shown.source.splitlines()}
        for kind, body in REGION.findall(cell.source):
            lines = {line.strip() for line in body.splitlines() if len(line.strip()) > 3} - visible
            leaks += [f"cell {cell.get('id')}: {kind} line {line!r}" for line in sorted(lines & shown_lines)]
        nbgrader = cell.get("metadata", {}).get("nbgrader", {})
        if nbgrader.get("solution") and cell.cell_type == "code" and "raise NotImplementedError()" not in shown.source:
            leaks.append(f"cell {cell.get('id')}: solution cell without raise NotImplementedError()")
    for cell in student.cells:
        leaks += [f"cell {cell.get('id')}: marker {m}" for m in ("BEGIN SOLUTION", "HIDDEN TESTS") if m in cell.source]
        if cell.cell_type == "code" and cell.get("outputs"):
            leaks.append(f"cell {cell.get('id')}: stored outputs (the instructor's results)")
    return leaks


def test_student_links_open_the_student_notebook_on_github() -> None:
    options = theme_options()
    path = student_path_in_repo("notebooks/00_welcome.ipynb")
    assert path == "student/00_welcome.ipynb"
    colab, kaggle = launch_urls(options, path) or (None, None)
    repository = options["repository_url"].rstrip("/")
    blob = f"{repository}/blob/{options['repository_branch']}/student/00_welcome.ipynb"
    colab_base = options["launch_buttons"]["colab_url"].rstrip("/")
    assert colab == f"{colab_base}/github/{blob.removeprefix('https://github.com/')}"
    assert kaggle == f"https://kaggle.com/kernels/welcome?src={blob}"
    # the instructor's links (kaggle_launch) differ only in the folder
    assert launch_urls(options, "notebooks/00_welcome.ipynb") == (
        colab.replace("/student/", "/notebooks/"),
        kaggle.replace("/student/", "/notebooks/"),
    )


def test_student_links_follow_the_book_folder_and_refuse_other_hosts() -> None:
    assert student_path_in_repo("course/notebooks/03_kv_cache.ipynb") == "course/student/03_kv_cache.ipynb"
    options = dict(theme_options(), repository_url="https://gitlab.com/mini-infer/mini-infer")
    assert launch_urls(options, "student/00_welcome.ipynb") is None


def test_every_chapter_with_exercises_has_a_current_student_version() -> None:
    chapters = chapters_with_exercises()
    assert len(chapters) >= 13
    problems = [reason for path in chapters if (reason := stale_reason(path, STUDENT / path.name))]
    assert not problems, "run python scripts/make_student_versions.py:\n" + "\n".join(problems)
    orphans = sorted({p.name for p in STUDENT.glob("*.ipynb")} - {p.name for p in chapters})
    assert not orphans, f"student versions without a chapter: {orphans}"


@pytest.mark.parametrize("chapter", [p.name for p in chapters_with_exercises()])
def test_student_version_shows_no_solution(chapter: str) -> None:
    instructor = nbformat.read(ROOT / "notebooks" / chapter, as_version=4)
    student = nbformat.read(STUDENT / chapter, as_version=4)
    assert not leaked_solutions(instructor, student)
    graded = [c for c in student.cells if c.get("metadata", {}).get("nbgrader", {}).get("grade")]
    assert graded and all(c.metadata.nbgrader.get("locked") and c.metadata.nbgrader.get("checksum") for c in graded)


def test_leak_check_catches_a_leaked_solution() -> None:
    """The check above is not vacuous: the instructor notebook itself, as a 'student version', fails it."""
    instructor = nbformat.read(ROOT / "notebooks" / "00_welcome.ipynb", as_version=4)
    leaks = leaked_solutions(instructor, instructor)
    assert any("SOLUTION line" in leak for leak in leaks) and any("marker" in leak for leak in leaks)


def test_fingerprint_follows_cells_not_outputs(tmp_path: Path) -> None:
    source = ROOT / "notebooks" / "00_welcome.ipynb"
    nb = json.loads(source.read_text(encoding="utf-8"))
    fingerprint = instructor_fingerprint(nb)
    code = next(cell for cell in nb["cells"] if cell["cell_type"] == "code")
    code["outputs"], code["execution_count"] = [], None  # re-executed: the same student version
    assert instructor_fingerprint(nb) == fingerprint
    code["source"] = "print('edited')"
    assert instructor_fingerprint(nb) != fingerprint
    edited = tmp_path / source.name
    edited.write_text(json.dumps(nb), encoding="utf-8")
    reason = stale_reason(edited, STUDENT / source.name)
    assert reason is not None and "older" in reason
    assert "missing" in str(stale_reason(source, tmp_path / "absent.ipynb"))


@pytest.mark.slow
def test_regenerating_with_nbgrader_gives_the_committed_files(capsys: pytest.CaptureFixture[str]) -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    from make_student_versions import main

    assert main(["--check"]) == 0, capsys.readouterr().out


@pytest.mark.slow
def test_check_names_a_stale_student_version(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    from make_student_versions import main

    shutil.copyfile(STUDENT / "00_welcome.ipynb", tmp_path / "00_welcome.ipynb")
    edited = nbformat.read(tmp_path / "00_welcome.ipynb", as_version=4)
    edited.cells[0].source += " (edited by hand)"
    nbformat.write(edited, tmp_path / "00_welcome.ipynb")
    assert main(["--check", "--out", str(tmp_path), str(ROOT / "notebooks" / "00_welcome.ipynb")]) == 1
    assert "00_welcome.ipynb: missing or stale" in capsys.readouterr().out
