"""Each chapter shows only what it and the chapters before it build.

The intro promises that every chapter uses only what the chapters before it built. For imports,
``test_package_shape`` checks it; this module checks it for what the reader *sees*: the package
source a notebook displays with ``show_source`` must name nothing that a later chapter introduces.

A name is *introduced* by the earliest chapter whose modules bind it anywhere (a function, class,
parameter, attribute, field or variable; imports do not count). A module belongs to the chapter its
docstring names, or to an earlier chapter that already displays some of its code (``model.py`` is
chapter 03's, but chapter 01 shows how it loads weights). Chapter ``09b`` counts as 9.1, so chapter
09 may not show chapter 09b's names either. A displayed source breaks the promise when one of its
identifiers is introduced only by a later chapter: chapter 06 showing a ``draft_lag`` that only
chapter 10's module binds, for example. Names of the libraries the code calls (``view``,
``extend``, ``field``) are not the package's and are left out, as are the names the displayed code
binds itself.

Targets are resolved from the notebook itself: its ``mini_infer`` imports are run, and each
``show_source`` argument (or, for ``for function in (a, b): show_source(function)``, each item of
the loop) is looked up; objects the notebook defines itself are its own code and are skipped.
"""

from __future__ import annotations

import ast
import inspect
import json
import re
import textwrap
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from tests.test_package_shape import MODULES

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted(path for path in (ROOT / "notebooks").glob("[0-9]*.ipynb"))
CHAPTER = re.compile(r"\((?:chapters?|appendix) ?(\d\d)?([b-e])?")

MENTION = re.compile(r"chapters? (\d\d)([b-e])?")
# Names a chapter may show although a later chapter's module binds them first, each with why.
ALLOWED: dict[str, str] = {}
# Displayed sources that may point to a later chapter, keyed by (chapter, what is shown), with why:
# a pointer in prose to what a later chapter improves is fine; code that serves a later chapter is not.
SEAM = "a hook a later chapter plugs into, kept where the chapter's code calls it; the later chapter's state is its own"
ALLOWED_MENTIONS: dict[tuple[str, str], str] = {
    ("02", "folded_attention"): "a pointer: the one grouped-query fold also takes chapter 05's batched layout",
    ("03", "ContiguousKVCache"): "a pointer to the waste chapter 04 removes, which this chapter measures",
    ("04", "BlockTable"): SEAM + " (shrink: draft slots a step did not keep)",
    ("05", "PagedAttention"): SEAM + " (in_place: chapter 05c's kernel, passed in so that 05 imports nothing of it)",
    ("05", "SequenceInput"): "chapter 05 lays out every kind of step, guessed tokens to verify included",
    ("05", "ForwardBatch"): SEAM + " (the inputs chapter 14 sends to the other ranks)",
    ("05", "ModelRunner"): SEAM + " (chapter 05c's kernel; chapter 14's health check of its workers)",
    ("06", "Scheduler.schedule"): SEAM + " (draft slots, through the Speculation protocol)",
    ("07", "Scheduler.schedule"): SEAM + " (draft slots, through the Speculation protocol)",
    ("06", "Scheduler.update"): SEAM + " (the accepted guesses a step keeps)",
    ("06", "GreedySampler"): "an error message that tells the caller which sampler to use instead",
    ("06", "LLM.generate"): "a comment on why any failure, a worker's death included, ends the call cleanly",
    ("08", "BlockManager.computed"): SEAM + " (blocks of draft slots a step did not keep)",
    ("09b", "Sampler.restrict"): "why a grammar's mask is per guessed position, for chapter 10's verification",
    ("10", "build_engine"): SEAM + " (chapter 14's launcher, reached by module name only)",
}


def chapter_number(text: str) -> float:
    """``"06"`` -> 6.0, ``"05b"`` -> 5.1, ``"05c"`` -> 5.2: the order of the book's table of contents."""
    match = re.fullmatch(r"(\d\d)([b-e])?", text)
    assert match, text
    return int(match.group(1)) + (ord(match.group(2)) - ord("a")) / 10 if match.group(2) else int(match.group(1))


def module_chapter(module: str) -> float:
    first_line = (ast.get_docstring(ast.parse(MODULES[module].read_text())) or "").split("\n")[0]
    match = CHAPTER.search(first_line)
    assert match, f"{module}: the docstring's first line names no chapter"
    return chapter_number((match.group(1) or "00") + (match.group(2) or ""))


def bound_names(tree: ast.AST) -> set[str]:
    """Every name the code binds: definitions, parameters, assigned variables and attributes."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            names.add(node.name)
    return names


@cache
def library_names() -> frozenset[str]:
    """What the libraries the package calls name themselves: their functions, methods, arguments."""
    import builtins
    import collections.abc
    import dataclasses
    import itertools
    import json
    import math
    import typing

    import torch
    import torch.nn.functional

    names: set[str] = set()
    for thing in (builtins, collections.abc, dataclasses, itertools, json, math, typing, torch, torch.Tensor):
        names |= set(dir(thing))
    for thing in (torch.nn.functional, torch.nn.Module, str, list, dict, set, bytes, int, float, tuple):
        names |= set(dir(thing))
    return frozenset(names)


@cache
def module_chapters() -> dict[str, float]:
    """Each module's chapter: its docstring's, or the first chapter that displays its code."""
    chapters = {module: module_chapter(module) for module in MODULES}
    for notebook in NOTEBOOKS:
        chapter = chapter_number(notebook.stem.split("_")[0])
        for _, target in displayed_objects(notebook):
            module = package_module(target)
            if module in chapters:
                chapters[module] = min(chapters[module], chapter)
    return chapters


@cache
def introduced_by() -> dict[str, float]:
    """Each name bound in the package, and the earliest chapter whose modules bind it."""
    first: dict[str, float] = {}
    for module, chapter in module_chapters().items():
        for name in bound_names(ast.parse(MODULES[module].read_text())):
            first[name] = min(first.get(name, chapter), chapter)
    return first


def identifiers(tree: ast.AST) -> set[str]:
    """The names code reads: variables, functions and attributes (keyword arguments are the
    callee's business, and the callee's own name is read)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
    return names


def imported_names(tree: ast.AST) -> set[str]:
    return {
        (alias.asname or alias.name).split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    }


def code_cells(notebook: Path) -> list[ast.Module]:
    cells = []
    for cell in json.loads(notebook.read_text())["cells"]:
        if cell["cell_type"] != "code":
            continue
        lines = "".join(cell["source"]).splitlines()
        source = "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in lines)
        try:
            cells.append(ast.parse(source))
        except SyntaxError:
            continue
    return cells


def displayed_objects(notebook: Path) -> list[tuple[str, Any]]:
    """The package objects whose source the notebook displays, with the expression naming each."""
    namespace: dict[str, Any] = {}
    cells = code_cells(notebook)
    for tree in cells:
        for node in ast.walk(tree):
            modules = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            modules += [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            if any(module.startswith("mini_infer") for module in modules):
                exec(compile(ast.Module([node], []), str(notebook), "exec"), namespace)
    shown: list[tuple[str, Any]] = []
    for tree in cells:
        loops = {
            node.target.id: node.iter.elts
            for node in ast.walk(tree)
            if isinstance(node, ast.For)
            and isinstance(node.target, ast.Name)
            and isinstance(node.iter, (ast.Tuple, ast.List))
        }
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "show_source" and node.args):
                continue
            argument = node.args[0]
            items = loops.get(argument.id, [argument]) if isinstance(argument, ast.Name) else [argument]
            for item in items:
                expression = ast.unparse(item)
                try:
                    target = eval(expression, namespace)
                except NameError:
                    continue  # the notebook's own code, not the package's
                shown.append((expression, target))
    return shown


def unwrapped(target: Any) -> Any:
    return getattr(target, "fget", None) or getattr(target, "__func__", None) or target


def package_module(target: Any) -> str | None:
    module = inspect.getmodule(unwrapped(target))
    return module.__name__ if module is not None and module.__name__.startswith("mini_infer") else None


def package_source(target: Any) -> str | None:
    return inspect.getsource(unwrapped(target)) if package_module(target) else None


def later_names(chapter: float, target: Any) -> list[str]:
    """The names in ``target``'s source that only chapters after ``chapter`` introduce."""
    tree = ast.parse(textwrap.dedent(package_source(target) or ""))
    module_tree = ast.parse(MODULES[package_module(target) or ""].read_text())
    not_package = bound_names(tree) | library_names() | imported_names(module_tree) | set(ALLOWED)
    first = introduced_by()
    return sorted(
        f"{name} (chapter {first[name]:g})" for name in identifiers(tree) - not_package if first.get(name, 0) > chapter
    )


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda path: path.stem)
def test_a_chapter_shows_nothing_a_later_chapter_introduces(notebook):
    chapter = chapter_number(notebook.stem.split("_")[0])
    later = {
        expression: names
        for expression, target in displayed_objects(notebook)
        if package_source(target) and (names := later_names(chapter, target))
    }
    assert not later, f"{notebook.name} (chapter {chapter:g}) shows later chapters' names: {later}"


def later_mentions(chapter: float, source: str) -> list[str]:
    """Lines of ``source`` that name a later chapter (the student track's region markers aside)."""
    return [
        line.strip()
        for line in source.splitlines()
        if "student:" not in line
        and any(chapter_number(m.group(1) + (m.group(2) or "")) > chapter for m in MENTION.finditer(line))
    ]


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda path: path.stem)
def test_a_chapter_shows_no_code_that_serves_a_later_chapter(notebook):
    """Code written for a later chapter says so in its comments (``# Speculative decoding (chapter
    10): ...``): a chapter that shows such a line shows later chapters' state."""
    stem = notebook.stem.split("_")[0]
    found = {
        expression: lines
        for expression, target in displayed_objects(notebook)
        if (source := package_source(target)) and (stem, expression) not in ALLOWED_MENTIONS
        if (lines := later_mentions(chapter_number(stem), source))
    }
    assert not found, f"{notebook.name} shows code that names later chapters: {found}"


def test_the_check_finds_what_the_notebooks_show_and_would_fire():
    """Every chapter that shows package code is resolved (so the check cannot pass by finding
    nothing), and a name bound only by a later chapter's module is reported."""
    resolved = {path.stem for path in NOTEBOOKS if any(package_source(t) for _, t in displayed_objects(path))}
    showing = {path.stem for path in NOTEBOOKS if "show_source(" in path.read_text()}
    assert resolved == showing, f"show_source targets not resolved in {sorted(showing - resolved)}"
    first = introduced_by()
    assert first["Sequence"] == 6 and first["RadixCache"] == 8 and first["SpeculativeDecoder"] == 10
    assert module_chapter("mini_infer.structured_output") == 9.1
    assert first["BlockPool"] < first["Scheduler"] < first["RadixCache"]
    from mini_infer.speculative import SpeculativeDecoder

    assert later_names(6, SpeculativeDecoder.propose) and not later_names(10, SpeculativeDecoder.propose)
    assert later_mentions(6, "x = 1  # the draft model (chapter 10)\n# student: begin chapter 10") == [
        "x = 1  # the draft model (chapter 10)"
    ]
    assert later_mentions(10, "x = 1  # the draft model (chapter 10)") == []


def test_every_allowed_mention_is_still_shown_and_still_needed():
    """An allowance outlives its reason when the code changes: each one must still name a later
    chapter in what its chapter shows."""
    shown = {
        (path.stem.split("_")[0], expression): target
        for path in NOTEBOOKS
        for expression, target in displayed_objects(path)
    }
    for (stem, expression), reason in ALLOWED_MENTIONS.items():
        assert (stem, expression) in shown, f"chapter {stem} no longer shows {expression}: drop its allowance"
        source = package_source(shown[stem, expression]) or ""
        assert later_mentions(chapter_number(stem), source), f"{expression} no longer needs its allowance ({reason})"
