"""Streaming safetensors checkpoints, tensor by tensor (chapter 01).

A safetensors file is an 8-byte little-endian header length, a JSON header (name -> dtype,
shape, byte offsets) and the raw bytes (chapter 01 takes one apart by hand). ``safe_open`` parses
the header, refuses a file the header does not match (truncated, corrupt) and memory-maps the
rest; ``open_checkpoint`` opens every file once, and from those handles' headers alone checks the
whole checkpoint *before* a byte of weights is read: every tensor the architecture needs is
present, none is unexpected, every shape is right (each error names the tensor and the file).

Then ``iter_checkpoint`` yields one tensor at a time through the same handles (no header is
parsed twice), so the caller can cast it and copy it into its place on the device and drop it:
the checkpoint is never held twice.

Sharded checkpoints (``model.safetensors.index.json`` plus ``model-0000k-of-0000n``) and single
files are read the same way. Which names and shapes a Qwen2 checkpoint must have comes from
``expected_tensors(config)``, in Hugging Face's naming.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
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


def _open(file: Path, stack: ExitStack) -> Any:
    """``safe_open`` one file for the whole load: it parses the header (once) and refuses a file
    shorter than the header promises or a corrupt header, which we report with the file's name."""
    try:
        return stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
    except SafetensorError as exc:
        raise CheckpointError(f"{file} is truncated or not a safetensors file ({exc})") from exc


def read_header(file: Path, f: Any) -> dict[str, TensorInfo]:
    """Name, dtype and shape of every tensor of one file, from its open handle ``f``."""
    slices = {name: f.get_slice(name) for name in f.keys()}  # noqa: SIM118 (a safe_open handle is not iterable)
    return {name: TensorInfo(name, file, s.get_dtype(), tuple(s.get_shape())) for name, s in slices.items()}


@contextmanager
def open_checkpoint(model_dir: str | Path, config: ModelConfig) -> Iterator[list[tuple[TensorInfo, Any]]]:
    """Open every file of the checkpoint once and check names and shapes before a weight is read;
    yields each tensor to load, with the handle of its file (``safe_open``'s, open until exit)."""
    with ExitStack() as stack:
        infos: dict[str, TensorInfo] = {}
        handles = {}
        for file in checkpoint_files(model_dir):
            handles[file] = _open(file, stack)
            for name, info in read_header(file, handles[file]).items():
                if name in infos:
                    raise CheckpointError(f"tensor {name!r} appears twice: in {infos[name].file.name} and {file.name}")
                infos[name] = info
        yield [(info, handles[info.file]) for info in check_tensors(model_dir, config, infos)]


def check_tensors(model_dir: str | Path, config: ModelConfig, infos: dict[str, TensorInfo]) -> list[TensorInfo]:
    """The tensors to load, in ``expected_tensors`` order, after checking names and shapes."""
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


def inspect_checkpoint(model_dir: str | Path, config: ModelConfig) -> list[TensorInfo]:
    """Check names, shapes and file sizes of the whole checkpoint; return what will be loaded."""
    with open_checkpoint(model_dir, config) as tensors:
        return [info for info, _ in tensors]


def iter_checkpoint(
    model_dir: str | Path,
    config: ModelConfig,
    *,
    show_progress: bool = True,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor of the checkpoint, one at a time, memory-mapped.

    The tensors are CPU views of the mapped file in the checkpoint's own dtype: the caller casts
    and copies each one where it belongs, then lets it go.
    """
    with open_checkpoint(model_dir, config) as tensors:
        # File by file, each in the order of the expected names.
        first_seen = {file: i for i, file in enumerate(dict.fromkeys(info.file for info, _ in tensors))}
        tensors.sort(key=lambda item: first_seen[item[0].file])
        with tqdm(
            total=len(tensors), desc="Loading weights", unit="tensor", disable=not show_progress, leave=False
        ) as bar:
            for info, f in tensors:
                yield info.name, f.get_tensor(info.name)
                bar.update(1)
