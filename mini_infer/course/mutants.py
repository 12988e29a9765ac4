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

from mini_infer.course.grade import HELPERS, child_environment, prepare_run_dir
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
# found to behave exactly as the reference on every valid input, with the reason. They are left
# out of the score ("mutants that change behaviour"); keyed by the original line's text, so that a
# region whose code changes is judged again instead of inheriting an old verdict. Written below as
# (function, original line) -> {mutated expression: reason}.
_TRANSPOSE = "transpose(1, 0) and transpose(0, 1) swap the same two axes"
_LAST_AXIS = "dim=1 is dim=-1: the tensor is always 2-D here ([rows, vocab])"
_ASSERTION = "_split's one caller (_descend) always passes 0 < num_blocks < len(node.block_ids): it never fires"
_VERDICTS: dict[tuple[str, str], dict[str, str]] = {
    # chapter 02
    ("RotaryEmbedding.__init__", "angles = torch.cat((freqs, freqs), dim=-1)  # [max_positions, head_dim]"): {
        "torch.cat((freqs, freqs), dim=1)": "freqs is an outer product, always 2-D",
    },
    ("folded_bias", "if group > 1 and mask.shape[-2] > 1:"): {
        "group >= 1": "repeating the rows once (group 1) is the identity",
        "group > 0": "repeating the rows once (group 1) is the identity",
    },
    ("causal_mask", "ends = torch.full((1,), num_keys, device=device) if context_lens is None else context_lens"): {
        "(2,)": "two equal ends give two equal masks, of which the function returns the first",
    },
    ("causal_mask", "return mask[0] if context_lens is None else mask"): {
        "mask[-1]": "without context_lens the mask has one entry: [-1] is [0]",
    },
    (
        "folded_attention",
        "k, v = k.transpose(0, 1)[:, None], v.transpose(0, 1)[:, None]",
    ): {
        "k.transpose(1, 0)": _TRANSPOSE,
        "v.transpose(1, 0)": _TRANSPOSE,
    },
    ("attention", "if mask is None and causal and num_queries > 1:"): {
        "num_queries >= 1": "one query is the last position: causal_mask(1, n) is all True, the same as no mask",
        "num_queries > 0": "one query is the last position: causal_mask(1, n) is all True, the same as no mask",
    },
    # chapter 04
    ("BlockTable.ensure_capacity", "if missing <= 0:"): {
        "missing < 0": "missing == 0 then allocates 0 blocks: can_allocate(0) is True and allocate(0) is []",
        "missing <= -1": "missing == 0 then allocates 0 blocks: can_allocate(0) is True and allocate(0) is []",
    },
    ("BlockTable.shrink", "if len(self.block_ids) > keep:"): {
        "len(self.block_ids) >= keep": "at equality it frees [] (a no-op) and deletes an empty slice",
    },
    # chapter 05
    ("PagedAttention.__call__", "k_pool[:, meta.block_of_slot, meta.offset_of_slot] = k.transpose(0, 1)"): {
        "k.transpose(1, 0)": _TRANSPOSE,
    },
    ("PagedAttention.__call__", "v_pool[:, meta.block_of_slot, meta.offset_of_slot] = v.transpose(0, 1)"): {
        "v.transpose(1, 0)": _TRANSPOSE,
    },
    # chapter 06
    ("Scheduler.schedule", "n = min(seq.num_uncomputed_tokens, budget)"): {
        "min(budget, seq.num_uncomputed_tokens)": "min of two ints is symmetric",
    },
    ("Scheduler.schedule", "if budget == 0 or len(self.running) >= self.max_num_seqs or out.preempted:"): {
        "budget == -1": (
            "the budget never goes below 0, and with none left blocks.admit admits nothing (a chunk of at most "
            "0 tokens) and returns 0, which ends the loop the same"
        ),
    },
    # chapter 07
    ("Scheduler._preempt", "while index < len(self.waiting) and self.waiting[index].arrival < seq.arrival:"): {
        "self.waiting[index].arrival <= seq.arrival": (
            "arrivals are unique (a counter), and the sequence being preempted is not in the waiting queue"
        ),
    },
    # chapter 08
    ("RadixCache.evict", "while heap and len(freed) < num_blocks:"): {
        "len(freed) <= num_blocks": (
            "once the quota is met the inner loop frees nothing and every node on the heap holds a block, "
            "so the extra pops only continue"
        ),
    },
    (
        "RadixCache._descend",
        "tokens = tokens[: len(tokens) - len(tokens) % bs]  # a partial last block never matches",
    ): {
        "len(tokens) + len(tokens) % bs": (
            "a partial block still never matches: no child's key is shorter than a block, and a partial "
            "match is floored to whole blocks"
        ),
    },
    ("RadixCache._descend", "while pos < len(tokens):"): {
        "pos <= len(tokens)": "at pos == len(tokens) the lookup key is (), which no child has: the loop breaks",
    },
    ("RadixCache._descend", "if tokens[pos : pos + len(run)] == run:"): {
        "pos - len(run)": "the else branch counts a whole-node match the same way (len(run) // bs blocks)",
    },
    ("RadixCache._descend", "for a, b in zip(run, tokens[pos : pos + len(run)]):"): {
        "zip(tokens[pos:pos + len(run)], run)": "a != b is symmetric, and zip stops at the shorter either way",
    },
    ("RadixCache._split", "assert parent is not None and 0 < num_blocks < len(node.block_ids)"): {
        "parent is not None or 0 < num_blocks < len(node.block_ids)": _ASSERTION,
        "0 <= num_blocks < len(node.block_ids)": _ASSERTION,
        "0 < num_blocks <= len(node.block_ids)": _ASSERTION,
        "-1 < num_blocks < len(node.block_ids)": _ASSERTION,
    },
    # chapter 09
    ("apply_penalties", "logits = torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)"): {
        "logits >= 0": "a zero logit stays zero, divided or multiplied by a positive finite penalty",
    },
    ("apply_top_k", "vocab = logits.shape[-1]"): {"logits.shape[1]": _LAST_AXIS},
    ("apply_top_k", "width = vocab if max_k is None else max(1, min(max_k, vocab))"): {
        "max(min(max_k, vocab), 1)": "max of two ints is symmetric",
        "min(vocab, max_k)": "min of two ints is symmetric",
    },
    ("apply_top_k", "kth_largest = logits.topk(width, dim=-1).values.gather(1, (k - 1).unsqueeze(1))"): {
        "logits.topk(width, dim=1)": _LAST_AXIS,
    },
    ("apply_top_p", "probs = logits.softmax(dim=-1)"): {"logits.softmax(dim=1)": _LAST_AXIS},
    ("apply_top_p", "sorted_probs = probs.sort(dim=-1, descending=True).values"): {
        "probs.sort(dim=1, descending=True)": _LAST_AXIS,
    },
    ("apply_top_p", "mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs"): {
        "sorted_probs.cumsum(dim=1)": _LAST_AXIS,
    },
    ("apply_top_p", "in_nucleus = (mass_before < top_p.unsqueeze(1)).sum(dim=-1, keepdim=True).clamp(min=1)"): {
        "(mass_before < top_p.unsqueeze(1)).sum(dim=1, keepdim=True)": _LAST_AXIS,
    },
    ("apply_min_p", "probs = logits.softmax(dim=-1)"): {"logits.softmax(dim=1)": _LAST_AXIS},
    ("apply_min_p", "threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)"): {
        "probs.amax(dim=1, keepdim=True)": _LAST_AXIS,
    },
    # chapter 10
    ("rejection_sample", "is_draft = draft_probs.sum(dim=-1) > 0"): {"draft_probs.sum(dim=1)": _LAST_AXIS},
    ("rejection_sample", "empty = residual.sum(dim=-1, keepdim=True) <= 0"): {
        "residual.sum(dim=1, keepdim=True)": _LAST_AXIS,
    },
}
EQUIVALENT: dict[tuple[str, str, str], str] = {
    (function, line, expression): reason
    for (function, line), verdicts in _VERDICTS.items()
    for expression, reason in verdicts.items()
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
            shown = _shown(mutated, node, kind)  # found before a dropped sign leaves the tree
            if kind == "unary":
                assert isinstance(node, ast.UnaryOp)
                mutated = _Replace(node).visit(mutated)
            line = getattr(node, "lineno", region.begin_line)
            expression = ast.unparse(shown)
            site = (region.function, source.splitlines()[line - 1].strip(), expression)
            text = f"{region.function} line {line}: {description}: `{expression}`"
            out.append(Mutant(region, line, text, ast.unparse(mutated), site))
    return out


def _shown(tree: ast.AST, node: ast.AST, kind: str) -> ast.AST:
    """The mutated expression a report shows (and ``EQUIVALENT`` keys on).

    An operator, comparison or swap shows its own node. A constant or a dropped sign shows the
    expression around it (``x.chunk(2, dim=1)``, not ``1``): a line such as
    ``k.transpose(0, 1)[0]`` holds several, and a verdict must name one mutant only.
    """
    if kind not in ("const", "unary"):
        return node
    parents = {id(child): parent for parent in ast.walk(tree) for child in ast.iter_child_nodes(parent)}
    around = parents.get(id(node))
    while around is not None and not isinstance(around, ast.stmt):
        if isinstance(around, ast.expr) and not isinstance(around, ast.UnaryOp):
            return around
        around = parents.get(id(around))  # through a keyword argument or a sign
    return node.operand if isinstance(node, ast.UnaryOp) else node


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
    for name in [m for m in sys.modules if m.startswith("mini_infer") or m.startswith("test_chapter") or m in ("conftest", *__HELPER_MODULES__)]:
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
        chapters = sorted({m.region.chapter for m in selected})
        tests = {c: str(file) for c, file in zip(chapters, prepare_run_dir(run_dir, chapters))}
        jobs = [{"path": m.region.path, "source": m.source, "tests": tests[m.region.chapter]} for m in selected]
        (work / "jobs.json").write_text(json.dumps(jobs))
        # The graded tests' shared helpers are imported afresh for every mutant, like the tests.
        helper_modules = tuple(name.removesuffix(".py") for name in HELPERS)
        (work / "worker.py").write_text(WORKER.replace("__HELPER_MODULES__", repr(helper_modules)))
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
