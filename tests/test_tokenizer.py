import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mini_infer.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = [
    "Hello, world!",
    "Größe: 12 € — naïve café ☕",
    "emoji 🚀🚀 and 中文字符 mixed with ascii",
    "tabs\tand\nnewlines\n\n  spaces",
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return Tokenizer(tiny_model_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_roundtrip(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text)) == text


@pytest.mark.parametrize("text", TEXTS)
def test_streaming_never_emits_half_a_character(tokenizer, text):
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.push([t]) for t in ids]
    pieces.append(detok.flush())
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text
    # An emoji is four bytes spread over several byte-level tokens: the pushes that end
    # inside it must emit nothing.
    if "🚀" in text:
        assert "" in pieces[:-1]


@settings(max_examples=40, deadline=None)
@given(text=st.text(min_size=0, max_size=40), chunk=st.integers(min_value=1, max_value=5))
def test_streaming_equals_full_decode(tokenizer, text, chunk):
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer)
    out = "".join(detok.push(ids[i : i + chunk]) for i in range(0, len(ids), chunk)) + detok.flush()
    assert out == tokenizer.decode(ids)


def test_chat_template_renders_chatml(tokenizer):
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}])
    assert prompt == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_chat_template_with_tools_and_tool_results(tokenizer):
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Add 2 and 3."},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}],
        },
        {"role": "tool", "content": "5"},
    ]
    prompt = tokenizer.apply_chat_template(messages, tools=tools)
    assert prompt.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert '"name": "add"' in prompt
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>' in prompt
    assert "<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


def test_special_tokens_are_single_tokens(tokenizer):
    assert len(tokenizer.encode("<|im_start|>")) == 1
    assert len(tokenizer.encode("<tool_call>")) == 1
    assert tokenizer.hf.convert_ids_to_tokens(tokenizer.eos_token_id) == "<|im_end|>"
