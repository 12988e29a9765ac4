import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from mini_infer.config import ModelConfig
from mini_infer.loader import (
    CheckpointError,
    checkpoint_files,
    expected_tensors,
    inspect_checkpoint,
    iter_checkpoint,
)
from mini_infer.model import Qwen2Model


@pytest.fixture
def model_copy(tiny_model_dir, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(tiny_model_dir, dst)
    return dst


def _rewrite(model_dir, edit):
    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))


def test_streams_every_expected_tensor_once(tiny_model_dir):
    config = ModelConfig.from_model_dir(tiny_model_dir)
    names = [name for name, _ in iter_checkpoint(tiny_model_dir, config, show_progress=False)]
    assert sorted(names) == sorted(expected_tensors(config))


def test_sharded_checkpoint_is_read_across_files(model_dirs):
    sharded = model_dirs["sharded"]
    assert len(checkpoint_files(sharded)) > 1
    config = ModelConfig.from_model_dir(sharded)
    assert len(inspect_checkpoint(sharded, config)) == len(expected_tensors(config))


def test_each_header_is_parsed_once_per_load(model_dirs, monkeypatch):
    """safe_open parses a file's header; the loader reads names and shapes from that same handle
    and reads no header of its own."""
    import pathlib

    import mini_infer.loader as loader

    sharded = model_dirs["sharded"]
    opened: list[str] = []
    real_safe_open, real_path_open = loader.safe_open, pathlib.Path.open

    def counting_safe_open(path, *args, **kwargs):
        opened.append(pathlib.Path(path).name)
        return real_safe_open(path, *args, **kwargs)

    def counting_path_open(self, *args, **kwargs):
        opened.append(self.name)
        return real_path_open(self, *args, **kwargs)

    monkeypatch.setattr(loader, "safe_open", counting_safe_open)
    monkeypatch.setattr(pathlib.Path, "open", counting_path_open)
    config = ModelConfig.from_model_dir(sharded)
    names = [name for name, _ in iter_checkpoint(sharded, config, show_progress=False)]
    assert sorted(names) == sorted(expected_tensors(config))
    shards = [file.name for file in checkpoint_files(sharded)]
    assert len(shards) > 1 and sorted(n for n in opened if n.endswith(".safetensors")) == sorted(shards)


def test_missing_tensor_named(model_copy):
    _rewrite(model_copy, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*missing"):
        Qwen2Model.from_pretrained(model_copy, show_progress=False)


def test_unexpected_tensor_named(model_copy):
    _rewrite(model_copy, lambda t: t.__setitem__("model.layers.0.mystery.weight", torch.zeros(3)))
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model\.layers\.0\.mystery\.weight'"):
        Qwen2Model.from_pretrained(model_copy, show_progress=False)


def test_misshaped_tensor_named(model_copy):
    _rewrite(model_copy, lambda t: t.__setitem__("model.norm.weight", torch.ones(63)))
    with pytest.raises(CheckpointError, match=r"'model\.norm\.weight'.*\[63\].*\[64\]"):
        Qwen2Model.from_pretrained(model_copy, show_progress=False)


def test_truncated_file_named(model_copy):
    path = model_copy / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match="model.safetensors is truncated"):
        Qwen2Model.from_pretrained(model_copy, show_progress=False)


def test_shard_listed_in_index_but_missing(model_dirs, tmp_path):
    dst = tmp_path / "sharded"
    shutil.copytree(model_dirs["sharded"], dst)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[-1]
    (dst / victim).unlink()
    with pytest.raises(CheckpointError, match=victim):
        Qwen2Model.from_pretrained(dst, show_progress=False)


def test_pickle_only_checkpoint_explained(model_copy):
    (model_copy / "model.safetensors").unlink()
    (model_copy / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(CheckpointError, match="safetensors"):
        Qwen2Model.from_pretrained(model_copy, show_progress=False)


def test_unsupported_architecture_refused(model_copy):
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg["architectures"] = ["MistralForCausalLM"]
    (model_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="MistralForCausalLM"):
        Qwen2Model.from_pretrained(model_copy, show_progress=False)


def test_tied_checkpoint_with_stored_lm_head_is_accepted(model_copy):
    # Some tied checkpoints still store lm_head.weight; transformers ignores it, and so do we.
    _rewrite(model_copy, lambda t: t.__setitem__("lm_head.weight", t["model.embed_tokens.weight"].clone()))
    model = Qwen2Model.from_pretrained(model_copy, show_progress=False)
    assert model.lm_head is model.embed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_weights_cast_to_target_dtype(tiny_model_dir, dtype):
    model = Qwen2Model.from_pretrained(tiny_model_dir, dtype, show_progress=False)
    assert all(p.dtype == dtype for p in model.parameters())
    ref = load_file(str(tiny_model_dir / "model.safetensors"))["model.layers.0.self_attn.k_proj.weight"]
    q_size = model.config.q_size
    fused_k = model.layers[0].qkv_weight[q_size : q_size + model.config.kv_size]
    torch.testing.assert_close(fused_k, ref.to(dtype))


def test_progress_bar_shown(tiny_model_dir, capsys):
    Qwen2Model.from_pretrained(tiny_model_dir, show_progress=True)
    assert "Loading weights" in capsys.readouterr().err
