"""Half precision that survives Qwen2 (chapter 02): the residual stream of a float16 model is kept
in float32, so a model with a residual channel past 65,504 and large key biases decodes as
Hugging Face does in float32; without the policy it does not."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from mini_infer import LLM, SamplingParams
from mini_infer.layers import projection_scale, residual_dtype
from mini_infer.model import FullAttention, Qwen2Model
from mini_infer.offline_models import add_massive_activations, write_random_model
from tests.conftest import TEST_DEVICE
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
    without = Qwen2Model.from_pretrained(massive, torch.float16, TEST_DEVICE, show_progress=False)
    without.residual_dtype = torch.float16  # no policy: a float16 residual stream
    ids = torch.tensor(PROMPTS[0], device=TEST_DEVICE)
    logits = without.compute_logits(without.forward(ids, torch.arange(len(ids), device=TEST_DEVICE), FullAttention()))
    assert not torch.isfinite(logits).all()


@pytest.mark.parametrize("dtype, tolerance", [(torch.float16, 2e-2), (torch.bfloat16, 6e-2)])
def test_half_precision_logits_stay_finite_and_close_to_float32(massive, dtype, tolerance):
    """bfloat16 has float32's range (its residual stays bfloat16) but only 8 bits of mantissa:
    close, within a coarser tolerance."""
    half_model = Qwen2Model.from_pretrained(massive, dtype, TEST_DEVICE, show_progress=False)
    ours32 = Qwen2Model.from_pretrained(massive, torch.float32, show_progress=False)  # the reference, on the CPU
    for prompt in PROMPTS:
        ids, positions = torch.tensor(prompt), torch.arange(len(prompt))
        on_device = half_model.forward(ids.to(TEST_DEVICE), positions.to(TEST_DEVICE), FullAttention())
        half = half_model.compute_logits(on_device).cpu()
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


def add_one_layer_overflow(model_dir):
    """A model whose last layer's ``down_proj`` alone writes 67,000 to 270,000 into residual
    channel 0: more than float16 holds, in a single matmul output (not only in a sum).

    Residual channel 0 is 1.0 on every token (an embedding column) and nothing else reads or
    writes it, except in the last layer: its post-attention RMSNorm weights the channel 300, one
    MLP neuron reads only that channel (gate and up 0.1 each: about 100 to 400 after SwiGLU, which
    float16 holds) and ``down_proj`` writes it, times 700, to channel 0 only. The final norm gives
    channel 0 weight 0, so the next token depends on the other channels, as in the model before."""
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    layers = sorted({int(name.split(".")[2]) for name in tensors if name.startswith("model.layers.")})
    tensors["model.embed_tokens.weight"][:, 0] = 1.0
    for layer in layers:
        p = f"model.layers.{layer}."
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            tensors[p + name + ".weight"][:, 0] = 0.0  # nothing reads channel 0...
        tensors[p + "self_attn.o_proj.weight"][0, :] = 0.0  # ...nor writes it
        tensors[p + "mlp.down_proj.weight"][0, :] = 0.0
    p, neuron = f"model.layers.{layers[-1]}.", 0
    tensors[p + "post_attention_layernorm.weight"][0] = 300.0
    gate, up, down = (tensors[p + f"mlp.{n}_proj.weight"] for n in ("gate", "up", "down"))
    gate[neuron, :], up[neuron, :] = 0.0, 0.0
    gate[neuron, 0], up[neuron, 0] = 0.1, 0.1
    down[:, neuron] = 0.0
    down[0, neuron] = 700.0
    tensors["model.norm.weight"][0] = 0.0
    save_file(tensors, str(path), metadata={"format": "pt"})
    return model_dir


@pytest.fixture(scope="module")
def one_layer(tmp_path_factory):
    path = tmp_path_factory.mktemp("one-layer-overflow")
    write_random_model(path, "small-test", seed=1, dtype="float32", init_std=0.1)
    return add_one_layer_overflow(path)


def test_a_single_down_proj_output_overflows_float16_and_the_policy_survives_it(one_layer):
    hf = AutoModelForCausalLM.from_pretrained(one_layer, dtype=torch.float32).eval()
    outputs = {}
    for name in ("o_proj", "down_proj"):
        module = getattr(hf.model.layers[-1], "self_attn" if name == "o_proj" else "mlp")
        getattr(module, name).register_forward_hook(lambda m, i, out, name=name: outputs.__setitem__(name, out))
    with torch.no_grad():
        hf(torch.tensor([PROMPTS[1]]))
    fp16_max = torch.finfo(torch.float16).max
    assert outputs["down_proj"][..., 0].abs().min() > fp16_max  # on every token, one addend overflows
    assert outputs["o_proj"].abs().max() < fp16_max

    # Without the scaled projections (float32 residual only), the float16 model is not finite.
    without = Qwen2Model.from_pretrained(one_layer, torch.float16, TEST_DEVICE, show_progress=False)
    without.projection_scale = 1.0
    ids = torch.tensor(PROMPTS[1], device=TEST_DEVICE)
    positions = torch.arange(len(ids), device=TEST_DEVICE)
    assert not torch.isfinite(without.compute_logits(without.forward(ids, positions, FullAttention()))).all()

    # With them, the float16 engine decodes as Hugging Face does in float32.
    expected = transformers_greedy(one_layer, PROMPTS, 16)
    llm = LLM(str(one_layer), dtype="float16", num_kv_blocks=64, show_progress=False)
    assert llm.engine.runner.model.projection_scale == projection_scale(torch.float16) < 1
    outputs16 = llm.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True), use_tqdm=False)
    got = [o.token_ids for o in outputs16]
    same = sum(a == b for g, e in zip(got, expected) for a, b in zip(g, e))
    assert same >= 0.95 * sum(map(len, expected)), (got, expected)
    assert len({t for g in got for t in g}) > 1  # not one token repeated everywhere


def test_the_scale_is_a_power_of_two_and_only_for_float16():
    scale = projection_scale(torch.float16)
    assert scale < 1 and math.log2(scale).is_integer()  # exact: scaling changes no mantissa
    assert projection_scale(torch.bfloat16) == projection_scale(torch.float32) == 1.0


def test_tensor_parallel_ranks_sum_float16_partials_in_float32():
    """Each rank's partial sum fits float16 (40,000), their total (80,000) does not."""
    from tests.test_parallel_shards import _run_ranks

    def reduce(group):
        return group.all_reduce(torch.full((4,), 40000.0, dtype=torch.float16))

    for total in _run_ranks(2, reduce):
        assert total.dtype == torch.float32 and torch.equal(total, torch.full((4,), 80000.0))
