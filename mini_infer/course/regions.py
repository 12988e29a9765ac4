"""Assignment regions: the code a student writes, marked in the package's own source (appendix).

A region is a run of whole statements inside one function, between two comment lines at the
indentation of its statements::

    def allocate(self, n: int) -> list[int]:
        \"\"\"Take ``n`` free blocks, each with reference count 1; all or nothing.\"\"\"
        # student: begin chapter 04: take n free blocks, reference count 1 each, all or nothing
        ...the real code the engine runs...
        # student: end

Why comments rather than a decorator: a comment costs nothing at run time and needs no import
in the engine's modules (this subpackage stays off their import path); ``inspect.getsource``,
and so every ``show_source`` in the book, shows the pair, so a reader sees which lines are the
assignment; ``grep "# student:"`` lists every assignment; linters and formatters leave comments
alone. A decorator could only mark whole functions, and would put course machinery into the
engine. The text after ``chapter NN:`` says what to write: it becomes the message of the
``NotImplementedError`` that replaces the region in the student's copy.

Invariants, checked by ``find_regions`` (a marker that breaks one is an error naming the file and
line), so that a blanked file still imports, runs its other code and type-checks:

* begin and end alternate (no nesting), each on a line of its own;
* a region is a non-empty, contiguous slice of whole statements of one block of one function,
  and both markers sit at that block's indentation;
* a region that does not run to the end of its function binds no name that the function reads
  after it (the ``raise`` that replaces it would leave that name undefined).
"""

from __future__ import annotations

import ast
import io
import json
import re
import tokenize
from dataclasses import dataclass
from pathlib import Path

BEGIN = re.compile(r"^# student: begin chapter (\d\d): (\S.*)$")
END = "# student: end"
MARKER_PREFIX = "# student:"


class RegionError(ValueError):
    """A marker that breaks the rules above; the message names the file and line."""


@dataclass(frozen=True, slots=True)
class Region:
    """One assignment: lines ``begin_line .. end_line`` (1-based, the markers included)."""

    path: str  # relative to the package's parent, e.g. "mini_infer/kv/block_pool.py"
    chapter: int
    task: str
    function: str  # qualified name, e.g. "BlockPool.allocate"
    begin_line: int
    end_line: int
    indent: int

    @property
    def message(self) -> str:
        return f"chapter {self.chapter:02d}: {self.task}"


def _comments(source: str) -> list[tuple[int, int, str]]:
    """(line, column, text) of every comment that starts with ``# student:``."""
    found = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT and tok.string.startswith(MARKER_PREFIX):
            found.append((tok.start[0], tok.start[1], tok.string.rstrip()))
    return found


def _functions(tree: ast.AST) -> list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    out: list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.append((prefix + child.name, child))
                visit(child, prefix + child.name + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")
            else:
                visit(child, prefix)

    visit(tree, "")
    return out


def _blocks(node: ast.AST) -> list[list[ast.stmt]]:
    """Every statement list (block) inside ``node``, ``node``'s own body first."""
    blocks = []
    for sub in ast.walk(node):
        for name in ("body", "orelse", "finalbody"):
            value = getattr(sub, name, None)
            if isinstance(value, list) and value and isinstance(value[0], ast.stmt):
                blocks.append(value)
        if isinstance(sub, ast.Try):
            blocks.extend(h.body for h in sub.handlers)
    return blocks


def _bound_names(statements: list[ast.stmt]) -> set[str]:
    return {n.id for s in statements for n in ast.walk(s) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}


def find_regions(source: str, path: str) -> list[Region]:
    """The regions of one file's ``source`` (``path`` names it in errors and in the result)."""
    markers = _comments(source)
    if not markers:
        return []
    tree = ast.parse(source)
    functions = _functions(tree)
    regions = []
    opened: tuple[int, int, re.Match[str]] | None = None
    for line, col, text in markers:
        begin = BEGIN.match(text)
        where = f"{path}:{line}"
        if begin is None and text != END:
            raise RegionError(f"{where}: unknown marker {text!r}: write '# student: begin chapter NN: <what to write>'")
        if source.splitlines()[line - 1][:col].strip():
            raise RegionError(f"{where}: a marker must be on a line of its own")
        if begin is not None:
            if opened is not None:
                raise RegionError(f"{where}: a region begins inside the region opened at line {opened[0]}")
            opened = (line, col, begin)
            continue
        if opened is None:
            raise RegionError(f"{where}: '# student: end' without a region to end")
        begin_line, begin_col, match = opened
        opened = None
        if col != begin_col:
            raise RegionError(f"{where}: the end marker is not at the begin marker's indentation (line {begin_line})")
        # The end marker follows the last statement, so only the begin marker is inside the
        # function's lines (a comment after a body's last line belongs to no node).
        inside = [(name, fn) for name, fn in functions if fn.lineno < begin_line <= (fn.end_lineno or 0)]
        if not inside:
            raise RegionError(f"{path}:{begin_line}: a region must be inside a function")
        name, fn = inside[-1]  # the innermost
        statements: list[ast.stmt] = []
        for block in _blocks(fn):
            chosen = [s for s in block if begin_line < s.lineno and (s.end_lineno or s.lineno) < line]
            if chosen:
                statements = chosen
                break
        if not statements:
            raise RegionError(f"{path}:{begin_line}: the region holds no statement")
        block = next(b for b in _blocks(fn) if statements[0] in b)
        overlapping = [
            s for s in block if s.lineno <= line and (s.end_lineno or s.lineno) >= begin_line and s not in statements
        ]
        nested = {id(n) for st in statements for n in ast.walk(st)}
        strays = [
            n
            for n in ast.walk(tree)
            if isinstance(n, ast.stmt) and begin_line < n.lineno < line and id(n) not in nested
        ]
        if overlapping or strays or statements[0].col_offset != begin_col:
            raise RegionError(
                f"{path}:{begin_line}: a region must hold whole statements of one block, markers at their indentation"
            )
        after = [
            n.id
            for s in ast.walk(fn)
            if isinstance(s, ast.Name) and isinstance(s.ctx, ast.Load) and s.lineno > line
            for n in [s]
        ]
        leaked = sorted(_bound_names(statements) & set(after))
        if leaked:
            raise RegionError(
                f"{path}:{begin_line}: the region binds {leaked}, read after it: end the region at the end of "
                f"{name}, or move those lines into it"
            )
        regions.append(Region(path, int(match.group(1)), match.group(2), name, begin_line, line, begin_col))
    if opened is not None:
        raise RegionError(f"{path}:{opened[0]}: the region is never ended with '# student: end'")
    return regions


def blank(source: str, regions: list[Region]) -> str:
    """``source`` with each region's statements replaced by ``raise NotImplementedError(message)``;
    the markers stay, so the student sees where to write (and the result has the same regions)."""
    lines = source.split("\n")
    for region in sorted(regions, key=lambda r: r.begin_line, reverse=True):
        indent = " " * region.indent
        lines[region.begin_line : region.end_line - 1] = [
            f"{indent}raise NotImplementedError({json.dumps(region.message)})"
        ]
    return "\n".join(lines)


def package_regions(package_dir: Path) -> list[Region]:
    """Every region of the package at ``package_dir`` (a ``mini_infer`` directory), in file order."""
    regions = []
    for file in sorted(package_dir.rglob("*.py")):
        if "course" in file.relative_to(package_dir).parts[:1]:
            continue  # the course's own code and graded tests are never blanked
        text = file.read_text()
        if MARKER_PREFIX in text:
            regions += find_regions(text, str(file.relative_to(package_dir.parent)))
    return regions


def parse_chapters(spec: str | None, available: set[int]) -> set[int]:
    """``"04-06"``, ``"4,9"``, ``"02"``, or None (every chapter with regions) -> chapter numbers."""
    if spec is None:
        return set(available)
    chosen: set[int] = set()
    for part in spec.split(","):
        bounds = part.strip().split("-")
        try:
            numbers = [int(b) for b in bounds]
        except ValueError:
            raise ValueError(f"chapters {spec!r}: write a chapter (04), a range (04-06) or a list (02,04)") from None
        if len(numbers) == 1:
            chosen.add(numbers[0])
        elif len(numbers) == 2 and numbers[0] <= numbers[1]:
            chosen.update(range(numbers[0], numbers[1] + 1))
        else:
            raise ValueError(f"chapters {spec!r}: a range is FIRST-LAST with FIRST <= LAST")
    if not chosen & available:
        raise ValueError(f"chapters {spec!r} have no assignment; chapters with one: {_names(available)}")
    return chosen & available


def _names(chapters: set[int]) -> str:
    return ", ".join(f"{c:02d}" for c in sorted(chapters))
