"""`subscriptions/listen` (2026-07-28 basic/patterns/subscriptions): relay the upstream's
list-changed notifications to every open listen stream of one server."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Protocol

from .protocol.era import LIST_CHANGED_NOTIFICATIONS, META_SUBSCRIPTION_ID, TASKS_EXTENSION, Envelope
from .protocol.jsonrpc import INVALID_PARAMS, MISSING_REQUIRED_CLIENT_CAPABILITY, JsonObject, JsonRpcError, RequestId, notification


class Reply(Protocol):
    """How a handler talks back on one request's HTTP response while it is still running."""

    async def notify(self, message: JsonObject) -> None:
        """Send a JSON-RPC notification (switching the response to SSE)."""

    async def keepalive(self) -> None:
        """Send an SSE comment so idle-timeout intermediaries keep the connection."""


class ListenHub:
    """The open `subscriptions/listen` streams of one server; upstream list-changed notifications
    are fanned out to every one of them (each stream then applies its own filter)."""

    def __init__(self) -> None:
        self._queues: set[asyncio.Queue[JsonObject]] = set()

    def publish(self, message: JsonObject) -> None:
        """Offer one upstream notification to every open stream (others than list changes are ignored)."""
        if message.get("method") in LIST_CHANGED_NOTIFICATIONS:
            for queue in list(self._queues):
                queue.put_nowait(message)

    @contextlib.contextmanager
    def subscribe(self) -> Iterator[asyncio.Queue[JsonObject]]:
        """A queue that receives what is published while the block runs."""
        queue: asyncio.Queue[JsonObject] = asyncio.Queue()
        self._queues.add(queue)
        try:
            yield queue
        finally:
            self._queues.discard(queue)

    async def listen(
        self, request_id: RequestId, params: JsonObject, envelope: Envelope, *, upstream_capabilities: JsonObject, reply: Reply, keepalive_s: float
    ) -> JsonObject:
        """Acknowledge the subset of the filter the proxy honours, then relay the upstream's
        list-changed notifications until the client closes the stream (an SSE comment every
        `keepalive_s` seconds). Resource subscriptions and task ids are not honoured (left out of
        the acknowledgement). Raises JsonRpcError -32602 for a missing filter, -32021 for task ids
        without the tasks extension."""
        wanted = params.get("notifications")
        if not isinstance(wanted, dict):
            raise JsonRpcError(INVALID_PARAMS, "subscriptions/listen needs params.notifications (a SubscriptionFilter object)")
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
        tag = {META_SUBSCRIPTION_ID: request_id}
        with self.subscribe() as queue:
            await reply.notify(notification("notifications/subscriptions/acknowledged", {"notifications": agreed, "_meta": tag}))
            while True:
                try:
                    message = await asyncio.wait_for(queue.get(), timeout=keepalive_s)
                except TimeoutError:
                    await reply.keepalive()
                    continue
                if message["method"] in methods:
                    relayed = dict(message.get("params") or {})
                    relayed["_meta"] = {**(relayed.get("_meta") or {}), **tag}
                    await reply.notify(notification(message["method"], relayed))
