#!/usr/bin/env bash
# The offline route to the chapters on Kaggle (chapter 13 above all): a Kaggle dataset of wheels.
#
# Fills kaggle/wheels/ (git-ignored) with mini-infer's own wheel and the wheels of what it and its
# [notebook] extra add to a Kaggle image (llguidance for constrained decoding, the server's
# FastAPI, uvicorn and pydantic, httpx, the OpenAI client), for Kaggle's Python (KAGGLE_PYTHON, default 3.11: check `python --version` in a
# Kaggle notebook) on x86-64 Linux, and writes the dataset-metadata.json that the Kaggle CLI reads.
# torch, transformers and the rest of mini-infer's dependencies come with Kaggle's image. Then:
#
#   KAGGLE_USER=you bash scripts/kaggle_wheels.sh
#   kaggle datasets create -p kaggle/wheels          # once; `kaggle datasets version` afterwards
#
# and attach the dataset to the notebook (Add Input, or "dataset_sources" in
# kaggle/kernel-metadata.json). Every chapter's setup cell looks for mini-infer's wheel under
# /kaggle/input (wherever Kaggle mounts the dataset) and, when it finds it, installs from that
# folder without an index; so the wheel must be the version the notebooks name
# (mini_infer.__version__), and everything it needs that the image lacks must sit beside it.
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
  llguidance fastapi starlette pydantic pydantic-core annotated-types typing-inspection typing-extensions uvicorn h11 click \
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
