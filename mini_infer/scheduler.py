"""Iteration-level scheduling, chunked prefill and preemption (chapters 06 and 07).

Every engine step the scheduler decides, from scratch, which sequences run and how many new
tokens each computes, inside a token budget (``max_num_batched_tokens``):

1. **Decodes first.** Every running sequence that has finished its prompt gets its one token.
   Decode latency is what users feel, so prompts never starve it.
2. **Then prefill chunks** of running sequences whose prompt is not fully computed yet.
3. **Then new requests** from the waiting queue, in arrival order, while the budget, the
   ``max_num_seqs`` bound and the block pool allow. A prompt longer than the remaining budget is
   cut into chunks (chunked prefill): it is ingested over several steps while decodes flow.

The scheduler is the policy; the block bookkeeping under it is ``kv.block_manager`` (its
``BlockManager``, ``self.blocks``, changes every block table and checks before it changes
anything). When a sequence that is already running needs a block and none is free (after
evicting blocks that only the prefix cache holds, chapter 08), the scheduler **preempts** the
latest-arrived running sequence that has not been scheduled this step: its blocks are freed and
it goes back to the front of the waiting queue, to be recomputed (prompt and generated tokens
together) when there is room. Nothing is lost: with greedy sampling a preempted request's output
is identical to an unpressured run. A new request starts after the longest prefix whose K/V is
already in the pool (``BlockManager.admit``): a prefix-cache match, or, for the ``n`` choices of
one request, the first choice's full prompt blocks (a fork waits until that prompt is computed).

Later chapters plug in through small protocols, so that this module imports nothing of theirs
(nor torch, nor the model runner: the engine turns a ``ScheduledSequence`` into the model's
input): ``kv.block_manager.PrefixCache`` (chapter 08's radix tree) and ``Speculation`` (chapter
10's speculative decoder, which asks for *draft slots*: after everything else is scheduled, a
decoding sequence may bring a few guessed tokens as well, from the budget and the free blocks
that are left, and the scheduler never lets a guess delay a prompt, evict or preempt).

Invariants (checked by ``check_invariants`` and asserted by the tests after every step):
* every block is free, or referenced by running sequences and/or the prefix cache;
* waiting sequences hold no blocks; running sequences hold exactly the blocks their computed
  tokens (plus this step's) need;
* ``len(running) <= max_num_seqs``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Protocol

from mini_infer.kv.block_manager import BlockManager, PrefixCache
from mini_infer.kv.block_pool import BlockPool, num_blocks_for
from mini_infer.sequence import Sequence, SequenceStatus


class RequestTooLongError(ValueError):
    """A request that could never run: longer than the model's context or the whole KV pool."""


class Speculation(Protocol):
    """What speculative decoding (chapter 10's ``SpeculativeDecoder``) tells the scheduler."""

    def num_draft_slots(self, seq: Sequence) -> int:
        """How many guessed tokens ``seq`` would like verified this step (0: none)."""
        ...

    def num_cacheable_tokens(self, seq: Sequence) -> int:
        """Computed tokens whose K/V every model's cache holds: what may be cached or shared."""
        ...


@dataclass(slots=True)
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int  # of which the last num_draft_tokens are slots for guessed tokens
    context_len: int  # tokens in the cache once this step has run (computed + new)
    num_draft_tokens: int = 0  # draft slots (chapter 10), filled by the speculative decoder's guesses

    @property
    def samples(self) -> bool:
        """The chunk reaches the end of the sequence, so its last logits give the next token."""
        return self.context_len - self.num_draft_tokens == len(self.seq.token_ids)


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    def add(self, seq: Sequence, num_new_tokens: int) -> int:
        """Schedule ``num_new_tokens`` of ``seq``; return them (what they take from the budget)."""
        self.scheduled.append(ScheduledSequence(seq, num_new_tokens, seq.num_computed_tokens + num_new_tokens))
        return num_new_tokens

    def has(self, seq: Sequence) -> bool:
        return any(item.seq is seq for item in self.scheduled)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        pool: BlockPool,
        *,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        prefix_cache: PrefixCache | None = None,
        speculation: Speculation | None = None,
    ) -> None:
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        cacheable = speculation.num_cacheable_tokens if speculation is not None else None
        self.blocks = BlockManager(pool, prefix_cache, cacheable)  # every block table changes there
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.speculation = speculation
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # ----------------------------------------------------------------- admission
    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Refuse, at submission, a request that could never run."""
        # student: begin chapter 07: raise RequestTooLongError past max_model_len tokens or past the whole pool
        total = num_prompt_tokens + max_tokens
        if total > self.max_model_len:
            raise RequestTooLongError(
                f"this model's maximum context length is {self.max_model_len} tokens, but the request asks for "
                f"{total} tokens ({num_prompt_tokens} in the prompt, {max_tokens} to generate); shorten the "
                "prompt or lower max_tokens"
            )
        pool = self.blocks.pool
        needed = num_blocks_for(total, pool.block_size)
        if needed > pool.num_blocks:
            raise RequestTooLongError(
                f"the request needs {needed} KV blocks ({total} tokens) but the whole pool has "
                f"{pool.num_blocks}; give the engine more KV memory (num_kv_blocks) or lower max_tokens"
            )
        # student: end

    def add(self, seq: Sequence, fork_of: Sequence | None = None) -> None:
        """Queue ``seq``; ``fork_of``, a request with the same prompt (the ``n`` choices of one
        request), lends it its prompt's blocks once computed."""
        self.check_fits(seq.num_prompt_tokens, seq.params.max_tokens)
        if fork_of is not None:
            self.blocks.fork(seq, fork_of)
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ----------------------------------------------------------------- one step
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        self.running.sort(key=lambda s: s.arrival)
        # student: begin chapter 06: decodes, then prefill chunks, then waiting requests in order, in the budgets
        # 1. decodes, 2. prefill chunks of running sequences.
        for prefilling in (False, True):
            for seq in list(self.running):
                if budget == 0:
                    break
                if seq.is_prefilling != prefilling or seq.status is not SequenceStatus.RUNNING:
                    continue  # the other pass's, or preempted just now
                n = min(seq.num_uncomputed_tokens, budget)
                if self._make_room(seq, n, out):
                    budget -= out.add(seq, n)

        # 3. new requests (and preempted ones, which wait at the front), unless this step preempted.
        for seq in list(self.waiting):
            if budget == 0 or len(self.running) >= self.max_num_seqs or out.preempted:
                break
            if self.blocks.waits_for_parent(seq):
                continue
            n = self.blocks.admit(seq, budget)
            if n == 0:
                # No room now: it keeps its place at the head of the queue, holding nothing, and
                # nothing behind it overtakes it (first come, first served).
                break
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            budget -= out.add(seq, n)
        # student: end

        # 4. Draft slots for guessed tokens (chapter 10), from what is left.
        if self.speculation is not None:
            self._add_draft_slots(out, self.max_num_batched_tokens - out.num_tokens)
        return out

    def _add_draft_slots(self, out: SchedulerOutput, budget: int) -> None:
        """Give decoding sequences slots for the guesses speculative decoding (chapter 10) wants,
        from the ``budget`` and the free blocks left: a guess never delays a prompt, evicts or
        preempts, and never reaches past ``max_tokens`` or the model's context."""
        assert self.speculation is not None
        for item in out.scheduled:
            if budget == 0:
                break
            seq = item.seq
            if item.num_new_tokens != 1 or not item.samples:
                continue  # decodes only (and a prompt whose last chunk is its last token)
            room = min(seq.params.max_tokens - seq.num_output_tokens - 1, self.max_model_len - len(seq.token_ids))
            k = min(self.speculation.num_draft_slots(seq), budget, room)
            if k > 0 and self.blocks.grow(seq, item.context_len + k, evict=False):
                item.num_new_tokens += k
                item.context_len += k
                item.num_draft_tokens = k
                budget -= k

    def _make_room(self, seq: Sequence, n: int, out: SchedulerOutput) -> bool:
        """Blocks for a running sequence's next ``n`` tokens, preempting later arrivals if needed.

        Returns False when ``seq`` itself had to be preempted, or (for a prefill chunk) when it
        must wait because everything later has already been scheduled this step.
        """
        # student: begin chapter 07: grow seq's blocks, preempting the latest unscheduled arrival until they fit
        while not self.blocks.grow(seq, seq.num_computed_tokens + n):
            victim = max((s for s in self.running if not out.has(s)), key=lambda s: s.arrival)
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        return True
        # student: end

    def _preempt(self, seq: Sequence) -> None:
        # student: begin chapter 07: free seq's blocks and computed tokens; back to the waiting queue in arrival order
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.status = SequenceStatus.WAITING
        self.num_preemptions += 1
        # Back in arrival order at the front: it was admitted before anything still waiting.
        index = 0
        while index < len(self.waiting) and self.waiting[index].arrival < seq.arrival:
            index += 1
        self.waiting.insert(index, seq)
        # student: end

    # ----------------------------------------------------------------- after the forward
    def update(self, scheduled: list[ScheduledSequence], kept: Seq[Seq[int]]) -> None:
        """Advance each scheduled sequence by the tokens the step kept for it: none (a prompt chunk
        short of the end), one sampled token, or, with guesses (chapter 10), the accepted ones and
        one more; fewer when a stop cut them (the engine finds stops before this)."""
        for item, tokens in zip(scheduled, kept, strict=True):
            seq = item.seq
            seq.token_ids.extend(tokens)
            # Every input now in token_ids has its K/V (rejected guesses are past the end); the
            # last token never has.
            seq.num_computed_tokens = len(seq.token_ids) - 1 if tokens else item.context_len
            self.blocks.computed(seq)  # unkept draft slots back, full blocks to the prefix cache

    def finish(self, seq: Sequence) -> None:
        """Mark ``seq`` finished (stop, length, abort or error: the output processor keeps why)
        and give its blocks back."""
        if seq.is_finished:
            return
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq)
        seq.status = SequenceStatus.FINISHED

    # ----------------------------------------------------------------- checks
    def check_invariants(self) -> None:
        for seq in self.running:
            assert seq.status is SequenceStatus.RUNNING, f"{seq.request_id} in running with status {seq.status}"
            assert seq.num_computed_tokens <= len(seq.token_ids), f"{seq.request_id} computed more than it has"
        self.blocks.check_invariants(self.running, self.waiting)
        assert len(self.running) <= self.max_num_seqs
