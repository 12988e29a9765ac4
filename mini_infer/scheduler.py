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

from mini_infer.kv.block_pool import BlockPool, num_blocks_for
from mini_infer.kv.radix_cache import RadixCache
from mini_infer.sequence import Sequence, SequenceStatus


class RequestTooLongError(ValueError):
    """A request that could never run: longer than the model's context or the whole KV pool."""


@dataclass(slots=True)
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int
    context_len: int  # tokens in the cache once this step has run (computed + new)
    # Speculative decoding (chapter 10): the last ``num_speculative_tokens`` of the new tokens
    # are draft proposals (``draft_token_ids``, filled in before the forward), not yet the
    # sequence's own; the target verifies them and keeps those it agrees with.
    num_speculative_tokens: int = 0
    draft_token_ids: list[int] = field(default_factory=list)

    @property
    def samples(self) -> bool:
        """The chunk reaches the end of the sequence, so its last logits give the next token."""
        return self.context_len - self.num_speculative_tokens == len(self.seq.token_ids)

    def input_token_ids(self) -> list[int]:
        """The ``num_new_tokens`` tokens this step computes: the sequence's, then any drafts."""
        start, tokens = self.context_len - self.num_new_tokens, self.seq.token_ids
        if self.context_len <= len(tokens):
            return tokens[start : self.context_len]
        drafts = self.draft_token_ids[: self.context_len - len(tokens)]
        return tokens[start:] + drafts if start <= len(tokens) else drafts[start - len(tokens) :]


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
        prefix_cache: RadixCache | None = None,
        num_speculative_tokens: int = 0,
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
        self.num_speculative_tokens = num_speculative_tokens  # draft slots per decode (chapter 10)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.prefix_cache_hit_tokens = 0
        self.prefix_cache_query_tokens = 0

    # ----------------------------------------------------------------- admission
    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Refuse, at submission, a request that could never run."""
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

        # 1. decodes, 2. prefill chunks of running sequences.
        for prefilling in (False, True):
            for seq in list(self.running):
                if budget == 0:
                    break
                if seq.is_prefilling != prefilling or id(seq) in scheduled_ids or seq.status is not SequenceStatus.RUNNING:
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
                seq.num_computed_tokens = seq.num_blocks_offered = seq.draft_lag = 0
                break
            if not seq.was_admitted and self.prefix_cache is not None:
                # Counted once per request, at its first admission (not again after a preemption,
                # when it may even match blocks it cached itself).
                seq.was_admitted = True
                self.prefix_cache_query_tokens += seq.num_prompt_tokens
                self.prefix_cache_hit_tokens += cache_hit
                seq.num_cached_prompt_tokens = cache_hit
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            schedule(seq, n)

        # 4. Draft slots for speculative decoding (chapter 10), from what is left of the budget
        # and of the free blocks: speculation never delays a prompt, evicts or preempts.
        if self.num_speculative_tokens:
            for item in out.scheduled:
                if budget == 0:
                    break
                if item.num_new_tokens != 1 or not item.samples:
                    continue  # decodes (and a prompt whose last chunk is its last token)
                k = self._num_draft_slots(item.seq, budget)
                if k and item.seq.block_table.ensure_capacity(self.pool, item.context_len + k):
                    item.num_new_tokens += k
                    item.context_len += k
                    item.num_speculative_tokens = k
                    budget -= k
        return out

    def _num_draft_slots(self, seq: Sequence, budget: int) -> int:
        """How many draft tokens a decoding ``seq`` may verify this step (chapter 10): at most
        ``num_speculative_tokens``, within ``budget`` tokens, and never past ``max_tokens`` or the
        context. Requests with penalties or logprobs
        are not speculated: their distributions depend on tokens the draft has only proposed."""
        params = seq.params
        if not self.num_speculative_tokens or params.needs_penalties or params.logprobs is not None:
            return 0
        room = min(params.max_tokens - seq.num_output_tokens - 1, self.max_model_len - len(seq.token_ids))
        return max(0, min(self.num_speculative_tokens, budget, room))

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
            match = self.prefix_cache.match_prefix(seq.token_ids[:limit])
            if match.num_tokens:
                self._adopt(seq, list(match.block_ids), match.num_tokens)
                cache_hit = match.num_tokens
        parent = seq.parent
        if parent is not None and parent.status is SequenceStatus.RUNNING and seq.num_output_tokens == 0:
            full = min(parent.num_computed_tokens - parent.draft_lag, limit) // self.block_size
            if full * self.block_size > seq.num_computed_tokens:
                self._release_blocks(seq)
                self._adopt(seq, parent.block_table.block_ids[:full], full * self.block_size)
                cache_hit = 0
        return cache_hit

    def _adopt(self, seq: Sequence, block_ids: list[int], num_tokens: int) -> None:
        self.pool.fork(block_ids)  # the sequence's own reference, so that eviction skips them
        seq.block_table.block_ids = block_ids
        seq.num_computed_tokens = num_tokens
        seq.num_blocks_offered = num_tokens // self.block_size  # already in the tree, or the parent's
        seq.draft_lag = 0  # shared blocks hold the draft model's K/V too (see _cache_full_blocks)

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Give ``seq`` blocks for ``num_tokens``, evicting cache-only blocks if that helps."""
        if seq.block_table.ensure_capacity(self.pool, num_tokens):
            return True
        if self.prefix_cache is not None:
            missing = num_blocks_for(num_tokens, self.block_size) - len(seq.block_table.block_ids) - self.pool.num_free_blocks
            self.prefix_cache.evict(missing)
            return seq.block_table.ensure_capacity(self.pool, num_tokens)
        return False

    def _reserve(self, seq: Sequence, n: int, out: SchedulerOutput, scheduled_ids: set[int]) -> bool:
        """Blocks for a running sequence's next ``n`` tokens, preempting later arrivals if needed.

        Returns False when ``seq`` itself had to be preempted, or (for a prefill chunk) when it
        must wait because everything later has already been scheduled this step.
        """
        while not self._grow(seq, seq.num_computed_tokens + n):
            candidates = [s for s in self.running if id(s) not in scheduled_ids]
            victim = max(candidates, key=lambda s: s.arrival)
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release_blocks(seq)
        seq.num_computed_tokens = seq.num_blocks_offered = seq.draft_lag = 0
        seq.status = SequenceStatus.WAITING
        self.num_preemptions += 1
        # Back in arrival order at the front: it was admitted before anything still waiting.
        index = 0
        while index < len(self.waiting) and self.waiting[index].arrival < seq.arrival:
            index += 1
        self.waiting.insert(index, seq)

    # ----------------------------------------------------------------- after the forward
    def update(self, scheduled: list[ScheduledSequence], new_token_ids: Seq[int | list[int] | None]) -> None:
        """Advance each scheduled sequence by what the step produced for it: one sampled token,
        None (a prefill chunk that does not reach the end), or, when drafts were verified
        (chapter 10), the list of accepted draft tokens followed by the target's own token."""
        for item, produced in zip(scheduled, new_token_ids):
            seq = item.seq
            tokens = [] if produced is None else [produced] if isinstance(produced, int) else produced
            # Every input but the rejected drafts now has its K/V: the last new token never does.
            rejected = item.num_speculative_tokens - max(len(tokens) - 1, 0)
            seq.num_computed_tokens = item.context_len - rejected
            seq.token_ids.extend(tokens)
            if item.num_speculative_tokens:
                seq.block_table.shrink(self.pool, len(seq.token_ids))
            self._cache_full_blocks(seq)

    def _cache_full_blocks(self, seq: Sequence) -> None:
        """Offer the sequence's completely computed blocks to the prefix cache.

        With a draft model (chapter 10) a block is offered only once the draft's K/V of it is
        written too (``draft_lag``), so whoever reuses it finds both models' caches filled.
        """
        if self.prefix_cache is None:
            return
        full = (seq.num_computed_tokens - seq.draft_lag) // self.block_size
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
        for i, cached in enumerate(self.prefix_cache.match_prefix(tokens).block_ids):
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
            assert len(seq.block_table.block_ids) >= num_blocks_for(seq.num_computed_tokens, self.block_size)
            for block in seq.block_table.block_ids:
                refs[block] = refs.get(block, 0) + 1
        for seq in self.waiting:
            assert not seq.block_table.block_ids, f"waiting sequence {seq.request_id} holds blocks"
        cached = set() if self.prefix_cache is None else {b for node in self.prefix_cache.nodes() for b in node.block_ids}
        for block in range(self.pool.num_blocks):
            expected = refs.get(block, 0) + (1 if block in cached else 0)
            assert self.pool.ref_count(block) == expected, (
                f"block {block}: ref count {self.pool.ref_count(block)}, but sequences and cache hold {expected}"
            )
        assert len(self.running) <= self.max_num_seqs
