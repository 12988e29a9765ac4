"""A Qwen2 model split over tensor-parallel ranks: who holds which slice, and the collectives (chapter 14).

Megatron-LM's split of a transformer layer over N ranks, which the model of chapter 03 follows when
it is given a ``TensorParallel`` (``model.shard_config`` gives each rank's shapes):

* **column-parallel**: the q, k, v projections (and their biases) and the gate and up projections
  are split along their *output* features. Rank r holds query heads ``[r H/N, (r + 1) H/N)``, the
  KV heads of the same range, and MLP columns ``[r I/N, (r + 1) I/N)``: it computes the attention
  of its own heads and its part of the MLP's hidden layer without any communication;
* **row-parallel**: the o and down projections are split along their *input* features, the same
  ranges; each rank's product is a partial sum of the whole output, and one all-reduce adds them
  up (``Qwen2Model.sum_over_ranks``): two all-reduces per layer, in float32 under float16 weights
  (the ranks' partial sums each fit float16, their total need not);
* **vocabulary-parallel**: the embedding and the LM head are split by vocabulary rows,
  ``ceil(V / N)`` each (the last rank's padded with zero rows): a lookup is one more all-reduce,
  the logits one all-gather;
* the RMSNorm weights are small and every rank holds them whole.

``read_shard`` reads a rank's slice straight from the safetensors file (``get_slice``), so the N
ranks together read the checkpoint once. ``RankGroup`` implements the model's ``TensorParallel``
hook on a ``torch.distributed`` process group and counts what goes through it.

Invariant: a model split over N ranks computes the logits of the whole model, up to the rounding
of the partial sums (the tests require identical greedy tokens).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mini_infer.config import ModelConfig
from mini_infer.device import synchronize
from mini_infer.loader import iter_checkpoint
from mini_infer.model import Qwen2Model

# Split along the input features (axis 1 of the weight): each rank's product is a partial sum.
ROW_PARALLEL = ("self_attn.o_proj.weight", "mlp.down_proj.weight")
# Held whole by every rank.
REPLICATED = ("input_layernorm.weight", "post_attention_layernorm.weight", "model.norm.weight")


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
    """The model's ``TensorParallel`` hook on a ``torch.distributed`` process group (None: the
    default group). Counts its collectives and their payload; with ``timed`` set, also the time
    spent in each kind (synchronising the device around each one, so only for measurements). That
    time includes waiting for the slowest rank to reach the collective."""

    def __init__(self, rank: int, size: int, group: dist.ProcessGroup | None = None) -> None:
        self.rank, self.size, self.group = rank, size, group
        self.num_collectives = 0
        self.payload_bytes = 0  # what each rank contributes, summed over the collectives
        self.timed = False
        self.seconds = {"all_reduce": 0.0, "all_gather": 0.0}

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks, in float32 when ``x`` is float16: each rank's partial sum fits
        float16, their total need not (chapter 02's policy; twice the bytes on the wire)."""
        if x.dtype == torch.float16:
            x = x.float()
        with self._counted("all_reduce", x):
            dist.all_reduce(x, group=self.group)  # in place: x is a fresh matmul output (or its copy)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        with self._counted("all_gather", x):
            dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=-1)

    @contextmanager
    def _counted(self, kind: str, x: torch.Tensor) -> Iterator[None]:
        self.num_collectives += 1
        self.payload_bytes += x.numel() * x.element_size()
        if not self.timed:
            yield
            return
        synchronize(x.device)
        start = time.perf_counter()
        yield
        synchronize(x.device)
        self.seconds[kind] += time.perf_counter() - start


def load_shard(
    model_dir: Path,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    group: RankGroup,
    show_progress: bool,
) -> Qwen2Model:
    """This rank's shard of the model, each tensor's slice read from the checkpoint and copied into
    place (then prepacked for a CPU's matrix units, as ``engine_builder.load_model`` does)."""
    model = Qwen2Model(config, dtype, device, tp=group)
    read = partial(read_shard, rank=group.rank, size=group.size)
    model.load_weights(iter_checkpoint(model_dir, config, show_progress=show_progress, read_part=read))
    model.prepack_weights()
    return model
