"""The kernel client of unattended notebook runs (mini_infer.course.kernel_client): a missed
message costs one short wait, never the caller's whole timeout, and the caller's deadline holds."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from queue import Empty
from typing import Any

import pytest
from jupyter_client.channels import AsyncZMQSocketChannel

from mini_infer.course.kernel_client import ShortWaitChannel, ShortWaitKernelClient


@dataclass
class MissingWaits:
    arrival: float  # when the message arrives (monotonic seconds)
    waits: list[float] = field(default_factory=list)  # the timeouts the stock wait was asked for


@pytest.fixture
def missing_waits(monkeypatch: pytest.MonkeyPatch) -> MissingWaits:
    """The stock wait replaced by one that behaves as jupyter/nbclient#312 describes: a message that
    arrives while it waits is missed, and the wait returns empty only at its timeout."""
    state = MissingWaits(arrival=time.monotonic() + 0.3)

    async def stock_wait(self: AsyncZMQSocketChannel, timeout: float | None = None) -> dict[str, Any]:
        assert timeout is not None, "a short wait always has a timeout"
        state.waits.append(timeout)
        if time.monotonic() >= state.arrival:
            return {"msg_type": "execute_reply"}
        await asyncio.sleep(timeout)
        raise Empty

    monkeypatch.setattr(AsyncZMQSocketChannel, "get_msg", stock_wait)
    return state


def channel() -> ShortWaitChannel:
    return ShortWaitChannel.__new__(ShortWaitChannel)  # no socket: the stock wait is replaced


def test_a_message_missed_by_a_wait_is_seen_by_the_next_short_one(missing_waits: MissingWaits) -> None:
    start = time.monotonic()
    msg = asyncio.run(channel().get_msg(timeout=600))
    assert msg == {"msg_type": "execute_reply"}
    assert time.monotonic() - start < 0.3 + ShortWaitChannel.SLICE_S + 1.0  # not the 600 s asked for
    assert len(missing_waits.waits) >= 2 and max(missing_waits.waits) <= ShortWaitChannel.SLICE_S


def test_no_message_still_ends_at_the_callers_deadline(missing_waits: MissingWaits) -> None:
    missing_waits.arrival = time.monotonic() + 3600  # nothing arrives
    start = time.monotonic()
    with pytest.raises(Empty):
        asyncio.run(channel().get_msg(timeout=1.2))
    assert 1.2 <= time.monotonic() - start < 2.0
    waits = missing_waits.waits
    assert len(waits) >= 3 and max(waits) <= ShortWaitChannel.SLICE_S and sum(waits) == pytest.approx(1.2, abs=0.1)


def test_every_channel_that_waits_is_a_short_wait_one() -> None:
    client = ShortWaitKernelClient()
    for name in ("shell", "iopub", "stdin", "control"):
        assert getattr(client, f"{name}_channel_class") is ShortWaitChannel, name
