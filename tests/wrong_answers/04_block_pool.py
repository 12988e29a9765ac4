"""Chapter 04's exercises answered wrongly, as a student plausibly would (see scripts/wrong_answers.py)."""

WRONG_ANSWERS = {
    "table-from-slots-solution": [
        # Reads the first slot of every block and checks nothing: impossible slot lists get a table.
        "return [slot // block_size for slot in slots[::block_size]]",
        # Checks the offsets only: a block spread over two physical blocks, or used twice, passes.
        """
for position, slot in enumerate(slots):
    if slot % block_size != position % block_size:
        raise ValueError(f"token {position} sits at the wrong offset")
return [slot // block_size for slot in slots[::block_size]]
""",
        # Floor instead of ceiling: the last, partly filled block is left out of the table.
        """
table = []
for position, slot in enumerate(slots):
    block, offset = divmod(slot, block_size)
    if offset != position % block_size:
        raise ValueError(f"token {position} sits at the wrong offset")
    if position % block_size == 0:
        if block in table:
            raise ValueError(f"block {block} serves two logical blocks")
        table.append(block)
    elif block != table[-1]:
        raise ValueError(f"logical block {position // block_size} is spread over two blocks")
return table[: len(slots) // block_size]
""",
        # One table entry per token instead of per block.
        """
for position, slot in enumerate(slots):
    if slot % block_size != position % block_size:
        raise ValueError(f"token {position} sits at the wrong offset")
return [slot // block_size for slot in slots]
""",
    ],
    "refcount-fork-solution": [
        # Checks and counts in one loop: a refused fork has already added references to earlier blocks.
        """
for b in block_ids:
    if pool.ref[b] == 0:
        raise ValueError(f"cannot fork block {b}: it is free")
    pool.ref[b] += 1
""",
        # Never checks: forking a free block gives it an owner while it stays on the free list.
        """
for b in block_ids:
    pool.ref[b] += 1
""",
        # Forks each block once however often it is listed (a set drops the repeats).
        """
for b in set(block_ids):
    if pool.ref[b] == 0:
        raise ValueError(f"cannot fork block {b}: it is free")
for b in set(block_ids):
    pool.ref[b] += 1
""",
    ],
    "refcount-free-solution": [
        # Checks each block alone, not its drops per call: freeing [a, a] with one reference passes.
        """
for b in block_ids:
    if pool.ref[b] == 0:
        raise ValueError(f"double free of block {b}")
for b in reversed(block_ids):
    pool.ref[b] -= 1
    if pool.ref[b] == 0:
        pool.free_list.append(b)
""",
        # Forgets to put a block whose count reaches 0 back on the free list.
        """
for b, drops in Counter(block_ids).items():
    if drops > pool.ref[b]:
        raise ValueError(f"double free of block {b}")
for b in block_ids:
    pool.ref[b] -= 1
""",
        # Frees in the given order: the blocks come back in the wrong order (not last in, first out).
        """
for b, drops in Counter(block_ids).items():
    if drops > pool.ref[b]:
        raise ValueError(f"double free of block {b}")
for b in block_ids:
    pool.ref[b] -= 1
    if pool.ref[b] == 0:
        pool.free_list.append(b)
""",
        # Checks while freeing: a refused free has already dropped the earlier blocks' references.
        """
for b in reversed(block_ids):
    if pool.ref[b] == 0:
        raise ValueError(f"double free of block {b}")
    pool.ref[b] -= 1
    if pool.ref[b] == 0:
        pool.free_list.append(b)
""",
    ],
    "paged-waste-solution": [
        # Floor division: the partly filled last block of each sequence is not counted.
        """
allocated = sum(n // block_size for n in lengths) * block_size
return (allocated - sum(lengths)) / allocated if allocated else 0.0
""",
        # One block more than the floor: a sequence that fills its blocks exactly gets an extra one.
        """
allocated = sum(n // block_size + 1 for n in lengths) * block_size
return (allocated - sum(lengths)) / allocated if allocated else 0.0
""",
        # Divides by zero when nothing is allocated.
        """
allocated = sum(-(-n // block_size) for n in lengths) * block_size
return 1 - sum(lengths) / allocated
""",
        # Calls the package's own count.
        "return kv_cache_waste(lengths, block_size).paged_waste",
    ],
}
