"""What a request asks for: ``SamplingParams`` (chapter 06; chapter 09 shows how each field acts).

``SamplingParams`` has vLLM's names and defaults. It is validated when it is built, so that a bad
request fails at the door with a message naming the field; after construction ``stop`` and
``stop_token_ids`` are always lists. The engine of chapter 06 reads ``max_tokens``, the stops,
``ignore_eos``, ``min_tokens`` (no stop counts before it) and ``skip_special_tokens``; temperature,
top-k, top-p, min-p, penalties, ``logit_bias``, seeds and logprobs are the sampler's business
(chapter 09), and ``structured_outputs`` (a JSON Schema, a regex, a choice or a grammar that the
output must match) is constrained decoding's (chapter 09b). A seeded request owns a
``torch.Generator`` (``make_generator``) for its whole life, so that preemption or a different
batch never changes its tokens.

A checkpoint carries its own sampling defaults in ``generation_config.json`` (Qwen2.5-Instruct:
temperature 0.7, top_p 0.8, top_k 20 and a repetition penalty). ``generation_defaults`` reads
them, as vLLM's ``--generation-config auto`` does, and ``SamplingParams.with_defaults`` gives
them to the fields a request did not set: a ``SamplingParams`` remembers which fields its caller
gave (``fields_set``: in the constructor, or assigned afterwards), so that an explicit
``temperature=1.0`` wins over the model's 0.7 while a field left out takes it.

Invariant: a ``SamplingParams`` that exists is valid on its own; what needs the model (a token id
inside the vocabulary, a grammar that compiles) is checked when the request is added.
"""

from __future__ import annotations

import json
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from mini_infer.config import Check, Rule, check_fields, checked, must_be

# OpenAI's range for a logit bias.
_MAX_LOGIT_BIAS = 100.0
# vLLM's convention: temperatures this small are treated as 0 (greedy), because dividing the
# logits by them overflows float32 for no difference in the result.
_GREEDY_TEMPERATURE = 1e-5
_MAX_LOGPROBS = 20
_BOOL = Rule(bool, "a bool")


def _none_or(words: str, holds: Callable[[Any], bool]) -> Check:
    """The rule of a field that is None or a value ``holds`` accepts (kept as given)."""

    def check(name: str, value: Any) -> Any:
        if value is not None and not holds(value):
            raise must_be(name, words, value)
        return value

    return check


def _token_id(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and int(value) >= 0


def _stop(name: str, stop: Any) -> list[str]:
    stop = [stop] if isinstance(stop, str) else [] if stop is None else stop
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
        raise must_be(name, "a str or a list of str", stop)
    if "" in stop:  # an empty stop string would match before the first character: surely a bug
        raise must_be(name, "non-empty strings", stop)
    return list(stop)


def _stop_token_ids(name: str, ids: Any) -> list[int]:
    if ids is None:
        return []
    if not isinstance(ids, (list, tuple)) or not all(_token_id(i) for i in ids):
        raise must_be(name, "a list of ints >= 0", ids)
    return [int(i) for i in ids]


def _logit_bias(name: str, bias: Any) -> dict[int, float] | None:
    if bias is None or bias == {}:
        return None
    if not isinstance(bias, dict):
        raise must_be(name, "a dict of token id -> bias", bias)
    for token in bias:
        if not _token_id(token):
            raise must_be(name, "keyed by token ids >= 0", token)
    in_range = Rule(float, f"in [-{_MAX_LOGIT_BIAS:g}, {_MAX_LOGIT_BIAS:g}]", lambda x: abs(x) <= _MAX_LOGIT_BIAS)
    return {int(token): in_range(f"{name}[{token}]", value) for token, value in bias.items()}


def _choices(x: Any) -> bool:
    return isinstance(x, (list, tuple)) and bool(x) and all(isinstance(c, str) and c for c in x)


_NON_EMPTY_STRING = _none_or("a non-empty string", lambda x: isinstance(x, str) and x != "")


@dataclass(slots=True, frozen=True)
class StructuredOutputsParams:
    """What the output must match (vLLM's ``StructuredOutputsParams``): exactly one of

    * ``json``: a JSON Schema (a dict, or its JSON text): the output is one JSON value it accepts;
    * ``json_object``: True: the output is one JSON object, any object (OpenAI's JSON mode);
    * ``regex``: the whole output matches this regular expression;
    * ``choice``: the output is exactly one of these strings;
    * ``grammar``: a context-free grammar in Lark syntax (llguidance's dialect, which vLLM's
      ``guidance`` backend also takes; it may embed JSON Schemas with ``%json {...}``).

    Only the shape is checked here; whether it compiles is checked when a request is added
    (chapter 09b). The output ends when the grammar is complete (an end-of-sequence token is the
    only token left), or at ``max_tokens``, which can cut it short: ``finish_reason`` "length".
    """

    json: dict[str, Any] | str | None = checked(
        None, _none_or("a JSON Schema (a dict or its JSON text)", lambda x: isinstance(x, (dict, str)))
    )
    regex: str | None = checked(None, _NON_EMPTY_STRING)
    choice: list[str] | None = checked(None, _none_or("a non-empty list of non-empty strings", _choices))
    grammar: str | None = checked(None, _NON_EMPTY_STRING)
    json_object: bool = checked(False, _BOOL)

    def __post_init__(self) -> None:
        check_fields(self, prefix="structured_outputs.")
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(
                "structured_outputs must give exactly one of json, json_object, regex, choice or grammar, got "
                + (", ".join(given) if given else "none")
            )
        if self.choice is not None:
            object.__setattr__(self, "choice", list(self.choice))

    @property
    def kind(self) -> str:
        """Which of the five it is."""
        return (
            "json_object"
            if self.json_object
            else next(n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None)
        )


@dataclass(slots=True)
class SamplingParams:
    """What one request asks of the sampler (vLLM's names and defaults).

    Each field declares its rule (``config.checked``); a value the rule refuses raises a
    ValueError naming the field, the value and what it must be. After construction ``stop`` and
    ``stop_token_ids`` are always lists (empty when not given; ``stop`` also takes one string and
    ``stop_token_ids`` also takes None, as in vLLM). ``fields_set`` names the fields the caller
    gave, to the constructor or by assignment; the others may take a model's defaults
    (``with_defaults``).
    """

    max_tokens: int = checked(16, Rule(int, ">= 1", lambda x: x >= 1))
    temperature: float = checked(1.0, Rule(float, ">= 0", lambda x: x >= 0))  # 0 (below 1e-5) means greedy
    top_p: float = checked(1.0, Rule(float, "in (0, 1]", lambda x: 0 < x <= 1))  # 1 disables
    # -1 disables; larger than the vocabulary is clamped
    top_k: int = checked(-1, Rule(int, "-1 (disabled) or >= 1", lambda x: x == -1 or x >= 1))
    min_p: float = checked(0.0, Rule(float, "in [0, 1]", lambda x: 0 <= x <= 1))  # 0 disables
    # A seeded request owns a generator (make_generator); torch's seeds are 64-bit.
    seed: int | None = checked(None, Rule(int, "None or an int in [0, 2**64)", lambda x: 0 <= x < 2**64, optional=True))
    stop: str | list[str] | None = checked(None, _stop)
    stop_token_ids: list[int] = checked(None, _stop_token_ids)
    ignore_eos: bool = checked(False, _BOOL)
    # The number of top alternatives besides the chosen token.
    logprobs: int | None = checked(
        None, Rule(int, f"None or in [0, {_MAX_LOGPROBS}]", lambda x: 0 <= x <= _MAX_LOGPROBS, optional=True)
    )
    presence_penalty: float = checked(0.0, Rule(float, "in [-2, 2]", lambda x: -2 <= x <= 2))
    frequency_penalty: float = checked(0.0, Rule(float, "in [-2, 2]", lambda x: -2 <= x <= 2))
    repetition_penalty: float = checked(1.0, Rule(float, "> 0", lambda x: x > 0))
    include_stop_str_in_output: bool = checked(False, _BOOL)
    # No EOS, stop token or stop string ends the output before this many tokens.
    min_tokens: int = checked(0, Rule(int, ">= 0", lambda x: x >= 0))
    logit_bias: dict[int, float] | None = checked(None, _logit_bias)  # token id -> added to its logit
    skip_special_tokens: bool = checked(True, _BOOL)  # leave special tokens' text out of the output text
    # What the output must match (chapter 09b).
    structured_outputs: StructuredOutputsParams | None = checked(
        None, _none_or("a StructuredOutputsParams", lambda x: isinstance(x, StructuredOutputsParams))
    )
    # The names the caller gave: a frozenset while the constructor runs (its own assignments are
    # not the caller's), a set afterwards, replaced by a larger one at each assignment of a field
    # (never changed in place, so that copies do not share it).
    _fields_set: frozenset[str] | set[str] = field(init=False, repr=False, compare=False)

    def __new__(cls, *args: Any, **kwargs: Any) -> SamplingParams:
        # __new__ sees the constructor's arguments, which __init__ cannot tell from defaults.
        self = object.__new__(cls)
        object.__setattr__(self, "_fields_set", frozenset(_FIELD_NAMES[: len(args)]).union(kwargs))
        return self

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        given = getattr(self, "_fields_set", None)
        if isinstance(given, set) and name in _FIELD_NAMES:
            object.__setattr__(self, "_fields_set", given | {name})

    def __post_init__(self) -> None:
        check_fields(self)
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        # The grammar decides where the output ends: when it is complete, an EOS is the only token
        # it allows. Both of these would forbid that EOS, leaving no token at all.
        for clash in ("ignore_eos", "min_tokens") if self.structured_outputs is not None else ():
            if getattr(self, clash):
                raise ValueError(f"{clash} cannot be combined with structured_outputs: the grammar ends the output")
        object.__setattr__(self, "_fields_set", set(self._fields_set))

    @property
    def fields_set(self) -> frozenset[str]:
        """The fields the caller gave (constructor arguments and later assignments)."""
        return frozenset(self._fields_set)

    def with_defaults(self, defaults: Mapping[str, Any]) -> SamplingParams:
        """These parameters, with ``defaults`` (a model's, say) for the fields the caller did not
        set; the caller's values always win. ``self`` when no default applies; otherwise a new,
        validated ``SamplingParams`` that remembers the same ``fields_set``."""
        unknown = set(defaults) - set(_FIELD_NAMES)
        if unknown:
            raise ValueError(f"defaults for unknown SamplingParams fields: {sorted(unknown)}")
        applied = {name: value for name, value in defaults.items() if name not in self._fields_set}
        if all(getattr(self, name) == value for name, value in applied.items()):
            return self
        try:
            merged = SamplingParams(**{name: getattr(self, name) for name in _FIELD_NAMES} | applied)
        except ValueError as exc:
            # e.g. a request's min_tokens above the model's max_new_tokens: say where the clash came from.
            raise ValueError(f"{exc} (with the defaults {applied} for the fields the request left unset)") from None
        object.__setattr__(merged, "_fields_set", set(self._fields_set))
        return merged

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_TEMPERATURE

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def changes_logits(self) -> bool:
        """The sampler changes this request's logits before anything else: a bias, stops forbidden
        below ``min_tokens``, or a grammar's mask (chapter 09b)."""
        return bool(self.logit_bias) or self.min_tokens > 0 or self.structured_outputs is not None


_FIELD_NAMES = tuple(f.name for f in fields(SamplingParams) if f.init)

# What a generation_config.json may set for every request, in transformers' names, and the
# SamplingParams field each one defaults (the fields vLLM reads: ``do_sample`` is not one of them).
GENERATION_DEFAULT_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def generation_defaults(model_dir: str | Path) -> dict[str, Any]:
    """The sampling defaults a checkpoint's ``generation_config.json`` sets, under SamplingParams'
    names (``max_new_tokens`` becomes ``max_tokens``; transformers' ``top_k=0``, "no top-k",
    becomes -1); ``{}`` when the file is absent or sets none. A value SamplingParams would refuse
    is a ValueError naming the file."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    defaults = {ours: raw[theirs] for theirs, ours in GENERATION_DEFAULT_FIELDS.items() if raw.get(theirs) is not None}
    if defaults.get("top_k") == 0:
        defaults["top_k"] = -1
    try:
        SamplingParams(**defaults)
    except ValueError as exc:
        raise ValueError(f"{path} sets a sampling default mini-infer refuses: {exc}") from None
    return defaults


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator:
    """A random generator on ``device``: seeded, or from fresh entropy when ``seed`` is None."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator
