"""Every exercise of every chapter has a plausible wrong answer that fits its solution cell
(scripts/wrong_answers.py). That the wrong answers fail their graded cells is checked by running
the notebooks: scripts/check_student_versions.py, in CI."""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from wrong_answers import (  # noqa: E402
    RESTORE,
    WRONG_ANSWERS_DIR,
    Replay,
    graded_ids_of,
    load_wrong_answers,
    problems,
    replace_solution,
    replay_of,
    with_wrong_answers,
)

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_exercise_has_a_wrong_answer_that_fits_its_cell(path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    assert problems(nb, load_wrong_answers(path), path.name) == []


def test_no_wrong_answers_file_belongs_to_no_notebook() -> None:
    stems = {p.stem for p in NOTEBOOKS}
    assert {p.stem for p in WRONG_ANSWERS_DIR.glob("*.py")} <= stems


def test_a_wrong_answer_replaces_only_the_solution_region_at_its_indentation() -> None:
    source = "def f(x):\n    # keep me\n    ### BEGIN SOLUTION\n    return x\n    ### END SOLUTION\n# after"
    replaced = replace_solution(source, "y = x - 1\nreturn y\n")
    assert replaced == (
        "def f(x):\n    # keep me\n    ### BEGIN SOLUTION\n    y = x - 1\n    return y\n    ### END SOLUTION\n# after"
    )
    with pytest.raises(ValueError, match="exactly one"):
        replace_solution("return x", "return 1")


def test_each_wrong_answer_is_replayed_after_its_exercise_then_the_solution_again() -> None:
    nb = nbformat.read(ROOT / "notebooks" / "00_welcome.ipynb", as_version=4)
    answers = {"kv-bytes-solution": ["return 0"], "blocks-needed-solution": ["return 1", "return 2"]}
    checked = with_wrong_answers(nb, answers)
    assert checked.cells[0] is not nb.cells[0]  # a copy: the notebook given is left as it was
    own = [c for c in checked.cells if replay_of(c) is None]
    assert [c.source for c in own] == [c.source for c in nb.cells]  # the notebook itself, unchanged

    replays = [(i, replay_of(c), c) for i, c in enumerate(checked.cells) if replay_of(c) is not None]
    graded = graded_ids_of(nb, "blocks-needed-solution")
    blocks = [(r.answer, r.graded) for _, r, _ in replays if r.exercise == "blocks-needed-solution"]
    # per replay: the solution cell, then every code cell up to the last graded one (here: graded only)
    assert blocks == [(a, g) for a in (0, 1, RESTORE) for g in [None, *graded]]
    solutions = [c.source for _, r, c in replays if r.exercise == "blocks-needed-solution" and r.graded is None]
    assert "    return 1\n" in solutions[0] and "    return 2\n" in solutions[1]
    assert "-(-num_tokens" in solutions[2]  # the last replay puts the instructor's solution back

    # each replay comes right after its exercise's last graded cell, before the next cell of the notebook
    last_graded = max(
        i
        for i, c in enumerate(checked.cells)
        if replay_of(c) is None and c.metadata.get("nbgrader", {}).get("grade_id") in graded
    )
    first_replay = min(i for i, r, _ in replays if r.exercise == "blocks-needed-solution")
    assert first_replay == last_graded + 1
    for _, replay, cell in replays:
        assert "nbgrader" not in cell.metadata  # nbgrader never counts a copy as a graded cell
        assert replay == Replay(replay.exercise, replay.answer, replay.graded)
    ids = [c.id for c in checked.cells]
    assert len(ids) == len(set(ids))
    nbformat.validate(checked)
