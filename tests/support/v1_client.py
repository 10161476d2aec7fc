"""A raw 2025-11-25 (handshake-era) client over aiohttp for the v1 tasks tests: initialize with
`capabilities.tasks`, session id, JSON or SSE replies, server→client requests answered by a callback."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import aiohttp

from proxy.protocol.sse import iter_events

V1_CAPS = {
    "tasks": {"list": {}, "cancel": {}, "requests": {"elicitation": {"create": {}}}},
    "elicitation": {"form": {}},
}

Answer = Callable[[dict], Awaitable[dict]]


class V1Client:
    """One legacy session against `url` (initialize first)."""

    def __init__(self, url: str, *, capabilities: dict | None = None) -> None:
        self.url = url
        self.capabilities = V1_CAPS if capabilities is None else capabilities
        self.http = aiohttp.ClientSession()
        self.sid: str | None = None
        self._ids = 0
        self.initialize_result: dict = {}
        self.last_headers: Mapping[str, str] = {}  # the HTTP headers of the last response

    async def close(self) -> None:
        await self.http.close()

    def _headers(self) -> dict[str, str]:
        headers = {
            "Content-Type": "application/json",
            "Accept": "application/json, text/event-stream",
            "MCP-Protocol-Version": "2025-11-25",
        }
        if self.sid:
            headers["Mcp-Session-Id"] = self.sid
        return headers

    async def initialize(self) -> dict:
        """`initialize` + `notifications/initialized`; returns the InitializeResult."""
        params = {
            "protocolVersion": "2025-11-25",
            "capabilities": self.capabilities,
            "clientInfo": {"name": "v1-test", "version": "0"},
        }
        status, message, _ = await self.post(
            {"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": params}
        )
        assert status == 200, message
        await self.post({"jsonrpc": "2.0", "method": "notifications/initialized"})
        self.initialize_result = message["result"]
        return message["result"]

    async def request(
        self, method: str, params: dict | None = None, *, on_request: Answer | None = None
    ) -> tuple[int, dict, list[dict]]:
        """One request: (HTTP status, final message, notifications seen before it)."""
        self._ids += 1
        body: dict[str, Any] = {"jsonrpc": "2.0", "id": self._ids, "method": method}
        if params is not None:
            body["params"] = params
        return await self.post(body, on_request=on_request)

    async def post(self, body: dict, *, on_request: Answer | None = None) -> tuple[int, dict, list[dict]]:
        async with self.http.post(self.url, data=json.dumps(body), headers=self._headers()) as resp:
            self.last_headers = resp.headers
            if "Mcp-Session-Id" in resp.headers:
                self.sid = resp.headers["Mcp-Session-Id"]
            notes: list[dict] = []
            if resp.headers.get("Content-Type", "").startswith("text/event-stream"):
                async for event in iter_events(resp.content.iter_any()):
                    if not event.data:
                        continue
                    msg = json.loads(event.data)
                    if "method" in msg and "id" in msg:
                        assert on_request is not None, f"unexpected server request {msg}"
                        answer = await on_request(msg)
                        status, _, _ = await self.post({"jsonrpc": "2.0", "id": msg["id"], "result": answer})
                        assert status == 202
                    elif "method" in msg:
                        notes.append(msg)
                    elif msg.get("id") == body.get("id"):
                        return resp.status, msg, notes
                return resp.status, {}, notes
            text = await resp.text()
            return resp.status, (json.loads(text) if text else {}), notes

    async def call_as_task(
        self, tool: str, arguments: dict, ttl: int | None = 60_000, meta: dict | None = None
    ) -> dict:
        """`tools/call` with `params.task`; returns the CreateTaskResult's task."""
        params: dict[str, Any] = {
            "name": tool,
            "arguments": arguments,
            "task": {} if ttl is None else {"ttl": ttl},
        }
        if meta:
            params["_meta"] = meta
        status, message, _ = await self.request("tools/call", params)
        assert status == 200 and "result" in message, message
        return message["result"]["task"]
