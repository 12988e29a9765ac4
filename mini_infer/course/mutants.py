"""Mutation testing of the graded tests (appendix): do they catch plausible wrong answers?

``mutants(chapter)`` lists one-edit mutants of every region of a chapter, made by an AST
mutator of our own: an arithmetic operator swapped (``+``/``-``, ``*``/``/``, ``//``/``%``), a
comparison flipped (``<``/``<=``, ``>``/``>=``, ``==``/``!=``), an integer constant off by one
(``n + 1`` and ``n - 1``), the first two arguments of a call swapped, ``and``/``or`` swapped, a
``not`` or unary minus dropped. ``run_mutants`` grades each mutant: it is *killed* when it loses
at least one point. A surviving mutant is either a gap in the tests or equivalent to the
reference (no behaviour change); the report lists the survivors so a person can tell which.

All mutants given to ``run_mutants`` run in one child process (torch is imported once), whatever
their chapters: each mutant's file written, the package's modules purged and its chapter's tests
run again with ``pytest.main``; a mutant that loops is stopped by an alarm after
``per_mutant_timeout`` seconds and counts as killed.

    mini-infer course mutants 04            every mutant of chapter 04's regions
    mini-infer course mutants 04 --sample 5 a seeded sample (what CI runs)
"""

from __future__ import annotations

import ast
import copy
import json
import random
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from mini_infer.course.grade import child_environment, prepare_run_dir
from mini_infer.course.regions import Region, package_regions

PACKAGE = Path(__file__).resolve().parent.parent

SWAPS: dict[type, type] = {
    ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult, ast.FloorDiv: ast.Mod,
    ast.Mod: ast.FloorDiv, ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt,
    ast.Eq: ast.NotEq, ast.NotEq: ast.Eq, ast.And: ast.Or, ast.Or: ast.And, ast.Is: ast.IsNot, ast.IsNot: ast.Is,
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class Mutant:
    region: Region
    line: int
    description: str
    source: str  # the whole mutated file
    site: tuple[str, str, str] = ("", "", "")  # function, original line (stripped), mutated expression

    @property
    def equivalent(self) -> str | None:
        """Why this mutant changes no behaviour, when a person found it does not (else None)."""
        return EQUIVALENT.get(self.site)


# Mutants that change no behaviour: survivors of ``mini-infer course mutants NN``, each read and
# found to behave exactly as the reference on every input, with the reason. They are left out of
# the score ("mutants that change behaviour"); keyed by the original line's text, so that a
# region whose code changes is judged again instead of inheriting an old verdict.
EQUIVALENT: dict[tuple[str, str, str], str] = {
    ("Scheduler.schedule", "n = min(seq.num_uncomputed_tokens, budget)", "min(budget, seq.num_uncomputed_tokens)"): (
        "min of two ints is symmetric"
    ),
    (
        "Scheduler._preempt",
        "while index < len(self.waiting) and self.waiting[index].arrival < seq.arrival:",
        "self.waiting[index].arrival <= seq.arrival",
    ): "arrivals are unique (a counter), and the sequence being preempted is not in the waiting queue",
}


def _sites(region_nodes: list[ast.AST]) -> list[tuple[ast.AST, str, object]]:
    """(node, kind, detail) of every mutation in the region's statements, in source order."""
    sites: list[tuple[ast.AST, str, object]] = []
    for root in region_nodes:
        for node in ast.walk(root):
            if isinstance(node, (ast.BinOp, ast.BoolOp)) and type(node.op) in SWAPS:
                sites.append((node, "op", None))
            elif isinstance(node, ast.Compare):
                sites += [(node, "cmp", i) for i, op in enumerate(node.ops) if type(op) in SWAPS]
            elif isinstance(node, ast.AugAssign) and type(node.op) in SWAPS:
                sites.append((node, "op", None))
            elif isinstance(node, ast.Constant) and type(node.value) is int:
                sites += [(node, "const", +1), (node, "const", -1)]
            elif (
                isinstance(node, ast.Call) and len(node.args) >= 2 and ast.dump(node.args[0]) != ast.dump(node.args[1])
            ):
                if not any(isinstance(a, ast.Starred) for a in node.args[:2]):
                    sites.append((node, "swap", None))
            elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.Not, ast.USub)):
                sites.append((node, "unary", None))
    return sites


def _apply(node: ast.AST, kind: str, detail: object) -> str:
    if kind == "op":
        old = type(node.op)  # type: ignore[attr-defined]
        node.op = SWAPS[old]()  # type: ignore[attr-defined]
        return f"{old.__name__} -> {SWAPS[old].__name__}"
    if kind == "cmp":
        assert isinstance(node, ast.Compare) and isinstance(detail, int)
        old = type(node.ops[detail])
        node.ops[detail] = SWAPS[old]()
        return f"{old.__name__} -> {SWAPS[old].__name__}"
    if kind == "const":
        assert isinstance(node, ast.Constant) and isinstance(node.value, int) and isinstance(detail, int)
        old_value = node.value
        node.value = old_value + detail
        return f"{old_value} -> {node.value}"
    if kind == "swap":
        assert isinstance(node, ast.Call)
        node.args[0], node.args[1] = node.args[1], node.args[0]
        return f"swap the first two arguments of {ast.unparse(node.func)}"
    assert isinstance(node, ast.UnaryOp)
    return f"drop {type(node.op).__name__}"


class _Replace(ast.NodeTransformer):
    def __init__(self, target: ast.UnaryOp) -> None:
        self.target = target

    def visit_UnaryOp(self, node: ast.UnaryOp) -> ast.AST:
        return node.operand if node is self.target else self.generic_visit(node)


def mutants(chapter: int, package: Path = PACKAGE) -> list[Mutant]:
    """Every one-edit mutant of chapter ``chapter``'s regions (files rewritten with ``ast.unparse``)."""
    out = []
    for region in [r for r in package_regions(package) if r.chapter == chapter]:
        source = (package.parent / region.path).read_text()
        tree = ast.parse(source)
        count = len(_sites(_region_statements(tree, region)))
        for index in range(count):
            mutated = copy.deepcopy(tree)
            node, kind, detail = _sites(_region_statements(mutated, region))[index]
            description = _apply(node, kind, detail)
            if kind == "unary":
                assert isinstance(node, ast.UnaryOp)
                mutated = _Replace(node).visit(mutated)
            line = getattr(node, "lineno", region.begin_line)
            shown = node.operand if isinstance(node, ast.UnaryOp) else node
            expression = ast.unparse(shown)
            site = (region.function, source.splitlines()[line - 1].strip(), expression)
            text = f"{region.function} line {line}: {description}: `{expression}`"
            out.append(Mutant(region, line, text, ast.unparse(mutated), site))
    return out


def _region_statements(tree: ast.AST, region: Region) -> list[ast.AST]:
    """The region's outermost statements, in ``ast.walk`` order."""
    inside = [n for n in ast.walk(tree) if isinstance(n, ast.stmt) and region.begin_line < n.lineno < region.end_line]
    nested = {id(child) for n in inside for child in ast.walk(n) if child is not n}
    return [n for n in inside if id(n) not in nested]


WORKER = r"""
import json, signal, sys
from pathlib import Path
import pytest

sys.dont_write_bytecode = True
package, jobs, timeout = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text()), int(sys.argv[3])

def alarm(*_):
    raise TimeoutError("the mutant ran past its time (an endless loop?)")

signal.signal(signal.SIGALRM, alarm)
results = []
for job in jobs:
    target = package / job["path"]
    original = target.read_text()
    target.write_text(job["source"])
    for name in [m for m in sys.modules if m.startswith("mini_infer") or m.startswith("test_chapter") or m == "conftest"]:
        del sys.modules[name]
    signal.alarm(timeout)
    try:
        code = pytest.main([job["tests"], "-x", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", "--no-header", "-W", "ignore"])
    except BaseException as exc:  # a timeout that escaped pytest, or a mutant that breaks the interpreter
        code = repr(exc)
    finally:
        signal.alarm(0)
        target.write_text(original)
    results.append(code != 0)
print("RESULTS " + json.dumps(results))
"""


def run_mutants(selected: list[Mutant], per_mutant_timeout: int = 60) -> list[bool]:
    """Killed (True) or survived (False), per mutant in ``selected`` (each graded on its own
    chapter's tests; mutants of several chapters share one child process)."""
    if not selected:
        return []
    with tempfile.TemporaryDirectory(prefix="mini-infer-mutants-") as tmp:
        work = Path(tmp)
        copy_root = work / "package"
        shutil.copytree(PACKAGE, copy_root / "mini_infer", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        run_dir = work / "run"
        run_dir.mkdir()
        tests = {c: str(prepare_run_dir(run_dir, c)) for c in sorted({m.region.chapter for m in selected})}
        jobs = [{"path": m.region.path, "source": m.source, "tests": tests[m.region.chapter]} for m in selected]
        (work / "jobs.json").write_text(json.dumps(jobs))
        (work / "worker.py").write_text(WORKER)
        env = child_environment(copy_root)
        env["MINI_INFER_GRADE_RESULTS"] = str(work / "results.json")
        command = [sys.executable, str(work / "worker.py"), str(copy_root), str(work / "jobs.json")]
        run = subprocess.run(
            [*command, str(per_mutant_timeout)], cwd=run_dir, env=env, capture_output=True, text=True,
            timeout=per_mutant_timeout * len(selected) + 120,
        )  # fmt: skip
        line = next((s for s in run.stdout.splitlines() if s.startswith("RESULTS ")), None)
        if line is None:
            raise RuntimeError(f"the mutation worker failed: {(run.stdout + run.stderr)[-2000:]}")
        return list(json.loads(line.removeprefix("RESULTS ")))


def behaviour_changing(chapter_mutants: list[Mutant]) -> list[Mutant]:
    """The mutants not known to be equivalent to the reference (what the score counts)."""
    return [m for m in chapter_mutants if m.equivalent is None]


def sample(chapter_mutants: list[Mutant], size: int | None, seed: int = 0) -> list[Mutant]:
    if size is None or size >= len(chapter_mutants):
        return chapter_mutants
    return random.Random(seed).sample(chapter_mutants, size)
