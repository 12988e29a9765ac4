"""Graded tests (chapter 07): preemption by recompute, and refusing requests that could never run.

``Scheduler._make_room`` grows a running sequence's blocks, preempting the latest arrival not yet
scheduled in this step until they fit; ``Scheduler._preempt`` frees the victim and puts it back in
the waiting queue in arrival order; ``Scheduler.check_fits`` refuses, at submission, a request
longer than the model's context or the whole pool. The last test runs random workloads on a
pool too small for them and checks that preemption never changes a request's output.
"""

from __future__ import annotations

import itertools
import random

import pytest
from graded_fake_engine import check_unpressured_outputs, fake_step, ids, random_requests

from mini_infer.kv.block_pool import BlockPool
from mini_infer.sampling_params import SamplingParams
from mini_infer.scheduler import RequestTooLongError, Scheduler
from mini_infer.sequence import Sequence, SequenceStatus

BS = 4  # tokens per block
ARRIVALS = itertools.count()  # submission order across the file: only the order matters


def make(num_blocks: int, budget: int = 64, max_seqs: int = 8, max_model_len: int = 10_000) -> Scheduler:
    pool = BlockPool(num_blocks, block_size=BS)
    return Scheduler(pool, max_num_batched_tokens=budget, max_num_seqs=max_seqs, max_model_len=max_model_len)


def add(scheduler: Scheduler, name: str, prompt: list[int], max_tokens: int = 8) -> Sequence:
    seq = Sequence(name, prompt, SamplingParams(max_tokens=max_tokens), arrival=next(ARRIVALS))
    scheduler.add(seq)
    return seq


def step(scheduler: Scheduler) -> tuple[list[tuple[str, int]], list[str]]:
    """One engine step with the fake model: (request id, new tokens) scheduled, and ids preempted."""
    out = fake_step(scheduler)
    return [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled], ids(out.preempted)


def three_decoding(num_blocks: int, c_prompt: int = 7) -> tuple[Scheduler, list[Sequence]]:
    """a, b, c (in that order) decoding, their blocks full: a and b 2 blocks (8 tokens computed of 9),
    c 2 blocks too, or 1 with ``c_prompt=3`` (4 computed of 5)."""
    scheduler = make(num_blocks)
    seqs = [add(scheduler, name, list(range(n)), max_tokens=12) for name, n in zip("abc", (7, 7, c_prompt))]
    assert step(scheduler) == ([("a", 7), ("b", 7), ("c", c_prompt)], [])
    assert step(scheduler) == ([("a", 1), ("b", 1), ("c", 1)], [])
    return scheduler, seqs


@pytest.mark.points(2)
def test_the_victim_is_the_latest_arrival():
    scheduler, (a, b, c) = three_decoding(num_blocks=7)  # one block free
    # a takes the free block; b needs one: c, the latest arrival, is preempted; c itself is not run.
    assert step(scheduler) == ([("a", 1), ("b", 1)], ["c"])
    assert ids(scheduler.running) == ["a", "b"] and ids(scheduler.waiting) == ["c"]
    assert c.status is SequenceStatus.WAITING and scheduler.num_preemptions == 1
    assert len(a.block_table.block_ids) == len(b.block_table.block_ids) == 3


@pytest.mark.points(2)
def test_the_sequence_asking_may_be_the_victim_and_then_does_not_run():
    scheduler, (a, b, c) = three_decoding(num_blocks=5, c_prompt=3)  # no block free
    # a needs a block: c goes, and a takes c's block. b needs one: the only running sequence
    # not scheduled yet is b itself, which gives its own blocks up and does not run.
    assert step(scheduler) == ([("a", 1)], ["c", "b"])
    assert ids(scheduler.running) == ["a"] and ids(scheduler.waiting) == ["b", "c"]
    assert scheduler.num_preemptions == 2
    assert scheduler.blocks.pool.num_free_blocks == 5 - 3


@pytest.mark.points(2)
def test_a_preempted_sequence_keeps_its_tokens_and_recomputes_them():
    scheduler, (a, b, c) = three_decoding(num_blocks=7)
    tokens = list(c.token_ids)
    step(scheduler)
    assert c.token_ids == tokens and c.num_computed_tokens == 0 and c.block_table.block_ids == []
    while c.status is SequenceStatus.WAITING:
        step(scheduler)
    # Readmitted: its prompt and the tokens it had generated are computed again as one prompt.
    assert c.num_computed_tokens >= len(tokens) - 1


@pytest.mark.points(2)
def test_the_waiting_queue_stays_in_arrival_order():
    scheduler, (a, b, c) = three_decoding(num_blocks=5, c_prompt=3)
    d = add(scheduler, "d", [1, 2], max_tokens=1)
    step(scheduler)  # c then b are preempted; they go back in front of d, b first
    assert ids(scheduler.waiting) == ["b", "c", "d"]
    assert [s.status for s in scheduler.waiting] == [SequenceStatus.WAITING] * 3
    assert d.num_computed_tokens == 0


@pytest.mark.points(2)
def test_a_victim_goes_back_behind_earlier_arrivals_still_waiting():
    for later in (False, True):
        scheduler = make(num_blocks=5)
        parent = add(scheduler, "p", list(range(10)), max_tokens=6)
        fork = Sequence("q", list(range(10)), SamplingParams(max_tokens=6), arrival=next(ARRIVALS))
        scheduler.add(fork, fork_of=parent)  # waits until its parent's prompt is computed, then finds no room
        add(scheduler, "r", list(range(7)), max_tokens=6)
        if later:
            add(scheduler, "u", [1], max_tokens=2)  # arrived last, waits behind q
        assert step(scheduler) == ([("p", 10), ("r", 7)], [])
        assert step(scheduler) == ([("p", 1), ("r", 1)], [])
        assert step(scheduler) == ([("p", 1)], ["r"])
        # r goes behind the fork, which arrived before it, and before u, which arrived after it.
        assert ids(scheduler.waiting) == (["q", "r", "u"] if later else ["q", "r"])


@pytest.mark.points(2)
def test_check_fits_refuses_what_could_never_run():
    scheduler = make(num_blocks=5, max_model_len=24)  # 5 blocks of 4: 20 tokens in the whole pool
    scheduler.check_fits(10, 10)  # 20 tokens: exactly the pool
    scheduler.check_fits(1, 19)
    with pytest.raises(RequestTooLongError, match="KV blocks"):
        scheduler.check_fits(10, 11)  # 21 tokens: 6 blocks
    roomy = make(num_blocks=100, max_model_len=24)
    roomy.check_fits(20, 4)  # exactly the context
    with pytest.raises(RequestTooLongError, match="24") as error:
        roomy.check_fits(20, 5)
    assert "25" in str(error.value)  # it says how long the request is
    with pytest.raises(RequestTooLongError):
        roomy.add(Sequence("long", list(range(30)), SamplingParams(max_tokens=1), arrival=next(ARRIVALS)))
    assert not roomy.waiting


@pytest.mark.points(4)
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_random_workloads_on_a_small_pool_keep_every_output(seed):
    rng = random.Random(seed)
    num_blocks = rng.choice([8, 10, 14])
    scheduler = make(num_blocks=num_blocks, budget=rng.choice([5, 9, 32]), max_seqs=rng.choice([3, 8]))
    requests = random_requests(rng, 14, longest=14)
    seqs = {name: add(scheduler, name, prompt, max_tokens=n) for name, (prompt, n) in requests.items()}
    steps = preempted = 0
    while scheduler.has_unfinished:
        scheduled, victims = step(scheduler)
        assert scheduled, "a step with unfinished requests scheduled nothing: the engine would hang"
        assert not set(victims) & {name for name, _ in scheduled}, "a preempted sequence also ran"
        preempted += len(victims)
        steps += 1
        assert steps < 2000
    assert preempted == scheduler.num_preemptions > 0
    assert scheduler.blocks.pool.num_free_blocks == num_blocks
    check_unpressured_outputs(seqs, requests)
