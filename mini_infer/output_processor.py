"""From kept tokens to what a request sees: stops, text, logprobs, counters (chapter 06).

Every step the engine hands each sequence's new tokens to ``take`` *before* the scheduler
appends them. ``take`` detokenizes them one at a time and finds the first stop: an EOS token
(unless ``ignore_eos``), a stop token id, a stop string completed in the text, or ``max_tokens``
reached; none of the first three counts while the output has ``min_tokens`` tokens or fewer. It returns the tokens up to and including that one; the rest (guesses accepted past an
EOS, say, chapter 10) never enter the sequence, so ``num_computed_tokens <= len(token_ids)``
holds for every sequence, finished ones included. ``output`` then builds the request's
``RequestOutput``: cumulative text and tokens, and the piece that is new (for streaming).

Text is streamed without ever cutting a character (``IncrementalDetokenizer``, chapter 01) or
showing a stop string (``StopStringChecker``); an EOS or stop token's text is not part of the
answer, and other special tokens' text only with ``skip_special_tokens=False``. The counters (tokens in and out, finished and failed requests) are the engine's statistics.

A fault stays with its request (``faults``): when detokenizing or checking stops raises, the
token is kept, the request finishes with ``"error"`` and ``output`` says what was raised.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

from mini_infer import faults
from mini_infer.greedy import SampledTokens
from mini_infer.outputs import RequestOutput, TokenLogprob
from mini_infer.sequence import Sequence
from mini_infer.stop_strings import StopStringChecker
from mini_infer.tokenizer import IncrementalDetokenizer, Tokenizer

logger = logging.getLogger("mini_infer.engine")


@dataclass(slots=True)
class RequestState:
    """Per-request output bookkeeping that the scheduler does not need."""

    seq: Sequence
    prompt: str | None
    detokenizer: IncrementalDetokenizer
    stop_checker: StopStringChecker | None
    text: str = ""
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # found by ``take`` (or set by an abort); the engine finishes the sequence
    stop_reason: str | int | None = None  # the stop string or token id that finished it
    new_token_ids: list[int] = field(default_factory=list)  # since the last output
    new_text: str = ""
    error: str | None = None  # with finish_reason "error": what its own work raised (``faults``)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, eos_token_ids: Iterable[int]) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids)
        self.requests: dict[str, RequestState] = {}
        self.counters = {"prompt_tokens": 0, "generated_tokens": 0, "finished_requests": 0, "failed_requests": 0}

    def add(self, seq: Sequence, prompt: str | None) -> None:
        params = seq.params
        stop = StopStringChecker(params.stop, params.include_stop_str_in_output) if params.stop else None
        detokenizer = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
        self.requests[seq.request_id] = RequestState(seq, prompt, detokenizer, stop)
        self.counters["prompt_tokens"] += seq.num_prompt_tokens

    def take(self, seq: Sequence, sampled: SampledTokens) -> list[int]:
        """The tokens of ``sampled`` that ``seq`` keeps: up to and including the first stop."""
        state = self.requests[seq.request_id]
        kept: list[int] = []
        for token in sampled.token_ids:
            kept.append(token)
            state.finish_reason = self._check(state, token, seq.num_output_tokens + len(kept))
            if state.finish_reason is not None:
                break
        if sampled.logprobs is not None and seq.params.logprobs is not None:
            state.logprobs = (state.logprobs or []) + sampled.logprobs[: len(kept)]
        state.new_token_ids += kept
        self.counters["generated_tokens"] += len(kept)
        return kept

    def _check(self, state: RequestState, token: int, num_output_tokens: int) -> str | None:
        """Detokenize one new token; why the request finishes with it (None: it goes on), or
        ``"error"`` when detokenizing or checking stops raised: that request alone fails."""
        try:
            return self._stop_of(state, token, num_output_tokens)
        except Exception as exc:
            logger.error("request %s: detokenizing or checking stops failed", state.seq.request_id, exc_info=exc)
            state.error = f"detokenizing or checking stops failed: {type(exc).__name__}: {exc}"
            return "error"

    def _stop_of(self, state: RequestState, token: int, num_output_tokens: int) -> str | None:
        params, seq = state.seq.params, state.seq
        faults.hit("stop_check", seq.request_id)
        may_stop = num_output_tokens > params.min_tokens
        if token in self.eos_token_ids and not params.ignore_eos and may_stop:
            reason: str | None = "stop"  # EOS ends the turn; its text is not part of the answer
        elif token in params.stop_token_ids and may_stop:
            reason, state.stop_reason = "stop", token
        else:
            faults.hit("detokenize", seq.request_id)
            reason, piece = None, state.detokenizer.push([token])
            if state.stop_checker is not None and piece and may_stop:
                piece, hit = state.stop_checker.push(piece)
                if hit:
                    reason, state.stop_reason = "stop", state.stop_checker.matched
            if reason is None and num_output_tokens >= params.max_tokens:
                reason = "length"
            state.new_text += piece
        if reason is not None and not isinstance(state.stop_reason, str):
            # Release what was held back: bytes of an unfinished character, and text that
            # could have been the start of a stop string.
            tail = state.detokenizer.flush()
            if state.stop_checker is not None:
                tail = (state.stop_checker.push(tail)[0] if tail else "") + state.stop_checker.flush()
            state.new_text += tail
        return reason

    def output(self, request_id: str, num_cached_tokens: int = 0) -> RequestOutput:
        """The request's output now, with what is new since the last one (``num_cached_tokens``:
        prompt tokens the prefix cache served, chapter 08); a finished request is forgotten."""
        state = self.requests[request_id]
        seq = state.seq
        faults.hit("output", request_id)
        state.text += state.new_text
        out = RequestOutput(
            request_id=seq.request_id,
            prompt=state.prompt,
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=list(seq.output_token_ids),
            text=state.text,
            finished=seq.is_finished,
            finish_reason=state.finish_reason,
            stop_reason=state.stop_reason,
            new_token_ids=state.new_token_ids,
            new_text=state.new_text,
            logprobs=None if state.logprobs is None else list(state.logprobs),
            num_cached_tokens=num_cached_tokens,
            error=state.error,
        )
        state.new_token_ids, state.new_text = [], ""
        if seq.is_finished:
            del self.requests[request_id]
            self.counters["finished_requests"] += state.finish_reason not in ("abort", "error")
            self.counters["failed_requests"] += state.finish_reason == "error"
        return out

    def fail(self, request_id: str, error: str) -> RequestOutput:
        """The last output of a request whose own work raised, built from its sequence alone (its
        detokenizer may be what failed); the request is forgotten."""
        seq = self.requests.pop(request_id).seq
        self.counters["failed_requests"] += 1
        return RequestOutput(
            request_id, None, seq.prompt_token_ids, list(seq.output_token_ids), "", True, "error", error=error
        )
