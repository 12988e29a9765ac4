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

``scripts/check_student_versions.py`` runs ``with_wrong_answers(nb, answers)``: the instructor's
notebook in which, after each exercise's last graded cell, the exercise is replayed once per wrong
answer (its solution cell answered wrongly, then every code cell up to its last graded cell
again) and finally once more with the instructor's solution, which puts back what later cells
need. One kernel run checks every wrong answer, each in the state its exercise normally runs in
and with every other exercise answered correctly. Every graded cell of a wrong replay must fail;
every cell of the instructor's own cells and of the restoring replay must pass. The replayed
cells carry ``metadata["wrong_answer"]`` (a ``Replay``'s fields) and no nbgrader metadata.
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


RESTORE = -1  # the answer number of the replay that runs the instructor's solution again


@dataclass(frozen=True)
class Replay:
    """One replayed cell: which exercise, which wrong answer (``RESTORE``: the instructor's), and
    the grade_id of the graded cell it copies (None for the solution and the cells between)."""

    exercise: str  # the solution cell's grade_id
    answer: int
    graded: str | None


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


def replay_of(cell: NotebookNode) -> Replay | None:
    """The ``Replay`` a cell of ``with_wrong_answers``'s notebook is, None for the notebook's own cells."""
    meta = cell.get("metadata", {}).get("wrong_answer")
    return None if meta is None else Replay(meta["exercise"], meta["answer"], meta["graded"])


def _replayed(cell: NotebookNode, replay: Replay, number: int) -> NotebookNode:
    copied = copy.deepcopy(cell)
    copied.metadata.pop("nbgrader", None)  # a copy is no graded cell: nbgrader must not count it twice
    copied.metadata["wrong_answer"] = {"exercise": replay.exercise, "answer": replay.answer, "graded": replay.graded}
    copied.outputs, copied.execution_count = [], None
    if "id" in cell:
        copied["id"] = f"{cell.id}-r{number}"[-64:]  # nbformat ids: unique, at most 64 characters
    return copied


def with_wrong_answers(nb: NotebookNode, answers: dict[str, list[str]]) -> NotebookNode:
    """``nb`` with every wrong answer replayed after its exercise (see the module docstring); a
    copy: ``nb`` itself is left as it was."""
    out = copy.deepcopy(nb)
    own, out.cells = out.cells, []
    solutions = set(solution_ids(nb))
    # index of an exercise's last graded cell -> (its solution id, its graded ids, the code cells to replay)
    spans: dict[int, tuple[str, set[str], list[NotebookNode]]] = {}
    for index, cell in enumerate(own):
        solution_id = _grade_id(cell)
        if solution_id not in solutions or not answers.get(solution_id):
            continue
        graded = set(graded_ids_of(nb, solution_id))
        last = max((i for i, c in enumerate(own) if _grade_id(c) in graded), default=index)
        span = [c for c in own[index : last + 1] if c.cell_type == "code"]
        if any(_grade_id(c) in solutions for c in span[1:]):
            raise ValueError(f"{solution_id}: another exercise's solution lies between it and its graded cells")
        spans[last] = (solution_id, graded, span)
    number = 0
    for index, cell in enumerate(own):
        out.cells.append(cell)
        if index not in spans:
            continue
        solution_id, graded, span = spans[index]
        for answer, code in [*enumerate(answers[solution_id]), (RESTORE, None)]:
            for span_cell in span:
                number += 1
                grade_id = _grade_id(span_cell)
                replay = Replay(solution_id, answer, grade_id if grade_id in graded else None)
                copied = _replayed(span_cell, replay, number)
                if span_cell is span[0] and code is not None:
                    copied.source = replace_solution(span_cell.source, code)
                out.cells.append(copied)
    return out
