"""Hundreds of malformed and hostile requests: all 4xx in the OpenAI shape, none 5xx (chapter 11).

Bad JSON, invalid UTF-8, wrong types, huge and negative numbers, unknown and unsupported
fields, missing fields, oversized bodies, wrong content types, prompts over the context. After
all of them the server (and its engine thread) must still answer normally.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from mini_infer.server import BackgroundServer, ServerConfig, build_app

pytestmark = pytest.mark.timeout(180)  # a hung socket or thread fails its test, not the run

MODEL = "tiny-hostile"
MAX_BODY = 64 * 1024
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
GOOD_CHAT: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
GOOD_COMPLETION: dict[str, Any] = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
TOOL = {"type": "function", "function": {"name": "f"}}

# Values of the wrong type, or out of range, for fields of every type.
WRONG = ["x", "", -1, 0, -(10**30), 10**30, 1.5, 1e308, -1e308, True, [], {}, [1], {"a": 1}]
NUMERIC_FIELDS = [
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "n",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
]
# Per field, the values above that are valid (and so must not be refused).
VALID = {
    "temperature": [0, 1.5],
    "top_p": [],
    "top_k": [-1],
    "min_p": [0],
    "seed": [0],
    "presence_penalty": [-1, 0, 1.5],
    "frequency_penalty": [-1, 0, 1.5],
    "repetition_penalty": [1.5],
    "max_tokens": [],
    "n": [],
}


def cases() -> list[tuple[str, str, dict[str, str], bytes]]:
    """(name, path, headers, body) of every hostile request."""
    json_headers = {"Content-Type": "application/json"}
    out: list[tuple[str, str, dict[str, str], bytes]] = []

    def add(name: str, body: Any, path: str = CHAT, headers: dict[str, str] | None = None) -> None:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        out.append((name, path, headers or json_headers, raw))

    for path, good in ((CHAT, GOOD_CHAT), (COMPLETIONS, GOOD_COMPLETION)):
        # Broken JSON and bodies that are not objects.
        for raw in [
            b"",
            b"{",
            b"}",
            b"[]",
            b"null",
            b"1",
            b'"x"',
            b"{'model': 1}",
            b'{"model": NaN}',
            b'{"a": Infinity}',
            b'{"a": -Infinity}',
            b'{"model": "m",}',
            b'{"model": "m"} trailing',
            b"[" * 50_000,
            b'{"a":' * 20_000,
            b'{"max_tokens": 1' + b"0" * 5000 + b"}",
            b'{"temperature": 1e999}',
            b"\x00\x01\x02",
            b"\xef\xbb\xbf{}",
        ]:
            add(f"json {raw[:20]!r}", raw, path)
        # Invalid UTF-8 and lone surrogates.
        for raw in [b'{"model": "\xff"}', b'{"model": "\xc0\xaf"}', b'{"model": "\xed\xa0\x80"}', b'{"x": "\x80\x80"}']:
            add(f"utf8 {raw!r}", raw, path)
        lone = dict(
            good, **({"messages": [{"role": "user", "content": "\ud800"}]} if path == CHAT else {"prompt": "a\udfffb"})
        )
        add("lone surrogate", json.dumps(lone).encode(), path)
        # Wrong content types.
        body = json.dumps(good).encode()
        for content_type in [
            "text/plain",
            "application/x-www-form-urlencoded",
            "",
            "application/json; charset=latin-1",
            "multipart/form-data; boundary=x",
            "application/jsonx",
        ]:
            out.append(
                (f"content-type {content_type!r}", path, {"Content-Type": content_type} if content_type else {}, body)
            )
        # Wrong types and ranges, field by field.
        for field in NUMERIC_FIELDS:
            for value in WRONG:
                if value in VALID.get(field, []) and not isinstance(value, bool):
                    continue
                add(f"{field}={value!r:.30}", dict(good, **{field: value}), path)
        for field, values in {
            "model": [None, 1, [], "gpt-4"],
            "stream": ["yes", 1, [], {}],
            "stop": [1, [1], [""], "", ["a"] * 17, {"a": 1}],
            "stop_token_ids": ["x", [-1], [10**9], [1.5], [True], 5],
            "ignore_eos": ["no", 1, 0],
            "user": [1, [], {}],
            "stream_options": [{"include_usage": True}, {"x": 1}, "yes"],
            "logit_bias": [{"x": 5}, {"1": 101}, {"-1": 1}, [1], {"1": "5"}, {"99999999": 1}],
            "min_tokens": [-1, "1", 1.5, 10**9],
            "skip_special_tokens": ["no", 1],
            "include_stop_str_in_output": ["no", 1],
            "max_completion_tokens": [0, "5"],
            "response_format": [
                {"type": "json_schema", "json_schema": {}},
                {"type": "json_schema"},
                {"type": "xml"},
                {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
            ],
            "structured_outputs": [
                {},
                {"regex": "a(b"},
                {"json": {"type": 1}},
                {"choice": []},
                {"regex": "a", "choice": ["b"]},
            ],
            "functions": [[{"name": "f"}]],
            "audio": [{"voice": "x"}],
            "suffix": ["x"],
            "best_of": [5, 0],
            "echo": ["yes", 1],
            "unknown_field": [1],
            "modalities": [["audio"]],
            "store": [True],
            "metadata": [{"a": "b"}],
        }.items():
            for value in values:
                add(f"{field}={value!r:.30}", dict(good, **{field: value}), path)
        # Missing fields.
        for field in good:
            if field != "max_tokens":
                add(f"missing {field}", {k: v for k, v in good.items() if k != field}, path)

    # Chat-specific: messages and tools.
    for messages in [
        [],
        "hi",
        [{"content": "hi"}],
        [{"role": "robot", "content": "hi"}],
        [{"role": "user"}],
        [{"role": "user", "content": 5}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        [{"role": "user", "content": "hi", "name": 5}],
        [{"role": "user", "content": "hi", "tool_calls": []}],
        [{"role": "tool", "content": "x", "tool_call_id": 5}],
        [None],
        [[]],
        {"role": "user"},
    ]:
        add(f"messages={messages!r:.40}", dict(GOOD_CHAT, messages=messages))
    for extra in [
        {"logprobs": "yes"},
        {"top_logprobs": 5},
        {"logprobs": True, "top_logprobs": 21},
        {"logprobs": True, "top_logprobs": -1},
        {"max_tokens": 3, "max_completion_tokens": 4},
        {"max_completion_tokens": 0},
        {"tools": "x"},
        {"tools": [{}]},
        {"tool_choice": "auto"},
        {"tool_choice": "sometimes"},
        {"parallel_tool_calls": False},
        {"messages": [{"role": "user", "content": "hi " * 3000}]},
    ]:
        add(f"chat {extra!r:.40}", dict(GOOD_CHAT, **extra))
    # Completion-specific: prompts.
    for prompt in [
        [],
        [[]],
        [-1],
        [10**9],
        [1.5],
        [True],
        [[1], "x"],
        [["x"]],
        None,
        5,
        {"a": 1},
        [7] * 3000,
        [[7] * 2048],
        ["a", 1],
        "",
    ]:
        add(f"prompt={prompt!r:.40}", dict(GOOD_COMPLETION, prompt=prompt), COMPLETIONS)
    for extra in [
        {"logprobs": 21},
        {"logprobs": True},
        {"prompt": [[1]] * 100, "n": 2},
        {"prompt": [7] * 2000, "max_tokens": 100},
        {"max_tokens": 10**9},
        {"n": 129},
    ]:
        add(f"completion {extra!r:.40}", dict(GOOD_COMPLETION, **extra), COMPLETIONS)
    # Other routes.
    for body in [{"tokens": "x"}, {"tokens": [-1]}, {"tokens": [10**12]}, {}, {"tokens": [1], "model": "other"}]:
        add(f"detokenize {body!r:.30}", body, "/detokenize")
    for body in [
        {},
        {"prompt": 1},
        {"prompt": "a", "messages": []},
        {"messages": [{"role": "x"}]},
        {"prompt": "a", "tools": []},
    ]:
        add(f"tokenize {body!r:.30}", body, "/tokenize")
    # Oversized bodies: declared, and actually sent.
    big = json.dumps(dict(GOOD_COMPLETION, prompt="a" * (MAX_BODY + 10))).encode()
    add("oversized", big, COMPLETIONS)
    add(
        "oversized chat",
        json.dumps(dict(GOOD_CHAT, messages=[{"role": "user", "content": "b" * (MAX_BODY * 2)}])).encode(),
    )
    return out


CASES = cases()


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[BackgroundServer]:
    config = ServerConfig(
        model=str(tiny_model_dir),
        served_model_name=MODEL,
        max_body_bytes=MAX_BODY,
        show_progress=False,
        engine_kwargs={"dtype": "float32", "num_kv_blocks": 256},
    )
    with BackgroundServer(build_app(config)) as srv:
        srv.wait_ready(timeout=60)
        yield srv


def assert_openai_error(response: httpx.Response, name: str) -> None:
    assert 400 <= response.status_code < 500, f"{name}: {response.status_code} {response.text[:300]}"
    body = response.json()
    assert set(body) == {"error"}, name
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, name
    assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str), name


def test_hostile_requests_get_4xx_in_the_openai_shape(server: BackgroundServer) -> None:
    assert len(CASES) >= 300
    statuses: dict[int, int] = {}
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        for name, path, headers, body in CASES:
            response = client.post(path, content=body, headers=headers)
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            assert_openai_error(response, name)
        assert client.get("/health").status_code == 200
        good = client.post(CHAT, json=GOOD_CHAT)
        assert good.status_code == 200 and good.json()["choices"][0]["message"]["role"] == "assistant"
    assert set(statuses) <= {400, 404, 413}, statuses
    assert statuses.get(413, 0) >= 2 and statuses.get(404, 0) >= 2


def test_extreme_but_valid_values_do_not_break_the_engine(server: BackgroundServer) -> None:
    extremes: list[dict[str, Any]] = [
        {"temperature": 1e-300},
        {"temperature": 2},
        {"top_p": 1e-300},
        {"top_k": 2**31 - 1},
        {"top_k": 1},
        {"min_p": 1},
        {"repetition_penalty": 1e-300},
        {"repetition_penalty": 10},
        {"presence_penalty": -2, "frequency_penalty": 2},
        {"seed": 2**64 - 1},
        {"stop": ["a"] * 16},
        {"n": 8, "max_tokens": 1},
        {"logprobs": True, "top_logprobs": 20},
    ]
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        for extra in extremes:
            response = client.post(CHAT, json=dict(GOOD_CHAT, **extra))
            assert response.status_code == 200, (extra, response.text)
            json.dumps(response.json(), allow_nan=False)  # no NaN or Infinity in what we send
        assert client.get("/health").status_code == 200


def test_body_limits_without_content_length(server: BackgroundServer) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"model": "' + MODEL.encode() + b'", "prompt": "'
        for _ in range(MAX_BODY // 1024 + 2):
            yield b"a" * 1024
        yield b'"}'

    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        response = client.post(COMPLETIONS, content=chunks(), headers={"Content-Type": "application/json"})
        assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
        # A declared length over the limit is refused before the body is read.
        response = client.post(
            COMPLETIONS, content=b"{}", headers={"Content-Type": "application/json", "Content-Length": "2"}
        )
        assert response.status_code == 400


def test_lying_content_length_is_refused(server: BackgroundServer) -> None:
    with socket.create_connection((server.host, server.port), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {MAX_BODY * 100}\r\n\r\n".encode()
            + b"{}"
        )
        reply = sock.recv(4096)
    assert reply.startswith(b"HTTP/1.1 413"), reply[:100]
    assert httpx.get(server.base_url + "/health").status_code == 200


def test_client_gone_before_its_body_arrived_is_not_a_server_error(caplog: pytest.LogCaptureFixture) -> None:
    # A client that sends the headers and part of the body, then closes: reading the body ends
    # with the disconnect. That is the client's doing, answered 499 like any client that left,
    # not a 500 with a logged traceback. Driven over ASGI: the body is read before the engine is used.
    app = build_app(ServerConfig(model="unused", show_progress=False))
    incoming = [
        {"type": "http.request", "body": b'{"model": "unused", "prompt": "', "more_body": True},
        {"type": "http.disconnect"},
    ]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return incoming.pop(0)

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": COMPLETIONS,
        "raw_path": COMPLETIONS.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json"), (b"content-length", b"500")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 2),
    }
    with caplog.at_level(logging.WARNING):
        asyncio.run(app(scope, receive, send))
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 499
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        # A field of several forms: the error is the one form the value has the shape of, not
        # "not a string" for a list that is a list of strings.
        ({"stop": ["x"] * 17}, "stop", "at most 16 items"),
        ({"stop": ["x", 5]}, "stop.1", "valid string"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages.0.content.0.type",
            "'text'",
        ),
        # The Responses API's shape of a named tool choice.
        ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "f"}}, "tool_choice.function", "required"),
        # A value no form fits better than another keeps the general message.
        ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content", "other accepted forms"),
    ],
)
def test_errors_of_fields_with_several_forms_name_what_is_wrong(
    server: BackgroundServer, extra: dict[str, Any], param: str, words: str
) -> None:
    response = httpx.post(server.base_url + CHAT, json=dict(GOOD_CHAT, **extra), timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error
