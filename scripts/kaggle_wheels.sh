#!/usr/bin/env bash
# The offline route to the chapters on Kaggle (chapter 13 above all): a Kaggle dataset of wheels.
#
# Fills kaggle/wheels/ (git-ignored) with mini-infer's own wheel and the wheels of what its
# [notebook] extra adds to a Kaggle image (the server's FastAPI, uvicorn and pydantic, httpx, the
# OpenAI client), for Kaggle's Python (KAGGLE_PYTHON, default 3.11: check `python --version` in a
# Kaggle notebook) on x86-64 Linux, and writes the dataset-metadata.json that the Kaggle CLI reads.
# torch, transformers and the rest of mini-infer's dependencies come with Kaggle's image. Then:
#
#   KAGGLE_USER=you bash scripts/kaggle_wheels.sh
#   kaggle datasets create -p kaggle/wheels          # once; `kaggle datasets version` afterwards
#
# attach the dataset to the notebook (Add Input, or "dataset_sources" in kaggle/kernel-metadata.json)
# and, with the internet off, run this in a cell of its own above the setup cell, which then finds
# mini-infer installed and installs nothing:
#
#   %pip install -q --no-index --find-links /kaggle/input/mini-infer-wheels "mini-infer[notebook]"
#
# (the dataset may be mounted under /kaggle/input/datasets/<you>/mini-infer-wheels instead).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=kaggle/wheels
KAGGLE_PYTHON=${KAGGLE_PYTHON:-3.11}
USER_SLUG=${KAGGLE_USER:-your-kaggle-username}
rm -rf "$OUT"
mkdir -p "$OUT"
"$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$OUT" .
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$KAGGLE_PYTHON" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$OUT" \
  fastapi starlette pydantic pydantic-core annotated-types typing-inspection typing-extensions uvicorn h11 click \
  prometheus_client httpx httpcore anyio sniffio idna certifi openai distro jiter
cat >"$OUT/dataset-metadata.json" <<JSON
{
  "title": "mini-infer wheels",
  "id": "$USER_SLUG/mini-infer-wheels",
  "licenses": [{"name": "other"}],
  "description": "mini-infer (Apache-2.0) and the wheels its notebook extra needs, each under its own license, for running the mini-infer chapters without internet."
}
JSON
ls "$OUT"
