"""Every number the prose of a chapter quotes from a measurement is the one that chapter stored.

A chapter's measurement cell stores the numbers its prose quotes (``notebook_env.glue(name,
value)``, MyST-NB's ``glue``: an invisible output). The prose writes the number itself, so that
Jupyter, Colab and Kaggle show it as the website does, inside a span that names the stored key:

    the rows were <span data-glue="rows_faster_min">1.5</span> times faster
    a speedup of <span data-glue="speedup:.2f">1.06</span>        (a format spec after the key)

The span shows as plain text everywhere. This test fails, naming the notebook, cell and key,
when the number written differs from the stored value formatted as MyST-NB's ``{glue:text}``
would (so re-executing a chapter whose numbers moved fails until the sentence is reread and its
numbers rewritten), when a key is not stored, or glued twice. MyST-NB's glue roles
(``{glue:text}`key```) and directives are refused in prose: only the website renders them, and
Jupyter, Colab and Kaggle show the raw role where the number belongs.

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
# <span data-glue="key">1.5</span> or <span data-glue="key:.2f">1.06</span>: a number the prose quotes.
QUOTED = re.compile(r'<span data-glue="(?P<body>[^"]+)">(?P<shown>[^<]*)</span>')


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


@dataclass(frozen=True)
class QuotedNumber:
    cell: int  # index of the Markdown cell
    key: str
    fmt: str  # format spec ("" if none)
    shown: str  # what the prose writes


def quoted_numbers(nb: NotebookNode) -> list[QuotedNumber]:
    """Every ``<span data-glue="key[:fmt]">shown</span>`` in the notebook's Markdown cells, in order."""
    found = []
    for index, cell in enumerate(nb.cells):
        if cell.cell_type == "markdown":
            for match in QUOTED.finditer(cell.source):
                key, _, fmt = match.group("body").partition(":")
                found.append(QuotedNumber(index, key, fmt, match.group("shown")))
    return found


def glue_problems(nb: NotebookNode, name: str) -> list[str]:
    """What is wrong with the quoted numbers of notebook ``nb`` (called ``name``)."""
    values, twice = glued_values(nb)
    problems = [f"{name}: glue key {key!r} is glued more than once" for key in twice]
    problems += [
        f"{name}, Markdown cell {ref.cell}: a glue {ref.kind} for {ref.key!r} shows raw in Jupyter, Colab and "
        f'Kaggle; write the number in a <span data-glue="{ref.key}">...</span> instead'
        for ref in glue_references(nb)
    ]
    for quoted in quoted_numbers(nb):
        where = f"{name}, Markdown cell {quoted.cell}"
        data = values.get(quoted.key)
        if data is None:
            problems.append(
                f"{where}: glue key {quoted.key!r} is not glued in its stored outputs (glue it in the cell that "
                "measures it and re-execute the notebook)"
            )
            continue
        if "text/plain" not in data:
            problems.append(f"{where}: glue key {quoted.key!r} has no text/plain value")
            continue
        try:
            stored = format_like_myst_nb("".join(data["text/plain"]), quoted.fmt)
        except (TypeError, ValueError) as error:
            problems.append(f"{where}: glue key {quoted.key!r} cannot be formatted as {quoted.fmt!r}: {error}")
            continue
        if stored != quoted.shown:
            problems.append(
                f"{where}: the prose says {quoted.shown!r} for {quoted.key!r}, the stored output {stored!r}: "
                "reread the sentence against the new output and rewrite its numbers"
            )
    return problems


# --- every chapter ----------------------------------------------------------------------------


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_number_the_prose_quotes_is_the_stored_one(path: Path) -> None:
    problems = glue_problems(nbformat.read(path, as_version=4), f"notebooks/{path.name}")
    assert not problems, "\n".join(problems)


def test_the_chapters_quote_stored_numbers() -> None:
    quoted = {path.name: len(quoted_numbers(nbformat.read(path, as_version=4))) for path in NOTEBOOKS}
    assert sum(quoted.values()) >= 20, quoted  # chapters 05, 07, 08, 09 and 10 quote their measurements


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
    nb = notebook(
        'A speedup of <span data-glue="speedup:.2f">1.06</span>, <span data-glue="ratio:.1f">2.5</span>.',
        glued_output("ratio", "2.5"),
    )
    (problem,) = glue_problems(nb, "notebooks/99_synthetic.ipynb")
    assert "notebooks/99_synthetic.ipynb" in problem and "'speedup'" in problem and "Markdown cell 1" in problem


def test_every_form_of_role_and_directive_is_found_and_refused() -> None:
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
    problems = glue_problems(notebook(markdown, glued_output("a", "1")), "nb")
    assert len(problems) == 10 and all("shows raw in Jupyter, Colab and Kaggle" in p for p in problems)


def test_a_number_that_differs_from_its_output_is_named() -> None:
    outputs = [glued_output("speedup", "1.0625"), glued_output("label", "'1.1x'", shown=True)]
    good = notebook('<span data-glue="speedup:.2f">1.06</span> and <span data-glue="label">1.1x</span>', *outputs)
    assert glue_problems(good, "nb") == []
    assert [(q.key, q.fmt, q.shown) for q in quoted_numbers(good)] == [
        ("speedup", ".2f", "1.06"),
        ("label", "", "1.1x"),
    ]
    stale = notebook('A speedup of <span data-glue="speedup:.2f">1.10</span>.', *outputs)
    (problem,) = glue_problems(stale, "nb")
    assert "the prose says '1.10' for 'speedup', the stored output '1.06'" in problem


def test_stored_keys_that_cannot_be_quoted_are_named() -> None:
    outputs = [glued_output("speedup", "1.0625"), glued_output("n", "'many'")]
    bad = notebook('<span data-glue="n:.2f">1.00</span>', *outputs, outputs[0])
    problems = glue_problems(bad, "nb")
    assert any("'speedup' is glued more than once" in p for p in problems)
    assert any("'n' cannot be formatted as '.2f'" in p for p in problems)
    assert format_like_myst_nb("1.0625", ".2f") == "1.06" and format_like_myst_nb("'1.1x'", "") == "1.1x"


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
    assert glue_problems(notebook('<span data-glue="speedup:.2f">1.06</span>', output), "nb") == []
