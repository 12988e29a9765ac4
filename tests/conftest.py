"""Shared fixtures: small random-weight Qwen2 models written once per test session, and the
device the tests run on.

Nothing here downloads anything: every model is built by ``mini_infer.offline_models``.

``MINI_INFER_TEST_DEVICE=cuda pytest`` runs the suite's engines on CUDA: every engine built with
``device="auto"`` resolves to it (through ``MINI_INFER_DEVICE``), and the tests that place
tensors themselves read ``TEST_DEVICE``. Without it the suite runs on the CPU, even on a GPU
machine.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from mini_infer.offline_models import write_random_model

TEST_DEVICE = torch.device(os.environ.get("MINI_INFER_TEST_DEVICE", "cpu"))
os.environ["MINI_INFER_DEVICE"] = str(TEST_DEVICE)  # what device="auto" means in every test
if TEST_DEVICE.type == "cpu":  # Triton kernels run through its interpreter, whichever test imports it first
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Shapes chosen to cover what differs between real checkpoints: tied and untied embeddings,
# GQA ratios 2, 4 and 1 (multi-head), and a head_dim that is not hidden / heads.
MODEL_VARIANTS = {
    "tied-gqa2": dict(shape="tiny-test"),
    "untied-gqa4": dict(shape="small-test"),
    "mha-headdim32": dict(shape="tiny-test", num_key_value_heads=4, head_dim=32),
    "sharded": dict(shape="tiny-test", num_hidden_layers=3, max_shard_bytes=60_000),
}


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    dirs = {}
    for name, spec in MODEL_VARIANTS.items():
        spec = dict(spec)
        shape = spec.pop("shape")
        # A larger init scale than real training gives sharper distributions, so that greedy
        # comparisons are decided by clear margins rather than float noise.
        dirs[name] = write_random_model(root / name, shape, seed=1, dtype="float32", init_std=0.1, **spec)
    return dirs


@pytest.fixture(scope="session")
def tiny_model_dir(model_dirs: dict[str, Path]) -> Path:
    return model_dirs["tied-gqa2"]


@pytest.fixture(autouse=True)
def _deterministic() -> None:
    torch.manual_seed(0)
