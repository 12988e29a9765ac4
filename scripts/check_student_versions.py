#!/usr/bin/env python
"""Check every chapter's exercises: the student version and wrong answers fail them, the instructor's pass.

    python scripts/check_student_versions.py                  # every chapter with exercises
    python scripts/check_student_versions.py notebooks/00_welcome.ipynb --jobs 1

For each notebook with nbgrader cells, two runs (each executes the notebook in a fresh kernel of
this environment, every cell even after an error, with ``HF_HUB_OFFLINE=1``, as ``nbgrader
autograde`` would: the cells tagged ``timing`` skipped by ``nbgrader_config.py``'s
``SkipTimingCells``; nbval runs every cell of the chapters):

* the **student version** (``make_student_versions.student_version``: solutions replaced by
  ``raise NotImplementedError()``, hidden tests removed): every graded test cell must FAIL, or a
  student could score points without writing anything;
* the **instructor version with the wrong answers replayed** (``wrong_answers.with_wrong_answers``:
  after each exercise, the exercise again once per plausible wrong answer in
  ``tests/wrong_answers/<notebook stem>.py``, then once more with the instructor's solution):
  every cell of the notebook itself must run without error, so in particular every graded test
  cell PASSES and no cell needs what a skipped timing cell made; every graded cell replayed with a
  wrong answer must FAIL, or the exercise does not tell a right answer from a wrong one; the
  replay with the instructor's solution must pass again. Every exercise needs at least one wrong
  answer.

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
from wrong_answers import RESTORE, load_wrong_answers, replay_of, with_wrong_answers  # noqa: E402
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
    checked = with_wrong_answers(instructor, answers)
    threads = max(1, (os.cpu_count() or 1) // jobs)
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        student_future = pool.submit(run, student, path.parent, timeout, threads)
        instructor_future = pool.submit(run, checked, path.parent, timeout, threads)
        student_run, instructor_run = student_future.result(), instructor_future.result()

    replays = sum(1 for c in instructor_run.nb.cells if (r := replay_of(c)) and r.graded and r.answer != RESTORE)
    print(
        f"{path.name}: student run {student_run.seconds:.1f} s, instructor run with"
        f" {replays} graded cells replayed on wrong answers {instructor_run.seconds:.1f} s"
    )
    student_graded = {nbgrader_metadata(c)["grade_id"]: c for _, c in graded_cells(student_run.nb)}
    for index, cell in graded_cells(instructor_run.nb):
        meta = nbgrader_metadata(cell)
        grade_id, points = meta["grade_id"], meta.get("points", 0)
        instructor_error = cell_error(cell)
        student_cell = student_graded.get(grade_id)
        student_error = cell_error(student_cell) if student_cell is not None else "missing"
        instructor_result = "passes" if instructor_error is None else f"FAILS: {instructor_error}"
        student_result = f"fails ({student_error})" if student_error is not None else "PASSES without a solution"
        print(f"  cell {index:>3} {grade_id} ({points} pt): instructor {instructor_result}; student {student_result}")
        if instructor_error is not None:
            problems.append(f"{path.name}: graded cell {grade_id} fails on the instructor version: {instructor_error}")
        if student_error is None:
            problems.append(f"{path.name}: graded cell {grade_id} passes on the student version")

    for index, cell in enumerate(instructor_run.nb.cells):
        replay, error = replay_of(cell), cell_error(cell) if cell.cell_type == "code" else None
        if replay is None:  # the notebook's own cells: any error is a broken chapter, graded cell or not
            if error is not None and not nbgrader_metadata(cell).get("grade"):
                problems.append(f"{path.name}: cell {index} fails on the instructor version: {error}")
        elif replay.answer == RESTORE:
            if error is not None:
                problems.append(f"{path.name}: {replay.exercise} replayed with its solution fails: {error}")
        elif replay.graded is not None:
            wrong = f"{replay.exercise}[{replay.answer}]"
            print(f"  wrong answer {wrong}: {replay.graded} " + (f"fails ({error})" if error else "PASSES"))
            if error is None:
                problems.append(f"{path.name}: graded cell {replay.graded} passes wrong answer {wrong}")
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
