"""stdio upstreams under pressure: a cap on children per server (with `isolation: per_principal`
stopped when idle by default), oversized messages refused, and every start failure and crash loop
visible in the log and in metrics."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from pathlib import Path

import aiohttp
import structlog
from support.clients import AuthClient, ModernClient
from support.proxy import Serve, stdio_config

from proxy.app import POOLS_KEY
from proxy.config import config_from_data
from proxy.front.auth import hash_token
from proxy.runtime.logs import configure_logging


def test_per_principal_children_stop_when_idle_by_default(tmp_path: Path) -> None:
    assert (
        stdio_config(tmp_path, server={"isolation": "per_principal"}).mcpServers["fx"].idle_timeout == 600.0
    )
    assert stdio_config(tmp_path).mcpServers["fx"].idle_timeout is None  # a shared child stays up
    assert stdio_config(tmp_path).mcpServers["fx"].max_children == 32


async def test_per_principal_children_are_capped(tmp_path: Path, serve: Serve) -> None:
    config = stdio_config(tmp_path, server={"isolation": "per_principal", "max_children": 2})
    tokens = {name: hash_token(name + "-secret") for name in ("alice", "bob", "carol")}
    config.auth = type(config.auth).model_validate({"mode": "bearer", "tokens": tokens})
    proxy = await serve(config)
    pool = proxy.app[POOLS_KEY]["fx"]
    clients = {
        name: AuthClient(proxy.url(), {"Authorization": f"Bearer {name}-secret"}, capabilities={})
        for name in tokens
    }
    try:
        for name in ("alice", "bob", "carol"):  # the third principal's child replaces an idle one
            assert (await clients[name].call("greet", {"name": name})).result["content"][0][
                "text"
            ] == f"Hello, {name}!"
            assert len(pool.children()) <= 2
        busy = [
            asyncio.create_task(clients[n].call("slow_compute", {"seconds": 1.5, "label": n}))
            for n in ("alice", "bob")
        ]
        async with asyncio.timeout(10):  # until both slow calls run on their own children
            while sum(1 for slot in pool._slots.values() for child in slot.sessions if child.in_flight) < 2:
                await asyncio.sleep(0.02)
        refused = await clients["carol"].call("greet", {"name": "carol"})
        assert refused.status < 500 and "max_children" in refused.error["message"], refused.message
        assert len(pool.children()) <= 2
        for reply in await asyncio.gather(*busy):
            assert reply.result["isError"] is False
    finally:
        for client in clients.values():
            await client.close()


async def test_an_oversized_stdout_message_is_an_error_and_the_child_restarts(
    tmp_path: Path, serve: Serve
) -> None:
    proxy = await serve(stdio_config(tmp_path, server={"max_response_bytes": 64 * 1024}))
    client = ModernClient(proxy.url(), capabilities={})
    try:
        reply = await client.call("big_result", {"kb": 256})
        assert (
            reply.status < 500
            and reply.error["code"] == -32603
            and "max_response_bytes" in reply.error["message"]
        )
        assert (await client.call("greet", {"name": "again"})).result["content"][0]["text"] == "Hello, again!"
    finally:
        await client.close()


# A raw stdio server: the handshake, an empty tools/list, and for any other request the lines given
# (at the indent of a block under `else:`, a tool's name in `tool`): they set `result` (the answer),
# or `continue` to answer nothing.
_STDIO_SCRIPT = """
import json, subprocess, sys
for line in sys.stdin:
    msg = json.loads(line)
    if "id" not in msg:
        continue
    method = msg.get("method")
    if method == "initialize":
        result = {"protocolVersion": msg["params"]["protocolVersion"], "capabilities": {"tools": {}},
                  "serverInfo": {"name": "raw-stdio", "version": "1"}}
    elif method == "tools/list":
        result = {"tools": []}
    else:
        tool = (msg.get("params") or {}).get("name")  # (None for a method other than tools/call)
TOOLS_CALL
    sys.stdout.write(json.dumps({"jsonrpc": "2.0", "id": msg["id"], "result": result}) + "\\n")
    sys.stdout.flush()
"""


def _stdio_script(tools_call: str) -> str:
    """_STDIO_SCRIPT with `tools_call` (lines already indented 8 spaces) as its `tools/call` branch."""
    return _STDIO_SCRIPT.replace("TOOLS_CALL\n", tools_call)


# Asked for `big`, it starts a grandchild holding its stdout open, then writes one line past the
# proxy's limit and never answers: the child's exit cannot be seen while the grandchild lives, which
# must never keep the caller waiting.
_HELD_STDOUT_SERVER = _stdio_script(
    """        if tool == "big":
            grandchild = subprocess.Popen(["sleep", "60"])
            with open(sys.argv[1], "a") as pids:
                pids.write(f"{grandchild.pid}\\n")
            sys.stdout.write("x" * 200_000 + "\\n")
            sys.stdout.flush()
            continue
        result = {"content": [{"type": "text", "text": "ok"}], "isError": False}
"""
)


async def test_an_oversized_message_fails_at_once_while_a_grandchild_holds_stdout(
    tmp_path: Path, serve: Serve
) -> None:
    script, pids = tmp_path / "held_stdout.py", tmp_path / "grandchildren"
    script.write_text(_HELD_STDOUT_SERVER)
    config = config_from_data(
        {
            "store": {"path": str(tmp_path / "store"), "durable": False},
            "mcpServers": {
                "held": {
                    "command": sys.executable,
                    "args": [str(script), str(pids)],
                    "max_response_bytes": 65536,
                }
            },
        }
    )
    proxy = await serve(config)
    client = ModernClient(proxy.url("held"), capabilities={})
    try:
        async with asyncio.timeout(4):  # the grandchild lives 60 s: the answer must not wait for it
            reply = await client.call("big")
            assert reply.status < 500 and "max_response_bytes" in reply.error["message"], reply.message
            assert (await client.call("small")).result["content"][0]["text"] == "ok"  # on a new child
    finally:
        await client.close()
        for pid in pids.read_text().split() if pids.exists() else []:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)


async def test_a_command_that_cannot_start_or_crash_loops_is_logged_and_counted(
    tmp_path: Path, capsys, serve: Serve
) -> None:
    configure_logging("info")
    try:
        config = config_from_data(
            {
                "store": {"path": str(tmp_path / "store"), "durable": False},
                "mcpServers": {
                    "missing": {"command": str(tmp_path / "no-such-server")},
                    "looping": {
                        "command": sys.executable,
                        "args": ["-c", "import sys; sys.exit(7)"],
                        "max_restarts": 2,
                    },
                },
            }
        )
        proxy = await serve(config)
        for server in ("missing", "looping"):
            client = ModernClient(proxy.url(server), capabilities={})
            try:
                for _ in range(2):
                    assert (await client.call("anything")).error["code"] == -32603
            finally:
                await client.close()
        async with aiohttp.ClientSession() as http, http.get(f"{proxy.base}/metrics") as resp:
            metrics = await resp.text()
        await proxy.stop()
        lines = [json.loads(line) for line in capsys.readouterr().err.splitlines() if line.startswith("{")]
    finally:
        structlog.reset_defaults()
    failed = [line for line in lines if line["event"] == "upstream_start_failed"]
    assert any(line["server"] == "missing" and "cannot start" in line["reason"] for line in failed)
    assert any(line["server"] == "looping" for line in failed)
    assert any(line["event"] == "upstream_crash_loop" and line["server"] == "looping" for line in lines)
    assert 'mcp_tasks_proxy_upstream_processes_total{event="start_failed",server="missing"}' in metrics
    assert 'mcp_tasks_proxy_upstream_processes_total{event="crash_loop",server="looping"}' in metrics


# Asked for `deep`, it first writes a notification nested 1,100 arrays deep (more than JSON parsing
# can follow), then answers like any other tool.
_DEEP_LINE_SERVER = _stdio_script(
    """        if tool == "deep":
            note = '{"jsonrpc":"2.0","method":"notifications/message","params":{"data":'
            sys.stdout.write(note + "[" * 1100 + "]" * 1100 + "}}\\n")
        result = {"content": [{"type": "text", "text": f"{tool} done"}], "isError": False}
"""
)


async def test_a_line_too_deep_to_parse_is_skipped_and_the_child_keeps_serving(
    tmp_path: Path, serve: Serve
) -> None:
    """The line is logged as not JSON-RPC, like any other; the calls before and after it answer at
    once. (It killed the reader: every call on that child then waited out its `timeout`.)"""
    script = tmp_path / "deep_line.py"
    script.write_text(_DEEP_LINE_SERVER)
    config = config_from_data(
        {
            "store": {"path": str(tmp_path / "store"), "durable": False},
            "tasks": {"detach_after": "10s"},
            "mcpServers": {"deep": {"command": sys.executable, "args": [str(script)], "timeout": "20s"}},
        }
    )
    proxy = await serve(config)
    client = ModernClient(proxy.url("deep"), capabilities={})
    try:
        async with asyncio.timeout(5):
            assert (await client.call("deep")).result["content"][0]["text"] == "deep done"
            assert (await client.call("after")).result["content"][0]["text"] == "after done"
    finally:
        await client.close()
