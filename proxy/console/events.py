"""The console's change stream: the task service's fan-out of committed changes, as server-sent events.

Each open stream subscribes to `TaskService.changes` (changes this proxy process commits, and on a
Redis store those of every replica; the operator CLI's writes to a diskcache directory from
another process are not seen). A stream that falls behind by the fan-out's limit gets one `resync`
event instead of the changes it missed (the page then reloads its list).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import structlog
from aiohttp import web

from proxy.console.views import row
from proxy.protocol.sse import SSE_HEADERS
from proxy.runtime.fanout import Fanout, Subscription
from proxy.tasks.types import TaskChange, TaskEvent

log = structlog.get_logger("proxy.console")

MAX_STREAMS = 64  # open console streams at most (more: 503)
SESSION_RECHECK_S = 2.0  # how often (s) a session's stream asks whether it is still signed in
WRITE_TIMEOUT_S = 30.0  # a reader that takes longer than this (s) to accept one write loses its stream
RESYNC: dict[str, Any] = {"event": "resync"}
CLOSE: dict[str, Any] = {"event": "close"}


class TooManyStreamsError(Exception):
    """Raised by `ConsoleHub.subscribe` when MAX_STREAMS streams are already open."""


class ConsoleHub:
    """The open console event streams: at most MAX_STREAMS, all ended at once on shutdown."""

    def __init__(self) -> None:
        self._streams: set[Subscription[Any]] = set()
        self.closed = False

    @contextlib.contextmanager
    def subscribe(self, changes: Fanout[TaskEvent]) -> Iterator[Subscription[Any]]:
        """A subscription to the committed changes of `changes` while the block runs.

        Raises TooManyStreamsError past MAX_STREAMS."""
        if len(self._streams) >= MAX_STREAMS:
            raise TooManyStreamsError(f"{MAX_STREAMS} console event streams are already open")
        with changes.subscribe(lambda event: isinstance(event, TaskChange)) as subscription:
            self._streams.add(subscription)
            try:
                yield subscription
            finally:
                self._streams.discard(subscription)

    async def close(self, _app: web.Application | None = None) -> None:
        """End every open stream (on shutdown, before aiohttp waits for handlers)."""
        self.closed = True
        for subscription in list(self._streams):
            subscription.offer(CLOSE)

    async def stream(
        self,
        request: web.Request,
        changes: Fanout[TaskEvent],
        *,
        keepalive_s: float,
        signed_in: Callable[[], Awaitable[bool]] | None = None,
    ) -> web.StreamResponse:
        """Serve `text/event-stream`: `ready` once, then `task` (a list row plus `previousStatus`)
        per change and `resync` after an overflow (the fan-out's `OVERFLOW`); a `: keepalive` comment every
        `keepalive_s` (s). `signed_in` (for a session, not a bearer token) is asked again at most
        every SESSION_RECHECK_S (s), before anything is sent: once it says no (signed out, expired,
        token rotated), the stream ends.
        Every wait is bounded: a write the reader does not take within WRITE_TIMEOUT_S ends the stream.
        Raises TooManyStreamsError past MAX_STREAMS."""
        loop = asyncio.get_running_loop()
        checked = sent = loop.time()
        wait_s = keepalive_s if signed_in is None else min(keepalive_s, SESSION_RECHECK_S)
        with self.subscribe(changes) as subscription:
            response = web.StreamResponse(headers={**SSE_HEADERS, "Cache-Control": "no-store"})
            await response.prepare(request)
            try:
                await _send(response, b"retry: 2000\n\n" + _event({"event": "ready", "data": {}}))
                while not self.closed:
                    try:
                        item = await asyncio.wait_for(subscription.get(), timeout=wait_s)
                    except TimeoutError:
                        item = None
                    if signed_in is not None and loop.time() - checked >= SESSION_RECHECK_S:
                        checked = loop.time()
                        if not await signed_in():
                            log.info("console_stream_ended", reason="the session ended")
                            break
                    if item is None:
                        if loop.time() - sent >= keepalive_s:
                            await _send(response, b": keepalive\n\n")
                            sent = loop.time()
                        continue
                    if item is CLOSE:
                        break
                    await _send(response, _event(_message(item) if isinstance(item, TaskChange) else RESYNC))
                    sent = loop.time()
            except TimeoutError:
                reason = f"the reader took more than {WRITE_TIMEOUT_S:g} s to accept a write"
                log.info("console_stream_dropped", reason=reason)
            return response


def _message(change: TaskChange) -> dict[str, Any]:
    before = change.before.value if change.before else None
    return {"event": "task", "data": {**row(change.record), "previousStatus": before}}


async def _send(response: web.StreamResponse, data: bytes) -> None:
    await asyncio.wait_for(response.write(data), timeout=WRITE_TIMEOUT_S)


def _event(message: dict[str, Any]) -> bytes:
    data = json.dumps(message.get("data", {}), separators=(",", ":"))
    return f"event: {message['event']}\ndata: {data}\n\n".encode()
