"""The engine in float16 and bfloat16, on the test device (``MINI_INFER_TEST_DEVICE``), under every
scheduling regime: each token it chooses is the best of the float32 reference's logits, up to a
stated tolerance.

Greedy sequences in half precision drift apart from float32 ones after the first near-tie, so
comparing sequences says little; instead the float32 model reads each prompt and the engine's
own output (teacher forcing), and every token the engine chose must be within ``tolerance`` x the
row's spread (largest minus smallest logit) of the row's largest logit. A wrong K/V, mask or
position is far outside that; float16 rounding stays well inside (measured on this CPU: at most
0.05% of the spread in float16, 0.8% in bfloat16).
"""

import random

import pytest
import torch

from mini_infer import LLM, SamplingParams
from mini_infer.config import ModelConfig
from mini_infer.model import FullAttention, Qwen2Model
from tests.conftest import TEST_DEVICE
from tests.engine_checks import run_checked

TOLERANCE = {"float16": 0.01, "bfloat16": 0.02}
SETTINGS = {
    "roomy": dict(num_kv_blocks=512),
    "preemption": dict(num_kv_blocks=24),
    "chunked": dict(num_kv_blocks=512, max_num_batched_tokens=7),
    "prefix-cache-off": dict(num_kv_blocks=512, enable_prefix_caching=False),
    "speculative": dict(num_kv_blocks=512, num_speculative_tokens=3),
}


def supported(dtype: str) -> bool:
    return dtype != "bfloat16" or TEST_DEVICE.type != "cuda" or torch.cuda.get_device_capability(TEST_DEVICE)[0] >= 8


@pytest.fixture(scope="module")
def reference(model_dirs):
    model_dir = model_dirs["untied-gqa4"]
    rng = random.Random(0)
    vocab = ModelConfig.from_model_dir(model_dir).vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(1, 90))] for _ in range(12)]
    return model_dir, prompts, Qwen2Model.from_pretrained(model_dir, torch.float32, show_progress=False)


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("dtype", list(TOLERANCE))
def test_half_precision_tokens_are_the_references_best(reference, model_dirs, dtype, setting):
    if not supported(dtype):
        pytest.skip(f"{dtype} needs compute capability 8.0")
    model_dir, prompts, fp32 = reference
    options = dict(SETTINGS[setting])
    if setting == "speculative":
        options["draft_model"] = str(model_dir)  # a draft of the same weights: most guesses kept
    llm = LLM(str(model_dir), dtype=dtype, show_progress=False, **options)
    outputs = run_checked(llm.engine, prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    exact = total = 0
    for prompt, output in zip(prompts, outputs):
        tokens = torch.tensor(prompt + output.token_ids)
        with torch.no_grad():
            logits = fp32.compute_logits(fp32.forward(tokens, torch.arange(len(tokens)), FullAttention()))
        rows = logits[len(prompt) - 1 : -1]
        chosen = rows.gather(1, torch.tensor(output.token_ids)[:, None])[:, 0]
        gaps = (rows.max(dim=1).values - chosen) / (rows.max(dim=1).values - rows.min(dim=1).values)
        assert gaps.max() <= TOLERANCE[dtype], (prompt, output.token_ids, gaps.max())
        exact += int((gaps == 0).sum())
        total += len(gaps)
    assert exact >= 0.9 * total  # almost every token is exactly the reference's argmax
    if setting == "preemption":
        assert llm.stats()["num_preemptions"] > 0
    if setting == "speculative":
        assert llm.stats()["num_accepted_draft_tokens"] > 0
