"""The server with a draft model (chapters 10 and 11): answers, streamed or not, are the target's
own greedy answers; every block comes back; the metrics count drafts."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from mini_infer import LLM, SamplingParams
from mini_infer.server import BackgroundServer, ServerConfig, build_app
from tests.server_checks import assert_all_blocks_back, wait_idle

pytestmark = pytest.mark.timeout(180)

MODEL = "tiny-test"
ENGINE = {"dtype": "float32", "num_kv_blocks": 256, "max_num_batched_tokens": 256}
MESSAGES = [
    [{"role": "user", "content": "What is 2 + 3?"}],
    [
        {"role": "user", "content": "the cache"},
        {"role": "assistant", "content": "a"},
        {"role": "user", "content": "more"},
    ],
]


@pytest.fixture(scope="module")
def server(model_dirs: dict[str, Path]) -> Iterator[BackgroundServer]:
    engine = dict(ENGINE, draft_model=str(model_dirs["sharded"]), num_speculative_tokens=3)
    config = ServerConfig(
        model=str(model_dirs["tied-gqa2"]), served_model_name=MODEL, engine_kwargs=engine, show_progress=False
    )
    with BackgroundServer(build_app(config)) as srv:
        srv.wait_ready(timeout=60)
        yield srv


def test_greedy_answers_streamed_or_not_are_the_targets(server: BackgroundServer, model_dirs: dict[str, Path]) -> None:
    llm = LLM(str(model_dirs["tied-gqa2"]), show_progress=False, **ENGINE)  # no draft
    expected = llm.chat(MESSAGES, SamplingParams(max_tokens=20, temperature=0.0), use_tqdm=False)
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=30) as client:
        for messages, want in zip(MESSAGES, expected):
            got = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
            assert got.choices[0].message.content == want.text
            assert got.usage is not None and got.usage.completion_tokens == len(want.token_ids)
            chunks = list(
                client.chat.completions.create(
                    model=MODEL, messages=messages, max_tokens=20, temperature=0, stream=True
                )
            )
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    wait_idle(server)
    assert_all_blocks_back(server)
    metrics = {
        line.split()[0]: float(line.split()[1])
        for line in httpx.get(server.base_url + "/metrics").text.splitlines()
        if line.startswith("mini_infer:spec_decode")
    }
    assert metrics["mini_infer:spec_decode_num_draft_tokens_total"] > 0
    assert (
        0
        <= metrics["mini_infer:spec_decode_num_accepted_tokens_total"]
        <= metrics["mini_infer:spec_decode_num_draft_tokens_total"]
    )
