"""Publish mini-infer's wheel with the website, at the address every chapter's first cell installs.

A chapter's stored outputs were produced by the package at the same commit as the chapter, so the
first cell of a notebook opened on Colab or Kaggle must install *that* package, not whatever
GitHub's ``main`` holds when the reader clicks. The website is built from one commit; this
extension builds the package's wheel from the same tree after the HTML is written, into

    <site>/wheels/mini_infer-<version>-py3-none-any.whl

and ``mini_infer.notebook_env.first_cell()`` installs from ``<html.baseurl>wheels/<that name>``.
``tests/test_book_site.py`` checks that the built site holds exactly the file the cells name.
The same wheel, attached to a Kaggle notebook as a dataset, is what the first cell installs with
the internet off (``scripts/kaggle_wheels.sh``).

The wheel is built without build isolation when setuptools is importable (seconds, no network),
and with it otherwise. setuptools builds in the source tree's ``build/`` folder, and packs whatever
it finds there, so that folder is emptied first: a module deleted from the package must not
travel on in the published wheel.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

from sphinx.application import Sphinx
from sphinx.errors import ExtensionError
from sphinx.util import logging

LOGGER = logging.getLogger(__name__)
WHEELS_DIR = "wheels"


def wheel_name(project_root: Path) -> str:
    """The file name pip gives mini-infer's wheel, from pyproject.toml's name and version."""
    text = (project_root / "pyproject.toml").read_text(encoding="utf-8")  # no tomllib on Python 3.10
    fields = dict(re.findall(r'^(name|version) = "([^"]+)"$', text, flags=re.MULTILINE))
    return f"{fields['name'].replace('-', '_')}-{fields['version']}-py3-none-any.whl"


def build_wheel(app: Sphinx, exception: Exception | None) -> None:
    if exception is not None or app.builder.format != "html":
        return
    root = Path(app.confdir)
    out = Path(app.outdir) / WHEELS_DIR
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.whl"):  # one wheel: the one this tree builds
        old.unlink()
    shutil.rmtree(root / "build", ignore_errors=True)
    command = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", str(out), str(root)]
    if importlib.util.find_spec("setuptools") is not None:
        command.insert(5, "--no-build-isolation")
    result = subprocess.run(command, capture_output=True, text=True)
    expected = out / wheel_name(root)
    if result.returncode != 0 or not expected.is_file():
        raise ExtensionError(
            f"release_wheel: building {expected.name} for the website failed "
            f"(command: {' '.join(command)}):\n{result.stdout}{result.stderr}"
        )
    LOGGER.info("release_wheel: %s (%.1f MB)", expected.relative_to(app.outdir), expected.stat().st_size / 1e6)


def setup(app: Sphinx) -> dict[str, object]:
    app.connect("build-finished", build_wheel)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
