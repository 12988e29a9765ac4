import json
import re

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


# ------------------------------------------------------------------ EngineConfig, checked as it is built


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"block_size": 0}, "block_size must be a positive int, got 0"),
        ({"max_num_batched_tokens": 2.5}, "max_num_batched_tokens must be an int, got 2.5"),
        ({"max_num_seqs": True}, "max_num_seqs must be an int, got True"),
        ({"num_kv_blocks": 0}, "num_kv_blocks must be None or a positive int, got 0"),
        ({"kv_cache_memory": -1}, "kv_cache_memory must be None or a positive number of bytes, got -1"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization must be in (0, 1], got 1.5"),
        ({"gpu_memory_utilization": "high"}, "gpu_memory_utilization must be a number, got 'high'"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size must be a positive int, got 0"),
        ({"max_model_len": 0}, "max_model_len must be None or a positive int, got 0"),
        ({"num_speculative_tokens": 0, "draft_model": "tiny-draft"}, "num_speculative_tokens must be a positive int"),
        ({"num_speculative_tokens": 6}, "num_speculative_tokens=6 does nothing without a draft model"),
        ({"generation_config": "nowhere"}, "generation_config must be 'auto', 'vllm' or a directory holding"),
    ],
)
def test_engine_config_refuses_a_bad_option_when_built(options, message):
    """Every option is checked by its field's rule when the config is built, before anything
    loads, and the error names the option, the value and what it must be."""
    from mini_infer.engine_builder import EngineConfig

    with pytest.raises(ValueError, match="^" + re.escape(message)):
        EngineConfig(model="tiny", **options)
    normalised = EngineConfig(model="tiny", gpu_memory_utilization=1)
    assert isinstance(normalised.gpu_memory_utilization, float) and normalised.gpu_memory_utilization == 1.0
