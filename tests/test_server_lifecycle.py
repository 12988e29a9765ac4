"""The server's life: loading, a dead engine, a model that cannot load (chapter 11).

``/health`` says 503 until the engine is ready and after it died; an exception in the engine
loop fails every waiting request (a stream gets one error event, then ``[DONE]``), and later
requests get 503 instead of hanging.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from mini_infer.engine import LLMEngine
from mini_infer.engine_builder import EngineConfig, build_engine
from mini_infer.server import BackgroundServer, ServerConfig, build_app
from mini_infer.server import cli as server_cli

pytestmark = pytest.mark.timeout(180)  # a hung socket or thread fails its test, not the run

MODEL = "tiny-life"
CHAT: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def error_of(response: httpx.Response) -> dict[str, Any]:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_503_while_loading_then_ready(tiny_model_dir: Path) -> None:
    release = threading.Event()

    def slow_factory() -> LLMEngine:
        assert release.wait(timeout=60)
        return build_engine(
            EngineConfig(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=64, show_progress=False)
        )

    config = ServerConfig(model=str(tiny_model_dir), served_model_name=MODEL, show_progress=False)
    with (
        BackgroundServer(build_app(config, engine_factory=slow_factory)) as server,
        httpx.Client(base_url=server.base_url) as http,
    ):
        response = http.get("/health")
        assert response.status_code == 503 and "loading" in error_of(response)["message"]
        response = http.post("/v1/chat/completions", json=CHAT)
        assert response.status_code == 503 and error_of(response)["code"] == "engine_unavailable"
        assert http.get("/v1/models").json()["data"][0]["id"] == MODEL
        assert http.get("/metrics").status_code == 200
        release.set()
        server.wait_ready(timeout=60)
        assert http.post("/v1/chat/completions", json=CHAT).status_code == 200


@pytest.fixture()
def fragile_server(tiny_model_dir: Path) -> Iterator[tuple[BackgroundServer, threading.Event]]:
    """A server whose engine raises in ``step`` once ``broken`` is set."""
    broken = threading.Event()

    def factory() -> LLMEngine:
        engine = build_engine(
            EngineConfig(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=256, show_progress=False)
        )
        step = engine.step

        def failing_step() -> Any:
            if broken.is_set():
                raise RuntimeError("simulated failure in the forward pass")
            return step()

        engine.step = failing_step
        return engine

    config = ServerConfig(model=str(tiny_model_dir), served_model_name=MODEL, show_progress=False)
    with BackgroundServer(build_app(config, engine_factory=factory)) as server:
        server.wait_ready(timeout=60)
        yield server, broken


def test_engine_death_fails_waiting_requests_and_marks_the_server_dead(
    fragile_server: tuple[BackgroundServer, threading.Event],
) -> None:
    server, broken = fragile_server
    long = {"model": MODEL, "prompt": "hello", "max_tokens": 1500, "ignore_eos": True}
    with httpx.Client(base_url=server.base_url, timeout=30) as http, ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(http.post, "/v1/completions", json=long)  # not streaming
        with http.stream("POST", "/v1/completions", json=dict(long, stream=True)) as response:
            lines = response.iter_lines()
            first = next(line for line in lines if line)
            assert json.loads(first.removeprefix("data: "))["object"] == "text_completion"
            broken.set()
            rest = [line for line in lines if line]
        # The stream ends with one error event, then [DONE].
        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2].removeprefix("data: "))
        assert set(error) == {"error"} and "simulated failure" in error["error"]["message"]
        assert all("error" not in json.loads(line.removeprefix("data: ")) for line in rest[:-2])
        result = waiting.result(timeout=30)
        assert result.status_code == 503 and "simulated failure" in error_of(result)["message"]
        assert http.get("/health").status_code == 503
        response = http.post("/v1/chat/completions", json=CHAT)
        assert response.status_code == 503 and "simulated failure" in error_of(response)["message"]
        assert http.get("/metrics").status_code == 200
        with pytest.raises(Exception, match="not running"):
            server.app.state.server.engine.call(lambda e: None).result(timeout=10)


def test_openai_client_sees_a_stream_error(fragile_server: tuple[BackgroundServer, threading.Event]) -> None:
    server, broken = fragile_server
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=30) as client:
        stream = client.chat.completions.create(model=MODEL, messages=CHAT["messages"], max_tokens=1500, stream=True)
        with pytest.raises(openai.APIError, match="simulated failure"):
            for i, _ in enumerate(stream):
                if i == 1:
                    broken.set()


def test_serve_exits_when_the_model_cannot_load(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    server_cli.add_arguments(parser)
    args = parser.parse_args(["--model", str(tmp_path / "missing"), "--port", "0", "--log-level", "error"])
    started = time.monotonic()
    assert server_cli.main(args) == 1
    assert time.monotonic() - started < 60


def test_serve_arguments() -> None:
    parser = argparse.ArgumentParser()
    server_cli.add_arguments(parser)
    args = parser.parse_args([])
    assert (args.model, args.host, args.port, args.api_key, args.served_model_name) == (
        "tiny",
        "127.0.0.1",
        8000,
        None,
        None,
    )
    args = parser.parse_args(["--max-body-bytes", "0"])
    assert server_cli.main(args) == 2
