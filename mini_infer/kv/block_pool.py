"""The bookkeeping of the paged KV cache: blocks, reference counts, block tables (chapter 04).

The KV cache is one pool of ``num_blocks`` physical blocks of ``block_size`` token slots each,
allocated once after the weights are loaded (the tensors live in the model runner; this module
only does the accounting, so it needs no torch). A sequence owns a ``BlockTable``: the list of
physical block ids that hold its logical blocks 0, 1, 2, ... Token position ``p`` of a sequence
lives in slot ``block_table[p // block_size] * block_size + p % block_size`` of the pool.

Blocks are reference counted so that several owners can share one block: two sequences with a
common prompt prefix (chapter 08's radix cache holds a reference too), or parallel samples.
Only full blocks are ever shared, so nobody writes into a block someone else reads.

Invariants (``BlockPool.check_invariants`` asserts them; the tests call it after every step):

* every block is either free (on the free list, reference count 0) or referenced (count >= 1),
  never both: ``num_free_blocks + number of referenced blocks == num_blocks``;
* the free list holds no block twice;
* ``allocate`` and ``ensure_capacity`` are all-or-nothing: when the pool is short, nothing changes.

With the radix cache of chapter 08 the same count reads: free + held by sequences + held only
by the cache == total.

Running out of blocks is normal under load: ``allocate`` raises ``OutOfBlocks`` (and
``BlockTable.ensure_capacity`` returns ``False``) so that the scheduler can preempt or wait.
Misuse (freeing a free block, forking a free block, an id outside the pool) is a bug in the
caller and raises ``ValueError`` naming the block.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

__all__ = [
    "BlockPool",
    "BlockTable",
    "OutOfBlocks",
    "num_blocks_for",
    "slot_for",
    "slot_mapping",
]


class OutOfBlocks(Exception):
    """The pool has fewer free blocks than requested; a normal condition under load."""

    def __init__(self, requested: int, free: int) -> None:
        super().__init__(f"requested {requested} KV blocks but only {free} are free")
        self.requested = requested
        self.free = free


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens`` tokens: ceil(num_tokens / block_size)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    # student: begin chapter 04: ceil(num_tokens / block_size)
    return -(-num_tokens // block_size)
    # student: end


def slot_mapping(block_table: Sequence[int], start: int, end: int, block_size: int) -> list[int]:
    """Pool slots of logical positions ``start, ..., end - 1`` of a sequence with this block table
    (the slot mapping of a chunk): position ``p`` lives in ``block_table[p // block_size] *
    block_size + p % block_size``."""
    # student: begin chapter 05: the pool slot of each position in [start, end), IndexError outside the table
    capacity = len(block_table) * block_size
    if not 0 <= start <= end <= capacity:
        raise IndexError(
            f"positions [{start}, {end}) are outside a table of {len(block_table)} blocks of {block_size} tokens"
        )
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]
    # student: end


def slot_for(block_table: Sequence[int], position: int, block_size: int) -> int:
    """The pool slot that holds logical token ``position`` of a sequence with this block table."""
    return slot_mapping(block_table, position, position + 1, block_size)[0]


class BlockPool:
    """Free list and reference counts of ``num_blocks`` physical KV blocks."""

    def __init__(self, num_blocks: int, block_size: int = 16) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref_counts = [0] * num_blocks
        # A stack: allocate pops from the end. Reversed so that a fresh pool hands out 0, 1, 2, ...
        # which makes the book's pictures and the tests readable.
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks, each with reference count 1; all or nothing."""
        # student: begin chapter 04: take n free blocks, reference count 1 each, all or nothing
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > len(self._free):
            raise OutOfBlocks(n, len(self._free))
        if n == 0:
            return []
        block_ids = self._free[-n:]
        del self._free[-n:]
        block_ids.reverse()  # pop order: the top of the stack comes first
        for block_id in block_ids:
            self._ref_counts[block_id] = 1
        return block_ids
        # student: end

    def fork(self, block_ids: Iterable[int]) -> None:
        """Add one reference to each block (a new owner shares it); every block must be in use."""
        # student: begin chapter 04: one more reference on each block in use; a bad id changes nothing
        ids = list(block_ids)
        # Check everything before changing anything, so a bad id leaves the pool as it was.
        for block_id in ids:
            self._check_id(block_id)
            if self._ref_counts[block_id] == 0:
                raise ValueError(f"cannot fork KV block {block_id}: it is free")
        for block_id in ids:
            self._ref_counts[block_id] += 1
        # student: end

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block; a block whose count reaches 0 becomes free."""
        # student: begin chapter 04: drop one reference per id; a block at 0 goes back on the free list
        ids = list(block_ids)
        # An id may appear more than once (an owner dropping two references), so compare the
        # number of drops against the count, again before changing anything.
        for block_id, drops in Counter(ids).items():
            self._check_id(block_id)
            if drops > self._ref_counts[block_id]:
                raise ValueError(
                    f"double free of KV block {block_id}: {drops} reference(s) dropped but it "
                    f"holds {self._ref_counts[block_id]}"
                )
        # Pushed in reverse so that the next allocate hands the same blocks back in the same
        # order (last freed, first reused: those blocks are likely still warm in the caches).
        for block_id in reversed(ids):
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free.append(block_id)
        # student: end

    def ref_count(self, block_id: int) -> int:
        self._check_id(block_id)
        return self._ref_counts[block_id]

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` when the free list and the reference counts disagree."""
        free_set = set(self._free)
        if len(free_set) != len(self._free):
            dupes = sorted(b for b, c in Counter(self._free).items() if c > 1)
            raise AssertionError(f"free list holds blocks {dupes} more than once")
        for block_id in self._free:
            if not 0 <= block_id < self.num_blocks:
                raise AssertionError(f"free list holds block {block_id}, outside the pool")
        for block_id, count in enumerate(self._ref_counts):
            if count < 0:
                raise AssertionError(f"block {block_id} has a negative reference count {count}")
            if count > 0 and block_id in free_set:
                raise AssertionError(f"block {block_id} is free but has {count} reference(s)")
            if count == 0 and block_id not in free_set:
                raise AssertionError(f"block {block_id} has no reference but is not free (leaked)")
        referenced = sum(1 for count in self._ref_counts if count > 0)
        if len(self._free) + referenced != self.num_blocks:
            raise AssertionError(f"{len(self._free)} free + {referenced} referenced != {self.num_blocks} blocks")

    def _check_id(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"KV block id {block_id} is outside the pool of {self.num_blocks} blocks")

    def __repr__(self) -> str:
        return f"BlockPool(num_blocks={self.num_blocks}, block_size={self.block_size}, free={self.num_free_blocks})"


@dataclass(slots=True)
class BlockTable:
    """One sequence's logical -> physical block map: logical block ``i`` is ``block_ids[i]``.

    The table holds one reference on each of its blocks (taken by ``ensure_capacity``, or by
    the caller with ``pool.fork`` when it starts the table from shared blocks).
    """

    block_ids: list[int] = field(default_factory=list)

    def ensure_capacity(self, pool: BlockPool, num_tokens: int) -> bool:
        """Grow the table so that ``num_tokens`` tokens fit; ``False``, unchanged, if the pool can't."""
        # student: begin chapter 04: grow the table so num_tokens fit, or return False unchanged
        missing = num_blocks_for(num_tokens, pool.block_size) - len(self.block_ids)
        if missing <= 0:
            return True
        if not pool.can_allocate(missing):
            return False
        self.block_ids.extend(pool.allocate(missing))
        return True
        # student: end

    def shrink(self, pool: BlockPool, num_tokens: int) -> None:
        """Give back the blocks beyond what ``num_tokens`` tokens need (speculative slots a
        step reserved but did not keep, chapter 10)."""
        # student: begin chapter 04: give back the blocks beyond what num_tokens need
        keep = num_blocks_for(num_tokens, pool.block_size)
        if len(self.block_ids) > keep:
            pool.free(self.block_ids[keep:])
            del self.block_ids[keep:]
        # student: end

    def release(self, pool: BlockPool) -> None:
        """Drop this table's reference on every block; shared blocks stay alive for their other owners."""
        # student: begin chapter 04: drop the table's reference on every block and empty it
        pool.free(self.block_ids)
        self.block_ids = []
        # student: end

    def slots(self, start: int, end: int, block_size: int) -> list[int]:
        """Pool slots of logical positions ``start, ..., end - 1`` (``slot_mapping`` of this table)."""
        return slot_mapping(self.block_ids, start, end, block_size)
