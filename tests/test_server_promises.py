"""What the server promises about security (book/serving_security.md; chapter 11), where no other
test checks it: the API key compared in constant time, a 4xx naming the limit for ``n``,
``max_tokens``, stop strings and grammar size, no request field that reads files or reaches the
network, and CORS off unless asked for. (Loopback by default: ``test_server_lifecycle``; body size
and prompt length: ``test_server_hostile``.)
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from mini_infer.server import BackgroundServer, ServerConfig, build_app
from mini_infer.server import app as app_module
from mini_infer.server.protocol import MAX_CHOICES, MAX_STOP_CHARS
from mini_infer.server.serving import MAX_GRAMMAR_CHARS

pytestmark = pytest.mark.timeout(180)

KEY = "s3cret-key"
MODEL = "tiny-promises"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT: dict[str, Any] = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
CHAT: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
BIG_SCHEMA = {
    "type": "object",
    "properties": {f"field_{i}": {"type": "string", "description": "x" * 200} for i in range(400)},
}


def config(model_dir: Path, **fields: Any) -> ServerConfig:
    engine = {"dtype": "float32", "num_kv_blocks": 64}
    return ServerConfig(
        model=str(model_dir), served_model_name=MODEL, engine_kwargs=engine, show_progress=False, **fields
    )


@pytest.fixture(scope="module")
def http(tiny_model_dir: Path) -> Iterator[httpx.Client]:
    with BackgroundServer(build_app(config(tiny_model_dir, api_key=KEY))) as server:
        server.wait_ready(timeout=120)
        with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=60) as client:
            yield client


def error_of(response: httpx.Response) -> dict[str, Any]:
    assert 400 <= response.status_code < 500, (response.status_code, response.text)
    return response.json()["error"]


def test_the_api_key_is_compared_in_constant_time(http: httpx.Client, monkeypatch: pytest.MonkeyPatch) -> None:
    compared: list[tuple[bytes, bytes]] = []
    original = hmac.compare_digest

    def compare_digest(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return original(a, b)

    monkeypatch.setattr(app_module.hmac, "compare_digest", compare_digest)
    wrong = http.get("/v1/models", headers={"Authorization": "Bearer s3cret-kez"})
    assert wrong.status_code == 401 and error_of(wrong)["code"] == "invalid_api_key"
    assert http.get("/v1/models").status_code == 200
    assert compared == [(b"s3cret-kez", KEY.encode()), (KEY.encode(), KEY.encode())]


@pytest.mark.parametrize(
    ("path", "extra", "says"),
    [
        ("/v1/completions", {"n": MAX_CHOICES + 1}, f"{MAX_CHOICES}"),
        ("/v1/completions", {"prompt": ["hi"] * 2, "n": MAX_CHOICES // 2 + 1}, f"more than {MAX_CHOICES} choices"),
        ("/v1/completions", {"max_tokens": 10**9}, "holds at most 1024 tokens for one request"),
        ("/v1/completions", {"stop": [f"s{i}" for i in range(17)]}, "at most 16"),
        ("/v1/completions", {"stop": "x" * (MAX_STOP_CHARS + 1)}, f"at most {MAX_STOP_CHARS} characters"),
        (
            "/v1/completions",
            {"response_format": {"type": "json_schema", "json_schema": {"name": "big", "schema": BIG_SCHEMA}}},
            f"grammars of at most {MAX_GRAMMAR_CHARS}",
        ),
        (
            "/v1/chat/completions",
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": BIG_SCHEMA}}],
                "tool_choice": "required",
            },
            f"grammars of at most {MAX_GRAMMAR_CHARS}",
        ),
    ],
)
def test_each_limit_is_a_4xx_that_names_it(http: httpx.Client, path: str, extra: dict[str, Any], says: str) -> None:
    body = (CHAT if path == "/v1/chat/completions" else PROMPT) | extra
    assert says in error_of(http.post(path, json=body))["message"]


def test_the_grammar_limit_counts_the_json_of_the_schema() -> None:
    assert len(json.dumps(BIG_SCHEMA)) > MAX_GRAMMAR_CHARS > 1000


@pytest.mark.parametrize(
    ("path", "extra"),
    [
        ("/v1/chat/completions", {"chat_template": "{{ open('/etc/passwd').read() }}"}),
        ("/v1/chat/completions", {"chat_template_kwargs": {"template_path": "/etc/passwd"}}),
        ("/v1/chat/completions", {"documents": [{"path": "/etc/passwd"}]}),
        ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "../../etc/passwd"}}]}),
        ("/v1/completions", {"prompt": "hi", "lora_request": {"path": "/tmp/adapter"}}),
        (
            "/v1/completions",
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "remote", "schema": {"$ref": "http://127.0.0.1:9/schema.json"}},
                }
            },
        ),
    ],
)
def test_no_request_field_reads_files_or_reaches_the_network(
    http: httpx.Client, path: str, extra: dict[str, Any]
) -> None:
    body = (CHAT if path == "/v1/chat/completions" else PROMPT) | extra
    assert error_of(http.post(path, json=body))["type"] == "invalid_request_error"


def preflight(client: httpx.Client, origin: str) -> httpx.Response:
    headers = {
        "Origin": origin,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization",
    }
    return client.options("/v1/completions", headers=headers)


def test_cors_is_off_unless_asked_for(http: httpx.Client, tiny_model_dir: Path) -> None:
    assert "access-control-allow-origin" not in preflight(http, "https://evil.example").headers
    assert (
        "access-control-allow-origin" not in http.get("/v1/models", headers={"Origin": "https://evil.example"}).headers
    )
    allowed = "https://app.example"
    with (
        BackgroundServer(build_app(config(tiny_model_dir, api_key=KEY, cors_origins=(allowed,)))) as server,
        httpx.Client(base_url=server.base_url, timeout=60) as client,
    ):
        answer = preflight(client, allowed)
        assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == allowed
        assert "access-control-allow-origin" not in preflight(client, "https://evil.example").headers
        # The API itself still wants the key.
        assert client.get("/v1/models", headers={"Origin": allowed}).status_code == 401
