"""Half precision that survives Qwen2 (chapter 02): the residual stream of a float16 model is kept
in float32, so a model with a residual channel past 65,504 and large key biases decodes as
Hugging Face does in float32; without the policy it does not."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from mini_infer import LLM, SamplingParams
from mini_infer.layers import residual_dtype
from mini_infer.model import FullAttention, Qwen2Model
from mini_infer.offline_models import add_massive_activations, write_random_model
from tests.engine_checks import transformers_greedy

PROMPTS = [[5, 17, 230, 4], [88, 3, 41, 41, 9, 300, 12], [7] * 20, list(range(100, 160))]


@pytest.fixture(scope="module")
def massive(tmp_path_factory):
    path = tmp_path_factory.mktemp("massive")
    write_random_model(path, "small-test", seed=1, dtype="float32", init_std=0.1, num_hidden_layers=4)
    return add_massive_activations(path)


def test_the_policy():
    assert residual_dtype(torch.float16) == torch.float32
    assert residual_dtype(torch.bfloat16) == torch.bfloat16 and residual_dtype(torch.float32) == torch.float32


def test_the_model_really_overflows_float16(massive):
    hf = AutoModelForCausalLM.from_pretrained(massive, dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = hf(torch.tensor([PROMPTS[0]]), output_hidden_states=True).hidden_states
    residual_before_the_final_norm = hidden[-2] + 40000.0  # the last layer adds its 40,000 after this
    assert residual_before_the_final_norm.abs().max() > torch.finfo(torch.float16).max
    without = Qwen2Model.from_pretrained(massive, torch.float16, show_progress=False)
    without.residual_dtype = torch.float16  # no policy: a float16 residual stream
    ids = torch.tensor(PROMPTS[0])
    logits = without.compute_logits(without.forward(ids, torch.arange(len(ids)), FullAttention()))
    assert not torch.isfinite(logits).all()


@pytest.mark.parametrize("dtype, tolerance", [(torch.float16, 2e-2), (torch.bfloat16, 6e-2)])
def test_half_precision_logits_stay_finite_and_close_to_float32(massive, dtype, tolerance):
    """bfloat16 has float32's range (its residual stays bfloat16) but only 8 bits of mantissa:
    close, within a coarser tolerance."""
    half_model = Qwen2Model.from_pretrained(massive, dtype, show_progress=False)
    ours32 = Qwen2Model.from_pretrained(massive, torch.float32, show_progress=False)
    for prompt in PROMPTS:
        ids, positions = torch.tensor(prompt), torch.arange(len(prompt))
        half = half_model.compute_logits(half_model.forward(ids, positions, FullAttention()))
        full = ours32.compute_logits(ours32.forward(ids, positions, FullAttention()))
        assert torch.isfinite(half).all()
        scale = full.abs().max()
        assert (half - full).abs().max() <= tolerance * scale, ((half - full).abs().max(), scale)


def test_the_float16_engine_decodes_like_transformers_float32(massive):
    expected = transformers_greedy(massive, PROMPTS, 16)
    llm = LLM(str(massive), dtype="float16", num_kv_blocks=64, show_progress=False)
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert [o.token_ids for o in outputs] == expected
    assert len({t for o in outputs for t in o.token_ids}) > 1  # not one token repeated everywhere
