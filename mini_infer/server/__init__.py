"""``mini-infer serve``: an OpenAI-compatible HTTP server over the engine (chapter 11).

The pieces, in the order a request meets them:

* ``app``: FastAPI routes, API keys, OpenAI-shaped errors;
* ``http``: bodies read under a size limit, server-sent events, noticing clients that leave;
* ``protocol``: the OpenAI request models (strict: unknown or unsupported fields are refused)
  and response shapes; ``validation_errors``: which of pydantic's errors a 400 names;
  ``response_format``: the fields that constrain the output (JSON Schema,
  JSON mode, vLLM's ``structured_outputs``), enforced by constrained decoding (chapter 09b);
* ``chat`` and ``completions``: the two generation endpoints; ``tool_calls`` turns the model's
  ``<tool_call>`` blocks into OpenAI tool calls, streaming included;
* ``serving``: what the endpoints share: state, checks, and the two ways to answer (JSON or a stream);
* ``async_engine``: the one thread that owns the ``LLMEngine``, and the queues to it;
* ``metrics``: Prometheus metrics with vLLM's names;
* ``cli``: ``mini-infer serve``; ``background``: a server in a thread, for tests and notebooks;
  ``bench_overhead``: the server's throughput against ``LLM.generate``; ``soak``: a bounded,
  seeded soak of a live server on 127.0.0.1, with injected faults and end checks.

Invariants: the engine thread alone touches the engine; every request ends with its KV blocks
freed (finished, aborted when its client leaves, failed on its own (``mini_infer.faults``: a 500
or an error event, the server going on), or failed when the engine dies); nothing blocks the event
loop.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Here rather than in ``http``, so that ``mini-infer --help`` can show it without importing the
# server's dependencies (FastAPI, uvicorn), which are an optional extra.
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024

if TYPE_CHECKING:
    from mini_infer.server.app import build_app
    from mini_infer.server.async_engine import AsyncEngine
    from mini_infer.server.background import BackgroundServer
    from mini_infer.server.serving import ServerConfig

_EXPORTS = {
    "AsyncEngine": "mini_infer.server.async_engine",
    "BackgroundServer": "mini_infer.server.background",
    "ServerConfig": "mini_infer.server.serving",
    "build_app": "mini_infer.server.app",
}
__all__ = ["DEFAULT_MAX_BODY_BYTES", "AsyncEngine", "BackgroundServer", "ServerConfig", "build_app"]


def __getattr__(name: str) -> Any:
    # Imported on first use, for the same reason as above.
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'mini_infer.server' has no attribute {name!r}")
