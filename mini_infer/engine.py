"""The engine: one step = schedule, run, sample, update (chapter 06).

``LLMEngine`` owns the model, the KV pool, the scheduler and the sampler. Its step reads like
its description::

    schedule = scheduler.schedule()                 # who runs, how many tokens each
    result   = runner.execute(schedule.scheduled)   # one flat forward, logits where we sample
    tokens   = sampler(result.logits, ...)          # one host sync
    scheduler.update(...); outputs = self._process(...)   # append, detokenize, stop, free

Requests come in through ``add_request`` (a prompt string or token ids, and ``SamplingParams``);
``step`` returns a ``RequestOutput`` for every request that progressed (with the new text for
streaming); ``abort_request`` finishes a request at once and frees its blocks. The offline
``LLM`` class and the server both drive this same loop.

With a ``draft_model`` (speculative decoding, chapter 10) the step gains two calls: before the
forward the draft proposes tokens for the decoding sequences (``speculator.propose``), and after
it the target's logits verify that proposal (``speculator.verify``), so a sequence may gain several tokens
in one step. Without one, those lines do nothing.

The KV pool is allocated once, after the weights, from a memory budget (or a block count).
Invariant, checked by tests after every step: every block is free, or held by running
sequences and/or the prefix cache.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from mini_infer.config import ModelConfig
from mini_infer.device import resolve_device, resolve_dtype
from mini_infer.kv.block_pool import BlockPool, num_blocks_for
from mini_infer.kv.paged_attention import PagedKVCache
from mini_infer.kv.radix_cache import RadixCache
from mini_infer.model import Qwen2Model
from mini_infer.model_runner import ModelRunner
from mini_infer.model_source import resolve_model
from mini_infer.outputs import RequestOutput, TokenLogprob
from mini_infer.sampling import Sampler, SamplingParams, StopStringChecker, make_generator
from mini_infer.scheduler import Scheduler
from mini_infer.sequence import Sequence
from mini_infer.tokenizer import IncrementalDetokenizer, Tokenizer

if TYPE_CHECKING:
    from mini_infer.speculative import SpeculativeDecoder

_CPU_KV_BUDGET_BYTES = 2 * 1024**3
DEFAULT_NUM_SPECULATIVE_TOKENS = 4


@dataclass(slots=True)
class EngineConfig:
    model: str
    dtype: str | torch.dtype = "auto"
    device: str | torch.device = "auto"
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: int | None = None  # bytes; None: a budget chosen from the device
    gpu_memory_utilization: float = 0.9
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 256
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    draft_model: str | None = None  # speculative decoding (chapter 10): a small model with the same vocabulary
    num_speculative_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS  # drafts verified per decode step, with draft_model
    seed: int = 0
    show_progress: bool = True

    def validate(self) -> None:
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_kv_blocks is not None and (not isinstance(self.num_kv_blocks, int) or self.num_kv_blocks < 1):
            raise ValueError(f"num_kv_blocks must be a positive integer or None, got {self.num_kv_blocks!r}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be a positive number of bytes or None, got {self.kv_cache_memory!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"num_speculative_tokens must be a positive integer, got {k!r}")
        if self.draft_model is None and k != DEFAULT_NUM_SPECULATIVE_TOKENS:
            raise ValueError(
                f"num_speculative_tokens={k} does nothing without a draft model: give draft_model "
                "(for example 'tiny-draft' for 'tiny') or leave num_speculative_tokens at its default"
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be a positive integer or None, got {self.max_model_len!r}")


@dataclass(slots=True)
class StepRecord:
    """What one step computed, for benchmarks that compare a run with its roofline."""

    num_tokens: int  # new tokens through the model
    num_logits: int  # rows sampled
    attended_tokens: int  # sum over new tokens of the context each attended to


@dataclass(slots=True)
class _RequestState:
    """Per-request output bookkeeping that the scheduler does not need."""

    seq: Sequence
    prompt: str | None
    detokenizer: IncrementalDetokenizer
    stop_checker: StopStringChecker | None
    text: str = ""
    logprobs: list[TokenLogprob] | None = None
    num_reported_tokens: int = 0


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        config.validate()
        self.config = config
        self.model_dir = resolve_model(config.model)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.model_config = ModelConfig.from_model_dir(self.model_dir)
        self.tokenizer = Tokenizer(self.model_dir)
        self.model = Qwen2Model.from_pretrained(self.model_dir, self.dtype, self.device, show_progress=config.show_progress)
        self.model.prepack_weights()  # bf16 on a CPU: matmul weights in oneDNN's layout (chapter 02)
        self.max_model_len = min(config.max_model_len or self.model_config.max_position_embeddings, self.model_config.max_position_embeddings)
        self.draft_model: Qwen2Model | None = None
        if config.draft_model is not None:
            self.draft_model = self._load_draft(config.draft_model)
            self.max_model_len = min(self.max_model_len, self.draft_model.config.max_position_embeddings)

        num_blocks = config.num_kv_blocks or self._blocks_from_memory_budget()
        self.kv_cache = PagedKVCache(self.model_config, num_blocks, config.block_size, self.dtype, self.device)
        self.pool = BlockPool(num_blocks, config.block_size)
        self.prefix_cache = RadixCache(self.pool) if config.enable_prefix_caching else None
        self.scheduler = Scheduler(
            self.pool,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            max_model_len=self.max_model_len,
            prefix_cache=self.prefix_cache,
            num_speculative_tokens=config.num_speculative_tokens if self.draft_model is not None else 0,
        )
        self.runner = ModelRunner(self.model, self.kv_cache)
        self.sampler = Sampler()
        self.speculator: SpeculativeDecoder | None = None
        if self.draft_model is not None:
            from mini_infer.speculative import SpeculativeDecoder  # chapter 10, loaded only when used

            # Same block count and block ids as the target's pool.
            draft_kv = PagedKVCache(self.draft_model.config, num_blocks, config.block_size, self.dtype, self.device)
            smaller_vocab = self.draft_model.config.vocab_size < self.model_config.vocab_size
            draft_runner = ModelRunner(self.draft_model, draft_kv, feed_unknown_ids_as=0 if smaller_vocab else None)
            self.speculator = SpeculativeDecoder(draft_runner, self.model_config.vocab_size)
        self.generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self.eos_token_ids = set(self.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self._requests: dict[str, _RequestState] = {}
        self._ids = itertools.count()
        self._arrivals = itertools.count()
        self.counters = {"prompt_tokens": 0, "generated_tokens": 0, "steps": 0, "finished_requests": 0}
        self.step_log: list[StepRecord] | None = None  # set to [] to record every step

    # ----------------------------------------------------------------- models and memory
    def _load_draft(self, name: str) -> Qwen2Model:
        """The draft model of speculative decoding (chapter 10), checked against the target."""
        draft_dir = resolve_model(name)
        draft_config = ModelConfig.from_model_dir(draft_dir)
        # Token ids must mean the same in both models. Equal vocabulary sizes are taken on
        # trust (as vLLM does); different ones are fine when only the padding differs, that is
        # when both tokenizers are the same (Qwen2.5-0.5B drafting for Qwen2.5-7B).
        if draft_config.vocab_size != self.model_config.vocab_size and (
            Tokenizer(draft_dir).hf.get_vocab() != self.tokenizer.hf.get_vocab()
        ):
            raise ValueError(
                f"draft_model {name!r} has a vocabulary of {draft_config.vocab_size} tokens and another tokenizer "
                f"than the target {self.config.model!r} ({self.model_config.vocab_size} tokens); a draft must share "
                "the target's tokenizer (for example Qwen2.5-0.5B-Instruct for Qwen2.5-1.5B-Instruct, tiny-draft for tiny)"
            )
        draft = Qwen2Model.from_pretrained(draft_dir, self.dtype, self.device, show_progress=self.config.show_progress)
        draft.prepack_weights()
        return draft

    def _blocks_from_memory_budget(self) -> int:
        """KV blocks from a memory budget, capped at what max_num_seqs full-length sequences need."""
        per_block = PagedKVCache.bytes_per_block(self.model_config, self.config.block_size, self.dtype)
        if self.draft_model is not None:  # each block id holds the draft's K/V too
            per_block += PagedKVCache.bytes_per_block(self.draft_model.config, self.config.block_size, self.dtype)
        if self.config.kv_cache_memory is not None:
            budget = int(self.config.kv_cache_memory)
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            # Leave room for activations of the largest step: logits and MLP dominate.
            c = self.model_config
            activations = self.config.max_num_batched_tokens * (c.vocab_size * 4 + c.intermediate_size * 2 * 4 + c.hidden_size * 16)
            budget = int(free - (1 - self.config.gpu_memory_utilization) * total - activations)
        else:
            try:
                ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            except (ValueError, OSError, AttributeError):
                ram = 8 * 1024**3
            budget = min(_CPU_KV_BUDGET_BYTES, ram // 5)
        useful = self.config.max_num_seqs * num_blocks_for(self.max_model_len, self.config.block_size)
        blocks = min(budget // per_block, useful)
        if blocks < 1:
            raise MemoryError(
                f"no memory is left for the KV cache ({budget / 2**20:.0f} MiB after the weights); use a smaller "
                "model, a lower max_num_batched_tokens, or set num_kv_blocks"
            )
        return int(blocks)

    # ----------------------------------------------------------------- requests
    def add_request(
        self,
        prompt: str | Seq[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        fork_of: str | None = None,
    ) -> str:
        """Submit a request; returns its id. Raises ValueError for a request that cannot run.

        ``fork_of`` names a request with the same prompt (the ``n`` choices of one API call):
        this one waits until that prompt is computed, then shares its full blocks by reference
        count instead of computing them again. Give each fork its own ``seed`` if it has one.
        """
        params = params or SamplingParams()
        if isinstance(prompt, str):
            text: str | None = prompt
            token_ids = self.tokenizer.encode(prompt)
        else:
            text = None
            token_ids = [int(t) for t in prompt]
        if not token_ids:
            raise ValueError("the prompt is empty: give at least one token")
        vocab = self.model_config.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        parent = None
        if fork_of is not None:
            if fork_of not in self._requests:
                raise ValueError(f"fork_of={fork_of!r} is not a request in flight")
            parent = self._requests[fork_of].seq
            if parent.prompt_token_ids != token_ids:
                raise ValueError(f"a fork must have the same prompt as request {fork_of!r}")
        generator = make_generator(params.seed, self.device) if params.seed is not None else None
        seq = Sequence(request_id, token_ids, params, arrival=next(self._arrivals), generator=generator, parent=parent)
        self.scheduler.add(seq)  # raises RequestTooLongError for a request that can never fit
        stop = StopStringChecker(params.stop, params.include_stop_str_in_output) if params.stop else None
        self._requests[request_id] = _RequestState(seq, text, IncrementalDetokenizer(self.tokenizer), stop)
        self.counters["prompt_tokens"] += len(token_ids)
        return request_id

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Finish a request now and free its blocks; returns its last output (None if unknown)."""
        state = self._requests.pop(request_id, None)
        if state is None:
            return None
        self.scheduler.finish(state.seq, "abort")
        return self._output(state, [])

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished

    # ----------------------------------------------------------------- one step
    def step(self) -> list[RequestOutput]:
        schedule = self.scheduler.schedule()
        if schedule.is_empty:
            return []
        scheduled = schedule.scheduled
        # Chapter 10: with a draft model, its proposals fill the items' draft_token_ids.
        proposal = self.speculator.propose(scheduled, self.generator) if self.speculator is not None else None
        result = self.runner.execute(scheduled)
        # What each scheduled sequence gets: nothing (a chunk short of the end), one sampled
        # token, or the accepted drafts and one more (speculative decoding).
        produced: list[list[int]] = [[] for _ in scheduled]
        logprob_of: list[TokenLogprob | None] = [None] * len(scheduled)
        verified: dict[int, list[int]] = {}
        if self.speculator is not None and proposal is not None:
            verified = self.speculator.verify(proposal, result, scheduled, self.generator)
        for i, tokens in verified.items():
            produced[i] = tokens
        sampling = [i for i, rows in enumerate(result.rows_of) if len(rows) and i not in verified]
        if sampling:
            seqs = [scheduled[i].seq for i in sampling]
            logits = result.logits_at([result.rows_of[i][0] for i in sampling])  # one row each
            # Token histories are only gathered when a request uses penalties: the common case
            # stays free of per-step work proportional to sequence length.
            penalties = any(s.params.needs_penalties for s in seqs)
            out = self.sampler(
                logits,
                [s.params for s in seqs],
                [s.generator for s in seqs],
                default_generator=self.generator,
                prompt_token_ids=[s.prompt_token_ids for s in seqs] if penalties else None,
                output_token_ids=[s.output_token_ids for s in seqs] if penalties else None,
            )
            out = out.to_host()  # the step's one host sync (verification has its own)
            tokens = out.token_ids.tolist()
            logprobs = out.to_token_logprobs(tokens) if out.logprobs is not None else [None] * len(tokens)
            for i, token, logprob in zip(sampling, tokens, logprobs):
                produced[i], logprob_of[i] = [token], logprob
        self.scheduler.update(scheduled, produced)
        self.counters["steps"] += 1
        if self.step_log is not None:
            self.step_log.append(
                StepRecord(
                    num_tokens=schedule.num_tokens,
                    num_logits=result.logits.shape[0],
                    attended_tokens=sum(s.num_new_tokens * s.context_len for s in scheduled),
                )
            )

        outputs = []
        for item, tokens, logprob in zip(scheduled, produced, logprob_of):
            state = self._requests.get(item.seq.request_id)
            if tokens and state is not None:
                outputs.append(self._append_tokens(state, tokens, logprob))
        return outputs

    def _append_tokens(self, state: _RequestState, tokens: list[int], logprob: TokenLogprob | None) -> RequestOutput:
        """Detokenize and check stops for this step's new tokens (already in ``seq.token_ids``);
        one output for them all. Tokens after a stop (accepted drafts past an EOS, say) are
        dropped from the sequence."""
        seq, params = state.seq, state.seq.params
        if logprob is not None and params.logprobs is not None:
            if state.logprobs is None:
                state.logprobs = []
            state.logprobs.append(logprob)
        num_before = seq.num_output_tokens - len(tokens)
        text = ""
        for j, token in enumerate(tokens):
            self.counters["generated_tokens"] += 1
            piece, reason, stop_reason = self._check_token(state, token, num_before + j + 1)
            text += piece
            if reason is not None:
                del seq.token_ids[len(seq.token_ids) - (len(tokens) - j - 1) :]
                seq.stop_reason = stop_reason
                self.scheduler.finish(seq, reason)
                self._requests.pop(seq.request_id, None)
                self.counters["finished_requests"] += 1
                tokens = tokens[: j + 1]
                break
        state.text += text
        return self._output(state, tokens, text)

    def _check_token(self, state: _RequestState, token: int, num_output_tokens: int) -> tuple[str, str | None, str | int | None]:
        """One new token: its text, and why the request finishes with it (None: it goes on)."""
        params = state.seq.params
        reason: str | None = None
        stop_reason: str | int | None = None
        piece = ""
        if token in self.eos_token_ids and not params.ignore_eos:
            reason = "stop"  # EOS ends the turn; its text is not part of the answer
        elif token in params.stop_token_ids:
            reason, stop_reason = "stop", token
        else:
            piece = state.detokenizer.push([token])
            if state.stop_checker is not None and piece:
                piece, hit = state.stop_checker.push(piece)
                if hit:
                    reason, stop_reason = "stop", state.stop_checker.matched
            if reason is None and num_output_tokens >= params.max_tokens:
                reason = "length"
        if reason is not None and not isinstance(stop_reason, str):
            # Release what was held back: bytes of an unfinished character, and text that
            # could have been the start of a stop string.
            tail = state.detokenizer.flush()
            if state.stop_checker is not None:
                tail, _ = state.stop_checker.push(tail) if tail else ("", False)
                tail += state.stop_checker.flush()
            piece += tail
        return piece, reason, stop_reason

    def _output(self, state: _RequestState, new_tokens: list[int], new_text: str = "") -> RequestOutput:
        seq = state.seq
        return RequestOutput(
            request_id=seq.request_id,
            prompt=state.prompt,
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=list(seq.output_token_ids),
            text=state.text,
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            new_token_ids=new_tokens,
            new_text=new_text,
            logprobs=None if state.logprobs is None else list(state.logprobs),
            num_cached_tokens=seq.num_cached_prompt_tokens,
        )

    # ----------------------------------------------------------------- counters
    def stats(self) -> dict[str, int]:
        s = self.scheduler
        return {
            "prompt_tokens": self.counters["prompt_tokens"],
            "generated_tokens": self.counters["generated_tokens"],
            "num_preemptions": s.num_preemptions,
            "kv_blocks_total": self.pool.num_blocks,
            "kv_blocks_free": self.pool.num_free_blocks,
            "prefix_cache_hit_tokens": s.prefix_cache_hit_tokens,
            "prefix_cache_query_tokens": s.prefix_cache_query_tokens,
            "num_running": len(s.running),
            "num_waiting": len(s.waiting),
            "steps": self.counters["steps"],
            "finished_requests": self.counters["finished_requests"],
            # Speculative decoding (chapter 10): draft tokens verified, and how many were kept.
            "num_draft_tokens": self.speculator.num_draft_tokens if self.speculator is not None else 0,
            "num_accepted_draft_tokens": self.speculator.num_accepted_tokens if self.speculator is not None else 0,
        }

