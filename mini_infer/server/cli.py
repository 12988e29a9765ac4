"""``mini-infer serve``: start the OpenAI-compatible server (chapter 11).

    mini-infer serve --model tiny --port 8000
    curl localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \\
         -d '{"model": "tiny", "messages": [{"role": "user", "content": "What is 2 + 3?"}]}'

The server listens at once; the model loads in the engine thread (with a progress bar) while
``/health`` answers 503. If loading fails the server stops with exit code 1: a server that can
never answer should not pretend to be starting. If the engine fails later, the server stays up
and says so (503 on ``/health`` and on every request) so that a supervisor can see it.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from mini_infer.cli_options import add_engine_args, engine_kwargs
from mini_infer.server import DEFAULT_MAX_BODY_BYTES

API_KEY_ENV = "MINI_INFER_API_KEY"
_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser)
    parser.add_argument("--served-model-name", default=None, help="the model name clients use (default: --model)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--api-key", default=None, help=f"require 'Authorization: Bearer KEY' (default: ${API_KEY_ENV})"
    )
    parser.add_argument(
        "--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, help="largest request body accepted"
    )
    parser.add_argument(
        "--cors-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="let web pages of ORIGIN (https://example.org) call the API from a browser; repeatable (default: none)",
    )
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def main(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from mini_infer.server.app import build_app
        from mini_infer.server.serving import ServerConfig
    except ImportError as exc:
        print(
            f"mini-infer serve: error: {exc}; install the server extra: pip install 'mini-infer[server]'",
            file=sys.stderr,
        )
        return 2

    if args.max_body_bytes < 1:
        print("mini-infer serve: error: --max-body-bytes must be positive", file=sys.stderr)
        return 2
    if not 0 <= args.port < 65536:
        print(f"mini-infer serve: error: --port {args.port} is not a port number", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s:     %(name)s: %(message)s")
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    if api_key is None and args.host not in _LOOPBACK:
        logging.getLogger("mini_infer.server").warning(
            "listening on %s without an API key: anyone who can reach it can use it", args.host
        )
    config = ServerConfig(
        model=args.model,
        served_model_name=args.served_model_name,
        api_key=api_key,
        max_body_bytes=args.max_body_bytes,
        cors_origins=tuple(args.cors_origin),
        engine_kwargs=engine_kwargs(args),
        show_progress=True,
    )
    app = build_app(config)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level))
    return asyncio.run(_serve(server, app))


async def _serve(server: object, app: object) -> int:
    import uvicorn
    from fastapi import FastAPI

    from mini_infer.server.async_engine import EngineState

    assert isinstance(server, uvicorn.Server) and isinstance(app, FastAPI)
    state = app.state.server
    serving = asyncio.ensure_future(server.serve())
    while not server.started and not serving.done():
        await asyncio.sleep(0.05)
    if serving.done():
        await serving
        return 1  # could not start (the port is taken, say); uvicorn has said why
    settled = asyncio.ensure_future(state.engine.wait_settled())
    await asyncio.wait({serving, settled}, return_when=asyncio.FIRST_COMPLETED)
    if settled.done() and settled.result() is EngineState.DEAD and state.engine.info is None:
        logging.getLogger("mini_infer.server").error("%s; stopping", state.engine.error)
        server.should_exit = True
        await serving
        return 1
    await serving
    settled.cancel()
    return 0
