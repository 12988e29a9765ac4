"""``POST /v1/completions``: the legacy text API (chapter 11).

A prompt is a string, a list of strings, a list of token ids, or a list of token-id lists.
Each prompt gets ``n`` choices, numbered ``prompt_index * n + i`` as OpenAI numbers them; all
of them go to the engine as one submission (forks share their prompt's blocks). ``max_tokens``
defaults to 16, as in OpenAI's completions API (chat defaults to the rest of the context).
``echo`` puts the prompt's text before each choice's text (in the first chunk when streaming);
``response_format`` and ``structured_outputs`` constrain the text (chapter 09b). ``suffix``,
``best_of`` other than ``n`` and ``echo`` with ``logprobs`` are refused.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from mini_infer.server.async_engine import Choice, RequestStream
from mini_infer.server.protocol import (
    MAX_CHOICES,
    CompletionRequest,
    bad_request,
    completion,
    parse_request,
    sampling_error,
    usage,
)
from mini_infer.server.serving import (
    Call,
    ServerState,
    TokenTexts,
    check_token_ids,
    merge_batch,
    resolve_max_tokens,
)
from mini_infer.tokenizer import Tokenizer

OPENAI_COMPLETIONS_MAX_TOKENS = 16


def _tokenize(tokenizer: Tokenizer, prompts: list[str | list[int]]) -> list[list[int]]:
    """Runs in the tokenizer thread."""
    return [tokenizer.encode(p) if isinstance(p, str) else p for p in prompts]


async def create_completion(state: ServerState, request: Request, body: dict[str, Any]) -> Response:
    req = parse_request(CompletionRequest, body)
    state.check_model(req.model)
    info, tokenizer = state.ready()
    prompts = req.prompts()
    n = req.num_choices
    if len(prompts) * n > MAX_CHOICES:
        raise bad_request(
            f"{len(prompts)} prompts x n={n} is more than {MAX_CHOICES} choices in one request", param="n"
        )
    constraint, param = req.output_constraint()
    await state.check_request(req, info, [] if constraint is None else [(constraint, param)])
    prompt_ids = await state.in_tokenizer_thread(_tokenize, tokenizer, prompts)
    choices: list[Choice] = []
    for ids in prompt_ids:
        check_token_ids(ids, info, "prompt")
        default = info.sampling_defaults.get("max_tokens", OPENAI_COMPLETIONS_MAX_TOKENS)  # the model's, else OpenAI's
        max_tokens = resolve_max_tokens(info, len(ids), req.requested_max_tokens, default, prompt_param="prompt")
        first = len(choices)
        for i in range(n):
            try:
                params = req.sampling_params(max_tokens, req.logprobs, i, info.vocab_size, constraint)
            except ValueError as exc:
                raise sampling_error(exc) from None
            choices.append(Choice(ids, params, fork_of=None if i == 0 else first))
    texts = state.token_texts if req.logprobs is not None else None
    echoes = None
    if req.echo:  # the prompt as given, or as its tokens read (special tokens included)
        decoded = await state.in_tokenizer_thread(lambda: [tokenizer.decode(ids, False) for ids in prompt_ids])
        echoes = [p if isinstance(p, str) else text for p, text in zip(prompts, decoded)]
    response_id = f"cmpl-{uuid.uuid4().hex}"
    # From here on every way out must abort the stream (see chat.py).
    stream = await state.submit(choices, response_id)
    call = _CompletionCall(state, req, stream, prompt_ids, n, response_id, texts, echoes)
    return await call.respond(request, bool(req.stream))


class _CompletionCall(Call):
    def __init__(
        self,
        state: ServerState,
        req: CompletionRequest,
        stream: RequestStream,
        prompt_ids: list[list[int]],
        n: int,
        response_id: str,
        texts: TokenTexts | None,
        echoes: list[str] | None = None,
    ) -> None:
        super().__init__(state, stream, response_id, "text_completion", req.include_usage)
        self.prompt_tokens = sum(len(ids) for ids in prompt_ids)
        size = len(stream.request_ids)
        self.n = n
        # Each choice's echo, sent once before its text (choice i belongs to prompt i // n).
        self.echoes = [echoes[i // n] if echoes else "" for i in range(size)]
        self.logprobs_sent = [0] * size
        self.text_offsets = [0] * size
        self.texts = texts

    def _usage(self) -> dict[str, Any]:
        completion_tokens = sum(len(out.token_ids) for out in self.finals if out is not None)
        cached = sum(out.num_cached_tokens for i, out in enumerate(self.finals) if out is not None and i % self.n == 0)
        return usage(self.prompt_tokens, completion_tokens, cached)

    def _logprobs(self, index: int, out: Any) -> dict[str, Any] | None:
        if self.texts is None:
            return None
        entries = (out.logprobs or [])[self.logprobs_sent[index] :]
        self.logprobs_sent[index] += len(entries)
        body, self.text_offsets[index] = self.texts.completion_logprobs(entries, self.text_offsets[index])
        return body

    def response(self) -> dict[str, Any]:
        choices = [
            {
                "index": i,
                "text": self.echoes[i] + out.text,
                "logprobs": self._logprobs(i, out),
                "finish_reason": out.finish_reason,
            }
            for i, out in enumerate(self.finals)
        ]
        return completion(self.head, choices, self._usage())

    async def _choice_chunks(self) -> AsyncGenerator[str, None]:
        # student: begin chapter 11: each choice's echo, then a chunk per new text or logprobs, finish_reason at its end
        for index, echo in enumerate(self.echoes):
            if echo:
                yield self.encoder.chunk([{"index": index, "text": echo, "logprobs": None, "finish_reason": None}])
        while not self.stream.finished:
            for index, m in merge_batch(await self.stream.next_batch()):
                out = m.out
                self.finals[index] = out
                logprobs = self._logprobs(index, out)
                if m.new_text or logprobs or out.finished:
                    choice = {
                        "index": index,
                        "text": m.new_text,
                        "logprobs": logprobs,
                        "finish_reason": out.finish_reason if out.finished else None,
                    }
                    yield self.encoder.chunk([choice])
        # student: end
