"""Speculative decoding: a small draft model guesses, the target model verifies (chapter 10).

A decode step of a large model reads all its weights to produce one token per sequence. If a
small *draft* model (Qwen2.5-0.5B for the 1.5B, ``tiny-draft`` for ``tiny``) guesses the next
``k`` tokens, the target can score all ``k + 1`` positions in **one** forward, the same flat
forward that runs prefill chunks (each sequence brings ``1 + k`` new tokens), and keep every
guess it agrees with. One target step then yields between 1 and ``k + 1`` tokens.

Which guesses to keep is decided by *rejection sampling* (Leviathan et al., Chen et al., 2023),
so that the tokens come out exactly as if the target had sampled them one by one. With ``p`` the
target's distribution at a position and ``q`` the draft's (both after temperature, top-k, top-p
and min-p, the ``sampling.probs_from_logits`` of the request), a guess ``x`` is accepted with
probability ``min(1, p(x) / q(x))``; at the first rejection the token is drawn instead from the
residual ``max(0, p - q)`` (renormalised), and if all ``k`` are accepted a bonus token is drawn
from the target's last row. Greedy requests are the limit case: ``p`` and ``q`` are one-hot, a
guess is kept exactly when it equals the target's argmax (``greedy.accepted_prefix``), and the
output equals plain greedy decoding token for token.

Everything of it lives here, in ``SpeculativeDecoder``, which plays three parts of the engine:

1. ``Speculation`` for the scheduler (chapter 06): ``num_draft_slots`` (``k``, or 0 for requests
   with penalties or logprobs, whose distributions would depend on unconfirmed tokens) and
   ``num_cacheable_tokens``. The scheduler hands out draft slots last, from the budget and the
   free blocks left, never past ``max_tokens``.
2. ``Drafter`` for the engine: ``propose`` runs the draft, a first pass over every scheduled
   sequence (prefill chunks too, so that the draft's cache keeps up with the prompt), then
   ``k - 1`` passes, one guess each. Each pass is a ``ForwardBatch`` of the draft's own, from the
   same builder (chapter 05); a draft with a smaller padded vocabulary than the target reads the
   target's padding ids as id 0, mapped where its inputs are made.
3. The ``TokenSampler``: ``sample`` verifies every sequence's guesses in one pass over the
   target's logit rows (plain sampling is the case ``k = 0``), with one host sync. It is not a
   sampler of its own: the target's rows, and the draft's, go through chapter 9's ``Sampler``
   pipeline (``step_arguments``: restrict; ``rows``: penalties; ``LogitRows.probs``: the
   distributions), and this module adds only the verdict, ``rejection_sample``. Greedy guesses
   need no distributions and are verified by the ``Sampler`` itself (``greedy.accepted_prefix``);
   the distributions of sampled ones stay here, from ``propose`` to the ``sample`` of that step.

The draft keeps its own ``PagedKVCache`` with the same number of blocks, addressed by the *same*
block tables: a block id means the same positions in both pools, so the scheduler's blocks,
preemption and prefix cache serve both models, and throwing away rejected guesses is only a
shorter sequence (their K/V, in both pools, sits past the sequence's length and is overwritten
later). After a step that kept every guess the draft is one token behind (its last guess was
never fed to it): the decoder's own per-request count of the tokens the draft's cache holds
(``_draft_computed``, keyed weakly by the sequence, so that it goes with the request) records it,
the next first pass feeds that token too, and the prefix cache takes a block only when both pools
hold it. The count needs no reset when a preemption or a shared prefix resets the target's: what
both caches hold is the smaller of the two counts.

Randomness: a seeded request draws its uniforms and exponentials from its own generator, a fixed
number per verified row, so its tokens do not depend on the batch; they do depend on how many
guesses it was given each step (the token budget and free blocks decide that). The draft's
guesses come back to the host after each of its passes (the next pass's inputs are built in
Python): ``k`` host syncs a step, on top of the target's one.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from mini_infer.config import ModelConfig
from mini_infer.device import to_device
from mini_infer.engine import Proposal
from mini_infer.greedy import SampledTokens, argmax_rows
from mini_infer.model_runner import ForwardBatch, ModelRunner, SequenceInput
from mini_infer.sampling import Sampler, SamplerOutput, exponential_race, per_sequence
from mini_infer.sampling_params import SamplingParams
from mini_infer.scheduler import SchedulerOutput
from mini_infer.sequence import Sequence as Seq
from mini_infer.tokenizer import Tokenizer


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
    # student: begin chapter 10: accept each guess with probability min(1, p/q); recover from max(0, p - q)
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
    return accepted, exponential_race(residual, exponentials)
    # student: end


def check_draft_vocabulary(
    draft: str, draft_dir: Path, target: str, target_config: ModelConfig, tokenizer: Tokenizer
) -> None:
    """Token ids must mean the same in both models. Equal vocabulary sizes are taken on trust (as
    vLLM does); different ones are fine when only the padding differs, that is when both
    tokenizers are the same (Qwen2.5-0.5B drafting for Qwen2.5-7B)."""
    vocab = ModelConfig.from_model_dir(draft_dir).vocab_size
    if vocab != target_config.vocab_size and Tokenizer(draft_dir).hf.get_vocab() != tokenizer.hf.get_vocab():
        raise ValueError(
            f"draft_model {draft!r} has a vocabulary of {vocab} tokens and another tokenizer than the target "
            f"{target!r} ({target_config.vocab_size} tokens); a draft must share the target's tokenizer (for example "
            "Qwen2.5-0.5B-Instruct for Qwen2.5-1.5B-Instruct, tiny-draft for tiny)"
        )


class SpeculativeDecoder:
    """The draft model inside the engine's step, and the policy that verifies its guesses with
    chapter 9's ``Sampler`` (see above)."""

    def __init__(
        self, draft_runner: ModelRunner, num_speculative_tokens: int, vocab_size: int, sampler: Sampler
    ) -> None:
        self.runner = draft_runner
        self.num_speculative_tokens = num_speculative_tokens
        # The target's vocabulary size. Checkpoints of one tokenizer may pad it differently
        # (Qwen2.5-0.5B has 151,936 rows, Qwen2.5-7B 152,064): the draft's distributions are
        # cut or zero-padded to the target's width, ids past the tokenizer being padding.
        self.vocab_size = vocab_size
        self.sampler = sampler
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        # The distributions this step's sampled guesses were drawn from, laid out like the
        # target's logit rows: made by ``propose``, used by the ``sample`` of the same step.
        self._draft_probs: Tensor | None = None
        # Tokens of each sequence whose K/V the draft's cache holds, as of its last pass; the target's
        # count may have been reset since (preemption, a shared prefix), so only the minimum counts.
        self._draft_computed: weakref.WeakKeyDictionary[Seq, int] = weakref.WeakKeyDictionary()

    def check(self, params: SamplingParams) -> None:
        self.sampler.check(params)

    # ----------------------------------------------------------------- what the scheduler asks
    def num_draft_slots(self, seq: Seq) -> int:
        params = seq.params
        return 0 if params.needs_penalties or params.logprobs is not None else self.num_speculative_tokens

    def num_cacheable_tokens(self, seq: Seq) -> int:
        return min(seq.num_computed_tokens, self._draft_computed.get(seq, seq.num_computed_tokens))

    # ----------------------------------------------------------------- the draft's passes
    def propose(self, schedule: SchedulerOutput) -> Proposal:
        """Run the draft model: as many guesses for each scheduled sequence as its draft slots."""
        items = schedule.scheduled
        guesses: list[list[int]] = [[] for _ in items]
        self._draft_probs = None  # this step's, if its guesses are sampled
        # Pass 1: every scheduled sequence, so that the draft's cache holds what the target's
        # will hold after this step (its own tokens, a lagging one too); logits for those that guess.
        catch_up = []
        for item in items:
            seq, start = item.seq, self.num_cacheable_tokens(item.seq)
            own = seq.token_ids[start : item.context_len - item.num_draft_tokens]
            catch_up.append(self._input(seq, own, start, samples=item.num_draft_tokens > 0))
            # After this step's passes the draft holds everything but its own last guess, never fed to it.
            self._draft_computed[seq] = item.context_len - (1 if item.num_draft_tokens else 0)
        logits = self._forward(catch_up)
        active = [i for i, item in enumerate(items) if item.num_draft_tokens]
        if not active:
            return Proposal(guesses)
        greedy = all(items[i].seq.params.greedy for i in active)
        probs_per_pass: list[tuple[list[int], Tensor | None]] = []
        for j in range(max(items[i].num_draft_tokens for i in active)):
            if j:  # pass j + 1: each sequence that wants another guess feeds its previous one
                active = [i for i in active if items[i].num_draft_tokens > j]
                logits = self._forward(
                    [self._input(items[i].seq, guesses[i][-1:], len(items[i].seq.token_ids) + j - 1) for i in active]
                )
            tokens, probs = self._draw(logits, [items[i].seq for i in active], greedy)
            for i, token in zip(active, tokens):
                guesses[i].append(token)
            probs_per_pass.append((active, probs))
        if not greedy:
            self._draft_probs = self._by_row(schedule, probs_per_pass)
        return Proposal(guesses)

    def _input(self, seq: Seq, token_ids: Sequence[int], start: int, samples: bool = True) -> SequenceInput:
        # Ids past a smaller draft vocabulary are the target's padding: fed as 0, they only make
        # the draft's guesses worse, never the output.
        vocab = self.runner.model.config.vocab_size
        return SequenceInput([t if t < vocab else 0 for t in token_ids], start, seq.block_table.block_ids, samples)

    def _forward(self, inputs: list[SequenceInput]) -> Tensor:
        """One pass of the draft: its own ForwardBatch (chapter 05), its logit rows."""
        return self.runner.execute(self.runner.prepare(inputs))

    def _draw(self, logits: Tensor, seqs: list[Seq], greedy: bool) -> tuple[list[int], Tensor | None]:
        """One guess per row (a host sync), and the distribution it was drawn from (None when all greedy)."""
        if logits.shape[1] > self.vocab_size:
            logits = logits[:, : self.vocab_size].contiguous()  # never guess an id the target lacks
        if greedy:
            return argmax_rows(logits).tolist(), None
        rows = self.sampler.rows(logits, [s.params for s in seqs], [s.generator for s in seqs])
        probs = rows.probs()
        tokens = exponential_race(probs, rows.exponentials()).tolist()
        return tokens, F.pad(probs, (0, self.vocab_size - probs.shape[1]))  # q = 0 where the draft has no row

    @staticmethod
    def _by_row(schedule: SchedulerOutput, probs_per_pass: list[tuple[list[int], Tensor | None]]) -> Tensor:
        """The draft's distributions laid out like the target's logit rows (``1 + k`` per sampling
        sequence, in schedule order), zero at each bonus row."""
        offsets, total = [], 0
        for item in schedule.scheduled:
            offsets.append(total)
            total += 1 + item.num_draft_tokens if item.samples else 0
        first = probs_per_pass[0][1]
        assert first is not None
        out = torch.zeros(total, first.shape[1], dtype=torch.float32, device=first.device)
        for j, (active, probs) in enumerate(probs_per_pass):
            assert probs is not None
            out.index_copy_(0, to_device([offsets[i] + j for i in active], torch.long, first.device), probs)
        return out

    # ----------------------------------------------------------------- the target's verdict
    def sample(self, logits: Tensor, batch: ForwardBatch, seqs: list[Seq]) -> list[SampledTokens]:
        """The tokens each sequence keeps: its accepted guesses and one more. Updates the
        acceptance counters (which count the target's verdicts, also on guesses that a stop then
        cuts off)."""
        draft_probs, self._draft_probs = self._draft_probs, None
        if draft_probs is None:  # greedy guesses: kept while they equal the target's argmax
            sampled = self.sampler.sample(logits, batch, seqs)
        else:
            sampled = per_sequence(self._verify_sampled(logits, batch, seqs, draft_probs).to_host(), batch)
        for guesses, kept in zip(batch.draft_token_ids, sampled):
            self.num_draft_tokens += len(guesses)
            self.num_accepted_tokens += max(len(kept.token_ids) - 1, 0)
        return sampled

    def _verify_sampled(
        self, logits: Tensor, batch: ForwardBatch, seqs: list[Seq], draft_probs: Tensor
    ) -> SamplerOutput:
        """Rejection sampling over every logit row; rows without a guess draw from ``p``. The
        target's rows go through the sampler's own pipeline (restrict, which applies a grammar's
        mask at every row, so that a guess it forbids is rejected; penalties; probabilities)."""
        rows = self.sampler.rows(*self.sampler.step_arguments(logits, batch, seqs))
        device = rows.logits.device
        guesses = to_device(
            [t for rows_of, g in zip(batch.rows_of, batch.draft_token_ids) if rows_of for t in (*g, 0)],
            torch.long,
            device,
        )
        uniforms = self._uniforms(batch, seqs, device)
        accepted, recovered = rejection_sample(rows.probs(), draft_probs, guesses, uniforms, rows.exponentials())
        return rows.output(recovered, accepted)

    def _uniforms(self, batch: ForwardBatch, seqs: list[Seq], device: torch.device) -> Tensor:
        """One uniform per logit row: a seeded request's guesses from its own generator (``k``
        draws, whatever the batch), the others' from one shared draw. Greedy rows need none: their
        ratio is exactly 0 or 1, so any value in (0, 1) decides the same; bonus rows are never
        accepted."""
        uniforms = torch.rand(batch.num_logits, device=device, generator=self.sampler.generator_for(device))
        for seq, rows, guesses in zip(seqs, batch.rows_of, batch.draft_token_ids):
            if rows and seq.params.greedy:
                uniforms[rows.start : rows.stop] = 0.5
            elif guesses and seq.generator is not None:
                uniforms[rows.start : rows.start + len(guesses)] = torch.rand(
                    len(guesses), device=device, generator=seq.generator
                )
        return uniforms
