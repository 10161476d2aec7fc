"""What the calls layer shares with the layers above it: how a running handler talks back to its
client (`Reply`). (Where a detached call reports is the task service's `tasks.types.TaskSink`.)"""

from __future__ import annotations

from typing import Any, Protocol

from proxy.protocol.jsonrpc import JsonObject


class Reply(Protocol):
    """How a handler talks back on one request's HTTP response while it is still running.

    `arrived` is the event-loop time (s) the request reached the proxy (None when unknown: the
    handler then counts from now); `headers` are the request's HTTP headers, a case-insensitive
    multi-dict (the `Mcp-Param-*` checks read them).
    """

    arrived: float | None
    headers: Any

    async def notify(self, message: JsonObject) -> None:
        """Send a JSON-RPC notification (switching the response to SSE)."""

    async def keepalive(self) -> None:
        """Send an SSE comment so idle-timeout intermediaries keep the connection."""
