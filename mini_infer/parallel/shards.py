"""A Qwen2 model split over tensor-parallel ranks: who holds which slice, and the collectives (chapter 14).

Megatron-LM's split of a transformer layer over N ranks (``shard_config`` gives each rank's shapes):

* **column-parallel**: the q, k, v projections (and their biases) and the gate and up projections
  are split along their *output* features. Rank r holds query heads ``[r H/N, (r + 1) H/N)``, the
  KV heads of the same range, and MLP columns ``[r I/N, (r + 1) I/N)``: it computes the attention
  of its own heads and its part of the MLP's hidden layer without any communication;
* **row-parallel**: the o and down projections are split along their *input* features, the same
  ranges; each rank's product is a partial sum of the whole output, and one all-reduce adds them
  up (``ShardedQwen2Model.add_projection``): two all-reduces per layer, in float32 under float16
  weights (the ranks' partial sums each fit float16, their total need not);
* **vocabulary-parallel**: the embedding and the LM head are split by vocabulary rows,
  ``ceil(V / N)`` each (the last rank's padded with zero rows): a lookup is one more all-reduce,
  the logits one all-gather;
* the RMSNorm weights are small and every rank holds them whole.

``ShardedQwen2Model`` is chapter 03's model built at a rank's shapes; it overrides the three
methods through which the model reaches its embedding, its o and down projections and its output
projection, and runs the same ``forward``. ``load_shard`` reads a rank's slice of each tensor
straight from the safetensors file (``read_shard``, on ``get_slice``), so the N ranks together
read the checkpoint once. ``RankGroup`` holds the two collectives, on a ``torch.distributed``
process group.

Invariant: a model split over N ranks computes the logits of the whole model, up to the rounding
of the partial sums (the tests require identical greedy tokens).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm.auto import tqdm

from mini_infer.config import ModelConfig
from mini_infer.layers import linear
from mini_infer.loader import open_checkpoint
from mini_infer.model import Qwen2Model

# Split along the input features (axis 1 of the weight): each rank's product is a partial sum.
ROW_PARALLEL = ("self_attn.o_proj.weight", "mlp.down_proj.weight")
# Held whole by every rank.
REPLICATED = ("input_layernorm.weight", "post_attention_layernorm.weight", "model.norm.weight")


def shard_config(config: ModelConfig, size: int) -> ModelConfig:
    """The shapes one of ``size`` tensor-parallel ranks holds: ``1 / size`` of the attention heads,
    the KV heads and the MLP's width, and ``ceil(vocab / size)`` rows of the vocabulary (the last
    rank's padded). ``config`` itself for one rank."""
    if size == 1:
        return config
    split = {n: getattr(config, n) for n in ("num_attention_heads", "num_key_value_heads", "intermediate_size")}
    if any(value % size for value in split.values()):
        sizes = [n for n in range(1, config.num_key_value_heads + 1) if not any(v % n for v in split.values())]
        raise ValueError(
            f"tensor_parallel_size={size} must divide "
            + ", ".join(f"{name} ({value})" for name, value in split.items())
            + f": every rank holds the same number of heads; sizes that do: {', '.join(map(str, sizes))}"
        )
    return replace(
        config,
        **{name: value // size for name, value in split.items()},
        vocab_size=-(-config.vocab_size // size),
    )


def split_axis(name: str) -> int | None:
    """The axis of checkpoint tensor ``name`` that is split over the ranks: 1 for the row-parallel
    projections, None for what every rank holds whole, else 0 (output features, vocabulary rows)."""
    if name.endswith(REPLICATED):
        return None
    return 1 if name.endswith(ROW_PARALLEL) else 0


def shard_range(length: int, rank: int, size: int) -> range:
    """Rank ``rank``'s indices of an axis of ``length`` split over ``size`` ranks: equal runs of
    ``ceil(length / size)``, the last one shorter when ``size`` does not divide ``length``."""
    part = -(-length // size)
    return range(min(rank * part, length), min((rank + 1) * part, length))


def read_shard(name: str, tensor: Any, *, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s slice of checkpoint tensor ``name``, read from ``tensor`` (a safetensors
    slice: only the bytes of the slice are read), padded with zeros to ``ceil(length / size)``."""
    axis = split_axis(name)
    if axis is None:
        return tensor[:]
    length = tensor.get_shape()[axis]
    part_range = shard_range(length, rank, size)
    part = tensor[part_range.start : part_range.stop] if axis == 0 else tensor[:, part_range.start : part_range.stop]
    missing = -(-length // size) - len(part_range)
    if missing:  # only the vocabulary rows: the heads and the MLP width are divided exactly
        part = F.pad(part, [0, 0] * (part.dim() - 1 - axis) + [0, missing])
    return part


class RankGroup:
    """The two collectives of a model split over ``size`` ranks, on a ``torch.distributed``
    process group (None: the default group)."""

    def __init__(self, rank: int, size: int, group: dist.ProcessGroup | None = None) -> None:
        self.rank, self.size, self.group = rank, size, group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks, in float32 when ``x`` is float16: each rank's partial sum fits
        float16, their total need not (chapter 02's policy; twice the bytes on the wire)."""
        if x.dtype == torch.float16:
            x = x.float()
        dist.all_reduce(x, group=self.group)  # in place: x is a fresh matmul output (or its copy)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' ``x`` side by side along the last axis, in rank order."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=-1)


class ShardedQwen2Model(Qwen2Model):
    """Rank ``group.rank``'s shard of a Qwen2 model: chapter 03's model at ``shard_config``'s
    shapes, whose row-parallel projections, embedding and logits meet the other ranks'.

    ``config`` is what the engine reads: this rank's heads and KV heads (its attention, its part
    of the KV pool) and the whole vocabulary (the width of the gathered logits); ``whole`` is the
    model's own config."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device, group: RankGroup) -> None:
        shard = shard_config(config, group.size)
        super().__init__(shard, dtype, device)  # allocates this rank's heads, MLP columns and vocabulary rows
        self.whole, self.group, self.vocab_rows = config, group, shard.vocab_size
        self.config = replace(shard, vocab_size=config.vocab_size)

    def add_projection(self, hidden: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Row-parallel: this rank's product of its heads (or MLP columns) is a partial sum of the
        whole projection; the ranks add theirs up before the residual adds the total."""
        scale = self.projection_scale
        partial = linear(x if scale == 1.0 else x * scale, weight)
        return hidden.add(self.group.all_reduce(partial), alpha=1.0 / scale)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Vocabulary-parallel: a rank holds rows ``[rank * n, (rank + 1) * n)``, looks up the ids
        in its range and gives zeros for the others; the sum over the ranks is every row."""
        local = input_ids - self.group.rank * self.vocab_rows
        elsewhere = (local < 0) | (local >= self.vocab_rows)
        found = F.embedding(local.masked_fill(elsewhere, 0), self.embed).masked_fill(elsewhere[:, None], 0)
        return self.group.all_reduce(found)

    def compute_logits(self, hidden: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Vocabulary-parallel: each rank's rows of the output projection give its columns of the
        logits; every rank gathers them all (the padding columns dropped)."""
        logits = self.group.all_gather(linear(hidden, self.lm_head))
        return logits[:, : self.config.vocab_size].to(dtype)


def load_shard(
    model_dir: Path,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    group: RankGroup,
    show_progress: bool,
) -> ShardedQwen2Model:
    """This rank's shard of the model, each tensor's slice read from the checkpoint and copied into
    place (then prepacked for a CPU's matrix units, as ``engine_builder.load_model`` does)."""
    model = ShardedQwen2Model(config, dtype, device, group)
    with open_checkpoint(model_dir, config) as tensors:
        loading = tqdm(tensors, desc="Loading weights", unit="tensor", disable=not show_progress, leave=False)
        model.load_weights(
            (info.name, read_shard(info.name, f.get_slice(info.name), rank=group.rank, size=group.size))
            for info, f in loading
        )
    model.prepack_weights()
    return model
