#!/usr/bin/env bash
# The serving benchmark of chapter 12 in one command: our server, measured by servebench.
#
#     bash scripts/bench_serve.sh [OUT_DIR]          # default OUT_DIR: bench_results/serve
#
# What it does, as a user would by hand, with the server and the client in separate processes
# (a client in the server's process would compete with the engine loop for the GIL):
#   1. builds a random-weight model (SHAPE, default small-test) in OUT_DIR/model-SHAPE;
#   2. starts `mini-infer serve` on it and runs a `servebench` sweep of the random dataset over
#      RATES, past the server's capacity up to `inf` (everything at once): sweep.json, sweep.png;
#   3. on a model of PREFIX_SHAPE (default qwen2.5-0.5b: big enough that prefill, not HTTP,
#      dominates a request), runs the shared-prefix dataset with the prefix cache on
#      (prefix_on.json), then restarts the server with --no-enable-prefix-caching and sends the same
#      requests (prefix_off.json);
#   4. `servebench compare` of the two: prefix_compare.png, and the TTFT ratio off / on.
# Everything it prints is also in OUT_DIR/report.txt.
#
# Settings (environment variables): SHAPE, DTYPE (default auto), RATES (default
# 4,8,16,32,64,96,128,inf), NUM_PROMPTS (128), INPUT_LEN (256), OUTPUT_LEN (32), PORT (8765),
# PREFIX_SHAPE, PREFIX (servebench shared-prefix options: the default keeps the server below
# capacity even with the cache off, so the ratio measures prefill saved, not queueing).
# About 6 minutes on a 2-core CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench_results/serve}
SHAPE=${SHAPE:-small-test}
DTYPE=${DTYPE:-auto}
RATES=${RATES:-4,8,16,32,64,96,128,inf}
NUM_PROMPTS=${NUM_PROMPTS:-128}
INPUT_LEN=${INPUT_LEN:-256}
OUTPUT_LEN=${OUTPUT_LEN:-32}
PORT=${PORT:-8765}
PREFIX_SHAPE=${PREFIX_SHAPE:-qwen2.5-0.5b}
PREFIX=${PREFIX:---num-groups 4 --prompts-per-group 4 --system-prompt-len 512 --question-len 32 --output-len 8 --request-rate 0.25}
BIN=${BIN:-.venv/bin}
[ -x "$BIN/mini-infer" ] || BIN=$(dirname "$(command -v mini-infer)")

mkdir -p "$OUT"
exec > >(tee "$OUT/report.txt") 2>&1
URL=http://127.0.0.1:$PORT
SERVER_PID=

stop_server() {
    if [ -n "$SERVER_PID" ]; then
        kill "$SERVER_PID" 2>/dev/null || true
        wait "$SERVER_PID" 2>/dev/null || true
        SERVER_PID=
    fi
}
trap stop_server EXIT

start_server() {  # model directory, then extra `mini-infer serve` options
    MODEL=$1
    shift
    "$BIN/mini-infer" serve --model "$MODEL" --served-model-name bench --dtype "$DTYPE" \
        --port "$PORT" --log-level warning "$@" &
    SERVER_PID=$!
    "$BIN/python" -m mini_infer.server.background "$URL" "$SERVER_PID"
}

servebench() {
    "$BIN/servebench" --base-url "$URL" --model bench --tokenizer "$MODEL" --no-progress "$@"
}

model_dir() {  # a random-weight model of shape $1, written once into OUT
    [ -f "$OUT/model-$1/config.json" ] || "$BIN/mini-infer" random-model --shape "$1" "$OUT/model-$1" >/dev/null
    echo "$OUT/model-$1"
}

echo "== $(date -u +%FT%TZ)  dtype $DTYPE, $(nproc --all) CPUs, OMP_NUM_THREADS=${OMP_NUM_THREADS:-unset}"

echo "== sweep on $SHAPE: random dataset, $NUM_PROMPTS prompts of $INPUT_LEN tokens, $OUTPUT_LEN output tokens, rates $RATES"
start_server "$(model_dir "$SHAPE")"
servebench --dataset random --num-prompts "$NUM_PROMPTS" --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" \
    --request-rate "$RATES" --json "$OUT/sweep.json" --plot "$OUT/sweep.png" | tail -n "$(( $(tr -cd , <<<"$RATES" | wc -c) + 4 ))"

stop_server

echo "== shared-prefix dataset on $PREFIX_SHAPE, prefix cache on ($PREFIX)"
start_server "$(model_dir "$PREFIX_SHAPE")"
# shellcheck disable=SC2086  # PREFIX is a list of options
servebench --dataset shared-prefix $PREFIX --json "$OUT/prefix_on.json" >/dev/null
stop_server

echo "== the same requests, prefix cache off"
start_server "$MODEL" --no-enable-prefix-caching
# shellcheck disable=SC2086
servebench --dataset shared-prefix $PREFIX --json "$OUT/prefix_off.json" >/dev/null
stop_server

"$BIN/servebench" compare "$OUT/prefix_on.json" "$OUT/prefix_off.json" --plot "$OUT/prefix_compare.png"
"$BIN/python" - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
on, off = (json.loads((out / f"prefix_{s}.json").read_text())["runs"][0]["metrics"] for s in ("on", "off"))
failed = on["failed"] + off["failed"] + sum(r["metrics"]["failed"] for r in json.loads((out / "sweep.json").read_text())["runs"])
for stat in ("median", "mean", "p90"):
    print(f"TTFT {stat}, prefix cache off / on: {off['ttft_ms'][stat] / on['ttft_ms'][stat]:.2f}x "
          f"({off['ttft_ms'][stat]:.1f} ms / {on['ttft_ms'][stat]:.1f} ms)")
print(f"failed requests in all runs: {failed}")
sys.exit(1 if failed else 0)
EOF
echo "== wrote $OUT: sweep.json sweep.png prefix_on.json prefix_off.json prefix_compare.png report.txt"
