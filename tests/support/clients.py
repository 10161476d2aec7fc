"""Raw clients over aiohttp: a 2026-07-28 client that builds the envelope and routing headers
itself (`ModernClient`), one that sends credentials (`AuthClient`), and the reply they parse."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from proxy.protocol.era import (
    META_CLIENT_CAPABILITIES,
    META_PROTOCOL_VERSION,
    MODERN_VERSION,
    TASKS_EXTENSION,
)
from proxy.protocol.sse import iter_events

TASKS_CAPS = {"extensions": {TASKS_EXTENSION: {}}}


LEGACY_INITIALIZE = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "initialize",
    "params": {
        "protocolVersion": "2025-11-25",
        "capabilities": {},
        "clientInfo": {"name": "t", "version": "0"},
    },
}  # a handshake-era `initialize` request (2025-11-25), as raw legacy tests send it
# the headers of a raw handshake-era POST (add `MCP-Protocol-Version` once initialized)
LEGACY_HEADERS = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}


def envelope(capabilities: dict | None = None, **extra: Any) -> dict:
    """A 2026-07-28 `_meta` envelope."""
    return {
        META_PROTOCOL_VERSION: MODERN_VERSION,
        META_CLIENT_CAPABILITIES: capabilities if capabilities is not None else {},
        **extra,
    }


@dataclass
class Reply:
    """One HTTP exchange: status, parsed final JSON-RPC message, notifications seen before it."""

    status: int
    message: dict
    notifications: list[dict]
    content_type: str
    request_id: str = ""  # the proxy's `X-Request-Id` response header
    retry_after: str = ""  # its `Retry-After` header

    @property
    def result(self) -> dict:
        assert "result" in self.message, self.message
        return self.message["result"]

    @property
    def error(self) -> dict:
        assert "error" in self.message, self.message
        return self.message["error"]


def _ids_and_wait(headers: Mapping[str, str]) -> tuple[str, str]:
    """The `X-Request-Id` and `Retry-After` of a response ("" when absent)."""
    return headers.get("X-Request-Id", ""), headers.get("Retry-After", "")


class ModernClient:
    """A raw 2026-07-28 client over aiohttp: builds the envelope and routing headers itself."""

    def __init__(self, url: str, *, capabilities: dict | None = None) -> None:
        self.url = url
        self.capabilities = TASKS_CAPS if capabilities is None else capabilities
        self.http = aiohttp.ClientSession()
        self._ids = 0

    async def close(self) -> None:
        await self.http.close()

    def headers_for(self, method: str, params: dict) -> dict[str, str]:
        headers = {
            "Content-Type": "application/json",
            "Accept": "application/json, text/event-stream",
            "MCP-Protocol-Version": MODERN_VERSION,
            "Mcp-Method": method,
        }
        if method in ("tools/call", "prompts/get"):
            headers["Mcp-Name"] = params.get("name", "")
        elif method == "resources/read":
            headers["Mcp-Name"] = params.get("uri", "")
        elif method.startswith("tasks/") and "taskId" in params:
            headers["Mcp-Name"] = str(params["taskId"])
        return headers

    async def request(
        self,
        method: str,
        params: dict | None = None,
        *,
        capabilities: dict | None = None,
        headers: dict | None = None,
        meta: dict | None = None,
    ) -> Reply:
        """Send one request; parse a JSON or SSE reply."""
        self._ids += 1
        params = dict(params or {})
        params["_meta"] = {
            **envelope(self.capabilities if capabilities is None else capabilities),
            **(meta or {}),
        }
        body = {"jsonrpc": "2.0", "id": self._ids, "method": method, "params": params}
        all_headers = {**self.headers_for(method, params), **(headers or {})}
        return await self.post_raw(json.dumps(body).encode(), all_headers)

    async def post_raw(self, data: bytes, headers: dict[str, str]) -> Reply:
        """POST raw bytes; parse the reply as JSON-RPC (JSON or SSE)."""
        async with self.http.post(self.url, data=data, headers=headers) as resp:
            ctype = resp.headers.get("Content-Type", "")
            notes: list[dict] = []
            if ctype.startswith("text/event-stream"):
                final: dict = {}
                async for event in iter_events(resp.content.iter_any()):
                    if not event.data:
                        continue
                    msg = json.loads(event.data)
                    if "id" in msg and "method" not in msg:
                        final = msg
                    else:
                        notes.append(msg)
                return Reply(resp.status, final, notes, ctype, *_ids_and_wait(resp.headers))
            text = await resp.text()
            message = json.loads(text) if text else {}
            return Reply(resp.status, message, notes, ctype, *_ids_and_wait(resp.headers))

    async def call(self, tool: str, arguments: dict | None = None, **kwargs: Any) -> Reply:
        """`tools/call`."""
        return await self.request("tools/call", {"name": tool, "arguments": arguments or {}}, **kwargs)

    async def get(self, task_id: str, **kwargs: Any) -> Reply:
        """`tasks/get`."""
        return await self.request("tasks/get", {"taskId": task_id}, **kwargs)

    async def warm_up(self) -> None:
        """Open the upstream session for this client's capabilities with a `greet` call, and wait for
        it to end even when it became a task (the detach clock counts the session's start-up)."""
        reply = await self.call("greet", {"name": "warm-up"})
        if reply.result.get("resultType") == "task":
            await self.wait_terminal(reply.result["taskId"])

    async def wait_terminal(self, task_id: str, timeout: float = 10.0) -> dict:
        """Poll `tasks/get` until the task is terminal; return the DetailedTask."""
        return await self.wait_status(task_id, ("completed", "failed", "cancelled"), timeout)

    async def wait_status(self, task_id: str, statuses: tuple[str, ...], timeout: float = 10.0) -> dict:
        """Poll `tasks/get` (every 20 ms) until the status is one of `statuses`."""
        async with asyncio.timeout(timeout):
            while True:
                task = (await self.get(task_id)).result
                if task["status"] in statuses:
                    return task
                await asyncio.sleep(0.02)


class AuthClient(ModernClient):
    """A ModernClient that sends fixed extra headers (credentials)."""

    def __init__(self, url: str, headers: dict[str, str], **kwargs) -> None:
        super().__init__(url, **kwargs)
        self.extra = headers

    def headers_for(self, method: str, params: dict) -> dict[str, str]:
        return {**super().headers_for(method, params), **self.extra}
