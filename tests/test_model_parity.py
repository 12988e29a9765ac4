"""The model against Hugging Face ``transformers`` with the same weights (fp32, max |diff| <= 1e-4)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from mini_infer.model import ContiguousKVCache, FullAttention, Qwen2Model
from tests.conftest import MODEL_VARIANTS

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def pairs(model_dirs):
    result = {}
    for name in MODEL_VARIANTS:
        ours = Qwen2Model.from_pretrained(model_dirs[name], torch.float32, show_progress=False)
        theirs = AutoModelForCausalLM.from_pretrained(model_dirs[name], dtype=torch.float32).eval()
        result[name] = (ours, theirs)
    return result


@pytest.mark.parametrize("variant", list(MODEL_VARIANTS))
def test_logits_match_transformers(pairs, variant):
    ours, theirs = pairs[variant]
    ids = torch.randint(0, ours.config.vocab_size, (45,))
    with torch.no_grad():
        expected = theirs(ids[None]).logits[0]
    got = ours.compute_logits(ours.forward(ids, torch.arange(45), FullAttention()))
    assert (got - expected).abs().max().item() <= TOLERANCE


@pytest.mark.parametrize("variant", ["tied-gqa2", "untied-gqa4"])
def test_contiguous_cache_equals_recompute(pairs, variant):
    ours, _ = pairs[variant]
    ids = torch.randint(0, ours.config.vocab_size, (30,))
    full = ours.compute_logits(ours.forward(ids, torch.arange(30), FullAttention()))
    cache = ContiguousKVCache(ours.config, 32, torch.float32, "cpu")
    pieces = [ours.compute_logits(ours.forward(ids[:17], torch.arange(17), cache))]
    cache.advance(17)
    for t in range(17, 30):
        pieces.append(ours.compute_logits(ours.forward(ids[t : t + 1], torch.tensor([t]), cache)))
        cache.advance(1)
    assert (torch.cat(pieces) - full).abs().max().item() <= TOLERANCE


def test_contiguous_cache_refuses_overflow(pairs):
    ours, _ = pairs["tied-gqa2"]
    cache = ContiguousKVCache(ours.config, 4, torch.float32, "cpu")
    with pytest.raises(ValueError, match="holds 4 tokens"):
        ours.forward(torch.zeros(5, dtype=torch.long), torch.arange(5), cache)


def test_bf16_close_to_fp32(model_dirs):
    fp32 = Qwen2Model.from_pretrained(model_dirs["tied-gqa2"], torch.float32, show_progress=False)
    bf16 = Qwen2Model.from_pretrained(model_dirs["tied-gqa2"], torch.bfloat16, show_progress=False)
    ids = torch.randint(0, fp32.config.vocab_size, (20,))
    a = fp32.compute_logits(fp32.forward(ids, torch.arange(20), FullAttention()))
    b = bf16.compute_logits(bf16.forward(ids, torch.arange(20), FullAttention()))
    # bf16 keeps 8 bits of mantissa: errors of a few percent of the logit scale, not more.
    assert (a - b).abs().max().item() < 0.05 * a.abs().max().item()
