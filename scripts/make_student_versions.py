#!/usr/bin/env python
"""Write the student version of every chapter with ``nbgrader generate_assignment``, for real.

    python scripts/make_student_versions.py                    # notebooks/*.ipynb -> student/
    python scripts/make_student_versions.py --check            # change nothing; fail if student/ is stale
    python scripts/make_student_versions.py --out /tmp/release notebooks/00_welcome.ipynb

The notebooks in ``notebooks/`` are the instructor versions. A student version has

* every region between ``### BEGIN SOLUTION`` and ``### END SOLUTION`` replaced by
  ``# YOUR CODE HERE`` / ``raise NotImplementedError()`` (``YOUR ANSWER HERE`` in Markdown);
* every region between ``### BEGIN HIDDEN TESTS`` and ``### END HIDDEN TESTS`` removed;
* all outputs cleared, graded and read-only cells locked, and nbgrader's checksums recorded.

How: a temporary nbgrader course folder, built from the repository: the repository's
``nbgrader_config.py``, one assignment per chapter (``source/ch00/00_welcome.ipynb``, ``ch09b``,
``chA1``: :func:`assignment_name`), its own sqlite gradebook; then ``nbgrader generate_assignment``
in a subprocess, exactly as an instructor runs it, and its ``release/`` folder is the result. The
user's own Jupyter configuration is kept out (``JUPYTER_CONFIG_DIR`` points into the course), so
the output depends on this repository only.

``student/`` is committed: Colab and Kaggle open notebooks from GitHub paths, and the website's
"Student version" links (``book/_ext/student_notebooks.py``) point there. Each file records which
instructor notebook it came from and a fingerprint of that notebook's cells
(``student_notebooks.instructor_fingerprint``): the book build refuses a stale one, and
``--check`` (run by ``tests/test_student_notebooks.py``) regenerates every version and requires
the committed files to be identical. After changing a chapter's cells, run this script.

``scripts/check_student_versions.py`` imports ``student_version`` from here.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import nbformat
from nbformat import NotebookNode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from execute_notebooks import ROOT, find_notebooks  # noqa: E402

sys.path.insert(0, str(ROOT / "book" / "_ext"))
from student_notebooks import STAMP_KEY, instructor_fingerprint  # noqa: E402

CONFIG_FILE = ROOT / "nbgrader_config.py"
STUDENT_DIR = ROOT / "student"
COURSE_ID = "mini-infer"
MARKERS = ("BEGIN SOLUTION", "END SOLUTION", "BEGIN HIDDEN TESTS", "END HIDDEN TESTS")


def nbgrader_metadata(cell: NotebookNode) -> dict:
    return dict(cell.get("metadata", {}).get("nbgrader", {}))


def graded_cells(nb: NotebookNode) -> list[tuple[int, NotebookNode]]:
    """(index, cell) of every autograded test cell of a notebook."""
    return [(i, cell) for i, cell in enumerate(nb.cells) if nbgrader_metadata(cell).get("grade")]


def has_exercises(nb: NotebookNode) -> bool:
    return any(nbgrader_metadata(cell) for cell in nb.cells)


def assignment_name(notebook: Path) -> str:
    """The nbgrader assignment of a chapter: ``ch`` and the chapter's number (``09b_x`` -> ``ch09b``)."""
    match = re.fullmatch(r"([0-9A-Z][0-9a-z]*)_\w+", notebook.stem)
    if match is None:
        raise ValueError(f"{notebook.name}: a chapter is named NN_topic.ipynb (book/contributing.md); rename it")
    return "ch" + match.group(1)


def generate_assignments(notebooks: Sequence[Path], course: Path) -> dict[Path, Path]:
    """Run ``nbgrader generate_assignment`` in a new course folder ``course`` holding ``notebooks``.

    Returns each instructor notebook's student version in ``course/release/<assignment>/``.
    """
    if course.exists() and any(course.iterdir()):
        raise FileExistsError(f"{course} is not empty: give generate_assignments a new folder")
    names: dict[str, Path] = {}
    for notebook in notebooks:
        name = assignment_name(notebook)
        if name in names:
            raise ValueError(f"{notebook.name} and {names[name].name} would both be assignment {name}: rename one")
        names[name] = notebook
        target = course / "source" / name / notebook.name
        target.parent.mkdir(parents=True)
        shutil.copyfile(notebook, target)
    shutil.copyfile(CONFIG_FILE, course / "nbgrader_config.py")
    (course / ".jupyter").mkdir()
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(course / ".jupyter"))
    # nbgrader migrates its gradebook by running the `alembic` command of its own environment.
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    command = [
        sys.executable, "-m", "nbgrader", "generate_assignment", "*", "--force",
        f"--CourseDirectory.course_id={COURSE_ID}",
        f"--CourseDirectory.db_url=sqlite:///{course / 'gradebook.db'}",
    ]  # fmt: skip
    result = subprocess.run(command, cwd=course, env=env, capture_output=True, text=True)
    released = {notebook: course / "release" / name / notebook.name for name, notebook in names.items()}
    missing = [str(path.relative_to(course)) for path in released.values() if not path.is_file()]
    if result.returncode != 0 or missing:
        raise RuntimeError(
            f"nbgrader generate_assignment failed (exit {result.returncode}; missing {missing}) in {course}:\n"
            f"{result.stdout[-4000:]}{result.stderr[-4000:]}"
        )
    for notebook, path in released.items():
        leaked = sorted({m for cell in nbformat.read(path, as_version=4).cells for m in MARKERS if m in cell.source})
        if leaked:
            raise RuntimeError(f"the student version of {notebook.name} still contains {leaked}")
    return released


def student_version(nb: NotebookNode, name: str = "00_chapter.ipynb") -> NotebookNode:
    """The student version of an instructor notebook (a new notebook; ``nb`` is left alone)."""
    with tempfile.TemporaryDirectory(prefix="mini-infer-course-") as tmp:
        source = Path(tmp) / "instructor" / name
        source.parent.mkdir()
        nbformat.write(nb, source)
        released = generate_assignments([source], Path(tmp) / "course")
        return nbformat.read(released[source], as_version=4)


def stamped(student_path: Path, instructor: Path) -> str:
    """The text of a student version as committed: nbgrader's output and where it came from."""
    student = nbformat.read(student_path, as_version=4)
    text = instructor.read_text(encoding="utf-8")
    student.metadata[STAMP_KEY] = {
        "instructor_notebook": instructor.relative_to(ROOT).as_posix()
        if instructor.is_relative_to(ROOT)
        else instructor.name,
        "instructor_fingerprint": instructor_fingerprint(json.loads(text)),
        "generated_by": "scripts/make_student_versions.py (nbgrader generate_assignment); do not edit",
    }
    body = nbformat.writes(student)
    return body if body.endswith("\n") else body + "\n"  # as nbformat.write ends a file


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", help="notebooks or folders (default: notebooks/)")
    parser.add_argument("--out", type=Path, default=STUDENT_DIR, help="output folder (default: student/)")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 naming stale or missing files")
    args = parser.parse_args(argv)

    notebooks = [p.resolve() for p in find_notebooks(args.paths)]
    with_exercises = [p for p in notebooks if has_exercises(nbformat.read(p, as_version=4))]
    for path in sorted(set(notebooks) - set(with_exercises)):
        print(f"{path.name}: no exercises, no student version")
    with tempfile.TemporaryDirectory(prefix="mini-infer-course-") as tmp:
        released = generate_assignments(with_exercises, Path(tmp) / "course")
        expected = {args.out / path.name: stamped(released[path], path) for path in with_exercises}
    # A student version whose chapter is gone (or has no exercises any more) must go too, but
    # only when every chapter was generated: a run on some chapters leaves the others alone.
    orphans = sorted(set(args.out.glob("*.ipynb")) - set(expected)) if not args.paths else []

    if args.check:
        stale = [p for p, text in expected.items() if not p.is_file() or p.read_text(encoding="utf-8") != text]
        for path in stale:
            print(f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}: missing or stale")
        for path in orphans:
            print(f"{path.name}: a student version without an instructor notebook with exercises")
        if stale or orphans:
            print("run: python scripts/make_student_versions.py", file=sys.stderr)
            return 1
        print(f"ok: {len(expected)} student versions up to date in {args.out}")
        return 0

    args.out.mkdir(parents=True, exist_ok=True)
    for path, text in expected.items():
        path.write_text(text, encoding="utf-8")
        nb = nbformat.reads(text, as_version=4)
        points = sum(float(nbgrader_metadata(c).get("points", 0)) for _, c in graded_cells(nb))
        print(f"{path.name} -> {path} ({len(graded_cells(nb))} graded cells, {points:g} points)")
    for path in orphans:
        path.unlink()
        print(f"{path.name}: removed (no instructor notebook with exercises)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
