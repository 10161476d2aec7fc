"""The console's change stream: store commits of this process, fanned out as server-sent events.

The hub subscribes once to `TaskStore.add_remote_listener` (changes this proxy process commits,
and on a Redis store those of every replica; the operator CLI's writes to a diskcache directory
from another process are not seen) and offers each change to every open
stream through a bounded queue. A stream that falls `QUEUE_MAX` changes behind gets one
`resync` event instead of the changes it missed (the page then reloads its list).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator
from typing import Any

import structlog
from aiohttp import web

from proxy.console.views import row
from proxy.tasks.model import TaskRecord, TaskStatus
from proxy.tasks.store import TaskStore

log = structlog.get_logger("proxy.console")

QUEUE_MAX = 1000  # changes one stream may lag behind before it gets `resync`
MAX_STREAMS = 64  # open console streams at most (more: 503)
WRITE_TIMEOUT_S = 30.0  # a reader that takes longer than this (s) to accept one write loses its stream
RESYNC: dict[str, Any] = {"event": "resync"}
CLOSE: dict[str, Any] = {"event": "close"}


class TooManyStreamsError(Exception):
    """Raised by `ConsoleHub.subscribe` when MAX_STREAMS streams are already open."""


class ConsoleHub:
    """Open console event streams and the store listener feeding them."""

    def __init__(self) -> None:
        self._queues: set[asyncio.Queue[dict[str, Any]]] = set()
        self._attached: set[int] = set()
        self.closed = False

    def attach(self, store: TaskStore) -> None:
        """Listen to `store`'s commits (once per store object)."""
        if id(store) not in self._attached:
            self._attached.add(id(store))
            store.add_remote_listener(self.publish)  # with Redis: every replica's changes

    def publish(self, before: TaskStatus | None, record: TaskRecord) -> None:
        """Offer one committed change to every open stream (never blocks)."""
        if not self._queues:
            return
        try:
            message = {
                "event": "task",
                "data": {**row(record), "previousStatus": before.value if before else None},
            }
            for queue in list(self._queues):
                try:
                    queue.put_nowait(message)
                except asyncio.QueueFull:
                    while not queue.empty():
                        queue.get_nowait()
                    queue.put_nowait(RESYNC)
        except Exception:  # called inside the store's commit path: never let the console break a write
            log.exception("console_publish_failed", task_id=record.task_id)

    @contextlib.contextmanager
    def subscribe(self) -> Iterator[asyncio.Queue[dict[str, Any]]]:
        """A bounded queue of changes while the block runs. Raises TooManyStreamsError."""
        if len(self._queues) >= MAX_STREAMS:
            raise TooManyStreamsError(f"{MAX_STREAMS} console event streams are already open")
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue(maxsize=QUEUE_MAX)
        self._queues.add(queue)
        try:
            yield queue
        finally:
            self._queues.discard(queue)

    async def close(self, _app: web.Application | None = None) -> None:
        """End every open stream (on shutdown, before aiohttp waits for handlers)."""
        self.closed = True
        for queue in list(self._queues):
            while not queue.empty():
                queue.get_nowait()
            queue.put_nowait(CLOSE)

    async def stream(self, request: web.Request, *, keepalive_s: float) -> web.StreamResponse:
        """Serve `text/event-stream`: `ready` once, then `task` (a list row plus `previousStatus`)
        per change and `resync` after an overflow; a `: keepalive` comment every `keepalive_s` (s).
        Every wait is bounded: a write the reader does not take within WRITE_TIMEOUT_S ends the stream."""
        with self.subscribe() as queue:
            response = web.StreamResponse(
                headers={
                    "Content-Type": "text/event-stream",
                    "Cache-Control": "no-store",
                    "X-Accel-Buffering": "no",
                }
            )
            await response.prepare(request)
            try:
                await _send(response, b"retry: 2000\n\n" + _event({"event": "ready", "data": {}}))
                while not self.closed:
                    try:
                        message = await asyncio.wait_for(queue.get(), timeout=keepalive_s)
                    except TimeoutError:
                        await _send(response, b": keepalive\n\n")
                        continue
                    if message is CLOSE:
                        break
                    await _send(response, _event(message))
            except TimeoutError:
                log.info(
                    "console_stream_dropped",
                    reason=f"the reader took more than {WRITE_TIMEOUT_S:g} s to accept a write",
                )
            return response


async def _send(response: web.StreamResponse, data: bytes) -> None:
    await asyncio.wait_for(response.write(data), timeout=WRITE_TIMEOUT_S)


def _event(message: dict[str, Any]) -> bytes:
    data = json.dumps(message.get("data", {}), separators=(",", ":"))
    return f"event: {message['event']}\ndata: {data}\n\n".encode()
