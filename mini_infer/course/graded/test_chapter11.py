"""Graded tests (chapter 11): the server's event stream, from engine outputs to ``data: [DONE]``.

``merge_batch`` folds the outputs of one choice that arrived together; a completion's
``_choice_chunks`` turns outputs into chunks (an echo first, a chunk per new text, the
``finish_reason`` on the last); ``Call.events`` sends them, the usage chunk when asked, an error
event if the engine dies, and ``data: [DONE]``, and aborts the request however the stream ends.
Most tests feed scripted outputs through a stand-in for the engine's ``RequestStream``; the last
runs the real server on the shipped tiny model and compares a stream with the same request
answered in one piece.
"""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from mini_infer.outputs import RequestOutput, TokenLogprob
from mini_infer.server.async_engine import EngineState, EngineUnavailableError
from mini_infer.server.completions import _CompletionCall
from mini_infer.server.serving import merge_batch


def output(request_id: str, text: str, new_text: str, new_ids: list[int], reason: str | None = None) -> RequestOutput:
    """One engine output: ``text`` so far (cumulative), ``new_text`` and ``new_ids`` this step."""
    return RequestOutput(
        request_id,
        None,
        [1, 2, 3],
        list(range(len(text))),
        text,
        finished=reason is not None,
        finish_reason=reason,
        new_token_ids=new_ids,
        new_text=new_text,
    )


class ScriptedStream:
    """What a ``Call`` reads from the engine: ``next_batch`` returns the scripted batches in turn
    (an exception in the script is raised, as when the engine dies); ``abort`` is counted."""

    def __init__(self, batches: list[Any], n: int = 1) -> None:
        self.request_ids = [f"req-{i}" for i in range(n)]
        self._batches = list(batches)
        self._unfinished = set(range(n))
        self.aborts = 0

    @property
    def finished(self) -> bool:
        return not self._unfinished

    async def next_batch(self) -> list[tuple[int, RequestOutput]]:
        batch = self._batches.pop(0)
        if isinstance(batch, Exception):
            self._unfinished.clear()
            raise batch
        for index, out in batch:
            if out.finished:
                self._unfinished.discard(index)
        return list(batch)

    def abort(self) -> None:
        self.aborts += 1


class LetterTexts:
    """Stands for the server's ``TokenTexts`` (which needs a tokenizer): token t reads as the letter
    chr(97 + t), one character long."""

    def completion_logprobs(self, entries: list[TokenLogprob], text_offset: int) -> tuple[dict[str, Any], int]:
        tokens = [chr(97 + e.token_id) for e in entries]
        offsets = list(range(text_offset, text_offset + len(tokens)))
        body = {"tokens": tokens, "token_logprobs": [e.logprob for e in entries], "text_offset": offsets}
        return body, text_offset + len(tokens)


def completion_call(
    stream: ScriptedStream, include_usage: bool = False, echoes: list[str] | None = None, texts: Any = None
) -> Any:
    state = SimpleNamespace(model_name="graded-model", system_fingerprint="fp_graded")
    request = SimpleNamespace(include_usage=include_usage)
    n = len(stream.request_ids)
    return _CompletionCall(state, request, stream, [[1, 2, 3]], n, "cmpl-1", texts, echoes)  # type: ignore[arg-type]


def events_of(call: Any, stop_after: int | None = None) -> list[str]:
    """The raw events of ``call.events()``; with ``stop_after``, the client leaves after that many."""

    async def read() -> list[str]:
        got = []
        generator = call.events()
        async for event in generator:
            got.append(event)
            if stop_after is not None and len(got) == stop_after:
                await generator.aclose()
                break
        return got

    return asyncio.run(read())


def parse(events: list[str]) -> list[Any]:
    """Each event as JSON (``"[DONE]"`` stays a string); checks the wire format on the way."""
    parsed = []
    for event in events:
        assert event.startswith("data: ") and event.endswith("\n\n") and "\n\n" not in event[:-2], repr(event)
        body = event[len("data: ") : -2]
        parsed.append(body if body == "[DONE]" else json.loads(body))
    return parsed


def choices(parsed: list[Any]) -> list[tuple[int, str, str | None]]:
    return [(c["index"], c["text"], c["finish_reason"]) for chunk in parsed[:-1] for c in chunk["choices"]]


@pytest.mark.points(2)
def test_merge_batch_folds_each_choices_outputs_in_order_of_arrival():
    a1, b1 = output("a", "He", "He", [1]), output("b", "X", "X", [7])
    a2, a3 = output("a", "Hel", "l", [2]), output("a", "Hello", "lo", [3, 4], "stop")
    merged = merge_batch([(0, a1), (1, b1), (0, a2), (0, a3)])
    assert [index for index, _ in merged] == [0, 1]
    first, second = merged[0][1], merged[1][1]
    assert (first.out, first.new_text, first.new_token_ids) == (a3, "Hello", [1, 2, 3, 4])
    assert (second.out, second.new_text, second.new_token_ids) == (b1, "X", [7])
    assert a1.new_token_ids == [1] and a1.new_text == "He"  # the outputs themselves are left alone
    assert merge_batch([]) == []
    only = merge_batch([(3, a2)])
    assert [(i, m.new_text, m.new_token_ids, m.out) for i, m in only] == [(3, "l", [2], a2)]


@pytest.mark.points(3)
def test_a_stream_is_one_chunk_per_output_then_done():
    stream = ScriptedStream([[(0, output("r", "He", "He", [1]))], [(0, output("r", "Hello", "llo", [2], "length"))]])
    call = completion_call(stream)
    parsed = parse(events_of(call))
    assert parsed[-1] == "[DONE]" and len(parsed) == 3
    assert choices(parsed) == [(0, "He", None), (0, "llo", "length")]
    for chunk in parsed[:-1]:
        assert (chunk["id"], chunk["object"], chunk["model"]) == ("cmpl-1", "text_completion", "graded-model")
        assert chunk["system_fingerprint"] == "fp_graded" and "usage" not in chunk
        assert set(chunk["choices"][0]) == {"index", "text", "logprobs", "finish_reason"}
    assert call.finals[0].text == "Hello" and call.finals[0].finish_reason == "length"


@pytest.mark.points(2)
def test_outputs_that_arrive_together_are_sent_as_one_chunk():
    batch = [(0, output("r", "a", "a", [1])), (0, output("r", "ab", "b", [2])), (0, output("r", "abc", "c", [3]))]
    stream = ScriptedStream([batch, [(0, output("r", "abcd", "d", [4], "stop"))]])
    parsed = parse(events_of(completion_call(stream)))
    assert choices(parsed) == [(0, "abc", None), (0, "d", "stop")]


@pytest.mark.points(2)
def test_nothing_new_sends_nothing_but_the_end_is_always_sent():
    quiet = output("r", "", "", [5])  # a token whose text is not complete yet (half a character)
    stream = ScriptedStream([[(0, quiet)], [(0, output("r", "é", "é", [6]))], [(0, output("r", "é", "", [], "stop"))]])
    parsed = parse(events_of(completion_call(stream)))
    assert choices(parsed) == [(0, "é", None), (0, "", "stop")]


@pytest.mark.points(2)
def test_several_choices_each_get_their_index_and_their_own_end():
    stream = ScriptedStream(
        [
            [(1, output("r1", "x", "x", [1])), (0, output("r0", "p", "p", [2]))],
            [(0, output("r0", "pq", "q", [3], "stop")), (1, output("r1", "xy", "y", [4]))],
            [(1, output("r1", "xyz", "z", [5], "length"))],
        ],
        n=2,
    )
    call = completion_call(stream)
    parsed = parse(events_of(call))
    assert choices(parsed) == [(1, "x", None), (0, "p", None), (0, "q", "stop"), (1, "y", None), (1, "z", "length")]
    assert [f.text for f in call.finals] == ["pq", "xyz"]


@pytest.mark.points(2)
def test_logprobs_are_sent_with_the_chunk_of_their_tokens_each_once():
    entries = [TokenLogprob(t, -0.5 * (t + 1)) for t in range(3)]

    def with_logprobs(out: RequestOutput, count: int) -> RequestOutput:
        out.logprobs = entries[:count]
        return out

    stream = ScriptedStream(
        [
            [(0, with_logprobs(output("r", "a", "a", [0]), 1))],
            [(0, with_logprobs(output("r", "a", "", [1]), 2))],  # a token with no text yet: its logprob still goes
            [(0, with_logprobs(output("r", "abc", "bc", [2], "length"), 3))],
        ]
    )
    parsed = parse(events_of(completion_call(stream, texts=LetterTexts())))
    assert choices(parsed) == [(0, "a", None), (0, "", None), (0, "bc", "length")]
    sent = [chunk["choices"][0]["logprobs"] for chunk in parsed[:-1]]
    assert [body["tokens"] for body in sent] == [["a"], ["b"], ["c"]]
    assert [body["text_offset"] for body in sent] == [[0], [1], [2]]
    assert [body["token_logprobs"] for body in sent] == [[-0.5], [-1.0], [-1.5]]


@pytest.mark.points(1)
def test_an_echo_is_sent_before_the_completion():
    stream = ScriptedStream([[(0, output("r", "!", "!", [1], "stop"))]])
    parsed = parse(events_of(completion_call(stream, echoes=["Say it"])))
    assert choices(parsed) == [(0, "Say it", None), (0, "!", "stop")]


@pytest.mark.points(2)
def test_usage_comes_last_before_done_when_asked_for():
    stream = ScriptedStream([[(0, output("r", "ok", "ok", [1, 2], "stop"))]])
    parsed = parse(events_of(completion_call(stream, include_usage=True)))
    assert len(parsed) == 3 and parsed[-1] == "[DONE]"
    assert parsed[0]["usage"] is None and parsed[0]["choices"][0]["text"] == "ok"
    assert parsed[1]["choices"] == []
    assert parsed[1]["usage"]["prompt_tokens"] == 3 and parsed[1]["usage"]["completion_tokens"] == 2
    assert parsed[1]["usage"]["total_tokens"] == 5


@pytest.mark.points(2)
def test_an_engine_that_dies_midway_ends_the_stream_with_an_error_event():
    stream = ScriptedStream([[(0, output("r", "He", "He", [1]))], EngineUnavailableError("the engine died: boom")])
    parsed = parse(events_of(completion_call(stream, include_usage=True)))
    assert parsed[0]["choices"][0]["text"] == "He"
    assert "boom" in parsed[1]["error"]["message"] and parsed[1]["error"]["code"] == "engine_unavailable"
    assert parsed[2:] == ["[DONE]"]  # no usage chunk after an error


@pytest.mark.points(2)
def test_a_client_that_leaves_aborts_its_request():
    never_ending = [[(0, output("r", "a" * i, "a", [i]))] for i in range(1, 10)]
    stream = ScriptedStream(never_ending)
    events = events_of(completion_call(stream), stop_after=2)
    assert len(events) == 2 and "[DONE]" not in events[-1]
    assert stream.aborts == 1  # freed at once, not when max_tokens runs out


@pytest.mark.points(3)
def test_the_real_server_streams_what_it_answers_in_one_piece():
    from mini_infer.server.app import build_app
    from mini_infer.server.background import BackgroundServer
    from mini_infer.server.serving import ServerConfig

    engine = {"dtype": "float32", "num_kv_blocks": 64, "max_num_batched_tokens": 128}
    config = ServerConfig(model="tiny", served_model_name="tiny", engine_kwargs=engine, show_progress=False)
    body = {"model": "tiny", "prompt": "the cache is", "max_tokens": 12, "temperature": 0, "n": 2, "echo": True}
    with BackgroundServer(build_app(config)) as server:
        engine = server.app.state.server.engine
        deadline = time.monotonic() + 120
        while engine.state is not EngineState.READY:  # a dead engine fails now, not after the timeout
            assert engine.state is not EngineState.DEAD, engine.unavailable()
            assert time.monotonic() < deadline, "the tiny model did not load within 120 s"
            time.sleep(0.05)
        with httpx.Client(base_url=server.base_url, timeout=60) as http:
            whole = http.post("/v1/completions", json=body).json()
            with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
                assert response.headers["content-type"].startswith("text/event-stream")
                raw = response.read().decode()
            chat_body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6}
            chat_whole = http.post("/v1/chat/completions", json={**chat_body, "temperature": 0}).json()
            with http.stream("POST", "/v1/chat/completions", json={**chat_body, "temperature": 0, "stream": True}) as r:
                chat_raw = r.read().decode()
    events = [event + "\n\n" for event in raw.split("\n\n")[:-1]]
    parsed = parse(events)
    assert parsed[-1] == "[DONE]" and raw.endswith("data: [DONE]\n\n")
    texts = ["", ""]
    reasons: list[str | None] = [None, None]
    for index, text, reason in choices(parsed):
        assert reasons[index] is None, "a chunk after the choice's end"
        texts[index] += text
        reasons[index] = reason
    assert texts == [c["text"] for c in whole["choices"]]
    assert reasons == [c["finish_reason"] for c in whole["choices"]]
    chat = parse([event + "\n\n" for event in chat_raw.split("\n\n")[:-1]])
    streamed = "".join(c["delta"].get("content") or "" for chunk in chat[:-1] for c in chunk["choices"])
    assert chat[-1] == "[DONE]" and streamed == chat_whole["choices"][0]["message"]["content"]
