"""A kernel client for running the chapters unattended (appendix): CI's notebook runs and nbgrader.

``ShortWaitKernelClient`` is jupyter_client's asyncio kernel client whose channel waits are many
short ones. A wait on a channel sometimes misses a message that has already arrived and returns
it only when the wait times out (jupyter/nbclient#312; seen with the chapters' widget cells): a
run of chapter 05 then sat idle for the whole cell timeout (600 s in CI) and went on without an
error. A fresh short wait sees such a message at once, so a missed one costs at most
``ShortWaitChannel.SLICE_S``; the deadline a caller asked for is kept.

``scripts/execute_notebooks.py`` (and so ``scripts/check_student_versions.py``) hands it to
nbclient, and ``nbgrader_config.py`` names it for ``nbgrader validate`` and ``autograde``.
"""

from __future__ import annotations

import time
from queue import Empty
from typing import Any

from jupyter_client.asynchronous import AsyncKernelClient
from jupyter_client.channels import AsyncZMQSocketChannel
from traitlets import Type


class ShortWaitChannel(AsyncZMQSocketChannel):
    """A kernel channel whose long waits are many short ones (see the module docstring)."""

    SLICE_S = 0.5

    # The ignore is jupyter_client's own: its async channel overrides a sync get_msg the same way.
    async def get_msg(self, timeout: float | None = None) -> dict[str, Any]:  # type: ignore[override]
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = self.SLICE_S if deadline is None else max(0.0, min(self.SLICE_S, deadline - time.monotonic()))
            try:
                return await super().get_msg(timeout=left)
            except Empty:
                if deadline is not None and time.monotonic() >= deadline:
                    raise


class ShortWaitKernelClient(AsyncKernelClient):
    shell_channel_class = Type(ShortWaitChannel)
    iopub_channel_class = Type(ShortWaitChannel)
    stdin_channel_class = Type(ShortWaitChannel)
    control_channel_class = Type(ShortWaitChannel)
