#!/usr/bin/env bash
# servebench against SGLang's benchmark client, on the same server and the same workload (chapter 12).
#
#     bash scripts/compare_servebench.sh PATH/TO/bench_serving.py [OUT_DIR]   # default bench_results/servebench_peer
#
# A benchmark client must measure the server, not itself: this runs `servebench` and SGLang's
# `bench_serving.py` (the single-file client of SGLang 0.5.2; `pip download sglang==0.5.2 --no-deps`
# and take sglang/bench_serving.py out of the wheel) alternately, RUNS times each, against one
# `mini-infer serve` on the tiny model, at request rate inf, and prints every run's output and
# request throughput, mean and median TTFT and ITL, and the ratio servebench / SGLang of the means,
# with the server's own mean TTFT of each run (its /metrics histogram, from each request's arrival
# in the server, the warm-up request included): a TTFT gap that the server does not see lies
# between a client's send and the server's intake of the request.
#
# The workload is the same on both sides, prompt for prompt: servebench's random dataset of run i
# (NUM_PROMPTS prompts of exactly INPUT_LEN tokens, seed i) is written as a ShareGPT file that
# SGLang's client reads (--dataset-name sharegpt --sharegpt-output-len OUTPUT_LEN); both ask for
# OUTPUT_LEN tokens with ignore_eos, on /v1/completions, after one warm-up request. (SGLang's own
# random-ids prompts are not: decoded runs of token ids re-encode to 125-316 tokens, 174 on
# average, for 128 asked, on the tiny model's tokenizer.) The prefix cache is off, or the second
# client of a pair would find the first one's prompts in it.
#
# PEER_PYTHON is a Python with what bench_serving.py imports (aiohttp, numpy, requests, tqdm,
# transformers): a separate virtual environment, e.g.
#     python3 -m venv /tmp/venv-sglang && /tmp/venv-sglang/bin/pip install aiohttp numpy requests tqdm transformers
# Settings (environment variables): PEER_PYTHON (default python3), RUNS (3), NUM_PROMPTS (200),
# INPUT_LEN (128), OUTPUT_LEN (128), PORT (8766), BIN (default .venv/bin), PIN (default 0; 1: the
# server on CPU 0 with one torch thread, the clients on CPU 1, so that a client's own work cannot
# slow the server down and shows only if the client falls behind the stream).
set -euo pipefail
if [ $# -lt 1 ] || [ ! -f "$1" ]; then
    echo "usage: bash scripts/compare_servebench.sh PATH/TO/bench_serving.py [OUT_DIR]" >&2
    echo "(bench_serving.py: SGLang's client, from 'pip download sglang==0.5.2 --no-deps')" >&2
    exit 2
fi
PEER=$(realpath "$1")
cd "$(dirname "$0")/.."
OUT=${2:-bench_results/servebench_peer}
PEER_PYTHON=${PEER_PYTHON:-python3}
RUNS=${RUNS:-3}
NUM_PROMPTS=${NUM_PROMPTS:-200}
INPUT_LEN=${INPUT_LEN:-128}
OUTPUT_LEN=${OUTPUT_LEN:-128}
PORT=${PORT:-8766}
BIN=${BIN:-.venv/bin}
PIN=${PIN:-0}
SERVER_CPU=() CLIENT_CPU=()
if [ "$PIN" = 1 ]; then
    SERVER_CPU=(env OMP_NUM_THREADS=1 taskset -c 0) CLIENT_CPU=(taskset -c 1)
fi
[ -x "$BIN/mini-infer" ] || BIN=$(dirname "$(command -v mini-infer)")
"$PEER_PYTHON" -c 'import aiohttp, numpy, requests, tqdm, transformers' 2>/dev/null || {
    echo "PEER_PYTHON=$PEER_PYTHON cannot import what bench_serving.py needs (see the comment at the top)" >&2
    exit 2
}

mkdir -p "$OUT"
rm -f "$OUT"/servebench_*.json "$OUT"/sglang_*.jsonl "$OUT"/prompts_*.json "$OUT"/server_ttft.txt
URL=http://127.0.0.1:$PORT
TOKENIZER=$("$BIN/python" -c 'from mini_infer.model_source import resolve_model; print(resolve_model("tiny"))')

"${SERVER_CPU[@]}" "$BIN/mini-infer" serve --model tiny --served-model-name tiny --port "$PORT" --log-level warning \
    --no-enable-prefix-caching &
SERVER_PID=$!
trap 'kill $SERVER_PID 2>/dev/null || true; wait $SERVER_PID 2>/dev/null || true' EXIT
"$BIN/python" -m mini_infer.server.background "$URL" "$SERVER_PID"

server_ttft() {  # the server's own TTFT histogram (from each request's arrival) after the run $1
    curl -s "$URL/metrics" | { grep -E '^mini_infer:time_to_first_token_seconds_(sum|count)' || true; } |
        sed "s/^/$1 /" >>"$OUT/server_ttft.txt"
}
server_ttft "start 0"

echo "== $(date -u +%FT%TZ)  $(nproc --all) CPUs; tiny model; $NUM_PROMPTS prompts x $INPUT_LEN tokens in," \
    "$OUTPUT_LEN out; rate inf; $RUNS runs each, alternating; PIN=$PIN"
for i in $(seq "$RUNS"); do
    "$BIN/python" - "$TOKENIZER" "$NUM_PROMPTS" "$INPUT_LEN" "$OUTPUT_LEN" "$i" "$OUT/prompts_$i.json" <<'EOF'
import json, sys
from mini_infer.bench.serve.datasets import random_dataset
from mini_infer.tokenizer import Tokenizer

tokenizer, (n, input_len, output_len, seed), path = Tokenizer(sys.argv[1]), map(int, sys.argv[2:6]), sys.argv[6]
# servebench --seed i measures the dataset of seed i: the same prompts, in ShareGPT's layout
rows = [{"conversations": [{"from": "human", "value": r.prompt}, {"from": "gpt", "value": "-"}]}
        for r in random_dataset(n, input_len, output_len, 0.0, seed, tokenizer)]
with open(path, "w") as f:
    json.dump(rows, f)
EOF
    "${CLIENT_CPU[@]}" "$BIN/servebench" --base-url "$URL" --model tiny --tokenizer "$TOKENIZER" --dataset random \
        --num-prompts "$NUM_PROMPTS" --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" --request-rate inf \
        --warmup-requests 1 --seed "$i" --no-progress --json "$OUT/servebench_$i.json" >/dev/null
    server_ttft "servebench $i"
    "${CLIENT_CPU[@]}" "$PEER_PYTHON" "$PEER" --backend vllm --base-url "$URL" --model tiny --tokenizer "$TOKENIZER" \
        --dataset-name sharegpt --dataset-path "$OUT/prompts_$i.json" --sharegpt-output-len "$OUTPUT_LEN" \
        --num-prompts "$NUM_PROMPTS" --request-rate inf --warmup-requests 1 \
        --seed "$i" --disable-tqdm --output-file "$OUT/sglang_$i.jsonl" >/dev/null 2>&1
    server_ttft "sglang $i"
done
"$BIN/python" -m mini_infer.bench.serve.peer "$OUT" | tee "$OUT/report.txt"
