"""Graceful shutdown (SIGTERM) of synchronous calls: a deadline every waiting handler plans against."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import structlog

log = structlog.get_logger("proxy.runtime")


class Drain:
    """Once started, synchronous calls have `timeout_s` seconds to finish; then their clients get a
    JSON-RPC error naming the shutdown instead of a cut connection."""

    def __init__(self) -> None:
        self.timeout_s = 0.0
        self.cut_short = False  # `cut` ended the drain before its deadline
        # the proxy is cutting what is still open (a replica's streams at the end of its drain,
        # connections aborted after it): a handler cancelled from now on was cut by the shutdown
        self.cutting = False
        self._deadline: float | None = None
        self._started = asyncio.Event()
        self._at_deadline: list[Callable[[str], None]] = []
        self._deadline_call: asyncio.TimerHandle | None = None
        self._passed = False
        self._timers: set[DrainTimer] = set()  # the wake-ups `start` and `cut` bring forward (see `timer`)
        self._streams: set[asyncio.Task[Any]] = set()  # handlers of streams open until their client leaves
        self._streams_cut: set[asyncio.Task[Any]] = set()  # those `close_streams` cut

    def track_stream(self) -> None:
        """Remember the current request handler as a stream that lasts as long as its client (a
        GET stream, `tasks/result`, `subscriptions/listen`): `close_streams` ends it."""
        task = asyncio.current_task()
        if task is not None:
            self._streams.add(task)
            task.add_done_callback(self._streams.discard)

    def close_streams(self) -> int:
        """Cut every tracked stream now, as a lone proxy starts draining (nothing it carries outlives
        the process, and a client reconnects once the proxy is back); returns how many. A replica
        cuts its own at the end of its drain instead (`replicas.node`)."""
        open_streams = [task for task in self._streams if not task.done()]
        for task in open_streams:
            self._streams_cut.add(task)
            task.add_done_callback(self._streams_cut.discard)
            task.cancel()
        return len(open_streams)

    def cut_at_shutdown(self, task: asyncio.Task[Any] | None) -> bool:
        """True when a cancelled handler (`task`) was cut by the shutdown: a stream `close_streams`
        ended, or anything once the proxy is `cutting`."""
        return self.cutting or task in self._streams_cut

    def at_deadline(self, fn: Callable[[str], None]) -> None:
        """Call `fn(reason)` once, when the drain deadline passes or `cut` ends the drain (for work
        that is not a waiting handler: the legacy relay's streams, which the upstream feeds whatever
        the handler does); `reason` is `Drain.reason`."""
        self._at_deadline.append(fn)

    @property
    def reason(self) -> str:
        """Why the drain ended, for the errors of calls it abandons: "drain_timeout, 30 s, passed",
        or the second signal that cut it short."""
        if self.cut_short:
            return "the drain was cut short by a second SIGTERM or SIGINT"
        return f"drain_timeout, {self.timeout_s:g} s, passed"

    def start(self, timeout_s: float) -> None:
        """Begin draining now; `timeout_s` in seconds. The `at_deadline` callbacks run `timeout_s` later
        (at once when `cut` came first)."""
        self.timeout_s = timeout_s
        loop = asyncio.get_running_loop()
        self._deadline = loop.time() + timeout_s
        self._started.set()
        if self.cut_short:
            self.cut_short = False  # (`cut` sets it again as it ends the drain)
            self.cut()
            return
        self._ring_all()
        self._deadline_call = loop.call_later(timeout_s, self._deadline_passed)

    def cut(self) -> None:
        """End the drain now (a second SIGTERM or SIGINT): the deadline is now, every waiting
        handler wakes to abandon its call, and the `at_deadline` callbacks run. Before `start`, the
        drain starts cut; after the deadline, no effect."""
        if self._passed:
            return
        self.cut_short = True
        if self._deadline is None:
            return
        self._deadline = asyncio.get_running_loop().time()
        if self._deadline_call is not None:
            self._deadline_call.cancel()
        self._ring_all()
        self._deadline_passed()

    def _ring_all(self) -> None:
        for timer in list(self._timers):
            timer.ring()  # (each leaves the set as it rings)

    @property
    def abandoned(self) -> str:
        """The message of the -32603 a synchronous call still running when the drain ends gets."""
        if self.cut_short:
            return (
                "proxy shutdown: the drain was cut short by a second SIGTERM or SIGINT and the call was "
                "abandoned"
            )
        return (
            f"proxy shutdown: the call did not finish within drain_timeout ({self.timeout_s:g} s) and was "
            "abandoned"
        )

    def _deadline_passed(self) -> None:
        if self._passed:
            return
        self._passed = True
        for fn in self._at_deadline:
            try:
                fn(self.reason)
            except Exception:  # one server's streams must not keep the others' from their errors
                log.exception("drain_callback_failed", callback=getattr(fn, "__qualname__", repr(fn)))

    @property
    def started(self) -> bool:
        """True once draining began."""
        return self._started.is_set()

    def remaining(self) -> float | None:
        """Seconds left before the drain deadline (0.0 once passed), or None when not draining."""
        if self._deadline is None:
            return None
        return max(0.0, self._deadline - asyncio.get_running_loop().time())

    def cap(self, wait_s: float) -> float:
        """`wait_s` (s), or the seconds left before the drain deadline when that is less."""
        remaining = self.remaining()
        return wait_s if remaining is None else min(wait_s, remaining)

    def timer(self, timeout_s: float, fire: Callable[[DrainTimer], None]) -> DrainTimer:
        """A wake-up for a waiting handler: `fire(timer)` is called once, `timeout_s` seconds from now
        (at the next loop iteration when 0 or less) or at once when a drain starts or is cut first,
        so the handler re-plans against the drain deadline; not at all after `timer.cancel()`.

        A handler waits on its own queue of events and `fire` puts a wake-up in it: the timer
        cancels nothing the handler awaits (a write to a slow client stays whole), one timer serves
        any number of events relayed before it rings, and `done` tells a handler busy relaying
        that it rang."""
        timer = DrainTimer(fire, self._timers, timeout_s)
        if not self._passed:
            self._timers.add(timer)
        return timer


class DrainTimer:
    """One wake-up of `Drain.timer`: `ring()` fires it now, `cancel()` drops it; each at most once."""

    __slots__ = ("_fire", "_timers", "_handle", "done")

    def __init__(self, fire: Callable[[DrainTimer], None], timers: set[DrainTimer], timeout_s: float) -> None:
        self._fire = fire
        self._timers = timers  # the drain's: a drain that starts rings every one in it
        self.done = False
        self._handle = asyncio.get_running_loop().call_later(max(0.0, timeout_s), self.ring)

    def ring(self) -> None:
        """Fire now, unless fired or cancelled already."""
        if not self.done:
            self.cancel()
            self._fire(self)

    def cancel(self) -> None:
        """Never fire (no effect once fired)."""
        if not self.done:
            self.done = True
            self._handle.cancel()
            self._timers.discard(self)
