"""A request's life inside the engine (chapter 06).

A ``Sequence`` is one request: its prompt, the tokens generated so far, how many of those
tokens already have their K/V in the cache (``num_computed_tokens``) and the block table that
says where. Its status moves

    WAITING --schedule--> RUNNING --finish--> FINISHED
       ^                     |
       +------preempt--------+   (blocks freed, K/V recomputed when it runs again)

Invariant: ``num_computed_tokens <= len(token_ids)``, always (the engine finds stops before
the scheduler appends tokens, so a token cut by a stop never enters ``token_ids``); the tokens
still to compute are ``token_ids[num_computed_tokens:]`` (the whole prompt at first, then one new
token per decode step). Preemption keeps ``token_ids`` (nothing generated is lost) and resets
what is computed to nothing (the block bookkeeping, ``kv.block_manager``, frees the blocks and
resets the count), so the recompute sees prompt and output as one longer prompt.

A sequence holds what this chapter needs and nothing a later chapter adds: later chapters keep
their per-request state in their own components, keyed by the sequence.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mini_infer.kv.block_pool import BlockTable
from mini_infer.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class _WeaklyReferable:
    # Later chapters key their per-request state by the sequence, weakly, so that it goes with
    # the request (``weakref.WeakKeyDictionary``); a slotted dataclass needs the slot declared.
    __slots__ = ("__weakref__",)


@dataclass(slots=True, eq=False)
class Sequence(_WeaklyReferable):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: int  # submission order: lower runs first and is preempted last
    generator: torch.Generator | None = None  # a seeded request's own random stream
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_table: BlockTable = field(default_factory=BlockTable)
    status: SequenceStatus = SequenceStatus.WAITING

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        """More than one token still to compute: a prompt (or a recompute after preemption)."""
        return self.num_uncomputed_tokens > 1

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
