"""The offline API: ``LLM(...).generate(prompts, SamplingParams(...))`` (chapter 10; used from chapter 00).

The names and defaults are vLLM's, so that code written for vLLM reads the same here::

    from mini_infer import LLM, SamplingParams
    llm = LLM("tiny")
    outputs = llm.generate(["What is 2 + 3?"], SamplingParams(max_tokens=16, temperature=0))
    print(outputs[0].text)

``generate`` submits every prompt to the continuous-batching engine at once and steps it until
all are done; outputs come back in prompt order. Every field a ``SamplingParams`` leaves unset
takes the model's own default from its ``generation_config.json`` (``generation_config="auto"``,
the default; ``"vllm"`` ignores the file), field by field as ``transformers``' ``generate`` and
vLLM's server do (vLLM's offline ``LLM`` uses the model's defaults only when no SamplingParams is
given); ``get_default_sampling_params()`` shows what a request that sets nothing gets. ``stream`` yields one request's outputs as the
engine produces them (the other requests in flight progress too). ``chat`` applies the model's
chat template first.

``close()`` (or ``with LLM(...) as llm:``) releases what would outlive the object: the worker
processes of a tensor-parallel engine (chapter 14), which garbage collection also ends.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any

from tqdm.auto import tqdm

from mini_infer.engine import is_token_id
from mini_infer.engine_builder import EngineConfig, build_engine
from mini_infer.outputs import RequestOutput
from mini_infer.sampling_params import SamplingParams
from mini_infer.tokenizer import Message, template_messages

Prompt = str | Sequence[int]


class LLM:
    """The whole engine behind vLLM's offline API. ``options`` are ``EngineConfig``'s fields
    (``dtype``, ``device``, ``num_kv_blocks``, ``max_num_seqs``, ``enable_prefix_caching``,
    ``draft_model``, ``num_speculative_tokens``, ``seed``, ...); an unknown one is a TypeError."""

    def __init__(self, model: str, **options: Any) -> None:
        self.engine = build_engine(EngineConfig(model=model, **options))

    def get_default_sampling_params(self) -> SamplingParams:
        """What a request that sets no field gets: the model's defaults over vLLM's."""
        return SamplingParams().with_defaults(self.engine.sampling_defaults)

    @property
    def tokenizer(self) -> Any:
        """The Hugging Face tokenizer (``transformers.PreTrainedTokenizerFast``)."""
        return self.engine.tokenizer.hf

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; one finished ``RequestOutput`` per prompt, in order."""
        prompt_list = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompt_list))
        # Validate and submit everything before running anything. A bad prompt, a failed step (a
        # dead tensor-parallel worker, chapter 14) or an interrupt fails the call without leaving
        # any of its requests in the engine.
        request_ids: list[str] = []
        finals: dict[str, RequestOutput] = {}
        try:
            for prompt, p in zip(prompt_list, params):
                request_ids.append(self.engine.add_request(prompt, p))
            wanted = set(request_ids)
            with tqdm(total=len(request_ids), desc="Generating", unit="req", disable=not use_tqdm, leave=False) as bar:
                while len(finals) < len(request_ids):
                    for out in self.engine.step():
                        if out.finished and out.request_id in wanted:
                            finals[out.request_id] = out
                            bar.update(1)
        except BaseException:
            for request_id in request_ids:
                self.engine.abort_request(request_id)  # a no-op for a finished one
            raise
        return [finals[r] for r in request_ids]

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        tools: Sequence[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """Apply the chat template to one conversation or a list of them, then ``generate``. A
        message's content may be a string or OpenAI's list of text parts."""
        if isinstance(messages, list | tuple) and messages and not isinstance(messages[0], Mapping):
            where = [f"conversation {i}: " for i in range(len(messages))]
            conversations = [template_messages(c, w) for c, w in zip(messages, where)]
        else:
            conversations = [template_messages(messages)]
        prompts = [self.engine.tokenizer.apply_chat_template(c, tools=tools) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield this request's outputs step by step; closing the iterator aborts it."""
        request_id = self.engine.add_request(prompt, sampling_params)
        try:
            while True:
                for out in self.engine.step():
                    if out.request_id == request_id:
                        yield out
                        if out.finished:
                            return
        finally:
            self.engine.abort_request(request_id)

    def stats(self) -> dict[str, int]:
        """Engine counters: tokens, preemptions, KV blocks, prefix-cache hits, steps."""
        return self.engine.stats()

    def close(self) -> None:
        """End the engine's worker processes (tensor parallelism); a no-op on one process."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, Sequence) and prompts and all(is_token_id(t) for t in prompts):
        return [prompts]  # type: ignore[list-item]  # one prompt given as token ids
    result: list[Prompt] = []
    for i, p in enumerate(prompts):
        if not isinstance(p, str) and not (isinstance(p, Sequence) and all(is_token_id(t) for t in p)):
            bad = next((t for t in p if not is_token_id(t)), None) if isinstance(p, Sequence) else None
            what = f"a list holding {bad!r} ({type(bad).__name__})" if isinstance(p, Sequence) else type(p).__name__
            raise TypeError(f"prompt {i} must be a string or a list of int token ids, got {what}")
        result.append(p)
    return result


def _as_params_list(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [params] * n
    result = list(params)
    if len(result) != n:
        raise ValueError(f"got {len(result)} SamplingParams for {n} prompts: give one, or one per prompt")
    return result
