"""The Qwen2 model, and why it needs a KV cache (chapter 03).

``Qwen2Model.forward(input_ids, positions, attn)`` runs a flat list of tokens (no batch axis:
``[num_tokens]``) through every layer and returns the final hidden states. *Where* keys and
values come from is not the model's business: each layer hands its new ``q, k, v`` to the
``attn`` object (an ``AttentionBackend``), which stores the new K/V and returns the attention
output. The same model therefore runs:

* ``FullAttention``: one sequence, every token recomputed (chapter 02/03: no cache at all);
* ``ContiguousKVCache``: one sequence with a preallocated max-length cache (chapter 03);
* the paged KV cache of chapter 05, which serves prefill chunks, batched decode and
  speculative verification of many sequences in one flat forward.

Weights are stored fused where that saves matmuls: ``[q | k | v]`` in one projection with its
bias, ``[gate | up]`` in another. ``load_weights`` copies each checkpoint tensor (streamed by the
loader, chapter 01) into its slice of the fused parameter, casting on the way, so a checkpoint
is never held twice in memory.

On a CPU with bf16 matrix units the engine then calls ``prepack_weights()``: every matmul weight
is replaced by a copy in oneDNN's blocked layout (``layers.prepack_linear_weight``, chapter 02),
which ``layers.linear`` reads directly. Results are as accurate (the last bf16 bit may differ);
matmuls at decode batch sizes run faster (chapter 02 measures by how much). A tied output
projection gets its own packed copy (the embedding table stays plain for lookups), which costs
``vocab x hidden`` more memory.
Packed weights are opaque: load weights before packing, never after.

With float16 weights the residual stream runs in float32 (``residual_dtype``, the numerics policy
of chapter 02): ``forward`` keeps ``hidden`` in it and every RMSNorm hands float16 to the matmuls;
the o and down projections, whose outputs are added to it, compute on inputs scaled by
``projection_scale`` (``2**-6``), and the float32 residual adds them scaled back, so that a single
output past 65,504 is not ``inf`` before it is added (``add_projection``).

The model reaches its embedding, its o and down projections and its output projection only through
``embed_tokens``, ``add_projection`` and ``compute_logits``: a subclass that overrides those three
runs the same ``forward`` on a part of the model (chapter 14 splits it over several processes).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from mini_infer.config import ModelConfig
from mini_infer.layers import (
    RotaryEmbedding,
    apply_rope,
    attention,
    can_prepack,
    linear,
    prepack_linear_weight,
    projection_scale,
    residual_dtype,
    rms_norm,
    silu_and_mul,
)
from mini_infer.loader import iter_checkpoint


class AttentionBackend(Protocol):
    """Stores one layer's new keys/values and attends; all metadata lives in the object."""

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``q``: ``[T, heads, D]``; ``k``, ``v``: ``[T, kv_heads, D]`` -> ``[T, heads, D]``."""
        ...


class FullAttention:
    """No cache: the tokens given are one whole sequence, attended causally."""

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attention(q, k, v, causal=True)


class ContiguousKVCache:
    """One sequence's K/V in a preallocated ``[layers, max_len, kv_heads, D]`` buffer.

    Usage: ``model.forward(ids, positions, cache)`` with ``positions`` continuing from
    ``cache.length``; then ``cache.advance(len(ids))``. The buffer is sized for the longest
    the sequence may become, which is exactly the waste chapter 04's block pool removes.
    """

    def __init__(self, config: ModelConfig, max_len: int, dtype: torch.dtype, device: torch.device | str) -> None:
        shape = (config.num_hidden_layers, max_len, config.num_key_value_heads, config.head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.length = 0  # tokens already stored (in every layer)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        end = self.length + q.shape[0]
        if end > self.max_len:
            raise ValueError(f"ContiguousKVCache holds {self.max_len} tokens; this step needs {end}")
        # student: begin chapter 03: store this step's K/V after the cached ones, attend over everything stored
        self.k[layer, self.length : end] = k
        self.v[layer, self.length : end] = v
        return attention(q, self.k[layer, :end], self.v[layer, :end], causal=True)
        # student: end

    def advance(self, num_tokens: int) -> None:
        # student: begin chapter 03: count the tokens just stored
        self.length += num_tokens
        # student: end

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2


class Qwen2Layer(nn.Module):
    MATMUL_WEIGHTS = ("qkv_weight", "o_weight", "gate_up_weight", "down_weight")

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        h, qkv = config.hidden_size, config.q_size + 2 * config.kv_size

        def param(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)

        self.input_norm = param(h)
        self.qkv_weight = param(qkv, h)
        self.qkv_bias = param(qkv)
        self.o_weight = param(h, config.q_size)
        self.post_attn_norm = param(h)
        self.gate_up_weight = param(2 * config.intermediate_size, h)
        self.down_weight = param(h, config.intermediate_size)


class Qwen2Model(nn.Module):
    """Qwen2 / Qwen2.5 decoder with fused projections; see the module docstring."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        h, vocab = config.hidden_size, config.vocab_size
        self.embed = nn.Parameter(torch.empty(vocab, h, dtype=dtype, device=device), requires_grad=False)
        self.layers = nn.ModuleList(Qwen2Layer(config, dtype, device) for _ in range(config.num_hidden_layers))
        self.norm = nn.Parameter(torch.empty(h, dtype=dtype, device=device), requires_grad=False)
        if config.tie_word_embeddings:
            self.lm_head = self.embed
        else:
            self.lm_head = nn.Parameter(torch.empty(vocab, h, dtype=dtype, device=device), requires_grad=False)
        self.rope = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta, device)
        # float32 under float16 weights: the numerics policy of chapter 02 (layers.residual_dtype).
        self.residual_dtype = residual_dtype(dtype)
        self.projection_scale = projection_scale(dtype)  # 2**-6 under float16 weights, else 1

    @classmethod
    def from_pretrained(
        cls,
        model_dir: str | Path,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        *,
        show_progress: bool = True,
    ) -> Qwen2Model:
        config = ModelConfig.from_model_dir(model_dir)
        model = cls(config, dtype, device)
        model.load_weights(iter_checkpoint(model_dir, config, show_progress=show_progress))
        return model

    def _destination(self, name: str) -> torch.Tensor:
        """The (slice of the) parameter that checkpoint tensor ``name`` is copied into."""
        c = self.config
        if name == "model.embed_tokens.weight":
            return self.embed
        if name == "model.norm.weight":
            return self.norm
        if name == "lm_head.weight":
            return self.lm_head
        _, _, index, module, leaf, kind = (name.split(".") + [""])[:6]
        layer = self.layers[int(index)]
        assert isinstance(layer, Qwen2Layer)
        if module == "input_layernorm":
            return layer.input_norm
        if module == "post_attention_layernorm":
            return layer.post_attn_norm
        if module == "self_attn" and leaf == "o_proj":
            return layer.o_weight
        if module == "self_attn":
            start, size = {
                "q_proj": (0, c.q_size),
                "k_proj": (c.q_size, c.kv_size),
                "v_proj": (c.q_size + c.kv_size, c.kv_size),
            }[leaf]
            fused = layer.qkv_weight if kind == "weight" else layer.qkv_bias
            return fused[start : start + size]
        if leaf == "down_proj":
            return layer.down_weight
        i = c.intermediate_size
        return layer.gate_up_weight[:i] if leaf == "gate_proj" else layer.gate_up_weight[i:]

    @property
    def prepacked(self) -> bool:
        return self.lm_head.is_mkldnn

    @torch.no_grad()
    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy streamed checkpoint tensors into place (cast and moved by ``copy_``)."""
        if self.prepacked:
            raise RuntimeError(
                "the weights are prepacked for the CPU; load weights into a model before prepack_weights()"
            )
        for name, tensor in tensors:
            self._destination(name).copy_(tensor)

    def prepack_weights(self) -> bool:
        """Replace every matmul weight by its prepacked form where that helps (see the module
        docstring); returns whether it did. Call once, after the weights are loaded."""
        if self.prepacked or not can_prepack(self.lm_head):
            return False
        for layer in self.layers:
            for name in Qwen2Layer.MATMUL_WEIGHTS:
                setattr(layer, name, nn.Parameter(prepack_linear_weight(getattr(layer, name)), requires_grad=False))
        self.lm_head = nn.Parameter(prepack_linear_weight(self.lm_head), requires_grad=False)
        return True

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        """Hidden states after the final norm, ``[num_tokens, hidden]``, for flat ``input_ids``."""
        c = self.config
        num_tokens = input_ids.shape[0]
        cos, sin = self.rope.cos_sin(positions, self.dtype)
        hidden = self.embed_tokens(input_ids).to(self.residual_dtype)
        for index, layer in enumerate(self.layers):
            assert isinstance(layer, Qwen2Layer)
            x = rms_norm(hidden, layer.input_norm, c.rms_norm_eps)
            qkv = linear(x, layer.qkv_weight, layer.qkv_bias)
            q, k, v = qkv.split([c.q_size, c.kv_size, c.kv_size], dim=-1)
            q = apply_rope(q.view(num_tokens, c.num_attention_heads, c.head_dim), cos, sin)
            k = apply_rope(k.view(num_tokens, c.num_key_value_heads, c.head_dim), cos, sin)
            v = v.view(num_tokens, c.num_key_value_heads, c.head_dim)
            out = attn(index, q, k, v)
            hidden = self.add_projection(hidden, out.reshape(num_tokens, c.q_size), layer.o_weight)
            x = rms_norm(hidden, layer.post_attn_norm, c.rms_norm_eps)
            hidden = self.add_projection(hidden, silu_and_mul(linear(x, layer.gate_up_weight)), layer.down_weight)
        return rms_norm(hidden, self.norm, c.rms_norm_eps)

    def add_projection(self, hidden: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``hidden + x @ weight.T`` for the o and down projections. Under float16 weights ``x`` is
        first scaled by ``projection_scale`` and the sum adds the output scaled back in the
        residual's float32, so one output up to 64 x 65,504 stays finite (chapter 02's policy);
        elsewhere the scale is 1 and this is a plain sum."""
        scale = self.projection_scale
        return hidden.add(linear(x if scale == 1.0 else x * scale, weight), alpha=1.0 / scale)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embedding rows of ``input_ids``."""
        return F.embedding(input_ids, self.embed)

    def compute_logits(self, hidden: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Logits ``[num_tokens, vocab]`` in ``dtype``: float32 by default, what sampling wants.
        The engine asks for the model's own dtype and lets the sampler cast when it needs to."""
        return linear(hidden, self.lm_head).to(dtype)
