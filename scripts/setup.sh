#!/usr/bin/env bash
# Creates the virtual environment .venv (once) and installs mini-infer into it, editable, with
# the extras named in $EXTRAS (default: everything the tests, the book and the server need).
# Torch is installed first and only when missing, so a preinstalled torch (Colab, Kaggle, a
# CUDA build) is kept; $TORCH_SPEC chooses which torch to install on a fresh machine.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
EXTRAS=${EXTRAS:-dev,book,server}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}

if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV with $("$PYTHON" --version)"
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
fi
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  echo "setup: installing $TORCH_SPEC"
  "$VENV/bin/python" -m pip install -q "$TORCH_SPEC"
fi
# Reinstall only when the package metadata or the extras changed.
stamp="$VENV/.mini-infer-installed"
want="$(sha256sum pyproject.toml | cut -d' ' -f1) $EXTRAS"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "setup: installing mini-infer[$EXTRAS]"
  "$VENV/bin/python" -m pip install -q -e ".[$EXTRAS]"
  echo "$want" > "$stamp"
fi
