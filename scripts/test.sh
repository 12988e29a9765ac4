#!/usr/bin/env bash
# The whole test suite, on a fresh machine, offline: set-up, lint, types, unit tests, every
# notebook through nbval, the book build (warnings are errors) and the student-version check.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

# Each step's header says how long the run has taken so far: where CI's time goes.
step() { printf '\n=== %s (%d s in)\n' "$*" "$SECONDS"; }
step "ruff";            ruff check mini_infer tests scripts && ruff format --check mini_infer tests scripts
step "mypy";            mypy
step "pytest";          pytest tests -q --durations=20
step "notebooks";       pytest --nbval-lax --nbval-current-env notebooks/ -q -p no:cacheprovider
step "book";            bash scripts/build_book.sh
step "student versions"; python scripts/check_student_versions.py
step "done"
