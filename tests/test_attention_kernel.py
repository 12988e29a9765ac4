"""The Triton paged-attention kernel against its definition, on the CPU through Triton's interpreter
(chapter 05c).

Every case draws a pool, scatters each sequence's blocks over it (shared blocks too) and checks
``paged_attention_triton`` against ``reference_attention`` (SDPA over each sequence's gathered
blocks). Shapes stay small: the interpreter runs the kernel in numpy.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mini_infer.kv.attention_backend import (
    combine_splits,
    load_kernel,
    paged_attention_triton,
    reference_attention,
    triton_unavailable,
)

pytestmark = pytest.mark.skipif(
    triton_unavailable(torch.device("cpu")) is not None, reason=str(triton_unavailable(torch.device("cpu")))
)
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
# (query heads, KV heads, head_dim) of Qwen2.5-0.5B, -1.5B and -3B, and of the shipped tiny model.
QWEN_LAYOUTS = [(14, 2, 64), (12, 2, 128), (16, 2, 128), (4, 2, 64)]


def scattered_batch(
    context_lens: list[int],
    query_len: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    *,
    block_size: int = 16,
    share_first_block: bool = False,
    seed: int = 0,
) -> tuple[torch.Tensor, ...]:
    """A pool with each sequence's blocks at random places; with ``share_first_block`` every
    sequence's first block is the same physical block (a shared prefix)."""
    generator = torch.Generator().manual_seed(seed)
    needed = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(needed) + 3
    pool_shape = (kv_heads, num_blocks, block_size, head_dim)
    k_pool = torch.randn(pool_shape, generator=generator).to(dtype)
    v_pool = torch.randn(pool_shape, generator=generator).to(dtype)
    order = torch.randperm(num_blocks, generator=generator).tolist()
    width = max(needed)
    tables = torch.full((len(context_lens), width), num_blocks - 1, dtype=torch.long)  # padding: any block
    for row, count in enumerate(needed):
        tables[row, :count] = torch.tensor([order.pop() for _ in range(count)])
        if share_first_block:
            tables[row, 0] = tables[0, 0]
    q = torch.randn((len(context_lens) * query_len, heads, head_dim), generator=generator).to(dtype)
    return q, k_pool, v_pool, tables, torch.tensor(context_lens)


def assert_matches_reference(*batch: torch.Tensor, query_len: int, splits: int | None = None) -> None:
    q = batch[0]
    got = paged_attention_triton(*batch, query_len, splits=splits)
    want = reference_attention(*batch, query_len)
    assert got.shape == want.shape and got.dtype == q.dtype
    error = (got.float() - want.float()).abs().max().item()
    assert error <= TOLERANCE[q.dtype], f"max error {error} for {q.dtype}"


@pytest.mark.parametrize("heads, kv_heads, head_dim", QWEN_LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_decode_matches_the_reference_for_each_qwen_layout_and_dtype(heads, kv_heads, head_dim, dtype):
    batch = scattered_batch([1, 16, 17, 45], 1, heads, kv_heads, head_dim, dtype)
    assert_matches_reference(*batch, query_len=1)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    context_lens=st.lists(st.integers(1, 70), min_size=1, max_size=4),
    query_len=st.integers(1, 4),
    splits=st.sampled_from([None, 1, 2, 3, 5]),
    shared=st.booleans(),
    layout=st.sampled_from(QWEN_LAYOUTS),
    head_dim_override=st.sampled_from([None, 48]),  # a head_dim that is not a power of 2
)
def test_ragged_batches_match_the_reference(context_lens, query_len, splits, shared, layout, head_dim_override):
    heads, kv_heads, head_dim = layout
    context_lens = [max(n, query_len) for n in context_lens]  # a sequence holds its own new tokens
    batch = scattered_batch(
        context_lens, query_len, heads, kv_heads, head_dim_override or head_dim, torch.float32, share_first_block=shared
    )
    assert_matches_reference(*batch, query_len=query_len, splits=splits)


@pytest.mark.parametrize("block_size", [8, 32])
def test_other_block_sizes(block_size):
    batch = scattered_batch([3, 40, 64], 2, 14, 2, 64, torch.float32, block_size=block_size)
    assert_matches_reference(*batch, query_len=2, splits=2)


def test_keys_past_the_context_get_no_weight():
    """Whatever the rest of the last block and the padded table entries hold, the output is the
    same: NaN there included (a kernel that let one through would return NaN)."""
    q, k_pool, v_pool, tables, lens = scattered_batch([5, 20], 1, 14, 2, 64, torch.float32)
    before = paged_attention_triton(q, k_pool, v_pool, tables, lens, 1)
    for row, length in enumerate(lens.tolist()):
        last = tables[row, (length - 1) // 16]
        k_pool[:, last, length % 16 or 16 :] = float("nan")
        v_pool[:, last, length % 16 or 16 :] = float("nan")
    k_pool[:, tables[0, 1]] = float("nan")  # sequence 0's padding entry points at a block of garbage
    after = paged_attention_triton(q, k_pool, v_pool, tables, lens, 1)
    torch.testing.assert_close(after, before)


def test_combine_splits_is_softmax_over_the_whole_context():
    """Two halves of a row, each softmaxed on its own terms, combine to the softmax of the whole."""
    scores, values = torch.randn(10), torch.randn(10, 3)
    halves = [scores[:6], scores[6:]]
    row_max = torch.stack([h.max() for h in halves])[:, None]
    row_sum = torch.stack([(h - h.max()).exp().sum() for h in halves])[:, None]
    parts = (slice(0, 6), slice(6, 10))
    acc = torch.stack([(h - h.max()).exp() @ values[part] for h, part in zip(halves, parts)])[:, None]
    torch.testing.assert_close(combine_splits(row_max, row_sum, acc)[0], torch.softmax(scores, 0) @ values)
    # A split that saw no key weighs nothing; a row that saw none is zeros, not NaN.
    empty = (torch.tensor([[float("-inf")]]), torch.zeros(1, 1), torch.zeros(1, 1, 3))
    both = [torch.cat([a, b]) for a, b in zip((row_max[:1], row_sum[:1], acc[:1]), empty)]
    torch.testing.assert_close(combine_splits(*both)[0], acc[0, 0] / row_sum[0, 0])
    assert torch.equal(combine_splits(*empty), torch.zeros(1, 3))


def test_a_padding_row_with_no_context_is_zeros_not_nan():
    q, k_pool, v_pool, tables, _ = scattered_batch([4, 9], 1, 14, 2, 64, torch.float32)
    out = paged_attention_triton(q, k_pool, v_pool, tables, torch.tensor([0, 9]), 1)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and not out.isnan().any()


def test_bad_shapes_are_refused_with_what_was_expected():
    q, k_pool, v_pool, tables, lens = scattered_batch([4, 9], 2, 14, 2, 64, torch.float32)
    with pytest.raises(ValueError, match=r"must be \[2 \* 1, heads, head_dim\]"):
        paged_attention_triton(q, k_pool, v_pool, tables, lens, 1)


def test_load_kernel_names_what_is_missing(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "triton" else real(name))
    assert "not installed" in str(triton_unavailable(torch.device("cpu")))
    with pytest.raises(RuntimeError, match="use attention_backend='sdpa'"):
        load_kernel(torch.device("cpu"))


# --- the engine with attention_backend="triton" ----------------------------------------------------

SHARED = "You are a careful assistant. Answer briefly and exactly. "
PROMPTS = [SHARED + "What is 12 + 30?", SHARED + "Reverse: red, green, blue.", "Count to five.", SHARED + "Hi"]


def generate_counting(backend: str, **options: object) -> tuple[list[list[int]], dict[str, int], int]:
    """Greedy tokens of ``PROMPTS``, the engine's counters, and how many times the in-place kernel ran."""
    from mini_infer import LLM, SamplingParams

    llm = LLM("tiny", attention_backend=backend, show_progress=False, **options)  # type: ignore[arg-type]
    runners = [llm.engine.runner] + ([llm.engine.drafter.runner] if llm.engine.drafter is not None else [])
    calls = [0]
    for runner in runners:
        kernel = runner.in_place_attention
        assert (kernel is None) == (backend == "sdpa")
        if kernel is not None:

            def counted(*args: object, kernel: object = kernel) -> torch.Tensor:
                calls[0] += 1
                return kernel(*args)  # type: ignore[operator]

            runner.in_place_attention = counted
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    return [o.token_ids for o in outputs], llm.stats(), calls[0]


def test_the_engine_gives_the_same_greedy_tokens_with_the_kernel_through_chunks_preemption_and_the_cache():
    options = {"max_num_batched_tokens": 16, "num_kv_blocks": 9, "enable_prefix_caching": True}
    sdpa, sdpa_stats, _ = generate_counting("sdpa", **options)
    triton, stats, calls = generate_counting("triton", **options)
    assert triton == sdpa
    assert calls > 0, "the kernel never ran"
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > 0, stats  # both were exercised
    assert sdpa_stats["num_preemptions"] == stats["num_preemptions"]


def test_speculative_verification_runs_through_the_kernel_and_keeps_the_greedy_tokens():
    options = {"draft_model": "tiny-draft", "num_speculative_tokens": 3}
    sdpa, _, _ = generate_counting("sdpa", **options)
    triton, stats, calls = generate_counting("triton", **options)
    assert triton == sdpa and calls > 0 and stats["num_draft_tokens"] > 0


def test_choose_attention_says_what_it_chose_and_why(monkeypatch):
    from mini_infer.kv.attention_backend import choose_attention

    cpu = torch.device("cpu")
    assert choose_attention("sdpa", cpu, torch.float32, 14, 2, 64)[0] is None
    kernel, why = choose_attention("auto", cpu, torch.float32, 14, 2, 64)
    assert kernel is None and "CUDA" in why  # auto never interprets
    kernel, why = choose_attention("triton", cpu, torch.float32, 14, 2, 64)
    assert kernel is not None and "interpreter" in why
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "triton" else real(name))
    with pytest.raises(ValueError, match="attention_backend='triton' cannot run here: Triton is not installed"):
        choose_attention("triton", cpu, torch.float32, 14, 2, 64)


def test_the_start_up_check_passes_the_kernel_and_catches_a_wrong_one():
    from mini_infer.kv import attention_backend

    kernel = load_kernel(torch.device("cpu"))
    assert attention_backend.start_up_check(kernel, torch.device("cpu"), torch.float32, 14, 2, 64) is None

    class Scaled:  # the real kernel with its softmax scale doubled
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                args = list(args)
                args[-1] *= 2  # the last positional argument is the scale
                return kernel[grid](*args, **kwargs)

            return launch

    failed = attention_backend.start_up_check(Scaled(), torch.device("cpu"), torch.float32, 14, 2, 64)
    assert failed is not None and "max error" in failed


def test_a_bad_backend_is_refused_by_name():
    from mini_infer.engine_builder import EngineConfig

    with pytest.raises(ValueError, match="attention_backend must be 'auto' or 'sdpa' or 'triton', got 'flash'"):
        EngineConfig(model="tiny", attention_backend="flash")


def test_tensor_parallelism_refuses_the_kernel_instead_of_ignoring_it():
    from mini_infer import LLM

    with pytest.raises(ValueError, match="ranks of a tensor-parallel engine attend with SDPA"):
        LLM("tiny", tensor_parallel_size=2, attention_backend="triton", show_progress=False)


@pytest.mark.parametrize("backend", ["sdpa", "triton"])
def test_bench_offline_takes_the_attention_backend(backend):
    import argparse

    from mini_infer.bench.offline import Bench, add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--shape", "tiny-test", "--device", "cpu", "--skip-hf", "--attention-backend", backend])
    assert Bench(args).results["attention"] == backend


def test_auto_falls_back_to_sdpa_when_triton_fails_on_a_gpu(monkeypatch):
    """On CUDA, 'auto' never fails the engine: a Triton that does not load, or a kernel that fails
    its start-up check, means SDPA with the reason (the CUDA calls themselves are replaced here)."""
    from mini_infer.kv import attention_backend

    cuda = torch.device("cuda")
    monkeypatch.setattr(attention_backend, "triton_unavailable", lambda device: None)

    def broken(device):
        raise ImportError("libcuda.so not found")

    monkeypatch.setattr(attention_backend, "load_kernel", broken)
    kernel, why = attention_backend.choose_attention("auto", cuda, torch.float16, 14, 2, 64)
    assert kernel is None and "Triton did not load (ImportError: libcuda.so not found)" in why
    monkeypatch.setattr(attention_backend, "load_kernel", lambda device: object())
    monkeypatch.setattr(attention_backend, "start_up_check", lambda *args: "max error 1.0e+00")
    kernel, why = attention_backend.choose_attention("auto", cuda, torch.float16, 14, 2, 64)
    assert kernel is None and "failed its start-up check (max error 1.0e+00)" in why
    monkeypatch.setattr(attention_backend, "start_up_check", lambda *args: None)
    kernel, why = attention_backend.choose_attention("auto", cuda, torch.float16, 14, 2, 64)
    assert kernel is not None and "start-up check passed" in why
