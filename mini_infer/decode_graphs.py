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
  so a handful of graphs serve every step; a shape whose padded gather would exceed
  ``MAX_GRAPH_KEYS`` keys runs eagerly, gathering by the real contexts (each graph's gather is
  memory its pool keeps). ``ModelRunner.prepare`` asks ``shape_for`` and pads
  the step on the host: padding rows write their K/V into the cache's null block and attend only
  to it (they touch no sequence's data). The step's host data then reach the device in one copy,
  and ``run`` copies them into the static buffer in one more: outside the graph a decode step is
  those two copies and the logits' gather and matmul (it was some thirty operations);
* a graph ends at the final norm: its output is the hidden states of the padded step
  (``[B_padded * Q, hidden]``), and the logits are computed after the replay, eagerly, for the
  real rows only. Inside the graph they would be a ``[B_padded * Q, vocab]`` buffer per graph,
  held by the graph pool for as long as the engine lives (151,936 numbers a row for Qwen2.5:
  hundreds of MB over the captured sizes);
* attention of the padded step is one bucket of the paged attention of this chapter, whose gather
  rows and mask come from the eager step's own builder (``metadata_from_tensors``), run on the
  static buffers at the start of the step, inside the graph (never inside a layer);
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

from mini_infer.kv.paged_attention import InPlaceAttention, PagedAttention, PagedKVCache, metadata_from_tensors
from mini_infer.model import Qwen2Model
from mini_infer.model_runner import MAX_BATCHED_QUERY_LEN, ForwardBatch

# A graph gathers every row's keys padded to its width, into memory its pool holds for as long as
# the engine lives: at 256 rows of 4k tokens of a 7B-class shape that was 2 GiB per layer. A shape
# gathers at most this many keys (rows x width x block size); a wider step runs eagerly, where the
# buckets of build_metadata size the gather by the real contexts.
MAX_GRAPH_KEYS = 1 << 18


def captured_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to ``max_num_seqs`` (and ``max_num_seqs`` itself)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sorted(set(sizes + [max_num_seqs]))


class DecodeGraphs:
    """Static buffers and recorded graphs of one model's decode steps (see the module docstring)."""

    def __init__(
        self,
        model: Qwen2Model,
        cache: PagedKVCache,
        *,
        max_num_seqs: int,
        max_model_len: int,
        capture: bool,
        in_place: InPlaceAttention | None = None,
    ) -> None:
        self.model, self.cache, self.capture, self.in_place = model, cache, capture, in_place
        self.batch_sizes = captured_batch_sizes(max_num_seqs)
        self.max_width = -(-max_model_len // cache.block_size)
        # The static step's inputs, laid out as ``ModelRunner.prepare`` stages a step padded to its
        # shape: ids, positions, slots (``q`` per row each), context lengths, block tables.
        self.staging = torch.zeros(
            max_num_seqs * (3 * MAX_BATCHED_QUERY_LEN + 1 + self.max_width), dtype=torch.long, device=model.device
        )
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.steps: dict[tuple[int, int, int], Callable[[], torch.Tensor]] = {}
        self.eager_only: set[tuple[int, int, int]] = set()

    def shape_for(self, rows: int, query_len: int, width: int) -> tuple[int, int, int] | None:
        """``(query_len, size, padded width)`` of the static step for ``rows`` sequences of
        ``query_len`` tokens with block tables ``width`` wide: ``rows`` padded to the next captured
        batch size, ``width`` to the next power of two; None when no static step serves them (a
        padded gather over ``MAX_GRAPH_KEYS`` keys included; the in-place kernel gathers none)."""
        size = next((b for b in self.batch_sizes if b >= rows), None)
        if size is None or rows == 0 or not 0 < query_len <= MAX_BATCHED_QUERY_LEN or width > self.max_width:
            return None
        width = min(self.max_width, 1 << max(width - 1, 0).bit_length())
        gathered = 0 if self.in_place else size * width * self.cache.block_size  # in place: nothing gathered
        return (query_len, size, width) if gathered <= MAX_GRAPH_KEYS else None

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """The hidden states of ``batch``, which ``ModelRunner.prepare`` padded to its
        ``static_shape``: one copy into the static buffer, then the step (a graph's replay)."""
        assert batch.static_shape is not None, "a batch prepared for this static step"
        graph_inputs = batch.staged.numel() - batch.logits_indices.numel()
        self.staging[:graph_inputs].copy_(batch.staged[:graph_inputs])
        return self._step(batch.static_shape)()

    def buffers(self, key: tuple[int, int, int]) -> list[torch.Tensor]:
        """The static buffers of shape ``key``, views of ``staging`` in the order ``prepare`` stages
        them: ids, positions, slots ``[size * q]``, context lengths ``[size]``, tables ``[size, width]``."""
        q, size, width = key
        parts = self.staging[: 3 * size * q + size * (1 + width)].split([size * q] * 3 + [size, size * width])
        return [*parts[:4], parts[4].view(size, width)]

    def _forward(self, key: tuple[int, int, int]) -> torch.Tensor:
        """The padded static step on the static buffers, up to the final norm: its hidden states,
        ``[size * q, hidden]``. Every address is the same at each call."""
        q, size, width = key
        ids, positions, slots, context_lens, tables = self.buffers(key)
        meta = metadata_from_tensors(  # the eager step's builder, one bucket of every row
            slots,
            tables,
            context_lens,
            prefills=(),
            buckets=() if self.in_place else ((0, size, width),),  # the kernel reads the blocks in place
            batch_query_len=q,
            cache=self.cache,
            num_heads=self.model.config.num_attention_heads,
        )
        return self.model.forward(ids, positions, PagedAttention(self.cache, meta, self.in_place))

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
