"""Rewrite the first code cell of every chapter to the canonical setup cell.

The cell installs this package's version from the website (``html.baseurl`` in ``_config.yml``)
or from an attached Kaggle dataset; ``mini_infer.notebook_env.first_cell()`` renders it and
``tests/test_notebook_env.py`` checks every notebook against it. Run this after changing the
version or the site address; each notebook keeps its own ``setup(...)`` arguments, outputs and ids.

    python scripts/sync_first_cells.py            # every notebook under notebooks/
    python scripts/sync_first_cells.py --check    # exit 1, naming the notebooks that differ
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import nbformat
import yaml

import mini_infer
from mini_infer.notebook_env import first_cell

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="change nothing; fail if a notebook differs")
    args = parser.parse_args()
    site_url = yaml.safe_load((ROOT / "_config.yml").read_text(encoding="utf-8"))["html"]["baseurl"]
    differing = []
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        cell = next(c for c in nb.cells if c.cell_type == "code")
        match = re.search(r"^env = setup\((.*)\)$", cell.source, flags=re.MULTILINE)
        if match is None:
            print(f"{path.name}: the first code cell does not end with env = setup(...); fix it by hand")
            return 1
        wanted = first_cell(site_url, mini_infer.__version__, arguments=match.group(1))
        if cell.source != wanted:
            differing.append(path.name)
            if not args.check:
                cell.source = wanted
                nbformat.write(nb, path)
    verb = "differ" if args.check else "rewritten"
    print(f"{len(differing)} notebook(s) {verb}: {', '.join(differing) or '-'}")
    return 1 if args.check and differing else 0


if __name__ == "__main__":
    sys.exit(main())
