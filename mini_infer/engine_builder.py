"""Building a whole engine from ``EngineConfig``: every chapter's part, assembled (chapter 10).

``EngineConfig`` declares every engine option once, with vLLM's names and defaults: ``LLM(...)``,
the server and every command's flags (``cli_options``) are derived from it, so they cannot drift
apart. ``build_engine(config)`` then does, in order:

1. find the model (chapter 01), choose the device and dtype (chapters 00 and 02), load the
   tokenizer and the weights, prepacked for a CPU's matrix units (chapters 01-03);
2. with a ``draft_model``, check that it shares the target's tokenizer and load it (chapter 10);
3. size the KV pool from a memory budget unless ``num_kv_blocks`` is given (``kv.sizing``; on
   CUDA after measuring the reserved memory of the largest step, speculative verification's
   sampled rows included, ``measure_activation_peak``),
   and allocate it once, for the draft too (chapters 04-05);
4. choose how batched groups attend (``attention_backend``: SDPA over gathered blocks, or chapter
   05c's Triton kernel reading them in place; the choice and its reason are logged), then on CUDA,
   unless ``enforce_eager``, let each model's decode steps replay CUDA graphs (``decode_graphs``,
   chapter 05);
   with ``tensor_parallel_size`` N > 1, steps 1, 3 and 4 happen on every rank instead: rank 0 (this
   process) starts ranks 1..N-1 and each loads its shard of the weights and allocates its part of
   the pool; a draft model runs whole on rank 0 beside its shard, with a pool of its own (chapter
   14, which this chapter reaches by module name, ``TENSOR_PARALLEL_LAUNCHER``, and only then: no
   module imports a later chapter);
5. put together the scheduler (chapters 06-07) with the radix prefix cache (chapter 08) and the
   draft's slots, the full sampler (chapter 09) with constrained decoding for structured
   outputs (chapter 09b; its grammar engine starts at the first request that has a grammar),
   or the speculative decoder that verifies (chapter 10), and the engine loop (chapter 06),
   which gives every request the model's own sampling defaults for the fields it leaves unset
   (``generation_config``, as vLLM's ``--generation-config``: ``auto`` reads the model's
   ``generation_config.json``, ``vllm`` ignores it, a directory reads that directory's).
"""

from __future__ import annotations

import importlib
import logging
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from mini_infer.config import Check, ModelConfig, Rule, check_fields, checked, must_be
from mini_infer.decode_graphs import DecodeGraphs
from mini_infer.device import resolve_device, resolve_dtype
from mini_infer.engine import LLMEngine
from mini_infer.kv.attention_backend import ATTENTION_BACKENDS, choose_attention
from mini_infer.kv.block_pool import BlockPool, num_blocks_for
from mini_infer.kv.paged_attention import PagedKVCache
from mini_infer.kv.radix_cache import RadixCache
from mini_infer.kv.sizing import kv_blocks_for_memory
from mini_infer.model import Qwen2Model
from mini_infer.model_runner import ModelRunner, SequenceInput
from mini_infer.model_source import resolve_model
from mini_infer.sampling import Sampler, SamplingParams
from mini_infer.sampling_params import generation_defaults
from mini_infer.scheduler import Scheduler
from mini_infer.speculative import SpeculativeDecoder, check_draft_vocabulary
from mini_infer.structured_output import StructuredOutputs
from mini_infer.tokenizer import Tokenizer

_LOG = logging.getLogger(__name__)

DEFAULT_NUM_SPECULATIVE_TOKENS = 4


def _option(default: Any, help: str, check: Check | None = None) -> Any:
    return checked(default, check, help=help)


_POSITIVE = Rule(int, "a positive int", lambda x: x >= 1)
_POSITIVE_OR_NONE = Rule(int, "None or a positive int", lambda x: x >= 1, optional=True)


def _generation_config(name: str, source: Any) -> str:
    if source in ("auto", "vllm") or (isinstance(source, str) and (Path(source) / "generation_config.json").is_file()):
        return source
    raise must_be(name, "'auto', 'vllm' or a directory holding a generation_config.json", source)


def _attention_backend(name: str, value: Any) -> str:
    if value not in ATTENTION_BACKENDS:
        raise must_be(name, " or ".join(repr(b) for b in ATTENTION_BACKENDS), value)
    return str(value)


@dataclass(slots=True)
class EngineConfig:
    """The engine's options; an option with a rule is checked by it as the config is built
    (``config.check_fields``), so that a bad one fails before anything loads."""

    model: str = field(
        metadata={"help": "a shipped model ('tiny', 'tiny-draft'), a local Hugging Face directory or a hub id"}
    )
    dtype: str | torch.dtype = _option("auto", "auto, float32, bfloat16 or float16")
    device: str | torch.device = _option("auto", "auto, cpu, cuda, cuda:N or mps")
    block_size: int = _option(16, "tokens per KV block", _POSITIVE)
    num_kv_blocks: int | None = _option(
        None, "KV pool size in blocks (default: from a memory budget)", _POSITIVE_OR_NONE
    )
    kv_cache_memory: int | None = _option(
        None,
        "bytes for the KV pool (default: chosen from the device)",
        Rule(int, "None or a positive number of bytes", lambda x: x >= 1, optional=True),
    )
    gpu_memory_utilization: float = _option(
        0.9,
        "on CUDA, the share of the GPU's memory the engine may use",
        Rule(float, "in (0, 1]", lambda x: 0 < x <= 1),
    )
    max_num_batched_tokens: int = _option(512, "new tokens per step: the token budget that chunks prompts", _POSITIVE)
    max_num_seqs: int = _option(256, "sequences running at once", _POSITIVE)
    max_model_len: int | None = _option(
        None, "longest prompt + output (default: the model's own limit)", _POSITIVE_OR_NONE
    )
    enable_prefix_caching: bool = _option(True, "reuse the K/V of shared prompt prefixes (the radix cache)")
    draft_model: str | None = _option(None, "speculative decoding: a small model with the target's tokenizer")
    num_speculative_tokens: int = _option(
        DEFAULT_NUM_SPECULATIVE_TOKENS, "guessed tokens verified per step (with a draft model)", _POSITIVE
    )
    enforce_eager: bool = _option(False, "on CUDA, run decode steps eagerly instead of replaying CUDA graphs")
    attention_backend: str = _option(
        "auto",
        "how decode and verification steps attend: 'sdpa' gathers each sequence's KV blocks, then runs SDPA; "
        "'triton' reads them in place with chapter 05c's kernel (on a CPU through Triton's interpreter: slow); "
        "'auto' is Triton on a CUDA GPU where it loads and passes a start-up check, else SDPA (and SDPA with "
        "tensor parallelism)",
        _attention_backend,
    )
    generation_config: str = _option(
        "auto",
        "sampling defaults for what a request leaves unset: 'auto' reads the model's generation_config.json "
        "(temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens), 'vllm' ignores it, "
        "or a directory holding a generation_config.json",
        _generation_config,
    )
    tensor_parallel_size: int = _option(
        1, "processes (on CUDA, one per GPU) that each hold 1/N of the model's heads; rank 0 schedules", _POSITIVE
    )
    seed: int = _option(0, "seed of the random stream shared by unseeded requests")
    show_progress: bool = _option(True, "progress bars while loading")

    def __post_init__(self) -> None:
        check_fields(self)
        k = self.num_speculative_tokens
        if self.draft_model is None and k != DEFAULT_NUM_SPECULATIVE_TOKENS:
            raise ValueError(
                f"num_speculative_tokens={k} does nothing without a draft model: give draft_model "
                "(for example 'tiny-draft' for 'tiny') or leave num_speculative_tokens at its default"
            )

    def sampling_defaults(self, model_dir: Path) -> dict[str, Any]:
        """What a request's unset SamplingParams fields take (see the module docstring)."""
        if self.generation_config == "vllm":
            return {}
        return generation_defaults(model_dir if self.generation_config == "auto" else Path(self.generation_config))


# Where chapter 14's launcher lives (see the module docstring).
TENSOR_PARALLEL_LAUNCHER = "mini_infer.parallel.workers"


@dataclass(frozen=True)
class ResolvedModels:
    """What ``build_engine`` settles before any weights load (steps 1-2 of the module docstring)."""

    model_dir: Path
    draft_dir: Path | None
    dtype: torch.dtype
    device: torch.device
    max_model_len: int  # context_limit's


class TensorParallelLauncher(Protocol):
    def __call__(self, config: EngineConfig, resolved: ResolvedModels) -> list[ModelRunner]:
        """Start ranks 1..N-1 and return rank 0's runner (its shard loaded, its part of the pool
        allocated) and, with a draft, the draft's runner: the whole draft, on rank 0 only."""
        ...


def load_model(model_dir: Path, dtype: torch.dtype, device: torch.device, show_progress: bool) -> Qwen2Model:
    """The weights, streamed from safetensors and, on a CPU with bf16 matrix units, prepacked."""
    model = Qwen2Model.from_pretrained(model_dir, dtype, device, show_progress=show_progress)
    model.prepack_weights()
    return model


def largest_step(config: EngineConfig, context: int) -> tuple[list[SequenceInput], int]:
    """The inputs of the largest step the engine can take, and the blocks they use: the whole token
    budget (``max_num_batched_tokens``), with as many sampled logit rows as a step can have. That is
    one per running sequence (``max_num_seqs``), and with a draft model ``1 + k`` per sequence,
    since verification samples every guess (``num_speculative_tokens`` = k): up to
    ``min(max_num_seqs * (1 + k), max_num_batched_tokens)`` rows. One long chunk brings the tokens
    that sample nothing and samples its own last one; the other sequences bring ``1 + k`` tokens each
    (the last one fewer), every one sampled. No chunk reaches past ``context`` (the engine's
    ``max_model_len``, within RoPE's table): a model with fewer positions than the budget gets its
    tokens as several chunks, of which the last samples. An upper bound: the chunk may be one
    sequence more than ``max_num_seqs``."""
    per_seq = 1 + (config.num_speculative_tokens if config.draft_model is not None else 0)
    budget = config.max_num_batched_tokens
    rows = min(config.max_num_seqs * per_seq, budget)
    chunk_tokens = budget - rows + 1
    chunks = [min(context, chunk_tokens - start) for start in range(0, chunk_tokens, context)]
    decodes = [min(per_seq, rows - 1 - start) for start in range(0, rows - 1, per_seq)]
    inputs: list[SequenceInput] = []
    num_blocks = 0
    for i, n in enumerate(chunks + decodes):
        guesses = n - 1 if i >= len(chunks) else 0
        table = list(range(num_blocks, num_blocks + num_blocks_for(n, config.block_size)))
        num_blocks += len(table)
        inputs.append(
            SequenceInput([0] * (n - guesses), 0, table, samples=i >= len(chunks) - 1, draft_token_ids=[0] * guesses)
        )
    return inputs, num_blocks


def measure_activation_peak(models: list[Qwen2Model], config: EngineConfig) -> int:
    """Bytes the largest step (``largest_step``) needs on the GPU besides the weights and the KV
    pool, measured: each model runs it, its logits sampled with a temperature and top-p (the
    sampler's float32 copies and its sort are a large part of it, at a 151,936-token vocabulary);
    with a draft model, the distributions of a step's guesses are held meanwhile. The figure is the
    growth of the allocator's *reserved* memory (what the process holds on the card, blocks the
    allocator keeps cached and fragmented ones included), from an emptied cache, less the scratch
    pool's own bytes."""
    device = models[0].device
    context = context_limit(config.max_model_len, [m.config for m in models])
    inputs, num_blocks = largest_step(config, context)
    rows = sum(s.num_logits for s in inputs)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()  # from here, reserved memory is what is really held
    held = torch.cuda.memory_reserved(device)
    torch.cuda.reset_peak_memory_stats(device)
    peak = 0
    # With a draft, a step's sampled guesses keep their distributions until the target verifies
    # them: up to one float32 row of the vocabulary per new token of the step.
    guesses = None
    if len(models) > 1:
        guesses = torch.empty(config.max_num_batched_tokens, models[0].config.vocab_size, device=device)
    for model in models:
        scratch = PagedKVCache(model.config, num_blocks, config.block_size, model.dtype, device)
        runner = ModelRunner(model, scratch)
        logits = runner.execute(runner.prepare(inputs))
        Sampler(config.seed)(logits, [SamplingParams(temperature=1.0, top_p=0.9)] * rows)
        torch.cuda.synchronize(device)
        peak = max(peak, torch.cuda.max_memory_reserved(device) - held - scratch.nbytes)
        del scratch, runner, logits
    del guesses
    torch.cuda.empty_cache()
    return peak


def size_kv_pool(config: EngineConfig, models: list[Qwen2Model], kept: list[ModelConfig], max_model_len: int) -> int:
    """The pool's block count: ``num_kv_blocks`` when given, else what the memory budget holds
    (``kv.sizing``) for a block id of every model in ``kept`` (the configs whose K/V this process
    keeps), after measuring the activation peak of ``models`` on CUDA."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    device = models[0].device
    return kv_blocks_for_memory(
        kept,
        block_size=config.block_size,
        dtype=models[0].dtype,
        device=device,
        max_num_seqs=config.max_num_seqs,
        max_model_len=max_model_len,
        kv_cache_memory=config.kv_cache_memory,
        gpu_memory_utilization=config.gpu_memory_utilization,
        activation_bytes=measure_activation_peak(models, config) if device.type == "cuda" else 0,
    )


def load_runners(config: EngineConfig, resolved: ResolvedModels) -> list[ModelRunner]:
    """The target's runner (and the draft's) in this process: weights loaded, one KV pool sized from
    the budget and allocated for each, and on CUDA decode graphs (steps 1-4 of the module docstring)."""
    dtype, device, max_model_len = resolved.dtype, resolved.device, resolved.max_model_len
    dirs = [resolved.model_dir] + ([] if resolved.draft_dir is None else [resolved.draft_dir])
    models = [load_model(d, dtype, device, config.show_progress) for d in dirs]
    num_blocks = size_kv_pool(config, models, [m.config for m in models], max_model_len)
    runners = [ModelRunner(m, PagedKVCache(m.config, num_blocks, config.block_size, dtype, device)) for m in models]
    c = models[0].config
    in_place, why = choose_attention(
        config.attention_backend, device, dtype, c.num_attention_heads, c.num_key_value_heads, c.head_dim
    )
    _LOG.info(why)
    for runner in runners:
        runner.in_place_attention = in_place
    if device.type == "cuda" and not config.enforce_eager:  # decode steps replay CUDA graphs (chapter 05)
        shape = {"max_num_seqs": config.max_num_seqs, "max_model_len": max_model_len}
        for runner in runners:
            runner.static_decode = DecodeGraphs(runner.model, runner.kv_cache, **shape, capture=True, in_place=in_place)
    return runners


def context_limit(asked: int | None, configs: list[ModelConfig]) -> int:
    """The engine's ``max_model_len``: ``asked``, or when it is None the models' shortest context
    (``max_position_embeddings``; with a draft, the shorter of the two). Asking for more than that
    is an error, as in vLLM: positions past a model's context are ones it never learned."""
    limit = min(c.max_position_embeddings for c in configs)
    if asked is not None and asked > limit:
        whose = "the model's context" if len(configs) == 1 else "the shorter context of the target and draft models"
        raise ValueError(
            f"max_model_len={asked} is longer than {whose} ({limit} tokens, max_position_embeddings): "
            f"give max_model_len <= {limit}, or leave it unset"
        )
    return asked or limit


def build_engine(config: EngineConfig) -> LLMEngine:
    """An engine with every part its config asks for (see the module docstring)."""
    model_dir = resolve_model(config.model)
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    tokenizer = Tokenizer(model_dir)
    target_config = ModelConfig.from_model_dir(model_dir)
    draft_dir = None if config.draft_model is None else resolve_model(config.draft_model)
    if draft_dir is not None:  # before any weights are loaded
        check_draft_vocabulary(str(config.draft_model), draft_dir, config.model, target_config, tokenizer)
    configs = [target_config] + ([] if draft_dir is None else [ModelConfig.from_model_dir(draft_dir)])
    max_model_len = context_limit(config.max_model_len, configs)
    resolved = ResolvedModels(model_dir, draft_dir, dtype, device, max_model_len)
    if config.tensor_parallel_size > 1:  # chapter 14: the other ranks run in processes of their own
        launch: TensorParallelLauncher = importlib.import_module(TENSOR_PARALLEL_LAUNCHER).launch
        runners = launch(config, resolved)
    else:
        runners = load_runners(config, resolved)
    num_blocks = runners[0].kv_cache.num_blocks
    eos = {*target_config.eos_token_ids, *([] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id])}
    mask = StructuredOutputs(tokenizer, target_config.vocab_size, eos)
    sampler = Sampler(config.seed, eos_token_ids=eos, mask=mask)
    # The draft's pool has the same block ids as the target's: one scheduler serves both.
    speculator = (
        None
        if len(runners) == 1
        else SpeculativeDecoder(runners[1], config.num_speculative_tokens, target_config.vocab_size, sampler)
    )
    pool = BlockPool(num_blocks, config.block_size)
    scheduler = Scheduler(
        pool,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_num_seqs=config.max_num_seqs,
        max_model_len=max_model_len,
        prefix_cache=RadixCache(pool) if config.enable_prefix_caching else None,
        speculation=speculator,
    )
    defaults = config.sampling_defaults(model_dir)
    if speculator is not None:
        _warn_if_defaults_stop_drafts(defaults)
    return LLMEngine(
        runners[0],
        scheduler,
        tokenizer,
        eos_token_ids=eos,
        sampler=speculator or sampler,  # with a draft, the decoder verifies its guesses with the sampler
        drafter=speculator,
        sampling_defaults=defaults,
    )


def _warn_if_defaults_stop_drafts(defaults: dict[str, Any]) -> None:
    """A model whose generation config sets a repetition penalty (the small Qwen2.5-Instruct
    models do) gives it to every request that does not set its own, and requests with penalties
    are served without drafts (chapter 10): say so, once, when the engine is built."""
    if SamplingParams().with_defaults(defaults).needs_penalties:
        warnings.warn(
            f"the model's generation config sets {defaults}: requests that keep its penalty are served without "
            "drafts; give them repetition_penalty=1.0, or build the engine with generation_config='vllm'",
            stacklevel=3,
        )
