"""Graded tests (chapter 04): the block pool's allocate, fork and free, and block tables.

The last test drives the pool through a long random sequence of operations next to a model of
it kept here (a free list and a reference count per block) and compares them after every step.
"""

from __future__ import annotations

import random

import pytest

from mini_infer.kv.block_pool import BlockPool, BlockTable, OutOfBlocks, num_blocks_for


def counts(pool: BlockPool) -> list[int]:
    return [pool.ref_count(b) for b in range(pool.num_blocks)]


@pytest.mark.points(1)
def test_num_blocks_for():
    cases = {(0, 16): 0, (1, 16): 1, (15, 16): 1, (16, 16): 1, (17, 16): 2, (33, 16): 3, (5, 1): 5, (9, 4): 3}
    for (tokens, block_size), expected in cases.items():
        assert num_blocks_for(tokens, block_size) == expected, (tokens, block_size)


@pytest.mark.points(2)
def test_a_fresh_pool_hands_out_blocks_in_order():
    pool = BlockPool(6, block_size=4)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(3) == [2, 3, 4]
    assert counts(pool) == [1, 1, 1, 1, 1, 0]
    assert pool.num_free_blocks == 1
    assert pool.allocate(0) == [] and pool.num_free_blocks == 1
    pool.check_invariants()


@pytest.mark.points(2)
def test_allocate_is_all_or_nothing():
    pool = BlockPool(4)
    pool.allocate(3)
    with pytest.raises(OutOfBlocks) as short:
        pool.allocate(2)
    assert (short.value.requested, short.value.free) == (2, 1)  # the scheduler reads both
    assert pool.num_free_blocks == 1 and counts(pool) == [1, 1, 1, 0]
    assert pool.allocate(1) == [3]
    with pytest.raises(OutOfBlocks):
        pool.allocate(1)
    with pytest.raises(ValueError):
        pool.allocate(-1)
    pool.check_invariants()


@pytest.mark.points(2)
def test_free_returns_blocks_last_freed_first_reused():
    pool = BlockPool(5)
    a = pool.allocate(3)
    pool.free(a)
    assert pool.num_free_blocks == 5 and counts(pool) == [0] * 5
    assert pool.allocate(3) == a  # the same blocks in the same order
    pool.free([2])
    pool.free([0])
    assert pool.allocate(1) == [0]
    assert pool.allocate(1) == [2]
    pool.check_invariants()


@pytest.mark.points(2)
def test_fork_shares_a_block_until_its_last_owner_frees_it():
    pool = BlockPool(4)
    a = pool.allocate(2)
    pool.fork(a)
    pool.fork(a[:1])
    assert counts(pool)[:2] == [3, 2]
    pool.free(a)
    assert counts(pool)[:2] == [2, 1] and pool.num_free_blocks == 2
    pool.free([a[0], a[0]])  # one owner may drop two references at once
    assert counts(pool)[:2] == [0, 1] and pool.num_free_blocks == 3
    pool.check_invariants()


@pytest.mark.points(2)
def test_misuse_raises_and_changes_nothing():
    pool = BlockPool(4)
    a = pool.allocate(2)
    before = (counts(pool), pool.num_free_blocks)
    with pytest.raises(ValueError):
        pool.fork([a[0], 3])  # 3 is free
    with pytest.raises(ValueError):
        pool.fork([a[1], 4])  # outside the pool
    with pytest.raises(ValueError):
        pool.free([a[0], 2])  # 2 is free
    with pytest.raises(ValueError):
        pool.free([a[1], a[1]])  # two drops, one reference
    with pytest.raises(ValueError):
        pool.free([-1])
    assert (counts(pool), pool.num_free_blocks) == before
    pool.check_invariants()


@pytest.mark.points(2)
def test_block_table_grows_exactly_as_needed():
    pool = BlockPool(5, block_size=4)
    table = BlockTable()
    assert table.ensure_capacity(pool, 1) and table.block_ids == [0]
    assert table.ensure_capacity(pool, 4) and table.block_ids == [0]
    assert table.ensure_capacity(pool, 5) and table.block_ids == [0, 1]
    assert table.ensure_capacity(pool, 12) and table.block_ids == [0, 1, 2]
    assert table.ensure_capacity(pool, 0) and table.block_ids == [0, 1, 2]
    assert not table.ensure_capacity(pool, 21)  # needs 6 blocks, the pool has 5
    assert table.block_ids == [0, 1, 2] and pool.num_free_blocks == 2
    assert table.ensure_capacity(pool, 20) and table.block_ids == [0, 1, 2, 3, 4]
    pool.check_invariants()


@pytest.mark.points(2)
def test_shrink_and_release():
    pool = BlockPool(6, block_size=4)
    table = BlockTable()
    table.ensure_capacity(pool, 17)  # 5 blocks
    table.shrink(pool, 9)  # keeps 3
    assert table.block_ids == [0, 1, 2] and counts(pool) == [1, 1, 1, 0, 0, 0]
    table.shrink(pool, 12)
    assert table.block_ids == [0, 1, 2]
    other = BlockTable(list(table.block_ids[:2]))
    pool.fork(other.block_ids)
    table.release(pool)
    assert table.block_ids == [] and counts(pool) == [1, 1, 0, 0, 0, 0]
    other.release(pool)
    assert pool.num_free_blocks == 6
    pool.check_invariants()


@pytest.mark.points(4)
def test_random_operations_agree_with_a_model_of_the_pool():
    rng = random.Random(0)
    pool = BlockPool(12, block_size=4)
    model_counts = [0] * 12
    owners: list[list[int]] = []
    for _ in range(600):
        op = rng.random()
        free = model_counts.count(0)
        if op < 0.4:
            n = rng.randint(0, 5)
            if n > free:
                with pytest.raises(OutOfBlocks):
                    pool.allocate(n)
            else:
                got = pool.allocate(n)
                assert len(got) == len(set(got)) == n
                assert all(model_counts[b] == 0 for b in got), "allocated a block in use"
                for b in got:
                    model_counts[b] = 1
                owners.append(got)
        elif op < 0.6 and owners:
            shared = list(rng.choice(owners))
            pool.fork(shared)
            for b in shared:
                model_counts[b] += 1
            owners.append(shared)
        elif owners:
            released = owners.pop(rng.randrange(len(owners)))
            pool.free(released)
            for b in released:
                model_counts[b] -= 1
        assert counts(pool) == model_counts
        assert pool.num_free_blocks == model_counts.count(0)
        pool.check_invariants()
