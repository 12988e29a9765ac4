"""Streaming safetensors checkpoints, tensor by tensor (chapter 01).

A safetensors file is an 8-byte little-endian header length, a JSON header (name -> dtype,
shape, byte offsets) and the raw bytes. Reading the header alone tells us every tensor's name
and shape, so the whole checkpoint is checked *before* a byte of weights is read:

* every tensor the architecture needs is present, none is unexpected, every shape is right
  (each error names the tensor and the file);
* no file is truncated (its size covers the last tensor's end offset).

Then ``iter_checkpoint`` yields one tensor at a time from a memory map, so the caller can cast
it and copy it into its place on the device and drop it: the checkpoint is never held twice.

A tensor-parallel rank (chapter 14) holds a slice of most tensors: ``iter_checkpoint``'s
``read_part`` reads only that slice from the file (safetensors' ``get_slice``), so no rank ever
reads a whole tensor it does not keep.

Sharded checkpoints (``model.safetensors.index.json`` plus ``model-0000k-of-0000n``) and single
files are read the same way. Which names and shapes a Qwen2 checkpoint must have comes from
``expected_tensors(config)``, in Hugging Face's naming.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from mini_infer.config import ModelConfig


class CheckpointError(ValueError):
    """A checkpoint that does not match its config; the message names the tensor and file."""


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]


# Tensors that checkpoints sometimes carry and the model recomputes or never uses.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def expected_tensors(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The name and shape of every tensor a Qwen2 checkpoint of this config must contain."""
    h, i = config.hidden_size, config.intermediate_size
    q, kv = config.q_size, config.kv_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, h),
        "model.norm.weight": (h,),
    }
    for layer in range(config.num_hidden_layers):
        p = f"model.layers.{layer}."
        shapes.update(
            {
                p + "input_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (q, h),
                p + "self_attn.q_proj.bias": (q,),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.k_proj.bias": (kv,),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.v_proj.bias": (kv,),
                p + "self_attn.o_proj.weight": (h, q),
                p + "post_attention_layernorm.weight": (h,),
                p + "mlp.gate_proj.weight": (i, h),
                p + "mlp.up_proj.weight": (i, h),
                p + "mlp.down_proj.weight": (h, i),
            }
        )
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    return shapes


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint, sharded or not."""
    directory = Path(model_dir)
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise CheckpointError(f"{index} is not a valid safetensors index: {exc}") from exc
        files = [directory / name for name in dict.fromkeys(weight_map.values())]
        for file in files:
            if not file.is_file():
                raise CheckpointError(f"{file.name}, listed in {index.name}, is missing from {directory}")
        return files
    single = directory / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(directory.glob("*.safetensors"))
    if found:
        return found
    if any(directory.glob("*.bin")) or any(directory.glob("*.pt")):
        raise CheckpointError(
            f"{directory} holds only PyTorch pickle weights (*.bin); mini-infer reads safetensors. "
            "Convert with transformers: AutoModelForCausalLM.from_pretrained(dir).save_pretrained(out)"
        )
    raise CheckpointError(f"no *.safetensors file in {directory}")


def read_header(file: Path) -> dict[str, TensorInfo]:
    """Parse one safetensors header and check that the file holds every byte it promises."""
    size = file.stat().st_size
    with file.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise CheckpointError(f"{file} is truncated: it is {size} bytes, too short for a safetensors header")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > size - 8:
            raise CheckpointError(
                f"{file} is truncated or not a safetensors file: header of {header_len} bytes in a {size}-byte file"
            )
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{file} has a corrupt safetensors header: {exc}") from exc
    header.pop("__metadata__", None)
    infos = {}
    data_end = 0
    for name, entry in header.items():
        infos[name] = TensorInfo(name, file, entry["dtype"], tuple(entry["shape"]))
        data_end = max(data_end, entry["data_offsets"][1])
    if 8 + header_len + data_end > size:
        raise CheckpointError(
            f"{file} is truncated: its tensors end at byte {8 + header_len + data_end} but the file has {size} bytes"
        )
    return infos


def inspect_checkpoint(model_dir: str | Path, config: ModelConfig) -> list[TensorInfo]:
    """Check names, shapes and file sizes of the whole checkpoint; return what will be loaded."""
    infos: dict[str, TensorInfo] = {}
    for file in checkpoint_files(model_dir):
        for name, info in read_header(file).items():
            if name in infos:
                raise CheckpointError(f"tensor {name!r} appears twice: in {infos[name].file.name} and {file.name}")
            infos[name] = info
    expected = expected_tensors(config)
    for name in list(infos):
        if name.endswith(_IGNORED_SUFFIXES) or name == "lm_head.weight" and config.tie_word_embeddings:
            del infos[name]
    missing = [n for n in expected if n not in infos]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"tensor {missing[0]!r}{more} is missing from the checkpoint in {model_dir}")
    unexpected = [n for n in infos if n not in expected]
    if unexpected:
        raise CheckpointError(
            f"unexpected tensor {unexpected[0]!r} in {infos[unexpected[0]].file.name}: it is not part of a Qwen2 model "
            f"with this config.json ({len(unexpected)} unexpected in all)"
        )
    for name, shape in expected.items():
        if infos[name].shape != shape:
            raise CheckpointError(
                f"tensor {name!r} in {infos[name].file.name} has shape {list(infos[name].shape)}, "
                f"but config.json implies {list(shape)}"
            )
    return [infos[name] for name in expected]


def iter_checkpoint(
    model_dir: str | Path,
    config: ModelConfig,
    *,
    show_progress: bool = True,
    read_part: Callable[[str, Any], torch.Tensor] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor of the checkpoint, one at a time, memory-mapped.

    The tensors are CPU views of the mapped file in the checkpoint's own dtype: the caller casts
    and copies each one where it belongs, then lets it go. ``read_part(name, f.get_slice(name))``,
    when given, reads what is wanted of each tensor instead of all of it (chapter 14).
    """
    tensors = inspect_checkpoint(model_dir, config)
    by_file: dict[Path, list[str]] = {}
    for info in tensors:
        by_file.setdefault(info.file, []).append(info.name)
    with tqdm(total=len(tensors), desc="Loading weights", unit="tensor", disable=not show_progress, leave=False) as bar:
        for file, names in by_file.items():
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in names:
                    yield name, f.get_tensor(name) if read_part is None else read_part(name, f.get_slice(name))
                    bar.update(1)
