"""The engine's first sampler: greedy, and the tokens a step keeps (chapter 06).

A step's forward gives each sampling sequence one logit row, or ``1 + k`` when it brought ``k``
guessed tokens after its own (speculative decoding, chapter 10: the guesses are verified in the
same forward). What a sequence keeps is always the same rule, ``accepted_prefix``: its guesses up
to the first one the model rejects, then the model's own token at that row. With no guesses that
is just the model's token: plain decoding is verification with ``k = 0``.

``GreedySampler`` is the sampler the engine of this chapter starts with: the argmax of every row,
a guess accepted when it equals the argmax. It refuses, when a request is added, what only the
full sampler of chapter 09 (``sampling.Sampler``) can do: temperature, penalties, logprobs,
logit biases, ``min_tokens`` and grammars.

Invariant: one host sync per step, the ``tolist`` of the argmax.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mini_infer.model_runner import ForwardBatch
from mini_infer.outputs import TokenLogprob
from mini_infer.sampling_params import SamplingParams
from mini_infer.sequence import Sequence as Seq


@dataclass(slots=True)
class SampledTokens:
    """What one step keeps for one sequence: its new tokens (none for a prompt chunk that does
    not reach the end), and their logprobs when the request asked for them."""

    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None


def accepted_prefix(
    target_token_ids: Sequence[int], draft_token_ids: Sequence[int], accepted: Sequence[bool] | None = None
) -> list[int]:
    """The guesses up to the first rejected one, then the target's token at that row (after the
    last guess: its bonus token). ``target_token_ids`` has one entry per row, ``len(draft_token_ids)
    + 1``. Without ``accepted`` (greedy) a guess is accepted when it equals the target's token."""
    n = 0
    while n < len(draft_token_ids) and (draft_token_ids[n] == target_token_ids[n] if accepted is None else accepted[n]):
        n += 1
    return [*draft_token_ids[:n], target_token_ids[n]]


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (its first maximum, as ``Tensor.argmax``), for logits of any dtype.

    ``Tensor.argmax`` over 151,936 columns runs at about one element per nanosecond on a CPU
    core, while ``amax`` is vectorised: so the row is cut into blocks of up to 128 columns, the
    first block holding the row's maximum is found from the block maxima, and only that block
    is searched. At 64 rows of bf16 Qwen2.5 logits: 4 ms, against 26 ms for casting to float32
    and taking the argmax. A vocabulary that no block width divides falls back to ``argmax``.
    """
    rows, vocab = logits.shape
    width = next((w for w in (128, 64, 32, 16) if vocab % w == 0 and vocab > w), 0)
    if not width:
        return logits.argmax(dim=-1)
    blocks = logits.view(rows, vocab // width, width)
    block = blocks.amax(dim=-1).argmax(dim=-1)  # the first block that holds the row's maximum
    within = blocks[torch.arange(rows, device=logits.device), block].argmax(dim=-1)
    return block * width + within


def keep_per_sequence(
    batch: ForwardBatch, token_ids: list[int], accepted: list[bool] | None = None
) -> list[SampledTokens]:
    """Each input's kept tokens, from the token chosen at every logit row (host lists)."""
    kept = []
    for rows, drafts in zip(batch.rows_of, batch.draft_token_ids):
        span = slice(rows.start, rows.stop)
        verdicts = None if accepted is None else accepted[span]
        kept.append(SampledTokens(accepted_prefix(token_ids[span], drafts, verdicts) if rows else []))
    return kept


class GreedySampler:
    """Greedy decoding for the engine of chapter 06 (see the module docstring)."""

    def check(self, params: SamplingParams) -> None:
        if not params.greedy or params.needs_penalties or params.logprobs is not None or params.changes_logits:
            raise ValueError(
                "this engine decodes greedily only (temperature=0; no penalties, logprobs, logit_bias, min_tokens "
                "or structured_outputs); give it the full sampler of chapter 09 (mini_infer.sampling.Sampler), "
                "as LLM does"
            )

    def sample(self, logits: torch.Tensor, batch: ForwardBatch, seqs: list[Seq]) -> list[SampledTokens]:
        return keep_per_sequence(batch, argmax_rows(logits).tolist())  # the step's one host sync
