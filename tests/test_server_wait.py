"""``python -m mini_infer.server.background URL PID``: the wait the shell scripts use before they
send a server its first request (chapter 11)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from fastapi import FastAPI, Response

from mini_infer.server import BackgroundServer

WAIT = [sys.executable, "-m", "mini_infer.server.background"]


def test_waits_until_health_answers_200() -> None:
    app, ready_at = FastAPI(), time.monotonic() + 1.5

    @app.get("/health")
    def health() -> Response:  # 503 while "loading", as the real server answers
        return Response(status_code=200 if time.monotonic() > ready_at else 503)

    with BackgroundServer(app) as server:
        done = subprocess.run([*WAIT, server.base_url, str(os.getpid())], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert time.monotonic() > ready_at  # it waited for the 200, not for the first answer


def test_stops_at_once_when_the_server_process_is_gone() -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    start = time.monotonic()
    done = subprocess.run([*WAIT, "http://127.0.0.1:9", str(gone.pid)], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "exited before it was ready" in done.stderr
    assert time.monotonic() - start < 30  # not the 300 s timeout


def test_gives_up_after_its_timeout() -> None:

    done = subprocess.run(
        [*WAIT, "http://127.0.0.1:9", str(os.getpid()), "--timeout", "1"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode != 0 and "was not ready within 1.0 s" in done.stderr
