"""Tests of mini_infer.kv.radix_cache (chapter 08): unit tests and a stateful property test."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from mini_infer.kv.block_pool import BlockPool, num_blocks_for
from mini_infer.kv.radix_cache import RadixCache, RadixNodeView

BS = 4
# One block of tokens each, all different in their first token.
A, B, C, D, E, Z = ([t] * BS for t in (1, 2, 3, 4, 5, 9))


def make(num_blocks: int = 16) -> tuple[BlockPool, RadixCache]:
    pool = BlockPool(num_blocks, block_size=BS)
    return pool, RadixCache(pool)


def cache_finished(pool: BlockPool, cache: RadixCache, tokens: list[int]) -> list[int]:
    """A sequence that computed ``tokens`` into fresh blocks, cached them and finished."""
    blocks = pool.allocate(len(tokens) // BS)
    cache.insert(tokens, blocks)
    pool.free(blocks)
    return blocks


def refs(pool: BlockPool) -> list[int]:
    return [pool.ref_count(b) for b in range(pool.num_blocks)]


def check(pool: BlockPool, cache: RadixCache) -> None:
    pool.check_invariants()
    cache.check_invariants()


# -- match and insert -------------------------------------------------------------------------


def test_empty_cache_matches_nothing() -> None:
    pool, cache = make()
    match = cache.match_prefix(A + B)
    assert (match.block_ids, match.num_tokens) == ([], 0)
    assert cache.num_cached_blocks == 0 and cache.num_evictable_blocks == 0
    assert cache.match_prefix([]).num_tokens == 0
    check(pool, cache)


def test_match_is_longest_whole_block_prefix() -> None:
    pool, cache = make()
    x = cache_finished(pool, cache, A + B + C)
    cases = {
        tuple(A + B + C): 3,
        tuple(A + B + C + [7]): 3,  # a partial block after the cached ones never matches
        tuple(A + B + C + D): 3,
        tuple(A + B + [3, 3, 3]): 2,  # the third block is not complete
        tuple(A + B + D): 2,  # diverges in the third block
        tuple(A + B + [3, 3, 3, 8]): 2,  # diverges in the last token of the third block
        tuple(A + [2, 2]): 1,
        tuple([1, 1, 1]): 0,  # less than one block
        tuple(B + C): 0,  # the prefix must start at token 0
    }
    for tokens, num_blocks in cases.items():
        match = cache.match_prefix(list(tokens))
        assert match.block_ids == x[:num_blocks], tokens
        assert match.num_tokens == num_blocks * BS
    check(pool, cache)


def test_match_takes_no_references() -> None:
    pool, cache = make()
    x = cache_finished(pool, cache, A + B)
    before = refs(pool)
    assert cache.match_prefix(A + B).block_ids == x
    assert refs(pool) == before
    assert all(pool.ref_count(b) == 1 for b in x)  # the tree's own reference only


def test_insert_takes_one_reference_on_new_blocks_only() -> None:
    pool, cache = make()
    x = pool.allocate(3)
    assert cache.insert(A + B + C, x) == 12
    assert [pool.ref_count(b) for b in x] == [2, 2, 2]  # the caller's and the tree's
    # A second sequence computed A B D into its own blocks (it started before the first was cached).
    y = pool.allocate(3)
    assert cache.insert(A + B + D, y) == 4
    assert [pool.ref_count(b) for b in y] == [1, 1, 2]  # the duplicates of A and B are left alone
    assert cache.match_prefix(A + B + D).block_ids == [x[0], x[1], y[2]]
    assert cache.num_cached_blocks == 4
    assert cache.insert(A + B, y[:2]) == 0  # all cached already
    assert cache.insert([], []) == 0
    pool.free(x)
    pool.free(y)
    assert pool.num_free_blocks == pool.num_blocks - 4
    check(pool, cache)


def test_insert_splits_at_the_block_where_sequences_diverge() -> None:
    pool, cache = make()
    x = cache_finished(pool, cache, A + B + C)
    y = cache_finished(pool, cache, A + B + D + E)
    nodes = {n.token_ids: n for n in cache.nodes()}
    root = nodes[()]
    ab, c, de = nodes[tuple(A + B)], nodes[tuple(C)], nodes[tuple(D + E)]
    assert len(nodes) == 4
    assert root.node_id == 0 and root.parent_id is None and root.block_ids == ()
    assert (ab.parent_id, ab.block_ids) == (root.node_id, tuple(x[:2]))
    assert (c.parent_id, c.block_ids) == (ab.node_id, (x[2],))
    assert (de.parent_id, de.block_ids) == (ab.node_id, tuple(y[2:]))
    assert cache.nodes()[0] == root  # root first, parents before children
    check(pool, cache)


def test_split_inside_a_block_happens_at_the_block_boundary() -> None:
    pool, cache = make()
    cache_finished(pool, cache, A + B)
    cache_finished(pool, cache, A + [2, 2, 2, 7])  # differs from B in its last token
    assert sorted(n.token_ids for n in cache.nodes()) == [(), tuple(A), tuple(B), (2, 2, 2, 7)]
    check(pool, cache)


def test_insert_rejects_partial_blocks_and_changes_nothing() -> None:
    pool, cache = make()
    cache_finished(pool, cache, A + B)
    blocks = pool.allocate(2)
    nodes, before = cache.nodes(), refs(pool)
    with pytest.raises(ValueError, match="whole blocks"):
        cache.insert(A + [3, 3, 3], blocks[:1] + blocks[1:])
    with pytest.raises(ValueError, match="whole blocks"):
        cache.insert(A + C + [5], blocks)
    assert cache.nodes() == nodes and refs(pool) == before


def test_insert_of_a_free_block_is_an_error_and_changes_nothing() -> None:
    pool, cache = make(5)
    cache_finished(pool, cache, A + B + C)
    (mine,) = pool.allocate(1)
    free_block = next(b for b in range(5) if pool.ref_count(b) == 0)
    nodes, before = cache.nodes(), refs(pool)
    with pytest.raises(ValueError, match="free"):
        # Diverges mid-node: a careless insert would split the node before noticing.
        cache.insert(A + D + E, [0, mine, free_block])
    assert cache.nodes() == nodes and refs(pool) == before
    check(pool, cache)


def test_insert_of_a_block_cached_elsewhere_is_an_error() -> None:
    pool, cache = make()
    x = cache_finished(pool, cache, A + B)
    with pytest.raises(ValueError, match="already cached"):
        cache.insert(C, [x[1]])
    (mine,) = pool.allocate(1)
    with pytest.raises(ValueError, match="repeat"):
        cache.insert(C + D, [mine, mine])
    check(pool, cache)


# -- eviction ---------------------------------------------------------------------------------


def test_evict_least_recently_used_leaf_first() -> None:
    pool, cache = make()
    x = cache_finished(pool, cache, A)
    y = cache_finished(pool, cache, B)
    z = cache_finished(pool, cache, C)
    cache.match_prefix(A + D)  # A is now the most recently used
    assert cache.evict(1) == 1
    assert pool.ref_count(y[0]) == 0 and cache.match_prefix(B).num_tokens == 0
    assert cache.match_prefix(C).num_tokens == 4  # touches C: A is now the oldest
    assert cache.evict(1) == 1
    assert pool.ref_count(x[0]) == 0 and pool.ref_count(z[0]) == 1
    assert cache.evict(5) == 1
    assert cache.evict(1) == 0
    assert pool.num_free_blocks == pool.num_blocks and cache.num_cached_blocks == 0
    check(pool, cache)


def test_evict_trims_a_leaf_from_its_end() -> None:
    pool, cache = make()
    x = cache_finished(pool, cache, A + B + C)
    assert cache.evict(1) == 1
    assert pool.ref_count(x[2]) == 0
    assert cache.match_prefix(A + B + C).block_ids == x[:2]
    assert cache.num_cached_blocks == 2
    assert cache.evict(0) == 0
    assert cache.num_cached_blocks == 2
    check(pool, cache)


def test_a_parent_goes_only_after_its_children() -> None:
    pool, cache = make()
    x = cache_finished(pool, cache, A + B + C)
    y = cache_finished(pool, cache, A + B + D)
    assert cache.evict(1) == 1  # C: the older leaf
    assert pool.ref_count(x[2]) == 0 and pool.ref_count(y[2]) == 1
    assert cache.evict(2) == 2  # D, then the shared node becomes a leaf: B
    assert pool.ref_count(x[1]) == 0 and pool.ref_count(x[0]) == 1
    assert cache.match_prefix(A + B).block_ids == x[:1]
    check(pool, cache)


def test_a_match_splits_so_the_unused_tail_is_evicted_first() -> None:
    pool, cache = make()
    x = cache_finished(pool, cache, A + B + C)
    z = cache_finished(pool, cache, Z)
    assert cache.match_prefix(A + B + D).num_tokens == 8  # uses A B, not C
    assert cache.evict(1) == 1
    assert pool.ref_count(x[2]) == 0  # C is older than Z
    assert cache.evict(1) == 1
    assert pool.ref_count(z[0]) == 0  # and Z older than A B
    check(pool, cache)


def test_blocks_in_use_are_never_evicted() -> None:
    pool, cache = make()
    x = cache_finished(pool, cache, A + B + C)
    match = cache.match_prefix(A + B)
    pool.fork(match.block_ids)  # a sequence now uses A B
    assert cache.num_evictable_blocks == 1
    assert cache.evict(10) == 1  # only C
    assert [pool.ref_count(b) for b in x] == [2, 2, 0]
    assert cache.num_evictable_blocks == 0 and cache.evict(10) == 0
    pool.free(match.block_ids)  # the sequence finished
    assert cache.num_evictable_blocks == 2
    assert cache.evict(10) == 2
    check(pool, cache)


def test_nothing_above_a_block_in_use_is_evicted() -> None:
    pool, cache = make()
    x = cache_finished(pool, cache, A)
    # A sequence computed A B into its own blocks and cached them: the tree keeps its A (held by
    # the tree only) and takes the sequence's B, which the sequence still uses.
    y = pool.allocate(2)
    assert cache.insert(A + B, y) == 4
    assert (pool.ref_count(x[0]), pool.ref_count(y[1])) == (1, 2)
    assert cache.num_evictable_blocks == 0
    assert cache.evict(10) == 0
    pool.free(y)
    assert cache.num_evictable_blocks == 2
    assert cache.evict(10) == 2
    assert pool.num_free_blocks == pool.num_blocks
    check(pool, cache)


def test_evict_rejects_a_negative_count() -> None:
    _, cache = make()
    with pytest.raises(ValueError, match="negative"):
        cache.evict(-1)


def test_reset_drops_only_the_trees_references() -> None:
    pool, cache = make()
    cache_finished(pool, cache, A + B)
    cache_finished(pool, cache, C)
    match = cache.match_prefix(A)
    pool.fork(match.block_ids)
    cache.reset()
    assert cache.num_cached_blocks == 0 and cache.nodes()[0].token_ids == ()
    assert len(cache.nodes()) == 1
    assert cache.match_prefix(A + B).num_tokens == 0
    assert pool.num_free_blocks == pool.num_blocks - 1
    assert pool.ref_count(match.block_ids[0]) == 1  # the sequence's reference survives
    check(pool, cache)


def test_nodes_report_last_access() -> None:
    pool, cache = make()
    cache_finished(pool, cache, A)
    cache_finished(pool, cache, B)
    by_tokens = {n.token_ids: n for n in cache.nodes()}
    assert by_tokens[tuple(A)].last_access < by_tokens[tuple(B)].last_access
    cache.match_prefix(A)
    by_tokens = {n.token_ids: n for n in cache.nodes()}
    assert by_tokens[tuple(A)].last_access > by_tokens[tuple(B)].last_access
    assert all(isinstance(n, RadixNodeView) for n in by_tokens.values())


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
