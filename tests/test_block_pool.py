"""Tests of mini_infer.kv.block_pool (chapter 04): unit tests and a stateful property test."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from mini_infer.course.kv_waste import KVWaste, kv_cache_waste
from mini_infer.kv.block_pool import BlockPool, BlockTable, OutOfBlocks, num_blocks_for, slot_for

# -- helpers ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("num_tokens", "block_size", "expected"),
    [(0, 16, 0), (1, 16, 1), (15, 16, 1), (16, 16, 1), (17, 16, 2), (32, 16, 2), (33, 16, 3), (5, 1, 5)],
)
def test_num_blocks_for(num_tokens: int, block_size: int, expected: int) -> None:
    assert num_blocks_for(num_tokens, block_size) == expected


def test_num_blocks_for_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="num_tokens"):
        num_blocks_for(-1, 16)
    with pytest.raises(ValueError, match="block_size"):
        num_blocks_for(4, 0)


@pytest.mark.parametrize(
    ("position", "expected"),
    [
        (0, 7 * 16),  # first slot of block 7
        (5, 7 * 16 + 5),  # mid-block
        (15, 7 * 16 + 15),  # last slot of the first block
        (16, 2 * 16),  # logical block 1 -> physical block 2
        (20, 2 * 16 + 4),
        (37, 5 * 16 + 5),  # logical block 2 -> physical block 5, offset 5
        (47, 5 * 16 + 15),
    ],
)
def test_slot_for(position: int, expected: int) -> None:
    assert slot_for([7, 2, 5], position, 16) == expected


def test_slot_for_small_blocks() -> None:
    assert [slot_for([3, 0], p, 4) for p in range(8)] == [12, 13, 14, 15, 0, 1, 2, 3]


@pytest.mark.parametrize("position", [-1, 48, 100])
def test_slot_for_outside_the_table(position: int) -> None:
    with pytest.raises(IndexError, match="outside"):
        slot_for([7, 2, 5], position, 16)


# -- BlockPool --------------------------------------------------------------------------------


@pytest.mark.parametrize(("num_blocks", "block_size"), [(0, 16), (-3, 16), (4, 0), (4, -1)])
def test_pool_rejects_bad_sizes(num_blocks: int, block_size: int) -> None:
    with pytest.raises(ValueError, match="must be >= 1"):
        BlockPool(num_blocks, block_size)


def test_fresh_pool() -> None:
    pool = BlockPool(8, block_size=4)
    assert (pool.num_blocks, pool.block_size, pool.num_free_blocks) == (8, 4, 8)
    assert all(pool.ref_count(b) == 0 for b in range(8))
    assert BlockPool(3).block_size == 16
    pool.check_invariants()


def test_allocate_gives_distinct_blocks_with_one_reference() -> None:
    pool = BlockPool(8)
    first = pool.allocate(3)
    second = pool.allocate(2)
    assert first == [0, 1, 2]  # a fresh pool hands blocks out in order
    assert len(set(first + second)) == 5
    assert all(pool.ref_count(b) == 1 for b in first + second)
    assert pool.num_free_blocks == 3
    assert pool.allocate(0) == []
    assert pool.num_free_blocks == 3
    pool.check_invariants()


def test_allocate_is_all_or_nothing() -> None:
    pool = BlockPool(4)
    pool.allocate(3)
    assert pool.can_allocate(1)
    assert not pool.can_allocate(2)
    with pytest.raises(OutOfBlocks) as info:
        pool.allocate(2)
    assert (info.value.requested, info.value.free) == (2, 1)
    assert "2" in str(info.value) and "1" in str(info.value)
    assert pool.num_free_blocks == 1  # nothing was taken
    pool.check_invariants()


def test_allocate_negative() -> None:
    pool = BlockPool(4)
    assert not pool.can_allocate(-1)
    with pytest.raises(ValueError, match="negative"):
        pool.allocate(-1)


def test_freed_blocks_are_reused_last_in_first_out() -> None:
    pool = BlockPool(8)
    pool.allocate(2)
    blocks = pool.allocate(3)
    pool.free(blocks)
    assert pool.allocate(3) == blocks


def test_fork_and_free_count_references() -> None:
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.fork([a, b])
    pool.fork([a])
    assert (pool.ref_count(a), pool.ref_count(b)) == (3, 2)
    pool.free([a, b])
    assert (pool.ref_count(a), pool.ref_count(b)) == (2, 1)
    assert pool.num_free_blocks == 2  # still referenced: not free
    pool.free([b])
    assert pool.ref_count(b) == 0 and pool.num_free_blocks == 3
    pool.free([a, a])  # one owner may drop two references at once
    assert pool.ref_count(a) == 0 and pool.num_free_blocks == 4
    pool.check_invariants()


def test_fork_accepts_any_iterable() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    pool.fork(iter(blocks))
    pool.free(b for b in blocks)
    assert [pool.ref_count(b) for b in blocks] == [1, 1]


def test_fork_of_a_free_block_is_an_error_and_changes_nothing() -> None:
    pool = BlockPool(4)
    (a,) = pool.allocate(1)
    free_block = next(b for b in range(4) if b != a)
    with pytest.raises(ValueError, match=f"fork KV block {free_block}"):
        pool.fork([a, free_block])
    assert pool.ref_count(a) == 1
    pool.check_invariants()


def test_double_free_is_an_error_and_changes_nothing() -> None:
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.free([a])
    with pytest.raises(ValueError, match=f"double free of KV block {a}"):
        pool.free([b, a])
    assert pool.ref_count(b) == 1  # b was not freed either
    with pytest.raises(ValueError, match=f"double free of KV block {b}"):
        pool.free([b, b])
    assert pool.ref_count(b) == 1 and pool.num_free_blocks == 3
    pool.check_invariants()


@pytest.mark.parametrize("bad", [-1, 4, 99])
def test_ids_outside_the_pool_are_errors(bad: int) -> None:
    pool = BlockPool(4)
    pool.allocate(4)
    for call in (pool.fork, pool.free):
        with pytest.raises(ValueError, match="outside the pool"):
            call([bad])
    with pytest.raises(ValueError, match="outside the pool"):
        pool.ref_count(bad)


def test_check_invariants_catches_corruption() -> None:
    # White-box: break the pool by hand and make sure the check notices each kind of damage.
    pool = BlockPool(4)
    pool.allocate(2)
    pool._free.append(pool._free[-1])
    with pytest.raises(AssertionError, match="more than once"):
        pool.check_invariants()

    pool = BlockPool(4)
    (a,) = pool.allocate(1)
    pool._free.append(a)
    with pytest.raises(AssertionError, match=f"block {a} is free but has 1 reference"):
        pool.check_invariants()

    pool = BlockPool(4)
    (a,) = pool.allocate(1)
    pool._ref_counts[a] = 0
    with pytest.raises(AssertionError, match="leaked"):
        pool.check_invariants()


# -- BlockTable -------------------------------------------------------------------------------


def test_block_table_grows_by_whole_blocks() -> None:
    pool = BlockPool(8, block_size=4)
    table = BlockTable()
    assert table.ensure_capacity(pool, 0) and table.block_ids == []
    assert table.ensure_capacity(pool, 1) and len(table.block_ids) == 1
    assert table.ensure_capacity(pool, 4) and len(table.block_ids) == 1  # still fits
    first = list(table.block_ids)
    assert table.ensure_capacity(pool, 9) and len(table.block_ids) == 3
    assert table.block_ids[:1] == first  # growing never moves existing blocks
    assert table.ensure_capacity(pool, 2) and len(table.block_ids) == 3  # never shrinks
    assert pool.num_free_blocks == 5
    pool.check_invariants()


def test_block_table_is_all_or_nothing_when_short() -> None:
    pool = BlockPool(4, block_size=4)
    table = BlockTable()
    assert table.ensure_capacity(pool, 8)
    before = list(table.block_ids)
    assert not table.ensure_capacity(pool, 4 * 4 + 1)  # needs 3 more, 2 are free
    assert table.block_ids == before
    assert pool.num_free_blocks == 2
    assert table.ensure_capacity(pool, 16)
    assert pool.num_free_blocks == 0


def test_block_table_release_keeps_shared_blocks_alive() -> None:
    pool = BlockPool(4, block_size=4)
    table = BlockTable()
    table.ensure_capacity(pool, 8)
    pool.fork(table.block_ids)
    sibling = BlockTable(list(table.block_ids))
    table.release(pool)
    assert table.block_ids == []
    assert pool.num_free_blocks == 2
    assert all(pool.ref_count(b) == 1 for b in sibling.block_ids)
    sibling.release(pool)
    assert pool.num_free_blocks == 4
    pool.check_invariants()


def test_block_table_slots() -> None:
    table = BlockTable([3, 0, 2])
    assert table.slots(0, 12, 4) == [12, 13, 14, 15, 0, 1, 2, 3, 8, 9, 10, 11]
    assert table.slots(6, 9, 4) == [2, 3, 8]  # a chunk that crosses a block boundary
    assert table.slots(5, 5, 4) == []
    with pytest.raises(IndexError):
        table.slots(10, 13, 4)
    with pytest.raises(IndexError):
        table.slots(3, 2, 4)


# -- waste ------------------------------------------------------------------------------------


def test_kv_cache_waste_hand_computed() -> None:
    # lengths 1, 17, 32, 40 with 16-token blocks: 1 + 2 + 2 + 3 = 8 blocks = 128 slots for 90 tokens
    waste = kv_cache_waste([1, 17, 32, 40], block_size=16, contiguous_max_len=64)
    assert waste == KVWaste(used_slots=90, paged_slots=128, contiguous_slots=256)
    assert waste.paged_waste == pytest.approx(38 / 128)
    assert waste.contiguous_waste == pytest.approx(166 / 256)
    # By default a contiguous cache reserves the longest sequence, 40 tokens, per request.
    default = kv_cache_waste([1, 17, 32, 40], block_size=16)
    assert default.contiguous_slots == 160
    assert default.contiguous_waste == pytest.approx(70 / 160)


def test_kv_cache_waste_edges() -> None:
    assert kv_cache_waste([], 16) == KVWaste(0, 0, 0)
    assert kv_cache_waste([], 16).paged_waste == 0.0
    exact = kv_cache_waste([16, 32], 16)
    assert exact.paged_waste == 0.0 and exact.contiguous_waste == pytest.approx(16 / 64)
    with pytest.raises(ValueError, match="shorter than the longest"):
        kv_cache_waste([10, 50], 16, contiguous_max_len=32)
    with pytest.raises(ValueError, match=">= 0"):
        kv_cache_waste([-1], 16)


# -- stateful property test -------------------------------------------------------------------


class BlockPoolMachine(RuleBasedStateMachine):
    """Random allocate / grow / fork / free / release against a model of reference counts."""

    @initialize(num_blocks=st.integers(1, 12), block_size=st.sampled_from([1, 2, 4, 16]))
    def setup(self, num_blocks: int, block_size: int) -> None:
        self.pool = BlockPool(num_blocks, block_size)
        self.refs = [0] * num_blocks  # the model: what each block's count must be
        self.tables: list[tuple[BlockTable, int]] = []  # (table, tokens it must hold)
        self.raw: list[list[int]] = []  # lists from allocate() still owned

    def model_free(self) -> int:
        return sum(1 for r in self.refs if r == 0)

    def take_fresh(self, blocks: list[int]) -> None:
        assert len(set(blocks)) == len(blocks)
        for b in blocks:
            assert self.refs[b] == 0, f"block {b} handed out while still referenced"
            self.refs[b] = 1

    @rule(n=st.integers(0, 6))
    def allocate(self, n: int) -> None:
        if n <= self.model_free():
            blocks = self.pool.allocate(n)
            assert len(blocks) == n
            self.take_fresh(blocks)
            self.raw.append(blocks)
        else:
            with pytest.raises(OutOfBlocks) as info:
                self.pool.allocate(n)
            assert (info.value.requested, info.value.free) == (n, self.model_free())

    @rule(num_tokens=st.integers(0, 40))
    def new_table(self, num_tokens: int) -> None:
        table = BlockTable()
        fits = num_blocks_for(num_tokens, self.pool.block_size) <= self.model_free()
        assert table.ensure_capacity(self.pool, num_tokens) == fits
        if fits:
            assert len(table.block_ids) == num_blocks_for(num_tokens, self.pool.block_size)
            self.take_fresh(table.block_ids)
            self.tables.append((table, num_tokens))
        else:
            assert table.block_ids == []

    @precondition(lambda self: self.tables)
    @rule(i=st.integers(0, 1000), extra=st.integers(1, 20))
    def append(self, i: int, extra: int) -> None:
        index = i % len(self.tables)
        table, num_tokens = self.tables[index]
        before = list(table.block_ids)
        missing = num_blocks_for(num_tokens + extra, self.pool.block_size) - len(before)
        fits = missing <= self.model_free()
        assert table.ensure_capacity(self.pool, num_tokens + extra) == fits
        if fits:
            assert table.block_ids[: len(before)] == before
            self.take_fresh(table.block_ids[len(before) :])
            self.tables[index] = (table, num_tokens + extra)
        else:
            assert table.block_ids == before

    @precondition(lambda self: self.tables)
    @rule(i=st.integers(0, 1000))
    def fork_table(self, i: int) -> None:
        table, num_tokens = self.tables[i % len(self.tables)]
        self.pool.fork(table.block_ids)
        for b in table.block_ids:
            self.refs[b] += 1
        self.tables.append((BlockTable(list(table.block_ids)), num_tokens))

    @precondition(lambda self: self.tables)
    @rule(i=st.integers(0, 1000))
    def release_table(self, i: int) -> None:
        table, _ = self.tables.pop(i % len(self.tables))
        for b in table.block_ids:
            self.refs[b] -= 1
        table.release(self.pool)
        assert table.block_ids == []

    @precondition(lambda self: self.raw)
    @rule(i=st.integers(0, 1000))
    def free_raw(self, i: int) -> None:
        blocks = self.raw.pop(i % len(self.raw))
        for b in blocks:
            self.refs[b] -= 1
        self.pool.free(blocks)

    @precondition(lambda self: any(r == 0 for r in self.refs))
    @rule(i=st.integers(0, 1000))
    def misuse_a_free_block(self, i: int) -> None:
        free_blocks = [b for b, r in enumerate(self.refs) if r == 0]
        block = free_blocks[i % len(free_blocks)]
        with pytest.raises(ValueError, match="double free"):
            self.pool.free([block])
        with pytest.raises(ValueError, match="fork"):
            self.pool.fork([block])

    @invariant()
    def pool_matches_model(self) -> None:
        self.pool.check_invariants()
        assert [self.pool.ref_count(b) for b in range(self.pool.num_blocks)] == self.refs
        assert self.pool.num_free_blocks == self.model_free()
        for table, num_tokens in self.tables:
            assert len(table.block_ids) >= num_blocks_for(num_tokens, self.pool.block_size)
            assert all(self.refs[b] >= 1 for b in table.block_ids)


BlockPoolMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestBlockPoolMachine = BlockPoolMachine.TestCase
