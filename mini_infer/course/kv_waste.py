"""How much KV memory a set of sequences wastes, paged against contiguous (chapter 04).

A teaching helper of chapters 03 and 04, which the engine never calls: it counts slots for the
chapters' pictures and exercises, from ``kv.block_pool.num_blocks_for``, the pool's own rule.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mini_infer.kv.block_pool import num_blocks_for


@dataclass(frozen=True, slots=True)
class KVWaste:
    """KV slots used and allocated by a set of sequences, paged against contiguous.

    ``used_slots``: tokens actually stored. ``paged_slots``: whole blocks the paged pool hands
    out (waste only in each sequence's last block). ``contiguous_slots``: a per-request cache
    reserved at the maximum length (waste everywhere after the sequence's end). A waste fraction
    is the share of allocated slots that hold no token.
    """

    used_slots: int
    paged_slots: int
    contiguous_slots: int

    @property
    def paged_waste(self) -> float:
        return _waste(self.used_slots, self.paged_slots)

    @property
    def contiguous_waste(self) -> float:
        return _waste(self.used_slots, self.contiguous_slots)


def _waste(used: int, allocated: int) -> float:
    return (allocated - used) / allocated if allocated else 0.0


def kv_cache_waste(token_counts: Sequence[int], block_size: int, contiguous_max_len: int | None = None) -> KVWaste:
    """Slots used and allocated for sequences of these lengths, paged and contiguous.

    ``contiguous_max_len`` is the length a contiguous cache reserves per request; by default the
    longest sequence here (the best a contiguous cache could do knowing the lengths in advance).
    """
    if any(n < 0 for n in token_counts):
        raise ValueError(f"token counts must be >= 0, got {list(token_counts)}")
    longest = max(token_counts, default=0)
    max_len = longest if contiguous_max_len is None else contiguous_max_len
    if max_len < longest:
        raise ValueError(f"contiguous_max_len {max_len} is shorter than the longest sequence ({longest} tokens)")
    return KVWaste(
        used_slots=sum(token_counts),
        paged_slots=sum(num_blocks_for(n, block_size) for n in token_counts) * block_size,
        contiguous_slots=len(token_counts) * max_len,
    )
