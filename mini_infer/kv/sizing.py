"""How many KV blocks to allocate: a memory budget divided by what one block costs (chapter 05).

The pool is allocated once, after the weights are loaded (chapter 04). A block of ``block_size``
token slots costs ``2 (K and V) x layers x kv_heads x block_size x head_dim x bytes per number``,
for every model that keeps K/V in it: a draft model (chapter 10) has a pool of the same block ids,
so each block id costs both. The budget is

* ``kv_cache_memory`` bytes when given;
* on CUDA, the memory still free after the weights, minus what ``gpu_memory_utilization`` leaves
  to others, minus room for the activations of the largest step (logits and MLP dominate);
* on a CPU, a fifth of the RAM, at most 2 GiB.

More blocks than ``max_num_seqs`` sequences of ``max_model_len`` tokens can ever use are never
allocated. A budget that holds no block at all is an error that says what to change.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from mini_infer.config import ModelConfig
from mini_infer.kv.block_pool import num_blocks_for
from mini_infer.kv.paged_attention import PagedKVCache

CPU_KV_BUDGET_BYTES = 2 * 1024**3


def kv_blocks_for_memory(
    configs: Sequence[ModelConfig],
    *,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    max_num_seqs: int,
    max_model_len: int,
    max_num_batched_tokens: int,
    kv_cache_memory: int | None = None,
    gpu_memory_utilization: float = 0.9,
) -> int:
    """KV blocks for the models in ``configs`` (the target first) from the budget above."""
    per_block = sum(PagedKVCache.bytes_per_block(c, block_size, dtype) for c in configs)
    if kv_cache_memory is not None:
        budget = int(kv_cache_memory)
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        c = configs[0]
        activations = max_num_batched_tokens * (c.vocab_size * 4 + c.intermediate_size * 2 * 4 + c.hidden_size * 16)
        budget = int(free - (1 - gpu_memory_utilization) * total - activations)
    else:
        try:
            ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            ram = 8 * 1024**3
        budget = min(CPU_KV_BUDGET_BYTES, ram // 5)
    blocks = min(budget // per_block, max_num_seqs * num_blocks_for(max_model_len, block_size))
    if blocks < 1:
        raise MemoryError(
            f"no memory is left for the KV cache ({budget / 2**20:.0f} MiB after the weights); use a smaller "
            "model, a lower max_num_batched_tokens, or set num_kv_blocks"
        )
    return int(blocks)
