"""The engine: one step = schedule -> batch -> forward -> sample -> update (chapter 06).

``LLMEngine`` is the loop and nothing else. Its step reads like its description::

    schedule = scheduler.schedule()                  # who runs, how many new tokens each
    proposal = drafter.propose(schedule)             # chapter 10's guesses (none without a draft)
    batch    = runner.prepare(inputs of schedule)    # one immutable ForwardBatch (chapter 05)
    logits   = runner.execute(batch)                 # one flat forward, logits where we sample
    sampled  = sampler.sample(logits, batch, ...)    # the tokens each sequence keeps: one host sync
    kept     = outputs.take(seq, sampled)            # stops found here, before the update
    scheduler.update(schedule, kept)                 # append, free or cache blocks

Requests come in through ``add_request`` (a prompt string or token ids, and ``SamplingParams``,
whose unset fields take the model's own ``sampling_defaults`` when the engine has them: chapter
10's builder reads them from ``generation_config.json``); ``step`` returns a ``RequestOutput`` for every request that progressed (with the new text for
streaming); ``abort_request`` finishes a request at once and frees its blocks. The offline
``LLM`` class and the server both drive this same loop.

The engine is built from parts: a ``ModelRunner`` (chapter 05), a ``Scheduler`` (this chapter and
the next) and a tokenizer, plus what later chapters add, each through a small protocol defined
here or in the scheduler: the prefix cache (chapter 08, given to the scheduler), a
``TokenSampler`` (``greedy.GreedySampler`` until chapter 09's ``sampling.Sampler``) and a
``Drafter`` (chapter 10). ``engine_builder.build_engine`` assembles all of them from an
``EngineConfig``. The engine re-exports none of its parts' attributes: the model and its device
are the runner's, the block pool and the prefix cache the scheduler's block bookkeeping's
(``scheduler.blocks``), the context length the scheduler's.

A fault stays with its request (``faults``): an exception in one request's own work (its
admission, its grammar, its detokenization, stop checks or output) finishes it alone, with
``finish_reason`` ``"error"``, and frees its blocks; one that can have corrupted what requests share
(a failed forward pass, out of memory, a dead tensor-parallel worker) goes on up to the caller.

``check_health`` raises when a part of the engine has died and ``close`` releases what would
outlive it: with tensor parallelism (chapter 14), the runner's worker processes.

Invariant, checked by tests after every step: every block is free, or held by running
sequences and/or the prefix cache; and ``num_computed_tokens <= len(token_ids)`` for every
sequence.
"""

from __future__ import annotations

import itertools
import logging
import numbers
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from mini_infer import faults
from mini_infer.faults import RequestError
from mini_infer.greedy import GreedySampler, SampledTokens
from mini_infer.model_runner import ForwardBatch, ModelRunner, SequenceInput
from mini_infer.output_processor import OutputProcessor
from mini_infer.outputs import RequestOutput
from mini_infer.sampling_params import SamplingParams, make_generator
from mini_infer.scheduler import ScheduledSequence, Scheduler, SchedulerOutput
from mini_infer.sequence import Sequence as Seq
from mini_infer.tokenizer import Tokenizer

logger = logging.getLogger("mini_infer.engine")


def is_token_id(t: object) -> bool:
    """An int, or an integer scalar of numpy (``numbers.Integral``); a bool is not a token id."""
    return isinstance(t, numbers.Integral) and not isinstance(t, bool)


def model_input(item: ScheduledSequence, draft_token_ids: Sequence[int] = ()) -> SequenceInput:
    """A scheduled sequence's input to this step's forward (chapter 05), with its guesses when it
    has draft slots (chapter 10)."""
    seq, start = item.seq, item.context_len - item.num_new_tokens
    if len(draft_token_ids) != item.num_draft_tokens:
        raise ValueError(f"{seq.request_id}: {len(draft_token_ids)} guesses for {item.num_draft_tokens} draft slots")
    own = seq.token_ids[start : item.context_len - item.num_draft_tokens]
    return SequenceInput(own, start, seq.block_table.block_ids, item.samples, draft_token_ids)


class TokenSampler(Protocol):
    """The sample stage: from a step's logits to the tokens each sequence keeps."""

    def check(self, params: SamplingParams) -> None:
        """Raise ValueError, when a request is added, for what this sampler cannot do."""
        ...

    def sample(self, logits: torch.Tensor, batch: ForwardBatch, seqs: list[Seq]) -> list[SampledTokens]:
        """One entry per input of ``batch``: its guesses up to the first rejected one (chapter 10),
        then one token of the model's own."""
        ...


@dataclass(frozen=True, slots=True)
class Proposal:
    """A drafter's guesses for one step (chapter 10): for every scheduled sequence, as many tokens
    as its draft slots."""

    token_ids: list[list[int]]


class Drafter(Protocol):
    num_draft_tokens: int  # guesses verified so far
    num_accepted_tokens: int  # of those, the ones kept

    def propose(self, schedule: SchedulerOutput) -> Proposal: ...


@dataclass(slots=True)
class StepRecord:
    """What one step computed, for benchmarks that compare a run with its roofline."""

    num_tokens: int  # new tokens through the model
    num_logits: int  # rows sampled
    attended_tokens: int  # sum over new tokens of the context each attended to


class LLMEngine:
    def __init__(
        self,
        runner: ModelRunner,
        scheduler: Scheduler,
        tokenizer: Tokenizer,
        *,
        eos_token_ids: Iterable[int] = (),
        sampler: TokenSampler | None = None,
        drafter: Drafter | None = None,
        sampling_defaults: Mapping[str, Any] | None = None,
    ) -> None:
        self.runner, self.scheduler, self.tokenizer = runner, scheduler, tokenizer
        self.sampler: TokenSampler = sampler or GreedySampler()
        self.drafter = drafter
        # What a request's unset SamplingParams fields take (the model's generation config).
        self.sampling_defaults = dict(sampling_defaults or {})
        self.outputs = OutputProcessor(tokenizer, eos_token_ids)
        self._ids = itertools.count()
        self._arrivals = itertools.count()
        self.num_steps = 0
        self.step_log: list[StepRecord] | None = None  # set to [] to record every step

    # ----------------------------------------------------------------- requests
    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        fork_of: str | None = None,
    ) -> str:
        """Submit a request; returns its id. Raises ValueError for a request that cannot run.

        ``fork_of`` names a request with the same prompt (the ``n`` choices of one API call):
        this one waits until that prompt is computed, then shares its full blocks by reference
        count instead of computing them again. Give each fork its own ``seed`` if it has one.
        """
        params = (params or SamplingParams()).with_defaults(self.sampling_defaults)
        self.sampler.check(params)
        if isinstance(prompt, str):
            token_ids = self.tokenizer.encode(prompt)
        else:
            bad = next((i for i, t in enumerate(prompt) if not is_token_id(t)), None)
            if bad is not None:
                raise TypeError(f"prompt token {bad} must be an int token id, got {prompt[bad]!r}")
            token_ids = [int(t) for t in prompt]
        if not token_ids:
            raise ValueError("the prompt is empty: give at least one token")
        vocab = self.runner.model.config.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
        bad = next((t for t in params.logit_bias or {} if t >= vocab), None)
        if bad is not None:
            raise ValueError(f"logit_bias token id {bad} is outside the vocabulary [0, {vocab})")
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.outputs.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        parent = None
        if fork_of is not None:
            if fork_of not in self.outputs.requests:
                raise ValueError(f"fork_of={fork_of!r} is not a request in flight")
            parent = self.outputs.requests[fork_of].seq
            if parent.prompt_token_ids != token_ids:
                raise ValueError(f"a fork must have the same prompt as request {fork_of!r}")
        faults.hit("admission", request_id)
        generator = make_generator(params.seed, self.runner.device) if params.seed is not None else None
        seq = Seq(request_id, token_ids, params, arrival=next(self._arrivals), generator=generator)
        self.scheduler.add(seq, fork_of=parent)  # raises RequestTooLongError for a request that can never fit
        try:
            self.outputs.add(seq, prompt if isinstance(prompt, str) else None)
        except BaseException:
            self.scheduler.finish(seq)  # a refused request leaves nothing behind
            raise
        return request_id

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Finish a request now and free its blocks; returns its last output (None if unknown)."""
        state = self.outputs.requests.get(request_id)
        if state is None:
            return None
        state.finish_reason = "abort"
        self.scheduler.finish(state.seq)
        return self._output(state.seq)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished

    # ----------------------------------------------------------------- one step
    def step(self) -> list[RequestOutput]:
        schedule = self.scheduler.schedule()
        if schedule.is_empty:
            return []
        scheduled = schedule.scheduled
        seqs = [item.seq for item in scheduled]
        proposal = self.drafter.propose(schedule) if self.drafter is not None else Proposal([[] for _ in scheduled])
        batch = self.runner.prepare([model_input(item, drafts) for item, drafts in zip(scheduled, proposal.token_ids)])
        logits = self.runner.execute(batch)
        try:
            sampled = self.sampler.sample(logits, batch, seqs)
        except RequestError as error:  # one request's own work (its grammar): it alone fails,
            return [self._fail(error)]  # and the others compute this step again
        kept = [self.outputs.take(seq, tokens) for seq, tokens in zip(seqs, sampled)]
        self.scheduler.update(scheduled, kept)
        self.num_steps += 1
        if self.step_log is not None:
            self.step_log.append(StepRecord(batch.num_tokens, batch.num_logits, batch.attended_tokens))
        progressed = [seq for seq, tokens in zip(seqs, kept) if tokens]
        for seq in progressed:
            if self.outputs.requests[seq.request_id].finish_reason is not None:
                self.scheduler.finish(seq)
        return [self._output(seq) for seq in progressed]

    def _output(self, seq: Seq) -> RequestOutput:
        try:
            return self.outputs.output(seq.request_id, self.scheduler.blocks.num_cached_tokens(seq))
        except Exception as exc:  # building this request's output failed: it alone fails
            return self._fail(RequestError(seq.request_id, "building its output", exc))

    def _fail(self, error: RequestError) -> RequestOutput:
        """Finish a request whose own work raised (``faults``), free its blocks, and say why.

        When a step's sample stage raised, nothing of the step was kept: the scheduler has not
        counted its tokens as computed, so the other requests compute them again next step, and
        the K/V this step wrote for them is written again, the same. Their tokens are the same as
        without the fault (the sampler raises before it draws), except that with a draft model
        (chapter 10) a seeded request's guesses are drawn again: what it keeps is distributed the
        same, not necessarily the same tokens.
        """
        logger.error("request %s failed: %s", error.request_id, error, exc_info=error.__cause__)
        self.scheduler.finish(self.outputs.requests[error.request_id].seq)
        return self.outputs.fail(error.request_id, str(error))

    def check_health(self) -> None:
        """Raise when a part of the engine has died (a tensor-parallel worker, chapter 14)."""
        self.runner.check_health()

    def close(self) -> None:
        """Release what would outlive the engine (a tensor-parallel runner's workers, chapter 14)."""
        self.runner.close()

    # ----------------------------------------------------------------- counters
    def stats(self) -> dict[str, int]:
        s, blocks, counters, drafter = self.scheduler, self.scheduler.blocks, self.outputs.counters, self.drafter
        return {
            "prompt_tokens": counters["prompt_tokens"],
            "generated_tokens": counters["generated_tokens"],
            "num_preemptions": s.num_preemptions,
            "kv_blocks_total": blocks.pool.num_blocks,
            "kv_blocks_free": blocks.pool.num_free_blocks,
            "prefix_cache_hit_tokens": blocks.prefix_cache_hit_tokens,
            "prefix_cache_query_tokens": blocks.prefix_cache_query_tokens,
            "num_running": len(s.running),
            "num_waiting": len(s.waiting),
            "steps": self.num_steps,
            "finished_requests": counters["finished_requests"],
            "failed_requests": counters["failed_requests"],  # finished with an error of their own
            # Speculative decoding (chapter 10): guesses verified, and how many were kept.
            "num_draft_tokens": drafter.num_draft_tokens if drafter is not None else 0,
            "num_accepted_draft_tokens": drafter.num_accepted_tokens if drafter is not None else 0,
        }
