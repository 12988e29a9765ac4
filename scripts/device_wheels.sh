#!/usr/bin/env bash
# Fill .whl/ (git-ignored) with the wheels scripts/device_check.sh needs on a GPU machine that has
# torch and transformers but no package registry (Python 3.12, x86-64 Linux): the server's
# FastAPI, uvicorn and pydantic, and the OpenAI client the server tests use. About 6 MB.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
rm -rf .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl \
  fastapi starlette pydantic pydantic-core annotated-types typing-inspection uvicorn openai distro jiter sniffio \
  typing-extensions
ls .whl
