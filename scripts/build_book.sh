#!/usr/bin/env bash
# Build the book's website into _build/html, with every Sphinx warning an error.
# The GitHub Pages workflow (.github/workflows/pages.yml) runs exactly this script.
#
#   scripts/build_book.sh              # incremental build
#   scripts/build_book.sh --all        # rebuild every page (extra arguments go to jupyter-book)
#
# Notebooks are not executed (execute_notebooks: "off" in _config.yml): they are committed with
# their outputs. Uses the jupyter-book of the active environment, else the repository's .venv.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

if command -v jupyter-book >/dev/null 2>&1; then
    JB=(jupyter-book)
elif [[ -x .venv/bin/jupyter-book ]]; then
    JB=(.venv/bin/jupyter-book)
else
    echo "error: jupyter-book not found; install the book extra: pip install -e '.[book]'" >&2
    exit 1
fi

"${JB[@]}" build . -W -n --keep-going "$@"
echo "built: $(pwd)/_build/html/index.html"
