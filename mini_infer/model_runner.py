"""From the step's sequences to logits: one typed ``ForwardBatch``, one flat forward (chapter 05).

Whoever runs a step (the engine of chapter 06, the draft model of chapter 10) describes each
sequence it computes with a ``SequenceInput``: the new tokens, where they start, the block table,
and whether logits are wanted after them. ``ModelRunner.prepare`` turns those into one immutable
``ForwardBatch`` holding everything the forward reads: flat ``input_ids`` and ``positions``, the
paged-attention metadata (slot mapping, padded block tables, gather rows and masks, chapter 05),
the query and context lengths, the rows whose logits are needed, and the guessed tokens those
rows verify. ``execute(batch)`` runs the model on it and returns those logits.

Layout: tokens are laid out flat, prefill chunks first, then the *batched group*: the sequences
that bring the same number ``Q`` of new tokens (``Q = 1``: decodes; ``Q = 1 + k``: speculative
verification), shortest context first, so that each attention bucket holds similar lengths. A
sequence that samples gets a logit row for its last token, and one for each guess it brings:
``1 + k`` rows, in input order.

Invariants: the batch is built once per step and never changed (the model and attention read
only it; nothing is computed lazily inside a layer); the step's host data (ids, positions, slots,
context lengths, block tables, logit rows) are assembled in Python lists and sent to the device
in one copy (``staged``; the batch's tensors are views of it); ``prepare`` never synchronises with
the device. A decode step the static step of ``decode_graphs`` serves is padded to its shape
here, and its attention metadata is built there, inside the graph, not here.

The batch keeps the inputs it was built from: with tensor parallelism (chapter 14) they are what
rank 0 sends the other ranks, each of which prepares its own batch from them (its gather rows
follow its own number of KV heads). ``check_health`` and ``close`` are the hooks for those worker
processes: on one process there is nothing to check or to release.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch.nn.attention import sdpa_kernel

from mini_infer.device import to_device
from mini_infer.kv.block_pool import num_blocks_for
from mini_infer.kv.paged_attention import (
    InPlaceAttention,
    PagedAttention,
    PagedAttentionMetadata,
    PagedKVCache,
    bucket_widths,
    host_tables,
    metadata_from_tensors,
)
from mini_infer.layers import sdpa_backends
from mini_infer.model import Qwen2Model

# Only short, decode-like groups are batched: a long chunk attends better on its own, where a
# chunk with no cached prefix needs no gather at all.
MAX_BATCHED_QUERY_LEN = 16


@dataclass(frozen=True, slots=True)
class SequenceInput:
    """What one sequence brings to a forward pass."""

    token_ids: Sequence[int]  # its new tokens, at positions start, start + 1, ...
    start: int  # tokens of the sequence whose K/V is already in the cache
    block_ids: Sequence[int]  # its block table, long enough for every new token
    samples: bool = False  # logits wanted after its last token (the chunk reaches the sequence's end)
    # Speculative decoding (chapter 10): guessed tokens fed after ``token_ids``; each gets a
    # logit row of its own, so that one forward verifies them all.
    draft_token_ids: Sequence[int] = ()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) + len(self.draft_token_ids)

    @property
    def context_len(self) -> int:
        return self.start + self.num_tokens

    @property
    def num_logits(self) -> int:
        return 1 + len(self.draft_token_ids) if self.samples else 0


@dataclass(frozen=True, slots=True)
class ForwardBatch:
    """Everything one forward computes, built once per step by ``ModelRunner.prepare``."""

    input_ids: torch.Tensor  # [T] long, prefill chunks first, then the batched group
    positions: torch.Tensor  # [T] long
    # Slot mapping, padded block tables, gather rows, masks; None when the static step serves the
    # batch (it builds its own from ``staged``).
    attention: PagedAttentionMetadata | None
    query_lens: tuple[int, ...]  # per input, in input order
    context_lens: tuple[int, ...]  # per input: cached tokens + new tokens
    logits_indices: torch.Tensor  # [R] long: the tokens (of T) whose logits are computed
    rows_of: tuple[range, ...]  # per input: its rows of the logits (empty when it does not sample)
    draft_token_ids: tuple[tuple[int, ...], ...]  # per input: the guesses its rows verify
    inputs: tuple[SequenceInput, ...]  # what it was built from (chapter 14 sends them to the other ranks)
    # The one host-to-device copy of the step: ids, positions, slots, context lengths, block
    # tables, logit indices (the tensors above are views of it), and the static step's shape.
    staged: torch.Tensor
    static_shape: tuple[int, int, int] | None = None

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def num_logits(self) -> int:
        return sum(len(rows) for rows in self.rows_of)

    @property
    def attended_tokens(self) -> int:
        """Sum over new tokens of the keys each attends to (for a roofline's FLOP count)."""
        return sum(q * c for q, c in zip(self.query_lens, self.context_lens))


class StaticDecode(Protocol):
    """Decode steps through a padded, shape-static step (``decode_graphs``: CUDA graphs)."""

    def shape_for(self, rows: int, query_len: int, width: int) -> tuple[int, int, int] | None:
        """``(query_len, padded rows, padded width)`` of the static step that serves ``rows``
        sequences of ``query_len`` tokens with block tables ``width`` wide, or None."""
        ...

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """The hidden states of the batch padded to its ``static_shape``."""
        ...


class ModelRunner:
    """One model and its paged KV cache: ``prepare`` a batch, then ``execute`` it."""

    def __init__(self, model: Qwen2Model, kv_cache: PagedKVCache) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = model.device
        self.attention_kernels = sdpa_backends(model.device, model.dtype)  # chapter 02
        self.static_decode: StaticDecode | None = None  # set by the engine builder on CUDA
        self.in_place_attention: InPlaceAttention | None = None  # chapter 05c's kernel, set by the builder

    def prepare(self, inputs: Sequence[SequenceInput]) -> ForwardBatch:
        batch_q = _batched_query_len(inputs)
        prefills = [i for i, s in enumerate(inputs) if s.num_tokens != batch_q]
        batched = sorted((i for i, s in enumerate(inputs) if s.num_tokens == batch_q), key=lambda i: inputs[i].start)
        input_ids: list[int] = []
        positions: list[int] = []
        token_start = [0] * len(inputs)
        for i in prefills + batched:
            s = inputs[i]
            token_start[i] = len(input_ids)
            input_ids += [*s.token_ids, *s.draft_token_ids]
            positions += range(s.start, s.context_len)
        logits_indices: list[int] = []
        rows_of = []
        for i, s in enumerate(inputs):
            end = token_start[i] + s.num_tokens
            rows_of.append(range(len(logits_indices), len(logits_indices) + s.num_logits))
            logits_indices += range(end - s.num_logits, end)
        prefill_rows = [(inputs[i].num_tokens, inputs[i].context_len, inputs[i].block_ids) for i in prefills]
        group = [(inputs[i].context_len, inputs[i].block_ids) for i in batched]
        bs, shape = self.kv_cache.block_size, None
        width = max((num_blocks_for(s.context_len, bs) for s in inputs), default=0)
        if self.static_decode is not None and not prefills and len(logits_indices) == len(input_ids):
            shape = self.static_decode.shape_for(len(batched), batch_q, width)
        if shape is not None:  # padding rows of the null block, to the static step's shape
            padding = shape[1] - len(batched)
            group += [(batch_q, [self.kv_cache.null_block] * num_blocks_for(batch_q, bs))] * padding
            input_ids += [0] * (batch_q * padding)
            positions += [*range(batch_q)] * padding
        slots, context_lens, tables, width = host_tables(prefill_rows, group, batch_q, bs, shape[2] if shape else 0)
        staged = to_device(
            [*input_ids, *positions, *slots, *context_lens, *tables, *logits_indices], torch.long, self.device
        )
        ids, pos, slot_tensor, context_tensor, table_tensor, logits_tensor = staged.split(
            [len(input_ids), len(positions), len(slots), len(context_lens), len(tables), len(logits_indices)]
        )
        metadata = None
        if shape is None:
            metadata = metadata_from_tensors(
                slot_tensor,
                table_tensor.view(len(context_lens), width),
                context_tensor,
                prefills=[(n, c) for n, c, _ in prefill_rows],
                buckets=[] if self.in_place_attention else bucket_widths([c for c, _ in group], bs),
                batch_query_len=batch_q,
                cache=self.kv_cache,
                num_heads=self.model.config.num_attention_heads,
            )
        return ForwardBatch(
            ids,
            pos,
            metadata,
            tuple(s.num_tokens for s in inputs),
            tuple(s.context_len for s in inputs),
            logits_tensor,
            tuple(rows_of),
            tuple(tuple(s.draft_token_ids) for s in inputs),
            tuple(inputs),
            staged,
            shape,
        )

    @torch.inference_mode()
    def execute(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits ``[R, vocab]`` of the batch's logit rows, in the model's dtype (a greedy step
        never needs a float32 copy of them)."""
        with sdpa_kernel(self.attention_kernels):
            if batch.attention is None:
                assert self.static_decode is not None, "a batch prepared for the static step"
                hidden = self.static_decode.run(batch)
            else:
                attention = PagedAttention(self.kv_cache, batch.attention, self.in_place_attention)
                hidden = self.model.forward(batch.input_ids, batch.positions, attention)
        if not batch.num_logits:
            return torch.empty(0, self.model.config.vocab_size, dtype=self.model.dtype, device=self.device)
        return self.model.compute_logits(hidden.index_select(0, batch.logits_indices), dtype=self.model.dtype)

    def check_health(self) -> None:
        """Raise when a part of the runner has died (chapter 14's worker processes); one process cannot."""

    def close(self) -> None:
        """Release what would outlive the runner (chapter 14's worker processes); nothing on one process."""


def _batched_query_len(inputs: Sequence[SequenceInput]) -> int:
    """The new-token count shared by the most sequences, up to ``MAX_BATCHED_QUERY_LEN``: they
    are attended as one group (0: no group)."""
    counts: dict[int, int] = {}
    for s in inputs:
        counts[s.num_tokens] = counts.get(s.num_tokens, 0) + 1
    small = [q for q in counts if q <= MAX_BATCHED_QUERY_LEN]
    return max(small, key=lambda q: (counts[q], -q)) if small else 0
