"""Speculative decoding: a small draft model proposes, the target model verifies (chapter 10).

A decode step of a large model reads all its weights to produce one token per sequence. If a
small *draft* model (Qwen2.5-0.5B for the 1.5B, ``tiny-draft`` for ``tiny``) guesses the next
``k`` tokens, the target can score all ``k + 1`` positions in **one** forward, the same flat
forward that runs prefill chunks (each sequence brings ``1 + k`` new tokens), and keep every
guess it agrees with. One target step then yields between 1 and ``k + 1`` tokens.

Which guesses to keep is decided by *rejection sampling* (Leviathan et al., Chen et al., 2023),
so that the tokens come out exactly as if the target had sampled them one by one. With ``p`` the
target's distribution at a position and ``q`` the draft's (both after temperature, top-k, top-p
and min-p, the ``sampling.probs_from_logits`` of the request), a draft token ``x`` is accepted
with probability ``min(1, p(x) / q(x))``; at the first rejection the token is drawn instead from
the residual ``max(0, p - q)`` (renormalised), and if all ``k`` are accepted a bonus token is
drawn from the target's last row. Greedy requests are the limit case: ``p`` and ``q`` are one-hot,
a guess is kept exactly when it equals the target's argmax, and the output equals plain greedy
decoding token for token.

How it sits in the engine (``LLMEngine.step``):

1. The scheduler gives each decoding sequence ``1 + k_i`` new tokens, with KV slots for the
   ``k_i`` drafts taken only from free blocks (``Scheduler._num_draft_slots``: at most
   ``num_speculative_tokens``, inside the token budget, never past ``max_tokens``; requests with
   penalties or logprobs are not speculated).
2. ``SpeculativeDecoder.propose`` runs the draft: a first pass over every scheduled sequence
   (prefill chunks too, so the draft's cache keeps up with the prompt), then ``k - 1`` decode
   passes, one proposal each.
3. The target runs the step as usual; its logits hold ``1 + k_i`` rows per speculating sequence.
4. ``SpeculativeDecoder.verify`` keeps the accepted prefix of each draft plus one token.

The draft keeps its own ``PagedKVCache`` with the same number of blocks, addressed by the *same*
block tables: a block id means the same positions in both pools, so the scheduler's blocks,
preemption and prefix cache serve both models, and throwing away rejected drafts is only a
shorter sequence (their K/V, in both pools, sits past the sequence's length and is overwritten
later). The draft lags the target by one token after a step that accepted everything (the last
draft token was never fed to the draft); ``Sequence.draft_lag`` records it, the next first pass
feeds that token too, and the prefix cache takes a block only when both pools hold it.

Randomness: a seeded request draws its uniforms and exponentials from its own generator, a fixed
number per verified position, so its tokens do not depend on the batch; they do depend on how
many drafts it was given each step (the token budget and free blocks decide that).
The draft's proposals come back to the host after each of its passes (the next pass's inputs
are built in Python): ``k`` host syncs a step, on top of the verification's one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from mini_infer.sampling import Sampler, SamplingParams, _exponential_race, argmax_rows, probs_from_logits
from mini_infer.scheduler import ScheduledSequence

if TYPE_CHECKING:
    from mini_infer.model_runner import ModelRunner, StepResult


def verify_greedy(target_argmax: list[int], draft_token_ids: list[int]) -> list[int]:
    """Greedy verification of one sequence: the drafts up to the first disagreement, then the
    target's own token there (or its bonus token after the last draft).
    ``target_argmax`` has ``len(draft_token_ids) + 1`` entries."""
    n = 0
    while n < len(draft_token_ids) and draft_token_ids[n] == target_argmax[n]:
        n += 1
    return draft_token_ids[:n] + [target_argmax[n]]


def rejection_sample(
    target_probs: Tensor, draft_probs: Tensor, draft_token_ids: Tensor, uniforms: Tensor, exponentials: Tensor
) -> tuple[Tensor, Tensor]:
    """Vectorised rejection sampling over flattened rows.

    Rows are the verified positions of every sequence, each sequence's ``k`` draft positions
    followed by its bonus position. ``target_probs`` and ``draft_probs`` are ``[R, V]`` float32
    (the draft's row is all zeros at a bonus position), ``draft_token_ids`` ``[R]`` (any value at
    a bonus position), ``uniforms`` ``[R]`` in [0, 1), ``exponentials`` ``[R, V]`` Exp(1) draws.

    Returns ``accepted [R]`` (bool; False at bonus positions) and ``recovered [R]``: the token to
    emit if this row is the first one rejected, drawn from ``max(0, p - q)``; at a bonus row
    that is just ``p``.
    """
    is_draft = draft_probs.sum(dim=-1) > 0
    index = torch.where(is_draft, draft_token_ids, torch.zeros_like(draft_token_ids)).unsqueeze(1)
    p = target_probs.gather(1, index).squeeze(1)
    q = draft_probs.gather(1, index).squeeze(1)
    # q > 0 wherever the draft sampled; bonus rows (q = 0) divide by 1 and are never accepted.
    accepted = is_draft & (uniforms < p / torch.where(is_draft, q, torch.ones_like(q)))
    residual = (target_probs - draft_probs).clamp_min(0)
    # Rounding can leave a residual with no mass where p and q agree to float precision; the
    # token is then drawn from p itself, which is what the residual is there to approximate.
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    residual = torch.where(empty, target_probs, residual)
    return accepted, _exponential_race(residual, exponentials)


def accepted_prefix(accepted: list[bool], recovered: list[int], draft_token_ids: list[int]) -> list[int]:
    """One sequence's tokens from its verified rows: drafts up to the first rejection, then the
    recovered token of that row (the bonus row's when none is rejected)."""
    n = 0
    while n < len(draft_token_ids) and accepted[n]:
        n += 1
    return draft_token_ids[:n] + [recovered[n]]


@dataclass(slots=True)
class Proposal:
    """What ``propose`` hands to ``verify``: the speculating items (their ``draft_token_ids``
    filled in) and the distributions the drafts were drawn from."""

    items: list[ScheduledSequence] = field(default_factory=list)
    # [sum over items of (k_i + 1), V] float32, laid out like the target's verified rows; None
    # when every item is greedy (then the drafts alone decide).
    draft_probs: Tensor | None = None


class SpeculativeDecoder:
    """Runs the draft model inside the engine's step; see the module docstring."""

    def __init__(self, draft_runner: ModelRunner, vocab_size: int) -> None:
        self.runner = draft_runner
        # The target's vocabulary size. Checkpoints of one tokenizer may pad it differently
        # (Qwen2.5-0.5B has 151,936 rows, Qwen2.5-7B 152,064): the draft's distributions are
        # cut or zero-padded to the target's width, ids past the tokenizer being padding.
        self.vocab_size = vocab_size
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    # ----------------------------------------------------------------- the draft's passes
    def propose(self, scheduled: list[ScheduledSequence], default_generator: torch.Generator) -> Proposal:
        """Run the draft model: fill ``draft_token_ids`` of every speculating item."""
        items = [s for s in scheduled if s.num_speculative_tokens]
        proposal = Proposal(items)
        # Pass 1: every scheduled sequence, so that the draft's cache holds what the target's
        # will hold after this step (its own tokens; a lagging token too).
        catch_up = []
        for s in scheduled:
            end = s.context_len - s.num_speculative_tokens
            catch_up.append(ScheduledSequence(s.seq, end - (s.seq.num_computed_tokens - s.seq.draft_lag), end))
        result = self.runner.execute(catch_up, last_position_only=True)
        if not items:
            return proposal
        logits = result.logits_at([result.rows_of[i][0] for i, s in enumerate(scheduled) if s.num_speculative_tokens])
        greedy = all(s.seq.params.greedy for s in items)
        probs_per_pass = []
        active = items
        for j in range(1, max(s.num_speculative_tokens for s in items) + 1):
            if j > 1:
                # Pass j: each sequence that still wants a draft feeds its previous one.
                active = [s for s in active if s.num_speculative_tokens >= j]
                drafting = [
                    ScheduledSequence(s.seq, 1, len(s.seq.token_ids) + j - 1, j - 1, s.draft_token_ids) for s in active
                ]
                logits = self.runner.execute(drafting, last_position_only=True).logits
            tokens, probs = self._draw(logits, active, default_generator, greedy)
            for s, token in zip(active, tokens.tolist()):
                s.draft_token_ids.append(token)
            probs_per_pass.append((active, probs))
        if not greedy:
            proposal.draft_probs = self._by_item(items, probs_per_pass)
        return proposal

    def _draw(
        self, logits: Tensor, items: list[ScheduledSequence], default_generator: torch.Generator, greedy: bool
    ) -> tuple[Tensor, Tensor | None]:
        """One proposal per row, and the distribution it was drawn from (None when all greedy)."""
        if logits.shape[1] > self.vocab_size:
            logits = logits[:, : self.vocab_size].contiguous()  # never propose an id the target lacks
        if greedy:
            return argmax_rows(logits), None
        params = [s.seq.params for s in items]
        probs = probs_from_logits(logits.to(torch.float32), params)
        gens = [s.seq.generator for s in items]
        # The sampler's own draws (chapter 09): a seeded row takes a fresh [V] from its generator.
        exponentials = Sampler._exponentials(probs.shape, params, gens, default_generator, probs.device)
        tokens = _exponential_race(probs, exponentials)
        return tokens, F.pad(probs, (0, self.vocab_size - probs.shape[1]))  # q = 0 where the draft has no row

    @staticmethod
    def _by_item(items: list[ScheduledSequence], probs_per_pass: list[tuple[list[ScheduledSequence], Tensor | None]]) -> Tensor:
        """The draft's distributions laid out like the target's verified rows, item by item,
        with an all-zero row at each item's bonus position."""
        offsets, total = {}, 0
        for s in items:
            offsets[id(s)] = total
            total += s.num_speculative_tokens + 1
        first = probs_per_pass[0][1]
        assert first is not None
        out = torch.zeros(total, first.shape[1], dtype=torch.float32, device=first.device)
        for j, (active, probs) in enumerate(probs_per_pass):
            assert probs is not None
            index = torch.tensor([offsets[id(s)] + j for s in active], device=first.device)
            out.index_copy_(0, index, probs)
        return out

    # ----------------------------------------------------------------- the target's verdict
    def verify(
        self, proposal: Proposal, result: StepResult, scheduled: list[ScheduledSequence], default_generator: torch.Generator
    ) -> dict[int, list[int]]:
        """Tokens for each speculating item (by its index in ``scheduled``): the accepted drafts
        and one more. Updates each sequence's ``draft_lag`` and the acceptance counters (which
        count the target's verdicts, also on drafts that a stop string or token then cuts off)."""
        index_of = {id(s): i for i, s in enumerate(scheduled)}
        rows = [r for s in proposal.items for r in result.rows_of[index_of[id(s)]]]
        if not rows:
            return {}
        logits = result.logits_at(rows)
        drafts = [s.draft_token_ids for s in proposal.items]
        if proposal.draft_probs is None:
            argmax = argmax_rows(logits).tolist()  # the verification's host sync
            produced, start = [], 0
            for d in drafts:
                produced.append(verify_greedy(argmax[start : start + len(d) + 1], d))
                start += len(d) + 1
        else:
            produced = self._verify_sampled(logits, proposal, default_generator)
        out = {}
        for s, tokens in zip(proposal.items, produced):
            accepted = len(tokens) - 1
            self.num_draft_tokens += s.num_speculative_tokens
            self.num_accepted_tokens += accepted
            # The draft was never fed its last proposal: after a full acceptance it lags by one.
            s.seq.draft_lag = 1 if accepted == s.num_speculative_tokens else 0
            out[index_of[id(s)]] = tokens
        return out

    def _verify_sampled(self, logits: Tensor, proposal: Proposal, default_generator: torch.Generator) -> list[list[int]]:
        assert proposal.draft_probs is not None
        items = proposal.items
        params = [s.seq.params for s in items for _ in range(s.num_speculative_tokens + 1)]
        gens = [s.seq.generator for s in items for _ in range(s.num_speculative_tokens + 1)]
        device = logits.device
        target_probs = probs_from_logits(logits.to(torch.float32), params)
        draft_ids = torch.tensor([t for s in items for t in s.draft_token_ids + [0]], device=device)
        uniforms = self._uniforms(items, default_generator, device)
        exponentials = Sampler._exponentials(target_probs.shape, params, gens, default_generator, device)
        accepted, recovered = rejection_sample(target_probs, proposal.draft_probs, draft_ids, uniforms, exponentials)
        flat = torch.stack([accepted.long(), recovered]).tolist()  # the verification's host sync
        produced, start = [], 0
        for s in items:
            end = start + s.num_speculative_tokens + 1
            produced.append(accepted_prefix([bool(a) for a in flat[0][start:end]], flat[1][start:end], s.draft_token_ids))
            start = end
        return produced

    @staticmethod
    def _uniforms(items: list[ScheduledSequence], default_generator: torch.Generator, device: torch.device) -> Tensor:
        """One uniform per verified row: a seeded request's from its own generator (``k + 1``
        draws, whatever the batch), the others' from one shared draw. Greedy rows need none:
        their ratio is exactly 0 or 1, so any value in (0, 1) decides the same."""
        total = sum(s.num_speculative_tokens + 1 for s in items)
        uniforms = torch.rand(total, device=device, generator=default_generator)
        start = 0
        for s in items:
            n = s.num_speculative_tokens + 1
            params: SamplingParams = s.seq.params
            if params.greedy:
                uniforms[start : start + n] = 0.5
            elif s.seq.generator is not None:
                uniforms[start : start + n] = torch.rand(n, device=device, generator=s.seq.generator)
            start += n
        return uniforms
