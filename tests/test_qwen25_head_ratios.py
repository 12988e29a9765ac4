"""Qwen2.5's head layouts at toy widths: the model and the engine against ``transformers`` (chapters 01-08).

The shared fixtures (``conftest.MODEL_VARIANTS``) have query groups of 1, 2 and 4. Real Qwen2.5
sizes group 7 query heads per KV head (0.5B: 14/2), 6 (1.5B: 12/2) and 5 (14B and 32B: 40/8), with
head_dim 64 or 128 larger than hidden / heads here; their config.json files carry a
``sliding_window`` that ``use_sliding_window: false`` turns off. These models keep those layouts
with a hidden size of 64, a vocabulary that is not a multiple of 64 (padded past the tokenizer)
and an MLP width that is not a multiple of the hidden size, so that each test runs in about a
second on a CPU.
"""

import json
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from mini_infer import LLM, SamplingParams
from mini_infer.model import FullAttention, Qwen2Model
from mini_infer.offline_models import write_random_model
from tests.engine_checks import assert_all_blocks_back, run_checked, transformers_greedy

HEAD_LAYOUTS = {
    "gqa7-headdim64": dict(num_attention_heads=14, num_key_value_heads=2, head_dim=64),  # Qwen2.5-0.5B
    "gqa6-headdim128": dict(num_attention_heads=12, num_key_value_heads=2, head_dim=128),  # Qwen2.5-1.5B
    "gqa5-headdim128": dict(num_attention_heads=40, num_key_value_heads=8, head_dim=128),  # Qwen2.5-14B
}
MAX_TOKENS = 5


@pytest.fixture(scope="module")
def layout_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("qwen25-layouts")
    dirs = {}
    for index, (name, heads) in enumerate(HEAD_LAYOUTS.items()):
        path = write_random_model(
            root / name,
            "tiny-test",
            seed=4,
            dtype="float32",
            init_std=0.1,
            vocab_size=500,
            intermediate_size=200,
            tie_word_embeddings=index % 2 == 0,
            rope_theta=10000.0 if index % 2 else 1e6,
            **heads,
        )
        config = json.loads((path / "config.json").read_text())
        config.update(sliding_window=32768, use_sliding_window=False)  # as in Qwen2.5's own files
        (path / "config.json").write_text(json.dumps(config))
        dirs[name] = path
    return dirs


@pytest.mark.parametrize("layout", list(HEAD_LAYOUTS))
def test_logits_match_transformers(layout_dirs, layout):
    ours = Qwen2Model.from_pretrained(layout_dirs[layout], torch.float32, show_progress=False)
    theirs = AutoModelForCausalLM.from_pretrained(layout_dirs[layout], dtype=torch.float32).eval()
    ids = torch.randint(0, ours.config.vocab_size, (37,))
    with torch.no_grad():
        expected = theirs(ids[None]).logits[0]
    got = ours.compute_logits(ours.forward(ids, torch.arange(37), FullAttention()))
    assert (got - expected).abs().max().item() <= 1e-4


def test_greedy_equals_transformers_through_chunks_preemption_and_the_prefix_cache(layout_dirs):
    # Qwen2.5-0.5B's layout (the smallest real one): groups of 7 folded in every paged attention path.
    model_dir = layout_dirs["gqa7-headdim64"]
    rng = random.Random(0)
    shared = [rng.randrange(490) for _ in range(19)]
    prompts = [[rng.randrange(490) for _ in range(n)] for n in (1, 40)] + [shared + [3], shared + [4, 5]]
    expected = transformers_greedy(model_dir, prompts, MAX_TOKENS)
    # 8-token blocks, 16-token chunks, and a pool of 8 blocks where the batch needs 13: prompts are
    # chunked mid-block and sequences preempted; the second round reads the shared prefix back.
    llm = LLM(
        str(model_dir),
        dtype="float32",
        block_size=8,
        max_num_batched_tokens=16,
        num_kv_blocks=8,
        show_progress=False,
    )
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = run_checked(llm.engine, prompts, greedy) + run_checked(llm.engine, prompts[-2:], greedy)
    assert [o.token_ids for o in outputs] == expected + expected[-2:]
    assert llm.stats()["num_preemptions"] > 0 and llm.stats()["prefix_cache_hit_tokens"] > 0
    assert_all_blocks_back(llm.engine)
