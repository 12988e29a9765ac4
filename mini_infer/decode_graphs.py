"""CUDA graphs for decode steps: a shape-static, padded step, recorded once and replayed (chapter 05).

A decode step of a small model on a GPU is launch-bound: hundreds of small kernels, each
launched from Python, while the GPU waits. A CUDA graph records those launches once, with every
address fixed, and replays them with one call. The price is static shapes: a graph replays the
same kernels on the same buffers, so a step must be copied into buffers of a size fixed in
advance. Only decode steps are recorded: they come in few shapes (how many sequences, how many
tokens each: 1, or ``1 + k`` when speculative decoding verifies ``k`` guesses), while prefill
chunks come in every length and are long enough that launches do not matter. So:

* a step qualifies when every sequence brings the same ``Q`` new tokens and samples all of them
  (``ForwardBatch`` has no prefill span and one logit row per token);
* its ``B`` sequences are padded to the next *captured batch size* (1, 2, 4, 8, then steps of 16
  up to ``max_num_seqs``, as nano-vllm does) and its block tables to the next power-of-two width,
  so a handful of graphs serve every step. Padding rows write their K/V into the cache's null
  block and attend only to it: they touch no sequence's data;
* a graph ends at the final norm: its output is the hidden states of the padded step
  (``[B_padded * Q, hidden]``), and the logits are computed after the replay, eagerly, for the
  real rows only. Inside the graph they would be a ``[B_padded * Q, vocab]`` buffer per graph,
  held by the graph pool for as long as the engine lives (151,936 numbers a row for Qwen2.5:
  hundreds of MB over the captured sizes);
* attention of the padded step is one bucket of the paged attention of this chapter, whose gather
  rows and mask are computed from the static buffers at the start of the step, inside the graph
  (never inside a layer);
* a graph is recorded the first time its shape is needed, and before it serves, its replay is
  checked against the same step run eagerly: a graph that does not reproduce it is never used
  (a warning says so, and that shape runs eagerly from then on). The output is filled with NaN
  before that replay, so a graph that recorded nothing (its kernels ran eagerly during capture,
  leaving the right values behind) fails the check instead of serving stale logits;
* everything happens on the model's device, not the current one: the side stream of the warm-up,
  the capture stream and the graph are made under ``torch.cuda.device(model.device)``. An engine
  on ``cuda:1`` would otherwise capture on ``cuda:0``'s stream while its kernels ran eagerly on
  ``cuda:1``: an empty graph.

On a CPU nothing is recorded (``capture=False``): the same padded, static step runs eagerly,
which is how the tests check it against the unpadded step.

Invariant: a replayed step computes the same logits as the eager padded step, which equals the
unpadded step up to float rounding (tests require identical greedy tokens).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

from mini_infer.kv.paged_attention import BatchBucket, PagedAttention, PagedAttentionMetadata, PagedKVCache, _pool_rows
from mini_infer.layers import folded_bias
from mini_infer.model import Qwen2Model
from mini_infer.model_runner import ForwardBatch


def captured_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to ``max_num_seqs`` (and ``max_num_seqs`` itself)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sorted(set(sizes + [max_num_seqs]))


def static_metadata(
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_len: int,
    cache: PagedKVCache,
    num_heads: int,
) -> PagedAttentionMetadata:
    """The attention metadata of a padded decode step, computed from tensors only (no host data),
    so that it can be recorded in a graph: one bucket of all ``B`` rows, ``W`` blocks wide."""
    rows, width = block_tables.shape
    bs = cache.block_size
    group = num_heads // cache.num_kv_heads
    last_visible = context_lens[:, None] - query_len + torch.arange(query_len, device=context_lens.device)[None, :]
    mask = torch.arange(width * bs, device=context_lens.device)[None, None, :] <= last_visible[:, :, None]
    bucket = BatchBucket(
        0,
        rows,
        _pool_rows(block_tables.reshape(-1), cache.num_kv_heads, cache.k.shape[2]),
        folded_bias(mask[None], group, cache.k.dtype),
    )
    return PagedAttentionMetadata(
        slot_mapping, slot_mapping // bs, slot_mapping % bs, block_tables, (), 0, query_len, (bucket,)
    )


class DecodeGraphs:
    """Static buffers and recorded graphs of one model's decode steps (see the module docstring)."""

    def __init__(
        self, model: Qwen2Model, cache: PagedKVCache, *, max_num_seqs: int, max_model_len: int, capture: bool
    ) -> None:
        self.model, self.cache, self.capture = model, cache, capture
        self.batch_sizes = captured_batch_sizes(max_num_seqs)
        self.max_width = -(-max_model_len // cache.block_size)
        self.max_query_len = 16
        device, rows = model.device, max_num_seqs * self.max_query_len
        self.input_ids = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.slot_mapping = torch.zeros(rows, dtype=torch.long, device=device)
        self.block_tables = torch.full(
            (max_num_seqs, self.max_width), cache.null_block, dtype=torch.long, device=device
        )
        self.context_lens = torch.zeros(max_num_seqs, dtype=torch.long, device=device)
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.steps: dict[tuple[int, int, int], Callable[[], torch.Tensor]] = {}
        self.eager_only: set[tuple[int, int, int]] = set()

    def run(self, batch: ForwardBatch) -> torch.Tensor | None:
        """The batch's logits through the padded static step, or None when it does not qualify."""
        meta = batch.attention
        q, rows = meta.batch_query_len, meta.batch_size
        if meta.prefills or rows == 0 or q > self.max_query_len or batch.num_logits != rows * q:
            return None
        size = next((b for b in self.batch_sizes if b >= rows), None)
        used = meta.block_tables.shape[1]
        width = min(self.max_width, 1 << max(used - 1, 0).bit_length())
        if size is None or used > self.max_width:
            return None
        self._load(batch, rows, size, q)
        key = (q, size, width)
        hidden = self._step(key)()
        # Outside the graph, and for the real rows only (see the module docstring).
        return self.model.compute_logits(hidden.index_select(0, batch.logits_indices), dtype=self.model.dtype)

    def _load(self, batch: ForwardBatch, rows: int, size: int, q: int) -> None:
        """Copy the batch into the static buffers; rows past it become padding: token 0 at
        positions 0 .. q - 1 of the null block, attending to those ``q`` slots only."""
        meta, null = batch.attention, self.cache.null_block
        tokens, padded = rows * q, size * q
        self.input_ids[:tokens].copy_(batch.input_ids)
        self.positions[:tokens].copy_(batch.positions)
        self.slot_mapping[:tokens].copy_(meta.slot_mapping)
        used = meta.block_tables.shape[1]
        self.block_tables[:rows, :used].copy_(meta.block_tables)
        self.block_tables[:rows, used:].fill_(null)
        self.block_tables[rows:size].fill_(null)
        self.context_lens[:rows].copy_(batch.positions.view(rows, q)[:, -1] + 1)
        self.context_lens[rows:size].fill_(q)
        offsets = torch.arange(q, device=self.positions.device) % self.cache.block_size
        self.input_ids[tokens:padded].zero_()
        self.positions[tokens:padded].copy_(offsets.repeat(size - rows))
        self.slot_mapping[tokens:padded].copy_((null * self.cache.block_size + offsets).repeat(size - rows))

    def _forward(self, key: tuple[int, int, int]) -> torch.Tensor:
        """The padded static step on the static buffers, up to the final norm: its hidden states,
        ``[size * q, hidden]``. Every address is the same at each call."""
        q, size, width = key
        tokens = size * q
        meta = static_metadata(
            self.slot_mapping[:tokens],
            self.block_tables[:size, :width],
            self.context_lens[:size],
            q,
            self.cache,
            self.model.config.num_attention_heads,
        )
        return self.model.forward(self.input_ids[:tokens], self.positions[:tokens], PagedAttention(self.cache, meta))

    def _step(self, key: tuple[int, int, int]) -> Callable[[], torch.Tensor]:
        if key not in self.steps:
            self.steps[key] = (
                self._record(key) if self.capture and key not in self.eager_only else (lambda: self._forward(key))
            )
        return self.steps[key]

    def _record(self, key: tuple[int, int, int]) -> Callable[[], torch.Tensor]:
        """Record the step of this shape on the model's device, then check its replay (into an
        output filled with NaN) against the eager step on the batch already in the buffers, by
        the logits of every row (computed outside the graph); a graph that differs never serves."""
        device = self.model.device
        problem = "did not reproduce the eager step"
        with torch.cuda.device(device):
            stream = torch.cuda.Stream(device=device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                expected = self._forward(key).clone()  # also warms up every kernel before recording
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, pool=self.pool, stream=torch.cuda.Stream(device=device)):
                    output = self._forward(key)
                output.fill_(float("nan"))  # what the eager kernels of an empty capture left is gone
                graph.replay()
                got, want = (self.model.compute_logits(h, dtype=self.model.dtype) for h in (output, expected))
                same = torch.equal(got.argmax(-1), want.argmax(-1))
                if same and torch.allclose(got, want, rtol=1e-3, atol=1e-3):
                    problem = ""
            except RuntimeError as error:  # a kernel that cannot be recorded: serve eagerly, never fail
                problem = f"could not be recorded ({error})"
        if problem:
            warnings.warn(
                f"the CUDA graph of decode steps of shape (tokens per sequence, batch, blocks) = {key} {problem}; "
                "that shape runs eagerly",
                RuntimeWarning,
                stacklevel=2,
            )
            self.eager_only.add(key)
            return lambda: self._forward(key)

        def replay() -> torch.Tensor:
            graph.replay()
            return output

        return replay
