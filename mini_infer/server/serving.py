"""What the endpoints share: server state, prompt limits, submission, answers, logprob tokens (chapter 11).

``ServerState`` is one app's world: its configuration, its ``AsyncEngine`` (the engine thread),
its metrics, and the worker thread in which prompts are rendered and tokenized, so that a long
chat template never holds up the event loop.

A request's length is checked here, before it reaches the engine, so that a prompt that is too
long gets a 400 that says how long it is and what the limit is, streaming or not. The engine
checks again (``RequestTooLongError``); its refusal also becomes a 400.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import Response

import mini_infer
from mini_infer.engine import LLMEngine
from mini_infer.engine_builder import EngineConfig, build_engine
from mini_infer.outputs import RequestOutput, TokenLogprob
from mini_infer.sampling_params import StructuredOutputsParams
from mini_infer.server import DEFAULT_MAX_BODY_BYTES
from mini_infer.server.async_engine import (
    AsyncEngine,
    Choice,
    EngineInfo,
    EngineUnavailableError,
    RequestFailedError,
    RequestRejectedError,
    RequestStream,
)
from mini_infer.server.http import CLIENT_CLOSED, EventStreamResponse, json_response, run_until_disconnect
from mini_infer.server.metrics import ServerMetrics
from mini_infer.server.protocol import (
    SSE_DONE,
    APIError,
    ChunkEncoder,
    bad_request,
    response_head,
    safe_logprob,
    sse,
)
from mini_infer.structured_output import check_grammar
from mini_infer.tokenizer import Tokenizer

T = TypeVar("T")
# The largest grammar (a JSON Schema, a regex, a Lark grammar, the tools of a forced call) one
# request may bring, in characters of its JSON: compiling one takes time in the tokenizer thread.
MAX_GRAMMAR_CHARS = 64 * 1024


@dataclass(slots=True)
class ServerConfig:
    model: str = "tiny"
    served_model_name: str | None = None  # the name clients send as "model"; default: ``model``
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    cors_origins: tuple[str, ...] = ()  # web pages (origins) allowed to call the API from a browser
    engine_kwargs: dict[str, Any] = field(default_factory=dict)  # EngineConfig's other fields
    show_progress: bool = True

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model


def unavailable(reason: str) -> APIError:
    return APIError(503, reason, type="server_error", code="engine_unavailable")


def internal_error(reason: str) -> APIError:
    """A 500 for one request whose own work failed (a bug of ours or of a library); the server
    goes on with the others."""
    return APIError(500, reason, type="server_error", code="internal_error")


class Call:
    """One completion request in flight, chat or plain: its choices' final outputs and the two
    ways to answer (one JSON body, or server-sent events). Endpoints subclass it: ``response``
    is the body, ``_choice_chunks`` the stream's chunks of choices, ``_usage`` the usage."""

    def __init__(
        self, state: ServerState, stream: RequestStream, response_id: str, chunk_object: str, include_usage: bool
    ) -> None:
        self.state = state
        self.stream = stream
        self.finals: list[Any] = [None] * len(stream.request_ids)
        self.response_id = response_id
        self.created = int(time.time())
        self.include_usage = include_usage
        self.head = response_head(response_id, self.created, state.model_name, state.system_fingerprint)
        self.encoder = ChunkEncoder(self.head, chunk_object, include_usage=include_usage)

    async def respond(self, request: Request, streaming: bool) -> Response:
        """Answer: a stream (whose generator aborts the request when it ends), or the whole
        response once every choice finished; a client that leaves first frees its blocks."""
        if streaming:
            return EventStreamResponse(self._events_or_failure())
        try:
            disconnected, _ = await run_until_disconnect(request.receive, self.collect())
        except EngineUnavailableError as exc:  # the engine died while we waited
            raise unavailable(str(exc)) from None
        except RequestFailedError as exc:  # this request alone
            raise internal_error(str(exc)) from None
        finally:
            self.stream.abort()  # a no-op when every choice finished
        if disconnected:
            return Response(status_code=CLIENT_CLOSED)
        return json_response(self.response())

    async def collect(self) -> None:
        while not self.stream.finished:
            for index, out in await self.stream.next_batch():
                self.finals[index] = out

    def response(self) -> dict[str, Any]:
        raise NotImplementedError

    async def events(self) -> AsyncGenerator[str, None]:
        """The event stream: the chunks of choices, the usage chunk if asked for, ``[DONE]``. An engine
        that dies midway ends it with an error event; however it ends, the request is aborted."""
        # student: begin chapter 11: the choices' chunks, the usage chunk if asked, data: [DONE]; abort however it ends
        try:
            async with aclosing(self._choice_chunks()) as chunks:
                async for chunk in chunks:
                    yield chunk
            if self.include_usage:
                yield self.encoder.usage_chunk(self._usage())
            yield SSE_DONE
        except EngineUnavailableError as exc:
            # The response has begun (200 is sent): the error travels as one event.
            yield sse(unavailable(str(exc)).body())
            yield SSE_DONE
        finally:
            self.stream.abort()  # the client left (or the engine died): free its blocks now
        # student: end

    async def _events_or_failure(self) -> AsyncGenerator[str, None]:
        """``events``; when a request of the call failed on its own (``RequestFailedError``), one
        error event naming the cause, then ``[DONE]`` (``events`` has aborted the others)."""
        try:
            async with aclosing(self.events()) as events:
                async for event in events:
                    yield event
        except RequestFailedError as exc:
            yield sse(internal_error(str(exc)).body())
            yield SSE_DONE

    def _choice_chunks(self) -> AsyncGenerator[str, None]:
        """The chunks of choices, until every choice finished (filling ``finals``)."""
        raise NotImplementedError

    def _usage(self) -> dict[str, Any]:
        raise NotImplementedError


class ServerState:
    def __init__(self, config: ServerConfig, engine_factory: Callable[[], LLMEngine] | None = None) -> None:
        self.config = config
        self.model_name = config.model_name
        self.created = int(time.time())
        # OpenAI's "backend configuration the model runs with": the version, the model and the
        # engine's options. The same for every response of this server.
        setup = json.dumps([mini_infer.__version__, config.model, config.engine_kwargs], sort_keys=True, default=str)
        self.system_fingerprint = "fp_" + hashlib.sha256(setup.encode()).hexdigest()[:12]
        self.metrics = ServerMetrics()
        factory = engine_factory or (
            lambda: build_engine(
                EngineConfig(model=config.model, show_progress=config.show_progress, **config.engine_kwargs)
            )
        )
        self.engine = AsyncEngine(factory, observer=self.metrics)
        self._tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="mini-infer-tokenizer")
        self._token_texts: TokenTexts | None = None

    def close(self) -> None:
        self._tokenizer_thread.shutdown(wait=False, cancel_futures=True)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")

    def ready(self) -> tuple[EngineInfo, Tokenizer]:
        reason = self.engine.unavailable()
        if reason is not None:
            raise unavailable(reason)
        assert self.engine.info is not None and self.engine.tokenizer is not None
        return self.engine.info, self.engine.tokenizer

    @property
    def token_texts(self) -> TokenTexts:
        if self._token_texts is None:
            _, tokenizer = self.ready()
            self._token_texts = TokenTexts(tokenizer)
        return self._token_texts

    async def in_tokenizer_thread(self, fn: Callable[..., T], *args: Any) -> T:
        """Run tokenizer work (templates, encoding) off the event loop, one job at a time."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, fn, *args)

    async def check_request(
        self, req: Any, info: EngineInfo, grammars: list[tuple[StructuredOutputsParams, str]]
    ) -> None:
        """A 400 for what the engine would refuse later: token ids a request names besides its
        prompt (stop tokens, biased tokens) outside the vocabulary, and grammars that do not
        compile (checked in the tokenizer thread: a large schema takes a while)."""
        if req.stop_token_ids:
            check_token_ids(req.stop_token_ids, info, "stop_token_ids")
        if req.logit_bias:
            check_token_ids([int(t) for t in req.logit_bias], info, "logit_bias")
        if grammars:
            await self.in_tokenizer_thread(check_grammars, grammars)

    async def submit(self, choices: list[Choice], group: str) -> RequestStream:
        try:
            return await self.engine.submit(choices, group)
        except RequestRejectedError as exc:
            if exc.status >= 500:
                raise internal_error(str(exc)) from None
            raise bad_request(
                str(exc), code="context_length_exceeded" if "context length" in str(exc) else None
            ) from None
        except EngineUnavailableError as exc:
            raise unavailable(str(exc)) from None


def check_token_ids(token_ids: Sequence[int], info: EngineInfo, param: str) -> None:
    bad = next((t for t in token_ids if not 0 <= t < info.vocab_size), None)
    if bad is not None:
        raise bad_request(f"{param}: token id {bad} is outside the vocabulary [0, {info.vocab_size})", param=param)


def check_grammars(parts: Sequence[tuple[StructuredOutputsParams, str]]) -> None:
    """A 400 for the first grammar that does not compile, named (``tools.1.function.parameters``
    does not compile: ...). Runs in the tokenizer thread: a large schema takes a while."""
    for spec, name in parts:
        size = len(json.dumps(getattr(spec, spec.kind)))
        if size > MAX_GRAMMAR_CHARS:
            raise bad_request(
                f"{name} is {size} characters of JSON; this server accepts grammars of at most {MAX_GRAMMAR_CHARS}",
                param=name.split(".")[0],
            )
        try:
            check_grammar(spec, name=name)
        except ValueError as exc:
            raise bad_request(str(exc), param=name.split(".")[0]) from None
        except Exception as exc:  # the grammar engine's failure, not the request's: a 500 naming it
            raise internal_error(f"{name}: compiling the grammar failed: {type(exc).__name__}: {exc}") from None


def resolve_max_tokens(
    info: EngineInfo, prompt_tokens: int, requested: int | None, default: int | None, *, prompt_param: str
) -> int:
    """The request's max_tokens, checked against the context (OpenAI's context-length error)."""
    if prompt_tokens == 0:
        raise bad_request(f"{prompt_param}: the prompt is empty", param=prompt_param)
    limit = min(info.max_model_len, info.max_pool_tokens)
    if limit == info.max_model_len:
        limit_text = f"This model's maximum context length is {limit} tokens"
    else:
        limit_text = f"This server's KV cache holds at most {limit} tokens for one request (the model's context is {info.max_model_len})"
    if requested is None:
        room = limit - prompt_tokens
        if room < 1:
            raise bad_request(
                f"{limit_text}. However, your {prompt_param} resulted in {prompt_tokens} tokens, which leaves no room "
                f"to generate ({prompt_tokens} + at least 1 > {limit}). Please reduce the length of the {prompt_param}.",
                param=prompt_param,
                code="context_length_exceeded",
            )
        return room if default is None else min(default, room)
    if prompt_tokens + requested > limit:
        raise bad_request(
            f"{limit_text}. However, you requested {prompt_tokens + requested} tokens ({prompt_tokens} in the "
            f"{prompt_param}, {requested} in the completion). Please reduce the length of the {prompt_param} or completion.",
            param=prompt_param,
            code="context_length_exceeded",
        )
    return requested


@dataclass(slots=True)
class Merged:
    """Consecutive outputs of one choice, folded into one (a client that fell behind)."""

    out: RequestOutput  # the latest: cumulative fields, finished, finish_reason
    new_text: str
    new_token_ids: list[int]


def merge_batch(batch: list[tuple[int, RequestOutput]]) -> list[tuple[int, Merged]]:
    """Fold each choice's outputs in ``batch`` into one, choices in order of first appearance."""
    # student: begin chapter 11: fold each choice's consecutive outputs into one Merged (new text and ids joined)
    merged: dict[int, Merged] = {}
    for index, out in batch:
        m = merged.get(index)
        if m is None:
            merged[index] = Merged(out, out.new_text, list(out.new_token_ids))
        else:
            m.out, m.new_text = out, m.new_text + out.new_text
            m.new_token_ids.extend(out.new_token_ids)
    return list(merged.items())
    # student: end


# --------------------------------------------------------------------------------------------
# Token strings for logprobs
# --------------------------------------------------------------------------------------------


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the printable character that stands for each byte."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    codes = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, codes)}


class TokenTexts:
    """Each token's text and bytes, as OpenAI's logprobs report them (cached per id).

    A byte-level BPE token can be part of a character: its ``bytes`` are exact, and its text is
    those bytes decoded with U+FFFD for the incomplete part (as OpenAI does).
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._hf = tokenizer.hf
        self._added = {i for i in getattr(self._hf, "added_tokens_decoder", {})}
        decoder = getattr(getattr(self._hf, "backend_tokenizer", None), "decoder", None)
        self._byte_level = "ByteLevel" in type(decoder).__name__ or "ByteLevel" in repr(decoder)
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is not None:
            return hit
        piece = self._hf.convert_ids_to_tokens(token_id)
        if piece is None:
            data = b""  # an id past the tokenizer's vocabulary (a padded embedding table)
        elif self._byte_level and token_id not in self._added and all(c in _byte_decoder() for c in piece):
            data = bytes(_byte_decoder()[c] for c in piece)
        else:
            data = str(self._hf.decode([token_id])).encode()
        result = (data.decode("utf-8", errors="replace"), list(data))
        self._cache[token_id] = result
        return result

    def chat_entry(self, entry: TokenLogprob) -> dict[str, Any]:
        text, data = self(entry.token_id)
        top = []
        for token_id, logprob in entry.top.items():
            t, b = self(token_id)
            top.append({"token": t, "logprob": safe_logprob(logprob), "bytes": b})
        return {"token": text, "logprob": safe_logprob(entry.logprob), "bytes": data, "top_logprobs": top}

    def completion_logprobs(self, entries: Sequence[TokenLogprob], text_offset: int) -> tuple[dict[str, Any], int]:
        """OpenAI's legacy logprobs object for some tokens; returns it and the next text offset."""
        tokens, token_logprobs, tops, offsets = [], [], [], []
        for entry in entries:
            text, _ = self(entry.token_id)
            tokens.append(text)
            token_logprobs.append(safe_logprob(entry.logprob))
            tops.append({self(t)[0]: safe_logprob(lp) for t, lp in entry.top.items()})
            offsets.append(text_offset)
            text_offset += len(text)
        body = {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}
        return body, text_offset
