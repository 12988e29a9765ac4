"""The OpenAI-compatible server through the official ``openai`` client (chapter 11).

One server per module (a random-weight model, uvicorn on 127.0.0.1 and a free port, in a
background thread), with an API key. Greedy answers are compared with ``LLM`` on the same
model and engine options.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from mini_infer import LLM, SamplingParams
from mini_infer.server import BackgroundServer, ServerConfig, build_app
from tests.server_checks import assert_all_blocks_back, on_engine, wait_idle

pytestmark = pytest.mark.timeout(180)  # a hung socket or thread fails its test, not the run

API_KEY = "test-key"
MODEL = "tiny-test"
ENGINE = {"dtype": "float32", "num_kv_blocks": 256, "max_num_batched_tokens": 256}
MESSAGES = [
    [{"role": "user", "content": "What is 2 + 3?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello world"}],
    [
        {"role": "user", "content": "the cache"},
        {"role": "assistant", "content": "a"},
        {"role": "user", "content": "more"},
    ],
]
PROMPTS: list[Any] = ["hello world", "the cache is", [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]]


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[BackgroundServer]:
    config = ServerConfig(
        model=str(tiny_model_dir), served_model_name=MODEL, api_key=API_KEY, engine_kwargs=ENGINE, show_progress=False
    )
    with BackgroundServer(build_app(config)) as srv:
        srv.wait_ready(timeout=60)
        yield srv


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> LLM:
    return LLM(str(tiny_model_dir), show_progress=False, **ENGINE)


@pytest.fixture(scope="module")
def client(server: BackgroundServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=30) as c:
        yield c


@pytest.fixture(scope="module")
def http(server: BackgroundServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30) as c:
        yield c


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0)


def error_of(response: httpx.Response) -> dict[str, Any]:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


# ------------------------------------------------------------------------------------ basics


def test_health_is_open_and_models_need_the_key(server: BackgroundServer, client: openai.OpenAI) -> None:
    assert httpx.get(server.base_url + "/health").status_code == 200
    response = httpx.get(server.base_url + "/v1/models")
    assert response.status_code == 401 and error_of(response)["code"] == "invalid_api_key"
    response = httpx.get(server.base_url + "/v1/models", headers={"Authorization": "Bearer wrong"})
    assert response.status_code == 401
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_unknown_model_route_and_method_are_openai_errors(client: openai.OpenAI, http: httpx.Client) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4", messages=MESSAGES[0], max_tokens=2)
    assert info.value.body["code"] == "model_not_found"
    response = http.post("/v1/nowhere", json={})
    assert response.status_code == 404 and error_of(response)["code"] == "not_found"
    response = http.get("/v1/chat/completions")
    assert response.status_code == 405 and error_of(response)


# ------------------------------------------------------------------------------------ parity


def test_chat_greedy_equals_llm_chat(client: openai.OpenAI, llm: LLM) -> None:
    expected = llm.chat(MESSAGES, greedy(12), use_tqdm=False)
    for messages, want in zip(MESSAGES, expected):
        got = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
        choice = got.choices[0]
        assert choice.message.role == "assistant" and choice.message.content == want.text
        assert choice.finish_reason == want.finish_reason
        assert got.usage is not None
        assert got.usage.prompt_tokens == len(want.prompt_token_ids)
        assert got.usage.completion_tokens == len(want.token_ids)
        assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens
        assert got.object == "chat.completion" and got.model == MODEL and got.id.startswith("chatcmpl-")


def test_messages_may_carry_a_name(client: openai.OpenAI) -> None:
    # OpenAI's messages take an optional participant "name"; AutoGen names every user message,
    # LangChain and LangGraph send a message's name. It goes to the chat template (as in vLLM),
    # and Qwen's template does not render it.
    named = [
        {"role": "system", "content": "Be brief.", "name": "rules"},
        {"role": "user", "content": "hello world", "name": "alice"},
        {"role": "assistant", "content": "a", "name": "helper"},
        {"role": "user", "content": "more", "name": "alice"},
    ]
    plain = [{k: v for k, v in m.items() if k != "name"} for m in named]
    got, want = (
        client.chat.completions.create(model=MODEL, messages=m, max_tokens=6, temperature=0) for m in (named, plain)
    )
    assert got.choices[0].message.content == want.choices[0].message.content
    assert got.usage is not None and want.usage is not None and got.usage.prompt_tokens == want.usage.prompt_tokens


def test_chat_streaming_equals_llm_chat(client: openai.OpenAI, llm: LLM) -> None:
    expected = llm.chat(MESSAGES, greedy(12), use_tqdm=False)
    for messages, want in zip(MESSAGES, expected):
        chunks = list(
            client.chat.completions.create(
                model=MODEL,
                messages=messages,
                max_tokens=12,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == want.text
        reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert reasons == [want.finish_reason]
        assert chunks[-1].choices == [] and chunks[-1].usage is not None
        assert chunks[-1].usage.completion_tokens == len(want.token_ids)
        assert all(c.usage is None for c in chunks[:-1])
        assert len({c.id for c in chunks}) == 1


def test_completions_greedy_equals_generate(client: openai.OpenAI, llm: LLM) -> None:
    expected = llm.generate(PROMPTS, greedy(10), use_tqdm=False)
    got = client.completions.create(model=MODEL, prompt=PROMPTS[:2], max_tokens=10, temperature=0)
    assert [c.text for c in got.choices] == [e.text for e in expected[:2]]
    assert [c.index for c in got.choices] == [0, 1]
    one = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=10, temperature=0)
    assert one.choices[0].text == expected[2].text and one.object == "text_completion"
    assert one.usage is not None and one.usage.prompt_tokens == len(PROMPTS[2])
    streamed = list(
        client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=10, temperature=0, stream=True)
    )
    assert "".join(c.choices[0].text for c in streamed) == expected[0].text
    assert streamed[-1].choices[0].finish_reason == expected[0].finish_reason


def test_completions_default_max_tokens_is_16(client: openai.OpenAI) -> None:
    got = client.completions.create(model=MODEL, prompt="hello", temperature=0, extra_body={"ignore_eos": True})
    assert got.usage is not None and got.usage.completion_tokens == 16
    assert got.choices[0].finish_reason == "length"


def test_chat_without_max_tokens_may_run_to_the_context_limit(http: httpx.Client) -> None:
    # No max_tokens: the answer may fill the context. A long message leaves room for a few tokens.
    def count(words: int) -> int:
        messages = [{"role": "user", "content": " ".join(["hello"] * words)}]
        return int(http.post("/tokenize", json={"messages": messages}).json()["count"])

    base, per_word = count(10), (count(20) - count(10)) / 10
    words = 10 + int((2040 - base) / per_word)
    for _ in range(50):  # the estimate is close; step down until the prompt leaves some room
        if count(words) <= 2044:
            break
        words -= 1
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": " ".join(["hello"] * words)}],
        "temperature": 0,
        "ignore_eos": True,
    }
    response = http.post("/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    u = response.json()["usage"]
    assert u["prompt_tokens"] + u["completion_tokens"] == 2048
    assert response.json()["choices"][0]["finish_reason"] == "length"


def test_token_id_list_prompts_and_stop_strings(client: openai.OpenAI, llm: LLM) -> None:
    free = llm.generate([[3, 4, 5, 6]], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True), use_tqdm=False)[
        0
    ]
    stop = free.text[len(free.text) // 2 :][:3]
    assert stop.strip(), free.text
    want = free.text[: free.text.index(stop)]
    got = client.completions.create(
        model=MODEL, prompt=[[3, 4, 5, 6]], max_tokens=16, temperature=0, stop=[stop], extra_body={"ignore_eos": True}
    )
    assert got.choices[0].text == want and got.choices[0].finish_reason == "stop"


def test_text_response_format_is_the_default(client: openai.OpenAI) -> None:
    got = client.chat.completions.create(
        model=MODEL, messages=MESSAGES[0], max_tokens=2, response_format={"type": "text"}
    )
    assert got.choices[0].message.content is not None
    with pytest.raises(openai.BadRequestError, match="json_schema is required"):
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES[0], max_tokens=2, response_format={"type": "json_schema"}
        )


def test_seed_reproduces_sampling(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {"model": MODEL, "messages": MESSAGES[0], "max_tokens": 8, "temperature": 1.0, "seed": 7}
    a = client.chat.completions.create(**kwargs)
    b = client.chat.completions.create(**kwargs)
    assert a.choices[0].message.content == b.choices[0].message.content


# ------------------------------------------------------------------------------------ n, logprobs


def test_n_choices_share_the_prompt_blocks(server: BackgroundServer, client: openai.OpenAI, llm: LLM) -> None:
    prompt = list(range(10, 110))  # 100 tokens: 6 full blocks of 16 that forks can share
    wait_idle(server)
    on_engine(server, lambda e: setattr(e, "step_log", []))
    on_engine(server, lambda e: e.scheduler.blocks.prefix_cache.reset() if e.scheduler.blocks.prefix_cache else None)
    got = client.completions.create(
        model=MODEL, prompt=prompt, n=4, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    steps = on_engine(server, lambda e: e.step_log)
    on_engine(server, lambda e: setattr(e, "step_log", None))
    want = llm.generate([prompt], greedy(6), use_tqdm=False)[0].text
    assert [c.index for c in got.choices] == [0, 1, 2, 3]
    assert all(c.text == want for c in got.choices)
    prompt_work = sum(s.num_tokens for s in steps) - 4 * 5  # minus the decode tokens
    # The first choice computes the whole prompt; each fork only what follows the 96 shared tokens.
    assert prompt_work == 100 + 3 * (100 - 96)
    assert got.usage is not None and got.usage.completion_tokens == 24
    assert_all_blocks_back(server)


def test_n_with_seed_gives_different_choices(client: openai.OpenAI) -> None:
    got = client.chat.completions.create(model=MODEL, messages=MESSAGES[1], n=3, max_tokens=8, temperature=1.0, seed=3)
    assert len({c.message.content for c in got.choices}) > 1


def test_chat_logprobs(client: openai.OpenAI) -> None:
    got = client.chat.completions.create(
        model=MODEL, messages=MESSAGES[0], max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
    )
    content = got.choices[0].logprobs.content
    assert content is not None and got.usage is not None and len(content) == got.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)  # greedy takes the top token
        assert entry.bytes is not None
    streamed = list(
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES[0], max_tokens=6, temperature=0, logprobs=True, stream=True
        )
    )
    entries = [e for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content or []]
    assert [e.token for e in entries] == [e.token for e in content]
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES[0], max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_completion_logprobs(client: openai.OpenAI) -> None:
    got = client.completions.create(
        model=MODEL, prompt="hello", max_tokens=5, temperature=0, logprobs=2, extra_body={"ignore_eos": True}
    )
    lp = got.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.top_logprobs is not None and lp.text_offset is not None
    assert len(lp.tokens) == 5 and all(len(t) <= 2 for t in lp.top_logprobs)
    assert lp.text_offset[0] == 0


# ------------------------------------------------------------------------------------ wire format


def sse_events(response: httpx.Response) -> list[str]:
    events = []
    for line in response.iter_lines():
        if line:
            assert line.startswith("data: "), line
            events.append(line[len("data: ") :])
    return events


def test_sse_wire_format(http: httpx.Client) -> None:
    body = {"model": MODEL, "messages": MESSAGES[0], "max_tokens": 4, "temperature": 0, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    assert raw.endswith("data: [DONE]\n\n") and "\n\n" in raw
    events = [e.removeprefix("data: ") for e in raw.strip().split("\n\n")]
    chunks = [json.loads(e) for e in events[:-1]]
    assert events[-1] == "[DONE]"
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    for chunk in chunks:
        assert chunk["object"] == "chat.completion.chunk" and "usage" not in chunk
        assert set(chunk["choices"][0]) == {"index", "delta", "logprobs", "finish_reason"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_stream_false_is_not_streamed(http: httpx.Client) -> None:
    response = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "stream": False})
    assert response.headers["content-type"] == "application/json"
    assert response.json()["object"] == "text_completion"


# ------------------------------------------------------------------------------------ other routes


def test_tokenize_and_detokenize(http: httpx.Client, llm: LLM) -> None:
    tokens = http.post("/tokenize", json={"prompt": "hello world"}).json()
    assert tokens["tokens"] == llm.engine.tokenizer.encode("hello world") and tokens["count"] == len(tokens["tokens"])
    assert tokens["max_model_len"] == llm.engine.scheduler.max_model_len
    back = http.post("/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert back == {"prompt": "hello world"}
    chat = http.post("/tokenize", json={"model": MODEL, "messages": MESSAGES[0]}).json()
    assert chat["tokens"] == llm.engine.tokenizer.encode(llm.engine.tokenizer.apply_chat_template(MESSAGES[0]))
    response = http.post("/detokenize", json={"tokens": [10**9]})
    assert response.status_code == 400 and error_of(response)["param"] == "tokens"


def test_context_length_error_names_the_numbers(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=[7] * 2000, max_tokens=100)
    message = info.value.body["message"]
    assert "2048" in message and "2100" in message and "2000" in message and "100" in message
    assert info.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=[7] * 2048, stream=True)
    assert "2048" in info.value.body["message"]


def test_metrics(server: BackgroundServer, client: openai.OpenAI, http: httpx.Client) -> None:
    client.chat.completions.create(model=MODEL, messages=MESSAGES[0], max_tokens=3)
    text = http.get("/metrics").text
    for name in (
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "prefix_cache_queries_total",
        "prefix_cache_hits_total",
        "prompt_tokens_total",
        "generation_tokens_total",
        "num_preemptions_total",
        "time_to_first_token_seconds_bucket",
        "inter_token_latency_seconds_bucket",
        "e2e_request_latency_seconds_bucket",
    ):
        assert f"\nmini_infer:{name}" in text, name
    generated = next(
        float(line.split()[-1]) for line in text.splitlines() if line.startswith("mini_infer:generation_tokens_total")
    )
    stats = on_engine(server, lambda e: e.stats())
    assert generated == stats["generated_tokens"]
    assert httpx.get(server.base_url + "/metrics").status_code == 401  # behind the key like the API


# ------------------------------------------------------------------------------------ disconnects


def test_client_that_leaves_a_non_streaming_request_aborts_it(server: BackgroundServer) -> None:
    wait_idle(server)
    before = on_engine(server, lambda e: e.stats()["generated_tokens"])
    body = json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 2000, "ignore_eos": True}).encode()
    with socket.create_connection((server.host, server.port), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        deadline = time.monotonic() + 10
        while on_engine(server, lambda e: e.stats()["generated_tokens"]) == before:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.01)
    wait_idle(server, timeout=60)
    # Only an abort ends it before its 2000 tokens.
    assert on_engine(server, lambda e: e.stats()["generated_tokens"]) - before < 2000
    assert_all_blocks_back(server)
