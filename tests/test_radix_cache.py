"""Tests of mini_infer.kv.radix_cache (chapter 08): unit tests and a stateful property test."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

# The radix cache's behavioural unit tests are chapter 08's graded tests (mini_infer/course/graded,
# which grade a student's cache against the same rules); they run here too, on the package itself,
# with the helpers they share with the tests below.
from mini_infer.course.graded.test_chapter08 import *  # noqa: F403
from mini_infer.course.graded.test_chapter08 import A, B, cache_finished, make
from mini_infer.kv.block_pool import BlockPool, num_blocks_for
from mini_infer.kv.radix_cache import RadixCache


def test_check_invariants_catches_corruption() -> None:
    pool, cache = make()
    x = cache_finished(pool, cache, A + B)
    pool.free([x[1]])  # someone drops the tree's reference behind its back
    with pytest.raises(AssertionError, match="free in the pool"):
        cache.check_invariants()

    pool, cache = make()
    cache_finished(pool, cache, A + B)
    cache._root.children[tuple(A)].token_ids.append(7)
    with pytest.raises(AssertionError, match="tokens in"):
        cache.check_invariants()

    pool, cache = make()
    cache_finished(pool, cache, A + B)
    cache._held.add(99)
    with pytest.raises(AssertionError, match="held set"):
        cache.check_invariants()


# -- stateful property test -------------------------------------------------------------------

Key = tuple[tuple[int, ...], ...]  # a cached prefix, as its blocks of tokens


class ReferenceCache:
    """The cache without a tree: every cached whole-block prefix -> [its last block, last use].

    A prefix of k blocks is cached exactly when the tree holds its k-th block on the path of its
    tokens. Only leaves are evicted, so the set stays closed under taking prefixes, and the
    longest match is found by extending one block at a time. Eviction is LRU over leaf prefixes
    held only by the cache; a node of the real tree is a run of prefixes touched together, so
    trimming it block by block from its end is the same order.
    """

    def __init__(self, block_size: int) -> None:
        self.bs = block_size
        self.entries: dict[Key, list[int]] = {}
        self.clock = 0

    def key(self, tokens: Sequence[int], num_blocks: int) -> Key:
        bs = self.bs
        return tuple(tuple(tokens[i * bs : (i + 1) * bs]) for i in range(num_blocks))

    def longest(self, tokens: Sequence[int]) -> int:
        k = 0
        while (k + 1) * self.bs <= len(tokens) and self.key(tokens, k + 1) in self.entries:
            k += 1
        return k

    def touch(self, tokens: Sequence[int], num_blocks: int) -> None:
        self.clock += 1
        for k in range(1, num_blocks + 1):
            self.entries[self.key(tokens, k)][1] = self.clock

    def match(self, tokens: Sequence[int]) -> list[int]:
        k = self.longest(tokens)
        self.touch(tokens, k)
        return [self.entries[self.key(tokens, i)][0] for i in range(1, k + 1)]

    def insert(self, tokens: Sequence[int], blocks: Sequence[int]) -> int:
        cached = self.longest(tokens)
        for i in range(cached + 1, len(blocks) + 1):
            self.entries[self.key(tokens, i)] = [blocks[i - 1], 0]
        self.touch(tokens, len(blocks))
        return (len(blocks) - cached) * self.bs

    def evict(self, num_blocks: int, ref_count: Callable[[int], int]) -> list[int]:
        freed: list[int] = []
        while len(freed) < num_blocks:
            parents = {key[:-1] for key in self.entries}
            leaves = [k for k, (b, _) in self.entries.items() if k not in parents and ref_count(b) == 1]
            if not leaves:
                break
            ticks = [self.entries[k][1] for k in leaves]
            assert len(set(ticks)) == len(ticks), "two leaves used at the same time"
            victim = min(leaves, key=lambda k: self.entries[k][1])
            freed.append(self.entries.pop(victim)[0])
        return freed

    def copy(self) -> ReferenceCache:
        other = ReferenceCache(self.bs)
        other.entries = {k: list(v) for k, v in self.entries.items()}
        other.clock = self.clock
        return other


SYSTEM_PROMPTS = [[], [0, 0, 0, 0, 0, 0], [0, 0, 0, 1, 1, 1], [1, 0, 1, 0, 1, 0, 1]]
token_lists = st.one_of(
    st.lists(st.integers(0, 1), min_size=1, max_size=12),
    st.tuples(st.sampled_from(SYSTEM_PROMPTS), st.lists(st.integers(0, 2), min_size=1, max_size=6)).map(
        lambda parts: parts[0] + parts[1]
    ),
)


class RadixCacheMachine(RuleBasedStateMachine):
    """Fake sequences start (match, lock, evict to make room, allocate), cache and finish."""

    @initialize(num_blocks=st.integers(3, 20), block_size=st.sampled_from([1, 2, 3]))
    def setup(self, num_blocks: int, block_size: int) -> None:
        self.pool = BlockPool(num_blocks, block_size)
        self.cache = RadixCache(self.pool)
        self.ref = ReferenceCache(block_size)
        self.seqs: list[tuple[list[int], list[int]]] = []  # (tokens, blocks it holds a reference on)

    def seq_refs(self) -> Counter[int]:
        return Counter(b for _, blocks in self.seqs for b in blocks)

    def tree_only(self) -> Callable[[int], int]:
        seq = self.seq_refs()
        return lambda block: 1 + seq[block]

    def check_match(self, tokens: list[int]) -> list[int]:
        match = self.cache.match_prefix(tokens)
        expected = self.ref.match(tokens)
        assert match.block_ids == expected
        assert match.num_tokens == len(expected) * self.pool.block_size
        return match.block_ids

    def check_evict(self, n: int) -> None:
        expected = self.ref.evict(n, self.tree_only())
        free_before = self.pool.num_free_blocks
        assert self.cache.evict(n) == len(expected)
        assert self.pool.num_free_blocks == free_before + len(expected)
        assert all(self.pool.ref_count(b) == 0 for b in expected)

    @rule(tokens=token_lists, use_cache=st.booleans())
    def start_sequence(self, tokens: list[int], use_cache: bool) -> None:
        # What the scheduler does: match all but the last token, lock the match, make room.
        # Without the match, the sequence computes its own copy of a cached prefix, as one that
        # started before the prefix was cached does: the tree then holds blocks used only by
        # itself above blocks a sequence still uses.
        matched = self.check_match(tokens[:-1]) if use_cache else []
        self.pool.fork(matched)
        self.seqs.append((tokens, matched))  # the lock counts while we evict
        needed = num_blocks_for(len(tokens), self.pool.block_size) - len(matched)
        if needed > self.pool.num_free_blocks:
            self.check_evict(needed - self.pool.num_free_blocks)
        if needed > self.pool.num_free_blocks:
            self.seqs.pop()
            self.pool.free(matched)  # cannot start now: unlock
            return
        self.seqs[-1] = (tokens, matched + self.pool.allocate(needed))

    def insert_seq(self, index: int) -> None:
        tokens, blocks = self.seqs[index]
        full = len(tokens) // self.pool.block_size
        expected = self.ref.insert(tokens[: full * self.pool.block_size], blocks[:full])
        assert self.cache.insert(tokens[: full * self.pool.block_size], blocks[:full]) == expected

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 1000))
    def cache_sequence(self, i: int) -> None:
        self.insert_seq(i % len(self.seqs))  # mid-flight, e.g. after prefill

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 1000), cache_it=st.booleans())
    def finish_sequence(self, i: int, cache_it: bool) -> None:
        index = i % len(self.seqs)
        if cache_it:
            self.insert_seq(index)
        _, blocks = self.seqs.pop(index)
        self.pool.free(blocks)

    @rule(tokens=token_lists)
    def match_only(self, tokens: list[int]) -> None:
        self.check_match(tokens)

    @rule(n=st.integers(0, 8))
    def evict(self, n: int) -> None:
        self.check_evict(n)

    @rule(roll=st.integers(0, 5))
    def reset(self, roll: int) -> None:
        if roll == 0:  # rarely, or the cache would be empty most of the time
            self.cache.reset()
            self.ref.entries.clear()

    @invariant()
    def cache_matches_reference(self) -> None:
        self.pool.check_invariants()
        self.cache.check_invariants()
        bs = self.pool.block_size
        # The tree, flattened to the same prefix -> (block, last use) form as the reference.
        prefix: dict[int, tuple[int, ...]] = {}
        flat: dict[Key, tuple[int, int]] = {}
        for node in self.cache.nodes():
            above = () if node.parent_id is None else prefix[node.parent_id]
            prefix[node.node_id] = above + node.token_ids
            for i, block in enumerate(node.block_ids):
                tokens = above + node.token_ids[: (i + 1) * bs]
                flat[self.ref.key(tokens, len(tokens) // bs)] = (block, node.last_access)
        assert {k: b for k, (b, _) in flat.items()} == {k: v[0] for k, v in self.ref.entries.items()}
        # Last uses must be ordered alike (the two clocks need not agree on values).
        pairs = sorted({(self.ref.entries[k][1], t) for k, (_, t) in flat.items()})
        assert len({r for r, _ in pairs}) == len(pairs), "one use in the reference, several in the tree"
        assert [t for _, t in pairs] == sorted({t for _, t in pairs}), "LRU order differs"

        # References: each block counts the tree's one plus one per fake sequence holding it.
        tree_blocks = {v[0] for v in self.ref.entries.values()}
        seq = self.seq_refs()
        for block in range(self.pool.num_blocks):
            assert self.pool.ref_count(block) == (block in tree_blocks) + seq[block], block
        held_by_seqs = set(seq)
        only_tree = tree_blocks - held_by_seqs
        assert self.pool.num_free_blocks + len(held_by_seqs) + len(only_tree) == self.pool.num_blocks
        assert self.cache.num_cached_blocks == len(tree_blocks)
        assert self.cache.num_evictable_blocks == len(self.ref.copy().evict(10**9, self.tree_only()))


RadixCacheMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestRadixCacheMachine = RadixCacheMachine.TestCase
