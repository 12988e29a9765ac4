"""Kaggle (and Colab) launch links on every notebook page of the book.

Jupyter Book 1.x has launch buttons for Colab, Binder and JupyterHub but none for Kaggle. Kaggle
opens any public notebook from a link of the form

    https://kaggle.com/kernels/welcome?src=<URL of the notebook on GitHub>

This extension builds that link from the one repository URL in ``_config.yml``
(``repository.url``, ``repository.branch``, ``repository.path_to_book``), which Jupyter Book hands
to the theme as ``html_theme_options``. Nothing is pasted into a notebook. Two places get it:

* the theme's launch menu (the rocket in the page header), next to Colab;
* a "Run this chapter" line under the title of every ``.ipynb`` page, with Colab and Kaggle links,
  so the way to run a chapter is visible without opening a menu.

Both open the chapter's reader copy, ``reader/<chapter>.ipynb`` (``reader_notebooks.py``): the
chapter less its hidden tests. The theme's own Colab entry, which would open ``notebooks/`` (the
instructors' copy), is pointed there too.

Only ``.ipynb`` pages get links: Colab and Kaggle open notebooks, not Markdown pages.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from docutils import nodes
from sphinx.application import Sphinx
from sphinx.util import logging
from sphinx.util.osutil import relative_uri

LOGGER = logging.getLogger(__name__)

KAGGLE_WELCOME = "https://kaggle.com/kernels/welcome?src="
STATIC_DIR = Path(__file__).resolve().parent / "static"


def theme_options(app: Sphinx) -> dict[str, Any]:
    return dict(app.config.html_theme_options or {})


def notebook_path_in_repo(app: Sphinx, docname: str) -> str | None:
    """The notebook's path relative to the repository root, or None when the page is not a .ipynb."""
    source = Path(app.env.doc2path(docname))
    if source.suffix != ".ipynb":
        return None
    relative = source.relative_to(Path(app.srcdir)).as_posix()
    book_dir = str(theme_options(app).get("path_to_docs", "")).strip("/")
    return f"{book_dir}/{relative}" if book_dir else relative


def github_blob_url(options: Mapping[str, Any], path_in_repo: str) -> str | None:
    """The file's page on GitHub, from the theme options; None when the repository is not on GitHub."""
    repository = str(options.get("repository_url", "")).rstrip("/")
    if repository.endswith(".git"):
        repository = repository[: -len(".git")]
    if not repository.startswith("https://github.com/"):
        return None
    branch = options.get("repository_branch") or "main"
    return f"{repository}/blob/{branch}/{path_in_repo}"


def kaggle_url(blob_url: str) -> str:
    return KAGGLE_WELCOME + blob_url


def colab_url(options: Mapping[str, Any], blob_url: str) -> str | None:
    launch = options.get("launch_buttons", {}) or {}
    colab = str(launch.get("colab_url", "")).rstrip("/")
    if not colab:
        return None
    return colab + "/github/" + blob_url.removeprefix("https://github.com/")


def launch_urls(options: Mapping[str, Any], path_in_repo: str) -> tuple[str | None, str] | None:
    """(Colab URL or None, Kaggle URL) that open the repository's notebook ``path_in_repo``.

    ``options`` are the theme options Jupyter Book makes of ``_config.yml`` (``repository_url``,
    ``repository_branch``, ``launch_buttons``); None when the repository is not on GitHub.
    ``book/_ext/student_notebooks.py`` builds the student versions' links with it too.
    """
    blob = github_blob_url(options, path_in_repo)
    if blob is None:
        return None
    return colab_url(options, blob), kaggle_url(blob)


def warn_not_github() -> None:
    LOGGER.warning(
        "kaggle_launch: repository.url in _config.yml must be a https://github.com/ URL for Colab and Kaggle links",
        type="kaggle_launch",
    )


def _links(app: Sphinx, docname: str) -> tuple[str | None, str] | None:
    """(colab url or None, kaggle url) of a notebook page's reader copy, None for any other page."""
    from reader_notebooks import reader_path_in_repo

    path = notebook_path_in_repo(app, docname)
    if path is None:
        return None
    links = launch_urls(theme_options(app), reader_path_in_repo(path))
    if links is None:
        warn_not_github()
    return links


def title_section(doctree: nodes.document) -> nodes.section | None:
    """The page's first section when it opens with its title (where the run lines go), else None."""
    section = next(iter(doctree.findall(nodes.section)), None)
    if section is None or not section.children or not isinstance(section[0], nodes.title):
        return None
    return section


def run_line_links(here: str, colab: str | None, kaggle: str) -> str:
    """The Colab (when configured) and Kaggle links of a run line, for the page at ``here``."""
    parts = []
    if colab:
        logo = relative_uri(here, "_static/images/logo_colab.png")
        parts.append(
            f'<a class="mi-run-link mi-colab" href="{colab}" target="_blank" rel="noopener">'
            f'<img src="{logo}" alt="" class="mi-run-icon">Open in Colab</a>'
        )
    parts.append(
        f'<a class="mi-run-link mi-kaggle" href="{kaggle}" target="_blank" rel="noopener">'
        f'<i class="fab fa-kaggle" aria-hidden="true"></i> Open in Kaggle</a>'
    )
    return "".join(parts)


def add_run_line(app: Sphinx, doctree: nodes.document, docname: str) -> None:
    """Insert the "Run this chapter" line right under the page title of a notebook page."""
    links = _links(app, docname)
    section = title_section(doctree)
    if links is None or section is None:
        return
    here = app.builder.get_target_uri(docname)
    line = (
        '<p class="mi-run-line"><span class="mi-run-label">Run this chapter:</span>'
        + run_line_links(here, *links)
        + "</p>"
    )
    section.insert(1, nodes.raw("", line, format="html"))


def add_launch_menu_entry(app: Sphinx, pagename: str, templatename: str, context: dict[str, Any], doctree: Any) -> None:
    """Append Kaggle to the theme's launch menu (sphinx-book-theme builds it at priority 501), and
    point the theme's Colab entry at the reader copy."""
    if pagename not in app.env.all_docs:
        return
    links = _links(app, pagename)
    if links is None:
        return
    colab, kaggle = links
    buttons = context.setdefault("header_buttons", [])
    group = next((b for b in buttons if b.get("label") == "launch-buttons"), None)
    if group is None:
        group = {
            "type": "group",
            "tooltip": "Launch interactive content",
            "icon": "fas fa-rocket",
            "buttons": [],
            "label": "launch-buttons",
        }
        buttons.append(group)
    for button in group["buttons"]:
        if button.get("text") == "Colab" and colab:
            button["url"] = colab
    group["buttons"].append(
        {
            "type": "link",
            "text": "Kaggle",
            "tooltip": "Launch on Kaggle",
            "icon": "fab fa-kaggle",
            "url": kaggle,
            "label": "kaggle-launch-button",
        }
    )


def _add_static_path(app: Sphinx, config: Any) -> None:
    config.html_static_path.append(str(STATIC_DIR))


def setup(app: Sphinx) -> dict[str, Any]:
    app.setup_extension("reader_notebooks")
    app.connect("config-inited", _add_static_path)
    app.add_css_file("kaggle_launch.css")
    app.connect("doctree-resolved", add_run_line)
    app.connect("html-page-context", add_launch_menu_entry, priority=510)
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}
