"""Which KV blocks each sequence holds: allocation, sharing and the prefix cache (chapters 06 and 08).

The scheduler (chapter 06) is the policy: who runs and how many tokens. This module is the
bookkeeping under it, the one place that changes a sequence's block table:

* ``admit`` starts a waiting sequence after the longest prefix whose K/V already sits in the
  pool (a prefix-cache match, chapter 08, or the full prompt blocks of the first of the ``n``
  choices of one request, shared by reference count), with blocks for its first chunk;
* ``grow`` gets a running sequence blocks for more tokens, evicting blocks that only the prefix
  cache holds if that helps (``evict=False`` for draft slots, chapter 10, which never evict);
* ``computed`` gives back blocks a step reserved and did not keep, and offers completely
  computed blocks to the prefix cache; ``free`` gives every block back (preemption, finish).

Every method checks before it changes anything: a refused ``admit`` or ``grow`` leaves the pool
and the prefix cache (its recency included, no node split) as they were.

The per-request state of this module (the fork's parent, the blocks already offered to the
cache, the tokens the cache served) is keyed by the sequence, weakly: it goes with the request.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Collection
from collections.abc import Sequence as Seq
from typing import Protocol

from mini_infer.kv.block_pool import BlockPool, num_blocks_for
from mini_infer.sequence import Sequence, SequenceStatus


class PrefixCache(Protocol):
    """What block bookkeeping asks of a prefix cache (chapter 08's ``kv.radix_cache.RadixCache``)."""

    def peek(self, token_ids: Seq[int]) -> tuple[list[int], int]:
        """``match_prefix``'s answer, without marking anything used or splitting a node."""
        ...

    def match_prefix(self, token_ids: Seq[int]) -> tuple[list[int], int]:
        """The cached blocks of the longest cached prefix, and its length in tokens."""
        ...

    def insert(self, token_ids: Seq[int], block_ids: Seq[int]) -> int:
        """Cache whole blocks of computed tokens; return the number of tokens newly cached."""
        ...

    def evict(self, num_blocks: int) -> int: ...

    def num_evictable(self, in_use: Collection[int] = ()) -> int:
        """Blocks ``evict`` could free, once the blocks ``in_use`` are held by a sequence too."""
        ...

    def cached_block_ids(self) -> set[int]: ...


class BlockManager:
    """The block tables of every sequence, over one ``BlockPool`` and an optional prefix cache.

    ``num_cacheable_tokens(seq)`` says how many computed tokens have their K/V in every model's
    cache (with a draft model, chapter 10, that can be one less): only those are cached or shared.
    """

    def __init__(
        self,
        pool: BlockPool,
        prefix_cache: PrefixCache | None = None,
        num_cacheable_tokens: Callable[[Sequence], int] | None = None,
    ) -> None:
        self.pool, self.prefix_cache, self.block_size = pool, prefix_cache, pool.block_size
        self.num_cacheable_tokens = num_cacheable_tokens or (lambda seq: seq.num_computed_tokens)
        self.prefix_cache_hit_tokens = 0  # counted once per request, at its first admission
        self.prefix_cache_query_tokens = 0
        self._parents: weakref.WeakKeyDictionary[Sequence, Sequence] = weakref.WeakKeyDictionary()
        self._offered: weakref.WeakKeyDictionary[Sequence, int] = weakref.WeakKeyDictionary()  # full blocks
        self._cache_hits: weakref.WeakKeyDictionary[Sequence, int] = weakref.WeakKeyDictionary()

    # ----------------------------------------------------------------- the n choices of a request
    def fork(self, seq: Sequence, parent: Sequence) -> None:
        """``seq`` has ``parent``'s prompt: it will share its full prompt blocks instead of
        computing them again (with or without a prefix cache)."""
        self._parents[seq] = parent

    def waits_for_parent(self, seq: Sequence) -> bool:
        """A fork joins once its parent's prompt is computed, to share its blocks."""
        parent = self._parents.get(seq)
        return (
            parent is not None
            and seq.num_output_tokens == 0
            and not parent.is_finished
            and parent.num_computed_tokens < parent.num_prompt_tokens
        )

    # ----------------------------------------------------------------- getting blocks
    def admit(self, seq: Sequence, budget: int) -> int:
        """Start waiting ``seq`` after the longest prefix already in the pool, with blocks for its
        first chunk of at most ``budget`` tokens; return that chunk's length, or 0, changing
        nothing, when the pool cannot hold it (or no budget is left). The last token is always computed, so that there
        are logits to sample from."""
        limit = len(seq.token_ids) - 1
        block_ids, num_tokens = self.prefix_cache.peek(seq.token_ids[:limit]) if self.prefix_cache else ([], 0)
        cache_hit = num_tokens
        parent = self._parents.get(seq)
        if parent is not None and parent.status is SequenceStatus.RUNNING and seq.num_output_tokens == 0:
            full = min(self.num_cacheable_tokens(parent), limit) // self.block_size
            if full * self.block_size > num_tokens:  # the parent's blocks (both models' K/V)
                block_ids, num_tokens, cache_hit = parent.block_table.block_ids[:full], full * self.block_size, 0
        n = min(len(seq.token_ids) - num_tokens, budget)
        if n < 1 or not self._can_hold(num_blocks_for(num_tokens + n, self.block_size) - len(block_ids), block_ids):
            return 0
        if cache_hit:
            assert self.prefix_cache is not None
            block_ids = self.prefix_cache.match_prefix(seq.token_ids[:limit])[0]  # now marked as used
        self.pool.fork(block_ids)  # the sequence's own reference, so that eviction skips them
        seq.block_table.block_ids = list(block_ids)
        seq.num_computed_tokens = num_tokens
        self._offered[seq] = num_tokens // self.block_size  # already in the tree, or the parent's
        grown = self.grow(seq, num_tokens + n)
        assert grown, "admit checked that the chunk fits"
        if seq not in self._cache_hits and self.prefix_cache is not None:  # not again after a preemption
            self._cache_hits[seq] = cache_hit
            self.prefix_cache_query_tokens += seq.num_prompt_tokens
            self.prefix_cache_hit_tokens += cache_hit
        return n

    def grow(self, seq: Sequence, num_tokens: int, *, evict: bool = True) -> bool:
        """Give ``seq`` blocks for ``num_tokens`` tokens, evicting cache-only blocks if that helps
        (unless ``evict`` is False); ``False``, changing nothing, when they do not fit."""
        missing = num_blocks_for(num_tokens, self.block_size) - len(seq.block_table.block_ids)
        if missing > self.pool.num_free_blocks and not (evict and self._can_hold(missing)):
            return False
        if self.prefix_cache is not None and missing > self.pool.num_free_blocks:
            self.prefix_cache.evict(missing - self.pool.num_free_blocks)
        return seq.block_table.ensure_capacity(self.pool, num_tokens)

    def _can_hold(self, num_blocks: int, in_use: Collection[int] = ()) -> bool:
        evictable = self.prefix_cache.num_evictable(in_use) if self.prefix_cache is not None else 0
        return num_blocks <= self.pool.num_free_blocks + evictable

    # ----------------------------------------------------------------- after a step, at the end
    def computed(self, seq: Sequence) -> None:
        """After a step: give back the blocks past ``seq``'s tokens (draft slots it did not keep,
        chapter 10) and offer its completely computed blocks to the prefix cache (only blocks
        every model's cache holds)."""
        seq.block_table.shrink(self.pool, len(seq.token_ids))
        if self.prefix_cache is None:
            return
        full, offered = self.num_cacheable_tokens(seq) // self.block_size, self._offered.get(seq, 0)
        if full > offered:  # only when a block has just been completed
            tokens = seq.token_ids[: full * self.block_size]
            newly_cached = self.prefix_cache.insert(tokens, seq.block_table.block_ids[:full])
            if newly_cached < (full - offered) * self.block_size:
                # The tree already held some of the blocks offered just now: rare, see below.
                self._use_the_cached_copies(seq, tokens)
            self._offered[seq] = full

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

    def free(self, seq: Sequence) -> None:
        """Give back every block of ``seq`` (preempted or finished): nothing of it is computed."""
        seq.block_table.release(self.pool)
        seq.num_computed_tokens = 0
        self._offered.pop(seq, None)

    def num_cached_tokens(self, seq: Sequence) -> int:
        """Prompt tokens the prefix cache served ``seq`` at its first admission."""
        return self._cache_hits.get(seq, 0)

    def check_invariants(self, running: Seq[Sequence], waiting: Seq[Sequence]) -> None:
        """Every block is free, or referenced by running sequences and/or the prefix cache;
        waiting sequences hold none; running ones hold what their computed tokens need."""
        self.pool.check_invariants()
        refs: dict[int, int] = {}
        for seq in running:
            assert len(seq.block_table.block_ids) >= num_blocks_for(seq.num_computed_tokens, self.block_size)
            for block in seq.block_table.block_ids:
                refs[block] = refs.get(block, 0) + 1
        for seq in waiting:
            assert not seq.block_table.block_ids, f"waiting sequence {seq.request_id} holds blocks"
        cached = set() if self.prefix_cache is None else self.prefix_cache.cached_block_ids()
        for block in range(self.pool.num_blocks):
            expected = refs.get(block, 0) + (1 if block in cached else 0)
            assert self.pool.ref_count(block) == expected, (
                f"block {block}: ref count {self.pool.ref_count(block)}, but sequences and cache hold {expected}"
            )
