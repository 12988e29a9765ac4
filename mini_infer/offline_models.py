"""Models the project builds itself, so that nothing ever downloads weights (chapter 01).

No machine of this project (and no CI run) reaches a model hub. Two kinds of model stand in:

* **Random-weight models at real Qwen2.5 shapes** (``write_random_model``): the right size for
  measuring speed and memory, meaningless text. Named shapes below carry the real dimensions
  of Qwen2.5-0.5B and Qwen2.5-1.5B, including the 151,936-entry vocabulary.
* **The tiny trained pair** (see ``scripts/train_tiny_pair.py`` and the appendix chapter),
  which shares this module's tokenizer builder.

For the benchmarks that time random-weight models (the server's overhead, chapter 11; the
engine's, chapter 12), the workload that goes with them: ``random_prompts``, and the options that
size it (``add_random_prompt_arguments``).

Every directory written here is a complete Hugging Face layout (``config.json``,
``model.safetensors``, tokenizer files with a chat template, ``generation_config.json``), so that
``transformers`` loads it exactly as mini-infer does, and tests can compare the two.

Invariant: everything here is a pure function of its arguments and seed; the same call writes
the same bytes.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from mini_infer.chat_template import (
    ENDOFTEXT,
    IM_END,
    QWEN_STYLE_CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    TOOL_TOKENS,
)

# Qwen2's pre-tokenizer splits text into words, single digits, punctuation runs and
# whitespace before byte-level BPE. Single digits matter: a model that must learn arithmetic
# would otherwise see every two-digit number as its own token.
QWEN_PRETOKENIZE_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class ModelShape:
    """The dimensions that decide a Qwen2 model's size and speed."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    tie_word_embeddings: bool = True
    head_dim: int | None = None  # None: hidden_size // num_attention_heads, as in Qwen2
    max_position_embeddings: int = 32768
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6


NAMED_SHAPES: dict[str, ModelShape] = {
    # Real Qwen2.5 dimensions (from their config.json files).
    "qwen2.5-0.5b": ModelShape(896, 4864, 24, 14, 2, 151936),
    "qwen2.5-1.5b": ModelShape(1536, 8960, 28, 12, 2, 151936),
    # Small shapes for tests and notebooks: fast on a 2-core CPU, still grouped-query attention.
    "tiny-test": ModelShape(64, 128, 2, 4, 2, 512, max_position_embeddings=2048),
    "small-test": ModelShape(128, 256, 3, 8, 2, 1024, tie_word_embeddings=False, max_position_embeddings=4096),
    # For benchmarks between the test shapes (a step is mostly Python overhead) and Qwen2.5-0.5B
    # (minutes per run on a laptop CPU): a step does real work, yet runs anywhere.
    "bench-small": ModelShape(384, 1024, 6, 6, 2, 8192, max_position_embeddings=4096),
}


def _sample_corpus(seed: int, num_lines: int = 2000) -> list[str]:
    """A deterministic, vaguely English corpus: enough for BPE to learn sensible merges."""
    rng = random.Random(seed)
    words = (
        "the a of to and in is it that for on with as was be at by this are from or an have not "
        "model token cache block batch request prefill decode attention layer memory speed time "
        "what how many is plus minus equals answer question hello world paris france rome italy "
        "one two three four five six seven eight nine ten red green blue cat dog bird tree"
    ).split()
    lines = []
    for _ in range(num_lines):
        n = rng.randint(3, 14)
        sentence = " ".join(rng.choice(words) for _ in range(n))
        if rng.random() < 0.3:
            sentence += f" {rng.randint(0, 999)} {rng.choice('+-*=')} {rng.randint(0, 99)}"
        lines.append(sentence.capitalize() + rng.choice([".", "?", "!", ","]))
    return lines


def build_tokenizer(texts: Iterable[str], vocab_size: int) -> Any:
    """Train a Qwen-style byte-level BPE tokenizer and wrap it for ``transformers``.

    The result has Qwen2.5's special tokens and chat template; ``eos_token`` is ``<|im_end|>``
    (the end of an assistant turn, as in Qwen2.5-Instruct) and ``pad_token`` is
    ``<|endoftext|>``. Returns a ``PreTrainedTokenizerFast``.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(list(texts), trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        additional_special_tokens=SPECIAL_TOKENS,
        clean_up_tokenization_spaces=False,
    )
    wrapped.add_tokens(TOOL_TOKENS)
    wrapped.chat_template = QWEN_STYLE_CHAT_TEMPLATE
    return wrapped


def qwen2_config_dict(shape: ModelShape, *, torch_dtype: str, eos_token_ids: Sequence[int]) -> dict[str, Any]:
    """A ``config.json`` as Qwen2.5's own, in the field names both transformers 4.x and 5.x read."""
    head_dim = shape.head_dim or shape.hidden_size // shape.num_attention_heads
    config: dict[str, Any] = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "bos_token_id": None,
        "eos_token_id": eos_token_ids[0] if eos_token_ids else None,
        "initializer_range": 0.02,
        "use_cache": True,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": shape.num_hidden_layers,
        "torch_dtype": torch_dtype,
        "rope_scaling": None,
        **{k: v for k, v in asdict(shape).items() if k != "head_dim"},
    }
    if shape.head_dim is not None and head_dim != shape.hidden_size // shape.num_attention_heads:
        config["head_dim"] = head_dim
    return config


def random_state_dict(
    shape: ModelShape, *, seed: int, dtype: torch.dtype, init_std: float = 0.02
) -> dict[str, torch.Tensor]:
    """Random weights under Hugging Face's Qwen2 names. Norm weights start at one, as trained
    models' roughly do, so activations keep a sensible scale through many layers."""
    gen = torch.Generator().manual_seed(seed)
    head_dim = shape.head_dim or shape.hidden_size // shape.num_attention_heads
    q_out = shape.num_attention_heads * head_dim
    kv_out = shape.num_key_value_heads * head_dim
    h, i = shape.hidden_size, shape.intermediate_size

    def rand(*size: int) -> torch.Tensor:
        return (torch.randn(*size, generator=gen) * init_std).to(dtype)

    tensors: dict[str, torch.Tensor] = {"model.embed_tokens.weight": rand(shape.vocab_size, h)}
    for layer in range(shape.num_hidden_layers):
        p = f"model.layers.{layer}."
        tensors.update(
            {
                p + "input_layernorm.weight": torch.ones(h, dtype=dtype),
                p + "self_attn.q_proj.weight": rand(q_out, h),
                p + "self_attn.q_proj.bias": rand(q_out),
                p + "self_attn.k_proj.weight": rand(kv_out, h),
                p + "self_attn.k_proj.bias": rand(kv_out),
                p + "self_attn.v_proj.weight": rand(kv_out, h),
                p + "self_attn.v_proj.bias": rand(kv_out),
                p + "self_attn.o_proj.weight": rand(h, q_out),
                p + "post_attention_layernorm.weight": torch.ones(h, dtype=dtype),
                p + "mlp.gate_proj.weight": rand(i, h),
                p + "mlp.up_proj.weight": rand(i, h),
                p + "mlp.down_proj.weight": rand(h, i),
            }
        )
    tensors["model.norm.weight"] = torch.ones(h, dtype=dtype)
    if not shape.tie_word_embeddings:
        tensors["lm_head.weight"] = rand(shape.vocab_size, h)
    return tensors


def save_sharded(tensors: dict[str, torch.Tensor], directory: Path, max_shard_bytes: int) -> None:
    """Write ``tensors`` as one ``model.safetensors`` or as shards with an index, as HF does."""
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    if total <= max_shard_bytes:
        save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    weight_map = {}
    for index, shard in enumerate(shards, start=1):
        filename = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(directory / filename), metadata={"format": "pt"})
        weight_map.update({name: filename for name in shard})
    index_json = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=2))


def write_random_model(
    path: str | Path,
    shape: str | ModelShape = "tiny-test",
    *,
    seed: int = 0,
    dtype: str = "bfloat16",
    max_shard_bytes: int = 2 * 1024**3,
    tokenizer_vocab_size: int = 2000,
    init_std: float = 0.02,
    **overrides: Any,
) -> Path:
    """Write a complete Hugging Face-layout Qwen2 model with random weights and return its path.

    ``shape`` is a name from ``NAMED_SHAPES`` or a ``ModelShape``; keyword ``overrides`` change
    single fields (for example ``num_key_value_heads=1``). The tokenizer is small (its vocabulary
    is ``tokenizer_vocab_size``, capped by the model's); ids beyond it exist in the model, as
    Qwen2.5's own padded vocabulary does, and decode to nothing. Their rows of the output
    projection are zero, so that, like a trained model, a random one (almost) never emits them:
    at the Qwen2.5 shapes 99% of the ids are padding, and a model that emitted them would stream
    empty text, which skews every streaming benchmark's time to first token.
    """
    if isinstance(shape, str) and shape not in NAMED_SHAPES:
        raise ValueError(f"unknown shape {shape!r}: use one of {', '.join(NAMED_SHAPES)} or a ModelShape")
    base = NAMED_SHAPES[shape] if isinstance(shape, str) else shape
    model_shape = replace(base, **overrides)
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)

    tokenizer = build_tokenizer(_sample_corpus(seed), min(tokenizer_vocab_size, model_shape.vocab_size - 8))
    if len(tokenizer) > model_shape.vocab_size:
        raise ValueError(f"vocab_size={model_shape.vocab_size} is smaller than the tokenizer ({len(tokenizer)} tokens)")
    tokenizer.save_pretrained(str(directory))
    eos_ids = [tokenizer.convert_tokens_to_ids(IM_END), tokenizer.convert_tokens_to_ids(ENDOFTEXT)]

    torch_dtype = getattr(torch, dtype)
    config = qwen2_config_dict(model_shape, torch_dtype=dtype, eos_token_ids=eos_ids)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    generation_config = {"eos_token_id": eos_ids, "pad_token_id": eos_ids[1], "do_sample": False}
    (directory / "generation_config.json").write_text(json.dumps(generation_config, indent=2))
    tensors = random_state_dict(model_shape, seed=seed, dtype=torch_dtype, init_std=init_std)
    output_projection = "model.embed_tokens.weight" if model_shape.tie_word_embeddings else "lm_head.weight"
    tensors[output_projection][len(tokenizer) :] = 0
    save_sharded(tensors, directory, max_shard_bytes)
    return directory


RANDOM_MODELS_CACHE = Path.home() / ".cache" / "mini-infer" / "random-models"


def random_model_dir(shape: str, dtype: str, cache_dir: Path = RANDOM_MODELS_CACHE) -> Path:
    """A random-weight model at ``shape`` (for benchmarks: speed does not depend on the weights),
    written once under ``cache_dir`` and reused."""
    path = cache_dir / f"{shape}-{dtype}"
    if not (path / "config.json").is_file():
        print(f"writing a random-weight {shape} model to {path} (once)")
        write_random_model(path, shape, seed=0, dtype=dtype)
    return path


def add_random_prompt_arguments(
    parser: argparse.ArgumentParser, *, num_prompts: int, input_len: tuple[int, int], output_len: int
) -> None:
    """``--num-prompts``, ``--input-len LO HI`` and ``--output-len``, with the script's defaults."""
    parser.add_argument("--num-prompts", type=int, default=num_prompts)
    parser.add_argument("--input-len", type=int, nargs=2, default=list(input_len), metavar=("LO", "HI"))
    parser.add_argument("--output-len", type=int, default=output_len)


def random_prompts(vocab_size: int, num_prompts: int, input_len: Sequence[int], seed: int) -> list[list[int]]:
    """``num_prompts`` lists of random token ids, each as long as a draw uniform in [lo, hi] (``input_len``)."""
    rng = random.Random(seed)
    lo, hi = input_len
    return [[rng.randrange(vocab_size) for _ in range(rng.randint(lo, hi))] for _ in range(num_prompts)]


def add_massive_activations(model_dir: str | Path, *, add_per_layer: float = 40000.0, key_bias: float = 30.0) -> Path:
    """Give a model written by ``write_random_model`` (float32, one ``model.safetensors``) what
    breaks Qwen2 in float16: a residual channel that grows past 65,504 and large key biases.

    Channel 0 of the residual stream is read by no projection; the last two layers each add
    ``add_per_layer`` to it (a value bias of 100 that the output projection scales), so that no
    single matmul output overflows float16 but their sum does. The final norm gives the channel
    weight 0, so the next token still depends on the other channels, whose scale the norm's
    weights restore. Every layer's key biases grow by ``key_bias``. Chapter 02 and the tests use
    it to show the float16 policy of ``layers.residual_dtype`` at work.
    """
    from safetensors.torch import load_file

    path = Path(model_dir) / "model.safetensors"
    tensors = load_file(str(path))
    layers = sorted({int(name.split(".")[2]) for name in tensors if name.startswith("model.layers.")})
    for layer in layers:
        p = f"model.layers.{layer}."
        tensors[p + "self_attn.k_proj.bias"] += key_bias
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            tensors[p + name + ".weight"][:, 0] = 0.0
        if layer >= layers[-1] - 1:
            tensors[p + "self_attn.v_proj.bias"][0] = 100.0
            tensors[p + "self_attn.o_proj.weight"][:, 0] = 0.0
            tensors[p + "self_attn.o_proj.weight"][0, :] = 0.0
            tensors[p + "self_attn.o_proj.weight"][0, 0] = add_per_layer / 100.0
    norm = tensors["model.norm.weight"]
    norm[:] = 1000.0
    norm[0] = 0.0
    save_file(tensors, str(path), metadata={"format": "pt"})
    return Path(model_dir)
