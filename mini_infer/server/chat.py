"""``POST /v1/chat/completions`` (chapter 11).

The path of a chat request:

1. validate the body (``ChatCompletionRequest``); the model name must be ours;
2. in the tokenizer thread, render the messages (and tools) with the model's chat template and
   tokenize them; a named ``tool_choice`` also writes the start of that call into the prompt,
   so the model's answer *is* a call to it;
3. check the length (400 with prompt tokens, requested tokens and the limit);
4. submit ``n`` engine requests (forks of the first, sharing its prompt blocks);
5. stream chunks as outputs arrive, or wait for all of them and answer once, in both cases
   aborting everything if the client goes away.

``tool_choice``: ``"none"`` leaves the tools out of the prompt and returns text; ``"auto"`` (the
default with tools) lists them and parses any ``<tool_call>`` the model writes, arguments as the
model wrote them (a tool marked ``strict`` is refused there: only a forced call is constrained);
a named function, or ``"required"``, forces one call: the prompt ends with its start (with the
name, when there is only one to choose), and constrained decoding (chapter 09b) keeps the rest to
``tool_calls.call_grammar``, so that the arguments always follow the function's JSON Schema.
``response_format`` ``json_object`` or ``json_schema`` constrains the answer to JSON the same
way; it cannot be combined with a forced call. A schema or grammar that does not compile is a
400 naming the problem.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from mini_infer.sampling_params import StructuredOutputsParams
from mini_infer.server.async_engine import Choice, RequestStream
from mini_infer.server.protocol import (
    ChatCompletionRequest,
    NamedToolChoice,
    Tool,
    bad_request,
    chat_completion,
    parse_request,
    sampling_error,
    tool_call_body,
    usage,
)
from mini_infer.server.serving import (
    Call,
    ServerState,
    TokenTexts,
    merge_batch,
    resolve_max_tokens,
)
from mini_infer.server.tool_calls import TOOL_CALL_END, ParserDelta, ToolCallParser, call_grammar, call_start
from mini_infer.tokenizer import Tokenizer

logger = logging.getLogger("mini_infer.server")


@dataclass(slots=True)
class _Prompt:
    token_ids: list[int]
    parse_tools: bool
    forced: str  # text written into the prompt for the model to continue ("" when none)


def _forced_call(
    req: ChatCompletionRequest, tokenizer: Tokenizer
) -> tuple[str, StructuredOutputsParams | None, list[tuple[StructuredOutputsParams, str]]]:
    """For a forced call: the start of the call written into the prompt, the grammar of the rest,
    and the parts to check (each function's schema on its own, so that an error names it)."""
    choice, tools = req.tool_choice, req.tools or []
    if isinstance(choice, NamedToolChoice):
        functions = [t.function for t in tools if t.function.name == choice.function.name]
    elif choice == "required":
        functions = [t.function for t in tools]
    else:
        for i, tool in enumerate(tools):
            if tool.function.strict and choice != "none":
                raise bad_request(
                    "strict function calling is supported for a forced call only: tool_choice 'required' or a "
                    "named function; under 'auto' the model's arguments are returned as written",
                    param=f"tools.{i}.function.strict",
                )
        return "", None, []
    end = tokenizer.encode(TOOL_CALL_END)
    end_tag = f"<[{end[0]}]>" if len(end) == 1 else json.dumps(TOOL_CALL_END)
    name_given = len(functions) == 1
    grammar = call_grammar([(f.name, f.parameters_schema()) for f in functions], name_given=name_given, end_tag=end_tag)
    parts = [
        (StructuredOutputsParams(json=f.parameters_schema()), f"tools.{_index(tools, f.name)}.function.parameters")
        for f in functions
    ]
    return call_start(functions[0].name if name_given else None), StructuredOutputsParams(grammar=grammar), parts


def _index(tools: list[Tool], name: str) -> int:
    return next(i for i, t in enumerate(tools) if t.function.name == name)


def _render(tokenizer: Tokenizer, req: ChatCompletionRequest, forced: str) -> list[int]:
    """Runs in the tokenizer thread."""
    use_tools = bool(req.tools) and req.tool_choice != "none"
    tools = [t.model_dump(exclude_none=True) for t in req.tools or []] if use_tools else None
    try:
        text = tokenizer.apply_chat_template([m.to_template() for m in req.messages], tools=tools)
    except Exception as exc:  # a template raises for conversations it cannot render
        raise bad_request(f"the chat template could not render these messages: {exc}", param="messages") from None
    return tokenizer.encode(text + forced)


async def create_chat_completion(state: ServerState, request: Request, body: dict[str, Any]) -> Response:
    req = parse_request(ChatCompletionRequest, body)
    state.check_model(req.model)
    info, tokenizer = state.ready()
    forced, constraint, parts = _forced_call(req, tokenizer)
    asked, param = req.output_constraint()
    if asked is not None:
        if constraint is not None:
            raise bad_request(
                f"{param} and a forced tool call (tool_choice) both constrain the output: give one of them", param=param
            )
        constraint = asked
        parts = [(asked, "response_format.json_schema.schema" if param == "response_format" else param)]
    elif constraint is not None:
        parts.append((constraint, "tools"))  # the whole call: the functions' names and schemas together
    await state.check_request(req, info, parts)
    token_ids = await state.in_tokenizer_thread(_render, tokenizer, req, forced)
    prompt = _Prompt(token_ids, parse_tools=bool(req.tools) and req.tool_choice != "none", forced=forced)
    default = info.sampling_defaults.get("max_tokens")  # the model's max_new_tokens, else the room left
    max_tokens = resolve_max_tokens(info, len(token_ids), req.requested_max_tokens, default, prompt_param="messages")
    try:
        params = [
            req.sampling_params(max_tokens, req.num_logprobs, i, info.vocab_size, constraint)
            for i in range(req.num_choices)
        ]
    except ValueError as exc:
        raise sampling_error(exc) from None
    choices = [Choice(token_ids, p, fork_of=None if i == 0 else 0) for i, p in enumerate(params)]
    texts = state.token_texts if req.logprobs else None
    response_id = f"chatcmpl-{uuid.uuid4().hex}"
    if req.user:
        logger.debug("%s for user %r", response_id, req.user)
    # From here on every way out must abort the stream: nothing below raises before the
    # try/finally or the streaming generator (whose finally aborts) takes it over.
    stream = await state.submit(choices, response_id)
    call = _ChatCall(state, req, stream, prompt, response_id, texts)
    return await call.respond(request, bool(req.stream))


class _ChatCall(Call):
    """One chat completion in flight: per-choice parsers and counters, and the two ways out."""

    def __init__(
        self,
        state: ServerState,
        req: ChatCompletionRequest,
        stream: RequestStream,
        prompt: _Prompt,
        response_id: str,
        texts: TokenTexts | None,
    ) -> None:
        super().__init__(state, stream, response_id, "chat.completion.chunk", req.include_usage)
        self.prompt = prompt
        n = len(stream.request_ids)
        self.parsers = [ToolCallParser() if prompt.parse_tools else None for _ in range(n)]
        self.logprobs_sent = [0] * n
        self.texts = texts

    def _finish_reason(self, index: int, reason: str | None) -> str | None:
        parser = self.parsers[index]
        if reason == "stop" and parser is not None and parser.tool_calls:
            return "tool_calls"
        return reason

    def _usage(self) -> dict[str, Any]:
        completion_tokens = sum(len(out.token_ids) for out in self.finals if out is not None)
        first = self.finals[0]
        return usage(
            len(self.prompt.token_ids), completion_tokens, first.num_cached_tokens if first is not None else None
        )

    # ----------------------------------------------------------------- not streaming
    def response(self) -> dict[str, Any]:
        choices = []
        for index, out in enumerate(self.finals):
            parser = self.parsers[index]
            message: dict[str, Any] = {"role": "assistant", "content": out.text}
            if parser is not None:
                parser.push(self.prompt.forced)
                parser.push(out.text)
                parser.finish()
                message["content"] = parser.content or (None if parser.tool_calls else "")
                if parser.tool_calls:
                    message["tool_calls"] = [tool_call_body(c.id, c.name, c.arguments) for c in parser.tool_calls]
            logprobs = None
            if self.texts is not None:
                logprobs = {"content": [self.texts.chat_entry(e) for e in out.logprobs or []]}
            choices.append(
                {
                    "index": index,
                    "message": message,
                    "logprobs": logprobs,
                    "finish_reason": self._finish_reason(index, out.finish_reason),
                }
            )
        return chat_completion(self.head, choices, self._usage())

    # ----------------------------------------------------------------- streaming
    def _chunk(self, choices: list[dict[str, Any]]) -> str:
        return self.encoder.chunk(choices)

    @staticmethod
    def _delta(pd: ParserDelta) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        if pd.content:
            delta["content"] = pd.content
        if pd.tool_calls:
            calls = []
            for c in pd.tool_calls:
                function: dict[str, Any] = {"arguments": c.arguments}
                call: dict[str, Any] = {"index": c.index, "function": function}
                if c.id is not None:
                    call["id"], call["type"] = c.id, "function"
                    function["name"] = c.name
                calls.append(call)
            delta["tool_calls"] = calls
        return delta

    async def _choice_chunks(self) -> AsyncGenerator[str, None]:
        for index, parser in enumerate(self.parsers):
            first: dict[str, Any] = {"role": "assistant", "content": ""}
            if parser is not None and self.prompt.forced:
                # The forced start of a call announces it at once: no content, the call's name.
                first = {"role": "assistant", "content": None, **self._delta(parser.push(self.prompt.forced))}
            yield self._chunk([{"index": index, "delta": first, "logprobs": None, "finish_reason": None}])
        while not self.stream.finished:
            for index, m in merge_batch(await self.stream.next_batch()):
                out = m.out
                self.finals[index] = out
                parser = self.parsers[index]
                if parser is None:
                    pd = ParserDelta(content=m.new_text)
                else:
                    pd = parser.push(m.new_text)
                    if out.finished:
                        pd.extend(parser.finish())
                logprobs = None
                if self.texts is not None and out.logprobs:
                    new = out.logprobs[self.logprobs_sent[index] :]
                    self.logprobs_sent[index] = len(out.logprobs)
                    logprobs = {"content": [self.texts.chat_entry(e) for e in new]}
                if pd or logprobs:
                    yield self._chunk(
                        [{"index": index, "delta": self._delta(pd), "logprobs": logprobs, "finish_reason": None}]
                    )
                if out.finished:
                    reason = self._finish_reason(index, out.finish_reason)
                    yield self._chunk([{"index": index, "delta": {}, "logprobs": None, "finish_reason": reason}])
