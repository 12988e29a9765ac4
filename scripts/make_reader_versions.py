#!/usr/bin/env python
"""Write the reader copy of every chapter: the chapter less its hidden tests, into ``reader/``.

    python scripts/make_reader_versions.py            # notebooks/*.ipynb -> reader/
    python scripts/make_reader_versions.py --check    # change nothing; fail if reader/ is stale

``notebooks/`` holds the instructors' copy of each chapter, hidden tests included (nbgrader needs
them there). The website's Colab and Kaggle links open ``reader/<chapter>.ipynb`` instead: the
same cells, solutions and outputs, with every region between ``### BEGIN HIDDEN TESTS`` and
``### END HIDDEN TESTS`` removed (``book/_ext/reader_notebooks.py``, which also keeps them off the
rendered pages). ``reader/`` is committed because Colab and Kaggle open notebooks from GitHub
paths; the book build and ``tests/test_notebook_links.py`` refuse a stale copy. Run this script
after changing or re-executing a chapter. It only rewrites JSON: it takes a second.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "book" / "_ext"))
from reader_notebooks import READER_DIR, reader_version  # noqa: E402


def expected_copies(root: Path = ROOT) -> dict[Path, str]:
    """Every reader copy the repository should hold, with its text."""
    return {
        root / READER_DIR / chapter.name: reader_version(chapter.read_text(encoding="utf-8"))
        for chapter in sorted((root / "notebooks").glob("*.ipynb"))
        if not chapter.name.startswith("_")
    }


def stale_copies(root: Path = ROOT) -> list[str]:
    """What is wrong with ``reader/``: copies missing or out of date, and copies of no chapter."""
    expected = expected_copies(root)
    problems = [
        f"{path.relative_to(root)} is missing" if not path.is_file() else f"{path.relative_to(root)} is out of date"
        for path, text in expected.items()
        if not path.is_file() or path.read_text(encoding="utf-8") != text
    ]
    problems += [
        f"{path.relative_to(root)} is the copy of no chapter"
        for path in sorted((root / READER_DIR).glob("*.ipynb"))
        if path not in expected
    ]
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 when reader/ is stale")
    args = parser.parse_args(argv)
    if args.check:
        problems = stale_copies()
        for problem in problems:
            print(f"stale: {problem} (run python scripts/make_reader_versions.py)", file=sys.stderr)
        return 1 if problems else 0
    expected = expected_copies()
    (ROOT / READER_DIR).mkdir(exist_ok=True)
    for path in sorted((ROOT / READER_DIR).glob("*.ipynb")):
        if path not in expected:
            path.unlink()
    for path, text in expected.items():
        path.write_text(text, encoding="utf-8")
    print(f"wrote {len(expected)} reader copies in {READER_DIR}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
