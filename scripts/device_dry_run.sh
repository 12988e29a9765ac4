#!/usr/bin/env bash
# Proof, on a machine without a GPU, that scripts/device_check.sh can start on the GPU machine: an
# environment with only what the GPU image has (torch, its Triton where there is one, transformers,
# pydantic, and what they depend on, taken from this project's environment), the check's own install
# step from .whl/ alone (--no-index), then its import step and the collection of every test it runs.
# Any module missing from .whl/ fails here. Run bash scripts/device_wheels.sh first.
#
#   bash scripts/device_dry_run.sh    # uses $PYTHON (default: python3), which must have torch
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -d .whl ] || { echo "no .whl/: run bash scripts/device_wheels.sh first" >&2; exit 1; }
DRY=$(mktemp -d /tmp/device_dry_run.XXXXXX)
# A clean virtual environment, and the "image": the distributions of torch, triton, transformers and
# pydantic and everything they require, linked from $PY's environment into one folder on its path.
"$PY" -c 'import sys; print(sys.base_prefix)' >/dev/null
BASE=$("$PY" -c 'import sys, os; print(os.path.join(sys.base_prefix, "bin", "python3"))')
"$BASE" -m venv "$DRY/venv"
"$PY" - "$DRY/image" <<'PYEOF'
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

image = Path(sys.argv[1])
image.mkdir()
todo, seen = ["torch", "triton", "transformers", "pydantic"], set()
while todo:
    name = todo.pop()
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        continue  # triton is not on every platform
    key = dist.metadata["Name"].lower().replace("_", "-")
    if key in seen:
        continue
    seen.add(key)
    for line in dist.requires or []:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            todo.append(req.name)
    for top in {f.parts[0] for f in dist.files or [] if not f.parts[0].endswith(".pth") and f.parts[0] != ".."}:
        source = Path(dist.locate_file(top))
        if source.exists() and not (image / top).exists() and not top.startswith("__"):
            (image / top).symlink_to(source)
print(f"image: {len(seen)} distributions: {', '.join(sorted(seen))}")
PYEOF
SITE_PACKAGES=$("$DRY/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$DRY/image" >"$SITE_PACKAGES/gpu_image.pth"
"$DRY/venv/bin/python" -c 'import torch, transformers, pydantic; print("image: torch", torch.__version__, "transformers", transformers.__version__, "pydantic", pydantic.VERSION)'
for missing in llguidance fastapi uvicorn pytest; do
  if "$DRY/venv/bin/python" -c "import $missing" 2>/dev/null; then echo "the image stand-in has $missing: not a clean test" >&2; exit 1; fi
done
OUT="$DRY/out" PYTHON="$DRY/venv/bin/python" DEVICE_CHECK_DRY_RUN=1 bash scripts/device_check.sh
"$DRY/venv/bin/python" - "$DRY/out" <<'PYEOF'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
data = json.loads((out / "device_check.json").read_text())
steps = data["steps"]
assert sorted(p.name for p in out.iterdir()) == ["device_check.json", "device_check.txt", "device_check_logs.tar.gz"]
bad = {name: s for name, s in steps.items() if s["exit"] != 0}
errors = data.get("imports", {}).get("import_errors")
if bad or errors or "collect" not in steps:
    sys.exit(f"dry run FAILED: steps {bad}, import errors {errors}")
print(f"dry run passed: {', '.join(steps)} exit 0; {len(data['imports']['versions'])} modules imported; 3 files under $OUT")
PYEOF
