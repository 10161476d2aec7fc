"""In-process fan-out of task changes to the streams that wait on them (status push).

The store calls `TaskPush.on_change(previous status | None, record)` after each change it commits
(`TaskStore.add_listener`); running calls may `publish` messages that belong to a task (a v1
client's `notifications/progress`). Each open stream (a v1 `tasks/result`, a v2
`subscriptions/listen` with `taskIds`) holds a `Subscription` for one principal on one server,
optionally narrowed to some task ids, and reads `("change", (previous status | None, TaskRecord))`
and `("message", JsonObject)` items from its queue. Only the principal's own tasks ever reach it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from proxy.tasks.model import TaskRecord, TaskStatus

QUEUE_MAX = (
    1000  # items a slow stream may fall behind before new ones are dropped (it re-reads the record anyway)
)


@dataclass(eq=False)
class Subscription:
    """One stream's interest: tasks of `principal` on `server`, all of them or only `task_ids`."""

    principal: str
    server: str
    task_ids: frozenset[str] | None = None
    queue: asyncio.Queue[Any] = field(default_factory=lambda: asyncio.Queue(QUEUE_MAX))

    def wants(self, principal: str, server: str, task_id: str) -> bool:
        """True when a change of `task_id` (owned by `principal` on `server`) is for this stream."""
        return (
            principal == self.principal
            and server == self.server
            and (self.task_ids is None or task_id in self.task_ids)
        )

    def offer(self, item: tuple[str, Any]) -> None:
        """Queue `item`; dropped when the stream is QUEUE_MAX items behind."""
        with contextlib.suppress(asyncio.QueueFull):
            self.queue.put_nowait(item)


class TaskPush:
    """The open subscriptions of one proxy process."""

    def __init__(self) -> None:
        self._subs: set[Subscription] = set()

    def on_change(self, before: TaskStatus | None, record: TaskRecord) -> None:
        """Store listener: offer `("change", (before, record))` to every stream that wants the task
        (each stream decides which changes it sends: a status change, new input requests)."""
        for sub in list(self._subs):
            if sub.wants(record.principal, record.server, record.task_id):
                sub.offer(("change", (before, record)))

    def publish(self, *, principal: str, server: str, task_id: str, message: dict[str, Any]) -> None:
        """Offer `("message", message)` (a JSON-RPC notification that belongs to the task) to its streams."""
        for sub in list(self._subs):
            if sub.wants(principal, server, task_id):
                sub.offer(("message", message))

    def watched(self, task_id: str) -> bool:
        """True while a stream subscribed to `task_id` by id (a v1 `tasks/result`) is open."""
        return any(sub.task_ids is not None and task_id in sub.task_ids for sub in self._subs)

    @contextlib.contextmanager
    def subscribe(
        self,
        *,
        principal: str,
        server: str,
        task_ids: frozenset[str] | None = None,
        queue: asyncio.Queue[Any] | None = None,
    ) -> Iterator[Subscription]:
        """A subscription that receives what is pushed while the block runs (into `queue` when given,
        so a stream can wait on one queue for several sources)."""
        sub = Subscription(principal=principal, server=server, task_ids=task_ids)
        if queue is not None:
            sub.queue = queue
        self._subs.add(sub)
        try:
            yield sub
        finally:
            self._subs.discard(sub)
