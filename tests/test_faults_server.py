"""A fault stays with its request, through the server (``mini_infer.faults``, chapter 11).

Each test injects a fault into one request's own work while other requests stream beside it:
that client gets a 500 naming the cause (before streaming) or an error event then ``[DONE]``
(while streaming); the others finish with the text they have without the fault; every block
comes back, and the server goes on. A fault that can have corrupted shared state (a forward
pass, out of memory) ends the engine: ``/health`` answers 503 and every request in flight gets an
error, instead of a hang.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from typing import Any

import httpx
import pytest
import torch

from mini_infer.faults import inject
from mini_infer.server import BackgroundServer, ServerConfig, build_app
from tests.server_checks import assert_all_blocks_back, on_engine, wait_idle

pytestmark = pytest.mark.timeout(240)

OTHERS = [
    {"prompt": f"Tell me about the number {i}.", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    for i in range(3)
]
TARGET = {"prompt": "Write a short poem.", "max_tokens": 8, "temperature": 0, "ignore_eos": True}


def start_server() -> BackgroundServer:
    config = ServerConfig(model="tiny", engine_kwargs={"dtype": "float32", "num_kv_blocks": 128}, show_progress=False)
    return BackgroundServer(build_app(config))


@pytest.fixture(scope="module")
def server() -> Iterator[BackgroundServer]:
    with start_server() as srv:
        srv.wait_ready(timeout=120)
        yield srv


def complete(base_url: str, body: dict[str, Any]) -> httpx.Response:
    with httpx.Client(base_url=base_url, timeout=120) as http:
        return http.post("/v1/completions", json={"model": "tiny", **body})


def stream_events(base_url: str, body: dict[str, Any]) -> tuple[int, list[str]]:
    """The status and the data lines of a streamed completion."""
    with (
        httpx.Client(base_url=base_url, timeout=120) as http,
        http.stream("POST", "/v1/completions", json={"model": "tiny", **body, "stream": True}) as response,
    ):
        response.read() if response.status_code != 200 else None
        lines = [line.removeprefix("data: ") for line in response.iter_lines() if line]
        return response.status_code, lines


def streamed_text(lines: list[str]) -> str:
    assert lines[-1] == "[DONE]", lines[-3:]
    chunks = [json.loads(line) for line in lines[:-1]]
    assert all("error" not in chunk for chunk in chunks), chunks[-1]
    return "".join(choice["text"] for chunk in chunks for choice in chunk["choices"])


@pytest.fixture(scope="module")
def expected(server: BackgroundServer) -> list[str]:
    """The others' texts without any fault."""
    return [complete(server.base_url, body).json()["choices"][0]["text"] for body in OTHERS]


def with_others_streaming(
    server: BackgroundServer, during: Callable[[Callable[[str | None], bool]], Any]
) -> tuple[Any, list[str]]:
    """Stream the others; once all are in the engine, run ``during(is_new)`` (``is_new``: a request
    id that is none of theirs); then the others' streamed texts."""
    with ThreadPoolExecutor(len(OTHERS)) as pool:
        futures: list[Future[tuple[int, list[str]]]] = [pool.submit(stream_events, server.base_url, b) for b in OTHERS]
        others: set[str] = set()
        while len(others) < len(OTHERS):
            others = on_engine(server, lambda e: set(e.outputs.requests)) or others
            assert not any(f.done() for f in futures), "an other request finished before the fault"
        result = during(lambda request_id: request_id is not None and request_id not in others)
        texts = []
        for future in futures:
            status, lines = future.result(timeout=120)
            assert status == 200
            texts.append(streamed_text(lines))
    return result, texts


def failure_count(server: BackgroundServer) -> float:
    """``/metrics``' count of requests ended by a fault of their own."""
    text = httpx.get(server.base_url + "/metrics", timeout=30).text
    return float(
        next(line.split()[1] for line in text.splitlines() if line.startswith("mini_infer:request_failure_total"))
    )


def error_event(lines: list[str]) -> dict[str, Any]:
    assert lines[-1] == "[DONE]"
    event = json.loads(lines[-2])
    assert set(event) == {"error"}, event
    assert all("error" not in json.loads(line) for line in lines[:-2])
    return event["error"]


def arm(server: BackgroundServer, stack: ExitStack, stage: str, error: Callable[[], BaseException], target: Any) -> Any:
    """Arm a fault; engine stages are armed (and disarmed) on the engine's own thread."""
    if stage in ("sample", "forward"):
        armed = on_engine(server, lambda e: stack.enter_context(inject(stage, error, target, engine=e)))
        return armed
    return stack.enter_context(inject(stage, error, target))


def injected(kind: type[BaseException] = RuntimeError) -> Callable[[], BaseException]:
    return lambda: kind("injected fault")


@pytest.mark.parametrize(
    ("stage", "kind", "cause"),
    [
        ("detokenize", RuntimeError, "detokenizing or checking stops failed: RuntimeError: injected fault"),
        ("stop_check", RuntimeError, "detokenizing or checking stops failed: RuntimeError: injected fault"),
        ("output", RuntimeError, "building its output failed: RuntimeError: injected fault"),
        ("sample", RuntimeError, "sampling failed: RuntimeError: injected fault"),
    ],
)
@pytest.mark.parametrize("streaming", [False, True])
def test_a_fault_in_a_request_s_own_work_fails_it_alone(
    server: BackgroundServer, expected: list[str], stage: str, kind: type[Exception], cause: str, streaming: bool
) -> None:
    def during(is_new: Callable[[str | None], bool]) -> Any:
        with ExitStack() as stack:
            armed = arm(server, stack, stage, injected(kind), is_new)
            answer = stream_events(server.base_url, TARGET) if streaming else complete(server.base_url, TARGET)
            if stage in ("sample", "forward"):
                on_engine(server, lambda e: stack.close())
            assert armed.times_raised == 1
            return answer

    failures = failure_count(server)
    answer, texts = with_others_streaming(server, during)
    if streaming:
        status, lines = answer
        assert status == 200
        error = error_event(lines)
    else:
        assert answer.status_code == 500
        error = answer.json()["error"]
    assert error["message"] == cause and error["code"] == "internal_error" and error["type"] == "server_error"
    assert texts == expected
    wait_idle(server)
    assert_all_blocks_back(server)
    assert failure_count(server) == failures + 1
    assert complete(server.base_url, OTHERS[0]).json()["choices"][0]["text"] == expected[0]


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}


@pytest.mark.parametrize(
    ("stage", "body", "status", "cause"),
    [
        ("admission", TARGET, 500, "adding the request failed: TypeError: injected fault"),
        # The second choice fails: the first, already added, is taken back.
        ("admission", TARGET | {"n": 2}, 500, "adding the request failed: TypeError: injected fault"),
        ("admission", TARGET | {"max_tokens": 1}, 400, "injected fault"),  # ValueError: the request's fault
        # As seen on Kaggle: llguidance raising TypeError while the engine compiles a grammar.
        (
            "grammar_compile",
            {
                "prompt": "Write",
                "max_tokens": 8,
                "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}},
            },
            500,
            "adding the request failed: TypeError: injected fault",
        ),
    ],
)
def test_a_fault_at_admission_is_that_request_s_error(
    server: BackgroundServer, expected: list[str], stage: str, body: dict[str, Any], status: int, cause: str
) -> None:
    kind = ValueError if status == 400 else TypeError
    on_engine(server, lambda e: e.sampler.mask._compiled.clear())  # the engine compiles it again

    def during(is_new: Callable[[str | None], bool]) -> Any:
        target = None if stage == "grammar_compile" else is_new
        if "n" in body:
            target = lambda request_id: is_new(request_id) and str(request_id).endswith("-1")  # noqa: E731
        with inject(stage, injected(kind), target) as armed:
            answer = complete(server.base_url, body)
        assert armed.times_raised == 1, answer.text
        return answer

    answer, texts = with_others_streaming(server, during)
    assert answer.status_code == status, answer.text
    assert answer.json()["error"]["message"] == cause
    assert texts == expected
    wait_idle(server)
    assert_all_blocks_back(server)


def test_a_grammar_that_breaks_while_streaming_ends_that_stream_alone(
    server: BackgroundServer, expected: list[str]
) -> None:
    body = TARGET | {"response_format": {"type": "json_object"}, "max_tokens": 30}
    body.pop("ignore_eos")

    def during(is_new: Callable[[str | None], bool]) -> Any:
        with inject("grammar_advance", injected(TypeError), is_new) as armed:
            answer = stream_events(server.base_url, body)
        assert armed.times_raised == 1
        return answer

    (status, lines), texts = with_others_streaming(server, during)
    assert status == 200
    assert error_event(lines)["message"] == "its grammar failed: TypeError: injected fault"
    assert texts == expected
    wait_idle(server)
    assert_all_blocks_back(server)


@pytest.mark.parametrize(
    ("error", "says"),
    [
        (injected(RuntimeError), "the engine failed: RuntimeError: injected fault"),
        (
            lambda: torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
            "ran out of device memory in a step and stopped",
        ),
    ],
)
def test_a_failed_forward_pass_ends_the_engine_and_every_request_hears_it(
    error: Callable[[], BaseException], says: str
) -> None:
    with start_server() as server, ExitStack() as stack:
        server.wait_ready(timeout=120)

        def during(is_new: Callable[[str | None], bool]) -> Any:
            arm(server, stack, "forward", error, None)
            return None

        with ThreadPoolExecutor(len(OTHERS) + 1) as pool:
            futures = [pool.submit(stream_events, server.base_url, b) for b in OTHERS]
            waiting = pool.submit(complete, server.base_url, TARGET | {"max_tokens": 1000})
            while len(on_engine(server, lambda e: set(e.outputs.requests))) < len(OTHERS) + 1:
                assert not waiting.done(), waiting.result()
            during(lambda _: True)
            for future in futures:
                status, lines = future.result(timeout=120)
                assert status == 200 and says in error_event(lines)["message"]
            answer = waiting.result(timeout=120)
        assert answer.status_code == 503 and says in answer.json()["error"]["message"]
        with httpx.Client(base_url=server.base_url, timeout=30) as http:
            health = http.get("/health")
            assert health.status_code == 503 and says in health.json()["error"]["message"]
            assert http.post("/v1/completions", json={"model": "tiny", **TARGET}).status_code == 503
