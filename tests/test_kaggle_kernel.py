"""``kaggle/kernel-metadata.json``: what ``kaggle kernels push -p kaggle`` reads to run chapter 13 on a
Kaggle T4 with both Qwen2.5 models attached (the fields of the Kaggle CLI's kernel metadata)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
FOLDER = ROOT / "kaggle"
METADATA = json.loads((FOLDER / "kernel-metadata.json").read_text())


def slugify(title: str) -> str:
    """Kaggle's rule for a kernel's slug: its title in lower case, dashes for everything else."""
    return re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")


def test_the_kernel_is_the_chapter_13_notebook_of_the_book() -> None:
    # The reader copy (reader/, the chapter less its hidden tests): what the website's links open too.
    notebook = (FOLDER / METADATA["code_file"]).resolve()
    assert notebook == ROOT / "reader" / "13_kaggle_t4.ipynb" and notebook.is_file()
    assert "HIDDEN TESTS" not in notebook.read_text()
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    files = [chapter["file"] for part in toc["parts"] for chapter in part["chapters"]]
    assert "notebooks/13_kaggle_t4" in files
    assert (METADATA["language"], METADATA["kernel_type"]) == ("python", "notebook")


def test_the_id_is_the_titles_slug() -> None:
    owner, slug = METADATA["id"].split("/")
    assert owner and slug == slugify(METADATA["title"]) and len(METADATA["title"]) >= 5


def test_a_t4_with_internet_and_both_models_attached() -> None:
    assert METADATA["enable_gpu"] is True and METADATA["machine_shape"] == "NvidiaTeslaT4"
    assert METADATA["enable_internet"] is True  # the first cell installs mini-infer from GitHub
    sources = METADATA["model_sources"]
    # owner/model/framework/variation/version, the form kaggle kernels push attaches
    assert all(len(source.split("/")) == 5 and all(source.split("/")) for source in sources)
    chapter = (ROOT / "notebooks" / "13_kaggle_t4.ipynb").read_text()
    for source in sources:
        handle = source.rsplit("/", 1)[0]
        variation = handle.rsplit("/", 1)[1]
        assert handle.startswith("qwen-lm/qwen2.5/transformers/") and variation in chapter  # what it searches


def test_the_setup_page_says_how_to_push_it() -> None:
    setup = (ROOT / "book" / "setup.md").read_text()
    assert "kaggle kernels push -p kaggle" in setup and METADATA["id"].split("/")[0] in setup
