"""Chapter 08's exercises answered wrongly, as a student plausibly would (see scripts/wrong_answers.py)."""

WRONG_ANSWERS = {
    "cached-prefix-solution": [
        # The longest common prefix, not cut down to whole blocks: a partial block "matches".
        """
best = 0
for tokens in inserted:
    n = 0
    while n < min(len(tokens), len(prompt)) and tokens[n] == prompt[n]:
        n += 1
    best = max(best, n)
return best
""",
        # Only the sequence inserted last is compared, as if each insert replaced the one before.
        """
best = 0
for tokens in inserted[-1:]:
    n = 0
    while n < min(len(tokens), len(prompt)) and tokens[n] == prompt[n]:
        n += 1
    best = n - n % block_size
return best
""",
        # Rounds the matched tokens up to whole blocks instead of down.
        """
best = 0
for tokens in inserted:
    n = 0
    while n < min(len(tokens), len(prompt)) and tokens[n] == prompt[n]:
        n += 1
    best = max(best, min(-(-n // block_size) * block_size, len(prompt)))
return best
""",
        # Builds the package's RadixCache and asks it: the exercise asks for the rule itself.
        """
pool = BlockPool(64, block_size)
cache = RadixCache(pool)
for tokens in inserted:
    blocks = pool.allocate(len(tokens) // block_size)
    cache.insert(tokens, blocks)
    pool.free(blocks)
return cache.match_prefix(prompt).num_tokens
""",
    ],
    "eviction-victim-solution": [
        # Most recently used leaf first.
        """
parents = {n.parent_id for n in nodes}
leaves = [n for n in nodes if n.parent_id is not None and n.node_id not in parents]
for leaf in sorted(leaves, key=lambda n: n.last_access, reverse=True):
    if ref_count(leaf.block_ids[-1]) == 1:
        return leaf.block_ids[-1]
return None
""",
        # Forgets the reference count: a block a running request still holds is "evicted".
        """
parents = {n.parent_id for n in nodes}
leaves = [n for n in nodes if n.parent_id is not None and n.node_id not in parents]
for leaf in sorted(leaves, key=lambda n: n.last_access):
    return leaf.block_ids[-1]
return None
""",
        # Every node but the root is a candidate, not only the leaves.
        """
for node in sorted((n for n in nodes if n.parent_id is not None), key=lambda n: n.last_access):
    if ref_count(node.block_ids[-1]) == 1:
        return node.block_ids[-1]
return None
""",
        # The leaf's first block instead of its last: the tree would lose a block in its middle.
        """
parents = {n.parent_id for n in nodes}
leaves = [n for n in nodes if n.parent_id is not None and n.node_id not in parents]
for leaf in sorted(leaves, key=lambda n: n.last_access):
    if ref_count(leaf.block_ids[0]) == 1:
        return leaf.block_ids[0]
return None
""",
    ],
}
