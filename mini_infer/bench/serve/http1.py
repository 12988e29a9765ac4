"""The few bytes of HTTP/1.1 a streaming benchmark needs, on asyncio streams (chapter 12).

Why not httpx, as everywhere else: a benchmark client must measure the server, not itself. At
request rate inf every streamed token is one chunk of the response, and through httpx each one
passes h11's event machine, httpcore's per-event context managers and anyio's stream wrappers
before servebench sees it: about half of servebench's CPU time per chunk, measured against a fake
server that streams 10,000 chunks a second (SGLang's client, on aiohttp's C parser, spent half of
what servebench did, and servebench's one core saturated: its TTFT grew with its own backlog).
Here one network read is de-chunked with ``bytes.find`` and handed on whole.

What it does: ``post`` sends one POST (``Connection: close``, a new connection per request, as
SGLang's client does with its session per request), reads the status line and headers, and ``StreamedBody.pieces``
yields the body as it arrives, de-chunked (``Transfer-Encoding: chunked``), cut by
``Content-Length``, or read to the end of the connection. ``http://`` and ``https://`` (the
system's certificate store; the tests cover only http); no proxies, redirects, compression or HTTP/2. The timeouts bound the
connection and each wait for bytes (httpx's connect and read timeouts, from the caller's client).

Invariants, kept by the tests: the body comes out byte for byte whatever the network cuts;
a malformed response or a connection cut inside the body raises ``ProtocolError``.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Mapping
from urllib.parse import urlsplit

READ_SIZE = 1 << 16
MAX_HEADER_BYTES = 1 << 16


class ProtocolError(Exception):
    """The server's answer is not HTTP/1.1 as expected, or it stopped inside the response."""


class StreamedBody:
    """A response's status, headers (names in lower case) and a way to read its body once."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        status: int,
        headers: dict[str, str],
        timeout: float | None,
    ) -> None:
        self.status, self.headers = status, headers
        self._reader, self._writer, self._timeout = reader, writer, timeout
        # The read timeout is one timer per response that moves with the last read, not a
        # wait_for per read, which made a task and a timer per network read (a third of the
        # client's time per token at saturation, measured).
        self._loop = asyncio.get_running_loop()
        self._last_read, self._timed_out = self._loop.time(), False
        self._timer = None if timeout is None else self._loop.call_at(self._last_read + timeout, self._watch)

    def _watch(self) -> None:
        assert self._timeout is not None
        deadline = self._last_read + self._timeout
        if self._loop.time() < deadline:
            self._timer = self._loop.call_at(deadline, self._watch)
            return
        self._timed_out = True
        self._writer.transport.abort()  # the pending read returns b"" at once

    async def _read(self) -> bytes:
        data = await self._reader.read(READ_SIZE)
        if self._timed_out:
            raise TimeoutError(f"no bytes from the server in {self._timeout} s")
        self._last_read = self._loop.time()
        return data

    async def pieces(self) -> AsyncIterator[bytes]:
        """The body as it arrives: one piece per network read (never empty)."""
        encoding = self.headers.get("transfer-encoding", "").lower()
        if "chunked" in encoding:
            async for piece in self._dechunk():
                yield piece
            return
        length = self.headers.get("content-length")
        left = int(length) if length is not None and length.strip().isdigit() else None
        data = b""
        while True:
            if left is not None:
                data = data[:left]
                left -= len(data)
            if data:
                yield data
            if left == 0:
                return
            data = await self._read()
            if not data:
                if left is not None:
                    raise ProtocolError(f"the connection closed {left} bytes before the end of the body")
                return

    async def _dechunk(self) -> AsyncIterator[bytes]:
        # One pass over each read with an index (no copies of the rest): ``left`` bytes of the
        # current chunk's data are still to come, then ``skip`` bytes of the CRLF after them.
        buffer, pos, left, skip = b"", 0, 0, 0
        while True:
            out = []
            n = len(buffer)
            while True:
                if skip:
                    step = min(skip, n - pos)
                    pos, skip = pos + step, skip - step
                    if skip:
                        break
                if left:
                    end = min(pos + left, n)
                    if end > pos:
                        out.append(buffer[pos:end])
                    left, pos = left - (end - pos), end
                    if left:
                        break
                    skip = 2
                    continue
                end = buffer.find(b"\r\n", pos)
                if end < 0:
                    if n - pos > MAX_HEADER_BYTES:
                        raise ProtocolError("a chunk size line without its end")
                    break
                try:
                    left = int(buffer[pos:end].split(b";", 1)[0], 16)
                except ValueError:
                    left = -1
                if left < 0:
                    raise ProtocolError(f"bad chunk size {bytes(buffer[pos:end][:40])!r}")
                pos = end + 2
                if left == 0:  # the last chunk (trailers, if any, do not matter here)
                    if out:
                        yield b"".join(out)
                    return
            if out:
                yield b"".join(out)
            data = await self._read()
            if not data:
                raise ProtocolError("the connection closed inside a chunked body")
            buffer, pos = buffer[pos:] + data, 0

    async def read(self) -> bytes:
        return b"".join([piece async for piece in self.pieces()])

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._writer.close()


async def post(
    url: str, body: bytes, headers: Mapping[str, str], connect_timeout: float | None, read_timeout: float | None
) -> StreamedBody:
    """Send a POST of ``body`` to ``url`` and read the response's head; the body is read after.

    Raises ``OSError`` (cannot connect), ``TimeoutError`` and ``ProtocolError``; the caller closes
    the returned body. A timeout of None waits for ever.
    """
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{url!r}: expected an http:// or https:// URL")
    tls = ssl.create_default_context() if parts.scheme == "https" else None
    port = parts.port or (443 if tls else 80)
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(parts.hostname, port, ssl=tls, limit=MAX_HEADER_BYTES), connect_timeout
        )
    except asyncio.TimeoutError:
        raise TimeoutError(f"could not connect to {parts.netloc} in {connect_timeout} s") from None
    try:
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        lines = [f"POST {target} HTTP/1.1", f"Host: {parts.netloc}", f"Content-Length: {len(body)}"]
        lines += ["Content-Type: application/json", "Accept: text/event-stream", "Connection: close"]
        lines += [f"{name}: {value}" for name, value in headers.items()]
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), read_timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"no response from the server in {read_timeout} s") from None
        except asyncio.IncompleteReadError:
            raise ProtocolError("the server closed the connection without a response") from None
        except asyncio.LimitOverrunError:
            raise ProtocolError("response headers over 64 KiB") from None
        status_line, *header_lines = head.decode("latin-1").split("\r\n")
        version, _, rest = status_line.partition(" ")
        if not version.startswith("HTTP/1.") or not rest[:3].isdigit():
            raise ProtocolError(f"not an HTTP/1.1 status line: {status_line[:80]!r}")
        response_headers = {}
        for line in header_lines:
            name, sep, value = line.partition(":")
            if sep:
                response_headers[name.strip().lower()] = value.strip()
        return StreamedBody(reader, writer, int(rest[:3]), response_headers, read_timeout)
    except BaseException:
        writer.close()
        raise
