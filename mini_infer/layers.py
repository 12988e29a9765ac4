"""The kernels of a Qwen2 layer as small typed functions (chapter 02).

Everything here is plain PyTorch, the same code on CPU and CUDA:

* ``rms_norm``: reduction in float32 whatever the input dtype (fp16 activations of Qwen2.5 can
  overflow a half-precision sum of squares), result cast to the weight's dtype, then scaled, as
  Hugging Face does.
* ``residual_dtype``: the numerics policy for half precision. Qwen2 and Qwen2.5 were trained in
  bf16, whose range is float32's; a few channels of their residual stream ("massive
  activations") grow past 65,504, the largest float16, and a float16 residual becomes ``inf``,
  then NaN after the next RMSNorm. So with float16 weights the residual stream (the running sum
  of every layer's output) is kept in float32; every matmul still runs in float16 on a
  normalised input, and attention's scores and softmax are accumulated in float32 by every SDPA
  kernel the engine uses. bfloat16 keeps a bfloat16 residual, as the models were trained.
* ``projection_scale``: an fp32 residual does not help when a single addend overflows: one
  ``o_proj`` or ``down_proj`` output past 65,504 is ``inf`` the moment the float16 matmul rounds
  it, before it is added. So with float16 weights those two projections run on their input
  times ``2**-6`` (exact: a power of two), and the residual adds their output times ``2**6`` in
  float32 (``torch.add(..., alpha=64)``, one kernel as before): a single output may reach
  64 x 65,504, about 4.2 million, and so may the partial sums inside the matmul (cuBLAS's
  split-K reductions, which ``allow_fp16_reduced_precision_reduction`` lets it keep in float16).
  The cost is one elementwise multiply of each projection's input; inputs below ``2**-8``
  become float16 subnormals, whose absolute error (about ``4e-6``) is what float16 already has
  at ``4e-3``. Tensor-parallel ranks sum these outputs in float32 (chapter 14).
* ``RotaryEmbedding``: the cos/sin table is computed once, in float32, for every position up to
  the model's maximum; a forward pass only indexes it with the tokens' positions.
* ``silu_and_mul``: SwiGLU on a fused ``[gate | up]`` projection (one matmul instead of two).
* ``linear``: ``x @ W.T + b``, for a plain weight or one *prepacked* once for the CPU's matrix
  units (``prepack_linear_weight``). ``F.linear`` on a bf16 CPU tensor hands oneDNN a plain
  row-major weight, which it re-lays into its blocked format on every call; a weight packed
  once skips that: faster matmuls at decode batch sizes on this project's 2-core CPU
  (chapter 02 measures it), equally accurate (both round one float32 accumulation to bf16; where
  the blocking differs, so may the last bit).
* ``attention``: grouped-query attention on ``scaled_dot_product_attention``. The query heads
  that share a KV head are folded into the query-length axis (``folded_attention``), so K and V
  are never expanded to every query head (2-5x faster for one decode token on this project's CPU
  than ``enable_gqa``, which behaved as if K/V were expanded). It is the one fold of the
  package: one sequence here, a batch of sequences in chapter 05's paged attention. The causal
  rule is the mask ``causal_mask`` (SDPA's own ``is_causal`` cannot follow the fold's rows, which
  are not in position order), built by ``folded_bias`` once per step in the engine; on a
  512-token chunk, the engine's largest by default, the fold under that mask was as fast on this
  project's CPU as K/V repeated per query head under ``is_causal``.
* ``sdpa_backends``: which SDPA kernels attention may use on a device and dtype, and why: the
  fold needs no ``enable_gqa`` (which, in the torch versions Colab and Kaggle ship, reached only
  the flash kernel), so the same layout lands on a kernel that exists on every GPU: flash on
  Ampere and later, memory-efficient on a T4 (Turing has no flash kernel), the CPU's own flash
  kernel on a CPU; the math kernel is the last resort everywhere.

Tensors use the flat token layout of the engine: ``[num_tokens, num_heads, head_dim]``, with no
batch axis; which tokens belong to which sequence is the attention metadata's business.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

# oneDNN chooses its blocked layout for an expected number of rows; any row count works with it.
# 512 (the engine's default token budget) measured as fast as 64 for decode-sized batches and
# faster for prefill chunks; 1 gave decode batches no gain.
PREPACK_ROWS_HINT = 512


def can_prepack(weight: torch.Tensor) -> bool:
    """Whether ``prepack_linear_weight`` helps here: a bf16 weight on a CPU whose oneDNN has bf16."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and not weight.is_mkldnn
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    )


def prepack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (``[out, in]``) in oneDNN's blocked layout: an opaque tensor only ``linear`` reads.

    ``packed.to_dense()`` gives the weight back exactly. Check ``can_prepack`` first.
    """
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PREPACK_ROWS_HINT)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for a plain or a prepacked ``weight`` (equally accurate either way)."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def sdpa_backends(
    device: torch.device, dtype: torch.dtype, capability: tuple[int, int] | None = None
) -> list[SDPBackend]:
    """The SDPA kernels attention may use on ``device`` for ``dtype``, best first (see the module
    docstring). ``capability`` is the CUDA compute capability, read from the device when None."""
    if device.type != "cuda":
        return [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]  # the CPU's flash kernel takes every dtype
    major, minor = capability if capability is not None else torch.cuda.get_device_capability(device)
    if dtype == torch.bfloat16 and major < 8:
        raise ValueError(
            f"bfloat16 needs a GPU of compute capability 8.0 or more; this one is {major}.{minor}: use float16"
        )
    if dtype == torch.float32 or major < 8:  # flash kernels: half precision on sm80+ only
        return [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    return [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as Qwen2 defines it: ``weight * (x / rms(x))``, the statistics in float32, the
    result in the weight's dtype (a float32 residual stream feeds float16 matmuls)."""
    # student: begin chapter 02: RMSNorm: x over its root mean square (statistics in float32), times the weight
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(weight.dtype)
    # student: end


def residual_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the residual stream for weights of ``dtype``: float32 for float16 (whose
    range massive activations exceed), else ``dtype`` itself (see the module docstring)."""
    return torch.float32 if dtype == torch.float16 else dtype


def projection_scale(dtype: torch.dtype) -> float:
    """What the o and down projections' inputs are multiplied by before a matmul in ``dtype``
    (and their outputs divided by as the float32 residual adds them): ``2**-6`` for float16,
    whose range one layer's output can exceed, else 1 (see the module docstring)."""
    return 2.0**-6 if dtype == torch.float16 else 1.0


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU: ``silu(gate) * up`` for a tensor whose last axis is ``[gate | up]``."""
    # student: begin chapter 02: SwiGLU: silu(gate) * up, for a last axis laid out as [gate | up]
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
    # student: end


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` on the last axis: the 'rotate by 90 degrees' of each pair."""
    # student: begin chapter 02: rotate each pair by 90 degrees: [x1, x2] -> [-x2, x1] on the last axis
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)
    # student: end


class RotaryEmbedding:
    """Rotary position embedding (RoPE) with a precomputed cos/sin table.

    Pair ``i`` of a head (dimensions ``i`` and ``i + head_dim/2``, the 'rotate half' layout of
    Qwen2 and Llama) is rotated by ``position * theta ** (-2i / head_dim)``.
    """

    cos: torch.Tensor  # [max_positions, head_dim], float32 (the region below fills both)
    sin: torch.Tensor

    def __init__(self, head_dim: int, max_positions: int, theta: float, device: torch.device | str = "cpu") -> None:
        if head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {head_dim}")
        self.head_dim = head_dim
        self.max_positions = max_positions
        # student: begin chapter 02: the RoPE cos/sin table: pair i turns by position * theta ** (-2i / head_dim)
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        angles = torch.cat((freqs, freqs), dim=-1)  # [max_positions, head_dim]
        self.cos = angles.cos().to(device)
        self.sin = angles.sin().to(device)
        # student: end

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for each position, ``[num_tokens, 1, head_dim]`` (broadcast over heads)."""
        # Cast after indexing, as Hugging Face does: the table stays exact in float32.
        return self.cos[positions].to(dtype).unsqueeze(1), self.sin[positions].to(dtype).unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (``[num_tokens, heads, head_dim]``) by the angles whose cos/sin are given."""
    # student: begin chapter 02: rotate x by the angles whose cos and sin are given
    return x * cos + rotate_half(x) * sin
    # student: end


def causal_mask(
    num_queries: int, num_keys: int, device: torch.device | str = "cpu", context_lens: torch.Tensor | None = None
) -> torch.Tensor:
    """``[num_queries, num_keys]`` boolean, True = may attend: the queries are the last
    ``num_queries`` positions of the ``num_keys``, so query ``i`` sees keys up to
    ``num_keys - num_queries + i``. With ``context_lens`` (``[B]``, a batch of sequences):
    ``[B, num_queries, num_keys]``, sequence ``b``'s queries the last of its ``context_lens[b]``
    keys, so that keys past its own context (padding) are masked by the same rule."""
    # student: begin chapter 02: the causal mask of the last num_queries positions of num_keys (of each context)
    ends = torch.full((1,), num_keys, device=device) if context_lens is None else context_lens
    last_visible = ends[:, None] - num_queries + torch.arange(num_queries, device=ends.device)[None, :]
    mask = torch.arange(num_keys, device=ends.device)[None, None, :] <= last_visible[:, :, None]
    return mask[0] if context_lens is None else mask
    # student: end


def folded_bias(mask: torch.Tensor, group: int, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask ``[..., Tq, num_keys]`` (True = may attend) made ready for the fold of
    ``folded_attention``: SDPA's additive form (0, or -inf where masked), its rows repeated once
    per query head of a group (``[..., group * Tq, num_keys]``; a single row is left to broadcast).

    SDPA would convert a boolean mask on every call; a caller that attends many layers with the
    same mask (the paged engine) builds this once per step instead.
    """
    # student: begin chapter 02: a boolean mask as SDPA's additive bias, its rows repeated per query head of a group
    bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    if group > 1 and mask.shape[-2] > 1:
        bias = bias.repeat(*([1] * (mask.dim() - 2)), group, 1)
    return bias
    # student: end


def folded_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Grouped-query attention with the query heads that share a KV head folded into the query axis.

    ``q``: ``[B * Tq, num_heads, D]``, ``B`` sequences of ``Tq`` queries each. ``k``, ``v``: one
    sequence's ``[num_keys, num_kv_heads, D]`` (``B = 1``), or ``B`` sequences' keys kv-heads
    outermost, ``[num_kv_heads, B, num_keys, D]`` (the paged gather's layout, chapter 05). ``bias``:
    from ``folded_bias``, ``[1, 1 or B, group * Tq or 1, num_keys]``, or None (every query sees
    every key). Returns ``[B * Tq, num_heads, D]``.
    """
    # student: begin chapter 02: grouped-query attention with each KV head's query heads folded into the query axis
    if k.dim() == 3:  # one sequence: [num_keys, Hkv, D] -> [Hkv, 1, num_keys, D] (views)
        k, v = k.transpose(0, 1)[:, None], v.transpose(0, 1)[:, None]
    num_kv_heads, batch, _, head_dim = k.shape
    num_heads = q.shape[1]
    group, num_queries = num_heads // num_kv_heads, q.shape[0] // batch
    # [B*Tq, Hkv*g, D] -> [Hkv, B, g*Tq, D] (row r of a sequence's fold is query r % Tq of head r // Tq).
    qf = (
        q.view(batch, num_queries, num_kv_heads, group, head_dim)
        .permute(2, 0, 3, 1, 4)
        .reshape(num_kv_heads, batch, group * num_queries, head_dim)
    )
    # 4-D tensors, even for one sequence: with 3-D inputs and a mask, CPU SDPA falls back to its
    # math kernel, which materialises every score and was 3x slower on a 512-token chunk.
    out = F.scaled_dot_product_attention(qf, k, v, attn_mask=bias)
    return (
        out.view(num_kv_heads, batch, group, num_queries, head_dim)
        .permute(1, 3, 0, 2, 4)
        .reshape(batch * num_queries, num_heads, head_dim)
    )
    # student: end


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Grouped-query attention of one sequence's queries over its keys and values.

    ``q``: ``[num_queries, num_heads, head_dim]``; ``k``, ``v``: ``[num_keys, num_kv_heads,
    head_dim]``. With ``causal=True`` the queries are the *last* ``num_queries`` positions of the
    ``num_keys`` (a prefill chunk after a cached prefix): query ``i`` sees keys up to
    ``num_keys - num_queries + i``. ``mask`` (boolean, True = may attend, shape
    ``[num_queries, num_keys]``) replaces the causal rule when given. Returns
    ``[num_queries, num_heads, head_dim]``.
    """
    # student: begin chapter 02: grouped-query attention of one sequence, causal or under a mask
    num_queries, num_heads, _ = q.shape
    num_keys, num_kv_heads, _ = k.shape
    if mask is None and causal and num_queries > 1:
        mask = causal_mask(num_queries, num_keys, q.device)
    bias = None if mask is None else folded_bias(mask, num_heads // num_kv_heads, q.dtype)[None, None]
    return folded_attention(q, k, v, bias)
    # student: end
