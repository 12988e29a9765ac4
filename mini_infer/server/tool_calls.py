"""Turning a model's ``<tool_call>`` blocks into OpenAI ``tool_calls``, streaming included (chapter 11).

A Qwen2.5-style chat template tells the model to call a function by writing::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

``ToolCallParser`` reads the generated text piece by piece, as the engine streams it, and
splits it into ordinary content and tool calls. It is incremental so that a streaming client
sees a call's name as soon as the model has written it and its arguments as they are written;
the non-streaming answer runs the *same* parser over the whole text at once, so both ways give
the same content and the same calls.

Rules (the same whether the text comes in one piece or a character at a time):

* text outside ``<tool_call>...</tool_call>`` is content; whitespace directly before
  ``<tool_call>`` and directly after ``</tool_call>`` is dropped (it only separates blocks);
* inside a block, once ``{"name": "...", "arguments": `` has been read, the call is announced
  (an id, its name) and the arguments stream as the model writes them. The closing ``}`` of the
  outer object is held back until ``</tool_call>`` shows which brace it is. The arguments are
  the model's own text: like OpenAI's non-strict function calling, nothing guarantees that they
  are valid JSON, and a client must check;
* a block whose start does not have that shape is parsed as JSON when it closes (any key order);
* a block that is not a call at all is given back as content, tags included, so nothing the
  model wrote is lost;
* a block left open when generation ends (``max_tokens``) is closed as it stands.

A *forced* call (``tool_choice`` "required" or a named function) is constrained decoding (chapter
09b): the prompt ends with the start of the call, and ``call_grammar`` is the grammar of the rest,
a function's name among those allowed, arguments that follow its JSON Schema, written compactly
as the template writes them, and the closing tag, after which only the end of the turn is
allowed. Those arguments always parse.

Invariant: the concatenation of all content deltas is the final content, and for each call the
concatenation of its argument deltas is its final arguments string.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from mini_infer.structured_output import JSON_OPTIONS

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
TOOL_CALL_CLOSE = "}\n"  # between a call's arguments and TOOL_CALL_END, as the chat template writes it
# The start of a call as Qwen's template asks for it: name first, then arguments.
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"([^"\\]*)"\s*,\s*"arguments"\s*:\s*')
_CLOSING = "}" + " \t\r\n"


def call_start(name: str | None) -> str:
    """The prompt's last words for a forced call: the call opened, with ``name`` when it is the
    only choice (names match ``[A-Za-z0-9_-]+``, so they need no escaping)."""
    return f'{TOOL_CALL_START}\n{{"name": "' + ("" if name is None else f'{name}", "arguments": ')


def call_grammar(functions: Sequence[tuple[str, dict[str, Any]]], *, name_given: bool, end_tag: str) -> str:
    """A Lark grammar (llguidance's dialect) for what follows ``call_start``: for one of
    ``functions`` (name, JSON Schema of its arguments), its name unless ``name_given``, its
    arguments, the outer object's ``}`` and ``end_tag`` (a grammar item: the closing tag's token,
    ``<[id]>``, or its text)."""
    alternatives, rules = [], []
    for i, (name, schema) in enumerate(functions):
        head = "" if name_given else json.dumps(f'{name}", "arguments": ') + " "
        alternatives.append(f"{head}args{i}")
        rules.append(f"args{i}: %json {json.dumps({**schema, 'x-guidance': JSON_OPTIONS})}")
    return "\n".join([f"start: ({' | '.join(alternatives)}) {json.dumps(TOOL_CALL_CLOSE)} {end_tag}", *rules])


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(slots=True)
class ToolCallDelta:
    """A piece of one call: the first piece of a call carries its id and name."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


@dataclass(slots=True)
class ParserDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)

    def extend(self, other: ParserDelta) -> None:
        self.content += other.content
        for call in other.tool_calls:
            self._add(call)

    def _add(self, call: ToolCallDelta) -> None:
        last = self.tool_calls[-1] if self.tool_calls else None
        if last is not None and last.index == call.index and call.id is None:
            last.arguments += call.arguments  # one delta per call per chunk
        else:
            self.tool_calls.append(call)


@dataclass(slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str


@dataclass(slots=True)
class _OpenCall:
    index: int
    id: str
    header_end: int = -1  # where the arguments start in the block; -1 until the name is read
    name: str | None = None
    arguments_sent: str = ""


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _parse_block(block: str) -> tuple[str, str] | None:
    """(name, arguments) of a block written as one JSON object, or None."""
    try:
        obj = json.loads(block)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or "arguments" not in obj:
        return None
    arguments = obj["arguments"]
    return obj["name"], arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


class ToolCallParser:
    """Split streamed model text into content and tool calls (see the module docstring)."""

    def __init__(self) -> None:
        self._buffer = ""  # text received but not yet given out (a whole open block, or a held tail)
        self._call: _OpenCall | None = None
        self._strip_leading = False  # just after </tool_call>: drop whitespace before the next text
        self.tool_calls: list[ToolCall] = []
        self.content = ""

    def push(self, text: str) -> ParserDelta:
        self._buffer += text
        delta = ParserDelta()
        while True:
            if self._call is None:
                if not self._scan_text(delta):
                    break
            elif not self._scan_call(delta):
                break
        self.content += delta.content
        return delta

    def finish(self) -> ParserDelta:
        """Generation has ended: give out what is held back and close an open block."""
        delta = ParserDelta()
        if self._call is not None:
            self._close_call(self._buffer, delta, closed=False)
        elif not self._strip_leading:
            delta.content += self._buffer
        self._buffer = ""
        self.content += delta.content
        return delta

    # ----------------------------------------------------------------- outside a block
    def _scan_text(self, delta: ParserDelta) -> bool:
        """Give out content; True when a block has just opened (scan again)."""
        if self._strip_leading:
            self._buffer = self._buffer.lstrip()
            if not self._buffer:
                return False
            self._strip_leading = False
        start = self._buffer.find(TOOL_CALL_START)
        if start >= 0:
            delta.content += self._buffer[:start].rstrip()
            self._buffer = self._buffer[start + len(TOOL_CALL_START) :]
            self._call = _OpenCall(index=len(self.tool_calls), id=new_tool_call_id())
            return True
        # Hold back what could be the start of a tag, and trailing whitespace (dropped if a
        # tag follows it).
        cut = len(self._buffer) - _partial_suffix(self._buffer, TOOL_CALL_START)
        text = self._buffer[:cut].rstrip()
        delta.content += text
        self._buffer = self._buffer[len(text) :]
        return False

    # ----------------------------------------------------------------- inside a block
    def _scan_call(self, delta: ParserDelta) -> bool:
        """Advance the open call; True when it has just closed (scan again)."""
        call = self._call
        assert call is not None
        end = self._buffer.find(TOOL_CALL_END)
        if end >= 0:
            self._close_call(self._buffer[:end], delta, closed=True)
            self._buffer = self._buffer[end + len(TOOL_CALL_END) :]
            self._strip_leading = True
            return True
        if call.name is None and not self._read_header(call, self._buffer, delta):
            return False
        raw = self._buffer[call.header_end :].lstrip()
        raw = raw[: len(raw) - _partial_suffix(raw, TOOL_CALL_END)]
        # Any run of braces at the end may hold the outer object's "}": keep it until the block
        # closes. The safe part only ever grows, so every delta extends the previous ones.
        safe = raw.rstrip(_CLOSING)
        if len(safe) > len(call.arguments_sent):
            delta._add(ToolCallDelta(call.index, arguments=safe[len(call.arguments_sent) :]))
            call.arguments_sent = safe
        return False

    @staticmethod
    def _read_header(call: _OpenCall, block: str, delta: ParserDelta) -> bool:
        match = _HEADER.match(block)
        if match is None:
            return False
        call.name, call.header_end = match.group(1), match.end()
        delta._add(ToolCallDelta(call.index, id=call.id, name=call.name))
        return True

    def _close_call(self, block: str, delta: ParserDelta, *, closed: bool) -> None:
        call = self._call
        assert call is not None
        self._call = None
        if call.name is None and not self._read_header(call, block, delta):
            parsed = _parse_block(block)
            if parsed is None:
                # Not a call: give the model's text back as content, tags and all.
                delta.content += TOOL_CALL_START + block + (TOOL_CALL_END if closed else "")
                return
            name, arguments = parsed
            delta._add(ToolCallDelta(call.index, arguments=arguments, id=call.id, name=name))
            self.tool_calls.append(ToolCall(call.id, name, arguments))
            return
        assert call.name is not None
        arguments = block[call.header_end :].strip()
        if arguments.endswith("}"):
            arguments = arguments[:-1].rstrip()  # the outer object's closing brace
        # What was sent is a prefix of this (see _scan_call); the guard only keeps a surprise
        # from sending a second copy.
        rest = arguments[len(call.arguments_sent) :] if arguments.startswith(call.arguments_sent) else ""
        if rest:
            delta._add(ToolCallDelta(call.index, arguments=rest))
        self.tool_calls.append(ToolCall(call.id, call.name, call.arguments_sent + rest))
