"""Graded tests (chapter 08): the radix cache's match, insert (with splits) and LRU eviction.

Most tests check one rule by hand on one-block token runs; the last drives the cache with random
prompts next to a model of what it must hold.
"""

from __future__ import annotations

import random

import pytest

from mini_infer.kv.block_pool import BlockPool
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


@pytest.mark.points(1)
def test_empty_cache_matches_nothing() -> None:
    pool, cache = make()
    match = cache.match_prefix(A + B)
    assert (match.block_ids, match.num_tokens) == ([], 0)
    assert cache.num_cached_blocks == 0 and cache.num_evictable_blocks == 0
    assert cache.match_prefix([]).num_tokens == 0
    check(pool, cache)


@pytest.mark.points(1)
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


@pytest.mark.points(1)
def test_match_takes_no_references() -> None:
    pool, cache = make()
    x = cache_finished(pool, cache, A + B)
    before = refs(pool)
    assert cache.match_prefix(A + B).block_ids == x
    assert refs(pool) == before
    assert all(pool.ref_count(b) == 1 for b in x)  # the tree's own reference only


@pytest.mark.points(1)
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


@pytest.mark.points(1)
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


@pytest.mark.points(1)
def test_split_inside_a_block_happens_at_the_block_boundary() -> None:
    pool, cache = make()
    cache_finished(pool, cache, A + B)
    cache_finished(pool, cache, A + [2, 2, 2, 7])  # differs from B in its last token
    assert sorted(n.token_ids for n in cache.nodes()) == [(), tuple(A), tuple(B), (2, 2, 2, 7)]
    check(pool, cache)


@pytest.mark.points(1)
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


@pytest.mark.points(1)
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


@pytest.mark.points(1)
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


@pytest.mark.points(1)
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


@pytest.mark.points(1)
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


@pytest.mark.points(1)
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


@pytest.mark.points(1)
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


@pytest.mark.points(1)
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


@pytest.mark.points(1)
def test_evict_frees_the_tail_of_a_leaf_whose_head_is_in_use() -> None:
    pool, cache = make()
    x = pool.allocate(3)
    cache.insert(A + B + C, x)
    pool.free(x[1:])  # the caller still uses A only: B and C are held by the tree alone
    assert cache.num_evictable_blocks == 2
    assert cache.evict(10) == 2  # C, then B; trimming stops at A
    assert [pool.ref_count(b) for b in x] == [2, 0, 0]
    assert cache.match_prefix(A + B + C).block_ids == x[:1]
    check(pool, cache)


@pytest.mark.points(1)
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


@pytest.mark.points(1)
def test_evict_rejects_a_negative_count() -> None:
    _, cache = make()
    with pytest.raises(ValueError, match="negative"):
        cache.evict(-1)


@pytest.mark.points(1)
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


@pytest.mark.points(1)
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


@pytest.mark.points(4)
def test_random_prompts_agree_with_a_model_of_the_cache() -> None:
    """Inserts only: a match is the longest whole-block prefix of anything inserted, in the
    blocks first inserted for it. Then evictions: every block freed was held only by the tree,
    and what still matches is still right."""
    rng = random.Random(0)
    pool, cache = make(200)
    owner: dict[tuple[int, ...], int] = {}  # a whole-block prefix -> the block that holds its last block
    for _ in range(60):
        tokens = [rng.choice([1, 2]) for _ in range(BS * rng.randint(1, 5))]
        blocks = pool.allocate(len(tokens) // BS)
        before = sum(1 for i in range(len(blocks)) if tuple(tokens[: (i + 1) * BS]) in owner)
        assert cache.insert(tokens, blocks) == (len(blocks) - before) * BS
        for i, block in enumerate(blocks):
            owner.setdefault(tuple(tokens[: (i + 1) * BS]), block)
        pool.free(blocks)
        check(pool, cache)
    for _ in range(40):
        probe = [rng.choice([1, 2]) for _ in range(rng.randint(0, 6 * BS))]
        expected = max([n for n in range(0, len(probe) // BS + 1) if n == 0 or tuple(probe[: n * BS]) in owner])
        match = cache.match_prefix(probe)
        assert match.num_tokens == expected * BS
        assert match.block_ids == [owner[tuple(probe[: (i + 1) * BS])] for i in range(expected)]
    for _ in range(30):
        cached, free_before = cache.num_cached_blocks, pool.num_free_blocks
        n = rng.randint(0, 4)
        freed = cache.evict(n)
        assert freed == min(n, cached)  # nothing is in use: every cached block can go
        assert cache.num_cached_blocks == cached - freed and pool.num_free_blocks == free_before + freed
        probe = [rng.choice([1, 2]) for _ in range(5 * BS)]
        match = cache.match_prefix(probe)
        assert match.block_ids == [owner[tuple(probe[: (i + 1) * BS])] for i in range(match.num_tokens // BS)]
        check(pool, cache)
