"""From a schedule to logits: one flat forward per engine step (chapters 05 and 06).

The scheduler says which sequences run and how many new tokens each brings. The runner lays
those tokens out flat (prefill chunks first, then the batched group of sequences that bring the
same number of tokens: decodes, shortest context first), builds the paged-attention metadata once for all layers, runs
the model, and computes logits only where a token will be sampled: the last position of every
chunk that reaches the end of its sequence, and, when speculative decoding (chapter 10) verifies
drafts, every draft position too (``1 + num_speculative_tokens`` rows for that sequence).

Everything for a step is assembled in Python lists and moved to the device in one go; the only
host synchronisation of a step is the sampler's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mini_infer.kv.paged_attention import PagedAttention, PagedKVCache, build_metadata
from mini_infer.model import Qwen2Model
from mini_infer.scheduler import ScheduledSequence


@dataclass(slots=True)
class StepResult:
    logits: torch.Tensor  # [rows, vocab] in the model's dtype, one row per sampled position
    rows_of: list[range]  # for each scheduled sequence (schedule order): its rows in ``logits``

    def logits_at(self, rows: list[int]) -> torch.Tensor:
        """``logits[rows]``, without a copy when ``rows`` are all of them in order."""
        if rows == list(range(self.logits.shape[0])):
            return self.logits
        return self.logits.index_select(0, torch.tensor(rows, dtype=torch.long, device=self.logits.device))


class ModelRunner:
    def __init__(self, model: Qwen2Model, kv_cache: PagedKVCache, *, feed_unknown_ids_as: int | None = None) -> None:
        self.model = model
        self.kv_cache = kv_cache
        # A draft model (chapter 10) may have a smaller padded vocabulary than its target, whose
        # tokens it must read: ids past its own are fed as this id (its guesses only get worse).
        self.feed_unknown_ids_as = feed_unknown_ids_as
        self.block_size = kv_cache.block_size
        self.device = model.device

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSequence], *, last_position_only: bool = False) -> StepResult:
        """Run one step. A sequence that samples gets ``1 + num_speculative_tokens`` logit rows
        (the verification of its drafts), or only its last position's with ``last_position_only``
        (what a draft model proposing the next token needs)."""
        batch_q = self._batched_query_len(scheduled)
        prefills = [i for i, s in enumerate(scheduled) if s.num_new_tokens != batch_q]
        # Shortest context first: the attention buckets of the group then hold similar lengths.
        batched = sorted((i for i, s in enumerate(scheduled) if s.num_new_tokens == batch_q), key=lambda i: scheduled[i].context_len)
        order = prefills + batched

        input_ids: list[int] = []
        positions: list[int] = []
        token_start = [0] * len(scheduled)
        for i in order:
            s = scheduled[i]
            start = s.context_len - s.num_new_tokens
            token_start[i] = len(input_ids)
            input_ids.extend(s.input_token_ids())
            positions.extend(range(start, s.context_len))

        metadata = build_metadata(
            prefills=[(scheduled[i].num_new_tokens, scheduled[i].context_len, scheduled[i].seq.block_table.block_ids) for i in prefills],
            batch=[(scheduled[i].context_len, scheduled[i].seq.block_table.block_ids) for i in batched],
            batch_query_len=batch_q,
            block_size=self.block_size,
            device=self.device,
        )
        if self.feed_unknown_ids_as is not None:
            vocab = self.model.config.vocab_size
            input_ids = [t if t < vocab else self.feed_unknown_ids_as for t in input_ids]
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        hidden = self.model.forward(ids, pos, PagedAttention(self.kv_cache, metadata))

        sample_index: list[int] = []
        rows_of: list[range] = []
        for i, s in enumerate(scheduled):
            if not s.samples:
                rows_of.append(range(len(sample_index), len(sample_index)))
                continue
            k = 1 if last_position_only else 1 + s.num_speculative_tokens
            end = token_start[i] + s.num_new_tokens
            rows_of.append(range(len(sample_index), len(sample_index) + k))
            sample_index.extend(range(end - k, end))
        if not sample_index:
            return StepResult(torch.empty(0, self.model.config.vocab_size, dtype=self.model.dtype, device=self.device), rows_of)
        index = torch.tensor(sample_index, dtype=torch.long, device=self.device)
        # The model's dtype: a greedy step never needs a float32 copy of [rows, vocab] logits.
        return StepResult(self.model.compute_logits(hidden.index_select(0, index), dtype=self.model.dtype), rows_of)

    @staticmethod
    def _batched_query_len(scheduled: list[ScheduledSequence]) -> int:
        """The new-token count shared by the most sequences: they are attended as one batch."""
        counts: dict[int, int] = {}
        for s in scheduled:
            counts[s.num_new_tokens] = counts.get(s.num_new_tokens, 0) + 1
        # Only short, decode-like groups are batched (Q <= 16): a long chunk attends better on
        # its own, where a chunk with no cached prefix needs no gather at all. 0 = no group.
        small = [q for q in counts if q <= 16]
        return max(small, key=lambda q: (counts[q], -q)) if small else 0
