"""The OpenAI wire format: request models, errors and response shapes (chapter 11).

Requests are pydantic models in strict mode with ``extra="forbid"``: a field of the wrong type
(``"max_tokens": "16"``) or a field we do not know is refused with a 400 that names it. Nothing
is accepted and ignored: a client that asks for a feature mini-infer lacks learns so at once,
instead of getting an answer that silently does not do what it asked.

Accepted beyond OpenAI's core fields (vLLM's extensions, which SGLang's and vLLM's benchmark
clients send): ``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``,
``stop_token_ids``, ``skip_special_tokens``, ``include_stop_str_in_output`` and
``structured_outputs`` (``{"json": schema}``, ``{"regex": ...}``, ``{"choice": [...]}``,
``{"grammar": lark}`` or ``{"json_object": true}``: constrained decoding, chapter 09b). Also:
``logit_bias``, ``max_completion_tokens`` and ``response_format`` (``text``, ``json_object``,
``json_schema``) on both endpoints, ``echo`` on completions; every response and chunk carries a
``system_fingerprint``.

Refused with a 400 (``UNSUPPORTED_FIELDS`` and the validators below say why): the legacy
``functions``/``function_call``, ``audio``, ``modalities``, ``prediction``, ``store``,
``metadata``, ``service_tier``, ``reasoning_effort``, ``web_search_options``, ``suffix``,
``best_of`` other than ``n``, ``parallel_tool_calls: false``, ``echo`` with ``logprobs`` (prompt
logprobs are not computed), a tool with ``strict: true`` under ``tool_choice`` "auto" (only a
forced call is constrained), and a grammar that does not compile (the message names the problem).

Responses are built as plain dicts (one JSON encode per chunk; pydantic would add a second
object per token on the hot path), in exactly the shapes the OpenAI API returns, so that the
official ``openai`` client and every tool built on it parse them.

Errors, everywhere, have OpenAI's shape::

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens", "code": null}}
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from mini_infer.sampling_params import SamplingParams, StructuredOutputsParams
from mini_infer.server.response_format import ResponseFormat, StructuredOutputsField
from mini_infer.server.validation_errors import first_field_error

MAX_LOGPROBS = 20
MAX_CHOICES = 128  # prompts x n in one call: a bound, so one call cannot queue unbounded work
MAX_STOP_CHARS = 1000  # one stop string: each new token's text is matched against them all
# JSON cannot carry -inf; OpenAI and vLLM report impossible tokens with this floor instead.
LOGPROB_FLOOR = -9999.0


class APIError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(message: str, *, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


# --------------------------------------------------------------------------------------------
# Requests
# --------------------------------------------------------------------------------------------

# Fields of OpenAI's API that mini-infer does not implement, and why; a null value is allowed
# (it asks for nothing). Everything else unknown is refused with a generic message.
UNSUPPORTED_FIELDS = {
    "functions": "the legacy 'functions' parameter is not supported: use 'tools'",
    "function_call": "the legacy 'function_call' parameter is not supported: use 'tool_choice'",
    "audio": "audio output is not supported",
    "modalities": "only text output is supported",
    "prediction": "predicted outputs are not supported",
    "store": "stored completions are not supported",
    "metadata": "stored completions (metadata) are not supported",
    "service_tier": "service tiers are not supported",
    "reasoning_effort": "reasoning models are not supported",
    "web_search_options": "web search is not supported",
    "suffix": "suffix (insertion) is not supported",
}


class _Strict(BaseModel):
    # strict: no "16" for 16, no 1.0 for an int, no true for 1 (ints are still accepted for floats).
    model_config = ConfigDict(strict=True, extra="forbid")


class _DropNullUnsupported(_Strict):
    @model_validator(mode="before")
    @classmethod
    def _drop_nulls(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if not (k in UNSUPPORTED_FIELDS and v is None)}
        return data


class FunctionDefinition(_Strict):
    # OpenAI's rule for names; it also lets a forced call be written into the prompt safely.
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    # A forced call's arguments (tool_choice "required" or named) always follow ``parameters``;
    # under "auto" a strict tool is refused (see chat.py).
    strict: bool | None = None

    def parameters_schema(self) -> dict[str, Any]:
        """The JSON Schema of the arguments; a function without ``parameters`` takes none (OpenAI:
        an empty parameter list), so no key is allowed: an object schema that only lists no
        properties would let a forced call write any keys."""
        if self.parameters is not None:
            return self.parameters
        return {"type": "object", "properties": {}, "additionalProperties": False}


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class _NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: _NamedFunction


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ToolCallFunction(_Strict):
    name: str
    arguments: str


class ToolCallParam(_Strict):
    id: str
    type: Literal["function"]
    function: ToolCallFunction


_NULL_ONLY_MESSAGE_FIELDS = ("refusal", "annotations", "audio", "function_call")


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    # OpenAI's optional participant name (AutoGen names every user message; LangChain sends a
    # message's name): given to the chat template, as vLLM does; Qwen's template leaves it out.
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _drop_empty_echoes(cls, data: Any) -> Any:
        # A client that sends back the assistant message it received carries these as null.
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if not (k in _NULL_ONLY_MESSAGE_FIELDS and v in (None, []))}
        return data

    @model_validator(mode="after")
    def _check_roles(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError("only tool messages carry tool_call_id")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"{'an' if self.role[0] in 'aeiou' else 'a'} {self.role} message needs content")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def to_template(self) -> dict[str, Any]:
        """The message as the chat template reads it."""
        # The template knows "system"; OpenAI's newer "developer" role means the same thing.
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": c.function.arguments},
                }
                for c in self.tool_calls
            ]
        return message


class StreamOptions(_Strict):
    include_usage: bool | None = None


Stop = str | Annotated[list[str], Field(max_length=16)]


class _SamplingFields(_DropNullUnsupported):
    """The parameters both endpoints share, with OpenAI's ranges and vLLM's extensions."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=2**31 - 1)  # above the vocabulary means all of it
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = Field(None, ge=0, lt=2**64)
    stop: Stop | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    n: int | None = Field(None, ge=1, le=MAX_CHOICES)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=10)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end-user id for abuse tracking; logged, does not change the output
    max_completion_tokens: int | None = Field(None, ge=1)
    min_tokens: int | None = Field(None, ge=0)
    logit_bias: dict[str, float] | None = None  # OpenAI's shape: token ids as strings
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, top_k: int | None) -> int | None:
        if top_k == 0:
            raise ValueError("must be -1 (disabled) or >= 1")
        return top_k

    @field_validator("stop")
    @classmethod
    def _stop(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if stop == "" or (isinstance(stop, list) and "" in stop):
            raise ValueError("stop strings must not be empty")
        if any(len(s) > MAX_STOP_CHARS for s in ([stop] if isinstance(stop, str) else stop or [])):
            raise ValueError(f"a stop string may have at most {MAX_STOP_CHARS} characters")
        return stop

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_token_ids(cls, ids: list[int] | None) -> list[int] | None:
        if ids is not None and any(t < 0 for t in ids):
            raise ValueError("token ids are >= 0")
        return ids

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for token, value in (bias or {}).items():
            if not token.isdigit():
                raise ValueError(f"keys are token ids written as strings, got {token!r}")
            if not -100 <= value <= 100:
                raise ValueError(f"biases are in [-100, 100], got {value} for token {token}")
        return bias

    @model_validator(mode="after")
    def _check_common(self) -> _SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        if (
            self.max_tokens is not None
            and self.max_completion_tokens is not None
            and self.max_tokens != self.max_completion_tokens
        ):
            raise ValueError("max_tokens and max_completion_tokens differ: give one of them")
        if (
            self.structured_outputs is not None
            and self.response_format is not None
            and self.response_format.type != "text"
        ):
            raise ValueError("structured_outputs and response_format both constrain the output: give one of them")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def output_constraint(self) -> tuple[StructuredOutputsParams | None, str]:
        """What the output must match, from ``response_format`` or ``structured_outputs``, and
        the field that asked (for a 400 naming it)."""
        if self.structured_outputs is not None:
            try:
                return self.structured_outputs.params(), "structured_outputs"
            except ValueError as exc:
                raise bad_request(str(exc), param="structured_outputs") from None
        if self.response_format is not None:
            return self.response_format.structured_outputs(), "response_format"
        return None, ""

    @property
    def num_choices(self) -> int:
        return self.n or 1

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_params(
        self,
        max_tokens: int,
        logprobs: int | None,
        choice: int,
        vocab_size: int,
        structured_outputs: StructuredOutputsParams | None = None,
    ) -> SamplingParams:
        """The engine's parameters for one choice; each choice of a seeded request gets its own seed.
        Only the fields the request sets are given: the engine fills the others with the model's
        defaults (its generation config), then vLLM's, as vLLM's server does."""
        given: dict[str, Any] = {
            name: getattr(self, name) for name in _SAMPLING_FIELDS if getattr(self, name) is not None
        }
        if self.seed is not None:
            given["seed"] = (self.seed + choice) % 2**64
        if self.top_p is not None:
            # Any top_p <= 1/V keeps only the most likely token (its probability is >= 1/V), so
            # raising it to 1/V changes nothing, and keeps it from rounding to 0 in float32 (where
            # the sampler's nucleus would be empty).
            given["top_p"] = max(self.top_p, 1.0 / vocab_size)
        if self.logit_bias:
            given["logit_bias"] = {int(t): b for t, b in self.logit_bias.items()}
        if structured_outputs is not None:
            given["structured_outputs"] = structured_outputs
        return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, **given)


# The request fields that are SamplingParams fields of the same name (seed, top_p and logit_bias
# are adjusted above; max_tokens and logprobs are resolved by the endpoint).
_SAMPLING_FIELDS = (
    "temperature",
    "top_k",
    "min_p",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "skip_special_tokens",
    "include_stop_str_in_output",
)


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if self.parallel_tool_calls is False and not self.forces_a_call:
            raise ValueError(
                "parallel_tool_calls false is supported with a forced call only (tool_choice 'required' or a "
                "named function, which makes exactly one call): under 'auto' nothing stops the model after one"
            )
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs to be true")
        if self.tool_choice is not None and not self.tools and self.tool_choice != "none":
            raise ValueError("tool_choice needs tools")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tools:
            names = {t.function.name for t in self.tools}
            if self.tool_choice.function.name not in names:
                raise ValueError(f"tool_choice names {self.tool_choice.function.name!r}, which is not among the tools")
        return self

    @property
    def forces_a_call(self) -> bool:
        """tool_choice "required" or a named function: exactly one call, constrained (chat.py)."""
        return bool(self.tools) and (self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice))

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


PromptInput = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(_SamplingFields):
    prompt: PromptInput
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = None  # the prompt's text first, then the completion
    best_of: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _check_completion(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of != self.num_choices:
            raise ValueError("best_of other than n is not supported (it would rank choices by logprob)")
        if self.echo and self.logprobs is not None:
            raise ValueError(
                "echo with logprobs is not supported: it needs the prompt's logprobs, which are not computed"
            )
        return self

    def prompts(self) -> list[str | list[int]]:
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise bad_request("prompt is an empty list", param="prompt")
        if isinstance(prompt[0], int):
            return [list(prompt)]
        return list(prompt)


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None
    add_generation_prompt: bool | None = None

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        if self.messages is None and (self.tools is not None or self.add_generation_prompt is not None):
            raise ValueError("tools and add_generation_prompt apply to messages only")
        return self


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


# --------------------------------------------------------------------------------------------
# Turning validation failures into 400s that name the field
# --------------------------------------------------------------------------------------------

M = TypeVar("M", bound=BaseModel)


def parse_request(model: type[M], body: dict[str, Any]) -> M:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise _validation_error(exc, model) from None
    except RecursionError:
        raise bad_request("the request is nested too deeply") from None


def _validation_error(exc: ValidationError, model: type[BaseModel]) -> APIError:
    error = first_field_error(exc)
    param = error.param
    if param is None:
        # A check across fields: its message starts with the field it is about.
        word = error.message.split(" ", 1)[0]
        if word in model.model_fields:
            return bad_request(error.message, param=word)
    if error.kind == "extra_forbidden" and error.loc:
        reason = UNSUPPORTED_FIELDS.get(error.loc[-1], "unknown field")
        return bad_request(f"{param}: {reason}; mini-infer refuses parameters it does not implement", param=param)
    if error.kind == "missing":
        return bad_request(f"{param} is required", param=param)
    return bad_request(f"{param}: {error.message}" if param else error.message, param=param)


def sampling_error(exc: ValueError) -> APIError:
    """A SamplingParams refusal (its messages start with the field's name)."""
    message = str(exc)
    param = message.split(" ", 1)[0]
    return bad_request(message, param=param if param.isidentifier() else None)


# --------------------------------------------------------------------------------------------
# Responses
# --------------------------------------------------------------------------------------------


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def sse(obj: Any) -> str:
    return f"data: {dumps(obj)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def safe_logprob(value: float) -> float:
    return value if math.isfinite(value) else LOGPROB_FLOOR


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        body["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return body


def tool_call_body(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def chat_completion(
    head: dict[str, Any], choices: Sequence[dict[str, Any]], usage_body: dict[str, Any]
) -> dict[str, Any]:
    return {**head, "object": "chat.completion", "choices": list(choices), "usage": usage_body}


def response_head(response_id: str, created: int, model: str, system_fingerprint: str) -> dict[str, Any]:
    """What every response and chunk of one call repeats (``object`` goes after ``id``)."""
    return {"id": response_id, "created": created, "model": model, "system_fingerprint": system_fingerprint}


class ChunkEncoder:
    """Stream chunks of one response as SSE events.

    Every chunk of a response repeats its id, object, created and model; they are encoded once,
    and each chunk encodes only its choices (the per-token cost of streaming is mostly here).
    With ``include_usage`` every chunk carries ``"usage": null`` and the last one the usage, with
    no choices, as OpenAI sends them.
    """

    def __init__(self, head: dict[str, Any], object: str, *, include_usage: bool) -> None:
        encoded = dumps({"id": head["id"], "object": object, **head})
        self._head = "data: " + encoded[:-1] + ',"choices":'
        self._tail = ',"usage":null}\n\n' if include_usage else "}\n\n"

    def chunk(self, choices: list[dict[str, Any]]) -> str:
        return self._head + dumps(choices) + self._tail

    def usage_chunk(self, usage_body: dict[str, Any]) -> str:
        return self._head + '[],"usage":' + dumps(usage_body) + "}\n\n"


def completion(
    head: dict[str, Any], choices: Sequence[dict[str, Any]], usage_body: dict[str, Any] | None
) -> dict[str, Any]:
    body: dict[str, Any] = {"id": head["id"], "object": "text_completion", **head, "choices": list(choices)}
    if usage_body is not None:
        body["usage"] = usage_body
    return body
