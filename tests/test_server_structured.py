"""Structured outputs through the server, with the official ``openai`` client and LangChain, on the
shipped tiny model (chapters 09b and 11): ``response_format`` JSON Schema and JSON mode, forced
tool calls whose arguments always parse (streaming too), grammars that do not compile, and the
sampling fields benchmark clients send (``min_tokens``, ``logit_bias``, ``skip_special_tokens``,
``include_stop_str_in_output``, ``max_completion_tokens``, ``echo``, ``system_fingerprint``).

The tiny model never saw JSON: the schemas bound their strings (``maxLength``) and numbers so
that it always completes them (see tests/test_structured_output.py).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

from mini_infer.server import BackgroundServer, ServerConfig, build_app
from mini_infer.tiny_corpus import TASKS, random_question

pytestmark = pytest.mark.timeout(300)

MODEL = "tiny"
CITY = {"type": "string", "maxLength": 12}
SCHEMAS: list[dict[str, Any]] = [
    {
        "type": "object",
        "properties": {"city": CITY, "days": {"type": "integer", "minimum": 1, "maximum": 14}},
        "required": ["city", "days"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "answer": {"type": "integer", "minimum": -200, "maximum": 200},
            "sure": {"type": "boolean"},
        },
        "required": ["answer", "sure"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"items": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4}},
        "required": ["items"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "country": {"enum": ["France", "Peru", "Japan", "Kenya"]},
            "capital": {"type": "string", "maxLength": 10},
            "facts": {
                "type": "object",
                "properties": {"population": {"type": "integer", "minimum": 0, "maximum": 99}},
                "required": ["population"],
                "additionalProperties": False,
            },
        },
        "required": ["country", "capital", "facts"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3},
]


def tool(name: str, properties: dict[str, Any]) -> dict[str, Any]:
    schema = {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}
    return {"type": "function", "function": {"name": name, "description": f"{name}.", "parameters": schema}}


TOOLS = [
    tool("get_weather", {"city": CITY, "units": {"enum": ["celsius", "fahrenheit"]}}),
    tool(
        "add",
        {"a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"type": "integer", "minimum": 0, "maximum": 99}},
    ),
    tool("get_time", {}),
]
TOOL_SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def questions(n: int, seed: int) -> list[str]:
    """``n`` varied questions: every task of the tiny corpus, many phrasings."""
    rng = random.Random(seed)
    return [random_question(rng, TASKS[i % len(TASKS)]).prompt for i in range(n)]


@pytest.fixture(scope="module")
def server() -> Iterator[BackgroundServer]:
    config = ServerConfig(model="tiny", engine_kwargs={"dtype": "float32", "num_kv_blocks": 512}, show_progress=False)
    with BackgroundServer(build_app(config)) as srv:
        srv.wait_ready(timeout=120)
        yield srv


@pytest.fixture(scope="module")
def client(server: BackgroundServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def in_parallel(fn: Any, items: list[Any]) -> list[Any]:
    """Requests side by side, so that the engine batches them (and masks rows of several grammars)."""
    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(fn, items))


# ------------------------------------------------------------------ response_format
def test_json_schema_is_followed_on_every_one_of_50_prompts(client: openai.OpenAI) -> None:
    def ask(i_question: tuple[int, str]) -> tuple[dict[str, Any], Any]:
        i, question = i_question
        schema = SCHEMAS[i % len(SCHEMAS)]
        response = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": question}],
            response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}},
            temperature=0.0 if i % 2 else 0.8,
            seed=i,
            max_tokens=200,
        )
        return schema, response.choices[0]

    for schema, choice in in_parallel(ask, list(enumerate(questions(50, seed=1)))):
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_n_choices_each_follow_the_schema(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the capital of Peru?"}],
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMAS[3]}},
        n=4,
        temperature=1.0,
        seed=5,
        max_tokens=200,
    )
    texts = [c.message.content for c in response.choices]
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMAS[3])
    assert len(set(texts)) > 1


def test_json_mode_gives_a_json_object_when_it_finishes(client: openai.OpenAI) -> None:
    choices = in_parallel(
        lambda q: client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": q}],
            response_format={"type": "json_object"},
            temperature=0.0,
            max_tokens=40,
        ).choices[0],
        questions(12, seed=2),
    )
    finished = [c for c in choices if c.finish_reason == "stop"]
    assert finished  # the tiny model closes some objects, and runs out of tokens inside others
    for choice in finished:
        assert isinstance(json.loads(choice.message.content), dict)


def test_structured_outputs_on_completions(client: openai.OpenAI) -> None:
    got = client.completions.create(
        model=MODEL, prompt="The answer is", max_tokens=8, extra_body={"structured_outputs": {"choice": ["yes", "no"]}}
    )
    assert got.choices[0].text in ("yes", "no") and got.choices[0].finish_reason == "stop"
    got = client.completions.create(
        model=MODEL,
        prompt="Numbers:",
        max_tokens=40,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMAS[4]}}},
    )
    jsonschema.validate(json.loads(got.choices[0].text), SCHEMAS[4])


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
            "response_format",
            "response_format.json_schema.schema does not compile: Invalid type: nonsense",
        ),
        ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs", "unclosed group"),
        ({"structured_outputs": {"grammar": "start: nowhere"}}, "structured_outputs", "nowhere"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one of"),
        (
            {"tools": [tool("f", {"x": {"type": "integer", "minimum": 5, "maximum": 1}})], "tool_choice": "required"},
            "tools",
            "tools.0.function.parameters does not compile",
        ),
    ],
)
def test_a_grammar_that_does_not_compile_is_a_400_naming_the_problem(
    server: BackgroundServer, extra: dict[str, Any], param: str, words: str
) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}
    response = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error


# ------------------------------------------------------------------ tool calls
def test_required_and_named_tool_calls_always_parse_on_50_prompts(client: openai.OpenAI) -> None:
    def ask(i_question: tuple[int, str]) -> tuple[str | None, Any]:
        i, question = i_question
        named = TOOLS[i % 3]["function"]["name"] if i % 4 == 0 else None
        choice: Any = {"type": "function", "function": {"name": named}} if named else "required"
        response = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": question}],
            tools=TOOLS,  # type: ignore[arg-type]
            tool_choice=choice,
            temperature=0.0 if i % 2 else 0.9,
            seed=i,
            max_tokens=200,
        )
        return named, response.choices[0]

    for named, choice in in_parallel(ask, list(enumerate(questions(50, seed=3)))):
        assert choice.finish_reason == "tool_calls", choice.message
        assert choice.message.content is None and len(choice.message.tool_calls) == 1
        call = choice.message.tool_calls[0].function
        assert named is None or call.name == named
        jsonschema.validate(json.loads(call.arguments), TOOL_SCHEMAS[call.name])


def test_streamed_tool_call_deltas_are_openai_shaped(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the weather in Oslo?"}],
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice="required",
        max_tokens=200,
        stream=True,
    )
    name, arguments, ids, reasons, fingerprints = "", "", [], [], set()
    for chunk in stream:
        fingerprints.add(chunk.system_fingerprint)
        for choice in chunk.choices:
            assert not choice.delta.content
            for call in choice.delta.tool_calls or []:
                assert call.index == 0
                if call.id is not None:
                    ids.append(call.id)
                    assert call.type == "function" and call.function.name
                    name = call.function.name
                arguments += call.function.arguments or ""
            if choice.finish_reason:
                reasons.append(choice.finish_reason)
    assert len(ids) == 1 and reasons == ["tool_calls"]
    jsonschema.validate(json.loads(arguments), TOOL_SCHEMAS[name])
    assert len(fingerprints) == 1 and next(iter(fingerprints)).startswith("fp_")


def test_forced_call_of_a_function_without_parameters_takes_none(client: openai.OpenAI) -> None:
    # OpenAI: "omitting parameters defines a function with an empty parameter list". An object
    # schema that merely lists no properties still allows any key, and the tiny model, given one,
    # writes keys until max_tokens.
    ping = {"type": "function", "function": {"name": "ping", "description": "Check that the service is up."}}
    for i, question in enumerate(questions(4, seed=6)):
        kwargs: Any = {
            "model": MODEL,
            "messages": [{"role": "user", "content": question}],
            "tools": [ping],
            "tool_choice": "required" if i % 2 else {"type": "function", "function": {"name": "ping"}},
            "temperature": 0.9,
            "seed": i,
            "max_tokens": 60,
        }
        choice = client.chat.completions.create(**kwargs).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice.message
        assert choice.message.tool_calls[0].function.arguments == "{}"
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
        arguments = "".join(
            d.function.arguments or "" for c in chunks for d in c.choices[0].delta.tool_calls or [] if d.function
        )
        assert arguments == "{}"


# ------------------------------------------------------------------ LangChain
class Weather(BaseModel):
    """The weather to look up."""

    city: str = Field(max_length=12)
    days: int = Field(ge=1, le=14)


class GetTime(BaseModel):
    """The time in a time zone."""

    zone: str = Field(max_length=8)


@pytest.fixture(scope="module")
def chat_model(server: BackgroundServer) -> ChatOpenAI:
    return ChatOpenAI(
        model=MODEL, base_url=server.base_url + "/v1", api_key="unused", temperature=0, max_retries=0, max_tokens=200
    )


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(chat_model: ChatOpenAI, method: str) -> None:
    # strict: the schema gets "additionalProperties": false. Without it, extra keys are allowed,
    # and the tiny model, once it opens one, may write its name until max_tokens.
    structured = chat_model.with_structured_output(Weather, method=method, strict=True)  # type: ignore[arg-type]
    for question in questions(6, seed=4):
        result = structured.invoke(question)
        assert isinstance(result, Weather)


@pytest.mark.parametrize("tool_choice", ["required", "GetTime"])
def test_langchain_bind_tools(chat_model: ChatOpenAI, tool_choice: str) -> None:
    bound = chat_model.bind_tools([Weather, GetTime], tool_choice=tool_choice, strict=True)
    for question in questions(6, seed=5):
        message = bound.invoke(question)
        assert not message.invalid_tool_calls and len(message.tool_calls) == 1  # type: ignore[attr-defined]
        call = message.tool_calls[0]  # type: ignore[attr-defined]
        assert tool_choice == "required" or call["name"] == tool_choice
        {"Weather": Weather, "GetTime": GetTime}[call["name"]].model_validate(call["args"])


# ------------------------------------------------------------------ the fields clients send
def test_min_tokens_and_max_completion_tokens(client: openai.OpenAI) -> None:
    messages: Any = [{"role": "user", "content": "What is 34 + 57?"}]
    short = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=40)
    assert short.choices[0].finish_reason == "stop" and short.usage.completion_tokens < 20
    longer = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_completion_tokens=30, extra_body={"min_tokens": 25}
    )
    assert 25 <= longer.usage.completion_tokens <= 30
    for create in (client.completions.create,):
        got = create(model=MODEL, prompt="What is", max_tokens=None, extra_body={"max_completion_tokens": 3})  # type: ignore[operator]
        assert got.usage.completion_tokens <= 3


def test_logit_bias_and_skip_special_tokens(client: openai.OpenAI) -> None:
    tokens = httpx.post(
        str(client.base_url).removesuffix("v1/") + "tokenize", json={"model": MODEL, "prompt": "<|im_start|> ship"}
    ).json()["tokens"]
    special, ship = tokens[0], tokens[-1]
    kwargs: Any = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": 0, "max_tokens": 3}
    assert client.chat.completions.create(**kwargs, logit_bias={str(ship): 100}).choices[0].message.content == (
        " ship" * 3
    )
    forced = {str(special): 100}
    skipped = client.chat.completions.create(**kwargs, logit_bias=forced)
    kept = client.chat.completions.create(**kwargs, logit_bias=forced, extra_body={"skip_special_tokens": False})
    assert skipped.choices[0].message.content == "" and kept.choices[0].message.content == "<|im_start|>" * 3


def test_include_stop_str_in_output(client: openai.OpenAI) -> None:
    kwargs: Any = {"model": MODEL, "prompt": "What is 34 + 57?", "temperature": 0, "max_tokens": 24}
    free = client.completions.create(**kwargs).choices[0].text
    stop = free.strip()[:2]
    cut = client.completions.create(**kwargs, stop=[stop]).choices[0].text
    kept = client.completions.create(**kwargs, stop=[stop], extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == cut + stop


def test_echo_on_completions(client: openai.OpenAI) -> None:
    kwargs: Any = {"model": MODEL, "prompt": "What is 34 + 57?", "temperature": 0, "max_tokens": 6}
    plain = client.completions.create(**kwargs).choices[0].text
    echoed = client.completions.create(**kwargs, echo=True, n=2)
    assert [c.text for c in echoed.choices] == ["What is 34 + 57?" + plain] * 2
    streamed = "".join(
        c.choices[0].text for c in client.completions.create(**kwargs, echo=True, stream=True) if c.choices
    )
    assert streamed == "What is 34 + 57?" + plain
    with pytest.raises(openai.BadRequestError, match="echo with logprobs is not supported"):
        client.completions.create(**kwargs, echo=True, logprobs=1)


def test_system_fingerprint_on_responses(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    text = client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    chunks = list(client.completions.create(model=MODEL, prompt="hi", max_tokens=2, stream=True))
    fingerprints = {chat.system_fingerprint, text.system_fingerprint, *(c.system_fingerprint for c in chunks)}
    assert len(fingerprints) == 1 and str(chat.system_fingerprint).startswith("fp_")
