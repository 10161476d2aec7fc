"""`subscriptions/listen` (2026-07-28 basic/patterns/subscriptions): relay the upstream's
list-changed notifications to every open listen stream of one server, and push
`notifications/tasks` for the task ids a stream asked for (ext-tasks, protocol.md §1.5.6)."""

from __future__ import annotations

import asyncio
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
from proxy.runtime.fanout import OVERFLOW, Fanout, Subscription
from proxy.tasks.model import TaskRecord, TaskStatus
from proxy.tasks.service import TaskService
from proxy.tasks.types import TaskChange, about
from proxy.tasks.wire_v2 import detailed_task

TASK_NOTIFICATION = "notifications/tasks"
MAX_TASK_IDS = 100  # task ids one listen stream may ask for


async def listen(
    request_id: RequestId,
    params: JsonObject,
    envelope: Envelope,
    *,
    upstream_capabilities: JsonObject,
    notifications: Fanout[JsonObject],
    tasks: TaskService,
    principal: str,
    server: str,
    reply: Reply,
    keepalive_s: float,
) -> JsonObject:
    """Acknowledge the subset of the filter the proxy honours, then relay the upstream's
    list-changed notifications (from `notifications`, the server's fan-out of them) and, for the
    `taskIds` it agreed to (the caller's own tasks on this server, ext-tasks §"Task Status
    Notifications"), `notifications/tasks` with the full DetailedTask on each status change (and on
    new input requests), until the client closes the stream (an SSE comment every `keepalive_s`
    seconds). A stream that fell too far behind (the fan-out's overflow) is sent every agreed list
    change and the current state of every agreed task, since it cannot know what it missed.

    Resource subscriptions are not honoured (left out of the acknowledgement), nor are ids that
    are unknown, expired or another principal's. Raises JsonRpcError -32602 for a missing filter or
    a malformed `taskIds` (a list of at most MAX_TASK_IDS strings), -32021 for `taskIds` without the
    tasks extension."""
    wanted = params.get("notifications")
    if not isinstance(wanted, dict):
        raise JsonRpcError(
            INVALID_PARAMS, "subscriptions/listen needs params.notifications (a SubscriptionFilter object)"
        )
    if "taskIds" in wanted and not envelope.declares_tasks:
        raise JsonRpcError(
            MISSING_REQUIRED_CLIENT_CAPABILITY,
            f"subscribing to taskIds needs the {TASKS_EXTENSION} extension declared in this request",
            {"requiredCapabilities": {"extensions": {TASKS_EXTENSION: {}}}},
        )
    agreed: JsonObject = {}
    methods: set[str] = set()
    for method, (capability, flag) in LIST_CHANGED_NOTIFICATIONS.items():
        cap = upstream_capabilities.get(capability)
        if wanted.get(flag) is True and isinstance(cap, dict) and cap.get("listChanged") is True:
            agreed[flag] = True
            methods.add(method)
    task_ids: list[str] = []
    if "taskIds" in wanted:
        task_ids = await _own_task_ids(wanted.get("taskIds"), tasks, principal, server)
        agreed["taskIds"] = task_ids
    tag = {META_SUBSCRIPTION_ID: request_id}

    async def send_task(record: TaskRecord) -> None:
        task = {k: v for k, v in detailed_task(record).items() if k != "resultType"}
        await reply.notify(notification(TASK_NOTIFICATION, {**task, "_meta": tag}))

    async def send_list_change(method: str, params: Any) -> None:
        relayed = dict(params or {})
        relayed["_meta"] = {**(relayed.get("_meta") or {}), **tag}
        await reply.notify(notification(method, relayed))

    stream: Subscription[Any] = Subscription(f"subscriptions/listen {server}")
    with (
        notifications.subscribe(lambda message: message.get("method") in methods, into=stream),
        tasks.changes.subscribe(about(principal, server, frozenset(task_ids)), into=stream),
    ):
        await reply.notify(
            notification("notifications/subscriptions/acknowledged", {"notifications": agreed, "_meta": tag})
        )
        while True:
            try:
                item = await asyncio.wait_for(stream.get(), timeout=keepalive_s)
            except TimeoutError:
                await reply.keepalive()
                continue
            if item is OVERFLOW:  # missed changes: send what is true now
                for method in sorted(methods):
                    await send_list_change(method, None)
                for task_id in task_ids:
                    record = await tasks.store.get(task_id)
                    if record is not None:
                        await send_task(record)
            elif isinstance(item, TaskChange):
                if item.before is not item.record.status or item.record.status is TaskStatus.INPUT_REQUIRED:
                    await send_task(item.record)
            elif isinstance(item, dict):
                await send_list_change(item["method"], item.get("params"))


async def _own_task_ids(raw: Any, tasks: TaskService, principal: str, server: str) -> list[str]:
    """The ids in a listen filter's `taskIds` that are `principal`'s live or finished tasks on
    `server`; the rest are silently left out. Raises JsonRpcError -32602 for a malformed list."""
    if not isinstance(raw, list) or len(raw) > MAX_TASK_IDS or not all(isinstance(t, str) and t for t in raw):
        raise JsonRpcError(
            INVALID_PARAMS, f"notifications.taskIds must be a list of at most {MAX_TASK_IDS} task id strings"
        )
    own: list[str] = []
    for task_id in dict.fromkeys(raw):
        try:
            await tasks.lookup(task_id, principal=principal, server=server)
        except JsonRpcError as exc:
            if exc.code != INVALID_PARAMS:
                raise
            continue
        own.append(task_id)
    return own
