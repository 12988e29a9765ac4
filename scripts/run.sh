#!/usr/bin/env bash
# The main job, on a fresh machine, offline: set up, then generate with the shipped tiny model.
# Any arguments are passed to `mini-infer generate` (for example: --model DIR --prompt "...").
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS=${EXTRAS:-server} bash scripts/setup.sh
if [ $# -eq 0 ]; then
  set -- --model tiny --chat --prompt "What is 12 + 30?" --prompt "What is the capital of France?" --max-tokens 32
fi
exec .venv/bin/mini-infer generate "$@"
