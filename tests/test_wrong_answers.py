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
    WRONG_ANSWERS_DIR,
    graded_ids_of,
    load_wrong_answers,
    problems,
    replace_solution,
    wrong_versions,
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


def test_rounds_use_the_ith_wrong_answer_and_name_the_cells_that_must_fail() -> None:
    nb = nbformat.read(ROOT / "notebooks" / "00_welcome.ipynb", as_version=4)
    answers = {"kv-bytes-solution": ["return 0"], "blocks-needed-solution": ["return 1", "return 2"]}
    first, second = wrong_versions(nb, answers)
    assert first.answered_wrongly == ["kv-bytes-solution", "blocks-needed-solution"]
    assert first.must_fail == graded_ids_of(nb, "kv-bytes-solution") + graded_ids_of(nb, "blocks-needed-solution")
    assert second.answered_wrongly == ["blocks-needed-solution"]
    sources = [c.source for c in second.nb.cells if "def blocks_needed" in c.source]
    assert len(sources) == 1 and "    return 2\n" in sources[0] and "-(-num_tokens" not in sources[0]
    untouched = [c.source for c in second.nb.cells if "def kv_bytes_per_token" in c.source]
    assert "2 * num_layers" in untouched[0]  # no wrong answer left for it: the instructor's solution
