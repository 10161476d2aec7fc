"""One in-process fan-out: what one part publishes, every open subscriber gets, each in a bounded
queue of its own, and nobody who publishes ever waits.

Used for task changes (status push to `tasks/result` and `subscriptions/listen` streams, the
console's event stream) and for an upstream's server-wide notifications (list changes relayed on
`subscriptions/listen`).

The overflow policy, the same for every subscriber: one that falls `limit` items behind loses
every item it has not read yet and finds one `OVERFLOW` marker in their place, so it knows to
re-read what it shows (a task's current record, the lists) instead of trusting its queue. The
first overflow of each subscription is logged (a warning naming the fan-out and how many items
were dropped); later ones of the same subscription are only counted.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

import structlog

log = structlog.get_logger("proxy.fanout")

T = TypeVar("T")
DEFAULT_LIMIT = 1000  # items a subscriber may fall behind before it overflows


class Overflow:
    """The marker a subscriber finds in place of the items it lost (see the module docstring)."""

    def __repr__(self) -> str:
        return "OVERFLOW"


OVERFLOW = Overflow()


class Subscription(Generic[T]):
    """One subscriber's bounded queue of items (or `OVERFLOW`), fed by one fan-out or several.

    `limit` is how many unread items it holds before it overflows; `name` names it in the log.
    """

    def __init__(self, name: str, limit: int = DEFAULT_LIMIT) -> None:
        self.name = name
        self._queue: asyncio.Queue[T | Overflow] = asyncio.Queue(limit)
        self.overflows = 0  # times this subscriber overflowed

    def offer(self, item: T) -> None:
        """Queue `item` without waiting; past the limit, apply the overflow policy."""
        try:
            self._queue.put_nowait(item)
        except asyncio.QueueFull:
            dropped = self._queue.qsize() + 1
            self._replace_with_overflow()
            self.overflows += 1
            if self.overflows == 1:
                log.warning("fanout_overflow", fanout=self.name, dropped=dropped)

    def missed(self) -> None:
        """Something meant for this subscriber was lost upstream of the fan-out: queue one
        `OVERFLOW` marker after what is waiting, so the reader resyncs."""
        try:
            self._queue.put_nowait(OVERFLOW)
        except asyncio.QueueFull:
            self._replace_with_overflow()

    def _replace_with_overflow(self) -> None:
        """Drop everything waiting; leave one `OVERFLOW` marker in its place."""
        while not self._queue.empty():
            self._queue.get_nowait()
        self._queue.put_nowait(OVERFLOW)

    async def get(self) -> T | Overflow:
        """The next item, waiting for one (unbounded: callers bound the wait)."""
        return await self._queue.get()

    def get_nowait(self) -> T | Overflow:
        """The next item; raises asyncio.QueueEmpty when there is none."""
        return self._queue.get_nowait()

    def empty(self) -> bool:
        """True when nothing is waiting to be read."""
        return self._queue.empty()


class Fanout(Generic[T]):
    """Publishes items of one kind to every open subscription that accepts them.

    `name` names it in the log; `limit` is each subscription's queue bound. `listen(fn)` adds a
    synchronous listener, called with every item as it is published (for in-process caches that
    must forget something at once; a listener must not block and never sees an overflow).
    """

    def __init__(self, name: str, *, limit: int = DEFAULT_LIMIT) -> None:
        self.name = name
        self.limit = limit
        self._subscribers: dict[Subscription[T], Callable[[T], bool] | None] = {}
        self._listeners: list[Callable[[T], None]] = []

    def __len__(self) -> int:
        """Open subscriptions."""
        return len(self._subscribers)

    def listen(self, listener: Callable[[T], None]) -> None:
        """Call `listener(item)` for every item published from now on."""
        self._listeners.append(listener)

    def publish(self, item: T) -> None:
        """Offer `item` to every subscription whose filter accepts it. Never blocks, never raises:
        a listener or filter that fails is logged and skipped (publishers sit in commit paths)."""
        for listener in self._listeners:
            try:
                listener(item)
            except Exception:
                log.exception("fanout_listener_failed", fanout=self.name)
        for subscription, accept in list(self._subscribers.items()):
            try:
                if accept is None or accept(item):
                    subscription.offer(item)
            except Exception:
                log.exception("fanout_filter_failed", fanout=self.name)

    def gap(self) -> None:
        """Items may have been lost before they reached this fan-out (a change feed was down):
        every subscription gets one `OVERFLOW` marker, so each reader resyncs. Listeners are not
        called (they see items only)."""
        for subscription in list(self._subscribers):
            subscription.missed()
        if self._subscribers:
            log.info("fanout_gap", fanout=self.name, subscriptions=len(self._subscribers))

    @contextlib.contextmanager
    def subscribe(
        self, accept: Callable[[T], bool] | None = None, *, into: Subscription[T] | None = None
    ) -> Iterator[Subscription[T]]:
        """A subscription that gets what is published while the block runs (only the items
        `accept` returns True for, when given); `into` shares an existing subscription's queue, so
        one reader waits on several fan-outs."""
        subscription = into if into is not None else Subscription[T](self.name, self.limit)
        self._subscribers[subscription] = accept
        try:
            yield subscription
        finally:
            self._subscribers.pop(subscription, None)
