"""Chapter 05's exercises answered wrongly, as a student plausibly would (see scripts/wrong_answers.py)."""

WRONG_ANSWERS = {
    "overwritten-solution": [
        # Flags any slot another sequence also reads: prefix sharing, which is fine, counts as a clash.
        """
users: dict[int, set[int]] = {}
for i, (table, start, end) in enumerate(chunks):
    if not 0 <= start < end <= len(table) * block_size:
        raise ValueError(f"sequence {i}: bad chunk")
    for p in range(end):
        users.setdefault(table[p // block_size] * block_size + p % block_size, set()).add(i)
return sorted(
    (i, p)
    for i, (table, _, end) in enumerate(chunks)
    for p in range(end)
    if users[table[p // block_size] * block_size + p % block_size] - {i}
)
""",
        # Checks only the positions a sequence writes itself: misses the cached keys another sequence overwrites.
        """
writers: dict[int, set[int]] = {}
for i, (table, start, end) in enumerate(chunks):
    if not 0 <= start < end <= len(table) * block_size:
        raise ValueError(f"sequence {i}: bad chunk")
    for p in range(start, end):
        writers.setdefault(table[p // block_size] * block_size + p % block_size, set()).add(i)
return sorted(
    (i, p)
    for i, (table, start, end) in enumerate(chunks)
    for p in range(start, end)
    if writers[table[p // block_size] * block_size + p % block_size] - {i}
)
""",
        # Works by blocks: every position read in a block another sequence writes into, even in slots nobody writes.
        """
writers: dict[int, set[int]] = {}
for i, (table, start, end) in enumerate(chunks):
    if not 0 <= start < end <= len(table) * block_size:
        raise ValueError(f"sequence {i}: bad chunk")
    for p in range(start, end):
        writers.setdefault(table[p // block_size], set()).add(i)
return sorted(
    (i, p)
    for i, (table, _, end) in enumerate(chunks)
    for p in range(end)
    if writers.get(table[p // block_size], set()) - {i}
)
""",
        # Reads only the cached positions (range(start)): two sequences writing one slot go unnoticed.
        """
writers: dict[int, set[int]] = {}
for i, (table, start, end) in enumerate(chunks):
    if not 0 <= start < end <= len(table) * block_size:
        raise ValueError(f"sequence {i}: bad chunk")
    for p in range(start, end):
        writers.setdefault(table[p // block_size] * block_size + p % block_size, set()).add(i)
return sorted(
    (i, p)
    for i, (table, start, _) in enumerate(chunks)
    for p in range(start)
    if writers.get(table[p // block_size] * block_size + p % block_size, set()) - {i}
)
""",
        # Calls the package's own slot mapping.
        """
from mini_infer.kv.block_pool import slot_mapping as package_slot_mapping

writers: dict[int, set[int]] = {}
for i, (table, start, end) in enumerate(chunks):
    if not 0 <= start < end <= len(table) * block_size:
        raise ValueError(f"sequence {i}: bad chunk")
    for slot in package_slot_mapping(table, start, end, block_size):
        writers.setdefault(slot, set()).add(i)
return sorted(
    (i, p)
    for i, (table, _, end) in enumerate(chunks)
    for p, slot in enumerate(package_slot_mapping(table, 0, end, block_size))
    if writers.get(slot, set()) - {i}
)
""",
    ],
    "group-mask-solution": [
        # Strict inequality: a query does not see its own key.
        """
max_blocks = max(-(-n // block_size) for n in context_lens)
last_visible = torch.tensor(context_lens)[:, None] - num_queries + torch.arange(num_queries)[None, :]
return torch.arange(max_blocks * block_size)[None, None, :] < last_visible[:, :, None]
""",
        # Ignores the query's place: every query of a sequence sees its whole context, later guesses included.
        """
max_blocks = max(-(-n // block_size) for n in context_lens)
keys = torch.arange(max_blocks * block_size)[None, None, :]
return (keys < torch.tensor(context_lens)[:, None, None]).expand(-1, num_queries, -1)
""",
        # Floor instead of ceiling for the number of blocks: the last, partly filled block has no columns.
        """
max_blocks = max(n // block_size for n in context_lens)
last_visible = torch.tensor(context_lens)[:, None] - num_queries + torch.arange(num_queries)[None, :]
return torch.arange(max_blocks * block_size)[None, None, :] <= last_visible[:, :, None]
""",
        # Builds it from the package's causal_mask, one sequence at a time.
        """
width = max(-(-n // block_size) for n in context_lens) * block_size
mask = torch.zeros(len(context_lens), num_queries, width, dtype=torch.bool)
for b, n in enumerate(context_lens):
    mask[b, :, :n] = causal_mask(num_queries, n)
return mask
""",
    ],
    "gather-keys-solution": [
        # Keeps whole blocks: the slots after context_len in the last block come along.
        """
kv_heads, _, block_size, head_dim = pool.shape
used = block_table[: -(-context_len // block_size)]
blocks = pool[:, torch.tensor(used, dtype=torch.long)]
return blocks.reshape(kv_heads, -1, head_dim).transpose(0, 1)
""",
        # Leaves the heads in front: [kv_heads, context_len, head_dim], not the model's layout.
        """
kv_heads, _, block_size, head_dim = pool.shape
used = block_table[: -(-context_len // block_size)]
blocks = pool[:, torch.tensor(used, dtype=torch.long)]
return blocks.reshape(kv_heads, -1, head_dim)[:, :context_len]
""",
        # Reshapes to tokens first without moving the head axis: the right shape, the numbers scrambled.
        """
kv_heads, _, block_size, head_dim = pool.shape
used = block_table[: -(-context_len // block_size)]
blocks = pool[:, torch.tensor(used, dtype=torch.long)]
return blocks.reshape(-1, kv_heads, head_dim)[:context_len]
""",
        # Calls the package's own gather.
        """
kv_heads, num_blocks = pool.shape[:2]
rows = _pool_rows(torch.tensor(block_table), kv_heads, num_blocks)
return _gather(pool, rows)[:, :context_len].transpose(0, 1)
""",
    ],
    "graph-key-solution": [
        # Rounds the width up to a power of two without the cap at max_model_len's blocks.
        """
sizes = sorted({b for b in (1, 2, 4, 8) if b < max_num_seqs} | set(range(16, max_num_seqs, 16)) | {max_num_seqs})
size = next(b for b in sizes if b >= len(context_lens))
used = max(-(-n // block_size) for n in context_lens)
width = 1
while width < used:
    width *= 2
return query_len, size, width
""",
        # Rounds the batch up to a power of two too, instead of to a captured size.
        """
size = 1
while size < len(context_lens):
    size *= 2
used = max(-(-n // block_size) for n in context_lens)
width = 1
while width < used:
    width *= 2
return query_len, size, min(width, -(-max_model_len // block_size))
""",
        # Uses the blocks of the longest context as the width, without rounding to a power of two.
        """
sizes = sorted({b for b in (1, 2, 4, 8) if b < max_num_seqs} | set(range(16, max_num_seqs, 16)) | {max_num_seqs})
size = next(b for b in sizes if b >= len(context_lens))
used = max(-(-n // block_size) for n in context_lens)
return query_len, size, min(used, -(-max_model_len // block_size))
""",
        # Asks the package for the captured batch sizes.
        """
size = next(b for b in captured_batch_sizes(max_num_seqs) if b >= len(context_lens))
used = max(-(-n // block_size) for n in context_lens)
width = 1
while width < used:
    width *= 2
return query_len, size, min(width, -(-max_model_len // block_size))
""",
    ],
    "padding-rows-solution": [
        # Every padding token at position 0: forgets that a row holds query_len tokens at 0 .. query_len - 1.
        """
positions = [0] * (query_len * (size - num_seqs))
return positions, [null_block * block_size + p for p in positions]
""",
        # Slots in block 0 instead of the null block.
        """
positions = list(range(query_len)) * (size - num_seqs)
return positions, positions
""",
        # Pads size rows instead of the size - num_seqs rows left after the real ones.
        """
positions = list(range(query_len)) * size
return positions, [null_block * block_size + p for p in positions]
""",
        # Lists position by position across rows instead of row after row.
        """
positions = [p for p in range(query_len) for _ in range(size - num_seqs)]
return positions, [null_block * block_size + p for p in positions]
""",
    ],
}
