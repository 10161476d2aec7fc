"""`subscriptions/listen` (2026-07-28 basic/patterns/subscriptions): relay the upstream's
list-changed notifications to every open listen stream of one server, and push
`notifications/tasks` for the task ids a stream asked for (ext-tasks, protocol.md §1.5.6)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any

from proxy.calls.types import Reply
from proxy.protocol.era import LIST_CHANGED_NOTIFICATIONS, META_SUBSCRIPTION_ID, TASKS_EXTENSION, Envelope
from proxy.protocol.jsonrpc import (
    INVALID_PARAMS,
    MISSING_REQUIRED_CLIENT_CAPABILITY,
    JsonObject,
    JsonRpcError,
    RequestId,
    notification,
)
from proxy.tasks.model import TaskStatus
from proxy.tasks.push import QUEUE_MAX
from proxy.tasks.service import TaskService
from proxy.tasks.wire_v2 import detailed_task

TASK_NOTIFICATION = "notifications/tasks"
MAX_TASK_IDS = 100  # task ids one listen stream may ask for


class ListenHub:
    """The open `subscriptions/listen` streams of one server; upstream list-changed notifications
    are fanned out to every one of them (each stream then applies its own filter)."""

    def __init__(self) -> None:
        self._queues: set[asyncio.Queue[Any]] = set()

    def publish(self, message: JsonObject) -> None:
        """Offer one upstream notification to every open stream (others than list changes are ignored)."""
        if message.get("method") in LIST_CHANGED_NOTIFICATIONS:
            for queue in list(self._queues):
                with contextlib.suppress(asyncio.QueueFull):  # a stream that far behind misses a list change
                    queue.put_nowait(message)

    @contextlib.contextmanager
    def subscribe(self) -> Iterator[asyncio.Queue[Any]]:
        """A queue that receives what is published while the block runs."""
        queue: asyncio.Queue[Any] = asyncio.Queue(QUEUE_MAX)  # bounded like the task push it shares
        self._queues.add(queue)
        try:
            yield queue
        finally:
            self._queues.discard(queue)

    async def listen(
        self,
        request_id: RequestId,
        params: JsonObject,
        envelope: Envelope,
        *,
        upstream_capabilities: JsonObject,
        reply: Reply,
        keepalive_s: float,
        tasks: TaskService | None = None,
        principal: str = "",
        server: str = "",
    ) -> JsonObject:
        """Acknowledge the subset of the filter the proxy honours, then relay the upstream's
        list-changed notifications and, for the `taskIds` it agreed to (the caller's own tasks on
        this server, ext-tasks §"Task Status Notifications"), `notifications/tasks` with the full
        DetailedTask on each status change (and on new input requests), until the client closes
        the stream (an SSE comment every `keepalive_s` seconds). Resource subscriptions are not
        honoured (left out of the acknowledgement), nor are ids that are unknown, expired or
        another principal's. Raises JsonRpcError -32602 for a missing filter or a malformed
        `taskIds` (a list of at most MAX_TASK_IDS strings), -32021 for `taskIds` without the tasks
        extension."""
        wanted = params.get("notifications")
        if not isinstance(wanted, dict):
            raise JsonRpcError(
                INVALID_PARAMS,
                "subscriptions/listen needs params.notifications (a SubscriptionFilter object)",
            )
        if "taskIds" in wanted and not envelope.declares_tasks:
            raise JsonRpcError(
                MISSING_REQUIRED_CLIENT_CAPABILITY,
                f"subscribing to taskIds needs the {TASKS_EXTENSION} extension declared in this request",
                {"requiredCapabilities": {"extensions": {TASKS_EXTENSION: {}}}},
            )
        agreed: JsonObject = {}
        methods = set()
        for method, (capability, flag) in LIST_CHANGED_NOTIFICATIONS.items():
            cap = upstream_capabilities.get(capability)
            if wanted.get(flag) is True and isinstance(cap, dict) and cap.get("listChanged") is True:
                agreed[flag] = True
                methods.add(method)
        task_ids = (
            await _own_task_ids(wanted.get("taskIds"), tasks, principal, server)
            if "taskIds" in wanted
            else []
        )
        if "taskIds" in wanted:
            agreed["taskIds"] = task_ids
        tag = {META_SUBSCRIPTION_ID: request_id}
        with self.subscribe() as queue, _task_subscription(tasks, principal, server, task_ids, queue):
            await reply.notify(
                notification(
                    "notifications/subscriptions/acknowledged", {"notifications": agreed, "_meta": tag}
                )
            )
            while True:
                try:
                    message = await asyncio.wait_for(queue.get(), timeout=keepalive_s)
                except TimeoutError:
                    await reply.keepalive()
                    continue
                if isinstance(message, tuple):  # a task change: ("change", (previous status, record))
                    kind, item = message
                    if kind == "change":
                        before, record = item
                        if before is not record.status or record.status is TaskStatus.INPUT_REQUIRED:
                            task = {k: v for k, v in detailed_task(record).items() if k != "resultType"}
                            await reply.notify(notification(TASK_NOTIFICATION, {**task, "_meta": tag}))
                elif message["method"] in methods:
                    relayed = dict(message.get("params") or {})
                    relayed["_meta"] = {**(relayed.get("_meta") or {}), **tag}
                    await reply.notify(notification(message["method"], relayed))


async def _own_task_ids(raw: Any, tasks: TaskService | None, principal: str, server: str) -> list[str]:
    """The ids in a listen filter's `taskIds` that are `principal`'s live or finished tasks on
    `server`; the rest are silently left out. Raises JsonRpcError -32602 for a malformed list."""
    if not isinstance(raw, list) or len(raw) > MAX_TASK_IDS or not all(isinstance(t, str) and t for t in raw):
        raise JsonRpcError(
            INVALID_PARAMS, f"notifications.taskIds must be a list of at most {MAX_TASK_IDS} task id strings"
        )
    own: list[str] = []
    for task_id in dict.fromkeys(raw):
        if tasks is None:
            break
        try:
            await tasks.lookup(task_id, principal=principal, server=server)
        except JsonRpcError as exc:
            if exc.code != INVALID_PARAMS:
                raise
            continue
        own.append(task_id)
    return own


@contextlib.contextmanager
def _task_subscription(
    tasks: TaskService | None, principal: str, server: str, task_ids: list[str], queue: asyncio.Queue[Any]
) -> Iterator[None]:
    """Push the changes of `task_ids` into `queue` while the block runs (nothing without ids)."""
    if tasks is None or not task_ids:
        yield
        return
    with tasks.push.subscribe(principal=principal, server=server, task_ids=frozenset(task_ids), queue=queue):
        yield
