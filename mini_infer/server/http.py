"""HTTP plumbing: reading bodies safely, server-sent events, noticing clients that leave (chapter 11).

Three things a framework does not do the way an inference server needs them:

* **Bodies are read by hand** (``read_json_body``): the declared Content-Length and the bytes
  actually received are both held to a limit (413), the bytes must be UTF-8 and the JSON an
  object (400), and NaN or infinite numbers are refused. Handlers never let FastAPI parse a body,
  so there is no 422 anywhere: every failure is an OpenAI-shaped 400.
* **A client that leaves is noticed** (``run_until_disconnect``). After the body, the ASGI
  ``receive`` channel has nothing more to say until the client disconnects, so one task waits on
  it while another does the work; whichever ends first decides. A departure cancels the work,
  whose ``finally`` aborts the engine requests, and so frees their blocks at the next step,
  without polling and whether the response streams or not.
* **Server-sent events** (``EventStreamResponse``): ``data: {...}\\n\\n`` chunks, sent as the
  engine produces them, with the same departure watch.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from collections.abc import AsyncGenerator, Coroutine
from typing import Any, TypeVar

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from mini_infer.server.protocol import APIError, bad_request, dumps

T = TypeVar("T")

# HTTP 499 (nginx's "client closed request"): nobody reads it, but logs show what happened.
CLIENT_CLOSED = 499


def json_response(body: Any, status_code: int = 200) -> Response:
    return Response(dumps(body).encode(), status_code=status_code, media_type="application/json")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text} is out of range")
    return value


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


async def read_json_body(request: Request, max_bytes: int) -> dict[str, Any]:
    """The request's JSON object, or an ``APIError`` (400, 413 for a body over ``max_bytes``, 499
    for a client that left before sending all of it)."""
    content_type = request.headers.get("content-type", "")
    media_type, _, params = content_type.partition(";")
    if media_type.strip().lower() != "application/json":
        raise bad_request(
            f"Content-Type must be application/json, got {content_type or 'none'!r}", code="invalid_content_type"
        )
    charset = params.strip().lower()
    if charset and charset.replace(" ", "") not in ("charset=utf-8", 'charset="utf-8"'):
        raise bad_request(f"JSON bodies must be UTF-8, got {params.strip()!r}", code="invalid_content_type")
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise bad_request(f"invalid Content-Length {declared!r}")
        if int(declared) > max_bytes:
            raise _too_large(int(declared), max_bytes)
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            # The declared length is the client's word; the bytes are the fact.
            if len(body) > max_bytes:
                raise _too_large(len(body), max_bytes)
    except ClientDisconnect:
        # The client left before its body arrived: its doing, not a server error (no 500, no
        # traceback in the log); the answer goes nowhere, the status shows in the access log.
        raise APIError(
            CLIENT_CLOSED, "the client closed the connection before sending its whole body", code="client_closed"
        ) from None
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(f"the request body is not valid UTF-8 (byte {exc.start})") from None
    try:
        obj = json.loads(text, parse_float=_finite_float, parse_constant=_no_constants)
    except RecursionError:
        raise bad_request("the request body is nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, and ints too long for Python to parse
        raise bad_request(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(obj).__name__}")
    if "\\ud" in text or "\\uD" in text:
        # A "\ud800" escape decodes to a lone surrogate: a str that no tokenizer can encode.
        try:
            json.dumps(obj, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise bad_request("the request body contains a lone surrogate (an invalid \\u escape)") from None
        except RecursionError:
            raise bad_request("the request body is nested too deeply") from None
    return obj


def _too_large(size: int, limit: int) -> APIError:
    return APIError(
        413, f"the request body ({size} bytes or more) is over the limit of {limit} bytes", code="request_too_large"
    )


async def _wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def run_until_disconnect(receive: Receive, work: Coroutine[Any, Any, T]) -> tuple[bool, T | None]:
    """Run ``work`` until it ends or the client disconnects; returns (disconnected, result).

    Call it once the body has been read. On a disconnect the work is cancelled (its ``finally``
    blocks run before this returns).
    """
    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.ensure_future(_wait_for_disconnect(receive))
    try:
        done, _ = await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
        if work_task in done:
            return False, work_task.result()
        work_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await work_task
        return True, None
    finally:
        # Also on our own cancellation (the server stopping): nothing may outlive the request.
        for task in (work_task, watch_task):
            task.cancel()


class EventStreamResponse(StreamingResponse):
    """``text/event-stream`` from an async generator of ready-made ``data: ...`` strings.

    When the client disconnects the generator is closed, so its ``finally`` runs (and aborts).
    """

    def __init__(self, events: AsyncGenerator[str, None]) -> None:
        super().__init__(
            events,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self.events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})

        async def pump() -> None:
            try:
                async for event in self.events:
                    await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            except OSError:
                pass  # the client is gone (servers that report it by failing the send)
            finally:
                await self.events.aclose()

        await run_until_disconnect(receive, pump())
