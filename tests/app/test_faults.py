"""Upstream faults end in a clear JSON-RPC error (synchronous) or a `failed` task, naming the cause;
the proxy keeps serving and stored tasks are untouched."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.clients import ModernClient
from support.proxy import Serve
from support.servers import ROOT, ServerProcess
from support.v1_client import V1Client

from proxy.config import config_from_data

FAULTS = {
    "hang": "hard timeout",
    "invalid_json": "invalid JSON",
    "refuse": "HTTP 503",
    "die": "stream",
    "not_jsonrpc": "not a JSON-RPC response",
}


@pytest.fixture(scope="module")
def bad_url() -> Iterator[str]:
    server = ServerProcess(
        [sys.executable, str(ROOT / "tests" / "fixtures" / "bad_upstream.py"), "--port", "0"]
    )
    yield server.url
    server.stop()


def fault_config(url: str, tmp_path: Path, *, required: bool):
    tools = {name: {"mode": "required"} for name in [*FAULTS, "ok"]} if required else {}
    return config_from_data(
        {
            "store": {"path": str(tmp_path / "store"), "durable": False},
            "tasks": {"detach_after": "5s", "poll_interval": "100ms"},
            "mcpServers": {"bad": {"url": url, "timeout": "400ms", "tasks": {"tools": tools}}},
        }
    )


async def test_faults_are_clear_synchronous_errors(bad_url: str, tmp_path: Path, serve: Serve) -> None:
    proxy = await serve(fault_config(bad_url, tmp_path, required=False))
    client = ModernClient(proxy.url(), capabilities={})
    try:
        for tool, cause in FAULTS.items():
            reply = await client.call(tool)
            assert reply.error["code"] == -32603, tool
            assert cause in reply.error["message"] and "bad" in reply.error["message"], (
                tool,
                reply.error,
            )
        assert (await client.call("ok")).result["content"][0]["text"] == "ok"
    finally:
        await client.close()


async def test_faults_fail_the_task_naming_the_cause(bad_url: str, tmp_path: Path, serve: Serve) -> None:
    proxy = await serve(fault_config(bad_url, tmp_path, required=True))
    client = ModernClient(proxy.url())
    try:
        ok_task = (await client.request("tools/call", {"name": "ok", "arguments": {}})).result
        for tool, cause in FAULTS.items():
            created = (await client.call(tool)).result
            assert created["resultType"] == "task", tool
            done = await client.wait_terminal(created["taskId"], timeout=5)
            assert done["status"] == "failed", tool
            assert cause in done["error"]["message"] and cause in done["statusMessage"], (tool, done)
        assert (await client.wait_terminal(ok_task["taskId"]))["result"]["content"][0]["text"] == "ok"
    finally:
        await client.close()


async def test_an_event_too_deep_to_parse_is_skipped_and_the_call_answers(
    bad_url: str, tmp_path: Path, serve: Serve
) -> None:
    """An upstream SSE event nested past what JSON parsing can follow is logged and skipped like
    any event that is not JSON; the result after it still answers the call (it crashed the call)."""
    proxy = await serve(fault_config(bad_url, tmp_path, required=False))
    client = ModernClient(proxy.url(), capabilities={})
    try:
        reply = await client.call("deep_event")
        assert reply.result["content"][0]["text"] == "ok", reply.message
    finally:
        await client.close()


async def test_a_broken_reply_to_a_legacy_call_is_the_upstreams_fault(
    bad_url: str, tmp_path: Path, serve: Serve
) -> None:
    """On the handshake-era wire too, an HTTP 200 whose body is not JSON-RPC is `-32603` naming the
    upstream (in an HTTP 200), never `-32600`, which blames the client's request (it was)."""
    proxy = await serve(fault_config(bad_url, tmp_path, required=False))
    client = V1Client(proxy.url(), capabilities={})
    try:
        await client.initialize()
        for tool in ("invalid_json", "not_jsonrpc"):
            status, reply, _ = await client.request("tools/call", {"name": tool, "arguments": {}})
            assert status == 200 and reply["error"]["code"] == -32603, (tool, reply)
            assert "upstream bad" in reply["error"]["message"], reply
    finally:
        await client.close()


async def test_a_keyed_legacy_call_keeps_the_error_the_proxy_wrote_for_a_broken_reply(
    bad_url: str, tmp_path: Path, serve: Serve
) -> None:
    """An upstream that answers a keyed legacy call with a page that is not JSON-RPC (HTTP 503, plain
    text): the retry with the key gets the error the first request got (it got "ended without an
    answer the proxy could keep", although the first request's answer was known)."""
    proxy = await serve(fault_config(bad_url, tmp_path, required=False))
    client = V1Client(proxy.url(), capabilities={})
    try:
        await client.initialize()
        call = {
            "name": "refuse",
            "arguments": {},
            "_meta": {"mcp-tasks-proxy/idempotencyKey": "refused-once"},
        }
        first = (await client.request("tools/call", call))[1]["error"]
        assert first["code"] == -32603 and "HTTP 503: upstream overloaded" in first["message"], first
        assert (await client.request("tools/call", call))[1]["error"] == first
    finally:
        await client.close()


async def test_unreachable_upstream_fails_a_required_task_naming_the_cause(
    tmp_path: Path, serve: Serve
) -> None:
    config = config_from_data(
        {
            "store": {"path": str(tmp_path / "store"), "durable": False},
            "mcpServers": {
                "gone": {"url": "http://127.0.0.1:9/mcp", "tasks": {"tools": {"job": {"mode": "required"}}}}
            },
        }
    )
    proxy = await serve(config)
    client = ModernClient(proxy.url())
    try:
        created = (await client.call("job")).result
        done = await client.wait_terminal(created["taskId"])
        assert (
            done["status"] == "failed"
            and "unreachable" in done["error"]["message"]
            and "gone" in done["error"]["message"]
        )
    finally:
        await client.close()
