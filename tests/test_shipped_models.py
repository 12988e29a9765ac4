"""The tiny pair shipped inside the package (appendix A1): loadable by name, equal to what
``transformers`` computes from the same files, usable together for speculative decoding, and
meaningful enough to read.

The accuracy thresholds here are loose floors on fixed questions (the weights are fixed, so
the outcome is deterministic); the real evaluation is ``scripts/eval_tiny_pair.py``.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from mini_infer import LLM, SamplingParams, tiny_corpus
from mini_infer.layers import can_prepack
from mini_infer.model import FullAttention, Qwen2Model
from mini_infer.model_source import resolve_model

SHIPPED = ("tiny", "tiny-draft")


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_model_has_weights_tokenizer_and_card(name):
    path = resolve_model(name)
    for file in (
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "README.md",
        "training_log.jsonl",
        "eval_results.json",
    ):
        assert (path / file).is_file(), f"{name} lacks {file}"
    card = (path / "README.md").read_text()
    assert "license: apache-2.0" in card and "## Evaluation" in card and "## Training" in card


def test_the_pair_fits_the_size_budget():
    total = sum(f.stat().st_size for name in SHIPPED for f in resolve_model(name).iterdir() if f.is_file())
    assert total <= 12 * 1024 * 1024, f"{total / 2**20:.1f} MiB"


def test_draft_shares_the_target_tokenizer_and_vocabulary():
    target, draft = (resolve_model(n) for n in SHIPPED)
    assert (target / "tokenizer.json").read_text() == (draft / "tokenizer.json").read_text()
    configs = [json.loads((p / "config.json").read_text()) for p in (target, draft)]
    assert configs[0]["vocab_size"] == configs[1]["vocab_size"]
    params = [
        sum(t.numel() for t in Qwen2Model.from_pretrained(p, torch.float32, show_progress=False).parameters())
        for p in (target, draft)
    ]
    assert 0.15 <= params[1] / params[0] <= 0.4, params  # "about a quarter of its size"


@pytest.mark.parametrize("name", SHIPPED)
def test_logits_equal_transformers_on_a_chat(name):
    path = resolve_model(name)
    tokenizer = AutoTokenizer.from_pretrained(path)
    chat = [{"role": "user", "content": "What is 34 + 57?"}]
    ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)[
        "input_ids"
    ]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ours = Qwen2Model.from_pretrained(path, torch.float32, show_progress=False)
    with torch.inference_mode():
        expected = hf(ids).logits[0]
        got = ours.compute_logits(ours.forward(ids[0], torch.arange(ids.shape[1]), FullAttention()))
    assert (got - expected).abs().max().item() <= 1e-4


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_target_answers_held_out_questions(dtype):
    """In bf16 on a CPU the engine runs prepacked matmul weights: the answers must hold too."""
    llm = LLM("tiny", dtype=dtype, show_progress=False)
    assert llm.engine.runner.model.prepacked == (
        dtype == "bfloat16" and can_prepack(torch.empty(1, dtype=torch.bfloat16))
    )
    params = SamplingParams(temperature=0, max_tokens=48)
    for task in tiny_corpus.TASKS:
        questions = tiny_corpus.held_out_questions(task)[:10]
        replies = llm.chat([q.messages() for q in questions], params, use_tqdm=False)
        correct = sum(tiny_corpus.check_answer(q, r.text) for q, r in zip(questions, replies, strict=True))
        assert correct >= 7, f"{task}: {correct}/10 held-out questions answered"
