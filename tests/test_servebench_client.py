"""servebench's client: the SSE parser, one streamed request, request bodies, /metrics (chapter 12).

The requests go to a small asyncio server on a socket of this process.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Awaitable, Callable

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mini_infer.bench.serve.client import (
    ClientConfig,
    SSEEvent,
    SSEParser,
    build_payload,
    parse_prefix_cache_counters,
    send_request,
)
from mini_infer.bench.serve.datasets import BenchRequest
from mini_infer.bench.serve.metrics import RequestRecord

# Every line ending the spec allows, a comment, a multi-line event, and multi-byte characters
# (a split inside one of them must not garble it).
STREAM = (
    b": keep-alive\n"
    b'data: {"choices": [{"text": "h\xc3\xa9llo"}]}\n\n'
    b'data: {"choices": [{"text": " \xf0\x9f\x99\x82"}]}\r\n\r\n'
    b"event: error\r"
    b'data: {"error": {"message": "bad"}}\r\r'
    b"data: line one\n"
    b"data: line two\n\n"
    b"data: [DONE]\n\n"
)
EXPECTED = [
    SSEEvent('{"choices": [{"text": "héllo"}]}'),
    SSEEvent('{"choices": [{"text": " 🙂"}]}'),
    SSEEvent('{"error": {"message": "bad"}}', event="error"),
    SSEEvent("line one\nline two"),
    SSEEvent("[DONE]"),
]


def parse_in_pieces(data: bytes, cuts: list[int]) -> list[SSEEvent]:
    parser = SSEParser()
    events: list[SSEEvent] = []
    start = 0
    for cut in sorted(set(cuts)) + [len(data)]:
        events += parser.feed(data[start:cut])
        start = cut
    return events + parser.close()


def test_sse_whole_stream() -> None:
    assert parse_in_pieces(STREAM, []) == EXPECTED


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=len(STREAM)), max_size=30))
def test_sse_split_at_any_byte(cuts: list[int]) -> None:
    assert parse_in_pieces(STREAM, cuts) == EXPECTED


def test_sse_byte_by_byte_and_unterminated_end() -> None:
    assert parse_in_pieces(STREAM, list(range(len(STREAM)))) == EXPECTED
    # a server that closes without the final blank line still delivers its last event
    assert parse_in_pieces(b"data: [DONE]", []) == [SSEEvent("[DONE]")]
    assert parse_in_pieces(b"data: [DONE]\r", []) == [SSEEvent("[DONE]")]


# ------------------------------------------------------------------ one request
# A server on a real socket of this process: ``handler`` gets the request (head and body) and
# answers (status, content type, body pieces), sent with chunked encoding one piece at a time.
Answer = tuple[int, str, list[bytes]]
Handler = Callable[[dict[str, str], bytes], Answer]


def sse(*objects: object) -> list[bytes]:
    return [f"data: {json.dumps(o) if not isinstance(o, str) else o}\n\n".encode() for o in objects]


def completion_chunks(pieces: list[str], usage: dict[str, object] | None) -> list[bytes]:
    last = len(pieces) - 1
    chunks = [
        {"choices": [{"index": 0, "text": p, "finish_reason": "length" if i == last else None}]}
        for i, p in enumerate(pieces)
    ]
    tail: list[object] = [{"choices": [], "usage": usage}] if usage else []
    return sse(*chunks, *tail, "[DONE]")


async def answer(handler: Handler, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in head[1:] if line)}
    headers[":request-line"] = head[0]
    body = await reader.readexactly(int(headers["content-length"]))
    status, content_type, pieces = handler(headers, body)
    writer.write(f"HTTP/1.1 {status} X\r\ncontent-type: {content_type}\r\ntransfer-encoding: chunked\r\n\r\n".encode())
    for piece in pieces:
        writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
        await writer.drain()
        await asyncio.sleep(0.001)
    writer.write(b"0\r\n\r\n")
    await writer.drain()
    writer.close()


def run_one(
    handler: Handler,
    request: BenchRequest | None = None,
    count_tokens: Callable[[str], int] | None = None,
    endpoint: str = "completions",
    base_url: str | None = None,
) -> RequestRecord:
    request = request or BenchRequest(prompt="hi there", messages=None, prompt_len=None, output_len=3)

    async def go() -> RequestRecord:
        server = await asyncio.start_server(lambda r, w: answer(handler, r, w), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        url = base_url or f"http://127.0.0.1:{port}"
        config = ClientConfig(base_url=url, endpoint=endpoint, model="m", api_key="secret", ignore_eos=True)
        async with server, httpx.AsyncClient(timeout=httpx.Timeout(5.0)) as client:
            return await asyncio.wait_for(send_request(client, config, request, 7, count_tokens), 20)

    return asyncio.run(go())


def streaming(chunks: list[bytes], status: int = 200) -> Handler:
    def handler(headers: dict[str, str], body: bytes) -> Answer:
        assert headers["authorization"] == "Bearer secret"
        assert headers[":request-line"] in ("POST /v1/completions HTTP/1.1", "POST /v1/chat/completions HTTP/1.1")
        assert json.loads(body)["stream"] is True
        return status, "text/event-stream", chunks

    return handler


def test_request_with_usage() -> None:
    usage = {"prompt_tokens": 11, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 8}}
    record = run_one(streaming(completion_chunks(["a", "", "b", "c"], usage)))
    assert record.success, record.error
    assert record.index == 7
    assert len(record.chunk_times) == 3  # the empty chunk carries no text, so no timestamp
    assert record.send_time <= record.chunk_times[0] <= record.chunk_times[-1] <= record.end_time
    assert (record.prompt_tokens, record.output_tokens, record.cached_tokens) == (11, 3, 8)
    assert record.token_count_source == "usage"
    assert record.requested_output_len == 3


def test_request_without_usage_counts_with_tokenizer_or_estimate() -> None:
    chunks = completion_chunks(["abcd", "efgh"], usage=None)
    record = run_one(streaming(chunks))
    # characters / 4: 8 characters out, "hi there" (8 characters) in
    assert (record.output_tokens, record.prompt_tokens, record.token_count_source) == (2, 2, "estimate")
    record = run_one(streaming(chunks), count_tokens=len)
    assert (record.output_tokens, record.prompt_tokens, record.token_count_source) == (8, 8, "tokenizer")


def test_chat_stream_and_reasoning_content() -> None:
    chunks = sse(
        {"choices": [{"delta": {"role": "assistant"}, "finish_reason": None}]},
        {"choices": [{"delta": {"reasoning_content": "hmm"}, "finish_reason": None}]},
        {"choices": [{"delta": {"content": "yes"}, "finish_reason": "stop"}]},
        "[DONE]",
    )
    record = run_one(streaming(chunks), endpoint="chat")
    assert record.success and len(record.chunk_times) == 2


def plain(status: int, content_type: str, body: bytes) -> Handler:
    return lambda headers, request_body: (status, content_type, [body])


@pytest.mark.parametrize(
    ("handler", "message"),
    [
        (plain(500, "application/json", b'{"error": {"message": "out of memory"}}'), "HTTP 500: out of memory"),
        (plain(400, "text/plain", b"no such field"), "HTTP 400: no such field"),
        (
            streaming(sse({"choices": [{"text": "a"}]}, {"error": {"message": "engine died"}})),
            "error event: engine died",
        ),
        (streaming([b'event: error\ndata: {"message": "x"}\n\n']), "error event: x"),
        (streaming(sse({"choices": [{"text": "a"}]})), "the stream ended before [DONE] or a finish_reason"),
        (streaming([b"data: {not json\n\n"]), "not JSON in the stream"),
    ],
)
def test_failures_are_recorded_not_raised(handler: Handler, message: str) -> None:
    record = run_one(handler)
    assert not record.success
    assert record.error.startswith(message)
    assert record.end_time >= record.send_time


def test_connection_error_is_recorded() -> None:
    with socket.socket() as sock:  # a port that was free a moment ago: nothing listens there
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    record = run_one(streaming([]), base_url=f"http://127.0.0.1:{port}")
    assert not record.success and record.error.startswith("ClientConnectorError: Cannot connect")


def run_raw(reply: Callable[[asyncio.StreamWriter], Awaitable[None]], read_timeout: float = 5.0) -> RequestRecord:
    """``send_request`` against a server that reads the request and writes whatever ``reply`` does."""
    request = BenchRequest(prompt="hi", messages=None, prompt_len=None, output_len=3)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:"))
        await reader.readexactly(int(length.split(b":")[1]))
        await reply(writer)
        await writer.drain()
        writer.close()

    async def go() -> RequestRecord:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        config = ClientConfig(base_url=f"http://127.0.0.1:{port}", endpoint="completions", model="m")
        timeout = httpx.Timeout(5.0, read=read_timeout)
        async with server, httpx.AsyncClient(timeout=timeout) as client:
            return await asyncio.wait_for(send_request(client, config, request, 0), 20)

    return asyncio.run(go())


def writes(data: bytes) -> Callable[[asyncio.StreamWriter], Awaitable[None]]:
    async def reply(writer: asyncio.StreamWriter) -> None:
        writer.write(data)

    return reply


OK_CHUNKED = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
OK_LENGTH_10 = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: 10\r\n\r\n"


@pytest.mark.parametrize(
    ("data", "error", "message"),
    [
        (OK_CHUNKED + b"zz\r\nhello\r\n0\r\n\r\n", "ClientResponseError", "chunk size"),  # not a chunk size
        (OK_CHUNKED + b"30\r\ndata: {", "ClientPayloadError", "not completed"),  # closes inside a chunk
        (OK_LENGTH_10 + b"data", "ClientPayloadError", "not completed"),  # closes 6 bytes before the end
        (b"SSH-2.0-OpenSSH_9.6\r\n\r\n", "ClientResponseError", "status line"),  # not HTTP at all
        (b"", "ServerDisconnectedError", "disconnected"),  # closes without a response
    ],
)
def test_malformed_cut_or_non_http_answers_are_recorded(data: bytes, error: str, message: str) -> None:
    record = run_raw(writes(data))
    assert not record.success and record.error.startswith(error + ": "), record.error
    assert message in record.error.lower() and "\n" not in record.error, record.error
    assert "400" not in record.error  # aiohttp's made-up status for what it cannot parse is left out
    assert record.chunk_times == []


def test_read_timeout_while_the_stream_stalls() -> None:
    pieces = completion_chunks(["a", "b", "c", "d"], usage=None)

    async def stall(writer: asyncio.StreamWriter) -> None:
        writer.write(OK_CHUNKED)
        for piece in pieces[:3]:  # three pieces 0.1 s apart: each wait is under the 0.3 s timeout
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            await writer.drain()
            await asyncio.sleep(0.1)
        await asyncio.sleep(1.5)  # then nothing

    record = run_raw(stall, read_timeout=0.3)
    assert not record.success and "Timeout" in record.error, record.error
    assert len(record.chunk_times) == 3  # the pieces before the stall were read, not timed out
    assert 0.5 < record.end_time - record.send_time < 1.4  # 0.2 s of pieces, then the 0.3 s timeout


def test_read_timeout_before_the_response_head() -> None:
    async def silent(writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(1.5)

    record = run_raw(silent, read_timeout=0.3)
    assert not record.success and "Timeout" in record.error, record.error
    assert record.end_time - record.send_time < 1.4


def test_payloads() -> None:
    request = BenchRequest(prompt="p", messages=None, prompt_len=1, output_len=5)
    base = ClientConfig(base_url="http://h:1/", endpoint="completions", model="m")
    payload = build_payload(base, request)
    assert payload == {
        "model": "m",
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.0,
        "prompt": "p",
        "max_tokens": 5,
    }
    assert base.url == "http://h:1/v1/completions" and base.headers() == {}
    chat = ClientConfig(base_url="http://h:1", endpoint="chat", model="m", ignore_eos=True, extra_body={"top_k": 1})
    payload = build_payload(chat, request)
    assert payload["messages"] == [{"role": "user", "content": "p"}]
    assert payload["ignore_eos"] is True and payload["top_k"] == 1 and "prompt" not in payload
    assert chat.url == "http://h:1/v1/chat/completions"
    with pytest.raises(ValueError, match="--endpoint chat"):
        build_payload(
            base,
            BenchRequest(prompt=None, messages=[{"role": "user", "content": "x"}], prompt_len=None, output_len=None),
        )


def test_prefix_cache_counters_from_prometheus_text() -> None:
    text = """
# HELP mini_infer:prefix_cache_hits_total Prompt tokens found in the prefix cache.
# TYPE mini_infer:prefix_cache_hits_total counter
mini_infer:prefix_cache_hits_total{model_name="tiny model"} 30.0
mini_infer:prefix_cache_hits_created{model_name="tiny model"} 1.7e9
mini_infer:prefix_cache_queries_total{model_name="tiny model"} 100.0
mini_infer:prefix_cache_queries_total{model_name="other"} 20.0 1712345678
"""
    assert parse_prefix_cache_counters(text) == (30.0, 120.0)
    assert parse_prefix_cache_counters("vllm:prefix_cache_hits 1\nvllm:prefix_cache_queries 4\n") == (1.0, 4.0)
    assert parse_prefix_cache_counters("process_cpu_seconds_total 3.5\n") is None
