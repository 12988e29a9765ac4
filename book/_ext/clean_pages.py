"""Pages that load without a console error in a fresh browser.

The browser test (``tests/test_book_site.py``) opens every page with an empty profile and fails
on any console error. Two came from the toolchain itself, not from the book:

* The inline scripts of sphinx-thebe and sphinx-togglebutton reach every page twice in a
  Jupyter Book build, so every page declared ``const THEBE_JS_URL`` twice: "Identifier
  'THEBE_JS_URL' has already been declared". The two copies differ only in how they spell "no
  file" (``None`` and ``""``), so Sphinx's own check for repeated scripts misses them. The fix
  keeps the first of any identical script (same file, attributes and body).
* pydata-sphinx-theme reads the colour mode from ``localStorage`` and falls back to the page
  context's ``default_mode``, which Jupyter Book leaves empty: a first visit logged "Got invalid
  theme mode". The fix sets it to ``auto`` (follow the reader's system) unless set.

Both run on ``html-page-context`` early (priority 100): Sphinx stops that event at the first
handler that returns a template name, so a late handler may never run.
"""

from __future__ import annotations

from typing import Any

from sphinx.application import Sphinx


def _script_key(script: Any) -> tuple[str, tuple[tuple[str, str], ...]]:
    attributes = getattr(script, "attributes", {}) or {}
    return str(getattr(script, "filename", script) or ""), tuple(sorted((k, str(v)) for k, v in attributes.items()))


def clean_page(app: Sphinx, pagename: str, templatename: str, context: dict[str, Any], doctree: Any) -> None:
    context.setdefault("default_mode", "auto")
    scripts = context.get("script_files")
    if not scripts:
        return
    seen: set[tuple[str, tuple[tuple[str, str], ...]]] = set()
    unique = []
    for script in scripts:
        key = _script_key(script)
        if key not in seen:
            seen.add(key)
            unique.append(script)
    # In place: the list is the builder's own, and handlers after this one (MathJax's, on pages
    # with formulas) still add to it.
    scripts[:] = unique


def setup(app: Sphinx) -> dict[str, Any]:
    app.connect("html-page-context", clean_page, priority=100)
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}
