"""The roofline's arithmetic (chapter 06), against a real model and PyTorch's FLOP counter.

``mini-infer bench offline`` judges a run by the sum over its steps of
``max(weight bytes / bandwidth, FLOPs / peak)``. Those two counts are written by hand in
``mini_infer/bench/roofline.py``; here they are checked against the model they describe: the
weights a step reads are exactly the model's matmul weights, and the matmul FLOPs are what
``torch.utils.flop_counter`` counts for the same forward.
"""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from mini_infer.bench.roofline import Roofline, step_flops, step_operations, weight_bytes_read
from mini_infer.config import ModelConfig
from mini_infer.model import ContiguousKVCache, Qwen2Layer, Qwen2Model

VARIANTS = ["tied-gqa2", "untied-gqa4", "mha-headdim32"]


def _load(model_dirs, variant):
    return Qwen2Model.from_pretrained(model_dirs[variant], torch.float32, show_progress=False)


@pytest.mark.parametrize("variant", VARIANTS)
def test_weight_bytes_are_the_models_matmul_weights(model_dirs, variant):
    model = _load(model_dirs, variant)
    layers = sum(getattr(layer, name).numel() for layer in model.layers for name in Qwen2Layer.MATMUL_WEIGHTS)
    # The LM head is read every step (tied or not); the embedding table only has rows looked up.
    assert weight_bytes_read(model.config, itemsize=2) == 2 * (layers + model.lm_head.numel())
    assert weight_bytes_read(model.config, itemsize=4) == 4 * (layers + model.lm_head.numel())


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(("cached", "new", "logits"), [(0, 1, 1), (12, 1, 1), (5, 7, 0), (5, 7, 3)])
def test_matmul_flops_are_what_pytorch_counts(model_dirs, variant, cached, new, logits):
    model = _load(model_dirs, variant)
    config = model.config
    cache = ContiguousKVCache(config, cached + new, torch.float32, "cpu")
    ids = torch.randint(0, config.vocab_size, (cached + new,))
    with torch.inference_mode():
        if cached:
            model.forward(ids[:cached], torch.arange(cached), cache)
            cache.advance(cached)
        # The counter sees every projection and the LM head (aten.mm / addmm). The CPU flash
        # attention kernel is not among the ops it counts, so the matmul part is compared alone.
        with FlopCounterMode(display=False) as counter:
            hidden = model.forward(ids[cached:], torch.arange(cached, cached + new), cache)
            if logits:
                model.compute_logits(hidden[-logits:])
    assert step_flops(config, new, logits, context_tokens=0) == counter.get_total_flops()


@pytest.mark.parametrize("variant", VARIANTS)
def test_attention_flops_are_two_matmuls_per_query_and_key(model_dirs, variant):
    config = _load(model_dirs, variant).config
    context = 37
    q = torch.randn(config.num_attention_heads, 1, config.head_dim)
    k = torch.randn(config.num_attention_heads, context, config.head_dim)
    with FlopCounterMode(display=False) as counter:
        for _ in range(config.num_hidden_layers):
            (q @ k.transpose(1, 2)).softmax(-1) @ k  # scores, then the weighted sum of values
    attention = step_flops(config, 1, 0, context_tokens=context) - step_flops(config, 1, 0, context_tokens=0)
    assert attention == counter.get_total_flops()


def test_a_step_is_bound_by_the_slower_of_memory_and_compute(model_dirs):
    config = _load(model_dirs, "tied-gqa2").config
    roofline = Roofline(bandwidth_bytes_per_s=1e9, peak_flops=1e12)
    small = roofline.step_floor_seconds(config, num_tokens=1, num_logits=1, context_tokens=10, itemsize=2)
    assert small == pytest.approx(weight_bytes_read(config, 2) / 1e9)  # one token: reading the weights
    large = roofline.step_floor_seconds(config, num_tokens=100_000, num_logits=1, context_tokens=10, itemsize=2)
    assert large == pytest.approx(step_flops(config, 100_000, 1, 10) / 1e12)  # many: the matmuls


def _hand_config() -> ModelConfig:
    return ModelConfig.from_dict(
        {
            "hidden_size": 8,
            "intermediate_size": 12,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "vocab_size": 20,
            "max_position_embeddings": 64,
        }
    )


def test_each_operations_flops_and_bytes_are_the_hand_count():
    # hidden 8, head_dim 4: q 8 wide, k and v 4 each; intermediate 12; 2 layers; vocabulary 20.
    # A step of 3 new tokens, 2 sampled rows, 3 * 10 keys attended, 10 cached tokens read; 2 bytes.
    ops = {op.name: op for op in step_operations(_hand_config(), 3, 2, 30, 10, itemsize=2)}
    assert list(ops) == ["qkv_proj", "attention", "o_proj", "gate_up_proj", "down_proj", "lm_head"]
    # qkv: [3, 8] @ [8, 16]: 2*3*8*16 = 768 FLOPs a layer; weight 128 + input 24 + output 48 = 200 values.
    assert (ops["qkv_proj"].flops, ops["qkv_proj"].bytes) == (2 * 768, 2 * 200 * 2)
    # attention: 4 * 2 heads * 4 * 30 = 960 FLOPs a layer; K/V read 2*4*10 = 80, Q read and O
    # written 3*8*2 = 48, new K/V written 3*4*2 = 24: 152 values.
    assert (ops["attention"].flops, ops["attention"].bytes) == (2 * 960, 2 * 152 * 2)
    # o_proj: [3, 8] @ [8, 8]: 384 FLOPs; 64 + 24 + 24 = 112 values.
    assert (ops["o_proj"].flops, ops["o_proj"].bytes) == (2 * 384, 2 * 112 * 2)
    # gate_up: [3, 8] @ [8, 24]: 1152 FLOPs; 192 + 24 + 72 = 288 values.
    assert (ops["gate_up_proj"].flops, ops["gate_up_proj"].bytes) == (2 * 1152, 2 * 288 * 2)
    # down: [3, 12] @ [12, 8]: 576 FLOPs; 96 + 36 + 24 = 156 values.
    assert (ops["down_proj"].flops, ops["down_proj"].bytes) == (2 * 576, 2 * 156 * 2)
    # LM head, once: [2, 8] @ [8, 20]: 640 FLOPs; 160 + 16 + 40 = 216 values.
    assert (ops["lm_head"].flops, ops["lm_head"].bytes) == (640, 216 * 2)
    assert ops["qkv_proj"].intensity == pytest.approx(1536 / 800)


def test_decode_is_memory_bound_and_a_long_prefill_is_not():
    config = _hand_config()
    decode = {op.name: op for op in step_operations(config, 1, 1, 50, 50, itemsize=2)}
    prefill = {op.name: op for op in step_operations(config, 4096, 1, 4096 * 2048, 0, itemsize=2)}
    # One row: about one FLOP per byte of weight read. 4,096 rows: the weight is read once for all.
    assert decode["gate_up_proj"].intensity < 1.1
    assert prefill["gate_up_proj"].intensity > 4
    assert prefill["gate_up_proj"].intensity > 4 * decode["gate_up_proj"].intensity


def test_on_cuda_the_timing_reads_cuda_events_not_the_host_clock(monkeypatch):
    """The CUDA branch of seconds_per_call with torch.cuda.Event faked on this CPU: each timing is
    the events' elapsed time (milliseconds) over the inner calls, and the host clock is never read
    (a 22 us matmul timed with perf_counter and a sync reads several times too slow)."""
    from mini_infer.bench import roofline

    calls, recorded = [], []

    class FakeEvent:
        def __init__(self, enable_timing=False):
            assert enable_timing

        def record(self, stream=None):
            recorded.append(len(calls))

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return 0.022 * 10  # ms for 10 calls of 22 us each

    def no_host_clock():
        raise AssertionError("the host clock times a CUDA kernel")

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(roofline.time, "perf_counter", no_host_clock)
    seconds = roofline.seconds_per_call(lambda: calls.append(1), torch.device("cuda"), repeats=3, inner=10)
    assert seconds == pytest.approx(22e-6)
    assert len(calls) == 4 * 10 and recorded == [0, 10, 10, 20, 20, 30, 30, 40]  # events around each 10


def test_on_a_cpu_the_timing_is_per_call():
    from mini_infer.bench.roofline import seconds_per_call

    calls = []
    assert seconds_per_call(lambda: calls.append(1), torch.device("cpu"), repeats=2, inner=3) >= 0
    assert len(calls) == 3 * 3
