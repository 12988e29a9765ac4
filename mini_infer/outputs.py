"""What the engine returns for a request (chapter 06).

``RequestOutput`` follows vLLM's shape: cumulative ``token_ids`` and ``text`` of the generated
part, plus the piece that is new since the last output (``new_token_ids``, ``new_text``) for
streaming. ``finish_reason`` is ``None`` while running, then ``"stop"`` (EOS, a stop token or a
stop string), ``"length"`` (``max_tokens`` reached), ``"abort"``, or ``"error"``: the request's own
work raised (``faults``), and ``error`` says what.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: dict[int, float] = field(default_factory=dict)  # the k most likely tokens, when asked


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    logprobs: list[TokenLogprob] | None = None
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache
    error: str | None = None  # with finish_reason "error": the stage and the exception
