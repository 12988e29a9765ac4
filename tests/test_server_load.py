"""The server under load: many concurrent streams, and many clients that leave (chapter 11).

The invariants under test: every stream gets exactly its greedy answer while the continuous
batcher serves them together, and every request a client abandons is aborted so that all its
KV blocks come back (with the prefix cache: free + cached == total).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from mini_infer import LLM, SamplingParams
from mini_infer.server import BackgroundServer, ServerConfig, build_app
from tests.server_checks import assert_all_blocks_back, on_engine, wait_idle

pytestmark = pytest.mark.timeout(180)  # a hung socket or thread fails its test, not the run

MODEL = "tiny-load"
ENGINE = {"dtype": "float32", "num_kv_blocks": 1024, "max_num_batched_tokens": 512}


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[BackgroundServer]:
    config = ServerConfig(model=str(tiny_model_dir), served_model_name=MODEL, engine_kwargs=ENGINE, show_progress=False)
    with BackgroundServer(build_app(config)) as srv:
        srv.wait_ready(timeout=60)
        yield srv


def async_client(server: BackgroundServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_64_concurrent_streams_all_get_their_greedy_answer(server: BackgroundServer, tiny_model_dir: Path) -> None:
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(4, 40))] for _ in range(16)] * 4
    llm = LLM(str(tiny_model_dir), show_progress=False, **ENGINE)
    expected = [
        o.text
        for o in llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True), use_tqdm=False)
    ]
    on_engine(server, lambda e: setattr(e, "step_log", []))

    async def one(client: openai.AsyncOpenAI, prompt: list[int]) -> tuple[str, str | None, int]:
        stream = await client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
        text, reason, chunks = "", None, 0
        async for chunk in stream:
            chunks += 1
            text += chunk.choices[0].text
            reason = chunk.choices[0].finish_reason or reason
        return text, reason, chunks

    async def run() -> list[tuple[str, str | None, int]]:
        async with async_client(server) as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, p) for p in prompts)), timeout=90)

    results = asyncio.run(run())
    steps = on_engine(server, lambda e: e.step_log)
    on_engine(server, lambda e: setattr(e, "step_log", None))
    assert [r[0] for r in results] == expected
    assert all(r[1] == "length" for r in results)
    # Streamed (a client that falls behind gets several tokens in one chunk, so not always 16).
    assert sum(r[2] for r in results) > len(results)
    # The continuous batcher served them together: many sequences sampled in one step.
    assert max(s.num_logits for s in steps) >= 16


def test_100_cancelled_streams_free_every_block(server: BackgroundServer) -> None:
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(8, 60))] for _ in range(100)]
    max_tokens = 400
    before = on_engine(server, lambda e: e.stats()["generated_tokens"])

    async def leave_early(client: openai.AsyncOpenAI, prompt: list[int], read: int) -> int:
        stream = await client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=max_tokens, stream=True, extra_body={"ignore_eos": True}
        )
        seen = 0
        async for _ in stream:
            seen += 1
            if seen >= read:
                break
        await stream.close()  # the connection closes mid-stream: the server must abort
        return seen

    async def run() -> list[int]:
        async with async_client(server) as client:
            jobs = (leave_early(client, p, 1 + i % 5) for i, p in enumerate(prompts))
            return await asyncio.wait_for(asyncio.gather(*jobs), timeout=90)

    seen = asyncio.run(run())
    assert all(s >= 1 for s in seen)

    wait_idle(server, timeout=30)
    assert_all_blocks_back(server)
    generated = on_engine(server, lambda e: e.stats()["generated_tokens"]) - before
    assert generated < len(prompts) * max_tokens  # they were aborted, not run to the end

    # And the server is still itself: a new request is answered at once.
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=10) as client:
        started = time.monotonic()
        got = client.completions.create(model=MODEL, prompt="hello", max_tokens=4)
        assert time.monotonic() - started < 5
    assert got.choices[0].text is not None and got.usage is not None and got.usage.completion_tokens >= 1
