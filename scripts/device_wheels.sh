#!/usr/bin/env bash
# Fill .whl/ (git-ignored) with the wheels scripts/device_check.sh installs on a GPU machine that has
# no package registry: every package of scripts/device_requirements.txt, resolved with their
# dependencies by pip for CPython 3.10, 3.11, 3.12 and 3.13 on x86-64 Linux (the machine's Python
# version is not known in advance), binary wheels only. A pin that cannot be resolved, or a package
# that would end up in two versions, stops the script. Writes .whl/lock.txt (one name==version a
# line). About 20 MB; carry it with the check: carry [".whl"].
#
# Proof that it is complete: bash scripts/device_dry_run.sh installs from .whl/ alone, with
# --no-index, into a clean environment that has only what the GPU image has, and imports
# everything the check runs.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
rm -rf .whl
mkdir -p .whl
for version in 3.10 3.11 3.12 3.13; do
  abi="cp${version/./}"
  "$PY" -m pip download -q --only-binary=:all: -d .whl -r scripts/device_requirements.txt \
    --python-version "$version" --implementation cp --abi "$abi" --abi abi3 --abi none \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any 2>&1 | grep -v "is ignored: it is neither" || true
  # pip download exits non-zero on a failed resolution; check that every pin arrived for this version.
  "$PY" - "$version" <<'PYEOF'
import re, sys
from pathlib import Path

version = sys.argv[1].replace(".", "")
def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()

wheels = {}
for wheel in Path(".whl").glob("*.whl"):
    name, ver, *_ , py, abi, plat = wheel.name[:-4].split("-")
    wheels.setdefault(norm(name), set()).add(ver)
pins = {}
for line in Path("scripts/device_requirements.txt").read_text().splitlines():
    line = line.split("#")[0].strip()
    if line:
        name, ver = line.split("==")
        pins[norm(name)] = ver
missing = [f"{n}=={v}" for n, v in pins.items() if v not in wheels.get(n, set())]
twice = {n: sorted(v) for n, v in wheels.items() if len(v) > 1}
if missing or twice:
    sys.exit(f"cp{version}: missing {missing}, in two versions {twice}")
PYEOF
done
"$PY" - <<'PYEOF'
from pathlib import Path

names = sorted({"==".join(w.name.split("-")[:2]) for w in Path(".whl").glob("*.whl")})
Path(".whl/lock.txt").write_text("\n".join(names) + "\n")
print(f"{len(list(Path('.whl').glob('*.whl')))} wheels of {len(names)} packages in .whl/ (lock: .whl/lock.txt)")
PYEOF
du -sh .whl
