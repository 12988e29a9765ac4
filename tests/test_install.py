"""What an install brings: dependency floors that are true, and the offline wheel set for Kaggle.

* llguidance: 1.7.0 is the first release whose ``hf.from_tokenizer`` takes the list of end tokens
  ``structured_output`` passes (1.6.1 raises TypeError at the first grammar; checked by
  unpacking both wheels). pyproject.toml's floor is the module's ``LLGUIDANCE_FLOOR``, and the module
  refuses an older one at import, naming the version found and the command that fixes it.
* transformers: ``from_pretrained(..., dtype=...)`` (the package's offline benchmark) needs 4.56.
* ``scripts/kaggle_wheels.sh`` fetches, for Python 3.11-3.13, every requirement the Kaggle image
  lacks, read from pyproject.toml and resolved with its dependencies, with the platform tags the
  wheels carry (llguidance 1.7+ is manylinux_2_31). Running it needs the package index, so this
  test reads the script; the run itself is a documented command.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from mini_infer.structured_output import LLGUIDANCE_FLOOR, check_llguidance_version

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = (ROOT / "pyproject.toml").read_text(encoding="utf-8")


def floor_of(name: str) -> tuple[int, ...]:
    match = re.search(rf'^\s*"{re.escape(name)}>=([0-9.]+)"', PYPROJECT, flags=re.MULTILINE)
    assert match, f"pyproject.toml sets no floor for {name}"
    return tuple(int(part) for part in match.group(1).split("."))


def test_the_llguidance_floor_is_the_one_structured_output_needs() -> None:
    assert floor_of("llguidance") == LLGUIDANCE_FLOOR == (1, 7, 0)


@pytest.mark.parametrize("version", ["1.7.0", "1.9.1", "2.0.0rc1"])
def test_llguidance_at_or_above_the_floor_is_accepted(version: str) -> None:
    check_llguidance_version(version)


@pytest.mark.parametrize("version", ["1.6.1", "1.0.0", "0.7.30"])
def test_an_older_llguidance_is_refused_naming_it_and_the_fix(version: str) -> None:
    with pytest.raises(ImportError, match=re.escape(f"found {version}")) as error:
        check_llguidance_version(version)
    assert "pip install -U 'llguidance>=1.7.0'" in str(error.value)


def test_importing_structured_output_with_an_old_llguidance_fails_with_that_message() -> None:
    code = (
        "import importlib.metadata as m\n"
        "real = m.version\n"
        "m.version = lambda name: '1.6.1' if name == 'llguidance' else real(name)\n"
        "import mini_infer.structured_output\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode != 0
    assert "ImportError: mini-infer needs llguidance>=1.7.0" in run.stderr and "found 1.6.1" in run.stderr


def test_the_transformers_floor_has_from_pretrained_dtype() -> None:
    # transformers 4.56 renamed from_pretrained's torch_dtype to dtype; earlier releases pass an
    # unknown dtype= on to the model's config and load float32.
    users = [
        p for p in (ROOT / "mini_infer").rglob("*.py") if re.search(r"from_pretrained\([^)]*dtype=", p.read_text())
    ]
    assert users, "nothing calls from_pretrained(..., dtype=...): the floor may be lowered"
    assert floor_of("transformers") >= (4, 56)


def test_kaggle_wheels_are_resolved_for_python_311_to_313_with_their_tags() -> None:
    script = (ROOT / "scripts" / "kaggle_wheels.sh").read_text(encoding="utf-8")
    pythons = re.search(r'KAGGLE_PYTHONS=\$\{KAGGLE_PYTHONS:-"([^"]+)"\}', script)
    assert pythons and pythons.group(1).split() == ["3.11", "3.12", "3.13"]
    assert "manylinux_2_31_x86_64" in script and "manylinux_2_28_x86_64" in script
    download = script[script.index("pip download") : script.index("done", script.index("pip download"))]
    assert "--no-deps" not in download, "the wheels must be resolved with their dependencies"
    assert '"${REQUIREMENTS[@]}"' in download and "pyproject.toml" in script, "requirements come from pyproject.toml"
