"""Plausible wrong answers to the chapters' exercises, and the notebook versions that use them.

A graded exercise proves something only if a wrong answer loses its points. For every notebook
with exercises, ``tests/wrong_answers/<notebook stem>.py`` defines

    WRONG_ANSWERS: dict[str, list[str]]   # solution cell's grade_id -> wrong answers

Each wrong answer is code that replaces the lines between ``### BEGIN SOLUTION`` and
``### END SOLUTION`` of that solution cell (written without indentation: it takes the markers').
It must be a mistake a student could make (an off-by-one, a swapped argument, a missed case, a
call to the package's own function where the exercise asks for it to be written), never code
that cannot run. The graded cells of exercise ``X-solution`` are those whose grade_id starts with
``X-``.

``scripts/check_student_versions.py`` runs ``wrong_versions(nb)``: version i answers every
exercise with its i-th wrong answer (exercises with fewer keep the instructor's solution), and
every graded cell of an exercise answered wrongly must fail.
"""

from __future__ import annotations

import copy
import importlib.util
import textwrap
from dataclasses import dataclass
from pathlib import Path

from nbformat import NotebookNode

ROOT = Path(__file__).resolve().parent.parent
WRONG_ANSWERS_DIR = ROOT / "tests" / "wrong_answers"
BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"


@dataclass
class WrongVersion:
    """A notebook with some exercises answered wrongly, and the graded cells that must fail."""

    nb: NotebookNode
    answered_wrongly: list[str]  # solution grade_ids
    must_fail: list[str]  # graded cells' grade_ids


def wrong_answers_file(notebook: Path) -> Path:
    return WRONG_ANSWERS_DIR / f"{notebook.stem}.py"


def load_wrong_answers(notebook: Path) -> dict[str, list[str]]:
    """The notebook's ``WRONG_ANSWERS`` ({} when it has no file)."""
    path = wrong_answers_file(notebook)
    if not path.exists():
        return {}
    spec = importlib.util.spec_from_file_location(f"wrong_answers_{notebook.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    answers = getattr(module, "WRONG_ANSWERS", None)
    if not isinstance(answers, dict):
        raise ValueError(f"{path} must define WRONG_ANSWERS: dict[str, list[str]]")
    return answers


def _grade_id(cell: NotebookNode) -> str | None:
    return cell.get("metadata", {}).get("nbgrader", {}).get("grade_id")


def solution_ids(nb: NotebookNode) -> list[str]:
    return [_grade_id(c) for c in nb.cells if c.get("metadata", {}).get("nbgrader", {}).get("solution")]


def graded_ids_of(nb: NotebookNode, solution_id: str) -> list[str]:
    """The graded cells of the exercise whose solution cell is ``solution_id`` (``X-solution`` -> ``X-*``)."""
    prefix = solution_id.removesuffix("-solution") + "-"
    return [
        grade_id
        for c in nb.cells
        if c.get("metadata", {}).get("nbgrader", {}).get("grade") and (grade_id := _grade_id(c)) is not None
        if grade_id.startswith(prefix)
    ]


def problems(nb: NotebookNode, answers: dict[str, list[str]], name: str) -> list[str]:
    """What is wrong with a notebook's wrong answers, before anything runs."""
    found: list[str] = []
    solutions = solution_ids(nb)
    for solution_id in solutions:
        if not answers.get(solution_id):
            found.append(f"{name}: exercise {solution_id} has no wrong answer in {wrong_answers_file(Path(name))}")
        elif not graded_ids_of(nb, solution_id):
            found.append(f"{name}: no graded cell belongs to {solution_id} (graded ids must start with its prefix)")
    cells = {_grade_id(c): c for c in nb.cells}
    for solution_id, codes in answers.items():
        if solution_id not in solutions:
            found.append(f"{name}: {solution_id} in the wrong answers is not a solution cell of the notebook")
            continue
        for i, code in enumerate(codes):
            try:  # the cell as the wrong answer leaves it must at least be Python
                compile(replace_solution(cells[solution_id].source, code), f"{solution_id}[{i}]", "exec")
            except (SyntaxError, ValueError) as exc:
                found.append(f"{name}: wrong answer {solution_id}[{i}] does not fit its cell: {exc}")
    return found


def replace_solution(source: str, code: str) -> str:
    """``source`` with the lines between the solution markers replaced by ``code`` (at their indentation)."""
    lines = source.splitlines()
    begins = [i for i, line in enumerate(lines) if line.strip() == BEGIN]
    ends = [i for i, line in enumerate(lines) if line.strip() == END]
    if len(begins) != 1 or len(ends) != 1 or ends[0] < begins[0]:
        raise ValueError(f"a solution cell needs exactly one {BEGIN} ... {END} region to replace")
    begin, end = begins[0], ends[0]
    indent = lines[begin][: len(lines[begin]) - len(lines[begin].lstrip())]
    body = textwrap.indent(textwrap.dedent(code).strip("\n"), indent).splitlines()
    return "\n".join(lines[: begin + 1] + body + lines[end:])


def wrong_versions(nb: NotebookNode, answers: dict[str, list[str]]) -> list[WrongVersion]:
    """One notebook per round of wrong answers (see the module docstring)."""
    rounds = max((len(codes) for codes in answers.values()), default=0)
    versions = []
    for i in range(rounds):
        version = copy.deepcopy(nb)
        wrong, must_fail = [], []
        for cell in version.cells:
            solution_id = _grade_id(cell)
            codes = answers.get(solution_id or "", [])
            if (
                solution_id is None
                or i >= len(codes)
                or not cell.get("metadata", {}).get("nbgrader", {}).get("solution")
            ):
                continue
            cell.source = replace_solution(cell.source, codes[i])
            wrong.append(solution_id)
            must_fail += graded_ids_of(nb, solution_id)
        versions.append(WrongVersion(version, wrong, must_fail))
    return versions
