#!/usr/bin/env python
"""Check every chapter's exercises: the student version and wrong answers fail them, the instructor's pass.

    python scripts/check_student_versions.py                  # every chapter with exercises
    python scripts/check_student_versions.py notebooks/00_welcome.ipynb --jobs 1

For each notebook with nbgrader cells, these runs (each notebook executes once per version, every
cell even after an error, in a fresh kernel of this environment, with ``HF_HUB_OFFLINE=1``, and
each runs as ``nbgrader autograde`` would: the cells tagged ``timing`` skipped by
``nbgrader_config.py``'s ``SkipTimingCells``; nbval runs every cell of the chapters):

* the **student version** (``make_student_versions.student_version``: solutions replaced by
  ``raise NotImplementedError()``, hidden tests removed): every graded test cell must FAIL, or a
  student could score points without writing anything;
* the **instructor version** (the notebook as committed): every cell must run without error, so
  in particular every graded test cell PASSES, and no cell needs what a skipped timing cell made;
* the **wrong versions** (``wrong_answers.wrong_versions``: exercises answered with the plausible
  wrong answers in ``tests/wrong_answers/<notebook stem>.py``): every graded cell of an exercise
  answered wrongly must FAIL, or the exercise does not tell a right answer from a wrong one. Every
  exercise needs at least one wrong answer.

Prints one line per graded cell and exits non-zero on any violation.
"""

from __future__ import annotations

import argparse
import copy
import os
import runpy
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import nbformat
from nbformat import NotebookNode
from traitlets.config import Config

sys.path.insert(0, str(Path(__file__).resolve().parent))
from execute_notebooks import ROOT, execute, find_notebooks, kernel_environment  # noqa: E402
from make_student_versions import graded_cells, has_exercises, nbgrader_metadata, student_version  # noqa: E402
from wrong_answers import load_wrong_answers, wrong_versions  # noqa: E402
from wrong_answers import problems as wrong_answer_problems  # noqa: E402


@dataclass
class Run:
    nb: NotebookNode
    seconds: float


def cell_error(cell: NotebookNode) -> str | None:
    """``"ename: evalue"`` of the first error output of a code cell, None when it ran cleanly."""
    for output in cell.get("outputs", []):
        if output.get("output_type") == "error":
            value = str(output.get("evalue", "")).strip().splitlines()
            return f"{output.get('ename', 'Error')}: {value[0] if value else ''}".rstrip(": ")
    return None


def skip_timing_cells(nb: NotebookNode) -> NotebookNode:
    """``nb`` as ``nbgrader autograde`` runs it: its ``timing`` cells replaced by a comment (a copy)."""
    config = ROOT / "nbgrader_config.py"  # the one definition of what grading skips
    skip = runpy.run_path(str(config), init_globals={"get_config": Config})["SkipTimingCells"]()
    skipped, _ = skip.preprocess(copy.deepcopy(nb), {})
    return skipped


def run(nb: NotebookNode, cwd: Path, timeout: int, threads: int) -> Run:
    nb = skip_timing_cells(nb)
    start = time.perf_counter()
    env = kernel_environment(online=False)
    # Kernels side by side must not ask for more threads than there are cores between them:
    # oversubscribed OpenMP threads wait on each other and a 20 s chapter takes minutes.
    env["OMP_NUM_THREADS"] = str(threads)
    execute(nb, cwd=cwd, timeout=timeout, allow_errors=True, env=env)
    return Run(nb, time.perf_counter() - start)


def check_notebook(path: Path, *, timeout: int, jobs: int) -> list[str]:
    """Run both versions of one notebook, print per-cell results, return the problems found."""
    instructor = nbformat.read(path, as_version=4)
    student = student_version(instructor)
    answers = load_wrong_answers(path)
    problems = wrong_answer_problems(instructor, answers, path.name)
    wrong = wrong_versions(instructor, answers)
    threads = max(1, (os.cpu_count() or 1) // jobs)
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        student_future = pool.submit(run, student, path.parent, timeout, threads)
        instructor_future = pool.submit(run, instructor, path.parent, timeout, threads)
        wrong_futures = [pool.submit(run, version.nb, path.parent, timeout, threads) for version in wrong]
        student_run, instructor_run = student_future.result(), instructor_future.result()
        wrong_runs = [future.result() for future in wrong_futures]

    print(f"{path.name}: student run {student_run.seconds:.1f} s, instructor run {instructor_run.seconds:.1f} s")
    student_graded = {nbgrader_metadata(c)["grade_id"]: c for _, c in graded_cells(student_run.nb)}
    for index, cell in graded_cells(instructor_run.nb):
        meta = nbgrader_metadata(cell)
        grade_id, points = meta["grade_id"], meta.get("points", 0)
        instructor_error = cell_error(cell)
        student_cell = student_graded.get(grade_id)
        student_error = cell_error(student_cell) if student_cell is not None else "missing"
        ok_instructor = instructor_error is None
        ok_student = student_error is not None
        instructor_result = "passes" if instructor_error is None else f"FAILS: {instructor_error}"
        student_result = f"fails ({student_error})" if student_error is not None else "PASSES without a solution"
        print(f"  cell {index:>3} {grade_id} ({points} pt): instructor {instructor_result}; student {student_result}")
        if not ok_instructor:
            problems.append(f"{path.name}: graded cell {grade_id} fails on the instructor version: {instructor_error}")
        if not ok_student:
            problems.append(f"{path.name}: graded cell {grade_id} passes on the student version")

    for round_number, (version, wrong_run) in enumerate(zip(wrong, wrong_runs), start=1):
        print(
            f"  wrong answers, round {round_number} ({wrong_run.seconds:.1f} s): {', '.join(version.answered_wrongly)}"
        )
        errors = {nbgrader_metadata(c)["grade_id"]: cell_error(c) for _, c in graded_cells(wrong_run.nb)}
        for grade_id in version.must_fail:
            error = errors.get(grade_id)
            print(f"    {grade_id}: " + (f"fails ({error})" if error is not None else "PASSES a wrong answer"))
            if error is None:
                problems.append(f"{path.name}: graded cell {grade_id} passes wrong answer {round_number}")

    # Any error in the instructor version is a broken chapter, graded cell or not.
    for index, cell in enumerate(instructor_run.nb.cells):
        if cell.cell_type == "code" and not nbgrader_metadata(cell).get("grade"):
            error = cell_error(cell)
            if error is not None:
                problems.append(f"{path.name}: cell {index} fails on the instructor version: {error}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", help="notebooks or folders (default: notebooks/)")
    parser.add_argument("--timeout", type=int, default=600, help="seconds allowed per cell (default 600)")
    parser.add_argument("--jobs", type=int, default=2, help="versions run at the same time (default 2)")
    args = parser.parse_args(argv)

    notebooks = [p for p in find_notebooks(args.paths) if has_exercises(nbformat.read(p, as_version=4))]
    if not notebooks:
        print("no notebook has exercises: nothing to check")
        return 0
    problems: list[str] = []
    for path in notebooks:
        problems += check_notebook(path, timeout=args.timeout, jobs=max(1, args.jobs))
    if problems:
        print("\nFAILED:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 1
    print(f"ok: {len(notebooks)} notebook(s) with exercises checked")
    return 0


if __name__ == "__main__":
    sys.exit(main())
