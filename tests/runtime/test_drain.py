"""The drain deadline (runtime/drain.py): a block bounded by `Drain.bounded` ends early when a drain
starts, even one whose own timer fired in the same loop iteration; once draining, a block with no
time left ends at entry, whatever is queued."""

from __future__ import annotations

import asyncio

import pytest

from proxy.runtime.drain import Drain


async def _wait(drain: Drain, timeout_s: float) -> None:
    async with drain.bounded(timeout_s):
        await asyncio.Event().wait()


async def test_a_starting_drain_ends_a_long_wait_early() -> None:
    drain = Drain()
    waiting = asyncio.create_task(_wait(drain, 60.0))
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
    waiting = asyncio.create_task(_wait(drain, 0.0))
    await asyncio.sleep(0)  # the waiting task entered its bound, whose timer is now queued
    await asyncio.sleep(0)  # the timer ran (the bound is expiring); the waiting task has not resumed
    drain.start(0.01)  # must not trip over the expiring bound
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(waiting, timeout=5.0)
    await asyncio.wait_for(deadline_passed.wait(), timeout=5.0)
    assert fired == [0.01]


async def test_one_bound_covers_many_awaits_until_its_time_is_up() -> None:
    drain = Drain()
    queue: asyncio.Queue[int] = asyncio.Queue()
    got: list[int] = []

    async def feed() -> None:
        for i in range(5):
            await asyncio.sleep(0.001)
            queue.put_nowait(i)

    feeding = asyncio.create_task(feed())
    with pytest.raises(TimeoutError):
        async with drain.bounded(0.2):
            while True:
                got.append(await queue.get())
    await feeding
    assert got == [0, 1, 2, 3, 4]


async def test_once_draining_a_block_with_no_time_left_ends_at_entry() -> None:
    drain = Drain()
    drain.start(0.0)
    queue: asyncio.Queue[int] = asyncio.Queue()
    queue.put_nowait(1)
    with pytest.raises(TimeoutError):
        async with drain.bounded(0.0):
            await queue.get()
    assert queue.qsize() == 1  # not taken: the caller answers with the shutdown error instead


async def test_before_a_drain_an_event_already_queued_is_taken_with_no_time_left() -> None:
    drain = Drain()
    queue: asyncio.Queue[int] = asyncio.Queue()
    queue.put_nowait(1)
    async with drain.bounded(0.0):
        assert await queue.get() == 1
