"""Structured outputs: grammar-constrained decoding inside continuous batching (chapter 09b).

A request may ask that its output match a JSON Schema, a regular expression, one of a list of
strings, or a grammar (``SamplingParams.structured_outputs``, chapter 06). An agent needs it: a
tool call whose arguments do not parse is a failed step. Each step, the request's grammar says
which tokens may come next, and every other token's logit becomes -inf before sampling, so the
sampler (chapter 09) can only pick a token that keeps the output a prefix of something the
grammar accepts. When the grammar is complete, an end-of-sequence token is the only one left, and
the request stops there.

The grammar engine is llguidance (one of vLLM's and SGLang's): it compiles a JSON Schema, a regex
or a Lark grammar once, and for a state of the parse fills a bitmask over the vocabulary, one bit
per token, in microseconds. This module is the glue:

* ``grammar_of(spec)`` and ``check_grammar(spec)``: llguidance's grammar for a request's
  ``StructuredOutputsParams``, and the refusal (a ValueError naming the problem) of one that does
  not compile. JSON is written compactly with ``", "`` and ``": "`` and no other whitespace: a
  model allowed free whitespace sometimes writes it forever.
* ``StructuredOutputs``: the sampler's ``TokenMask`` (the protocol chapter 09 defines, so that the
  sampler imports nothing of this chapter). ``check`` compiles a request's grammar when it is
  added (cached by spec; each sequence gets a copy of the compiled matcher); ``apply`` fills one
  bitmask row per logit row on the host and applies them all on the device in one operation
  (``apply_bitmask``).

Invariants:

* **A sequence's grammar state is a function of its output tokens.** ``GrammarState`` counts the
  tokens its matcher has consumed; before each mask it consumes the ones the sequence has kept
  since (``Scheduler.update`` appended them after the engine found the stops). Preemption keeps a
  sequence's tokens, so its state needs nothing rebuilt; a state lost or made anew is rebuilt
  from the tokens; each of the ``n`` forks of a request has its own. The states live here, keyed
  weakly by the sequence (nothing of chapter 09b sits on the ``Sequence``): a finished request's
  goes with it.
* **Guesses are verified against the grammar** (speculative decoding, chapter 10): row ``j`` of a
  sequence with guesses is masked with the state after its first ``j`` guesses (consumed, then
  rolled back), so a guess the grammar forbids has probability 0 under the target and is
  rejected, and the kept tokens are distributed exactly as without a draft. Rows after a
  forbidden guess are never used; they are left unmasked.
* **Requests without a grammar pay nothing**: the sampler calls ``apply`` only when a row has a
  grammar; the bits of other rows are all ones.
* **No host sync**: the bitmask is built on the host from tokens already there and copied to the
  device without waiting (pinned memory on CUDA).
* **Logprobs** (chapter 09) of a constrained request are those of the masked distribution: a
  token the grammar forbids has logprob -inf.
* **A grammar's failure is its request's alone**: when compiling or advancing a sequence's grammar
  raises (llguidance's ``TypeError`` included), ``state_of`` raises ``faults.RequestError`` naming
  that sequence; the engine fails that request and the others compute the step again.
* **A row always allows a token**: a matcher in an error state (llguidance's parser limits, or a
  token it was made to consume against its mask) allows only end-of-sequence, which ends the
  request instead of sampling from a row of -inf.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import math
import re
import sys
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.hf
import torch
from torch import Tensor

from mini_infer import faults
from mini_infer.model_runner import ForwardBatch
from mini_infer.sampling_params import SamplingParams, StructuredOutputsParams
from mini_infer.sequence import Sequence as Seq
from mini_infer.tokenizer import Tokenizer

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

logger = logging.getLogger("mini_infer.structured_output")

# The oldest llguidance this module can use: 1.7.0 is the first whose ``hf.from_tokenizer`` takes a
# list of end tokens (``eos_token=[...]``, as ``StructuredOutputs.ll_tokenizer`` passes); 1.6.1
# raises TypeError there, at the first request with a grammar. pyproject.toml's floor is the same.
LLGUIDANCE_FLOOR = (1, 7, 0)


def check_llguidance_version(version: str) -> None:
    """Refuse an llguidance older than ``LLGUIDANCE_FLOOR``, naming the version found and the fix."""
    parts = tuple(int(p) for p in re.findall(r"\d+", version)[:3])
    if parts < LLGUIDANCE_FLOOR:
        floor = ".".join(map(str, LLGUIDANCE_FLOOR))
        raise ImportError(
            f"mini-infer needs llguidance>={floor} for structured outputs, found {version} (older releases take one "
            f"end token, not the list the engine passes): pip install -U 'llguidance>={floor}'"
        )


check_llguidance_version(importlib.metadata.version("llguidance"))

# Compact JSON, as Qwen's chat template writes tool calls: ", " and ": " and no other whitespace.
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_JSON_OBJECT: dict[str, Any] = {"type": "object"}
_MAX_ERROR_CHARS = 400


def _schema(value: dict[str, Any] | str, where: str) -> dict[str, Any]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ValueError(f"{where} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be a JSON Schema object, got {type(value).__name__}")
    return value


def grammar_of(spec: StructuredOutputsParams) -> str:
    """llguidance's grammar for ``spec`` (not yet checked: see ``check_grammar``)."""
    kind = spec.kind
    if kind in ("json", "json_object"):
        schema = ANY_JSON_OBJECT if kind == "json_object" else _schema(spec.json or {}, "structured_outputs.json")
        try:
            return str(llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"structured_outputs.json cannot be read: {exc}") from None
    if kind == "regex":
        return str(llguidance.LLMatcher.grammar_from_regex(spec.regex or ""))
    if kind == "choice":
        # Each choice a string literal of the grammar, written as a JSON string.
        alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice or [])
        return str(llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}"))
    return str(llguidance.LLMatcher.grammar_from_lark(spec.grammar or ""))


def _short(message: str) -> str:
    """llguidance's error, without the parser dump some messages carry."""
    message = message.split("\n<state>")[0].strip()
    return message if len(message) <= _MAX_ERROR_CHARS else message[:_MAX_ERROR_CHARS] + "..."


def check_grammar(
    spec: StructuredOutputsParams, tokenizer: llguidance.LLTokenizer | None = None, *, name: str | None = None
) -> str:
    """``spec``'s grammar, or a ValueError naming what is wrong with it (the server's 400): the
    message starts with ``name`` (default ``structured_outputs.<kind>``)."""
    grammar = grammar_of(spec)
    error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
    if error:
        raise ValueError(f"{name or 'structured_outputs.' + spec.kind} does not compile: {_short(error)}")
    return grammar


def spec_key(spec: StructuredOutputsParams) -> str:
    """A string that identifies ``spec``, for the compiled-grammar cache."""
    try:
        return json.dumps([spec.kind, getattr(spec, spec.kind)], sort_keys=True)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"structured_outputs.{spec.kind} is not JSON: {exc}") from None


# For each byte value, its 8 bits as 8 bytes of 0 or 1 (bit i in byte i), read as one int64: a
# table lookup per byte unpacks a bitmask several times faster than shifting every word 32 times.
_BYTE_BITS = [int.from_bytes(bytes((value >> i) & 1 for i in range(8)), "little") for value in range(256)]
_byte_bits_on: dict[torch.device, Tensor] = {}


def apply_bitmask(logits: Tensor, bitmask: Tensor) -> None:
    """Set to -inf, in place, every token whose bit is 0. ``logits`` ``[R, V]``; ``bitmask``
    ``[R, ceil(V / 32)]`` int32 on the logits' device, bit ``i`` of word ``w`` for token
    ``32 w + i``. One lookup to unpack the bits, one ``masked_fill_`` for the whole batch."""
    rows, vocab = logits.shape
    width = bitmask.shape[1] * 32
    if sys.byteorder != "little":  # the lookup reads the words' bytes in memory order
        shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
        logits.masked_fill_(((bitmask.unsqueeze(-1) >> shifts) & 1).view(rows, width)[:, :vocab] == 0, -math.inf)
        return
    table = _byte_bits_on.get(bitmask.device)
    if table is None:
        table = _byte_bits_on[bitmask.device] = torch.tensor(_BYTE_BITS, dtype=torch.int64, device=bitmask.device)
    allowed = table[bitmask.view(torch.uint8).int()].view(torch.bool).view(rows, width)[:, :vocab]
    logits.masked_fill_(~allowed, -math.inf)


def token_bitmask(token_ids: Iterable[int], vocab_size: int) -> Tensor:
    """A ``[ceil(V / 32)]`` int32 bitmask allowing exactly ``token_ids``."""
    words = [0] * ((vocab_size + 31) // 32)
    for token in token_ids:
        words[token // 32] |= 1 << (token % 32)
    # Bit 31 is the sign bit of an int32: the same 32 bits, written as a signed number.
    return torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)


@dataclass(slots=True)
class GrammarState:
    """One sequence's parse: its own matcher, and how many of its output tokens it has consumed."""

    matcher: llguidance.LLMatcher
    num_consumed: int = 0


class StructuredOutputs:
    """Constrained decoding for the sampler (chapter 09's ``TokenMask``; see the module docstring).

    ``vocab_size`` is the model's (its logits' width, padding included: padding ids are never
    allowed); ``eos_token_ids`` are the tokens a complete grammar allows, the engine's stops.
    """

    def __init__(
        self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Iterable[int], *, cache_size: int = 128
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(set(eos_token_ids))
        self.cache_size = cache_size
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._host: Tensor | None = None  # the bitmask's host buffer, reused from step to step
        self.num_masked_rows = 0  # rows given a grammar's mask, for tests and measurements
        self._eos_only = token_bitmask(self.eos_token_ids, vocab_size)
        # Each constrained sequence's parse, keyed weakly by the sequence: it goes with the request.
        self._states: weakref.WeakKeyDictionary[Seq, GrammarState] = weakref.WeakKeyDictionary()

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the vocabulary: every token's bytes. Made at the first grammar
        (about a second for a 150k vocabulary), so engines that never see one never pay for it."""
        if self._ll_tokenizer is None:
            hf: Any = self.tokenizer.hf
            try:
                self._ll_tokenizer = llguidance.hf.from_tokenizer(
                    hf, n_vocab=self.vocab_size, eos_token=self.eos_token_ids or None
                )
            except ValueError as exc:
                raise ValueError(f"structured_outputs needs a fast (Rust) Hugging Face tokenizer: {exc}") from None
        return self._ll_tokenizer

    # ----------------------------------------------------------------- when a request is added
    def check(self, params: SamplingParams) -> None:
        if params.structured_outputs is not None:
            self.matcher_for(params.structured_outputs)

    def matcher_for(self, spec: StructuredOutputsParams) -> llguidance.LLMatcher:
        """A fresh matcher for ``spec``: a copy of the compiled one (compiled on first use)."""
        key = spec_key(spec)
        compiled = self._compiled.get(key)
        if compiled is None:
            faults.hit("grammar_compile")
            compiled = llguidance.LLMatcher(self.ll_tokenizer, check_grammar(spec, self.ll_tokenizer), log_level=0)
            if compiled.is_error():
                raise ValueError(f"structured_outputs.{spec.kind} does not compile: {_short(compiled.get_error())}")
            self._compiled[key] = compiled
            if len(self._compiled) > self.cache_size:
                self._compiled.popitem(last=False)
        self._compiled.move_to_end(key)
        return compiled.deep_copy()

    # ----------------------------------------------------------------- every step
    def apply(self, logits: Tensor, batch: ForwardBatch, seqs: Sequence[Seq]) -> None:
        """Mask every logit row of a sequence with a grammar, in place (see the module docstring)."""
        bitmask = self.bitmask(batch, seqs, logits.device)
        if bitmask is not None:
            copy_without_waiting = logits.device.type == "cuda"
            apply_bitmask(logits, bitmask.to(logits.device, non_blocking=copy_without_waiting))

    @torch.inference_mode()  # its host buffer is reused from step to step, which run in inference mode
    def bitmask(self, batch: ForwardBatch, seqs: Sequence[Seq], device: torch.device) -> Tensor | None:
        """The host bitmask of this step, one row per logit row (all ones for rows without a
        grammar), each grammar first advanced over its sequence's kept tokens; None when no row
        has a grammar (a prompt chunk short of its end samples nothing)."""
        constrained = [
            (seq, rows, guesses)
            for seq, rows, guesses in zip(seqs, batch.rows_of, batch.draft_token_ids, strict=True)
            if rows and seq.params.structured_outputs is not None
        ]
        if not constrained:
            return None
        bitmask = self._bitmask_buffer(batch.num_logits, device)
        for seq, rows, guesses in constrained:
            state = self.state_of(seq)
            try:
                faults.hit("grammar_mask", seq.request_id)
                self._fill(state, bitmask, rows, guesses)
            except Exception as exc:  # computing this request's mask: its grammar's work alone
                raise faults.RequestError(seq.request_id, "its grammar's mask", exc) from exc
        return bitmask

    def bitmask_of(self, matcher: llguidance.LLMatcher) -> Tensor:
        """The ``[ceil(V / 32)]`` int32 bitmask of the tokens ``matcher`` allows next."""
        row = torch.empty(1, (self.vocab_size + 31) // 32, dtype=torch.int32)
        self._fill_row(matcher, row, 0)
        return row[0]

    def state_of(self, seq: Seq) -> GrammarState:
        """``seq``'s grammar state, advanced over the tokens it has kept since the last step.
        Raises ``faults.RequestError`` naming ``seq`` when compiling or advancing its grammar
        raises: the engine fails that request alone."""
        try:
            return self._advanced(seq)
        except Exception as exc:  # llguidance's or ours, of this request alone
            raise faults.RequestError(seq.request_id, "its grammar", exc) from exc

    def _advanced(self, seq: Seq) -> GrammarState:
        state = self._states.get(seq)
        if state is None:
            assert seq.params.structured_outputs is not None
            state = self._states[seq] = GrammarState(self.matcher_for(seq.params.structured_outputs))
        new = seq.token_ids[seq.num_prompt_tokens + state.num_consumed :]
        if new:
            faults.hit("grammar_advance", seq.request_id)
            if not state.matcher.consume_tokens(new):
                logger.warning("%s: a kept token breaks its grammar: %s", seq.request_id, state.matcher.get_error())
            state.num_consumed += len(new)
        return state

    def _fill(self, state: GrammarState, bitmask: Tensor, rows: range, guesses: Sequence[int]) -> None:
        """Row ``rows[j]``: the mask after the first ``j`` guesses (consumed, then rolled back)."""
        matcher, consumed = state.matcher, 0
        for j, row in enumerate(rows):
            self._fill_row(matcher, bitmask, row)
            self.num_masked_rows += 1
            if j == len(guesses) or matcher.try_consume_tokens([guesses[j]]) != 1:
                break  # the last row, or a guess the grammar forbids: later rows are never used
            consumed += 1
        if consumed:
            matcher.rollback(consumed)

    def _fill_row(self, matcher: llguidance.LLMatcher, bitmask: Tensor, row: int) -> None:
        if matcher.is_error():
            bitmask[row] = self._eos_only
            return
        target = bitmask[row]
        matcher.unsafe_compute_mask_ptr(target.data_ptr(), target.numel() * target.element_size())

    def _bitmask_buffer(self, rows: int, device: torch.device) -> Tensor:
        """A host ``[rows, ceil(V / 32)]`` int32 buffer of ones. Reusing it is safe: the previous
        step's copy to the device finished at that step's host sync."""
        words = (self.vocab_size + 31) // 32
        if self._host is None or self._host.shape[0] < rows:
            pin = device.type == "cuda"
            self._host = torch.empty(max(rows, 64), words, dtype=torch.int32, pin_memory=pin)
        view = self._host[:rows]
        view.fill_(-1)
        return view
