"""Real Qwen2.5 weights (chapter 13): config and tokenizer, the chat template against
``transformers``, greedy parity on 16 prompts, and the 0.5B draft with the 1.5B target.

These run wherever real checkpoints are present: set ``MINI_INFER_QWEN_0_5B_DIR`` and
``MINI_INFER_QWEN_1_5B_DIR`` to local Hugging Face directories of Qwen2.5-0.5B-Instruct and
Qwen2.5-1.5B-Instruct (on Kaggle, the mounts ``find_kaggle_model`` finds). Without them every
test here is skipped, saying which variable is missing: nothing is ever downloaded. The engine
runs in float32 on the suite's device; the reference is ``transformers`` in float32 on the CPU.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from mini_infer import LLM, SamplingParams
from mini_infer.config import ModelConfig
from mini_infer.sampling_params import generation_defaults
from mini_infer.speculative import check_draft_vocabulary
from mini_infer.tokenizer import Tokenizer
from tests.engine_checks import transformers_greedy

MODELS = {"0.5b": "MINI_INFER_QWEN_0_5B_DIR", "1.5b": "MINI_INFER_QWEN_1_5B_DIR"}
VOCAB_ROWS = 151_936  # the embedding rows of both checkpoints; the tokenizer has fewer tokens
TEXTS = ["Hello, world!", "def f(x):\n    return x * 2\n", "你好，世界。", "naïve café 🚀🚀", " leading space", ""]
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "What is 17 times 23?",
    "Explain what a KV cache is in one sentence.",
    "List three prime numbers.",
    "Translate 'good morning' into German.",
    "Who wrote Pride and Prejudice?",
    "What does HTTP stand for?",
    "Give me a synonym for 'quick'.",
    "Why is the sky blue? Answer briefly.",
    "Write a Python function that reverses a string.",
    "What is the boiling point of water in Fahrenheit?",
    "Name a planet with rings.",
    "Summarize the plot of Hamlet in one sentence.",
    "What is 2 to the power of 10?",
    "Suggest a name for a pet goldfish.",
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 3?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}],
    [
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": '{"temperature": 18}'},
    ],
]


def model_dir(size: str) -> Path:
    variable = MODELS[size]
    value = os.environ.get(variable)
    if not value:
        pytest.skip(f"real Qwen2.5-{size.upper()}-Instruct weights: set {variable} to a local model directory")
    path = Path(value)
    assert (path / "config.json").is_file(), f"{variable}={value} holds no config.json"
    return path


def chats() -> list[dict[str, Any]]:
    return [{"role": "user", "content": q} for q in QUESTIONS]


@pytest.fixture(params=list(MODELS))
def real_dir(request: pytest.FixtureRequest) -> Path:
    return model_dir(request.param)


def test_config_and_tokenizer_read_as_transformers_reads_them(real_dir: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    ours, theirs = ModelConfig.from_model_dir(real_dir), AutoConfig.from_pretrained(real_dir)
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert ours.num_key_value_heads == theirs.num_key_value_heads
    # transformers 5 keeps RoPE's base in rope_parameters, 4.x at the top level.
    theta = (getattr(theirs, "rope_parameters", None) or {}).get("rope_theta") or theirs.rope_theta
    assert ours.rope_theta == theta and ours.rms_norm_eps == theirs.rms_norm_eps
    assert ours.tie_word_embeddings == theirs.tie_word_embeddings
    assert ours.vocab_size == VOCAB_ROWS
    tokenizer, hf = Tokenizer(real_dir), AutoTokenizer.from_pretrained(real_dir)
    assert len(tokenizer) < VOCAB_ROWS  # the rows past the tokenizer are padding
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert ids == hf.encode(text, add_special_tokens=False) and tokenizer.decode(ids) == text
    end_of_turn = hf.convert_tokens_to_ids("<|im_end|>")
    assert end_of_turn in ours.eos_token_ids and tokenizer.eos_token_id == end_of_turn


def test_the_chat_template_renders_as_transformers_renders_it(real_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer, hf = Tokenizer(real_dir), AutoTokenizer.from_pretrained(real_dir)
    for messages in CONVERSATIONS:
        for tools in (None, TOOLS):
            expected = hf.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
            assert tokenizer.apply_chat_template(messages, tools=tools) == expected
    # The server's path: OpenAI messages (tool-call arguments as a JSON string) through ChatMessage.
    pytest.importorskip("fastapi")
    from mini_infer.server.protocol import ChatMessage

    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    wire = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "18 degrees"},
    ]
    rendered = [ChatMessage.model_validate(m).to_template() for m in wire]
    expected = hf.apply_chat_template(rendered, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert tokenizer.apply_chat_template(rendered, tools=TOOLS) == expected
    assert expected.startswith("<|im_start|>system\nBe brief.") and "get_weather" in expected


def test_greedy_parity_with_transformers_on_16_prompts(real_dir: Path) -> None:
    """With the model's own defaults: its repetition penalty applies to both sides."""
    llm = LLM(str(real_dir), dtype="float32", show_progress=False, max_num_seqs=16)
    prompts = [llm.engine.tokenizer.encode(llm.engine.tokenizer.apply_chat_template([q])) for q in chats()]
    penalty = generation_defaults(real_dir).get("repetition_penalty", 1.0)
    ours = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True), use_tqdm=False)
    expected = transformers_greedy(real_dir, prompts, 16, repetition_penalty=penalty)
    assert [o.token_ids for o in ours] == expected


@pytest.mark.filterwarnings("ignore:the model's generation config sets")  # the penalty is overridden below
def test_the_real_pair_shares_its_vocabulary_and_drafts_exactly() -> None:
    draft, target = model_dir("0.5b"), model_dir("1.5b")
    target_config, draft_config = ModelConfig.from_model_dir(target), ModelConfig.from_model_dir(draft)
    assert draft_config.vocab_size == target_config.vocab_size == VOCAB_ROWS
    check_draft_vocabulary(str(draft), draft, str(target), target_config, Tokenizer(target))  # does not raise
    # repetition_penalty=1.0: the checkpoints' own penalty would leave every request without drafts.
    params = SamplingParams(max_tokens=24, temperature=0, repetition_penalty=1.0)
    conversations = [[c] for c in chats()[:6]]
    alone = LLM(str(target), dtype="float32", show_progress=False)
    drafted = LLM(str(target), draft_model=str(draft), num_speculative_tokens=4, dtype="float32", show_progress=False)
    assert [o.token_ids for o in drafted.chat(conversations, params, use_tqdm=False)] == [
        o.token_ids for o in alone.chat(conversations, params, use_tqdm=False)
    ]
    stats = drafted.stats()
    assert stats["num_draft_tokens"] > 0 and 0 < stats["num_accepted_draft_tokens"] <= stats["num_draft_tokens"]
