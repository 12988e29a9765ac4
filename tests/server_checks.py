"""Looking inside a running ``BackgroundServer``'s engine from a test (shared by the server tests).

Everything runs on the engine's own thread (``AsyncEngine.call``), between steps, so the test
never races the engine loop.
"""

from __future__ import annotations

import time
from typing import Any

from mini_infer.engine import LLMEngine
from mini_infer.server.background import BackgroundServer


def on_engine(server: BackgroundServer, fn: Any) -> Any:
    return server.app.state.server.engine.call(fn).result(timeout=30)


def wait_idle(server: BackgroundServer, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while on_engine(server, lambda e: e.has_unfinished_requests()):
        assert time.monotonic() < deadline, "requests still in the engine"
        time.sleep(0.05)


def assert_all_blocks_back(server: BackgroundServer) -> None:
    """Every block is free or held by the prefix cache alone, and the scheduler agrees."""

    def check(engine: LLMEngine) -> tuple[int, int, int]:
        engine.scheduler.check_invariants()
        cached = engine.scheduler.blocks.prefix_cache.num_cached_blocks if engine.scheduler.blocks.prefix_cache else 0
        return engine.scheduler.blocks.pool.num_free_blocks, cached, engine.scheduler.blocks.pool.num_blocks

    free, cached, total = on_engine(server, check)
    assert free + cached == total
