"""Graceful shutdown (SIGTERM) of synchronous calls: a deadline every waiting handler plans against."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any


class Drain:
    """Once started, synchronous calls have `timeout_s` seconds to finish; then their clients get a
    JSON-RPC error naming the shutdown instead of a cut connection."""

    def __init__(self) -> None:
        self.timeout_s = 0.0
        self._deadline: float | None = None
        self._started = asyncio.Event()
        self._at_deadline: list[Callable[[float], None]] = []
        self._bounds: set[asyncio.Timeout] = set()  # the waits `start` ends early (see `bounded`)

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

    def bounded(self, timeout_s: float) -> DrainBound:
        """`async with drain.bounded(timeout_s):` bounds the block by `timeout_s` seconds, as
        `asyncio.timeout`, but a drain that starts meanwhile ends it early, so the caller re-plans
        against the drain deadline. One timer for the whole block, however many awaits it makes.
        Before a drain, a block whose awaits are ready at once (events already queued) runs even
        when `timeout_s` is 0; once draining, a `timeout_s` of 0 or less raises at entry, so a chatty
        upstream cannot hold the caller past the deadline.

        Raises TimeoutError (at entry or from the block) when the time is up or a drain started."""
        return DrainBound(self._bounds, self._started, timeout_s)


class DrainBound:
    """The async context manager `Drain.bounded` returns: an `asyncio.Timeout` the drain's start
    reschedules to now while the block runs. Enter it once."""

    __slots__ = ("_bounds", "_started", "_timeout_s", "_timeout")

    def __init__(self, bounds: set[asyncio.Timeout], started: asyncio.Event, timeout_s: float) -> None:
        self._bounds = bounds  # the drain's: its start reschedules each to now
        self._started = started
        self._timeout_s = timeout_s
        self._timeout: asyncio.Timeout | None = None

    async def __aenter__(self) -> DrainBound:
        if self._timeout_s <= 0 and self._started.is_set():
            raise TimeoutError
        self._timeout = asyncio.timeout(self._timeout_s)
        await self._timeout.__aenter__()
        if not self._started.is_set():
            self._bounds.add(self._timeout)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any
    ) -> None:
        assert self._timeout is not None
        self._bounds.discard(self._timeout)
        await self._timeout.__aexit__(exc_type, exc, tb)  # turns its own cancellation into TimeoutError
