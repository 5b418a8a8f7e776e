"""The coalescing per-request channel.

Determinism: single task, or two tasks handing over through the channel itself.
"""

from __future__ import annotations

import anyio
import anyio.lowlevel
import pytest

from omni_trio._channel import CoalescingChannel
from tests.support.core import BUDGET

pytestmark = pytest.mark.anyio


async def test_newest_items_win() -> None:
    """A full buffer drops its oldest item; the sender never blocks."""
    channel: CoalescingChannel[int] = CoalescingChannel(3)
    for i in range(10):
        channel.send_nowait(i)
    channel.close_send()
    assert [await channel.receive() for _ in range(3)] == [7, 8, 9]
    with pytest.raises(anyio.EndOfStream):
        await channel.receive()


async def test_receiver_waits_for_items() -> None:
    """A receiver blocks until an item or the end of the stream arrives."""
    channel: CoalescingChannel[int] = CoalescingChannel(2)
    got: list[int] = []

    async def receive_all() -> None:
        try:
            while True:
                got.append(await channel.receive())
        except anyio.EndOfStream:
            pass

    with anyio.fail_after(BUDGET):
        async with anyio.create_task_group() as tg:
            tg.start_soon(receive_all)
            await anyio.lowlevel.checkpoint()
            channel.send_nowait(1)
            await anyio.lowlevel.checkpoint()
            channel.send_nowait(2)
            channel.close_send()
    assert got == [1, 2]


async def test_closing_receiver_clears_and_breaks_sender() -> None:
    """close_receive drops the buffer at once; later sends raise BrokenResourceError."""
    channel: CoalescingChannel[object] = CoalescingChannel(4)
    channel.send_nowait(object())
    assert channel.buffered == 1
    channel.close_receive()
    assert channel.buffered == 0
    with pytest.raises(anyio.BrokenResourceError):
        channel.send_nowait(object())
    with pytest.raises(anyio.ClosedResourceError):
        await channel.receive()


async def test_send_after_close_send_is_refused() -> None:
    """A closed sending side refuses more items."""
    channel: CoalescingChannel[int] = CoalescingChannel(1)
    channel.close_send()
    with pytest.raises(anyio.ClosedResourceError):
        channel.send_nowait(1)


def test_buffer_must_hold_something() -> None:
    """A channel without room is a configuration error."""
    with pytest.raises(ValueError, match="max_buffer"):
        CoalescingChannel(0)
