"""The student track's CI proofs (appendix): regions are well formed, the student package imports
and lints, the reference earns every point, the blank package none, and mutants lose points.

The mutation check here runs a seeded sample of each chapter's mutants (CI-sized); every mutant
of a chapter: ``mini-infer course mutants 04`` (the report lists the survivors).

Cost: each package is graded on every chapter in ONE child process (``grade_chapters``: torch
imported once, not once per chapter), and every chapter's sampled mutants share one more; the
per-chapter tests below read those shared results. ``course grade NN``'s own path (one chapter,
one child) is checked by the command-line test and by the test that both paths agree.
"""

from __future__ import annotations

import ast
import functools
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import mini_infer
from mini_infer.cli import main
from mini_infer.course.grade import GradeReport, GradingError, grade, grade_chapters, graded_file, possible_points
from mini_infer.course.mutants import EQUIVALENT, Mutant, behaviour_changing, mutants, run_mutants, sample
from mini_infer.course.regions import RegionError, blank, find_regions, package_regions
from mini_infer.course.student import graded_chapters, write_student_package

PACKAGE = Path(mini_infer.__file__).parent
REPO = PACKAGE.parent
REGIONS = package_regions(PACKAGE)
CHAPTERS = sorted({r.chapter for r in REGIONS})
MUTANTS_PER_CHAPTER = 6


@functools.cache
def chapter_mutants(chapter: int) -> list[Mutant]:
    """Every mutant of a chapter, made once per run (making them all takes seconds)."""
    return mutants(chapter)


@pytest.fixture(scope="module")
def student(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("student")
    write_student_package(out)
    return out


@pytest.fixture(scope="module")
def reference_reports() -> dict[int, GradeReport]:
    return grade_chapters(CHAPTERS, REPO)


@pytest.fixture(scope="module")
def blank_reports(student: Path) -> dict[int, GradeReport]:
    return grade_chapters(CHAPTERS, student)


@pytest.fixture(scope="module")
def sampled_mutants() -> dict[int, list[tuple[str, bool]]]:
    """Each chapter's seeded sample of the mutants that change behaviour, all graded in one child:
    (description, killed)."""
    chosen = {
        chapter: sample(behaviour_changing(chapter_mutants(chapter)), MUTANTS_PER_CHAPTER, seed=chapter)
        for chapter in CHAPTERS
    }
    every = [m for chapter in CHAPTERS for m in chosen[chapter]]
    killed = iter(run_mutants(every))
    return {chapter: [(m.description, next(killed)) for m in chosen[chapter]] for chapter in CHAPTERS}


def test_every_chapter_the_issue_names_has_regions_and_graded_tests():
    assert {2, 3, 4, 5, 6, 7, 8, 9, 10, 11} <= set(CHAPTERS)
    assert set(CHAPTERS) == graded_chapters()
    for chapter in CHAPTERS:
        assert sum(possible_points(graded_file(chapter).read_text()).values()) > 0


SOURCE = '''
def f(n):
    """Doc."""
    if n < 0:
        raise ValueError(n)
    # student: begin chapter 04: double n
    m = n * 2
    return m
    # student: end


def g(xs):
    total = 0
    # student: begin chapter 05: count
    for x in xs:
        total += x
    return total
    # student: end
'''


def test_regions_are_found_and_blanked_in_place():
    regions = find_regions(SOURCE, "m.py")
    assert [(r.function, r.chapter, r.task) for r in regions] == [("f", 4, "double n"), ("g", 5, "count")]
    blanked = blank(SOURCE, regions)
    assert 'raise NotImplementedError("chapter 04: double n")' in blanked and "m = n * 2" not in blanked
    assert "raise ValueError(n)" in blanked  # code outside a region stays
    again = find_regions(blanked, "m.py")  # the student's copy has the same regions, one line each
    assert [(r.function, r.task) for r in again] == [(r.function, r.task) for r in regions]
    assert [r.end_line - r.begin_line for r in again] == [2, 2]
    namespace: dict = {}
    exec(compile(blanked, "m.py", "exec"), namespace)
    with pytest.raises(NotImplementedError, match="chapter 05: count"):
        namespace["g"]([1])


@pytest.mark.parametrize(
    ("source", "error"),
    [
        ("def f():\n    # student: begin chapter 04: x\n    return 1\n", "never ended"),
        ("def f():\n    return 1\n    # student: end\n", "without a region"),
        ("def f():\n    # student: begin chapter 4: x\n    return 1\n    # student: end\n", "unknown marker"),
        ("# student: begin chapter 04: x\nA = 1\n# student: end\n", "inside a function"),
        (
            "def f():\n    # student: begin chapter 04: x\n    a = 1\n    # student: end\n    return a\n",
            "binds \\['a'\\]",
        ),
        (
            "def f(x):\n    # student: begin chapter 04: x\n    if x:\n        # student: end\n        return 1\n",
            "indentation",
        ),
    ],
)
def test_bad_markers_are_refused_with_the_line(source, error):
    with pytest.raises(RegionError, match=error):
        find_regions(source, "m.py")


def test_the_student_package_imports_lints_and_names_what_to_write(student: Path):
    assert len(package_regions(student / "mini_infer")) == len(REGIONS)
    code = (
        "import mini_infer, mini_infer.engine_builder, mini_infer.speculative, mini_infer.kv.radix_cache;"
        "print(mini_infer.__file__)"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=student, capture_output=True, text=True, env={"PYTHONPATH": str(student)}
    )
    assert run.returncode == 0, run.stderr
    assert Path(run.stdout.strip()).resolve() == (student / "mini_infer" / "__init__.py").resolve()
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    # Undefined names are what a careless blanking would leave; unused imports are expected.
    lint = subprocess.run(
        [ruff, "check", "--select", "F821,F823", str(student / "mini_infer")], capture_output=True, text=True
    )
    assert lint.returncode == 0, lint.stdout
    text = (student / "mini_infer" / "kv" / "block_pool.py").read_text()
    assert 'raise NotImplementedError("chapter 04: take n free blocks' in text
    assert "self._free[-n:]" not in text
    assert (student / "tests" / "test_chapter04.py").exists() and "## Chapter 04" in (
        student / "ASSIGNMENTS.md"
    ).read_text()


def test_chapters_selects_what_is_blanked(tmp_path: Path):
    blanked = write_student_package(tmp_path, "04-05")
    assert {r.chapter for r in blanked} == {4, 5}
    layers = (tmp_path / "mini_infer" / "layers.py").read_text()
    assert layers == (PACKAGE / "layers.py").read_text()  # chapter 02 keeps the reference code
    assert sorted(p.name for p in (tmp_path / "tests").glob("test_*.py")) == ["test_chapter04.py", "test_chapter05.py"]
    with pytest.raises(FileExistsError):
        write_student_package(tmp_path, "04")
    with pytest.raises(ValueError, match="no assignment"):
        write_student_package(tmp_path / "other", "12")


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_the_reference_earns_every_point_and_the_blank_package_none(
    chapter: int, reference_reports: dict[int, GradeReport], blank_reports: dict[int, GradeReport]
):
    reference = reference_reports[chapter]
    assert reference.points == reference.total > 0, reference.format()
    assert reference.total == sum(possible_points(graded_file(chapter).read_text()).values())
    assert Path(reference.package) == REPO.resolve()
    blank_report = blank_reports[chapter]
    assert blank_report.points == 0 and blank_report.total == reference.total, blank_report.format()
    assert {t.name for t in blank_report.tests} == {t.name for t in reference.tests}
    assert all(t.result == "failed" for t in blank_report.tests), blank_report.format()  # ran, and failed


def test_one_chapter_graded_alone_gets_the_report_it_gets_among_all(
    student: Path, tmp_path: Path, reference_reports: dict[int, GradeReport]
):
    # A student package with chapter 06 blanked and chapter 04 done: the scores of one chapter
    # must not depend on which other chapters share the child process.
    write_student_package(tmp_path, "06")
    alone, together = grade(6, tmp_path), grade_chapters([4, 6], tmp_path)
    assert alone.points == together[6].points == 0 < alone.total
    assert [(t.name, t.result) for t in alone.tests] == [(t.name, t.result) for t in together[6].tests]
    assert together[4].points == together[4].total == reference_reports[4].total


def test_grade_command_json(capsys: pytest.CaptureFixture[str], student: Path):
    assert main(["course", "grade", "10", "--package", str(student), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["points"] == 0 and report["total"] > 0
    assert all({"name", "points", "result"} <= set(t) for t in report["tests"])
    assert {t["result"] for t in report["tests"]} == {"failed"}
    assert main(["course", "grade", "04", "--package", str(student / "nowhere")]) == 2


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_a_sample_of_mutants_loses_points(chapter: int, sampled_mutants: dict[int, list[tuple[str, bool]]]):
    results = sampled_mutants[chapter]
    assert len(results) == min(MUTANTS_PER_CHAPTER, len(behaviour_changing(chapter_mutants(chapter)))) > 0
    survivors = [description for description, killed in results if not killed]
    assert len(results) - len(survivors) >= 0.8 * len(results), f"chapter {chapter:02d}: survivors {survivors}"


def test_every_mutant_marked_equivalent_is_one_the_mutator_makes():
    # A verdict whose line changed no longer matches any mutant: it must be judged again, not kept.
    sites = {m.site for chapter in CHAPTERS for m in chapter_mutants(chapter)}
    assert set(EQUIVALENT) <= sites, sorted(set(EQUIVALENT) - sites)
    assert all(reason.strip() for reason in EQUIVALENT.values())


# --- grading that cannot run refuses to grade ---------------------------------------------------


def run_grade_command(args: list[str], pythonpath: list[Path]) -> subprocess.CompletedProcess[str]:
    code = "import sys; from mini_infer.cli import main; sys.exit(main(sys.argv[1:]))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, [*pythonpath, REPO]))}
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=600)


def test_grading_without_pytest_refuses_with_the_reason_and_no_points(tmp_path: Path, student: Path):
    # A Python whose import of pytest fails, as where mini-infer was installed without the course
    # extra: the grading child finds this module first on PYTHONPATH.
    shadow = tmp_path / "no_pytest"
    shadow.mkdir()
    (shadow / "pytest.py").write_text("raise ModuleNotFoundError(\"No module named 'pytest'\", name='pytest')\n")
    for extra in ([], ["--json"]):
        run = run_grade_command(["course", "grade", "04", "--package", str(student), *extra], [shadow])
        assert run.returncode == 1, (run.returncode, run.stdout, run.stderr)
        assert "grading refused: pytest is not installed" in run.stderr and "mini-infer[course]" in run.stderr
        if extra:  # a gradebook finds no "points" to record, only the reason
            report = json.loads(run.stdout)
            assert "points" not in report and "pytest is not installed" in report["error"], report
        else:
            assert run.stdout == "", run.stdout  # no "0 / 19 points"


def test_a_package_whose_tests_cannot_be_collected_is_not_graded(tmp_path: Path):
    write_student_package(tmp_path, "04")
    pool = tmp_path / "mini_infer" / "kv" / "block_pool.py"
    pool.write_text(pool.read_text() + "\ndef broken(:\n")  # what a student's syntax error looks like
    with pytest.raises(GradingError, match=r"could not be collected.*test_chapter04\.py.*SyntaxError"):
        grade(4, tmp_path)
    run = run_grade_command(["course", "grade", "04", "--package", str(tmp_path), "--json"], [])
    assert run.returncode == 1 and "points" not in json.loads(run.stdout), run.stdout
    assert "could not be collected" in run.stderr


def test_the_course_extra_brings_what_grading_imports():
    """``pip install 'mini-infer[course]'`` is what GradingError's message names: it must bring
    pytest, and every third-party module the graded tests (and the server they drive) import."""
    tomllib = pytest.importorskip("tomllib", reason="Python 3.11+ reads pyproject.toml")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]

    def names(requirements: list[str]) -> set[str]:
        return {re.split(r"[<>=\[; ]", r, maxsplit=1)[0].lower().replace("-", "_") for r in requirements}

    base = names(project["dependencies"])
    course, server = (names(project["optional-dependencies"][extra]) for extra in ("course", "server"))
    assert "pytest" in course and server <= course, (course, server)
    imported = set()
    for file in (PACKAGE / "course" / "graded").glob("*.py"):
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                imported.add(node.module.split(".")[0])
    local = {"mini_infer", "graded_attention", "graded_fake_engine", "__future__"}
    third_party = {m for m in imported - local if m not in sys.stdlib_module_names}
    assert third_party and third_party <= base | course, third_party - base - course
