"""Every number the prose of a chapter quotes with MyST-NB's glue is one that chapter stored.

A chapter's measurement cell stores the numbers its prose quotes (``notebook_env.glue(name,
value)``, MyST-NB's ``glue``); a Markdown cell pastes them with a glue role (``{glue:text}`name```,
``{glue:text}`name:.2f```, ``{glue}`name```, ``{glue:md}`name```) or directive
(```` ```{glue:figure} name ```` or ``:::{glue:figure} name``). The book's build renders them from
the stored outputs, and fails on a key nobody glued, but only after minutes of Sphinx; this test
finds the same mistakes in a second, without building anything, and names the notebook and key:

* a key the Markdown pastes but no output of that notebook (or of the notebook a ``path::key``
  names) stores;
* a key glued twice in one notebook (MyST-NB keeps the last and warns);
* a ``{glue:text}`key:fmt``` whose stored value cannot be formatted with ``fmt``;
* a ``glue:figure`` whose value holds no image.

MyST-NB stores a glued value as a ``display_data`` output whose metadata is
``{"scrapbook": {"name": KEY, "mime_prefix": PREFIX}}`` and whose MIME types start with
``PREFIX`` (``application/papermill.record/`` when the value is not displayed, else nothing).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import nbformat
import pytest
from nbformat import NotebookNode

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted(p for p in (ROOT / "notebooks").glob("*.ipynb") if not p.name.startswith("_"))

# {glue}`key`, {glue:}`key`, {glue:any}`key`, {glue:text}`key:.2f`, {glue:md}`key:myst`, ...
ROLE = re.compile(r"\{glue(?::(?P<kind>[a-z]*))?\}`(?P<body>[^`]+)`")
# ```{glue:figure} key  or  :::{glue} key  (a directive's argument is the key)
DIRECTIVE = re.compile(r"^[ \t]*(?:`{3,}|~{3,}|:{3,})\{glue(?::(?P<kind>[a-z]*))?\}[ \t]*(?P<body>\S*)", re.MULTILINE)
KINDS_WITH_FORMAT = {"text", "md"}  # roles whose text is key:format (MyST-NB splits at the last colon)


@dataclass(frozen=True)
class GlueReference:
    cell: int  # index of the Markdown cell
    kind: str  # "any", "text", "md", "figure", "math"
    key: str
    fmt: str  # format spec of {glue:text}`key:fmt` ("" if none)
    document: str  # "" for this notebook, else the path before "::"


def glue_references(nb: NotebookNode) -> list[GlueReference]:
    """Every glue role and directive in the notebook's Markdown cells, in order."""
    found = []
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "markdown":
            continue
        for pattern, is_role in ((ROLE, True), (DIRECTIVE, False)):
            for match in pattern.finditer(cell.source):
                kind = match.group("kind") or "any"
                body, fmt = match.group("body"), ""
                if is_role and kind in KINDS_WITH_FORMAT and ":" in body.replace("::", ""):
                    body, fmt = body.rsplit(":", 1)
                document, _, key = body.rpartition("::")
                found.append(GlueReference(index, kind, key, fmt, document))
    return found


def glued_values(nb: NotebookNode) -> tuple[dict[str, dict], list[str]]:
    """The values glued in the notebook's stored outputs (MIME prefix removed), and keys glued twice."""
    values: dict[str, dict] = {}
    twice = []
    for cell in nb.cells:
        for output in cell.get("outputs", []) if cell.cell_type == "code" else []:
            scrapbook = output.get("metadata", {}).get("scrapbook")
            if not scrapbook:
                continue
            key, prefix = scrapbook["name"], scrapbook.get("mime_prefix", "")
            if key in values:
                twice.append(key)
            values[key] = {mime[len(prefix) :]: data for mime, data in output.get("data", {}).items()}
    return values, twice


def format_like_myst_nb(text: str, fmt: str) -> str:
    """What {glue:text}`key:fmt` renders (MyST-NB's ``format_plain_text``); raises if it cannot."""
    try:
        value = ast.literal_eval(text)
    except (SyntaxError, ValueError):
        value = text
    if fmt:
        kind = fmt[-1]
        if kind in "bcdoxX":
            value = int(value)
        elif kind in "eEfFgGn%":
            value = float(value)
        elif kind == "s":
            value = str(value)
    return format(value, fmt) if fmt else str(value)


def glue_problems(nb: NotebookNode, name: str, load=None) -> list[str]:
    """What is wrong with the glue of notebook ``nb`` (called ``name``); ``load(path)`` reads another
    notebook a ``path::key`` reference names."""
    values, twice = glued_values(nb)
    problems = [f"{name}: glue key {key!r} is glued more than once" for key in twice]
    for ref in glue_references(nb):
        where = f"{name}, Markdown cell {ref.cell}"
        stored = values
        if ref.document:
            if load is None:
                problems.append(f"{where}: {ref.document}::{ref.key} names another notebook, which cannot be read")
                continue
            stored = glued_values(load(ref.document))[0]
        if ref.key not in stored:
            source = f"{ref.document}'s" if ref.document else "its"
            problems.append(
                f"{where}: glue key {ref.key!r} is not glued in {source} stored outputs (glue it in the cell that "
                "measures it and re-execute the notebook)"
            )
            continue
        data = stored[ref.key]
        if ref.kind == "text":
            if "text/plain" not in data:
                problems.append(f"{where}: glue key {ref.key!r} has no text/plain value for {{glue:text}}")
                continue
            try:
                format_like_myst_nb("".join(data["text/plain"]), ref.fmt)
            except (TypeError, ValueError) as error:
                problems.append(f"{where}: glue key {ref.key!r} cannot be formatted as {ref.fmt!r}: {error}")
        if ref.kind == "figure" and not any(mime.startswith("image/") for mime in data):
            problems.append(f"{where}: glue key {ref.key!r} holds no image for {{glue:figure}}")
    return problems


# --- every chapter ----------------------------------------------------------------------------


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_glued_reference_is_stored(path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    problems = glue_problems(nb, f"notebooks/{path.name}", load=lambda doc: nbformat.read(path.parent / doc, 4))
    assert not problems, "\n".join(problems)


# --- the check itself, on notebooks made here -------------------------------------------------


def glued_output(key: str, text: str, shown: bool = False) -> NotebookNode:
    prefix = "" if shown else "application/papermill.record/"
    return nbformat.v4.new_output(
        "display_data",
        data={prefix + "text/plain": text},
        metadata={"scrapbook": {"name": key, "mime_prefix": prefix}},
    )


def notebook(markdown: str, *outputs: NotebookNode) -> NotebookNode:
    code = nbformat.v4.new_code_cell("from myst_nb import glue")
    code.outputs = list(outputs)
    return nbformat.v4.new_notebook(cells=[code, nbformat.v4.new_markdown_cell(markdown)])


def test_a_missing_key_is_named_with_its_notebook() -> None:
    nb = notebook("A speedup of {glue:text}`speedup:.2f`, and {glue:text}`ratio:.1f`.", glued_output("ratio", "2.5"))
    (problem,) = glue_problems(nb, "notebooks/99_synthetic.ipynb")
    assert "notebooks/99_synthetic.ipynb" in problem and "'speedup'" in problem and "Markdown cell 1" in problem


def test_every_form_of_role_and_directive_is_found() -> None:
    markdown = "\n".join(
        [
            "{glue}`a` {glue:}`b` {glue:any}`c` {glue:text}`d` {glue:text}`e:.1%` {glue:md}`f:myst`",
            "```{glue:figure} g",
            ":name: fig-g",
            "```",
            ":::{glue:math} h",
            ":::",
            "```{glue} i",
            "```",
            "{glue:text}`other.ipynb::j:.2f`",
        ]
    )
    refs = glue_references(notebook(markdown))
    assert [(r.kind, r.key, r.fmt, r.document) for r in refs] == [
        ("any", "a", "", ""),
        ("any", "b", "", ""),
        ("any", "c", "", ""),
        ("text", "d", "", ""),
        ("text", "e", ".1%", ""),
        ("md", "f", "myst", ""),
        ("text", "j", ".2f", "other.ipynb"),
        ("figure", "g", "", ""),
        ("math", "h", "", ""),
        ("any", "i", "", ""),
    ]
    problems = glue_problems(notebook(markdown), "nb")
    assert len(problems) == 10 and all("is not glued" in p or "another notebook" in p for p in problems)


def test_stored_keys_pass_and_bad_ones_are_named() -> None:
    outputs = [
        glued_output("speedup", "1.0625"),
        glued_output("label", "'1.1x'", shown=True),
        glued_output("n", "'many'"),
    ]
    good = notebook("{glue:text}`speedup:.2f` {glue:text}`label` {glue}`label`", *outputs)
    assert glue_problems(good, "nb") == []
    assert format_like_myst_nb("1.0625", ".2f") == "1.06" and format_like_myst_nb("'1.1x'", "") == "1.1x"
    bad = notebook("{glue:text}`n:.2f` {glue:figure}`speedup`\n```{glue:figure} speedup\n```", *outputs, outputs[0])
    problems = glue_problems(bad, "nb")
    assert any("'speedup' is glued more than once" in p for p in problems)
    assert any("'n' cannot be formatted as '.2f'" in p for p in problems)
    assert any("'speedup' holds no image" in p for p in problems)


def test_a_key_from_another_notebook_is_looked_up_there() -> None:
    other = notebook("", glued_output("j", "3.0"))
    nb = notebook("{glue:text}`other.ipynb::j:.2f` {glue:text}`other.ipynb::k`")
    (problem,) = glue_problems(nb, "nb", load=lambda doc: other)
    assert "other.ipynb's stored outputs" in problem and "'k'" in problem


def test_notebook_env_glue_writes_what_this_check_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    import IPython.display

    from mini_infer import notebook_env

    displayed: list = []
    monkeypatch.setattr(IPython.display, "display", lambda *objects, **kwargs: displayed.append((objects, kwargs)))
    glue_module = pytest.importorskip("myst_nb.ext.glue")
    monkeypatch.setattr(glue_module, "ipy_display", lambda *objects, **kwargs: displayed.append((objects, kwargs)))
    notebook_env.glue("speedup", 1.0625)
    ((bundle,), kwargs) = displayed[0]
    output = nbformat.v4.new_output("display_data", data=bundle, metadata=kwargs["metadata"])
    assert glue_problems(notebook("{glue:text}`speedup:.2f`", output), "nb") == []
