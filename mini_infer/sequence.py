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
what is computed to nothing (``reset_computed``), so the recompute sees prompt and output as one
longer prompt.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from mini_infer.kv.block_pool import BlockTable
from mini_infer.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: int  # submission order: lower runs first and is preempted last
    generator: torch.Generator | None = None  # a seeded request's own random stream
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_prompt_tokens: int = 0  # prompt tokens served by the prefix cache (chapter 08)
    num_blocks_offered: int = 0  # leading full blocks already offered to the prefix cache
    # Speculative decoding (chapter 10): computed tokens whose K/V the draft model's cache lacks
    # (0, or 1 after a step that kept every guess). Set by the speculative decoder alone.
    draft_lag: int = 0
    # Constrained decoding (chapter 09b): the grammar's state, made and advanced by it alone from
    # ``output_token_ids`` (so a preempted sequence, whose tokens are kept, needs nothing rebuilt).
    grammar_state: Any = None
    was_admitted: bool = False  # has run at least once (prefix-cache statistics count the first time)
    block_table: BlockTable = field(default_factory=BlockTable)
    status: SequenceStatus = SequenceStatus.WAITING
    parent: Sequence | None = None  # for the n choices of one request: shares its prompt blocks
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or token id that finished it

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

    def reset_computed(self, num_tokens: int, block_size: int) -> None:
        """The pools now hold the K/V of the first ``num_tokens`` tokens, in every model's cache
        (0 after a preemption; a shared prefix at admission, whose blocks are already cached)."""
        self.num_computed_tokens = num_tokens
        self.num_blocks_offered = num_tokens // block_size
        self.draft_lag = 0
