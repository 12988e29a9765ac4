"""The student package: a copy of ``mini_infer`` with the chosen chapters' regions blanked (appendix).

``write_student_package(out, chapters)`` writes ``out/mini_infer`` (the real package, every
region of ``chapters`` replaced by ``raise NotImplementedError("chapter NN: ...")``; the other
chapters' regions keep the reference code, so later chapters run on the student's earlier work),
``out/tests/test_chapterNN.py`` (the graded tests of each chosen chapter, which the student may
run: ``cd out && python -m pytest``), and ``out/ASSIGNMENTS.md`` (what to write, where).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from mini_infer.course.grade import GRADED, copy_graded_tests
from mini_infer.course.regions import Region, blank, package_regions, parse_chapters

PACKAGE = Path(__file__).resolve().parent.parent

# Beside the tests: make ``python -m pytest`` in the student's tree import *its* package, never
# an installed one (whose reference code would pass every test).
TESTS_CONFTEST = '''"""Run the tests against the package beside this folder, whatever else is installed."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
for name in [m for m in sys.modules if m == "mini_infer" or m.startswith("mini_infer.")]:
    del sys.modules[name]

import mini_infer  # noqa: E402

if Path(mini_infer.__file__).resolve().parent != ROOT / "mini_infer":
    raise RuntimeError(f"imported mini_infer from {mini_infer.__file__}, not from {ROOT}: check PYTHONPATH")


def pytest_configure(config):
    config.addinivalue_line("markers", "points(n): what a graded test is worth")
'''


def graded_chapters() -> set[int]:
    """Chapters that have graded tests in this package."""
    return {int(p.stem.removeprefix("test_chapter")) for p in GRADED.glob("test_chapter[0-9][0-9].py")}


def write_student_package(out: Path, chapters: str | None = None, package: Path = PACKAGE) -> list[Region]:
    """Write the student package for ``chapters`` (``"04-06"``, ``"4,9"``; None: all) to ``out``;
    return the regions blanked. Refuses an ``out`` that already holds a ``mini_infer``."""
    regions = package_regions(package)
    chosen = parse_chapters(chapters, {r.chapter for r in regions})
    target = out / "mini_infer"
    if target.exists():
        raise FileExistsError(f"{target} exists: choose an empty directory (the student's work is never overwritten)")
    shutil.copytree(package, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    blanked = [r for r in regions if r.chapter in chosen]
    for path in sorted({r.path for r in blanked}):
        file = out / path
        file.write_text(blank(file.read_text(), [r for r in blanked if r.path == path]))
    tests = out / "tests"
    tests.mkdir(exist_ok=True)
    (tests / "conftest.py").write_text(TESTS_CONFTEST)
    copy_graded_tests(sorted(chosen & graded_chapters()), tests)
    # Line numbers of the student's files (each region is one line shorter now).
    blanked = [r for r in package_regions(target) if r.chapter in chosen]
    (out / "ASSIGNMENTS.md").write_text(assignments_text(blanked))
    return blanked


def assignments_text(regions: list[Region]) -> str:
    lines = [
        "# Assignments",
        "",
        "Each function below raises `NotImplementedError` between a `# student: begin` and a",
        "`# student: end` comment: replace that line with your code. Run a chapter's tests with",
        "`python -m pytest tests/test_chapterNN.py`; `mini-infer course grade NN --package .` gives the points.",
        "",
    ]
    for chapter in sorted({r.chapter for r in regions}):
        lines += [f"## Chapter {chapter:02d}", ""]
        lines += [f"- `{r.path}:{r.begin_line}` `{r.function}`: {r.task}" for r in regions if r.chapter == chapter]
        lines.append("")
    return "\n".join(lines)
