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
# The documentation toolchain is pinned by .ci/docs-constraints.txt (the book builds with
# warnings as errors). Install only when the package metadata or the pins changed or an extra is
# missing, and keep the extras installed before: after the tests' set-up (dev,book,server),
# scripts/run.sh (server) installs nothing again. pip's chatter goes to a log, shown only when the install fails.
stamp="$VENV/.mini-infer-installed"
hash=$(cat pyproject.toml .ci/docs-constraints.txt | sha256sum | cut -d' ' -f1)
had_hash="" had_extras=""  # a fresh venv has no stamp
{ read -r had_hash had_extras <"$stamp"; } 2>/dev/null || true
extras=$(printf '%s\n' ${EXTRAS//,/ } ${had_extras//,/ } | sort -u | paste -sd, -)
if [ "$had_hash" != "$hash" ] || [ "$extras" != "$had_extras" ]; then
  echo "setup: installing mini-infer[$extras]"
  log=$(mktemp)
  if ! "$VENV/bin/python" -m pip install -q -c .ci/docs-constraints.txt -e ".[$extras]" >"$log" 2>&1; then
    cat "$log"
    exit 1
  fi
  echo "$hash $extras" >"$stamp"
fi
