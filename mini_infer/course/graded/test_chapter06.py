"""Graded tests (chapter 06): the scheduler's step, ``Scheduler.schedule``'s three loops.

A step runs decodes first, then prefill chunks of running sequences, then waiting requests in
arrival order, all inside the token budget and ``max_num_seqs``. The hand-written cases check one
rule each; the random workloads compare every step's schedule with a model of the policy kept
here (its own counters, not the scheduler's) and every request's output with what a run without
any pressure gives. No tensors: a fake model's "next token" is a function of the sequence.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Collection
from collections.abc import Sequence as Seq

import pytest
from graded_fake_engine import check_unpressured_outputs, expected_output, fake_step, fake_token, ids, random_requests

from mini_infer.kv.block_pool import BlockPool
from mini_infer.sampling_params import SamplingParams
from mini_infer.scheduler import Scheduler
from mini_infer.sequence import Sequence, SequenceStatus

BS = 4  # tokens per block


class WholeBlockPrefixCache:
    """The scheduler's ``PrefixCache``, as small as it gets: whole blocks keyed by every token up to
    the block's end, one reference held per cached block, nothing evicted. Chapter 08 builds the
    real one (the radix tree); this chapter's grade must not depend on a later chapter's code."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.blocks: dict[tuple[int, ...], int] = {}  # tokens up to a block's end -> that block

    def match_prefix(self, token_ids: Seq[int]) -> tuple[list[int], int]:
        found: list[int] = []
        for end in range(BS, len(token_ids) + 1, BS):
            block = self.blocks.get(tuple(token_ids[:end]))
            if block is None:
                break
            found.append(block)
        return found, len(found) * BS

    def insert(self, token_ids: Seq[int], block_ids: Seq[int]) -> int:
        new = 0
        for i, block in enumerate(block_ids):
            key = tuple(token_ids[: (i + 1) * BS])
            if key not in self.blocks:
                self.pool.fork([block])
                self.blocks[key] = block
                new += BS
        return new

    def peek(self, token_ids: Seq[int]) -> tuple[list[int], int]:
        return self.match_prefix(token_ids)  # nothing to mark as used, nothing to split

    def evict(self, num_blocks: int) -> int:
        return 0

    def num_evictable(self, in_use: Collection[int] = ()) -> int:
        return 0

    def cached_block_ids(self) -> set[int]:
        return set(self.blocks.values())


def make(num_blocks: int = 64, budget: int = 64, max_seqs: int = 8, cache: bool = False) -> Scheduler:
    pool = BlockPool(num_blocks, block_size=BS)
    return Scheduler(
        pool,
        max_num_batched_tokens=budget,
        max_num_seqs=max_seqs,
        max_model_len=10_000,
        prefix_cache=WholeBlockPrefixCache(pool) if cache else None,
    )


ARRIVALS = itertools.count()  # submission order across the file: only the order matters


def add(
    scheduler: Scheduler, name: str, prompt: list[int], max_tokens: int = 8, fork_of: Sequence | None = None
) -> Sequence:
    seq = Sequence(name, prompt, SamplingParams(max_tokens=max_tokens), arrival=next(ARRIVALS))
    scheduler.add(seq, fork_of=fork_of)
    return seq


def step(scheduler: Scheduler) -> list[tuple[str, int]]:
    """One engine step with the fake model; returns what was scheduled, (request id, new tokens)."""
    return [(s.seq.request_id, s.num_new_tokens) for s in fake_step(scheduler).scheduled]


@pytest.mark.points(2)
def test_one_request_is_prefilled_then_decoded_one_token_a_step():
    scheduler = make()
    seq = add(scheduler, "a", [1, 2, 3, 4, 5], max_tokens=3)
    assert step(scheduler) == [("a", 5)]
    assert seq.status is SequenceStatus.RUNNING and seq.num_output_tokens == 1
    assert step(scheduler) == [("a", 1)]
    assert step(scheduler) == [("a", 1)]
    assert seq.status is SequenceStatus.FINISHED and seq.output_token_ids == expected_output([1, 2, 3, 4, 5], 3)
    assert not scheduler.has_unfinished and scheduler.schedule().is_empty


@pytest.mark.points(3)
def test_decodes_first_then_prefill_chunks_then_new_requests():
    scheduler = make(budget=8)
    add(scheduler, "a", [1, 2, 3], max_tokens=20)
    assert step(scheduler) == [("a", 3)]
    add(scheduler, "b", list(range(20)), max_tokens=20)
    add(scheduler, "c", [7, 7], max_tokens=20)
    # a decodes; b's prompt is cut to what is left of the budget; nothing is left for c.
    assert step(scheduler) == [("a", 1), ("b", 7)]
    assert ids(scheduler.waiting) == ["c"]
    assert step(scheduler) == [("a", 1), ("b", 7)]
    # b's last chunk (6 tokens) leaves 1 token of budget: c starts with a chunk of one token.
    assert step(scheduler) == [("a", 1), ("b", 6), ("c", 1)]
    # b decodes now, and c has one token left to compute: three decodes, in arrival order.
    assert step(scheduler) == [("a", 1), ("b", 1), ("c", 1)]


@pytest.mark.points(2)
def test_a_decode_is_never_delayed_by_a_long_prompt():
    scheduler = make(budget=6)
    add(scheduler, "short", [5], max_tokens=6)
    add(scheduler, "long", list(range(30)), max_tokens=4)
    assert step(scheduler) == [("short", 1), ("long", 5)]
    for _ in range(5):
        assert step(scheduler) == [("short", 1), ("long", 5)]
    assert step(scheduler) == [("long", 1)]  # short finished its 6 tokens; long samples its first


@pytest.mark.points(2)
def test_when_the_budget_runs_out_the_rest_wait_for_the_next_step():
    scheduler = make(budget=8)
    for name in "abc":
        add(scheduler, name, [1, 2], max_tokens=6)
    assert step(scheduler) == [("a", 2), ("b", 2), ("c", 2)]
    scheduler.max_num_batched_tokens = 2  # the budget is read every step
    assert step(scheduler) == [("a", 1), ("b", 1)]  # c gets nothing (not a chunk of 0 tokens)
    scheduler.max_num_batched_tokens = 1
    assert step(scheduler) == [("a", 1)]
    scheduler.max_num_batched_tokens = 3
    assert step(scheduler) == [("a", 1), ("b", 1), ("c", 1)]


@pytest.mark.points(2)
def test_max_num_seqs_bounds_the_running_batch():
    scheduler = make(max_seqs=2)
    for name in "abc":
        add(scheduler, name, [1, 2], max_tokens=2)
    assert step(scheduler) == [("a", 2), ("b", 2)]
    assert ids(scheduler.waiting) == ["c"] and len(scheduler.running) == 2
    assert step(scheduler) == [("a", 1), ("b", 1)]  # both finish in this step
    assert step(scheduler) == [("c", 2)]


@pytest.mark.points(2)
def test_the_queue_is_first_come_first_served_when_blocks_run_short():
    scheduler = make(num_blocks=4, budget=64)
    add(scheduler, "a", list(range(9)), max_tokens=2)  # 3 blocks
    add(scheduler, "b", list(range(8)), max_tokens=1)  # 2 blocks: does not fit beside a
    add(scheduler, "c", [1, 2], max_tokens=1)  # 1 block: would fit, but must not overtake b
    assert step(scheduler) == [("a", 9)]
    b = scheduler.waiting[0]
    assert ids(scheduler.waiting) == ["b", "c"]
    assert b.block_table.block_ids == [] and b.num_computed_tokens == 0  # it waits holding nothing
    assert step(scheduler) == [("a", 1)]  # a finishes, its blocks come back
    assert step(scheduler) == [("b", 8), ("c", 2)]  # b's whole prompt, from its first token


@pytest.mark.points(2)
def test_a_step_that_preempts_admits_nobody():
    scheduler = make(num_blocks=7, budget=5)
    for name in "abc":
        add(scheduler, name, list(range(7)), max_tokens=10)
    assert step(scheduler) == [("a", 5)]
    assert step(scheduler) == [("a", 2), ("b", 3)]
    assert step(scheduler) == [("a", 1), ("b", 4)]
    assert step(scheduler) == [("a", 1), ("b", 1), ("c", 3)]
    out = scheduler.schedule()  # c's next chunk needs a block: c, the latest arrival, gives its own up
    assert [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 1)]
    assert ids(out.preempted) == ["c"]
    # Budget and a free block are left, but c goes back only next step: no thrashing.
    assert ids(scheduler.waiting) == ["c"] and scheduler.blocks.pool.num_free_blocks > 0
    scheduler.check_invariants()
    scheduler.update(out.scheduled, [[fake_token(s.seq.token_ids)] for s in out.scheduled])
    assert step(scheduler) == [("a", 1), ("b", 1), ("c", 3)]  # c recomputes from its first token


@pytest.mark.points(2)
def test_a_request_starts_after_its_cached_prefix():
    scheduler = make(cache=True)
    prompt = list(range(10, 19))  # 9 tokens: two whole blocks and one token
    first = add(scheduler, "first", prompt, max_tokens=1)
    assert step(scheduler) == [("first", 9)] and first.status is SequenceStatus.FINISHED
    second = add(scheduler, "second", prompt, max_tokens=2)
    assert step(scheduler) == [("second", 1)]  # 8 tokens' K/V come from the cache
    assert scheduler.blocks.num_cached_tokens(second) == 8
    assert (scheduler.blocks.prefix_cache_hit_tokens, scheduler.blocks.prefix_cache_query_tokens) == (8, 18)
    assert step(scheduler) == [("second", 1)]
    assert second.output_token_ids == expected_output(prompt, 2)


@pytest.mark.points(2)
def test_a_fork_waits_for_its_parent_and_shares_its_prompt_blocks():
    scheduler = make(budget=64)
    prompt = list(range(10))
    parent = add(scheduler, "p", prompt, max_tokens=3)
    child = add(scheduler, "q", prompt, max_tokens=3, fork_of=parent)
    add(scheduler, "r", [4, 4], max_tokens=3)
    # q waits until p's prompt is computed, and r behind it is not held up.
    assert step(scheduler) == [("p", 10), ("r", 2)]
    assert ids(scheduler.waiting) == ["q"]
    assert step(scheduler) == [("p", 1), ("r", 1), ("q", 2)]  # q reuses p's 2 full blocks
    assert child.block_table.block_ids[:2] == parent.block_table.block_ids[:2]
    assert scheduler.blocks.pool.ref_count(parent.block_table.block_ids[0]) == 2


def model_schedule(state: dict[str, list[int]], order: list[str], budget: int, max_seqs: int) -> list[tuple[str, int]]:
    """The policy, on the test's own counters: state[name] = [computed, length, running(0/1)]."""
    planned: list[tuple[str, int]] = []
    running = [name for name in order if state[name][2] == 1]
    for prefilling in (False, True):
        for name in running:
            computed, length, _ = state[name]
            if budget == 0:
                break
            if (length - computed > 1) != prefilling:
                continue
            n = min(length - computed, budget)
            planned.append((name, n))
            budget -= n
    for name in [name for name in order if state[name][2] == 0]:
        if budget == 0 or len(running) >= max_seqs:
            break
        n = min(state[name][1] - state[name][0], budget)
        state[name][2] = 1
        running.append(name)
        planned.append((name, n))
        budget -= n
    return planned


@pytest.mark.points(1)
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_random_workloads_follow_the_policy_step_by_step(seed):
    rng = random.Random(seed)
    budget, max_seqs = [(5, 2), (8, 3), (16, 4), (3, 8)][seed]  # every kind: seqs or tokens bind
    scheduler = make(num_blocks=400, budget=budget, max_seqs=max_seqs)
    state: dict[str, list[int]] = {}  # computed, length, running
    order: list[str] = []
    limits: dict[str, int] = {}
    requests: dict[str, tuple[list[int], int]] = {}
    seqs: dict[str, Sequence] = {}
    for t in range(200):
        if t < 40 and rng.random() < 0.4:
            name = f"r{t}"
            prompt = [rng.randrange(50) for _ in range(rng.randint(1, 14))]
            max_tokens = rng.randint(1, 6)
            seqs[name] = add(scheduler, name, prompt, max_tokens=max_tokens)
            requests[name] = (prompt, max_tokens)
            state[name] = [0, len(prompt), 0]
            order.append(name)
            limits[name] = len(prompt) + max_tokens
        planned = model_schedule(state, order, budget, max_seqs)
        assert step(scheduler) == planned, f"step {t}"
        for name, n in planned:
            state[name][0] += n
            if state[name][0] == state[name][1]:  # the chunk reached the end: a token is sampled
                state[name][1] += 1
                if state[name][1] == limits[name]:
                    order.remove(name)
                    del state[name]
    assert not scheduler.has_unfinished
    check_unpressured_outputs(seqs, requests)


@pytest.mark.points(3)
@pytest.mark.parametrize("seed", [0, 1])
def test_under_block_pressure_every_request_ends_with_its_unpressured_output(seed):
    rng = random.Random(seed)
    scheduler = make(num_blocks=10, budget=rng.choice([6, 12]), max_seqs=6)
    requests = random_requests(rng, 12, longest=16)
    seqs = {name: add(scheduler, name, prompt, max_tokens=n) for name, (prompt, n) in requests.items()}
    steps = 0
    while scheduler.has_unfinished:
        assert step(scheduler), "a step with unfinished requests scheduled nothing: the engine would hang"
        steps += 1
        assert steps < 2000
    assert scheduler.num_preemptions > 0  # the pool was too small for everyone at once
    assert scheduler.blocks.pool.num_free_blocks == 10
    check_unpressured_outputs(seqs, requests)
