import json

import pytest

from mini_infer.config import ConfigError, ModelConfig
from mini_infer.offline_models import NAMED_SHAPES, qwen2_config_dict


def _config(**changes):
    raw = qwen2_config_dict(NAMED_SHAPES["qwen2.5-0.5b"], torch_dtype="bfloat16", eos_token_ids=[1])
    raw.update(changes)
    return raw


def test_reads_qwen25_05b_shape():
    c = ModelConfig.from_dict(_config())
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads) == (896, 24, 14, 2)
    assert c.head_dim == 64 and c.vocab_size == 151936 and c.tie_word_embeddings
    assert c.rope_theta == 1e6 and c.torch_dtype == "bfloat16"
    # Qwen2.5-0.5B has 494M parameters (tied embeddings counted once).
    assert 490e6 < c.num_params < 500e6


def test_reads_transformers5_rope_parameters():
    raw = _config()
    del raw["rope_theta"]
    raw["rope_parameters"] = {"rope_theta": 12345.0, "rope_type": "default"}
    assert ModelConfig.from_dict(raw).rope_theta == 12345.0


def test_explicit_head_dim():
    assert ModelConfig.from_dict(_config(head_dim=128)).head_dim == 128


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"architectures": ["LlamaForCausalLM"]}, "architectures"),
        ({"model_type": "llama"}, "model_type"),
        ({"hidden_size": 0}, "hidden_size"),
        ({"num_attention_heads": 14, "num_key_value_heads": 3}, "num_key_value_heads"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "rope_type"),
        ({"rope_theta": -1}, "rope_theta"),
        ({"vocab_size": "many"}, "vocab_size"),
        ({"rms_norm_eps": 0}, "rms_norm_eps"),
        # transformers' Qwen2 MLP applies whatever hidden_act names; ours is SwiGLU with silu only.
        ({"hidden_act": "gelu"}, "hidden_act"),
    ],
)
def test_refusals_name_the_field(changes, field):
    with pytest.raises(ConfigError, match=field):
        ModelConfig.from_dict(_config(**changes))


def test_hidden_act_may_be_left_out():
    raw = _config()
    del raw["hidden_act"]  # transformers' Qwen2Config defaults it to silu
    assert ModelConfig.from_dict(raw).hidden_size == 896


def test_missing_field_named():
    raw = _config()
    del raw["intermediate_size"]
    with pytest.raises(ConfigError, match="intermediate_size"):
        ModelConfig.from_dict(raw)


def test_generation_config_eos_merged(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_config(eos_token_id=7)))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 7]}))
    assert ModelConfig.from_model_dir(tmp_path).eos_token_ids == (5, 7)


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="config.json"):
        ModelConfig.from_model_dir(tmp_path)
