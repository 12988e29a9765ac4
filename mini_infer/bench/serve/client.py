"""A streaming OpenAI-API client that records each request's timeline (chapter 12).

``send_request`` posts one prompt to ``/v1/completions`` or ``/v1/chat/completions`` with
``stream: true`` and ``stream_options.include_usage``, and notes the clock when it sends,
whenever a chunk with generated text arrives, and when the stream ends. It never raises for
a failed request: HTTP errors, error events inside the stream, broken connections and
timeouts all become a ``RequestRecord`` with ``success=False`` and the message, so one bad
request cannot stop a benchmark.

Server-sent events (the WHATWG spec, what OpenAI-compatible servers send): a stream of lines
ended by ``\\n``, ``\\r\\n`` or ``\\r``; ``data: ...`` lines accumulate, a blank line ends the
event, lines starting with ``:`` are comments. The network may cut the stream anywhere, even
inside a line or a UTF-8 character, so ``SSEParser`` buffers bytes and decodes only whole
lines. The stream ends with ``data: [DONE]``.

The client's own time per token must stay small beside the server's, or it measures itself. The
stream is read with aiohttp, as SGLang's and vLLM's benchmark clients read theirs, not with httpx
(everywhere else in mini-infer): at request rate inf every streamed token is one chunk of the
response, and through httpx each one passes h11's event machine, httpcore's and anyio's wrappers,
about half of servebench's CPU time per chunk against a fake server streaming 10,000 chunks/s
(its one core saturated and its TTFT grew with its own backlog); aiohttp parses HTTP in C.
``iter_any`` hands over whatever has arrived, the parser splits it into lines in one pass, and
every chunk in it is stamped with the time of that read: they arrived together (SGLang's and
vLLM's clients stamp each line as they reach it, later only by their own work).

Token counts come from the final ``usage`` chunk when the server sends one; otherwise the
tokenizer counts the generated text, or, without a tokenizer, characters / 4 estimate it (the
record says which).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import httpx
from aiohttp.http_exceptions import HttpProcessingError

from mini_infer.bench.serve.datasets import BenchRequest
from mini_infer.bench.serve.metrics import RequestRecord

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}

# Prefix-cache counters servers expose on GET /metrics, in tokens: (hits, queries). The
# Prometheus client appends ``_total`` to counter names, so both spellings are accepted.
PREFIX_CACHE_COUNTERS = [
    ("mini_infer:prefix_cache_hits", "mini_infer:prefix_cache_queries"),
    ("vllm:prefix_cache_hits", "vllm:prefix_cache_queries"),
]


@dataclass(slots=True)
class SSEEvent:
    data: str
    event: str = "message"


class SSEParser:
    """Incremental server-sent-events parser: feed it bytes cut anywhere, get whole events."""

    def __init__(self) -> None:
        self._buffer = b""
        self._data: list[str] = []
        self._event = ""

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        # Called for every network read, at saturation thousands of times a second: split with
        # bytes methods (C loops), and take the usual "data: ..." line past the general case.
        buffer = self._buffer + chunk
        held = b""
        if b"\r" in buffer:
            if buffer.endswith(b"\r"):  # may be half of "\r\n": wait for the next byte
                buffer, held = buffer[:-1], b"\r"
            buffer = buffer.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        *lines, rest = buffer.split(b"\n")
        self._buffer = rest + held
        events: list[SSEEvent] = []
        for raw in lines:
            if raw.startswith(b"data: "):
                self._data.append(raw[6:].decode("utf-8", errors="replace"))
                continue
            event = self._line(raw.decode("utf-8", errors="replace"))
            if event is not None:
                events.append(event)
        return events

    def close(self) -> list[SSEEvent]:
        """End of stream: a last line or event without its terminator still counts."""
        events: list[SSEEvent] = []
        if self._buffer:
            line, self._buffer = self._buffer.decode("utf-8", errors="replace").rstrip("\r"), b""
            event = self._line(line)
            if event is not None:
                events.append(event)
        event = self._line("")
        if event is not None:
            events.append(event)
        return events

    def _line(self, line: str) -> SSEEvent | None:
        if not line:
            if not self._data:
                self._event = ""
                return None
            event = SSEEvent("\n".join(self._data), self._event or "message")
            self._data, self._event = [], ""
            return event
        if line.startswith(":"):
            return None  # a comment (some servers send them as keep-alives)
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        return None  # "id" and "retry" do not matter to a benchmark


@dataclass(slots=True)
class ClientConfig:
    base_url: str  # without /v1: http://127.0.0.1:8000
    endpoint: str  # "completions" or "chat"
    model: str
    api_key: str | None = None
    ignore_eos: bool = False
    temperature: float = 0.0
    extra_body: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + ENDPOINTS[self.endpoint]

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def build_payload(config: ClientConfig, request: BenchRequest) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "model": config.model,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": config.temperature,
    }
    if config.endpoint == "chat":
        payload["messages"] = request.chat_messages()
    else:
        if request.prompt is None:
            raise ValueError("a prompt given only as chat messages needs --endpoint chat")
        payload["prompt"] = request.prompt
    if request.output_len is not None:
        # max_tokens, not max_completion_tokens: every OpenAI-compatible server accepts it on
        # both endpoints (vLLM, SGLang, llama.cpp), while the newer name is chat-only.
        payload["max_tokens"] = request.output_len
    if config.ignore_eos:
        payload["ignore_eos"] = True
    payload.update(config.extra_body)
    return payload


def _error_message(obj: Any) -> str:
    error = obj.get("error", obj) if isinstance(obj, dict) else obj
    if isinstance(error, dict):
        return str(error.get("message") or error)
    return str(error)


def _chunk_text(obj: dict[str, Any]) -> tuple[str, bool]:
    """The generated text in one streamed chunk, and whether a choice finished in it."""
    text, finished = "", False
    for choice in obj.get("choices") or []:
        delta = choice.get("delta") or {}
        # completions stream "text"; chat streams "content", and reasoning models stream their
        # thinking as "reasoning_content" (vLLM, SGLang) or "reasoning" before any content.
        for piece in (choice.get("text"), delta.get("content"), delta.get("reasoning_content"), delta.get("reasoning")):
            if isinstance(piece, str):
                text += piece
        finished = finished or choice.get("finish_reason") is not None
    return text, finished


def _describe(error: BaseException) -> str:
    # aiohttp reports a response it cannot parse with status 400, which the server never sent:
    # keep only the parser's message (for a cut body, the one nested in ClientPayloadError).
    if isinstance(error, aiohttp.ClientResponseError):
        return error.message
    if isinstance(error, aiohttp.ClientPayloadError) and isinstance(error.__cause__, HttpProcessingError):
        return f"response body not completed: {error.__cause__.message}"
    return str(error)


def _prompt_text(request: BenchRequest) -> str:
    if request.prompt is not None:
        return request.prompt
    return "".join(str(m.get("content") or "") for m in request.chat_messages())


async def send_request(
    client: httpx.AsyncClient,
    config: ClientConfig,
    request: BenchRequest,
    index: int,
    count_tokens: Callable[[str], int] | None = None,
) -> RequestRecord:
    """Send one streaming request and return its timeline; failures are recorded, not raised.

    The stream goes over an aiohttp session of its own, one connection per request as in
    SGLang's client, not through ``client`` (httpx's per-chunk work was half of servebench's
    time per token: see the module's docstring); ``client``'s connect timeout bounds the
    connection and its read timeout each wait for bytes, the response's head included.
    """
    body = json.dumps(build_payload(config, request)).encode()
    record = RequestRecord(
        index=index, send_time=time.perf_counter(), end_time=0.0, requested_output_len=request.output_len
    )
    text: list[str] = []
    usage: dict[str, Any] | None = None
    done = finished = False

    def fail(message: str) -> RequestRecord:
        record.success, record.error = False, message[:500]
        record.end_time = time.perf_counter()
        return record

    # total=None: a long answer is not a failure while bytes keep coming (httpx's semantics).
    timeout = aiohttp.ClientTimeout(total=None, connect=client.timeout.connect, sock_read=client.timeout.read)
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream", **config.headers()}
    try:
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            session.post(config.url, data=body, headers=headers) as response,
        ):
            if response.status != 200:
                detail = (await response.read()).decode("utf-8", errors="replace")
                try:
                    detail = _error_message(json.loads(detail))
                except json.JSONDecodeError:
                    detail = detail.strip()
                return fail(f"HTTP {response.status}: {detail}")
            parser = SSEParser()
            async for raw in response.content.iter_any():
                # One time for everything in one network read: it arrived together.
                now = time.perf_counter()
                for event in parser.feed(raw):
                    if event.data.strip() == "[DONE]":
                        done = True
                        break
                    try:
                        obj = json.loads(event.data)
                    except json.JSONDecodeError:
                        return fail(f"not JSON in the stream: {event.data[:200]!r}")
                    if event.event == "error" or (isinstance(obj, dict) and obj.get("error")):
                        return fail(f"error event: {_error_message(obj)}")
                    if not isinstance(obj, dict):
                        return fail(f"unexpected event: {event.data[:200]!r}")
                    piece, chunk_finished = _chunk_text(obj)
                    if piece:
                        text.append(piece)
                        record.chunk_times.append(now)
                    finished = finished or chunk_finished
                    usage = obj.get("usage") or usage
                if done:
                    break  # do not wait for the server to close the connection
            if not done:
                # A server may close without [DONE]; whatever was left in the buffer still counts.
                for event in parser.close():
                    if event.data.strip() == "[DONE]":
                        done = True
                    elif event.event == "error":
                        return fail(f"error event: {event.data[:200]}")
    # ClientError: refused, not HTTP, a cut or malformed body; TimeoutError: connect or read
    # timeout (aiohttp's timeout errors are both); OSError: anything from the socket itself.
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
        message = " ".join(_describe(e).split())  # on one line
        return fail(f"{type(e).__name__}: {message}" if message else type(e).__name__)
    except Exception as e:  # one odd response must not stop the whole benchmark
        return fail(f"{type(e).__name__}: {e}")
    record.end_time = time.perf_counter()
    if not (done or finished):
        return fail("the stream ended before [DONE] or a finish_reason")

    generated = "".join(text)
    if usage is not None and isinstance(usage.get("completion_tokens"), int):
        record.output_tokens = usage["completion_tokens"]
        prompt_tokens = usage.get("prompt_tokens")
        record.prompt_tokens = prompt_tokens if isinstance(prompt_tokens, int) else request.prompt_len
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        record.cached_tokens = cached if isinstance(cached, int) else None
        record.token_count_source = "usage"
    elif count_tokens is not None:
        record.output_tokens = count_tokens(generated)
        record.prompt_tokens = (
            request.prompt_len if request.prompt_len is not None else count_tokens(_prompt_text(request))
        )
        record.token_count_source = "tokenizer"
    else:
        record.output_tokens = estimate_tokens(generated)
        record.prompt_tokens = (
            request.prompt_len if request.prompt_len is not None else estimate_tokens(_prompt_text(request))
        )
        record.token_count_source = "estimate"
    return record


def estimate_tokens(text: str) -> int:
    """About four characters of English per token (OpenAI's rule of thumb); at least one if any text."""
    return max(1, round(len(text) / 4)) if text else 0


async def first_model_id(client: httpx.AsyncClient, base_url: str, api_key: str | None) -> str:
    """The first model the server lists at ``GET /v1/models``."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = await client.get(base_url.rstrip("/") + "/v1/models", headers=headers)
    response.raise_for_status()
    models = response.json().get("data") or []
    if not models:
        raise ValueError(f"{base_url}/v1/models lists no models; pass --model")
    return str(models[0]["id"])


def parse_prefix_cache_counters(text: str) -> tuple[float, float] | None:
    """(hits, queries) from a Prometheus text exposition, summed over label sets; None if absent."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if "{" in line.split(" ", 1)[0]:
            # name{labels} value [timestamp]; label values may hold spaces, so cut at the last brace.
            name, rest = line[: line.index("{")], line[line.rindex("}") + 1 :]
        else:
            name, _, rest = line.partition(" ")
        try:
            value = float(rest.split()[0])
        except (IndexError, ValueError):
            continue
        name = name.removesuffix("_total")
        values[name] = values.get(name, 0.0) + value
    for hits, queries in PREFIX_CACHE_COUNTERS:
        if hits in values and queries in values:
            return values[hits], values[queries]
    return None


async def read_prefix_cache_counters(client: httpx.AsyncClient, base_url: str) -> tuple[float, float] | None:
    """The server's prefix-cache counters from ``GET /metrics``, or None when it has none."""
    try:
        response = await client.get(base_url.rstrip("/") + "/metrics")
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    return parse_prefix_cache_counters(response.text)
