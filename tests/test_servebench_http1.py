"""servebench's HTTP/1.1 reader: bodies come out byte for byte whatever the network cuts (chapter 12).

``StreamedBody`` reads from anything with an async ``read``: here a list of pieces, one per read,
so every cut is exactly where the test puts it. ``post`` is tested against a socket server.
"""

from __future__ import annotations

import asyncio
from typing import cast

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mini_infer.bench.serve.http1 import ProtocolError, StreamedBody, post


class Pieces:
    """A stand-in for ``asyncio.StreamReader``: each ``read`` returns the next piece, then b""."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = list(pieces)

    async def read(self, n: int) -> bytes:
        return self.pieces.pop(0) if self.pieces else b""


class NoWriter:
    def close(self) -> None:
        pass


def cut(data: bytes, cuts: list[int]) -> list[bytes]:
    points = [0, *sorted({c for c in cuts if 0 < c < len(data)}), len(data)]
    return [data[a:b] for a, b in zip(points, points[1:])]


def body(data: bytes, cuts: list[int], headers: dict[str, str]) -> list[bytes]:
    reader = cast(asyncio.StreamReader, Pieces(cut(data, cuts)))

    async def go() -> list[bytes]:
        response = StreamedBody(reader, cast(asyncio.StreamWriter, NoWriter()), 200, headers, 5.0)
        try:
            return [piece async for piece in response.pieces()]
        finally:
            response.close()

    return asyncio.run(go())


def chunked(parts: list[bytes]) -> bytes:
    # upper- and lower-case hex, and a chunk extension on every other chunk (to be ignored)
    out = b""
    for i, part in enumerate(parts):
        size = b"%X" % len(part) if i % 2 else b"%x;name=value" % len(part)
        out += size + b"\r\n" + part + b"\r\n"
    return out + b"0\r\n\r\n"


PAYLOAD = b'data: {"choices": [{"text": "h\xc3\xa9llo"}]}\n\ndata: [DONE]\n\n' * 3


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(min_value=1, max_value=len(PAYLOAD)), max_size=8),
    st.lists(st.integers(min_value=0, max_value=400), max_size=30),
)
def test_chunked_body_whatever_the_cuts(splits: list[int], cuts: list[int]) -> None:
    parts = [p for p in cut(PAYLOAD, splits) if p]
    pieces = body(chunked(parts) + b"ignored after the last chunk", cuts, {"transfer-encoding": "chunked"})
    assert b"".join(pieces) == PAYLOAD
    assert all(pieces)  # never an empty piece


def test_chunked_body_byte_by_byte_and_whole() -> None:
    data = chunked([PAYLOAD[:10], PAYLOAD[10:]])
    assert b"".join(body(data, list(range(len(data))), {"transfer-encoding": "chunked"})) == PAYLOAD
    # one read holding everything: one piece, all chunks joined
    assert body(data, [], {"transfer-encoding": "chunked"}) == [PAYLOAD]


def test_content_length_and_read_to_close() -> None:
    assert b"".join(body(b"0123456789extra", [3, 7], {"content-length": "10"})) == b"0123456789"
    assert b"".join(body(b"0123456789", [3, 7], {})) == b"0123456789"
    assert body(b"", [], {"content-length": "0"}) == []


@pytest.mark.parametrize(
    ("data", "headers", "message"),
    [
        (b"zz\r\nhello\r\n0\r\n\r\n", {"transfer-encoding": "chunked"}, "bad chunk size"),
        (b"-1\r\nhello\r\n0\r\n\r\n", {"transfer-encoding": "chunked"}, "bad chunk size"),
        (b"5\r\nhel", {"transfer-encoding": "chunked"}, "closed inside a chunked body"),
        (b"01234", {"content-length": "10"}, "closed 5 bytes before the end"),
    ],
)
def test_malformed_or_cut_bodies_raise(data: bytes, headers: dict[str, str], message: str) -> None:
    with pytest.raises(ProtocolError, match=message):
        body(data, [2], headers)


def test_post_sends_the_request_and_reads_the_head() -> None:
    seen: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(await reader.readuntil(b"\r\n\r\n"))
        seen.append(await reader.readexactly(7))
        writer.write(b"HTTP/1.1 201 Created\r\nX-Thing:  a b \r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        writer.close()

    async def go() -> tuple[int, dict[str, str], bytes]:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            response = await post(f"http://127.0.0.1:{port}/v1/x?q=1", b'{"a":1}', {"Authorization": "Bearer k"}, 5, 5)
            try:
                return response.status, response.headers, await response.read()
            finally:
                response.close()

    status, headers, data = asyncio.run(go())
    assert (status, headers["x-thing"], data) == (201, "a b", b"ok")
    head = seen[0].decode()
    assert head.startswith("POST /v1/x?q=1 HTTP/1.1\r\n")
    assert "\r\nContent-Length: 7\r\n" in head and "\r\nAuthorization: Bearer k\r\n" in head
    assert seen[1] == b'{"a":1}'


@pytest.mark.parametrize(
    ("reply", "error", "message"),
    [
        (b"SSH-2.0-OpenSSH\r\n\r\n", ProtocolError, "not an HTTP/1.1 status line"),
        (b"", ProtocolError, "closed the connection without a response"),
        (None, TimeoutError, "no response from the server in 0.2 s"),
    ],
)
def test_post_refuses_what_is_not_http(reply: bytes | None, error: type[Exception], message: str) -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        if reply is None:
            await asyncio.sleep(1)
        writer.write(reply or b"")
        writer.close()

    async def go() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            await post(f"http://127.0.0.1:{port}/", b"", {}, 5, 0.2)

    with pytest.raises(error, match=message):
        asyncio.run(go())
    with pytest.raises(ValueError, match="http:// or https://"):
        asyncio.run(post("ftp://x/", b"", {}, 1, 1))


def test_read_timeout_while_the_stream_stalls() -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(3):  # three pieces 0.1 s apart: each wait is under the 0.25 s timeout
            writer.write(b"2\r\nok\r\n")
            await writer.drain()
            await asyncio.sleep(0.1)
        await asyncio.sleep(1)  # then nothing
        writer.close()

    async def go() -> list[bytes]:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        got: list[bytes] = []
        async with server:
            response = await post(f"http://127.0.0.1:{port}/", b"", {}, 5, 0.25)
            try:
                async for piece in response.pieces():
                    got.append(piece)
            finally:
                response.close()
                assert got == [b"ok"] * 3
        return got

    with pytest.raises(TimeoutError, match="no bytes from the server in 0.25 s"):
        asyncio.run(go())
