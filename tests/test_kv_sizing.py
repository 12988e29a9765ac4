"""Sizing the KV pool from a memory budget (chapter 05): the arithmetic, the draft's share, the cap."""

import pytest
import torch

from mini_infer.config import ModelConfig
from mini_infer.kv.paged_attention import PagedKVCache
from mini_infer.kv.sizing import kv_blocks_for_memory


def _config(layers: int, kv_heads: int, head_dim: int) -> ModelConfig:
    return ModelConfig(
        vocab_size=100, hidden_size=kv_heads * head_dim, intermediate_size=8, num_hidden_layers=layers,
        num_attention_heads=kv_heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        max_position_embeddings=4096, rope_theta=1e4, rms_norm_eps=1e-6, tie_word_embeddings=True, torch_dtype=None,
    )  # fmt: skip


QWEN_1_5B = _config(28, 2, 128)  # the Qwen2.5-1.5B target's KV shape
QWEN_0_5B = _config(24, 2, 64)  # the Qwen2.5-0.5B draft's


def blocks(configs, memory, **overrides):
    settings = dict(block_size=16, dtype=torch.float16, device=torch.device("cpu"), max_num_seqs=256)
    settings |= dict(max_model_len=4096, kv_cache_memory=memory) | overrides
    return kv_blocks_for_memory(configs, **settings)


def test_bytes_per_block_of_the_real_shapes():
    # 2 (K, V) x 28 layers x 2 KV heads x 16 slots x 128 dims x 2 bytes
    assert PagedKVCache.bytes_per_block(QWEN_1_5B, 16, torch.float16) == 458_752
    assert PagedKVCache.bytes_per_block(QWEN_0_5B, 16, torch.float16) == 196_608


def test_a_draft_makes_every_block_cost_both_pools():
    gib = 2**30
    assert blocks([QWEN_1_5B], gib) == gib // 458_752
    assert blocks([QWEN_1_5B, QWEN_0_5B], gib) == gib // (458_752 + 196_608)


def test_never_more_blocks_than_the_sequences_can_use():
    assert blocks([QWEN_1_5B], 2**40, max_num_seqs=3, max_model_len=100) == 3 * 7  # ceil(100 / 16) = 7 each


def test_a_budget_without_room_for_one_block_is_a_clear_error():
    with pytest.raises(MemoryError, match="num_kv_blocks"):
        blocks([QWEN_1_5B], 1000)


def test_on_cuda_the_budget_is_the_cards_share_minus_what_is_held_and_the_activation_peak(monkeypatch):
    """A 6 GiB card at gpu_memory_utilization 0.9 with 4.5 GiB already held (weights of the 1.5B
    target and the 0.5B draft in float16, the CUDA context) and a 300 MiB activation peak: the pool
    gets the 622 MiB left, at 448 + 192 KiB per block id (the card is faked: no GPU here)."""
    gib, mib = 2**30, 2**20
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (int(1.5 * gib), 6 * gib))
    settings = dict(block_size=16, dtype=torch.float16, device=torch.device("cuda"), max_num_seqs=256)
    settings |= dict(max_model_len=32768, gpu_memory_utilization=0.9, activation_bytes=300 * mib)
    got = kv_blocks_for_memory([QWEN_1_5B, QWEN_0_5B], **settings)
    assert got == int(0.9 * 6 * gib - 4.5 * gib - 300 * mib) // (458_752 + 196_608) == 994  # ~15,900 tokens
    with pytest.raises(MemoryError, match="gpu_memory_utilization"):
        kv_blocks_for_memory([QWEN_1_5B, QWEN_0_5B], **(settings | dict(activation_bytes=gib)))


def fake_allocator(monkeypatch, *, held, peak):
    """CUDA's caching allocator faked on this CPU: ``held`` bytes reserved before the step, ``peak()``
    the largest reserved during it. Its allocated-memory counters raise: sizing must read reserved
    memory (what the process holds on the card), not allocated."""
    for name in ("synchronize", "reset_peak_memory_stats", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, lambda device=None: None)

    def allocated(device=None):
        raise AssertionError("read reserved memory, not allocated")

    monkeypatch.setattr(torch.cuda, "memory_allocated", allocated)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", allocated)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: held)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: peak())


def test_the_activation_peak_is_measured_from_the_largest_step(tiny_model_dir, monkeypatch):
    """measure_activation_peak runs the largest step (a chunk and max_num_seqs logit rows, sampled)
    on each model and reads the allocator's reserved peak; the allocator is faked here, the step is
    real."""
    from mini_infer.engine_builder import EngineConfig, measure_activation_peak
    from mini_infer.model import Qwen2Model

    model = Qwen2Model.from_pretrained(tiny_model_dir, torch.float32, show_progress=False)
    ran = []
    original = PagedKVCache.__init__

    def counting_init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        ran.append(self.nbytes)

    monkeypatch.setattr(PagedKVCache, "__init__", counting_init)
    fake_allocator(monkeypatch, held=10_000, peak=lambda: 10_000 + ran[-1] + 7_000)
    config = EngineConfig(model=str(tiny_model_dir), max_num_batched_tokens=40, max_num_seqs=8)
    assert measure_activation_peak([model], config) == 7_000
    # The scratch pool holds the 33-token chunk and seven single-token sequences: 3 + 7 blocks
    # (and the cache's null block).
    assert ran == [PagedKVCache.bytes_per_block(model.config, 16, torch.float32) * (10 + 1)]


def test_the_measured_step_stays_within_the_models_positions(tmp_path, monkeypatch):
    """A model with fewer positions than the token budget (max_position_embeddings 64, 200 tokens
    a step): the measured step still brings the whole budget, in chunks no longer than the model's
    context. One 197-token chunk indexed RoPE's 64-row table past its end (a device-side assert
    on CUDA, at engine build)."""
    from mini_infer.engine_builder import EngineConfig, measure_activation_peak
    from mini_infer.model import Qwen2Model
    from mini_infer.model_runner import ModelRunner
    from mini_infer.offline_models import write_random_model

    model_dir = write_random_model(tmp_path / "short", "tiny-test", dtype="float32", max_position_embeddings=64)
    model = Qwen2Model.from_pretrained(model_dir, torch.float32, show_progress=False)
    prepared = []
    original = ModelRunner.prepare

    def recording_prepare(self, inputs):
        prepared.append(list(inputs))
        return original(self, inputs)

    monkeypatch.setattr(ModelRunner, "prepare", recording_prepare)
    fake_allocator(monkeypatch, held=0, peak=lambda: 1 << 30)
    measure_activation_peak([model], EngineConfig(model=str(model_dir), max_num_batched_tokens=200, max_num_seqs=4))
    (inputs,) = prepared
    assert sum(s.num_tokens for s in inputs) == 200
    assert max(s.context_len for s in inputs) <= 64
    assert sum(s.num_logits for s in inputs) == 4  # one logit row per sequence that can run


def test_with_a_draft_the_measured_step_samples_every_verification_row(model_dirs, monkeypatch):
    """Speculative verification samples 1 + k rows per sequence: the measured step must too, up to
    the token budget (before, it sampled max_num_seqs rows: 8 here, where verification samples 32),
    and the sampler sees every one of them."""
    from mini_infer.engine_builder import EngineConfig, largest_step, measure_activation_peak
    from mini_infer.model import Qwen2Model
    from mini_infer.model_runner import ModelRunner
    from mini_infer.sampling import Sampler

    target = Qwen2Model.from_pretrained(model_dirs["tied-gqa2"], torch.float32, show_progress=False)
    draft = Qwen2Model.from_pretrained(model_dirs["sharded"], torch.float32, show_progress=False)
    prepared, sampled = [], []
    original_prepare, original_sample = ModelRunner.prepare, Sampler.__call__

    def recording_prepare(self, inputs):
        prepared.append(list(inputs))
        return original_prepare(self, inputs)

    def recording_sample(self, logits, params, *args, **kwargs):
        sampled.append((logits.shape[0], len(params)))
        return original_sample(self, logits, params, *args, **kwargs)

    monkeypatch.setattr(ModelRunner, "prepare", recording_prepare)
    monkeypatch.setattr(Sampler, "__call__", recording_sample)
    fake_allocator(monkeypatch, held=0, peak=lambda: 1 << 30)
    for budget, rows in [(64, 8 * 4), (20, 20)]:  # 8 sequences x (1 + 3): 32 rows, or the whole budget
        prepared.clear(), sampled.clear()
        config = EngineConfig(
            model="x", draft_model="y", num_speculative_tokens=3, max_num_batched_tokens=budget, max_num_seqs=8
        )
        measure_activation_peak([target, draft], config)
        assert len(prepared) == 2  # the same step through the target and the draft
        for inputs in prepared:
            assert sum(s.num_tokens for s in inputs) == budget
            assert sum(s.num_logits for s in inputs) == rows
            assert max(len(s.draft_token_ids) for s in inputs) == 3
        assert sampled == [(rows, rows)] * 2
    no_draft, _ = largest_step(EngineConfig(model="x", max_num_batched_tokens=64, max_num_seqs=8), context=4096)
    assert sum(s.num_logits for s in no_draft) == 8 and not any(s.draft_token_ids for s in no_draft)
