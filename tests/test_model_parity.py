"""The model against Hugging Face ``transformers`` with the same weights (fp32, max |diff| <= 1e-4,
on the test device), and the bf16 model with prepacked CPU weights against the plain one."""

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from mini_infer.layers import can_prepack, linear, prepack_linear_weight
from mini_infer.model import ContiguousKVCache, FullAttention, Qwen2Layer, Qwen2Model
from tests.conftest import MODEL_VARIANTS, TEST_DEVICE

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def pairs(model_dirs):
    result = {}
    for name in MODEL_VARIANTS:
        ours = Qwen2Model.from_pretrained(model_dirs[name], torch.float32, TEST_DEVICE, show_progress=False)
        theirs = AutoModelForCausalLM.from_pretrained(model_dirs[name], dtype=torch.float32).eval()
        result[name] = (ours, theirs)
    return result


@pytest.mark.parametrize("variant", list(MODEL_VARIANTS))
def test_logits_match_transformers(pairs, variant):
    ours, theirs = pairs[variant]
    ids = torch.randint(0, ours.config.vocab_size, (45,))
    with torch.no_grad():
        expected = theirs(ids[None]).logits[0].to(TEST_DEVICE)
    ids = ids.to(TEST_DEVICE)
    got = ours.compute_logits(ours.forward(ids, torch.arange(45, device=TEST_DEVICE), FullAttention()))
    assert (got - expected).abs().max().item() <= TOLERANCE


@pytest.mark.parametrize("variant", ["tied-gqa2", "untied-gqa4"])
def test_contiguous_cache_equals_recompute(pairs, variant):
    ours, _ = pairs[variant]
    ids = torch.randint(0, ours.config.vocab_size, (30,), device=TEST_DEVICE)
    positions = torch.arange(30, device=TEST_DEVICE)
    full = ours.compute_logits(ours.forward(ids, positions, FullAttention()))
    cache = ContiguousKVCache(ours.config, 32, torch.float32, TEST_DEVICE)
    pieces = [ours.compute_logits(ours.forward(ids[:17], positions[:17], cache))]
    cache.advance(17)
    for t in range(17, 30):
        pieces.append(ours.compute_logits(ours.forward(ids[t : t + 1], positions[t : t + 1], cache)))
        cache.advance(1)
    assert (torch.cat(pieces) - full).abs().max().item() <= TOLERANCE


def test_contiguous_cache_refuses_overflow(pairs):
    ours, _ = pairs["tied-gqa2"]
    cache = ContiguousKVCache(ours.config, 4, torch.float32, TEST_DEVICE)
    with pytest.raises(ValueError, match="holds 4 tokens"):
        ours.forward(torch.zeros(5, dtype=torch.long, device=TEST_DEVICE), torch.arange(5, device=TEST_DEVICE), cache)


def test_bf16_close_to_fp32(model_dirs):
    fp32 = Qwen2Model.from_pretrained(model_dirs["tied-gqa2"], torch.float32, show_progress=False)
    bf16 = Qwen2Model.from_pretrained(model_dirs["tied-gqa2"], torch.bfloat16, TEST_DEVICE, show_progress=False)
    ids = torch.randint(0, fp32.config.vocab_size, (20,))
    a = fp32.compute_logits(fp32.forward(ids, torch.arange(20), FullAttention()))  # the reference, on the CPU
    on_device = bf16.forward(ids.to(TEST_DEVICE), torch.arange(20, device=TEST_DEVICE), FullAttention())
    b = bf16.compute_logits(on_device).cpu()
    # bf16 keeps 8 bits of mantissa: errors of a few percent of the logit scale, not more.
    assert (a - b).abs().max().item() < 0.05 * a.abs().max().item()


needs_prepack = pytest.mark.skipif(
    not can_prepack(torch.empty(1, dtype=torch.bfloat16)), reason="this CPU's oneDNN has no bf16 matmul to prepack for"
)


@needs_prepack
@pytest.mark.parametrize("rows", [1, 7, 64, 300, 512, 513])
def test_prepacked_linear_is_as_accurate_as_f_linear(rows):
    weight = torch.randn(96, 80).to(torch.bfloat16)
    bias = torch.randn(96).to(torch.bfloat16)
    x = torch.randn(rows, 80).to(torch.bfloat16)
    packed = prepack_linear_weight(weight)
    assert packed.is_mkldnn and torch.equal(packed.to_dense(), weight)
    exact = x.float() @ weight.float().T + bias.float()
    # Both round the float32 accumulation to bf16 once (the blocking may differ, so the last
    # bit may too): each is within one bf16 rounding of the exact product.
    for got in (linear(x, packed, bias), F.linear(x, weight, bias)):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), exact, rtol=2**-7, atol=1e-2)


@needs_prepack
@pytest.mark.parametrize("variant", ["tied-gqa2", "untied-gqa4"])
def test_prepacked_model_matches_the_plain_one(model_dirs, variant):
    plain = Qwen2Model.from_pretrained(model_dirs[variant], torch.bfloat16, show_progress=False)
    packed = Qwen2Model.from_pretrained(model_dirs[variant], torch.bfloat16, show_progress=False)
    assert packed.prepack_weights() and packed.prepacked and not packed.prepack_weights()
    assert not packed.embed.is_mkldnn  # the table stays plain for lookups
    layer = packed.layers[0]
    assert all(getattr(layer, name).is_mkldnn for name in Qwen2Layer.MATMUL_WEIGHTS)
    ids = torch.randint(0, plain.config.vocab_size, (40,))
    a = plain.compute_logits(plain.forward(ids, torch.arange(40), FullAttention()))
    b = packed.compute_logits(packed.forward(ids, torch.arange(40), FullAttention()))
    assert (a - b).abs().max().item() < 0.02 * a.abs().max().item()
    with pytest.raises(RuntimeError, match="prepacked"):
        packed.load_weights([("model.norm.weight", torch.ones(packed.config.hidden_size))])


def test_only_bf16_cpu_weights_are_prepacked(model_dirs):
    fp32 = Qwen2Model.from_pretrained(model_dirs["tied-gqa2"], torch.float32, show_progress=False)
    assert not fp32.prepack_weights() and not fp32.prepacked
    assert not can_prepack(torch.empty(1, dtype=torch.float16))
