"""servebench end to end against a fake OpenAI-compatible server in this process (chapter 12).

The fake (FastAPI + uvicorn on 127.0.0.1, a free port, in a thread) streams one word per
requested token with a short sleep between chunks, returns usage, keeps prefix-cache counters
on ``/metrics``, and can be told to fail every k-th request: alternately with HTTP 500 and with
an error event in the middle of the stream. Everything is bounded: few requests, short
sleeps, and a time limit on every wait.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import uvicorn  # noqa: E402
from fastapi import FastAPI, Request  # noqa: E402
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse  # noqa: E402

from mini_infer.bench.serve.cli import cli_main  # noqa: E402
from mini_infer.bench.serve.metrics import RequestRecord, compute_metrics  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@dataclass
class FakeState:
    fail_every: int = 0  # 0: never
    send_usage: bool = True
    report_cached_tokens: bool = False
    api_key: str | None = None
    chunk_sleep_s: float = 0.002
    count: int = 0
    hits: int = 0
    queries: int = 0
    seen_system_prompts: set[str] = field(default_factory=set)
    bodies: list[dict[str, Any]] = field(default_factory=list)


def words(text: str) -> int:
    return len(text.split())


def make_app(state: FakeState) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(
            f"# TYPE mini_infer:prefix_cache_hits_total counter\nmini_infer:prefix_cache_hits_total {state.hits}.0\n"
            f'mini_infer:prefix_cache_queries_total{{model_name="fake"}} {state.queries}.0\n'
        )

    async def generate(request: Request, chat: bool) -> Response:
        if state.api_key and request.headers.get("authorization") != f"Bearer {state.api_key}":
            return JSONResponse({"error": {"message": "bad api key"}}, status_code=401)
        body = await request.json()
        state.bodies.append(body)
        state.count += 1
        failing = state.fail_every and state.count % state.fail_every == 0
        if failing and (state.count // state.fail_every) % 2 == 1:
            return JSONResponse({"error": {"message": "injected failure"}}, status_code=500)
        # The prompt's tokens are its words; the "cache" holds system prompts already seen.
        if chat:
            system = next((m["content"] for m in body["messages"] if m["role"] == "system"), "")
            prompt_tokens = sum(words(m["content"]) for m in body["messages"])
            cached = words(system) if system in state.seen_system_prompts else 0
            state.seen_system_prompts.add(system)
        else:
            prompt_tokens, cached = words(body["prompt"]), 0
        if not failing:
            state.queries += prompt_tokens
            state.hits += prompt_tokens // 2
        n = body["max_tokens"]

        def chunk(i: int) -> bytes:
            finish = "length" if i == n - 1 else None
            choice = {"index": 0, "delta": {"content": "tok "}} if chat else {"index": 0, "text": "tok "}
            return f"data: {json.dumps({'choices': [{**choice, 'finish_reason': finish}]})}\n\n".encode()

        async def stream() -> AsyncIterator[bytes]:
            for i in range(n):
                await asyncio.sleep(state.chunk_sleep_s)
                yield chunk(i)
                if failing:
                    yield b'data: {"error": {"message": "injected mid-stream failure", "code": 500}}\n\n'
                    return
            if state.send_usage and body.get("stream_options", {}).get("include_usage"):
                usage: dict[str, Any] = {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": n,
                    "total_tokens": prompt_tokens + n,
                }
                if state.report_cached_tokens:
                    usage["prompt_tokens_details"] = {"cached_tokens": cached}
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, chat=True)

    return app


@pytest.fixture(scope="module")
def fake_server() -> Iterator[tuple[str, FakeState]]:
    state = FakeState()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(make_app(state), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 15
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the fake server did not start"
        time.sleep(0.01)
    yield f"http://127.0.0.1:{port}", state
    server.should_exit = True
    thread.join(timeout=10)
    sock.close()


@pytest.fixture
def server(fake_server: tuple[str, FakeState]) -> tuple[str, FakeState]:
    url, state = fake_server
    state.__init__()  # type: ignore[misc]  # a fresh configuration for each test
    return url, state


def load(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def test_random_sweep_counts_failures_and_writes_files(
    server: tuple[str, FakeState], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url, state = server
    state.fail_every = 4  # requests 4, 8, 12, ... of the server's count fail: 3 in each run of 12
    out_json, out_png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    argv = ["--base-url", url + "/v1", "--num-prompts", "12", "--input-len", "16", "--output-len", "6"]
    argv += ["--request-rate", "400,inf", "--warmup-requests", "0", "--max-concurrency", "6", "--seed", "1"]
    rc = cli_main([*argv, "--json", str(out_json), "--plot", str(out_png), "--no-progress"])
    assert rc == 0
    assert out_png.read_bytes()[:8] == PNG_MAGIC
    result = load(out_json)
    assert result["config"]["model"] == "fake-model"  # from GET /v1/models
    assert result["config"]["request_rates"] == [400.0, "inf"]
    assert [run["request_rate"] for run in result["runs"]] == [400.0, "inf"]
    for run in result["runs"]:
        m = run["metrics"]
        assert (m["completed"], m["failed"]) == (9, 3)
        assert sorted(m["errors"]) == ["HTTP 500: injected failure", "error event: injected mid-stream failure"]
        assert (m["total_input_tokens"], m["total_output_tokens"]) == (9 * 16, 9 * 6)
        assert m["token_count_source"] == "usage"
        assert (m["ttft_ms"]["count"], m["tpot_ms"]["count"], m["itl_ms"]["count"]) == (9, 9, 9 * 5)
        assert m["prefix_cache_hit_rate"] == pytest.approx(0.5) and m["prefix_cache_source"] == "metrics"
        assert m["mean_concurrency"] <= 6 + 1e-9  # the cap holds (Little's law)
        assert len(run["requests"]) == 12
        # the per-request records in the file reproduce the metrics
        again = compute_metrics([RequestRecord(**r) for r in run["requests"]])
        assert again.ttft_ms.p99 == pytest.approx(m["ttft_ms"]["p99"])
        assert again.itl_ms.mean == pytest.approx(m["itl_ms"]["mean"])
        assert again.duration_s == pytest.approx(m["duration_s"])
    # the two runs used different prompts (a fresh dataset seed per rate)
    assert result["runs"][0]["dataset_seed"] != result["runs"][1]["dataset_seed"]
    assert len(state.bodies) == 24
    for body in state.bodies:
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert body["ignore_eos"] is True and body["max_tokens"] == 6 and body["model"] == "fake-model"
    printed = capsys.readouterr().out
    assert printed.count("Serving Benchmark Result") == 2
    assert "50.0% (metrics)" in printed


def test_chat_shared_prefix_with_api_key_goodput_and_cached_tokens(
    server: tuple[str, FakeState], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url, state = server
    state.api_key, state.report_cached_tokens = "sk-test", True
    out_json, out_png = tmp_path / "chat.json", tmp_path / "chat.png"
    argv = ["--base-url", url, "--endpoint", "chat", "--api-key", "sk-test", "--dataset", "shared-prefix"]
    argv += ["--num-groups", "2", "--prompts-per-group", "3", "--system-prompt-len", "20", "--question-len", "4"]
    argv += ["--output-len", "3", "--request-rate", "1000", "--warmup-requests", "1", "--no-ignore-eos"]
    argv += ["--goodput", "ttft:10000", "tpot:10000", "--json", str(out_json), "--plot", str(out_png), "--no-progress"]
    assert cli_main(argv) == 0
    assert out_png.read_bytes()[:8] == PNG_MAGIC
    (run,) = load(out_json)["runs"]
    m = run["metrics"]
    assert (m["completed"], m["failed"], m["good_requests"]) == (6, 0, 6)
    # the first prompt of each group misses, the other two find its 20-word system prompt:
    # 4 x 20 cached of 6 x 24 prompt tokens
    assert m["prefix_cache_source"] == "usage"
    assert m["prefix_cache_hit_rate"] == pytest.approx(80 / 144)
    assert len(state.bodies) == 7  # one warm-up request, then six measured
    for body in state.bodies:
        assert "ignore_eos" not in body
        assert [turn["role"] for turn in body["messages"]] == ["system", "user"]
    assert "Request goodput (req/s):" in capsys.readouterr().out

    state.api_key = "another-key"  # every warm-up request now fails: stop early and say why
    assert cli_main([*argv[:-5], "--no-progress"]) == 2
    assert "every warm-up request failed" in capsys.readouterr().err


def test_estimated_counts_and_compare(
    server: tuple[str, FakeState], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url, state = server
    state.send_usage = False
    base = ["--base-url", url, "--num-prompts", "4", "--input-len", "8", "--output-len", "4", "--no-progress"]
    files = [tmp_path / "a.json", tmp_path / "b.json", tmp_path / "sweep.json"]
    assert cli_main([*base, "--json", str(files[0])]) == 0
    assert "estimate (chars/4)" in capsys.readouterr().out
    m = load(files[0])["runs"][0]["metrics"]
    assert m["token_count_source"] == "estimate"
    assert m["total_output_tokens"] == 4 * 4  # "tok " is four characters: one token each

    async def from_a_running_loop() -> int:  # as in a Jupyter cell
        return cli_main([*base, "--max-concurrency", "1", "--json", str(files[1])])

    assert asyncio.run(from_a_running_loop()) == 0
    assert cli_main([*base, "--request-rate", "500,inf", "--json", str(files[2])]) == 0
    capsys.readouterr()

    bars, lines = tmp_path / "bars.png", tmp_path / "lines.png"
    assert cli_main(["compare", str(files[0]), str(files[1]), "--plot", str(bars)]) == 0
    table = capsys.readouterr().out
    assert "TTFT p50" in table and "a" in table.split() and "b" in table.split()
    assert cli_main(["compare", str(files[0]), str(files[2]), "--plot", str(lines)]) == 0
    assert bars.read_bytes()[:8] == PNG_MAGIC and lines.read_bytes()[:8] == PNG_MAGIC
    assert cli_main(["compare"]) == 2


def test_unreachable_server_is_an_error_not_a_crash(capsys: pytest.CaptureFixture[str]) -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens here now
    assert cli_main(["--base-url", f"http://127.0.0.1:{port}", "--no-progress", "--request-timeout", "5"]) == 2
    assert "cannot reach" in capsys.readouterr().err
