"""What the graded tests of chapters 06 and 07 share (chapter 06): a fake engine loop that drives
the scheduler with a "model" whose next token is a function of the sequence, random workloads, and
the check that every request ends with what it gets with nothing else running.

Copied beside the graded tests wherever they run (``grade.copy_graded_tests``): the grader's
temporary folder and a student package's ``tests/``. It is never imported from the package being
graded, so a student's copy of it cannot change what the tests expect.
"""

from __future__ import annotations

import random
from typing import Any

from mini_infer.scheduler import Scheduler, SchedulerOutput
from mini_infer.sequence import SequenceStatus


def fake_token(token_ids: list[int]) -> int:
    """The 'model': a next token that depends on the whole sequence."""
    return (sum(token_ids) * 31 + len(token_ids)) % 97


def expected_output(prompt: list[int], max_tokens: int) -> list[int]:
    """What the fake model generates for ``prompt`` with nothing else running."""
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(fake_token(tokens))
    return tokens[len(prompt) :]


def random_requests(rng: random.Random, count: int, longest: int) -> dict[str, tuple[list[int], int]]:
    """``count`` requests named "0", "1", ...: (prompt, max_tokens), a prompt of 1 to ``longest``
    tokens below 50, and 1 to ``longest`` output tokens."""
    return {
        str(i): ([rng.randrange(50) for _ in range(rng.randint(1, longest))], rng.randint(1, longest))
        for i in range(count)
    }


def check_unpressured_outputs(seqs: dict[str, Any], requests: dict[str, tuple[list[int], int]]) -> None:
    """Every request ended with what the fake model generates for it with nothing else running."""
    for name, (prompt, max_tokens) in requests.items():
        assert seqs[name].output_token_ids == expected_output(prompt, max_tokens), name


def fake_step(scheduler: Scheduler) -> SchedulerOutput:
    """One engine step with the fake model: schedule, keep one token per sampling sequence, finish
    those that reached ``max_tokens``, check the scheduler's invariants."""
    out = scheduler.schedule()
    kept = [[fake_token(s.seq.token_ids)] if s.samples else [] for s in out.scheduled]
    scheduler.update(out.scheduled, kept)
    for item in out.scheduled:
        seq = item.seq
        if seq.status is SequenceStatus.RUNNING and seq.num_output_tokens >= seq.params.max_tokens:
            scheduler.finish(seq)
    scheduler.check_invariants()
    return out


def ids(seqs: object) -> list[str]:
    return [s.request_id for s in seqs]  # type: ignore[attr-defined]
