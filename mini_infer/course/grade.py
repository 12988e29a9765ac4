"""The grader: chapters' graded tests against any copy of the package, in a subprocess (appendix).

``grade(chapter, package_dir)`` runs ``mini_infer/course/graded/test_chapterNN.py`` (this
package's copy: the student's own copy of the tests could have been edited) in a fresh Python
whose ``mini_infer`` is ``package_dir/mini_infer``: ``PYTHONPATH`` points there, the tests run from
a temporary folder (so neither the working directory nor pytest's rootdir can put another
``mini_infer`` first), and the child checks ``mini_infer.__file__`` before any test runs.
``grade_chapters(chapters, package_dir)`` grades several chapters in one such child (one pytest
run over their files, torch imported once: what CI does for every chapter) and splits the
per-test results by file into one report per chapter, the same reports ``grade`` gives.

Each graded test carries ``@pytest.mark.points(n)``; a test earns its points when it passes.
The possible total is read from the test file's source (``possible_points``), not from the run.

Grading that cannot run refuses to grade: when the child's pytest is missing (install the
``course`` extra), when a test file cannot be collected (a package that does not import, a
missing dependency of the tests), or when the run ends without its results, ``grade_chapters``
raises :class:`GradingError` with the reason and gives no points at all, rather than a ``0 /
total`` a gradebook would record as the student's. A test that runs and fails earns 0; a run that
passes its time limit keeps the points of the tests that finished (the rest are ``did not run``).
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

GRADED = Path(__file__).parent / "graded"
# What several chapters' tests share, copied beside them.
HELPERS = ("graded_attention.py", "graded_fake_engine.py")

INSTALL_HINT = "pip install 'mini-infer[course]'"


class GradingError(RuntimeError):
    """The graded tests could not run (no pytest, a file that cannot be collected): no grade."""


# The child's conftest: refuses to run against any other package, records each test's outcome
# and every collection error.
CHILD_CONFTEST = """
import json
import os
from pathlib import Path
from typing import Any

import pytest

EXPECTED = Path(os.environ["MINI_INFER_GRADE_PACKAGE"]).resolve() / "mini_infer"
RESULTS = []
COLLECT_ERRORS = []


def pytest_configure(config):
    config.addinivalue_line("markers", "points(n): what a graded test is worth")
    import mini_infer

    found = Path(mini_infer.__file__).resolve().parent
    if found != EXPECTED:
        raise pytest.UsageError(f"graded the wrong package: imported {found}, expected {EXPECTED}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    marker = item.get_closest_marker("points")
    points = marker.args[0] if marker else 0
    file = item.path.name
    entry = next((r for r in RESULTS if r["name"] == item.name and r["file"] == file), None)
    if entry is None:
        entry = {"file": file, "name": item.name, "points": points, "result": "passed", "message": ""}
        RESULTS.append(entry)
    if report.failed or report.skipped:
        if entry["result"] == "passed":
            entry["result"] = "failed" if report.failed else "skipped"
            text = str(report.longrepr) if report.longrepr else ""
            entry["message"] = text.strip().splitlines()[-1][:300] if text.strip() else ""


def pytest_collectreport(report):
    if report.failed:
        text = str(report.longrepr).strip() if report.longrepr else ""
        lines = [line for line in text.splitlines() if line.strip()]
        COLLECT_ERRORS.append({"where": report.nodeid or ".", "message": lines[-1][:300] if lines else ""})


def pytest_sessionfinish(session, exitstatus):
    Path(os.environ["MINI_INFER_GRADE_RESULTS"]).write_text(
        json.dumps({"results": RESULTS, "collect_errors": COLLECT_ERRORS})
    )
"""


@dataclass(slots=True)
class TestResult:
    name: str
    points: int
    result: str  # passed, failed, skipped, error
    message: str = ""

    @property
    def earned(self) -> int:
        return self.points if self.result == "passed" else 0


@dataclass(slots=True)
class GradeReport:
    chapter: int
    package: str
    tests: list[TestResult] = field(default_factory=list)
    total: int = 0
    error: str = ""  # why the run produced no per-test results (import error, timeout)

    @property
    def points(self) -> int:
        return sum(t.earned for t in self.tests)

    def to_json(self) -> dict[str, object]:
        return {
            "chapter": self.chapter,
            "package": self.package,
            "points": self.points,
            "total": self.total,
            "error": self.error,
            "tests": [{**asdict(t), "earned": t.earned} for t in self.tests],
        }

    def format(self) -> str:
        lines = [f"chapter {self.chapter:02d}: {self.points} / {self.total} points  ({self.package})"]
        for t in self.tests:
            mark = "ok  " if t.result == "passed" else "FAIL"
            detail = f"  {t.message}" if t.message and t.result != "passed" else ""
            lines.append(f"  {mark} {t.earned}/{t.points}  {t.name}{detail}")
        if self.error:
            lines.append(f"  error: {self.error}")
        return "\n".join(lines)


def graded_file(chapter: int) -> Path:
    path = GRADED / f"test_chapter{chapter:02d}.py"
    if not path.exists():
        have = sorted(int(p.stem[-2:]) for p in GRADED.glob("test_chapter[0-9][0-9].py"))
        raise ValueError(f"chapter {chapter:02d} has no graded tests; chapters with some: {have}")
    return path


def possible_points(source: str) -> dict[str, int]:
    """Points per test function, times its cases when it is parametrized over a literal list."""
    points = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.FunctionDef) or not node.name.startswith("test"):
            continue
        worth, cases = 0, 1
        for deco in node.decorator_list:
            if not isinstance(deco, ast.Call):
                continue
            name = ast.unparse(deco.func)
            if name == "pytest.mark.points":
                worth = ast.literal_eval(deco.args[0])
            elif name == "pytest.mark.parametrize":
                cases *= len(ast.literal_eval(deco.args[1]))
        if worth <= 0:
            raise ValueError(f"graded test {node.name} has no @pytest.mark.points(n)")
        points[node.name] = worth * cases
    return points


def parse_chapter(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"chapter {text!r}: give a number such as 04 or 4") from None


def child_environment(package_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(package_dir), *filter(None, [env.get("PYTHONPATH")])])
    env["MINI_INFER_GRADE_PACKAGE"] = str(package_dir)
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # a mutant written within the same second must not reuse a .pyc
    env.setdefault("HF_HUB_OFFLINE", "1")
    return env


def copy_graded_tests(chapters: list[int], folder: Path) -> list[Path]:
    """Copy the graded tests of ``chapters`` into ``folder``, with the helpers they share (this
    package's copies, never the graded package's); return the test files."""
    for helper in HELPERS:
        shutil.copyfile(GRADED / helper, folder / helper)
    files = [folder / graded_file(chapter).name for chapter in chapters]
    for chapter, file in zip(chapters, files):
        shutil.copyfile(graded_file(chapter), file)
    return files


def prepare_run_dir(work: Path, chapters: list[int]) -> list[Path]:
    """``work`` set up for a run: the chapters' tests, the child's conftest, an empty pytest.ini."""
    (work / "conftest.py").write_text(CHILD_CONFTEST)
    (work / "pytest.ini").write_text("[pytest]\n")
    return copy_graded_tests(chapters, work)


def grade(chapter: int, package_dir: Path, timeout: float = 600.0) -> GradeReport:
    """Run chapter ``chapter``'s graded tests against ``package_dir/mini_infer``."""
    return grade_chapters([chapter], package_dir, timeout)[chapter]


def grade_chapters(chapters: list[int], package_dir: Path, timeout: float = 600.0) -> dict[int, GradeReport]:
    """Run the graded tests of every chapter in ``chapters`` against ``package_dir/mini_infer`` in
    one child process; one report per chapter. ``timeout`` bounds the whole run: a package that
    loops fails every chapter not yet finished (grade chapters one by one to isolate it)."""
    package_dir = package_dir.resolve()
    if not (package_dir / "mini_infer" / "__init__.py").exists():
        raise FileNotFoundError(f"{package_dir} holds no mini_infer package (expected {package_dir}/mini_infer)")
    if not chapters:
        raise ValueError("no chapter to grade: give at least one")
    chapters = sorted(set(chapters))
    reports = {}
    for chapter in chapters:
        total = sum(possible_points(graded_file(chapter).read_text()).values())
        reports[chapter] = GradeReport(chapter, str(package_dir), total=total)
    with tempfile.TemporaryDirectory(prefix="mini-infer-grade-") as tmp:
        work = Path(tmp)
        files = prepare_run_dir(work, chapters)
        env = child_environment(package_dir)
        env["MINI_INFER_GRADE_RESULTS"] = str(work / "results.json")
        # One chapter that fails to import must not stop the others from being graded.
        command = [sys.executable, "-m", "pytest", *map(str, files), "-q", "-p", "no:cacheprovider", "--rootdir", tmp]
        command += ["-c", str(work / "pytest.ini"), "--continue-on-collection-errors"]
        error = ""
        try:
            run = subprocess.run(command, cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            error = f"the tests ran past {timeout:.0f} s (an endless loop?)"
            run = None
        results = work / "results.json"
        entries: list[dict[str, Any]] = []
        if run is not None:
            entries = read_results(results, run, package_dir)
        for chapter, file in zip(chapters, files):
            report = reports[chapter]
            report.tests = [
                TestResult(**{k: v for k, v in r.items() if k != "file"}) for r in entries if r["file"] == file.name
            ]
            report.error = error
            if run is not None and not report.tests:
                tail = " | ".join((run.stdout + run.stderr).strip().splitlines()[-5:])
                raise GradingError(f"no test of {file.name} ran, so no points are given: {tail}")
    for chapter, report in reports.items():
        expected = possible_points(graded_file(chapter).read_text())
        seen = {t.name.split("[")[0] for t in report.tests}
        report.tests += [
            TestResult(name, points, "error", "did not run") for name, points in expected.items() if name not in seen
        ]
    return reports


def read_results(results: Path, run: subprocess.CompletedProcess[str], package_dir: Path) -> list[dict[str, Any]]:
    """The per-test entries the child's conftest wrote; :class:`GradingError` when the run could
    not grade (pytest missing, a collection error, no results)."""
    output = (run.stdout + run.stderr).strip()
    tail = " | ".join(output.splitlines()[-5:])
    if not results.exists():
        if "No module named" in output and "pytest" in output:
            raise GradingError(
                f"pytest is not installed for {sys.executable}, so the graded tests cannot run and no points are "
                f"given: {INSTALL_HINT}"
            )
        raise GradingError(f"the graded tests did not run (pytest exited with {run.returncode}): {tail}")
    found = json.loads(results.read_text())
    if found["collect_errors"]:
        where = "; ".join(f"{e['where']}: {e['message']}" for e in found["collect_errors"])
        raise GradingError(
            f"the graded tests could not be collected against {package_dir}/mini_infer, so no points are given "
            f"(a package that does not import, or a dependency of the tests missing: {INSTALL_HINT}): {where}"
        )
    return list(found["results"])
