"""Run a server in a background thread: for tests and notebooks (chapter 11).

A notebook cell cannot block on ``uvicorn.run``; a test wants a real socket. ``BackgroundServer``
runs uvicorn in a daemon thread on a socket it binds itself (port 0: the OS picks a free port,
so parallel runs never collide), and waits until the server is listening::

    with BackgroundServer(build_app(ServerConfig(model="tiny"))) as server:
        server.wait_ready()                      # /health answers 200: the model is loaded
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none")

Loopback only by default. Every wait is bounded. ``wait_until_healthy`` is the same wait for a
server in another process (``bench_overhead``); the shell scripts that start ``mini-infer serve``
(``scripts/bench_serve.sh``, ``scripts/compare_servebench.sh``) wait with
``python -m mini_infer.server.background URL PID``.
"""

from __future__ import annotations

import argparse
import os
import socket
import threading
import time
from collections.abc import Callable
from types import TracebackType

import httpx
import uvicorn
from fastapi import FastAPI


class BackgroundServer:
    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning") -> None:
        self.app = app
        # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on sockets that say so, and without it
        # Nagle and delayed ACKs add 40 ms to every response.
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, port))
        self.host, self.port = self._socket.getsockname()[:2]
        config = uvicorn.Config(app, log_level=log_level, lifespan="on", timeout_graceful_shutdown=5)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]}, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the server thread exited during startup")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server did not start within {timeout} s")
            time.sleep(0.02)
        return self

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Wait until ``/health`` answers 200 (the model is loaded)."""
        wait_until_healthy(self.base_url, timeout, alive=self._thread.is_alive, poll_s=0.05)

    def stop(self, timeout: float = 15.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout)
        self._socket.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def wait_until_healthy(
    base_url: str, timeout: float, alive: Callable[[], bool] = lambda: True, poll_s: float = 0.2
) -> None:
    """Poll ``GET /health`` until it answers 200. ``RuntimeError`` as soon as ``alive()`` says the
    server is gone (no point waiting out the timeout), ``TimeoutError`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    with httpx.Client(base_url=base_url, timeout=5.0) as client:
        while True:
            if not alive():
                raise RuntimeError(f"the server at {base_url} exited before it was ready")
            try:
                if client.get("/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server at {base_url} was not ready within {timeout} s")
            time.sleep(poll_s)


def process_alive(pid: int) -> Callable[[], bool]:
    """``alive`` for ``wait_until_healthy``: does process ``pid`` still exist?"""

    def alive() -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True

    return alive


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m mini_infer.server.background",
        description="Wait until the server at URL, run by process PID, answers GET /health with 200.",
    )
    parser.add_argument("url", help="the server's base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("pid", type=int, help="the server's process id: stop waiting as soon as it exits")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds to wait at most (default 300)")
    args = parser.parse_args(argv)
    try:
        wait_until_healthy(args.url, args.timeout, process_alive(args.pid))
    except (RuntimeError, TimeoutError) as error:
        raise SystemExit(f"error: {error}") from None


if __name__ == "__main__":
    main()
