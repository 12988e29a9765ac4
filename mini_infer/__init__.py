"""mini-infer: a continuous-batching LLM inference engine in pure Python and PyTorch (chapter 00).

The package's import order is the book's table of contents: no module imports one of a later
chapter (tests/test_package_shape.py checks it):
device (00) -> config, loader, tokenizer (01) -> layers (02) -> model (03) -> kv.block_pool (04)
-> kv.paged_attention, model_runner (05) -> sequence, scheduler, engine (06, 07) ->
kv.radix_cache (08) -> sampling (09) -> structured_output (09b) -> speculative, engine_builder,
llm (10) -> server (11) -> bench (12). Later parts plug into earlier ones through small protocols the earlier chapter
defines (``scheduler.PrefixCache``, ``engine.TokenSampler``, ``sampling.TokenMask``, ...).

    from mini_infer import LLM, SamplingParams, StructuredOutputsParams

The public names are imported lazily, so that ``import mini_infer.kv.block_pool`` (chapter 04)
does not pull in the whole engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["LLM", "RequestOutput", "SamplingParams", "StructuredOutputsParams", "__version__"]
__version__ = "0.1.0"

if TYPE_CHECKING:
    from mini_infer.llm import LLM
    from mini_infer.outputs import RequestOutput
    from mini_infer.sampling import SamplingParams
    from mini_infer.sampling_params import StructuredOutputsParams

_LAZY = {
    "LLM": "mini_infer.llm",
    "RequestOutput": "mini_infer.outputs",
    "SamplingParams": "mini_infer.sampling",
    "StructuredOutputsParams": "mini_infer.sampling_params",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'mini_infer' has no attribute {name!r}")
