#!/usr/bin/env bash
# The offline route to the chapters on Kaggle (chapter 13 above all): a Kaggle dataset of wheels.
#
# Fills kaggle/wheels/ (git-ignored) with mini-infer's own wheel and the wheels of everything it
# and its [notebook] extra need beyond a Kaggle image, resolved with their dependencies (pip
# download, not a hand-made --no-deps list that misses a new release's dependency, such as
# fastapi's annotated-doc), for every Python a notebook service runs (KAGGLE_PYTHONS, default
# "3.11 3.12 3.13": Kaggle runs 3.12, Colab 3.13) on x86-64 Linux, with the platform tags those
# wheels carry (llguidance 1.7 and later are manylinux_2_31; Kaggle's and Colab's glibc is newer).
# One flat folder: pip picks, for the Python it runs on, the wheels whose tags match. Then:
#
#   KAGGLE_USER=you bash scripts/kaggle_wheels.sh
#   kaggle datasets create -p kaggle/wheels          # once; `kaggle datasets version` afterwards
#
# and attach the dataset, mini-infer-wheels, to the notebook (Add Input, or "dataset_sources" in
# kaggle/kernel-metadata.json). Every chapter's first cell looks for mini-infer's wheel a few
# folders under /kaggle/input (wherever Kaggle mounts the dataset) and, when it finds it, installs
# from that folder without an index; so the wheel must be the version the notebooks name
# (mini_infer.__version__), and everything it needs that the image lacks must sit beside it.
#
# What the image has is not downloaded (IMAGE_HAS: torch, transformers, matplotlib, ipywidgets,
# ...); every other requirement of pyproject.toml's dependencies and [notebook] extra is, with the
# floors pyproject.toml sets (llguidance>=1.7.0, ...).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=kaggle/wheels
KAGGLE_PYTHONS=${KAGGLE_PYTHONS:-"3.11 3.12 3.13"}
USER_SLUG=${KAGGLE_USER:-your-kaggle-username}
PLATFORMS=(manylinux_2_35_x86_64 manylinux_2_34_x86_64 manylinux_2_31_x86_64 manylinux_2_28_x86_64
           manylinux_2_17_x86_64 manylinux2014_x86_64 linux_x86_64)
IMAGE_HAS="torch safetensors transformers tokenizers huggingface_hub tqdm jinja2 matplotlib ipywidgets"

rm -rf "$OUT"
mkdir -p "$OUT"
"$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$OUT" .

# The requirements to fetch, read from pyproject.toml (one place for names and floors).
mapfile -t REQUIREMENTS < <(IMAGE_HAS="$IMAGE_HAS" "$PY" - <<'PY'
import os, re
text = open("pyproject.toml", encoding="utf-8").read()
def block(start):
    body = text.split(start, 1)[1].split("]", 1)[0]
    return re.findall(r'^\s*"([^"]+)"', body, flags=re.MULTILINE)
image = set(os.environ["IMAGE_HAS"].split())
for requirement in block("dependencies = [") + block("notebook = ["):
    name = re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower().replace("-", "_")
    if name not in image:
        print(requirement)
PY
)
[[ ${#REQUIREMENTS[@]} -gt 0 ]] || { echo "error: no requirement read from pyproject.toml" >&2; exit 1; }

platform_args=()
for platform in "${PLATFORMS[@]}"; do platform_args+=(--platform "$platform"); done
for version in $KAGGLE_PYTHONS; do
  echo "Python $version: ${REQUIREMENTS[*]}"
  "$PY" -m pip download -q --only-binary=:all: --python-version "$version" --implementation cp \
    "${platform_args[@]}" -d "$OUT" "${REQUIREMENTS[@]}"
done

cat >"$OUT/dataset-metadata.json" <<JSON
{
  "title": "mini-infer wheels",
  "id": "$USER_SLUG/mini-infer-wheels",
  "licenses": [{"name": "other"}],
  "description": "mini-infer (Apache-2.0) and the wheels its notebook extra needs beyond Kaggle's image, for Python $KAGGLE_PYTHONS, each under its own license, for running the mini-infer chapters without internet."
}
JSON
ls "$OUT"
