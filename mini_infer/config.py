"""Reading a Qwen2 / Qwen2.5 ``config.json`` (chapter 01).

A Hugging Face checkpoint describes its architecture in ``config.json``. This module turns that
file into a frozen ``ModelConfig`` holding only what the engine uses, and refuses, with the
field named, anything it cannot run faithfully (another architecture or MLP activation,
sliding-window attention, scaled RoPE variants).

Both spellings of RoPE's base are read: ``rope_theta`` at the top level (transformers 4.x,
Qwen2.5's own files) and ``rope_parameters.rope_theta`` (transformers 5.x).

The configs a caller builds by hand (``SamplingParams``, chapter 06; ``EngineConfig``, chapter 10)
are checked in one style, defined here: each dataclass field declares its rule (``checked``, a
``Rule`` or any ``(name, value) -> value`` function), and ``__post_init__`` passes every field
through it (``check_fields``) before checking what involves several fields. A refused value raises
a ValueError that names the field, the value and what it must be: ``top_p must be in (0, 1], got 0.0``.
"""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("Qwen2ForCausalLM",)
SUPPORTED_MODEL_TYPES = ("qwen2",)


class ConfigError(ValueError):
    """A config.json that mini-infer cannot run; the message names the field."""


# A field's rule: its name and value in, the value to keep out (normalised), or a ValueError.
Check = Callable[[str, Any], Any]


def must_be(name: str, words: str, value: object) -> ValueError:
    return ValueError(f"{name} must be {words}, got {value!r}")


@dataclass(frozen=True, slots=True)
class Rule:
    """A scalar field's rule: of ``kind`` (int, float or bool) and ``holds``, said in ``words``.

    A bool is never a number (``temperature=True`` is a bug in the caller, not 1.0); a float field
    takes any finite real and keeps it as a float. ``optional``: None is allowed too."""

    kind: type
    words: str
    holds: Callable[[Any], bool] = lambda _: True
    optional: bool = False

    def __call__(self, name: str, value: Any) -> Any:
        if value is None and self.optional:
            return None
        number = numbers.Integral if self.kind is int else numbers.Real
        if isinstance(value, bool) != (self.kind is bool) or not isinstance(value, bool | number):
            raise must_be(name, {int: "an int", float: "a number", bool: "a bool"}[self.kind], value)
        value = self.kind(value)
        if isinstance(value, float) and not math.isfinite(value):
            raise must_be(name, "a finite number", value)
        if not self.holds(value):
            raise must_be(name, self.words, value)
        return value


def checked(default: Any, check: Check | None, **metadata: Any) -> Any:
    """A dataclass field with a default and a rule, which ``check_fields`` applies."""
    return field(default=default, metadata={"check": check, **metadata})


def check_fields(config: Any, prefix: str = "") -> None:
    """Pass each field of the dataclass ``config`` that has a rule through it, in order, keeping the
    normalised value; errors name the field as ``prefix + name``."""
    for f in fields(config):
        if (check := f.metadata.get("check")) is not None:
            object.__setattr__(config, f.name, check(prefix + f.name, getattr(config, f.name)))


@dataclass(frozen=True, slots=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    torch_dtype: str | None  # the checkpoint's dtype, e.g. "bfloat16"; None when unstated
    eos_token_ids: tuple[int, ...] = ()

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def num_params(self) -> int:
        """Parameters as Hugging Face counts them (tied embeddings counted once)."""
        h, i = self.hidden_size, self.intermediate_size
        attn = h * (self.q_size + 2 * self.kv_size) + (self.q_size + 2 * self.kv_size) + self.q_size * h
        per_layer = attn + 3 * h * i + 2 * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.num_hidden_layers * per_layer + h + head

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        _check_architecture(raw)
        hidden = _positive_int(raw, "hidden_size")
        heads = _positive_int(raw, "num_attention_heads")
        kv_heads = _positive_int(raw, "num_key_value_heads", default=heads)
        if heads % kv_heads:
            raise ConfigError(f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})")
        head_dim = raw.get("head_dim") or hidden // heads
        if raw.get("head_dim") is None and hidden % heads:
            raise ConfigError(f"hidden_size ({hidden}) is not divisible by num_attention_heads ({heads})")
        if head_dim % 2:
            raise ConfigError(f"head_dim must be even for rotary embeddings, got {head_dim}")
        if raw.get("use_sliding_window"):
            raise ConfigError("use_sliding_window=true is not supported: mini-infer attends over the full context")
        return cls(
            vocab_size=_positive_int(raw, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_positive_int(raw, "intermediate_size"),
            num_hidden_layers=_positive_int(raw, "num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=int(head_dim),
            max_position_embeddings=_positive_int(raw, "max_position_embeddings", default=32768),
            rope_theta=_rope_theta(raw),
            rms_norm_eps=_positive_float(raw, "rms_norm_eps", default=1e-6),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            eos_token_ids=_token_ids(raw.get("eos_token_id")),
        )

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ConfigError(f"{path} not found: a model directory needs a Hugging Face config.json")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path} is not valid JSON: {exc}") from exc
        config = cls.from_dict(raw)
        # generation_config.json usually lists every end-of-turn token (Qwen2.5-Instruct: both
        # <|im_end|> and <|endoftext|>); config.json often names only one.
        gen_path = Path(model_dir) / "generation_config.json"
        if gen_path.is_file():
            gen_eos = _token_ids(json.loads(gen_path.read_text()).get("eos_token_id"))
            merged = tuple(dict.fromkeys(gen_eos + config.eos_token_ids))
            config = _replace_eos(config, merged)
        return config


def _replace_eos(config: ModelConfig, eos: tuple[int, ...]) -> ModelConfig:
    from dataclasses import replace

    return replace(config, eos_token_ids=eos)


def _check_architecture(raw: dict[str, Any]) -> None:
    archs = raw.get("architectures") or []
    model_type = raw.get("model_type")
    if archs and not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise ConfigError(
            f"architectures={archs} is not supported: mini-infer runs {', '.join(SUPPORTED_ARCHITECTURES)} "
            "(Qwen2 and Qwen2.5 checkpoints)"
        )
    if model_type is not None and model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(f"model_type={model_type!r} is not supported: mini-infer runs model_type 'qwen2'")
    # transformers' Qwen2 MLP applies whatever activation this names (silu when unstated); the
    # engine's is SwiGLU with silu, so another would run, silently wrong.
    hidden_act = raw.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise ConfigError(f"hidden_act={hidden_act!r} is not supported: mini-infer's MLP is SwiGLU with silu")


def _rope_theta(raw: dict[str, Any]) -> float:
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling")
    rope_type = params.get("rope_type") or (scaling or {}).get("rope_type") or (scaling or {}).get("type")
    if rope_type not in (None, "default"):
        raise ConfigError(f"rope_type={rope_type!r} is not supported: mini-infer implements plain RoPE ('default')")
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or not math.isfinite(theta) or theta <= 0:
        raise ConfigError(f"rope_theta must be a positive number, got {theta!r}")
    return float(theta)


def _positive_int(raw: dict[str, Any], key: str, default: int | None = None) -> int:
    value = raw.get(key, default)
    if value is None:
        raise ConfigError(f"config.json has no {key!r}")
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{key} must be a positive integer, got {value!r}")
    return value


def _positive_float(raw: dict[str, Any], key: str, default: float) -> float:
    value = raw.get(key, default)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
        raise ConfigError(f"{key} must be a positive number, got {value!r}")
    return float(value)


def _token_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)
