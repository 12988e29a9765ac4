"""The repository's ``nbgrader_config.py``: a per-cell execution timeout, and timing cells skipped.

The settings are read the way nbgrader reads them (traitlets' Python config loader), handed to
nbgrader's own classes, and finally used by ``nbgrader autograde`` on a small course built in a
temporary folder: a submission whose timing cell would fail, and whose graded cell fails without
a solution, is graded with the timing cell skipped and the graded cell at zero.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook
from traitlets.config import Config
from traitlets.config.loader import PyFileConfigLoader

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from make_student_versions import generate_assignments  # noqa: E402

nbgrader = pytest.importorskip("nbgrader", reason="nbgrader is in the book extra")
from nbgrader.preprocessors import Execute  # noqa: E402


def load_config() -> Config:
    return PyFileConfigLoader("nbgrader_config.py", path=str(ROOT)).load_config()


def skipper(config: Config) -> Any:
    """The SkipTimingCells class the config defines, found where nbgrader finds it."""
    return next(p for p in config.Autograde.autograde_preprocessors if p.__name__ == "SkipTimingCells")


def timing_notebook() -> nbformat.NotebookNode:
    """A chapter in miniature: an exercise, its graded test, and a timing cell that must not run."""
    solution = new_code_cell(
        "def double(x):\n    ### BEGIN SOLUTION\n    return 2 * x\n    ### END SOLUTION",
        metadata={"nbgrader": {"grade": False, "grade_id": "double-solution", "locked": False,
                               "schema_version": 3, "solution": True, "task": False}},
    )  # fmt: skip
    test = new_code_cell(
        "assert double(21) == 42",
        metadata={"nbgrader": {"grade": True, "grade_id": "double-test", "locked": True, "points": 1,
                               "schema_version": 3, "solution": False, "task": False}},
    )  # fmt: skip
    timing = new_code_cell('raise RuntimeError("the timing cell ran")', metadata={"tags": ["timing"]})
    plain = new_code_cell("print('untagged cells run')")
    return new_notebook(cells=[new_markdown_cell("# Chapter 99. Test"), solution, test, timing, plain])


def test_execution_timeout_reaches_nbgrader_execute() -> None:
    config = load_config()
    assert config.ExecutePreprocessor.timeout == 300
    # nbgrader's Execute overrides nbconvert's default (30 s); the config must still win.
    assert Execute(config=config).timeout == 300
    assert Execute().timeout == 30, "nbgrader's default changed: reconsider the timeout in nbgrader_config.py"


def test_the_kernel_manager_nbgrader_starts_hands_out_the_short_wait_client() -> None:
    from mini_infer.course.kernel_client import ShortWaitKernelClient

    config = load_config()
    execute = Execute(config=config)
    # nbclient makes its kernel manager with the preprocessor's config, as here.
    assert execute.kernel_manager_class(config=config).client_factory is ShortWaitKernelClient
    assert execute.kernel_manager_class().client_factory is not ShortWaitKernelClient  # the setting does it


@pytest.mark.parametrize("steps", ["Autograde.autograde_preprocessors", "Validator.preprocessors"])
def test_timing_cells_are_skipped_right_before_execution(steps: str) -> None:
    config = load_config()
    section, name = steps.split(".")
    preprocessors = config[section][name]
    at = preprocessors.index(Execute)
    assert preprocessors[at - 1] is skipper(config), f"{steps}: {preprocessors}"
    assert preprocessors.count(Execute) == 1


def test_skipper_replaces_only_tagged_code_cells() -> None:
    config = load_config()
    nb = timing_notebook()
    nb.cells.append(new_markdown_cell("a tagged Markdown cell is left alone", metadata={"tags": ["timing"]}))
    before = [cell.source for cell in nb.cells]
    out, _ = skipper(config)(config=config).preprocess(nb, {})
    after = [cell.source for cell in out.cells]
    assert after[3].startswith("# Skipped while grading") and "raise" not in after[3]
    assert after[:3] + after[4:] == before[:3] + before[4:]


def test_skipper_leaves_an_untagged_notebook_alone() -> None:
    config = load_config()
    nb = timing_notebook()
    del nb.cells[3].metadata["tags"]
    before = json.dumps(nb, sort_keys=True)
    out, _ = skipper(config)(config=config).preprocess(nb, {})
    assert json.dumps(out, sort_keys=True) == before


def test_skipper_refuses_a_tagged_graded_cell() -> None:
    config = load_config()
    nb = timing_notebook()
    nb.cells[2].metadata["tags"] = ["timing"]
    with pytest.raises(ValueError, match=r"cell 2 \(double-test\) is tagged 'timing'.*remove the tag"):
        skipper(config)(config=config).preprocess(nb, {})


@pytest.mark.slow
def test_autograde_skips_timing_cells_and_grades_the_rest(tmp_path: Path) -> None:
    """Generate, submit unchanged (no solution), autograde: all with the repository's config."""
    instructor = tmp_path / "99_test.ipynb"
    nbformat.write(timing_notebook(), instructor)
    course = tmp_path / "course"
    released = generate_assignments([instructor], course)[instructor]
    submitted = course / "submitted" / "student1" / "ch99" / instructor.name
    submitted.parent.mkdir(parents=True)
    shutil.copyfile(released, submitted)

    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(course / ".jupyter"), HF_HUB_OFFLINE="1")
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    command = [
        sys.executable, "-m", "nbgrader", "autograde", "ch99", "--force",
        "--CourseDirectory.course_id=mini-infer", f"--CourseDirectory.db_url=sqlite:///{course / 'gradebook.db'}",
    ]  # fmt: skip
    result = subprocess.run(command, cwd=course, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    graded = nbformat.read(course / "autograded" / "student1" / "ch99" / instructor.name, as_version=4)
    timing, plain, test = graded.cells[3], graded.cells[4], graded.cells[2]
    assert timing.source.startswith("# Skipped while grading")
    assert not any(o.get("output_type") == "error" for o in timing.outputs), timing.outputs
    assert "untagged cells run" in "".join(o.get("text", "") for o in plain.outputs)
    assert any(o.get("ename") == "NotImplementedError" for o in test.outputs), test.outputs
    from nbgrader.api import Gradebook

    with Gradebook(f"sqlite:///{course / 'gradebook.db'}", "mini-infer") as gradebook:
        grade = gradebook.find_grade("double-test", "99_test", "ch99", "student1")
        assert (grade.score, grade.max_score) == (0.0, 1.0)
