#!/usr/bin/env bash
# The device check: everything that needs a GPU, in one run of about 8 minutes on a machine with
# one NVIDIA GPU. Writes device_check.json (every figure) and device_check.txt (a summary, and
# each step's log tail) under $OUT (default bench_results/device_check).
#
#   1. the suite's CUDA tests (MINI_INFER_TEST_DEVICE=cuda): model and engine parity in float32,
#      float16 and bfloat16 (tolerances in tests/test_half_precision.py), the float16 overflow
#      model, CUDA graphs against eager steps, sampling, the server;
#   2. mini-infer bench offline on random Qwen2.5-0.5B- and 1.5B-shaped models against
#      transformers on the same GPU, with CUDA graphs and with --enforce-eager;
#   3. mini-infer bench speculative: the 0.5B shape drafting for the 1.5B shape (random weights:
#      acceptance means nothing, the cost of each pass is real).
#
# Python packages: the machine's own torch and transformers are used. What it lacks (FastAPI and
# the server's other needs, the OpenAI client) is installed from wheels in .whl/ when that folder
# exists (scripts/device_wheels.sh fills it, for a machine with no registry), else from the
# registry. Run on this project's device machine, for example:
#   bash scripts/device_wheels.sh    # here, once: .whl/ is git-ignored
#   device run: command "bash scripts/device_check.sh", carry [".whl"], timeout_s 540
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench_results/device_check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
SUMMARY="$OUT/device_check.txt"
: >"$SUMMARY"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false MINI_INFER_TEST_DEVICE=cuda

say() { printf '%s\n' "$*" | tee -a "$SUMMARY"; }
run_step() {  # run_step NAME SECONDS COMMAND...: log to $OUT/NAME.log, one line and the tail to the summary
  local name=$1 limit=$2 start status
  shift 2
  start=$(date +%s)
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  status=$?
  say "== $name: exit $status in $(($(date +%s) - start)) s"
  tail -n 15 "$OUT/$name.log" >>"$SUMMARY"
  return 0
}

if [ -d .whl ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
else  # a machine with a registry: whatever it lacks (on a bare one, torch's CUDA build too)
  $PY -c "import torch, transformers" 2>/dev/null || $PY -m pip install -q "torch>=2.4" "transformers>=4.45"
  $PY -m pip install -q "safetensors>=0.4" "tokenizers>=0.19" "huggingface_hub>=0.23" "tqdm>=4.60" "jinja2>=3.1" \
    "fastapi>=0.110" "uvicorn>=0.29" "prometheus_client>=0.20" "httpx>=0.27" "openai>=1.30" \
    "pytest>=8" "pytest-timeout>=2.2" "hypothesis>=6.100"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
say "$($PY -c 'import torch, transformers; print("torch", torch.__version__, "| transformers", transformers.__version__, "|", torch.cuda.get_device_name(0), "| capability", torch.cuda.get_device_capability(0))')"

TESTS="tests/test_device.py tests/test_layers.py tests/test_model_parity.py tests/test_numerics.py"
TESTS="$TESTS tests/test_half_precision.py tests/test_decode_graphs.py tests/test_engine.py tests/test_speculative.py"
TESTS="$TESTS tests/test_prefix_cache_engine.py tests/test_sampling.py tests/test_server.py"
# shellcheck disable=SC2086
run_step cuda_tests 210 $PY -m pytest -q -p no:cacheprovider $TESTS --junitxml "$OUT/cuda_tests.xml"

BENCH=(-m mini_infer bench offline --device cuda --workloads roofline,throughput,decode --repeats 2)
for shape in qwen2.5-0.5b qwen2.5-1.5b; do
  run_step "offline_${shape}_graphs" 75 $PY "${BENCH[@]}" --shape "$shape" --json "$OUT/offline_${shape}_graphs.json"
  run_step "offline_${shape}_eager" 50 $PY "${BENCH[@]}" --shape "$shape" --skip-hf --enforce-eager --json "$OUT/offline_${shape}_eager.json"
done
models=~/.cache/mini-infer/random-models
run_step speculative 60 $PY -m mini_infer bench speculative --model "$models/qwen2.5-1.5b-bfloat16" \
  --draft-model "$models/qwen2.5-0.5b-bfloat16" --dtype bfloat16 --device cuda --k 1,2,4 --json "$OUT/speculative.json"

$PY - "$OUT" <<'EOF'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
figures = {p.stem: json.loads(p.read_text()) for p in sorted(out.glob("*.json")) if p.name != "device_check.json"}
(out / "device_check.json").write_text(json.dumps(figures, indent=2))
print(f"figures of {len(figures)} runs in {out / 'device_check.json'}")
EOF
