"""Legacy-era clients (initialize handshake, Mcp-Session-Id) pass through the proxy transparently.

The official `mcp` SDK client talks to the fixture server directly and through the proxy; both
must see the same thing.
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import mcp.types as types
from mcp.client.session import ClientRequestContext, ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from support.proxy import RunningProxy


async def _session_run(url: str, fn) -> Any:
    async def on_elicit(
        context: ClientRequestContext, params: types.ElicitRequestParams
    ) -> types.ElicitResult:
        return types.ElicitResult(action="accept", content={"confirm": True})

    async with streamable_http_client(url) as (read, write):
        async with ClientSession(read, write, elicitation_callback=on_elicit) as session:
            await session.initialize()
            return await fn(session)


def _dump(result: Any) -> Any:
    return result.model_dump(mode="json", exclude_none=True)


async def test_sdk_client_sees_the_same_through_the_proxy(legacy_url: str, proxy: RunningProxy) -> None:
    async def exercise(session: ClientSession) -> dict:
        progress: list[float] = []

        async def on_progress(p: float, total: float | None, message: str | None) -> None:
            progress.append(p)

        out = {
            "tools": [t.name for t in (await session.list_tools()).tools],
            "greet": _dump(await session.call_tool("greet", {"name": "Ada"})),
            "slow": _dump(
                await session.call_tool(
                    "slow_compute", {"seconds": 0.3, "label": "legacy"}, progress_callback=on_progress
                )
            ),
            "elicit": _dump(await session.call_tool("confirm_delete", {"filename": "a.txt"})),
            "failing": _dump(await session.call_tool("failing_job", {})),
            "resource": _dump(await session.read_resource("test://static-text")),
            "prompt": _dump(await session.get_prompt("simple_prompt", {})),
        }
        out["progress_seen"] = len(progress) >= 2
        try:
            await session.call_tool("instant_error", {})
            out["error"] = None
        except MCPError as exc:
            out["error"] = (exc.code, exc.message)
        return out

    direct = await _session_run(legacy_url, exercise)
    proxied = await _session_run(proxy.url(), exercise)
    assert proxied == direct
    assert proxied["greet"]["content"][0]["text"] == "Hello, Ada!"
    assert proxied["elicit"]["content"][0]["text"] == "deleted a.txt"
    assert proxied["progress_seen"] is True
    assert proxied["error"] == (-32603, "instant_error exploded")


async def test_unknown_and_ended_sessions_get_404(proxy: RunningProxy) -> None:
    headers = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
    init = {
        "jsonrpc": "2.0",
        "id": 0,
        "method": "initialize",
        "params": {
            "protocolVersion": "2025-11-25",
            "capabilities": {},
            "clientInfo": {"name": "t", "version": "1"},
        },
    }
    ping = {"jsonrpc": "2.0", "id": 1, "method": "ping"}
    async with aiohttp.ClientSession() as http:
        async with http.post(proxy.url(), json=init, headers=headers) as resp:
            assert resp.status == 200
            sid = resp.headers["Mcp-Session-Id"]
            await resp.read()
        session_headers = {**headers, "Mcp-Session-Id": sid, "MCP-Protocol-Version": "2025-11-25"}
        async with http.post(
            proxy.url(),
            json={"jsonrpc": "2.0", "method": "notifications/initialized"},
            headers=session_headers,
        ) as resp:
            assert resp.status == 202
        async with http.post(proxy.url(), json=ping, headers=session_headers) as resp:
            assert resp.status == 200
            await resp.read()
        async with http.post(
            proxy.url(), json=ping, headers={**session_headers, "Mcp-Session-Id": "not-a-session"}
        ) as resp:
            assert resp.status == 404
            body = json.loads(await resp.text())
            assert body["error"]["code"] == -32600 and body["id"] == 1
        async with http.delete(proxy.url(), headers=session_headers) as resp:
            assert resp.status < 300
        async with http.post(proxy.url(), json=ping, headers=session_headers) as resp:
            assert resp.status == 404


async def test_proxy_session_id_is_not_the_upstream_one(proxy: RunningProxy) -> None:
    headers = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
    init = {
        "jsonrpc": "2.0",
        "id": 0,
        "method": "initialize",
        "params": {
            "protocolVersion": "2025-11-25",
            "capabilities": {},
            "clientInfo": {"name": "t", "version": "1"},
        },
    }
    call = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "tools/call",
        "params": {"name": "echo_meta", "arguments": {}},
    }
    async with aiohttp.ClientSession() as http:
        async with http.post(proxy.url(), json=init, headers=headers) as resp:
            sid = resp.headers["Mcp-Session-Id"]
            await resp.read()
        session_headers = {**headers, "Mcp-Session-Id": sid, "MCP-Protocol-Version": "2025-11-25"}
        async with http.post(proxy.url(), json=call, headers=session_headers) as resp:
            sse = resp.headers["Content-Type"].startswith("text/event-stream")
            text = await resp.text()
    data = (
        [json.loads(line[5:]) for line in text.splitlines() if line.startswith("data:") and line[5:].strip()]
        if sse
        else [json.loads(text)]  # a quick answer alone comes as plain JSON
    )
    seen = json.loads(data[-1]["result"]["content"][0]["text"])
    assert seen["headers"]["mcp-session-id"] and seen["headers"]["mcp-session-id"] != sid


async def test_methods_outside_the_legacy_surface_get_method_not_found_from_the_proxy(
    proxy: RunningProxy,
) -> None:
    """-32601 from the proxy itself (never relayed: `mcp` 1.x upstreams say -32602), in an HTTP 200 as
    JSON-RPC errors are on this wire (a 404 would tell the client its session is gone). v1 tasks
    methods belong to 2025-11-25 sessions only."""
    headers = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
    init = {
        "jsonrpc": "2.0",
        "id": 0,
        "method": "initialize",
        "params": {
            "protocolVersion": "2025-11-25",
            "capabilities": {"tasks": {}},
            "clientInfo": {"name": "t", "version": "1"},
        },
    }
    async with aiohttp.ClientSession() as http:
        async with http.post(proxy.url(), json=init, headers=headers) as resp:
            sid = resp.headers["Mcp-Session-Id"]
            await resp.read()
        session_headers = {**headers, "Mcp-Session-Id": sid, "MCP-Protocol-Version": "2025-11-25"}
        async with http.post(
            proxy.url(),
            json={"jsonrpc": "2.0", "method": "notifications/initialized"},
            headers=session_headers,
        ) as resp:
            assert resp.status == 202

        async def post(body: dict, version: str = "2025-11-25") -> tuple[int, dict]:
            async with http.post(
                proxy.url(), json=body, headers={**session_headers, "MCP-Protocol-Version": version}
            ) as resp:
                text = await resp.text()
                if resp.headers.get("Content-Type", "").startswith("text/event-stream"):
                    text = [
                        line[5:]
                        for line in text.splitlines()
                        if line.startswith("data:") and line[5:].strip()
                    ][-1]
                return resp.status, json.loads(text)

        for method in ("unknown/method", "server/discover", "tasks/update", "subscriptions/listen"):
            status, body = await post({"jsonrpc": "2.0", "id": "x-1", "method": method, "params": {}})
            assert status == 200 and body["id"] == "x-1", method
            assert (
                body["error"]["code"] == -32601 and body["error"]["message"] == f"method {method!r} not found"
            ), method
        status, body = await post({"jsonrpc": "2.0", "id": 2, "method": "tasks/list", "params": {}})
        assert status == 200 and body["result"]["tasks"] == []  # v1 tasks, served for this 2025-11-25 session
        status, body = await post(
            {"jsonrpc": "2.0", "id": 3, "method": "tasks/list", "params": {}}, version="2025-06-18"
        )
        assert status == 200 and body["error"]["code"] == -32601
        status, body = await post({"jsonrpc": "2.0", "id": 4, "method": "ping"})
        assert status == 200 and body["result"] == {}  # the session is still there
        # not JSON-RPC 2.0: invalid, not "not found"
        status, body = await post({"id": 5, "method": "unknown/method"})
        assert 200 <= status < 500 and body["error"]["code"] == -32600
