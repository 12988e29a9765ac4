"""A radix tree over token ids that shares the KV blocks of common prefixes (chapter 08).

Chat traffic repeats itself: every request of an app starts with the same system prompt, every
turn of a conversation starts with the previous turns. The KV of a prefix depends only on the
prefix, so a request whose prompt starts with tokens already computed can reuse their blocks
and compute only the rest. This module keeps those blocks in a radix tree keyed by token ids.

Granularity is the KV block: a node holds a run of whole blocks (``len(token_ids) ==
len(block_ids) * block_size``), nodes split only at block boundaries, and a match counts whole
blocks only. A partly filled block is never shared, so nobody ever writes into a shared block.

References. The tree holds exactly one reference (``pool.fork``) on each block it caches.
``match_prefix`` takes none: the caller forks the matched blocks to keep them alive while it
uses them, and frees them (e.g. ``BlockTable.release``) when done. ``insert`` keeps the tree's
own blocks for the part already cached (the caller's duplicates are left alone, still owned by
the caller) and takes one reference on the caller's blocks for the new part.

Eviction. A block whose reference count is 1 is held only by the tree and can be freed.
``evict`` trims leaves from their end, block by block, least recently used leaf first, so a
node is freed only after all its descendants are. A block still used by a sequence (count > 1)
is never evicted, nor is anything above it. Recency is a counter bumped on every
``match_prefix`` and ``insert``, not wall-clock time, so runs are deterministic. A match splits
a node at the end of the match so that only the matched blocks count as used (the unmatched
tail keeps its older time and is evicted first).

Invariants (``check_invariants`` asserts them; the tests call it after every step):

* every node but the root holds >= 1 block and ``block_size`` tokens per block; a child is
  keyed in its parent by the tokens of its first block, so siblings differ in their first block;
* every block in the tree appears once and has pool reference count >= 1 (the tree's own);
* a parent was used no earlier than any of its children (each touch covers a path from the root);
* the pool's count: free + held by sequences + held only by the tree == total blocks.

Nodes are never merged back after an eviction leaves a parent with one child: the tree stays
correct, a lookup just walks one more node.
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from mini_infer.kv.block_pool import BlockPool

__all__ = ["PrefixMatch", "RadixCache", "RadixNodeView"]


class PrefixMatch(NamedTuple):
    """The longest cached prefix: its blocks (not yet referenced by the caller) and its length."""

    block_ids: list[int]
    num_tokens: int


@dataclass(frozen=True, slots=True)
class RadixNodeView:
    """One node of the tree as ``RadixCache.nodes`` shows it (for pictures and tests).

    ``node_id`` is stable for the node's life; the root is node 0, with no tokens and
    ``parent_id`` None. ``last_access`` is the value of the cache's use counter when the node
    was last matched or inserted (larger is more recent).
    """

    node_id: int
    parent_id: int | None
    token_ids: tuple[int, ...]
    block_ids: tuple[int, ...]
    last_access: int


@dataclass(eq=False, slots=True)
class _Node:
    node_id: int
    token_ids: list[int]  # len(token_ids) == len(block_ids) * block_size; both empty at the root
    block_ids: list[int]
    parent: _Node | None
    last_access: int = 0
    # Keyed by the tokens of the child's first block: nodes split at block boundaries, so two
    # children of one node always differ somewhere in their first block.
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)


class RadixCache:
    """Prefix cache of KV blocks, shared through the reference counts of a ``BlockPool``."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self._next_id = 1
        self._clock = 0
        self._root = _Node(node_id=0, token_ids=[], block_ids=[], parent=None)
        self._held: set[int] = set()  # every block id the tree holds a reference on

    # -- lookups ------------------------------------------------------------------------------

    def match_prefix(self, token_ids: Sequence[int]) -> PrefixMatch:
        """Longest cached prefix of ``token_ids`` in whole blocks; marks it as used.

        Takes no reference: call ``pool.fork(match.block_ids)`` before anything can evict
        (in particular before ``evict`` makes room for the rest of the sequence). Pass the
        prompt without its last token, so that at least one token is computed and yields logits.
        A node matched only in part is split where the match ends.
        """
        # student: begin chapter 08: the longest cached prefix in whole blocks, marked as used
        path, num_tokens = self._descend(list(token_ids))
        self._touch(path)
        return PrefixMatch([b for node in path for b in node.block_ids], num_tokens)
        # student: end

    def peek(self, token_ids: Sequence[int]) -> PrefixMatch:
        """What ``match_prefix`` would return, changing nothing: no recency, no split."""
        path, num_tokens = self._descend(list(token_ids), split=False)
        blocks = [b for node in path for b in node.block_ids]
        if len(blocks) * self.block_size < num_tokens:  # the node matched in part, left out of the path
            start = len(blocks) * self.block_size
            node = (path[-1] if path else self._root).children[tuple(token_ids[start : start + self.block_size])]
            blocks += node.block_ids[: (num_tokens - start) // self.block_size]
        return PrefixMatch(blocks, num_tokens)

    def insert(self, token_ids: Sequence[int], block_ids: Sequence[int]) -> int:
        """Cache ``token_ids`` (whole blocks, held in ``block_ids``); return the tokens newly cached.

        Pass only tokens whose KV is written, cut to whole blocks: for a finished sequence,
        every token but the last sampled one. The caller keeps its own references.
        """
        # student: begin chapter 08: cache whole blocks of tokens under their prefix; return the tokens newly cached
        tokens, blocks = list(token_ids), list(block_ids)
        bs = self.block_size
        if len(tokens) != len(blocks) * bs:
            raise ValueError(f"insert needs whole blocks: {len(tokens)} tokens for {len(blocks)} blocks of {bs}")
        # A dry run first, so that a bad call changes nothing (not even a split).
        _, cached = self._descend(tokens, split=False)
        new_blocks = blocks[cached // bs :]
        if new_blocks:
            # A block holds the KV of one position of one prefix: finding it cached under
            # another prefix means the caller's block table is wrong, and the tree would hold
            # two references it could never give back by eviction.
            already = sorted(set(new_blocks) & self._held)
            if already:
                raise ValueError(f"blocks {already} are already cached under another prefix")
            if len(set(new_blocks)) != len(new_blocks):
                raise ValueError(f"block ids repeat in {new_blocks}")
            self.pool.fork(new_blocks)  # raises, changing nothing, if a block is free
        path, cached = self._descend(tokens)
        if new_blocks:
            parent = path[-1] if path else self._root
            leaf = self._new_node(tokens[cached:], new_blocks, parent)
            parent.children[tuple(leaf.token_ids[:bs])] = leaf
            self._held.update(new_blocks)
            path.append(leaf)
        self._touch(path)
        return len(new_blocks) * bs
        # student: end

    # -- eviction -----------------------------------------------------------------------------

    def evict(self, num_blocks: int) -> int:
        """Free up to ``num_blocks`` blocks held only by the tree, LRU leaves first; return how many."""
        # student: begin chapter 08: free up to num_blocks blocks held only by the tree, LRU leaves first
        if num_blocks < 0:
            raise ValueError(f"cannot evict a negative number of blocks ({num_blocks})")
        bs = self.block_size
        # Ties are impossible (one touch marks one root path, and only one node of a path can
        # be a leaf); node_id only keeps the heap from comparing nodes.
        heap = [(n.last_access, n.node_id, n) for n in self._iter_nodes() if n is not self._root and not n.children]
        heapq.heapify(heap)
        freed: list[int] = []
        while heap and len(freed) < num_blocks:
            _, _, node = heapq.heappop(heap)
            key = tuple(node.token_ids[:bs])
            # Trim from the end: a block is reachable only through every block before it, so
            # cutting from the end never strands one.
            while node.block_ids and len(freed) < num_blocks and self.pool.ref_count(node.block_ids[-1]) == 1:
                freed.append(node.block_ids.pop())
                del node.token_ids[-bs:]
            if node.block_ids:
                continue  # pinned by a sequence, or the quota is met: the node stays
            parent = node.parent
            assert parent is not None
            del parent.children[key]
            if parent is not self._root and not parent.children:
                heapq.heappush(heap, (parent.last_access, parent.node_id, parent))
        self._held.difference_update(freed)
        self.pool.free(freed)
        return len(freed)
        # student: end

    @property
    def num_cached_blocks(self) -> int:
        return len(self._held)

    def cached_block_ids(self) -> set[int]:
        """Every block the tree holds a reference on."""
        return set(self._held)

    @property
    def num_evictable_blocks(self) -> int:
        """Blocks ``evict`` could free right now (held only by the tree, nothing in use below)."""
        return self.num_evictable()

    def num_evictable(self, in_use: Collection[int] = ()) -> int:
        """Blocks ``evict`` could free once the blocks ``in_use`` are held by a sequence too."""
        in_use = set(in_use)
        evictable: dict[int, int] = {}
        fully: dict[int, bool] = {}  # the whole subtree would go
        for node in reversed(self._iter_nodes()):  # children before their parents
            count = sum(evictable[c.node_id] for c in node.children.values())
            if all(fully[c.node_id] for c in node.children.values()):
                tail = 0
                for block_id in reversed(node.block_ids):
                    if self.pool.ref_count(block_id) != 1 or block_id in in_use:
                        break
                    tail += 1
                count += tail
                fully[node.node_id] = tail == len(node.block_ids)
            else:
                fully[node.node_id] = False
            evictable[node.node_id] = count
        return evictable[self._root.node_id]

    def reset(self) -> None:
        """Drop every reference the tree holds and forget all prefixes."""
        self.pool.free([b for node in self._iter_nodes() for b in node.block_ids])
        self._root = _Node(node_id=0, token_ids=[], block_ids=[], parent=None)
        self._held.clear()

    # -- views and checks ---------------------------------------------------------------------

    def nodes(self) -> list[RadixNodeView]:
        """Every node, root first, parents before children (depth-first, children in insertion order)."""
        return [
            RadixNodeView(
                node_id=n.node_id,
                parent_id=None if n.parent is None else n.parent.node_id,
                token_ids=tuple(n.token_ids),
                block_ids=tuple(n.block_ids),
                last_access=n.last_access,
            )
            for n in self._iter_nodes()
        ]

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` when the tree's structure or its references are inconsistent."""
        bs = self.block_size
        root = self._root
        if root.token_ids or root.block_ids or root.parent is not None:
            raise AssertionError("the root must hold no tokens, no blocks and have no parent")
        seen: set[int] = set()
        for node in self._iter_nodes():
            for key, child in node.children.items():
                if child.parent is not node:
                    raise AssertionError(f"node {child.node_id}'s parent pointer is wrong")
                if tuple(child.token_ids[:bs]) != key:
                    raise AssertionError(f"node {child.node_id} is keyed by {key}, not its first block")
                if not child.block_ids or len(child.token_ids) != len(child.block_ids) * bs:
                    raise AssertionError(
                        f"node {child.node_id} holds {len(child.token_ids)} tokens in "
                        f"{len(child.block_ids)} blocks of {bs}"
                    )
                if node is not root and child.last_access > node.last_access:
                    raise AssertionError(f"node {child.node_id} was used after its parent {node.node_id}")
            for block_id in node.block_ids:
                if block_id in seen:
                    raise AssertionError(f"block {block_id} is cached twice")
                seen.add(block_id)
                if self.pool.ref_count(block_id) < 1:
                    raise AssertionError(f"cached block {block_id} is free in the pool")
        if seen != self._held:
            raise AssertionError(f"tree blocks {sorted(seen)} != held set {sorted(self._held)}")

    # -- internals ----------------------------------------------------------------------------

    def _descend(self, tokens: list[int], split: bool = True) -> tuple[list[_Node], int]:
        """The path of nodes matching ``tokens`` in whole blocks, and the tokens it covers.

        With ``split``, a node matched only in part is split at the end of the match, so the
        path covers exactly the matched blocks; without it (a dry run) that node is left out of
        the path, but its matched blocks still count in the tokens covered.
        """
        # student: begin chapter 08: walk the tree along tokens in whole blocks, splitting a node matched in part
        bs = self.block_size
        tokens = tokens[: len(tokens) - len(tokens) % bs]  # a partial last block never matches
        node, path, pos = self._root, [], 0
        while pos < len(tokens):
            child = node.children.get(tuple(tokens[pos : pos + bs]))
            if child is None:
                break
            run = child.token_ids
            if tokens[pos : pos + len(run)] == run:
                matched_blocks = len(child.block_ids)
            else:
                same = 0
                for a, b in zip(run, tokens[pos : pos + len(run)]):
                    if a != b:
                        break
                    same += 1
                matched_blocks = same // bs  # >= 1: the first block is the key that matched
            pos += matched_blocks * bs
            if matched_blocks < len(child.block_ids):
                if split:
                    path.append(self._split(child, matched_blocks))
                break
            path.append(child)
            node = child
        return path, pos
        # student: end

    def _split(self, node: _Node, num_blocks: int) -> _Node:
        """Cut ``node`` after ``num_blocks`` blocks; return the new upper node (``node`` keeps the rest)."""
        # student: begin chapter 08: cut a node after num_blocks blocks; return the new upper node
        bs = self.block_size
        parent = node.parent
        assert parent is not None and 0 < num_blocks < len(node.block_ids)
        key = tuple(node.token_ids[:bs])
        upper = self._new_node(node.token_ids[: num_blocks * bs], node.block_ids[:num_blocks], parent)
        upper.last_access = node.last_access
        del node.token_ids[: num_blocks * bs]
        del node.block_ids[:num_blocks]
        node.parent = upper
        upper.children[tuple(node.token_ids[:bs])] = node
        parent.children[key] = upper  # same key: the first block did not change
        return upper
        # student: end

    def _new_node(self, token_ids: list[int], block_ids: list[int], parent: _Node) -> _Node:
        node = _Node(node_id=self._next_id, token_ids=token_ids, block_ids=block_ids, parent=parent)
        self._next_id += 1
        return node

    def _touch(self, path: list[_Node]) -> None:
        self._clock += 1
        for node in path:
            node.last_access = self._clock

    def _iter_nodes(self) -> list[_Node]:
        """All nodes, parents before children (an explicit stack: the tree can be deep)."""
        out: list[_Node] = []
        stack = [self._root]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(reversed(node.children.values()))
        return out
