"""Iteration-level scheduling, chunked prefill and preemption (chapters 06 and 07).

Every engine step the scheduler decides, from scratch, which sequences run and how many new
tokens each computes, inside a token budget (``max_num_batched_tokens``):

1. **Decodes first.** Every running sequence that has finished its prompt gets its one token.
   Decode latency is what users feel, so prompts never starve it.
2. **Then prefill chunks** of running sequences whose prompt is not fully computed yet.
3. **Then new requests** from the waiting queue, in arrival order, while the budget, the
   ``max_num_seqs`` bound and the block pool allow. A prompt longer than the remaining budget is
   cut into chunks (chunked prefill): it is ingested over several steps while decodes flow.

Blocks come from the ``BlockPool`` (chapter 04). When a sequence that is already running needs
a block and none is free, the scheduler first evicts blocks that only the prefix cache holds
(chapter 08), then **preempts** the latest-arrived running sequence that has not been scheduled
this step: its blocks are freed and it goes back to the front of the waiting queue, to be
recomputed (prompt and generated tokens together) when there is room. Nothing is lost: with
greedy sampling a preempted request's output is identical to an unpressured run.

A new request starts after the longest prefix whose K/V is already in the pool: a prefix-cache
match (chapter 08), or, for the ``n`` choices of one request, the full prompt blocks of the
first choice, shared by reference count (a fork waits until its parent's prompt is computed).

Later chapters plug in through two small protocols defined here, so that this module imports
nothing of theirs: ``PrefixCache`` (chapter 08's radix tree) and ``Speculation`` (chapter 10's
speculative decoder, which asks for *draft slots*: after everything else is scheduled, a
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

from mini_infer.kv.block_pool import BlockPool, num_blocks_for
from mini_infer.model_runner import SequenceInput
from mini_infer.sequence import Sequence, SequenceStatus


class RequestTooLongError(ValueError):
    """A request that could never run: longer than the model's context or the whole KV pool."""


class PrefixCache(Protocol):
    """What the scheduler asks of a prefix cache (chapter 08's ``kv.radix_cache.RadixCache``)."""

    def match_prefix(self, token_ids: Seq[int]) -> tuple[list[int], int]:
        """The cached blocks of the longest cached prefix, and its length in tokens."""
        ...

    def insert(self, token_ids: Seq[int], block_ids: Seq[int]) -> int:
        """Cache whole blocks of computed tokens; return the number of tokens newly cached."""
        ...

    def evict(self, num_blocks: int) -> int: ...

    def cached_block_ids(self) -> set[int]: ...


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

    def input(self, draft_token_ids: Seq[int] = ()) -> SequenceInput:
        """This step's input of the sequence (chapter 05), with its guesses when it has slots."""
        seq, start = self.seq, self.context_len - self.num_new_tokens
        if len(draft_token_ids) != self.num_draft_tokens:
            raise ValueError(
                f"{seq.request_id}: {len(draft_token_ids)} guesses for {self.num_draft_tokens} draft slots"
            )
        own = seq.token_ids[start : self.context_len - self.num_draft_tokens]
        return SequenceInput(own, start, seq.block_table.block_ids, self.samples, draft_token_ids)


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

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
        self.pool = pool
        self.block_size = pool.block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.prefix_cache = prefix_cache
        self.speculation = speculation
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.prefix_cache_hit_tokens = 0
        self.prefix_cache_query_tokens = 0

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
        needed = num_blocks_for(total, self.block_size)
        if needed > self.pool.num_blocks:
            raise RequestTooLongError(
                f"the request needs {needed} KV blocks ({total} tokens) but the whole pool has "
                f"{self.pool.num_blocks}; give the engine more KV memory (num_kv_blocks) or lower max_tokens"
            )
        # student: end

    def add(self, seq: Sequence) -> None:
        self.check_fits(seq.num_prompt_tokens, seq.params.max_tokens)
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ----------------------------------------------------------------- one step
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled_ids: set[int] = set()
        self.running.sort(key=lambda s: s.arrival)

        def schedule(seq: Sequence, n: int) -> None:
            nonlocal budget
            out.scheduled.append(ScheduledSequence(seq, n, seq.num_computed_tokens + n))
            scheduled_ids.add(id(seq))
            budget -= n

        # student: begin chapter 06: decodes, then prefill chunks, then waiting requests in order, in the budgets
        # 1. decodes, 2. prefill chunks of running sequences.
        for prefilling in (False, True):
            for seq in list(self.running):
                if budget == 0:
                    break
                if (
                    seq.is_prefilling != prefilling
                    or id(seq) in scheduled_ids
                    or seq.status is not SequenceStatus.RUNNING
                ):
                    continue
                n = min(seq.num_uncomputed_tokens, budget)
                if self._reserve(seq, n, out, scheduled_ids):
                    schedule(seq, n)

        # 3. new requests (and preempted ones, which wait at the front), unless this step preempted.
        for seq in list(self.waiting):
            if budget == 0 or len(self.running) >= self.max_num_seqs or out.preempted:
                break
            if self._waits_for_parent(seq):
                continue  # a fork joins once its parent's prompt is computed, to share its blocks
            cache_hit = self._reuse_computed_prefix(seq)
            n = min(seq.num_uncomputed_tokens, budget)
            if not self._grow(seq, seq.num_computed_tokens + n):
                # No room now: it keeps its place at the head of the queue, holding nothing, and
                # nothing behind it overtakes it (first come, first served).
                self._release_blocks(seq)
                seq.reset_computed(0, self.block_size)
                break
            self._count_prefix_cache_hit(seq, cache_hit)
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            schedule(seq, n)
        # student: end

        # 4. Draft slots for guessed tokens (chapter 10), from what is left.
        if self.speculation is not None:
            self._add_draft_slots(out, budget)
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
            if k > 0 and seq.block_table.ensure_capacity(self.pool, item.context_len + k):
                item.num_new_tokens += k
                item.context_len += k
                item.num_draft_tokens = k
                budget -= k

    def _count_prefix_cache_hit(self, seq: Sequence, cache_hit: int) -> None:
        """Prefix-cache statistics (chapter 08), counted once per request at its first admission
        (not again after a preemption, when it may even match blocks it cached itself)."""
        if not seq.was_admitted and self.prefix_cache is not None:
            seq.was_admitted = True
            self.prefix_cache_query_tokens += seq.num_prompt_tokens
            self.prefix_cache_hit_tokens += cache_hit
            seq.num_cached_prompt_tokens = cache_hit

    def _num_cacheable_tokens(self, seq: Sequence) -> int:
        return seq.num_computed_tokens if self.speculation is None else self.speculation.num_cacheable_tokens(seq)

    @staticmethod
    def _waits_for_parent(seq: Sequence) -> bool:
        parent = seq.parent
        return (
            parent is not None
            and seq.num_output_tokens == 0
            and parent.status is not SequenceStatus.FINISHED
            and parent.num_computed_tokens < parent.num_prompt_tokens
        )

    def _reuse_computed_prefix(self, seq: Sequence) -> int:
        """Start ``seq`` after the longest prefix whose K/V already sits in the pool.

        Two sources: the prefix cache (chapter 08), and a fork's parent (the ``n`` choices of
        one request), whose full prompt blocks are shared by reference count. The last token
        is always computed, so that there are logits to sample from. Returns the number of
        tokens the prefix cache served.
        """
        limit = len(seq.token_ids) - 1
        cache_hit = 0
        if self.prefix_cache is not None:
            block_ids, num_tokens = self.prefix_cache.match_prefix(seq.token_ids[:limit])
            if num_tokens:
                self._adopt(seq, list(block_ids), num_tokens)
                cache_hit = num_tokens
        parent = seq.parent
        if parent is not None and parent.status is SequenceStatus.RUNNING and seq.num_output_tokens == 0:
            full = min(self._num_cacheable_tokens(parent), limit) // self.block_size
            if full * self.block_size > seq.num_computed_tokens:
                self._release_blocks(seq)
                self._adopt(seq, parent.block_table.block_ids[:full], full * self.block_size)
                cache_hit = 0
        return cache_hit

    def _adopt(self, seq: Sequence, block_ids: list[int], num_tokens: int) -> None:
        self.pool.fork(block_ids)  # the sequence's own reference, so that eviction skips them
        seq.block_table.block_ids = block_ids
        seq.reset_computed(num_tokens, self.block_size)  # in the tree, or the parent's: both models' K/V

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Give ``seq`` blocks for ``num_tokens``, evicting cache-only blocks if that helps."""
        if seq.block_table.ensure_capacity(self.pool, num_tokens):
            return True
        if self.prefix_cache is not None:
            missing = (
                num_blocks_for(num_tokens, self.block_size) - len(seq.block_table.block_ids) - self.pool.num_free_blocks
            )
            self.prefix_cache.evict(missing)
            return seq.block_table.ensure_capacity(self.pool, num_tokens)
        return False

    def _reserve(self, seq: Sequence, n: int, out: SchedulerOutput, scheduled_ids: set[int]) -> bool:
        """Blocks for a running sequence's next ``n`` tokens, preempting later arrivals if needed.

        Returns False when ``seq`` itself had to be preempted, or (for a prefill chunk) when it
        must wait because everything later has already been scheduled this step.
        """
        # student: begin chapter 07: grow seq's blocks, preempting the latest unscheduled arrival until they fit
        while not self._grow(seq, seq.num_computed_tokens + n):
            candidates = [s for s in self.running if id(s) not in scheduled_ids]
            victim = max(candidates, key=lambda s: s.arrival)
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        return True
        # student: end

    def _preempt(self, seq: Sequence) -> None:
        # student: begin chapter 07: free seq's blocks and computed tokens; back to the waiting queue in arrival order
        self.running.remove(seq)
        self._release_blocks(seq)
        seq.reset_computed(0, self.block_size)
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
            if item.num_draft_tokens:
                seq.block_table.shrink(self.pool, len(seq.token_ids))
            self._cache_full_blocks(seq)

    def _cache_full_blocks(self, seq: Sequence) -> None:
        """Offer the sequence's completely computed blocks to the prefix cache: only blocks every
        model's cache holds (with a draft model, chapter 10, that can be one token less)."""
        if self.prefix_cache is None:
            return
        full = self._num_cacheable_tokens(seq) // self.block_size
        if full > seq.num_blocks_offered:  # only when a block has just been completed
            tokens = seq.token_ids[: full * self.block_size]
            newly_cached = self.prefix_cache.insert(tokens, seq.block_table.block_ids[:full])
            if newly_cached < (full - seq.num_blocks_offered) * self.block_size:
                # The tree already held some of the blocks offered just now: rare, see below.
                self._use_the_cached_copies(seq, tokens)
            seq.num_blocks_offered = full

    def _use_the_cached_copies(self, seq: Sequence, tokens: list[int]) -> None:
        """Point ``seq`` at the tree's blocks where the tree already held its tokens' K/V.

        A sequence can compute blocks the tree already has: after a whole-prompt cache hit the
        last prompt block is recomputed (the last token must give logits), and two requests
        with the same prompt may run side by side. ``insert`` keeps the tree's copy, so the
        sequence's own copy would be a duplicate, and the tree's copy, held by nobody else,
        would sit above the sequence's newer blocks in the tree, where eviction never reaches
        it: a block lost to the pool for as long as the sequence runs. Taking the tree's copy
        (same tokens at the same positions, so the same K/V) frees the duplicate now.
        """
        assert self.prefix_cache is not None
        table = seq.block_table.block_ids
        for i, cached in enumerate(self.prefix_cache.match_prefix(tokens)[0]):
            if table[i] != cached:
                self.pool.fork([cached])
                self.pool.free([table[i]])
                table[i] = cached

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark ``seq`` finished (stop, length or abort) and give its blocks back."""
        if seq.is_finished:
            return
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release_blocks(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def _release_blocks(self, seq: Sequence) -> None:
        seq.block_table.release(self.pool)

    # ----------------------------------------------------------------- checks
    def check_invariants(self) -> None:
        self.pool.check_invariants()
        refs: dict[int, int] = {}
        for seq in self.running:
            assert seq.status is SequenceStatus.RUNNING, f"{seq.request_id} in running with status {seq.status}"
            assert seq.num_computed_tokens <= len(seq.token_ids), f"{seq.request_id} computed more than it has"
            assert len(seq.block_table.block_ids) >= num_blocks_for(seq.num_computed_tokens, self.block_size)
            for block in seq.block_table.block_ids:
                refs[block] = refs.get(block, 0) + 1
        for seq in self.waiting:
            assert not seq.block_table.block_ids, f"waiting sequence {seq.request_id} holds blocks"
        cached = set() if self.prefix_cache is None else self.prefix_cache.cached_block_ids()
        for block in range(self.pool.num_blocks):
            expected = refs.get(block, 0) + (1 if block in cached else 0)
            assert self.pool.ref_count(block) == expected, (
                f"block {block}: ref count {self.pool.ref_count(block)}, but sequences and cache hold {expected}"
            )
        assert len(self.running) <= self.max_num_seqs
