"""The split of a model over tensor-parallel ranks (chapter 14): which slice each rank reads, and a
model split over two ranks (two threads on a real gloo group) against the whole model."""

from __future__ import annotations

import datetime
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open

from mini_infer.config import ModelConfig
from mini_infer.loader import checkpoint_files, expected_tensors
from mini_infer.model import FullAttention, Qwen2Model
from mini_infer.offline_models import write_random_model
from mini_infer.parallel import shards
from mini_infer.parallel.shards import RankGroup, load_shard, read_shard, shard_config, shard_range, split_axis


def test_split_axis_follows_megatron(tiny_model_dir: Path) -> None:
    config = ModelConfig.from_model_dir(tiny_model_dir)
    axes = {name.split(".", 3)[-1]: split_axis(name) for name in expected_tensors(config)}
    for name in ("self_attn.q_proj.weight", "self_attn.k_proj.bias", "mlp.gate_proj.weight", "mlp.up_proj.weight"):
        assert axes[name] == 0  # column-parallel: output features
    assert axes["self_attn.o_proj.weight"] == axes["mlp.down_proj.weight"] == 1  # row-parallel
    assert axes["input_layernorm.weight"] is None and split_axis("model.norm.weight") is None
    assert split_axis("model.embed_tokens.weight") == split_axis("lm_head.weight") == 0  # vocabulary rows


@pytest.mark.parametrize("length, size", [(8, 2), (7, 2), (151936, 4), (5, 3), (1, 2)])
def test_shard_ranges_cover_the_axis_once(length: int, size: int) -> None:
    ranges = [shard_range(length, rank, size) for rank in range(size)]
    assert [i for r in ranges for i in r] == list(range(length))
    assert all(len(r) == -(-length // size) for r in ranges[:-1])


def test_shard_config_splits_heads_and_refuses_what_does_not_divide(tiny_model_dir: Path) -> None:
    config = ModelConfig.from_model_dir(tiny_model_dir)  # 4 heads, 2 KV heads, vocabulary 512
    assert shard_config(config, 1) is config
    half = shard_config(config, 2)
    assert (half.num_attention_heads, half.num_key_value_heads, half.intermediate_size) == (2, 1, 64)
    assert half.vocab_size == 256 and half.head_dim == config.head_dim
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 must divide num_attention_heads \(4\).*do: 1, 2"):
        shard_config(config, 3)
    with pytest.raises(ValueError, match=r"num_key_value_heads \(2\)"):
        shard_config(config, 4)


class _Recorder:
    """A safetensors slice that records what is read from it."""

    def __init__(self, inner: Any, reads: list[Any]) -> None:
        self.inner, self.reads = inner, reads

    def get_shape(self) -> list[int]:
        return self.inner.get_shape()

    def __getitem__(self, index: Any) -> torch.Tensor:
        self.reads.append(index)
        return self.inner[index]


def test_read_shard_reads_only_the_ranks_slice(tmp_path: Path) -> None:
    model_dir = write_random_model(tmp_path / "odd", "tiny-test", seed=3, dtype="float32", vocab_size=511)
    (file,) = checkpoint_files(model_dir)
    with safe_open(str(file), framework="pt") as f:
        for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"):
            whole = f.get_tensor(name)
            axis = split_axis(name)
            assert axis is not None
            for rank in range(2):
                reads: list[Any] = []
                part = read_shard(name, _Recorder(f.get_slice(name), reads), rank=rank, size=2)
                half = whole.shape[axis] // 2
                assert torch.equal(part, whole.narrow(axis, rank * half, half))
                mine = slice(rank * half, (rank + 1) * half)
                assert reads == [mine if axis == 0 else (slice(None), mine)]  # one read, of this rank's slice only
        embed = f.get_tensor("model.embed_tokens.weight")  # 511 rows: 256 and 255 plus a zero row
        last = read_shard("model.embed_tokens.weight", f.get_slice("model.embed_tokens.weight"), rank=1, size=2)
        assert last.shape == (256, embed.shape[1])
        assert torch.equal(last[:255], embed[256:]) and not last[255].any()


class _CountingGroup(RankGroup):
    """A ``RankGroup`` that counts its collectives and the bytes each contributes."""

    num_collectives = 0
    payload_bytes = 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        out = super().all_reduce(x)
        self.num_collectives += 1
        self.payload_bytes += out.numel() * out.element_size()
        return out

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        self.num_collectives += 1
        self.payload_bytes += x.numel() * x.element_size()
        return super().all_gather(x)


def _run_ranks(size: int, fn: Any) -> list[Any]:
    """``fn(group)`` on ``size`` threads, each a rank of one in-process gloo group."""
    store = dist.HashStore()
    results: list[Any] = [None] * size
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            pg = dist.ProcessGroupGloo(dist.PrefixStore("t", store), rank, size, datetime.timedelta(seconds=60))
            results[rank] = fn(_CountingGroup(rank, size, pg))
        except BaseException as exc:  # noqa: BLE001  (re-raised below, in the test's thread)
            errors.append(exc)

    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("variant", ["tied-gqa2", "untied-gqa4", "odd-vocab"])
def test_a_model_split_over_two_ranks_computes_the_whole_models_logits(
    variant: str, model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    if variant == "odd-vocab":
        model_dir = write_random_model(tmp_path / "odd", "tiny-test", seed=2, dtype="float32", vocab_size=511)
    else:
        model_dir = model_dirs[variant]
    config = ModelConfig.from_model_dir(model_dir)
    ids = torch.tensor([5, 17, 300, 2, 255, 256, 257, config.vocab_size - 1])
    positions = torch.arange(len(ids))
    whole = Qwen2Model.from_pretrained(model_dir, show_progress=False)
    with torch.inference_mode():
        expected = whole.compute_logits(whole.forward(ids, positions, FullAttention()))

    def shard_logits(group: _CountingGroup) -> tuple[torch.Tensor, _CountingGroup]:
        model = load_shard(model_dir, config, torch.float32, torch.device("cpu"), group, show_progress=False)
        with torch.inference_mode():
            return model.compute_logits(model.forward(ids, positions, FullAttention())), group

    (logits0, group0), (logits1, _) = _run_ranks(2, shard_logits)
    assert logits0.shape == expected.shape
    torch.testing.assert_close(logits0, expected, rtol=1e-4, atol=1e-4)
    assert torch.equal(logits0, logits1)  # every rank ends with the same logits
    # One all-reduce for the embedding, two per layer, one all-gather of the logits.
    assert group0.num_collectives == 2 + 2 * config.num_hidden_layers
    hidden_bytes = len(ids) * config.hidden_size * 4
    vocab_bytes = len(ids) * shard_config(config, 2).vocab_size * 4
    assert group0.payload_bytes == (1 + 2 * config.num_hidden_layers) * hidden_bytes + vocab_bytes


def test_a_rank_reads_every_tensor_through_its_slice(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``load_shard`` reads each checkpoint tensor with ``read_shard`` (which reads only the rank's
    slice, above), never whole; and the shard it builds holds exactly those slices."""
    config = ModelConfig.from_model_dir(tiny_model_dir)
    read: list[str] = []

    def recording(name: str, tensor: Any, *, rank: int, size: int) -> torch.Tensor:
        read.append(name)
        assert (rank, size) == (1, 2)
        return read_shard(name, tensor, rank=rank, size=size)

    monkeypatch.setattr(shards, "read_shard", recording)
    model = load_shard(tiny_model_dir, config, torch.float32, torch.device("cpu"), RankGroup(1, 2), show_progress=False)
    assert sorted(read) == sorted(expected_tensors(config))
    whole = Qwen2Model.from_pretrained(tiny_model_dir, show_progress=False)
    half = config.intermediate_size // 2
    assert torch.equal(model.layers[0].down_weight, whole.layers[0].down_weight[:, half:])
    assert torch.equal(model.embed, whole.embed[model.vocab_rows :])  # the tiny vocabulary splits evenly
    assert (model.config.num_attention_heads, model.config.vocab_size) == (
        config.num_attention_heads // 2,
        config.vocab_size,
    )
