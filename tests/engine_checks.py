"""Driving an engine to the end while checking its block accounting, and the reference it is
held to (shared by the engine tests)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from mini_infer.engine import LLMEngine
from mini_infer.outputs import RequestOutput
from mini_infer.sampling import SamplingParams


def run_checked(
    engine: LLMEngine, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
) -> list[RequestOutput]:
    """Submit everything, step to the end, and after every step check the scheduler's (and the
    prefix cache's) block invariants and that no sequence, finished ones included, counts more
    computed tokens than it has; the finished outputs in submission order."""
    params_list = params if isinstance(params, list) else [params] * len(prompts)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params_list)]
    seqs = [engine.outputs.requests[i].seq for i in ids]
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        engine.scheduler.check_invariants()
        if engine.scheduler.blocks.prefix_cache is not None:
            engine.scheduler.blocks.prefix_cache.check_invariants()
        for seq in seqs:
            assert 0 <= seq.num_computed_tokens <= len(seq.token_ids), (seq.request_id, seq.num_computed_tokens)
            assert seq.num_output_tokens <= seq.params.max_tokens
    return [finals[i] for i in ids]


def assert_all_blocks_back(engine: LLMEngine) -> None:
    """Idle: every block is free or held by the cache alone; a reset frees them all."""
    pool, cache = engine.scheduler.blocks.pool, engine.scheduler.blocks.prefix_cache
    cached = cache.num_cached_blocks if cache is not None else 0
    assert pool.num_free_blocks + cached == pool.num_blocks
    if cache is not None:
        assert cache.num_evictable_blocks == cached  # nothing is in use any more
        cache.reset()
    assert pool.num_free_blocks == pool.num_blocks


def transformers_greedy(
    model_dir: str | Path, prompts: list[list[int]], max_new_tokens: int, *, repetition_penalty: float = 1.0
) -> list[list[int]]:
    """Hugging Face ``generate``'s greedy continuation of each prompt, one at a time, in float32
    on the CPU (never stopping at EOS; the repetition penalty given, not the checkpoint's): what
    the engine's greedy outputs must equal."""
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    expected = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            repetition_penalty=repetition_penalty,
            eos_token_id=None,
            pad_token_id=None,
        )
        expected.append(out[0, len(prompt) :].tolist())
    return expected
