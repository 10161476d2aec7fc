"""The drain deadline (runtime/drain.py): a handler's wake-up (`Drain.timer`) rings after its time,
or at once when a drain starts first, exactly once, and never after it was cancelled."""

from __future__ import annotations

import asyncio

from proxy.runtime.drain import Drain, DrainTimer


async def test_a_wake_up_rings_once_after_its_time() -> None:
    drain = Drain()
    rung: asyncio.Queue[DrainTimer] = asyncio.Queue()
    timer = drain.timer(0.02, rung.put_nowait)
    assert await asyncio.wait_for(rung.get(), timeout=5.0) is timer
    timer.ring()  # already rung: nothing more
    await asyncio.sleep(0.03)
    assert rung.empty() and timer.done


async def test_a_starting_drain_rings_every_wake_up_at_once() -> None:
    drain = Drain()
    rung: list[DrainTimer] = []
    timers = [drain.timer(60.0, rung.append) for _ in range(3)]
    cancelled = drain.timer(60.0, rung.append)
    cancelled.cancel()
    drain.start(5.0)
    assert len(rung) == 3 and set(rung) == set(timers)  # in start(); the cancelled one not at all
    assert 4.9 < (drain.remaining() or 0.0) <= 5.0


async def test_a_wake_up_made_while_draining_rings_after_its_own_time() -> None:
    drain = Drain()
    deadline_passed = asyncio.Event()
    drain.at_deadline(lambda _: deadline_passed.set())
    drain.start(0.01)
    rung: asyncio.Queue[DrainTimer] = asyncio.Queue()
    timer = drain.timer(drain.remaining() or 0.0, rung.put_nowait)
    assert await asyncio.wait_for(rung.get(), timeout=5.0) is timer
    await asyncio.wait_for(deadline_passed.wait(), timeout=5.0)


async def test_a_zero_wake_up_comes_after_what_is_already_queued() -> None:
    drain = Drain()
    drain.start(0.0)
    events: asyncio.Queue[object] = asyncio.Queue()
    events.put_nowait("notification")
    timer = drain.timer(0.0, events.put_nowait)
    assert await events.get() == "notification"
    assert await asyncio.wait_for(events.get(), timeout=5.0) is timer


async def test_a_handler_busy_relaying_sees_its_wake_up_rang() -> None:
    drain = Drain()
    events: asyncio.Queue[object] = asyncio.Queue()
    timer = drain.timer(60.0, events.put_nowait)
    for _ in range(3):
        events.put_nowait("notification")
    assert not timer.done
    drain.start(5.0)  # rings: the wake-up goes behind the three notifications
    assert timer.done and events.qsize() == 4


async def test_a_cut_ends_the_drain_now_and_once() -> None:
    drain = Drain()
    reasons: list[str] = []
    drain.at_deadline(reasons.append)
    drain.start(0.05)
    rung: list[DrainTimer] = []
    timer = drain.timer(drain.remaining() or 0.0, rung.append)  # a handler waiting while draining
    drain.cut()
    assert rung == [timer] and drain.remaining() == 0.0 and drain.cut_short
    assert reasons == ["the drain was cut short by a second SIGTERM or SIGINT"]
    drain.cut()
    await asyncio.sleep(0.1)  # past the first deadline: the callbacks do not run again
    assert reasons == ["the drain was cut short by a second SIGTERM or SIGINT"]


async def test_the_deadline_passes_once_with_its_reason() -> None:
    drain = Drain()
    reasons: list[str] = []
    drain.at_deadline(reasons.append)
    drain.start(0.01)
    await asyncio.sleep(0.1)
    drain.cut()  # after the deadline: nothing
    assert reasons == ["drain_timeout, 0.01 s, passed"] and not drain.cut_short


async def test_a_cut_before_the_start_makes_the_drain_start_cut() -> None:
    drain = Drain()
    reasons: list[str] = []
    drain.at_deadline(reasons.append)
    rung: list[DrainTimer] = []
    timer = drain.timer(60.0, rung.append)
    drain.cut()  # a second signal the loop handled before the drain began
    assert not drain.started and not rung and not reasons
    drain.start(30.0)
    assert drain.cut_short and drain.remaining() == 0.0 and rung == [timer]
    assert reasons == ["the drain was cut short by a second SIGTERM or SIGINT"]
