"""How many KV blocks to allocate: a memory budget divided by what one block costs (chapter 05).

The pool is allocated once, after the weights are loaded (chapter 04). A block of ``block_size``
token slots costs ``2 (K and V) x layers x kv_heads x block_size x head_dim x bytes per number``,
for every model that keeps K/V in it: a draft model (chapter 10) has a pool of the same block ids,
so each block id costs both. The budget is

* ``kv_cache_memory`` bytes when given;
* on CUDA, ``gpu_memory_utilization`` of the card's memory, minus what is already held when the
  pool is sized (the weights, the CUDA context, other processes: ``total - free``), minus the
  activation peak of the largest step, measured beforehand (``activation_bytes``; the engine
  builder runs that step once, speculative verification's ``max_num_seqs x (1 + k)`` sampled rows
  included, and reads the growth of the allocator's *reserved* memory, which is what the card has
  given the process: cached and fragmented blocks count, as they do in ``total - free``). For Qwen2.5-1.5B drafted by
  Qwen2.5-0.5B in float16 on a 6 GiB card at 0.9: 5.4 GiB usable, about 4.1 GB of weights and
  a few hundred MB of CUDA context held, then the activation peak, leave well under 1 GiB, and
  a block id costs 448 KiB (target) + 192 KiB (draft): on the order of a thousand blocks,
  some 16,000 tokens of context shared by all sequences;
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
    kv_cache_memory: int | None = None,
    gpu_memory_utilization: float = 0.9,
    activation_bytes: int = 0,
) -> int:
    """KV blocks for the models in ``configs`` (the target first) from the budget above."""
    per_block = sum(PagedKVCache.bytes_per_block(c, block_size, dtype) for c in configs)
    if kv_cache_memory is not None:
        budget = int(kv_cache_memory)
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = int(gpu_memory_utilization * total - (total - free) - activation_bytes)
    else:
        try:
            ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            ram = 8 * 1024**3
        budget = min(CPU_KV_BUDGET_BYTES, ram // 5)
    blocks = min(budget // per_block, max_num_seqs * num_blocks_for(max_model_len, block_size))
    if blocks < 1:
        raise MemoryError(
            f"no memory is left for the KV cache ({budget / 2**20:.0f} MiB after the weights and activations); "
            "use a smaller model, a lower max_num_batched_tokens or max_num_seqs, a higher "
            "gpu_memory_utilization, or set num_kv_blocks"
        )
    return int(blocks)
