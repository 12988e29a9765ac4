#!/usr/bin/env bash
# The device check: everything that needs a GPU, in one unattended command of at most 7 minutes,
# install included, on a fresh machine with one NVIDIA GPU and no package registry. Its image must
# have torch (CUDA build) and transformers; everything else comes from .whl/ (scripts/device_wheels.sh
# fills it here, with scripts/device_requirements.txt resolved for CPython 3.10-3.13).
#
# It writes exactly three files under $OUT (default bench_results/device_check), each rewritten after
# every step, so that a step or the whole command stopped by a time limit keeps what had finished:
#   device_check.json          every figure (scripts/device_check.py report builds it)
#   device_check.txt           a summary
#   device_check_logs.tar.gz   each step's full log, the junit file and the steps' JSON
#
# The steps, each under its own time limit and all under one deadline ($DEVICE_CHECK_SECONDS, 400 s):
#   install     the pinned wheels, with --no-index, into a folder put on PYTHONPATH;
#   imports     every module the check imports, and the card (name, capability, torch's arch list);
#   cuda_tests  the suite's CUDA tests (MINI_INFER_TEST_DEVICE=cuda): device choice, layers, model
#               parity, the float16 overflow models, half-precision engines under every scheduling
#               regime (parity counts per dtype in the JSON), decode graphs, KV sizing, roofline;
#   roofline    read bandwidth and matmul peak in bf16 and fp16, timed with CUDA events;
#   kernel      what attention_backend="auto" chooses here and why; chapter 05c's Triton kernel
#               against gather + SDPA on one layer's decode attention (error, time);
#   bench_*     mini-infer bench offline on a random Qwen2.5-0.5B-shaped model against transformers
#               on the same GPU, bf16 and fp16, with CUDA graphs and eagerly (decode graphs captured
#               and left eager per shape), and bf16 with --attention-backend sdpa against the default
#               (Triton where it passed its check); batch-1 decode against weight bytes / bandwidth.
#
# On the project's device machine, after `bash scripts/device_wheels.sh` here:
#   command "bash scripts/device_check.sh", carry [".whl"], timeout_s 480
set -uo pipefail
cd "$(dirname "$0")/.."
START=$(date +%s)
DEADLINE=$((START + ${DEVICE_CHECK_SECONDS:-400}))
OUT=${OUT:-bench_results/device_check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
LOGS=$(mktemp -d /tmp/device_check_logs.XXXXXX)
SITE=$(mktemp -d /tmp/device_check_site.XXXXXX)
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false MINI_INFER_TEST_DEVICE=cuda
export PYTHONPATH="$PWD:$SITE"

report() {  # rebuild the three files under $OUT from $LOGS
  $PY scripts/device_check.py report "$LOGS" "$OUT" >>"$LOGS/report.log" 2>&1
  tar -czf "$OUT/device_check_logs.tar.gz" -C "$LOGS" . 2>/dev/null
}

run_step() {  # run_step NAME SECONDS COMMAND...: under min(SECONDS, what the deadline leaves)
  local name=$1 limit=$2 left start status
  shift 2
  left=$((DEADLINE - $(date +%s) - 10))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 15 ]; then
    printf '{"exit": null, "seconds": 0, "timed_out": true, "skipped": "no time left"}\n' >"$LOGS/step_$name.json"
    report
    return 0
  fi
  start=$(date +%s)
  timeout -k 5 "$limit" "$@" >"$LOGS/$name.log" 2>&1
  status=$?
  printf '{"exit": %d, "seconds": %d, "limit": %d, "timed_out": %s}\n' "$status" "$(($(date +%s) - start))" \
    "$limit" "$([ "$status" -eq 124 ] || [ "$status" -eq 137 ] && echo true || echo false)" >"$LOGS/step_$name.json"
  report
  return 0
}

if [ -d .whl ]; then
  run_step install 60 $PY -m pip install -q --no-index --find-links .whl --target "$SITE" -r scripts/device_requirements.txt
else  # a machine with a registry: the same pins
  run_step install 90 $PY -m pip install -q --target "$SITE" -r scripts/device_requirements.txt
fi
run_step imports 40 $PY scripts/device_check.py imports "$LOGS"

TESTS=(tests/test_device.py tests/test_layers.py tests/test_model_parity.py tests/test_numerics.py
  tests/test_half_precision.py tests/test_decode_graphs.py tests/test_kv_sizing.py tests/test_roofline.py)
if [ -n "${DEVICE_CHECK_DRY_RUN:-}" ]; then  # scripts/device_dry_run.sh: install, imports, collect; no GPU
  run_step collect 60 $PY -m pytest -q -p no:cacheprovider --collect-only "${TESTS[@]}"
  cat "$OUT/device_check.txt"
  exit 0
fi
run_step cuda_tests 150 $PY -m pytest -q -p no:cacheprovider "${TESTS[@]}" --junitxml "$LOGS/cuda_tests.xml"
run_step roofline 25 $PY scripts/device_check.py roofline "$LOGS"
run_step kernel 40 $PY scripts/device_check.py kernel "$LOGS"

BENCH=(--shape qwen2.5-0.5b --device cuda --workloads throughput,decode --num-prompts 64 --output-len 64
  --decode-len 64 --repeats 1 --hf-repeats 1 --gpu-memory-utilization 0.5)
run_step bench_bf16_graphs 60 $PY scripts/device_check.py bench "$LOGS" bf16_graphs "${BENCH[@]}" --dtype bfloat16
run_step bench_bf16_sdpa 50 $PY scripts/device_check.py bench "$LOGS" bf16_sdpa "${BENCH[@]}" --dtype bfloat16 \
  --skip-hf --attention-backend sdpa
run_step bench_bf16_eager 40 $PY scripts/device_check.py bench "$LOGS" bf16_eager "${BENCH[@]}" --dtype bfloat16 \
  --skip-hf --enforce-eager
run_step bench_fp16_graphs 60 $PY scripts/device_check.py bench "$LOGS" fp16_graphs "${BENCH[@]}" --dtype float16
echo "device check: $(($(date +%s) - START)) s; $OUT: $(ls "$OUT" | tr '\n' ' ')"
cat "$OUT/device_check.txt"
