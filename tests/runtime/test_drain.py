"""The drain deadline (runtime/drain.py): a wait bounded by `Drain.wait_for` ends early when a drain
starts, even one whose own timer fired in the same loop iteration; once draining, a wait with no
time left ends at once, whatever is queued."""

from __future__ import annotations

import asyncio

import pytest

from proxy.runtime.drain import Drain


async def test_a_starting_drain_ends_a_long_wait_early() -> None:
    drain = Drain()
    waiting = asyncio.create_task(drain.wait_for(asyncio.Event().wait(), timeout=60.0))
    await asyncio.sleep(0)  # the wait is registered
    drain.start(5.0)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(waiting, timeout=5.0)
    assert 4.9 < (drain.remaining() or 0.0) <= 5.0


async def test_start_skips_a_wait_whose_timer_fired_in_the_same_iteration() -> None:
    drain = Drain()
    fired: list[float] = []
    drain.at_deadline(fired.append)
    deadline_passed = asyncio.Event()
    drain.at_deadline(lambda _: deadline_passed.set())
    waiting = asyncio.create_task(drain.wait_for(asyncio.Event().wait(), timeout=0.0))
    await asyncio.sleep(0)  # the waiting task entered its bound, whose timer is now queued
    await asyncio.sleep(0)  # the timer ran (the bound is expiring); the waiting task has not resumed
    drain.start(0.01)  # must not trip over the expiring bound
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(waiting, timeout=5.0)
    await asyncio.wait_for(deadline_passed.wait(), timeout=5.0)
    assert fired == [0.01]


async def test_once_draining_a_wait_with_no_time_left_ends_at_once() -> None:
    drain = Drain()
    drain.start(0.0)
    queue: asyncio.Queue[int] = asyncio.Queue()
    queue.put_nowait(1)
    with pytest.raises(TimeoutError):
        await drain.wait_for(queue.get(), timeout=0.0)
    assert queue.qsize() == 1  # not taken: the caller answers with the shutdown error instead


async def test_before_a_drain_an_event_already_queued_is_returned_with_no_time_left() -> None:
    drain = Drain()
    queue: asyncio.Queue[int] = asyncio.Queue()
    queue.put_nowait(1)
    assert await drain.wait_for(queue.get(), timeout=0.0) == 1
