"""Tool calls: the streaming parser, and end to end through the server (chapter 11).

A random-weight model never writes a ``<tool_call>``, so the end-to-end tests script the
engine's sampler: a request whose seed names a script gets exactly those tokens, whatever the
logits say. Everything else (the chat template with tools, the engine, detokenization, the
parser, the OpenAI shapes, the ``openai`` client) is the real thing.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mini_infer.engine import LLMEngine
from mini_infer.engine_builder import EngineConfig, build_engine
from mini_infer.sampling import Sampler, SamplerOutput
from mini_infer.server import BackgroundServer, ServerConfig, build_app
from mini_infer.server.tool_calls import ToolCallParser
from mini_infer.tokenizer import Tokenizer

pytestmark = pytest.mark.timeout(180)  # a hung socket or thread fails its test, not the run

MODEL = "tiny-tools"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
CALL_TEXT = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}\n</tool_call>'
)
TWO_CALLS = CALL_TEXT + '\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
FORCED_REST = '{"city": "Oslo"}}\n</tool_call>'  # what follows the forced start of a named call
SCRIPTS = {101: CALL_TEXT, 102: TWO_CALLS, 103: FORCED_REST, 104: "It is sunny."}


# ------------------------------------------------------------------------------------ the parser


def parse_whole(text: str) -> ToolCallParser:
    parser = ToolCallParser()
    parser.push(text)
    parser.finish()
    return parser


def parse_pieces(pieces: list[str]) -> tuple[str, dict[int, dict[str, str]]]:
    """Feed pieces; return the content and each call's fields as the deltas built them."""
    parser = ToolCallParser()
    content, calls = "", {}
    for delta in [parser.push(p) for p in pieces] + [parser.finish()]:
        content += delta.content
        for d in delta.tool_calls:
            call = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
            if d.id is not None:
                assert not call["id"], "a call is announced once"
                call["id"], call["name"] = d.id, d.name or ""
            call["arguments"] += d.arguments
    return content, calls


def test_parser_reads_calls_and_content() -> None:
    parser = parse_whole(TWO_CALLS)
    assert parser.content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in parser.tool_calls] == [
        ("get_weather", {"city": "Paris", "days": [1, 2]}),
        ("get_time", {}),
    ]
    assert len({c.id for c in parser.tool_calls}) == 2 and all(c.id.startswith("call_") for c in parser.tool_calls)


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        ("no calls here", "no calls here", []),
        ("ends with a partial tag <tool_", "ends with a partial tag <tool_", []),
        ('<tool_call>{"arguments": {"x": 1}, "name": "f"}</tool_call>', "", [("f", {"x": 1})]),  # other key order
        ("<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),  # given back as text
        ('<tool_call>\n{"name": "f", "arguments": {"x": "}"', "", [("f", '{"x": "}"')]),  # cut off by max_tokens
        ('<tool_call>{"name": "f", "arguments": {"s": "a}}b"}}</tool_call> after', "after", [("f", {"s": "a}}b"})]),
    ],
)
def test_parser_edge_cases(text: str, content: str, calls: list[tuple[str, Any]]) -> None:
    parser = parse_whole(text)
    assert parser.content == content
    got = [
        (c.name, json.loads(c.arguments) if isinstance(calls and calls[0][1], dict) else c.arguments)
        for c in parser.tool_calls
    ]
    assert got == calls


@settings(max_examples=60, deadline=None)
@given(
    text=st.sampled_from(
        [
            CALL_TEXT,
            TWO_CALLS,
            "plain <tool_call>garbage</tool_call> text",
            'x<tool_call>{"name": "f", "arguments": {"a": 1',
        ]
    ),
    cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=30),
)
def test_streamed_pieces_give_what_the_whole_text_gives(text: str, cuts: list[int]) -> None:
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    whole = parse_whole(text)
    content, calls = parse_pieces(pieces)
    assert content == whole.content
    assert [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)] == [
        (c.name, c.arguments) for c in whole.tool_calls
    ]


def test_streamed_arguments_arrive_before_the_block_closes() -> None:
    parser = ToolCallParser()
    first = parser.push('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa')
    assert [(d.name, d.arguments) for d in first.tool_calls] == [("get_weather", '{"city": "Pa')]
    more = parser.push('ris"}}\n')
    assert [d.arguments for d in more.tool_calls] == ['ris"']  # the braces wait: one of them closes the block
    last = parser.push("</tool_call>")
    assert [d.arguments for d in last.tool_calls] == ["}"]
    assert json.loads(parser.tool_calls[0].arguments) == {"city": "Paris"}


# ------------------------------------------------------------------------------------ end to end


class ScriptedSampler(Sampler):
    """The engine's sampler, but a request whose seed is in SCRIPTS gets its script's tokens."""

    def __init__(self, scripts: dict[int, list[int]], eos: int, mask: Any) -> None:
        super().__init__(seed=0, eos_token_ids=[eos], mask=mask)  # forced calls keep their grammar
        self.scripts, self.eos = scripts, eos
        self.position: dict[int, int] = {}

    def __call__(self, logits: torch.Tensor, params_list: Any, *args: Any, **kwargs: Any) -> SamplerOutput:
        out = super().__call__(logits, params_list, *args, **kwargs)
        tokens = out.token_ids.tolist()
        for row, params in enumerate(params_list):
            script = self.scripts.get(params.seed) if params.seed is not None else None
            if script is not None:
                at = self.position.get(params.seed, 0)
                self.position[params.seed] = at + 1
                tokens[row] = script[at] if at < len(script) else self.eos
        out.token_ids = torch.tensor(tokens, dtype=out.token_ids.dtype, device=out.token_ids.device)
        return out


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[BackgroundServer]:
    def factory() -> LLMEngine:
        engine = build_engine(
            EngineConfig(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=128, show_progress=False)
        )
        tokenizer: Tokenizer = engine.tokenizer
        eos = tokenizer.hf.convert_tokens_to_ids("<|im_end|>")
        scripts = {seed: tokenizer.encode(text) + [eos] for seed, text in SCRIPTS.items()}
        engine.sampler = ScriptedSampler(scripts, eos, engine.sampler.mask)  # type: ignore[attr-defined]
        return engine

    config = ServerConfig(model=str(tiny_model_dir), served_model_name=MODEL, show_progress=False)
    with BackgroundServer(build_app(config, engine_factory=factory)) as srv:
        srv.wait_ready(timeout=60)
        yield srv


@pytest.fixture(scope="module")
def client(server: BackgroundServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=30) as c:
        yield c


def reset_script(server: BackgroundServer, seed: int) -> None:
    def reset(engine: LLMEngine) -> None:
        engine.sampler.position.pop(seed, None)

    server.app.state.server.engine.call(reset).result(timeout=10)


ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_tool_calls_non_streaming(server: BackgroundServer, client: openai.OpenAI) -> None:
    reset_script(server, 102)
    got = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], seed=102, max_tokens=300)
    choice = got.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    calls = choice.message.tool_calls
    assert calls is not None and [c.type for c in calls] == ["function", "function"]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": [1, 2]}),
        ("get_time", {}),
    ]


def test_tool_calls_streaming(server: BackgroundServer, client: openai.OpenAI) -> None:
    reset_script(server, 101)
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=ASK, tools=[WEATHER], seed=101, max_tokens=300, stream=True
        )
    )
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls: dict[int, dict[str, str]] = {}
    for chunk in chunks:
        for d in chunk.choices[0].delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
            if d.id:
                call["id"] = d.id
            if d.function and d.function.name:
                call["name"] = d.function.name
            call["arguments"] += (d.function.arguments or "") if d.function else ""
    assert content == "Let me check."
    assert list(calls) == [0] and calls[0]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris", "days": [1, 2]}
    argument_chunks = [c for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert len(argument_chunks) > 2  # the arguments streamed, not in one piece at the end
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


def test_named_tool_choice_forces_the_call(server: BackgroundServer, client: openai.OpenAI) -> None:
    for stream in (False, True):
        reset_script(server, 103)
        kwargs: dict[str, Any] = {
            "model": MODEL,
            "messages": ASK,
            "tools": [WEATHER, TIME],
            "seed": 103,
            "max_tokens": 100,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        }
        if not stream:
            choice = client.chat.completions.create(**kwargs).choices[0]
            assert choice.message.content is None and choice.finish_reason == "tool_calls"
            assert choice.message.tool_calls is not None
            (call,) = choice.message.tool_calls
            name, arguments = call.function.name, call.function.arguments
        else:
            chunks = list(client.chat.completions.create(stream=True, **kwargs))
            first = chunks[0].choices[0].delta
            assert first.role == "assistant" and first.tool_calls and first.tool_calls[0].function
            name = first.tool_calls[0].function.name or ""
            arguments = "".join(
                d.function.arguments or ""
                for c in chunks
                if c.choices
                for d in c.choices[0].delta.tool_calls or []
                if d.function
            )
        assert name == "get_weather" and json.loads(arguments) == {"city": "Oslo"}


def test_tools_are_rendered_unless_tool_choice_is_none(server: BackgroundServer, client: openai.OpenAI) -> None:
    reset_script(server, 104)
    auto = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], seed=104, max_tokens=20)
    assert auto.choices[0].message.content == "It is sunny." and auto.choices[0].finish_reason == "stop"
    assert not auto.choices[0].message.tool_calls
    plain = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1)
    none = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=1)
    assert auto.usage and plain.usage and none.usage
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens < auto.usage.prompt_tokens
    with httpx.Client(base_url=server.base_url) as http:
        rendered = http.post("/tokenize", json={"messages": ASK, "tools": [WEATHER]}).json()
    assert rendered["count"] == auto.usage.prompt_tokens


def test_tool_history_round_trip(server: BackgroundServer, client: openai.OpenAI) -> None:
    reset_script(server, 101)
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], seed=101, max_tokens=300)
    message = first.choices[0].message
    assert message.tool_calls
    history: list[Any] = [
        *ASK,
        message,
        {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": '{"temp": 21}'},
    ]
    reply = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], max_tokens=3)
    assert reply.choices[0].message.role == "assistant"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, None),
        # strict under "auto": only a forced call is constrained
        ({"tools": [{"type": "function", "function": {"name": "f", "strict": True}}]}, "tools.0.function.strict"),
        (
            {
                "tool_choice": "required",
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 7}}}],
            },
            "tools",
        ),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools.0.function.name"),
        ({"tools": [{"type": "retrieval"}]}, "tools.0.type"),
        ({"parallel_tool_calls": False}, "parallel_tool_calls"),
        ({"functions": [{"name": "f"}]}, "functions"),
    ],
)
def test_tool_requests_we_cannot_honour_are_refused(
    server: BackgroundServer, extra: dict[str, Any], param: str | None
) -> None:
    body = {"model": MODEL, "messages": ASK, "tools": [WEATHER, TIME], "max_tokens": 2, **extra}
    response = httpx.post(server.base_url + "/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    if param is not None:
        assert response.json()["error"]["param"] == param


def test_required_with_one_tool_forces_it(server: BackgroundServer, client: openai.OpenAI) -> None:
    reset_script(server, 103)
    choice = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required", seed=103, max_tokens=100
    ).choices[0]
    assert choice.message.tool_calls and choice.message.tool_calls[0].function.name == "get_weather"
