import json

from transformers import AutoModelForCausalLM, AutoTokenizer

from mini_infer.config import ModelConfig
from mini_infer.loader import checkpoint_files
from mini_infer.offline_models import NAMED_SHAPES, write_random_model


def test_named_shapes_are_real_qwen25():
    assert NAMED_SHAPES["qwen2.5-0.5b"].hidden_size == 896
    assert NAMED_SHAPES["qwen2.5-1.5b"].num_hidden_layers == 28
    assert NAMED_SHAPES["qwen2.5-1.5b"].vocab_size == 151936


def test_written_model_loads_in_transformers(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert model.config.num_key_value_heads == 2
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    config = ModelConfig.from_model_dir(tiny_model_dir)
    # Both end-of-turn tokens are stop tokens, as in Qwen2.5-Instruct's generation_config.
    assert set(config.eos_token_ids) == {
        tokenizer.convert_tokens_to_ids("<|im_end|>"),
        tokenizer.convert_tokens_to_ids("<|endoftext|>"),
    }


def test_same_seed_same_bytes(tmp_path):
    a = write_random_model(tmp_path / "a", "tiny-test", seed=3)
    b = write_random_model(tmp_path / "b", "tiny-test", seed=3)
    c = write_random_model(tmp_path / "c", "tiny-test", seed=4)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_text() == (b / "tokenizer.json").read_text()


def test_overrides_and_sharding(tmp_path):
    path = write_random_model(tmp_path / "m", "tiny-test", num_hidden_layers=3, max_shard_bytes=50_000, dtype="float16")
    assert len(checkpoint_files(path)) > 1
    config = json.loads((path / "config.json").read_text())
    assert config["num_hidden_layers"] == 3 and config["torch_dtype"] == "float16"
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(index["weight_map"]) == 3 * 12 + 2  # per layer 12 tensors, embeddings and final norm


def test_ids_beyond_the_tokenizer_decode_to_nothing(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    config = ModelConfig.from_model_dir(tiny_model_dir)
    assert len(tokenizer) < config.vocab_size
    assert tokenizer.decode([config.vocab_size - 1]) == ""


def test_random_model_emits_only_tokens_the_tokenizer_has(tmp_path):
    # A vocabulary mostly of padding, as at the Qwen2.5 shapes: the padding rows of the output
    # projection are zero, so greedy decoding picks real tokens and streams real text.
    import torch

    from mini_infer import LLM, SamplingParams

    for tied in (True, False):
        path = write_random_model(
            tmp_path / f"tied-{tied}",
            "tiny-test",
            vocab_size=4096,
            tie_word_embeddings=tied,
            tokenizer_vocab_size=300,
            dtype="float32",
        )
        tokenizer_size = len(AutoTokenizer.from_pretrained(path))
        llm = LLM(str(path), dtype=torch.float32, show_progress=False)
        outputs = llm.generate(
            ["hello world", "a b c"], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True), use_tqdm=False
        )
        for out in outputs:
            assert len(out.token_ids) == 24 and max(out.token_ids) < tokenizer_size, out.token_ids
