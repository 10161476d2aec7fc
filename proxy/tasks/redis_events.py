"""Change events of the Redis task store: local waiters, and changes committed by other replicas.

Every committed create or change publishes one message on the store's channel (`P changes`, see
`redis_keys.change_message`) inside the same atomic script that writes it. `ChangeFeed` keeps one
pub/sub connection per store object, reconnecting (every RECONNECT_S seconds) after Redis errors,
and:

- wakes `wait_for_change` waiters of the task (its own commits wake them at once, without the
  round trip);
- calls the *cluster* listeners (`RedisTaskStore.add_remote_listener`) with `(previous status,
  record)` for the changes of every store object on this Redis: its own at once, other replicas'
  when their message arrives (the record travels inside the message up to INLINE_RECORD_MAX
  bytes; larger ones are read, and may then be newer than the change).

Messages published while the connection is down are lost: waiters fall back to re-reading the
record every POLL_S seconds, and the *gap* listeners (`RedisTaskStore.add_gap_listener`) are called
once the connection is back, so that every stream built on the listeners resyncs (re-reads what it
shows) instead of missing those changes for good.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import structlog
from redis.asyncio import Redis
from redis.exceptions import RedisError

from proxy.tasks.model import TaskRecord, TaskStatus
from proxy.tasks.store import Listener

log = structlog.get_logger("proxy.tasks")

RECONNECT_S = 0.5  # s between pub/sub reconnection attempts
POLL_S = 1.0  # s: a change wait re-reads the record at least this often (messages may be lost)
READ_S = 1.0  # s: one pub/sub read waits at most this long before the loop checks for shutdown


class ChangeFeed:
    """The pub/sub side of one `RedisTaskStore`; see the module docstring.

    `origin` names the store object (its own messages are skipped when they come back); `fetch`
    reads a record by id (for messages without the record inside).
    """

    def __init__(
        self, redis: Redis, channel: str, origin: str, fetch: Callable[[str], Awaitable[TaskRecord | None]]
    ) -> None:
        self._redis = redis
        self._channel = channel
        self.origin = origin
        self._fetch = fetch
        self._waiters: dict[str, set[asyncio.Event]] = {}
        self.listeners: list[Listener] = []
        self.gap_listeners: list[Callable[[], None]] = []  # called after a reconnection: changes were missed
        self._task: asyncio.Task[None] | None = None
        self._fetches: set[asyncio.Task[None]] = set()
        self.subscribed = asyncio.Event()  # set while the pub/sub connection listens
        self._closed = False
        self._down_logged = False

    def ensure_running(self) -> None:
        """Start (or restart) the pub/sub reader when a loop is running and it is not."""
        if self._closed or (self._task is not None and not self._task.done()):
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._task = loop.create_task(self._run(), name="redis-task-changes")

    @contextlib.contextmanager
    def waiter(self, task_id: str) -> Iterator[asyncio.Event]:
        """An event set at the next change of `task_id` (local or remote) while the block runs."""
        event = asyncio.Event()
        self._waiters.setdefault(task_id, set()).add(event)
        try:
            yield event
        finally:
            events = self._waiters.get(task_id)
            if events is not None:
                events.discard(event)
                if not events:
                    del self._waiters[task_id]

    def _wake(self, task_id: str) -> None:
        for event in self._waiters.get(task_id, ()):
            event.set()

    def committed_here(self, before: TaskStatus | None, record: TaskRecord) -> None:
        """A change this store object committed: wake its waiters and tell the cluster listeners."""
        self._wake(record.task_id)
        self._tell(before, record)

    def _tell(self, before: TaskStatus | None, record: TaskRecord) -> None:
        for listener in self.listeners:
            try:
                listener(before, record)
            except Exception:  # a listener must never break a commit or the reader
                log.exception("task_listener_failed", task_id=record.task_id)

    def _on_message(self, data: bytes | str) -> None:
        try:
            message: dict[str, Any] = json.loads(data)
            task_id = str(message["id"])
            before = TaskStatus(message["b"]) if message.get("b") else None
        except (ValueError, KeyError, TypeError):
            log.warning("task_change_message_unreadable")
            return
        if message.get("o") == self.origin:
            return  # our own commit: already delivered
        self._wake(task_id)
        if not self.listeners:
            return
        if isinstance(message.get("r"), dict):
            self._tell(before, TaskRecord.from_dict(message["r"]))
            return
        fetch = asyncio.get_running_loop().create_task(self._fetch_and_tell(before, task_id))
        self._fetches.add(fetch)
        fetch.add_done_callback(self._fetches.discard)

    async def _fetch_and_tell(self, before: TaskStatus | None, task_id: str) -> None:
        try:
            record = await self._fetch(task_id)
        except Exception as exc:  # the store is down: the change is lost for listeners
            log.warning("task_change_not_read", task_id=task_id, reason=str(exc))
            return
        if record is not None:
            self._tell(before, record)

    def _gap(self) -> None:
        """Tell the gap listeners that changes may have been missed (the subscription was lost)."""
        for listener in self.gap_listeners:
            try:
                listener()
            except Exception:  # a listener must never stop the reader
                log.exception("task_gap_listener_failed")

    async def _run(self) -> None:
        while not self._closed:
            pubsub = self._redis.pubsub()
            try:
                await pubsub.subscribe(self._channel)
                self.subscribed.set()
                if self._down_logged:
                    log.info("task_changes_resubscribed")
                    self._down_logged = False
                    self._gap()
                confirmed = 0
                while not self._closed:
                    message = await pubsub.get_message(timeout=READ_S)
                    kind = message.get("type") if message is not None else None
                    if kind == "message":
                        self._on_message(message["data"])  # type: ignore[index]
                    elif kind == "subscribe":
                        confirmed += 1
                        if confirmed > 1:  # redis-py reconnected and subscribed again on its own
                            log.info("task_changes_resubscribed", reason="the connection was re-made")
                            self._gap()
            except (RedisError, OSError) as exc:
                if not self._down_logged:
                    log.warning(
                        "task_changes_unsubscribed",
                        reason=f"{exc.__class__.__name__}: {exc}",
                        retry_s=RECONNECT_S,
                    )
                    self._down_logged = True
            finally:
                self.subscribed.clear()
                with contextlib.suppress(RedisError, OSError, TimeoutError):
                    await asyncio.wait_for(pubsub.aclose(), timeout=2.0)
            if not self._closed:
                await asyncio.sleep(RECONNECT_S)

    async def close(self) -> None:
        """Stop the reader and pending record reads."""
        self._closed = True
        tasks = [t for t in (self._task, *self._fetches) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
