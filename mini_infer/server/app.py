"""The FastAPI app: routes, API keys, and OpenAI-shaped errors everywhere (chapter 11).

Routes::

    POST /v1/chat/completions   POST /v1/completions   GET /v1/models[/{model}]
    POST /tokenize              POST /detokenize
    GET  /health (200 once the engine is ready; 503 while loading and after it died)
    GET  /metrics (Prometheus text format)

Every error, whatever raised it (our validation, an unknown route, a wrong method, a bug), is
answered as ``{"error": {"message", "type", "param", "code"}}``. There is no 422: handlers read
their bodies themselves (``http.read_json_body``), so FastAPI never validates one.

With an API key (``--api-key`` or ``MINI_INFER_API_KEY``) every route but ``/health`` wants
``Authorization: Bearer <key>``; the check is a constant-time comparison, and it happens before
the body is read, so an unauthenticated client cannot make the server read a large body.

Invariant: the app starts the engine thread on startup and stops it on shutdown; handlers
reach the engine only through ``ServerState.engine`` (the ``AsyncEngine``).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from mini_infer.engine import LLMEngine
from mini_infer.server.async_engine import EngineState, EngineUnavailableError
from mini_infer.server.chat import create_chat_completion
from mini_infer.server.completions import create_completion
from mini_infer.server.http import json_response, read_json_body
from mini_infer.server.metrics import EngineSnapshot, take_snapshot
from mini_infer.server.protocol import (
    APIError,
    DetokenizeRequest,
    TokenizeRequest,
    bad_request,
    dumps,
    error_body,
    parse_request,
)
from mini_infer.server.serving import ServerConfig, ServerState, check_token_ids, unavailable

logger = logging.getLogger("mini_infer.server")

OPEN_PATHS = frozenset({"/health"})
_METRICS_TIMEOUT_S = 5.0


class APIKeyMiddleware:
    """Refuse requests without ``Authorization: Bearer <key>`` (plain ASGI: streaming untouched)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            header = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            scheme, _, token = header.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self._key):
                body = error_body(
                    "Incorrect or missing API key: send 'Authorization: Bearer <key>'.",
                    type="invalid_request_error",
                    code="invalid_api_key",
                )
                await json_response(body, 401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(config: ServerConfig, engine_factory: Callable[[], LLMEngine] | None = None) -> FastAPI:
    """An app serving one model; ``engine_factory`` overrides how the engine is built (tests)."""
    state = ServerState(config, engine_factory)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        logger.info("loading model %s (the server answers 503 on /health until it is ready)", config.model)
        state.engine.start()
        try:
            yield
        finally:
            await state.engine.shutdown()
            state.close()

    app = FastAPI(title="mini-infer", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state
    _install_error_handlers(app)
    if config.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=config.api_key)
    if config.cors_origins:  # off unless asked for; added last, so preflights need no API key
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(config.cors_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type"],
        )

    async def body_of(request: Request) -> dict[str, Any]:
        return await read_json_body(request, config.max_body_bytes)

    @app.get("/health")
    async def health() -> Response:
        if state.engine.state is EngineState.READY:
            return json_response({"status": "ok"})
        reason = state.engine.unavailable() or "the engine is not running"
        return json_response(unavailable(reason).body(), 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        snapshot: EngineSnapshot | None = None
        if state.engine.state is EngineState.READY:
            try:
                future = state.engine.call(take_snapshot)
                snapshot = await asyncio.wait_for(asyncio.wrap_future(future), _METRICS_TIMEOUT_S)
            except (EngineUnavailableError, asyncio.TimeoutError):
                snapshot = None  # the last snapshot stands
        return Response(state.metrics.render(snapshot), media_type="text/plain; version=0.0.4; charset=utf-8")

    def model_card() -> dict[str, Any]:
        card: dict[str, Any] = {
            "id": state.model_name,
            "object": "model",
            "created": state.created,
            "owned_by": "mini-infer",
        }
        if state.engine.info is not None:
            card["max_model_len"] = state.engine.info.max_model_len
        return card

    @app.get("/v1/models")
    async def list_models() -> Response:
        return json_response({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str) -> Response:
        state.check_model(model)
        return json_response(model_card())

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await create_chat_completion(state, request, await body_of(request))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await create_completion(state, request, await body_of(request))

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        req = parse_request(TokenizeRequest, await body_of(request))
        state.check_model(req.model)
        info, tokenizer = state.ready()

        def run() -> list[int]:
            if req.prompt is not None:
                return tokenizer.encode(req.prompt)
            assert req.messages is not None
            tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
            add = True if req.add_generation_prompt is None else req.add_generation_prompt
            try:
                text = tokenizer.apply_chat_template(
                    [m.to_template() for m in req.messages], tools=tools, add_generation_prompt=add
                )
            except Exception as exc:
                raise bad_request(
                    f"the chat template could not render these messages: {exc}", param="messages"
                ) from None
            return tokenizer.encode(text)

        tokens = await state.in_tokenizer_thread(run)
        return json_response({"count": len(tokens), "max_model_len": info.max_model_len, "tokens": tokens})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        req = parse_request(DetokenizeRequest, await body_of(request))
        state.check_model(req.model)
        info, tokenizer = state.ready()
        check_token_ids(req.tokens, info, "tokens")
        # Special tokens kept: detokenize(tokenize(x)) gives x back, chat markers included.
        text = await state.in_tokenizer_thread(lambda: tokenizer.decode(req.tokens, skip_special_tokens=False))
        return json_response({"prompt": text})

    return app


def _install_error_handlers(app: FastAPI) -> None:
    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, APIError)
        return json_response(exc.body(), exc.status_code)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        if exc.status_code == 404:
            message = f"Unknown route: {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"Method {request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return Response(
            dumps(error_body(message, type=kind, code=code)).encode(),
            status_code=exc.status_code,
            media_type="application/json",
            headers=getattr(exc, "headers", None),
        )

    async def validation_error(request: Request, exc: Exception) -> Response:
        # Unused by our routes (they parse bodies themselves), kept so that no 422 can escape.
        return json_response(bad_request(f"invalid request: {exc}").body(), 400)

    async def internal_error(request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error in %s %s", request.method, request.url.path, exc_info=exc)
        message = f"internal server error: {type(exc).__name__}: {exc}"[:500]  # the cause, named
        body = error_body(message, type="server_error", code="internal_error")
        return json_response(body, 500)

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(Exception, internal_error)
