"""The package's shape: its import order is the book's table of contents, it has no import
cycles, its modules stay small, and nothing in it points outside the repository.

Each module's docstring names its chapter on its first line: ``(chapter 06)``, ``(chapters 06 and
07)`` or ``(chapter 05; ...)``: the first number is the chapter that builds it. Modules of the
appendix (the tiny model's corpus) import nothing of the engine and count as chapter 00.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import mini_infer
from tests.code_size import count_code_lines

PACKAGE = Path(mini_infer.__file__).parent
MODULES = {
    ".".join(("mini_infer", *path.relative_to(PACKAGE).with_suffix("").parts)).removesuffix(".__init__"): path
    for path in sorted(PACKAGE.rglob("*.py"))
}
CHAPTER = re.compile(r"\((?:chapters?|appendix) ?(\d\d)?")


def chapter_of(module: str) -> int:
    first_line = (ast.get_docstring(ast.parse(MODULES[module].read_text())) or "").split("\n")[0]
    match = CHAPTER.search(first_line)
    assert match, f"{module}: the docstring's first line names no chapter: {first_line!r}"
    return int(match.group(1) or 0)


def imports_of(module: str, *, runtime_only: bool = False) -> set[str]:
    """The package's modules that ``module`` imports, at any depth of its code. ``runtime_only``
    leaves out imports under ``if TYPE_CHECKING:``, which never run."""
    tree = ast.parse(MODULES[module].read_text())
    skipped: set[int] = set()
    if runtime_only:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                skipped |= {id(child) for child in ast.walk(node)}
    found = set()
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            # ``from pkg import sub`` imports the module pkg.sub when there is one.
            found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names}
    return {name for name in found if name in MODULES and name != module}


def test_every_module_names_its_chapter():
    for module in MODULES:
        chapter_of(module)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_imports_a_later_chapter(module):
    later = {m: chapter_of(m) for m in imports_of(module, runtime_only=True) if chapter_of(m) > chapter_of(module)}
    assert not later, f"{module} (chapter {chapter_of(module):02d}) imports later chapters: {later}"


def test_the_server_does_not_import_the_benchmarks():
    """The server (chapter 11) runs without the benchmark scripts (chapter 12), whatever chapter
    the first line of their shared module names."""
    for module in MODULES:
        if module.startswith("mini_infer.server."):
            bench = sorted(m for m in imports_of(module) if m.startswith("mini_infer.bench"))
            assert not bench, f"{module} imports the benchmarks: {bench}"


def test_no_import_cycles():
    graph = {m: imports_of(m, runtime_only=True) for m in MODULES}
    state: dict[str, str] = {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for other in sorted(graph[module]):
            if state.get(other) == "open":
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(other) :] + [module, other]))
            if other not in state:
                visit(other, path + [module])
        state[module] = "done"

    for module in MODULES:
        if module not in state:
            visit(module, [])


def test_the_checks_see_what_they_claim():
    """The walker finds function-level and relative imports, and the chapter rule would fire."""
    assert "mini_infer.speculative" in imports_of("mini_infer.engine_builder")
    assert "mini_infer.server.cli" in imports_of("mini_infer.cli")  # imported inside a function
    assert chapter_of("mini_infer.scheduler") == 6 and chapter_of("mini_infer.tiny_corpus") == 0
    assert chapter_of("mini_infer.kv.radix_cache") > chapter_of("mini_infer.scheduler")


@pytest.mark.parametrize("module", sorted(MODULES))
def test_modules_stay_small(module):
    assert count_code_lines(MODULES[module].read_text()) <= 400, f"{module} has more than 400 lines of code"


def test_nothing_points_outside_the_repository():
    for module, path in MODULES.items():
        assert "../shared" not in path.read_text(), f"{module} points at ../shared, which is not part of the repository"
