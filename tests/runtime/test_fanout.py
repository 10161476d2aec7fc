"""The one in-process fan-out (runtime/fanout.py): every subscriber gets what is published, each in
a bounded queue; a subscriber that falls behind loses what it had not read and finds one OVERFLOW
marker instead (logged once); publishing never blocks and never raises."""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs

from proxy.runtime.fanout import OVERFLOW, Fanout, Subscription


def drain(subscription: Subscription) -> list:
    out = []
    while not subscription.empty():
        out.append(subscription.get_nowait())
    return out


async def test_every_subscriber_gets_what_its_filter_accepts() -> None:
    fanout: Fanout[int] = Fanout("numbers")
    with fanout.subscribe() as everything, fanout.subscribe(lambda n: n % 2 == 0) as even:
        for n in range(5):
            fanout.publish(n)
        assert drain(everything) == [0, 1, 2, 3, 4]
        assert drain(even) == [0, 2, 4]
    fanout.publish(5)  # nobody subscribed any more: dropped, no error
    assert len(fanout) == 0


async def test_a_slow_subscriber_loses_its_backlog_for_one_overflow_marker_logged_once() -> None:
    fanout: Fanout[int] = Fanout("numbers", limit=3)
    with capture_logs() as logs, fanout.subscribe() as slow, fanout.subscribe() as other:
        for n in range(4):  # the fourth item overflows a queue of three
            fanout.publish(n)
        assert drain(slow) == [OVERFLOW]
        assert drain(other) == [OVERFLOW]
        for n in range(4, 9):
            fanout.publish(n)
        assert drain(slow) == [OVERFLOW, 8]  # 4, 5, 6 filled it, 7 overflowed it again, then 8
        assert slow.overflows == 2
    warnings = [entry for entry in logs if entry["event"] == "fanout_overflow"]
    assert len(warnings) == 2  # once per subscription, not once per overflow
    assert {entry["fanout"] for entry in warnings} == {"numbers"}


async def test_one_reader_can_wait_on_several_fanouts() -> None:
    letters: Fanout[str] = Fanout("letters")
    numbers: Fanout[int] = Fanout("numbers")
    shared = Subscription("both")
    with letters.subscribe(into=shared), numbers.subscribe(into=shared):
        letters.publish("a")
        numbers.publish(1)
        assert [await shared.get(), await shared.get()] == ["a", 1]


async def test_listeners_run_at_publish_and_a_failing_filter_or_listener_never_reaches_the_publisher() -> (
    None
):
    fanout: Fanout[int] = Fanout("numbers")
    seen: list[int] = []
    fanout.listen(seen.append)
    fanout.listen(lambda n: 1 / 0)  # a broken listener
    with fanout.subscribe(lambda n: 1 / n > 0) as subscription:  # fails for 0
        fanout.publish(0)
        fanout.publish(2)
        assert drain(subscription) == [2]
    assert seen == [0, 2]


@pytest.mark.parametrize("limit", [1, 1000])
async def test_the_queue_never_holds_more_than_its_limit(limit: int) -> None:
    fanout: Fanout[int] = Fanout("numbers", limit=limit)
    with fanout.subscribe() as subscription:
        for n in range(limit * 3 + 1):
            fanout.publish(n)
        assert len(drain(subscription)) <= limit
