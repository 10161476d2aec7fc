"""Graceful shutdown (SIGTERM) of synchronous calls: a deadline every waiting handler plans against."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any


class Drain:
    """Once started, synchronous calls have `timeout_s` seconds to finish; then their clients get a
    JSON-RPC error naming the shutdown instead of a cut connection."""

    def __init__(self) -> None:
        self.timeout_s = 0.0
        self._deadline: float | None = None
        self._started = asyncio.Event()
        self._at_deadline: list[Callable[[float], None]] = []
        self._bounds: set[asyncio.Timeout] = set()  # the waits `start` ends early (see `wait_for`)

    def at_deadline(self, fn: Callable[[float], None]) -> None:
        """Call `fn(timeout_s)` when the drain deadline passes (for work that is not a waiting handler: the
        legacy relay's streams, which the upstream feeds whatever the handler does)."""
        self._at_deadline.append(fn)

    def start(self, timeout_s: float) -> None:
        """Begin draining now; `timeout_s` in seconds. The `at_deadline` callbacks run `timeout_s` later."""
        self.timeout_s = timeout_s
        loop = asyncio.get_running_loop()
        self._deadline = loop.time() + timeout_s
        self._started.set()
        for bound in self._bounds:
            # A bound whose timer fired already (its task not yet resumed) ends its wait by itself,
            # and cannot be rescheduled; the others end at the next loop iteration.
            if not bound.expired():
                bound.reschedule(loop.time())
        self._bounds.clear()
        for fn in self._at_deadline:
            loop.call_later(timeout_s, fn, timeout_s)

    @property
    def started(self) -> bool:
        """True once draining began."""
        return self._started.is_set()

    def remaining(self) -> float | None:
        """Seconds left before the drain deadline (0.0 once passed), or None when not draining."""
        if self._deadline is None:
            return None
        return max(0.0, self._deadline - asyncio.get_running_loop().time())

    async def wait_for(self, awaitable: Awaitable[Any], timeout: float) -> Any:
        """`awaitable` bounded by `timeout` (s), as `asyncio.wait_for`, but a drain that starts meanwhile
        ends the wait early, so the caller re-plans against the drain deadline. Awaited in the
        caller's own task (no task of its own). Before a drain, an awaitable that is ready at once
        (an event already queued) is returned even when `timeout` is 0; once draining, a `timeout` of
        0 or less raises at once, so a chatty upstream cannot hold the caller past the deadline.

        Raises TimeoutError when the time is up or a drain started; cancelling the caller cancels
        `awaitable`.
        """
        if timeout <= 0 and self._started.is_set():
            if asyncio.iscoroutine(awaitable):
                awaitable.close()  # never awaited: no "was never awaited" warning
            raise TimeoutError
        async with asyncio.timeout(timeout) as bound:
            if self._started.is_set():
                return await awaitable
            self._bounds.add(bound)
            try:
                return await awaitable
            finally:
                self._bounds.discard(bound)
