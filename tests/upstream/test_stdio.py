"""stdio upstreams: spawn, multiplex, supervise, frame, stop — with the project's fixture server in
stdio mode and `mcp-server-time` from PyPI (a real third-party stdio server)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path

import aiohttp
import psutil
import pytest
from support.clients import ModernClient
from support.proxy import FIXTURE, Serve, stdio_config
from support.servers import ROOT, ServerProcess
from support.v1_client import V1Client

from proxy.app import POOLS_KEY
from proxy.config import config_from_data, load_config

BIN = str(Path(sys.executable).parent)


async def cancelled(client: ModernClient) -> list[dict]:
    return json.loads((await client.call("cancelled_log")).result["content"][0]["text"])


async def test_detach_poll_and_cancel_over_stdio(tmp_path: Path, serve: Serve) -> None:
    proxy = await serve(stdio_config(tmp_path))
    client = ModernClient(proxy.url())
    try:
        fast = await client.call("greet", {"name": "stdio"})
        assert (
            fast.result["content"][0]["text"] == "Hello, stdio!" and fast.result["resultType"] == "complete"
        )
        created = (await client.call("slow_compute", {"seconds": 0.5, "label": "stdio-task"})).result
        assert created["resultType"] == "task"
        assert (await client.get(created["taskId"])).result["taskId"] == created["taskId"]
        done = await client.wait_terminal(created["taskId"])
        assert (
            done["status"] == "completed"
            and done["result"]["content"][0]["text"] == "computed stdio-task after 0.5s"
        )
        # progress reached the task while it ran
        assert done["statusMessage"].endswith("tick 5")
        doomed = (await client.call("slow_compute", {"seconds": 5, "label": "stdio-cancel"})).result
        assert (await client.request("tasks/cancel", {"taskId": doomed["taskId"]})).result == {
            "resultType": "complete"
        }
        async with asyncio.timeout(5):
            while not any(e["label"] == "stdio-cancel" for e in await cancelled(client)):
                await asyncio.sleep(0.05)
        assert (await client.get(doomed["taskId"])).result["status"] == "cancelled"
        failed = (await client.call("protocol_error_job")).result
        assert (await client.wait_terminal(failed["taskId"]))["error"][
            "message"
        ] == "protocol_error_job exploded"
    finally:
        await client.close()


async def test_mcp_server_time_from_pypi(tmp_path: Path, serve: Serve) -> None:
    config = config_from_data(
        {
            "store": {"path": str(tmp_path / "store"), "durable": False},
            "tasks": {"detach_after": "100ms", "poll_interval": "100ms"},
            "mcpServers": {
                "time": {
                    "command": os.path.join(BIN, "mcp-server-time"),
                    "args": ["--local-timezone", "UTC"],
                    "tasks": {"tools": {"get_current_time": {"mode": "required"}}},
                }
            },
        }
    )
    proxy = await serve(config)
    client = ModernClient(proxy.url())
    try:
        tools = (await client.request("tools/list")).result["tools"]
        assert {"get_current_time", "convert_time"} <= {t["name"] for t in tools}
        sync = await client.call(
            "convert_time", {"source_timezone": "UTC", "time": "12:00", "target_timezone": "Europe/Paris"}
        )
        assert "Europe/Paris" in sync.result["content"][0]["text"]
        created = (await client.call("get_current_time", {"timezone": "UTC"})).result
        assert created["resultType"] == "task"
        done = await client.wait_terminal(created["taskId"])
        assert (
            done["status"] == "completed"
            and json.loads(done["result"]["content"][0]["text"])["timezone"] == "UTC"
        )
        another = (await client.call("get_current_time", {"timezone": "UTC"})).result
        assert (await client.request("tasks/cancel", {"taskId": another["taskId"]})).result == {
            "resultType": "complete"
        }
        assert (await client.wait_terminal(another["taskId"]))["status"] in ("cancelled", "completed")
        refused = await client.call("get_current_time", {"timezone": "UTC"}, capabilities={})
        assert refused.error["code"] == -32021
    finally:
        await client.close()


async def test_crash_mid_call_fails_the_task_naming_the_exit_status_and_restarts(
    tmp_path: Path, serve: Serve
) -> None:
    proxy = await serve(stdio_config(tmp_path))
    client = ModernClient(proxy.url())
    try:
        created = (await client.call("crash", {"after": 0.3, "status": 7})).result
        done = await client.wait_terminal(created["taskId"])
        assert done["status"] == "failed"
        assert "exited with status 7" in done["error"]["message"] and "fx" in done["error"]["message"]
        sync = await client.call("crash", {"after": 0, "status": 9}, capabilities={})
        assert "exited with status 9" in sync.error["message"]
        pool = proxy.app[POOLS_KEY]["fx"]
        async with asyncio.timeout(10):  # restarted without waiting for a request
            while not pool.children():
                await asyncio.sleep(0.05)
        assert (await client.call("greet", {"name": "again"}, capabilities={})).result["content"][0][
            "text"
        ] == "Hello, again!"
    finally:
        await client.close()


async def test_garbage_on_stdout_is_skipped_and_stderr_is_logged_with_the_server_name(
    tmp_path: Path, capsys, serve: Serve
) -> None:
    proxy = await serve(stdio_config(tmp_path, server={"env": {"FIXTURE_STDOUT_GARBAGE": "1"}}))
    # capabilities no child was started for yet: this client's first call starts its child
    client = ModernClient(proxy.url(), capabilities={"elicitation": {}})
    try:
        assert (await client.call("log_stderr", {"text": "hello from the child"})).result["content"][0][
            "text"
        ] == "logged"
        assert (await client.call("greet", {"name": "still fine"})).result["content"][0][
            "text"
        ] == "Hello, still fine!"
        await asyncio.sleep(0.1)
    finally:
        await client.close()
    await proxy.stop()
    out = capsys.readouterr()
    logs = out.out + out.err
    assert "upstream_stdout_not_jsonrpc" in logs and "this line is not JSON-RPC" in logs
    assert "upstream_stderr" in logs and "hello from the child" in logs and "fx" in logs
    # the child's lines are its own, not those of the request that happened to start it
    (stderr_line,) = [line for line in logs.splitlines() if "hello from the child" in line]
    assert "request_id" not in stderr_line and "rpc_method" not in stderr_line, stderr_line


async def test_five_megabyte_result(tmp_path: Path, serve: Serve) -> None:
    proxy = await serve(stdio_config(tmp_path))
    client = ModernClient(proxy.url(), capabilities={})
    try:
        reply = await client.call("big_result", {"kb": 5 * 1024})
        assert len(reply.result["content"][0]["text"]) == 5 * 1024 * 1024
    finally:
        await client.close()


async def test_slow_call_never_delays_a_fast_one(tmp_path: Path, serve: Serve) -> None:
    proxy = await serve(stdio_config(tmp_path))
    client = ModernClient(proxy.url(), capabilities={})
    try:
        order: list[str] = []

        async def slow() -> None:
            await client.call("slow_compute", {"seconds": 1.5, "label": "slow"})
            order.append("slow")

        async def fast() -> None:
            await asyncio.sleep(0.2)
            for _ in range(5):
                await client.call("greet", {"name": "fast"})
            order.append("fast")

        await asyncio.gather(slow(), fast())
        assert order == ["fast", "slow"]
    finally:
        await client.close()


async def test_max_concurrency_queues_requests(tmp_path: Path, serve: Serve) -> None:
    proxy = await serve(stdio_config(tmp_path, server={"max_concurrency": 1}))
    client = ModernClient(proxy.url(), capabilities={})
    try:
        order: list[str] = []

        async def slow() -> None:
            await client.call("slow_compute", {"seconds": 0.5, "label": "first"})
            order.append("slow")

        async def fast() -> None:
            await asyncio.sleep(0.1)
            await client.call("greet", {"name": "queued"})
            order.append("fast")

        await asyncio.gather(slow(), fast())
        assert order == ["slow", "fast"]
    finally:
        await client.close()


async def test_instances_pool_and_idle_timeout(tmp_path: Path, serve: Serve) -> None:
    proxy = await serve(stdio_config(tmp_path, server={"instances": 2, "idle_timeout": "2s"}))
    pool = proxy.app[POOLS_KEY]["fx"]
    client = ModernClient(proxy.url(), capabilities={})
    try:
        calls = asyncio.gather(*(client.call("slow_compute", {"seconds": 1}) for _ in range(4)))
        async with asyncio.timeout(10):
            while len(pool.children()) < 2:
                await asyncio.sleep(0.02)
        await calls
        assert len(pool.children()) == 2
        async with asyncio.timeout(10):
            while pool.children():
                await asyncio.sleep(0.05)
        assert (await client.call("greet", {"name": "woken"})).result["content"][0]["text"] == "Hello, woken!"
    finally:
        await client.close()


async def test_crash_loop_is_capped_and_shows_on_readyz(tmp_path: Path, serve: Serve) -> None:
    config = config_from_data(
        {
            "store": {"path": str(tmp_path / "store"), "durable": False},
            "mcpServers": {
                "broken": {
                    "command": sys.executable,
                    "args": ["-c", "import sys; sys.exit(4)"],
                    "max_restarts": 3,
                }
            },
        }
    )
    proxy = await serve(config)
    client = ModernClient(proxy.url(), capabilities={})
    try:
        messages = [(await client.call("anything")).error["message"] for _ in range(3)]
        assert any("status 4" in m or "exited" in m for m in messages)
        assert "crash loop" in messages[-1]
        async with aiohttp.ClientSession() as http, http.get(f"{proxy.base}/readyz") as resp:
            body = await resp.json()
        assert resp.status == 503 and "crash loop" in body["checks"]["upstream:broken"]
    finally:
        await client.close()


def _proxy_with_stdio_children(tmp_path: Path) -> tuple[ServerProcess, list[int]]:
    config_file = tmp_path / "stdio.json"
    config_file.write_text(
        json.dumps(
            {
                "store": {"path": str(tmp_path / "store")},
                "mcpServers": {"fx": {"command": FIXTURE[0], "args": FIXTURE[1:], "instances": 2}},
            }
        )
    )
    proxy = ServerProcess([sys.executable, "-m", "proxy", "--config", str(config_file), "--port", "0"])
    deadline = time.monotonic() + 10
    children: list[int] = []
    while time.monotonic() < deadline:
        children = [p.pid for p in psutil.Process(proxy.proc.pid).children(recursive=True)]
        if children:
            break
        time.sleep(0.05)
    assert children, "the proxy started no stdio child"
    return proxy, children


def _gone(pids: list[int], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [
            p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
        ]
        if not alive:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
def test_no_child_outlives_the_proxy(tmp_path: Path, how: str) -> None:
    proxy, children = _proxy_with_stdio_children(tmp_path)
    try:
        proxy.proc.send_signal(getattr(signal, how))
        proxy.proc.wait(timeout=10)
        assert _gone(children), f"stdio children survived {how} of the proxy"
    finally:
        proxy.stop()
        for pid in children:
            if psutil.pid_exists(pid):
                os.kill(pid, signal.SIGKILL)


async def test_claude_desktop_config_pasted_unchanged_loads_and_serves(
    monkeypatch, tmp_path: Path, serve: Serve
) -> None:
    monkeypatch.setenv("PATH", BIN + os.pathsep + os.environ["PATH"])
    monkeypatch.chdir(ROOT)
    config = load_config(ROOT / "config" / "claude_desktop.json")
    config.store.path = str(tmp_path / "store")
    assert set(config.servers) == {"time", "fixture", "demo"}
    proxy = await serve(config)
    for name, tool in (("time", "get_current_time"), ("fixture", "greet"), ("demo", "echo")):
        client = ModernClient(proxy.url(name), capabilities={})
        try:
            tools = (await client.request("tools/list")).result["tools"]
            assert tool in {t["name"] for t in tools}, name
        finally:
            await client.close()


async def test_legacy_sdk_client_in_front_of_a_stdio_server(tmp_path: Path, serve: Serve) -> None:
    import mcp.types as types
    from mcp.client.session import ClientRequestContext, ClientSession
    from mcp.client.streamable_http import streamable_http_client
    from mcp.shared.exceptions import MCPError

    async def on_elicit(
        context: ClientRequestContext, params: types.ElicitRequestParams
    ) -> types.ElicitResult:
        return types.ElicitResult(action="accept", content={"confirm": True})

    progress: list[float] = []

    async def on_progress(p: float, total: float | None, message: str | None) -> None:
        progress.append(p)

    proxy = await serve(stdio_config(tmp_path))
    async with streamable_http_client(proxy.url()) as (read, write):
        async with ClientSession(read, write, elicitation_callback=on_elicit) as session:
            init = await session.initialize()
            assert init.server_info.name
            assert {"greet", "confirm_delete"} <= {t.name for t in (await session.list_tools()).tools}
            assert (await session.call_tool("greet", {"name": "legacy"})).content[0].text == "Hello, legacy!"
            assert (await session.call_tool("confirm_delete", {"filename": "s.txt"})).content[
                0
            ].text == "deleted s.txt"
            slow = await session.call_tool(
                "slow_compute", {"seconds": 0.3, "label": "lp"}, progress_callback=on_progress
            )
            assert slow.content[0].text == "computed lp after 0.3s" and len(progress) >= 2
            with pytest.raises(MCPError) as info:
                await session.call_tool("instant_error", {})
            assert info.value.code == -32603


async def test_a_question_on_a_shared_child_is_refused_when_it_could_belong_to_several_calls(
    tmp_path: Path,
    serve: Serve,
) -> None:
    proxy = await serve(stdio_config(tmp_path))
    client = ModernClient(proxy.url(), capabilities={"elicitation": {}})
    try:
        await client.warm_up()
        slow = asyncio.create_task(client.call("slow_compute", {"seconds": 1.5, "label": "bystander"}))
        await asyncio.sleep(0.3)
        asked = await client.call("confirm_delete", {"filename": "ambiguous.txt"})
        # never shown to a guessed caller
        assert "error" in asked.message or asked.result.get("isError"), asked.message
        log = json.loads((await client.call("cancelled_log")).result["content"][0]["text"])
        assert any(e["label"] == "confirm_delete:ambiguous.txt" for e in log)
        assert (await slow).result["content"][0]["text"] == "computed bystander after 1.5s"
        # One call in flight: the question reaches its caller as an MRTR round.
        alone = (await client.call("confirm_delete", {"filename": "alone.txt"})).result
        assert alone["resultType"] == "input_required"
    finally:
        await client.close()


async def test_per_principal_isolation_gives_each_principal_its_own_child(
    tmp_path: Path, serve: Serve
) -> None:
    from support.clients import AuthClient

    from proxy.front.auth import hash_token

    config = stdio_config(tmp_path, server={"isolation": "per_principal"})
    config.auth = type(config.auth).model_validate(
        {
            "mode": "bearer",
            "tokens": {
                "alice": hash_token("alice-token-for-tests"),
                "bob": hash_token("bob-token-for-tests"),
            },
        }
    )
    proxy = await serve(config)
    pool = proxy.app[POOLS_KEY]["fx"]
    alice = AuthClient(
        proxy.url(), {"Authorization": "Bearer alice-token-for-tests"}, capabilities={"elicitation": {}}
    )
    bob = AuthClient(
        proxy.url(), {"Authorization": "Bearer bob-token-for-tests"}, capabilities={"elicitation": {}}
    )
    try:
        slow = asyncio.create_task(alice.call("slow_compute", {"seconds": 1.5, "label": "alice-work"}))
        await asyncio.sleep(0.2)
        asked = (await bob.call("confirm_delete", {"filename": "bob.txt"})).result
        assert asked["resultType"] == "input_required"  # bob's own child: no ambiguity
        assert len(pool.children()) >= 2
        key = next(iter(asked["inputRequests"]))
        retry = {
            "name": "confirm_delete",
            "arguments": {"filename": "bob.txt"},
            "inputResponses": {key: {"action": "accept", "content": {"confirm": True}}},
            "requestState": asked["requestState"],
        }
        assert (await bob.request("tools/call", retry)).result["content"][0]["text"] == "deleted bob.txt"
        await slow
    finally:
        await alice.close()
        await bob.close()


NULL_ID_CHILD = """
import json, sys
for line in sys.stdin:
    msg = json.loads(line)
    if msg.get("method") == "initialize":
        info = {"name": "n", "version": "0"}
        result = {"protocolVersion": "2025-06-18", "capabilities": {"tools": {}}, "serverInfo": info}
        out = {"jsonrpc": "2.0", "id": msg["id"], "result": result}
    elif msg.get("method") == "tools/list":
        tool = {"name": "x", "inputSchema": {"type": "object"}}
        out = {"jsonrpc": "2.0", "id": msg["id"], "result": {"tools": [tool]}}
    elif "id" in msg and "method" in msg:
        out = {"jsonrpc": "2.0", "id": None, "error": {"code": -32600, "message": "cannot read that request"}}
    else:
        continue
    print(json.dumps(out), flush=True)
"""


async def test_a_childs_error_with_a_null_id_answers_the_one_waiting_request(
    tmp_path: Path, serve: Serve
) -> None:
    """The stdio bridge as the relay: an error the child sends with a null id is its answer to the
    request waiting (here the only one), at once, not a wait until `timeout`."""
    config = stdio_config(
        tmp_path, {"command": sys.executable, "args": ["-c", NULL_ID_CHILD], "timeout": "20s"}
    )
    proxy = await serve(config)
    client = ModernClient(proxy.url(), capabilities={})
    legacy = V1Client(proxy.url(), capabilities={})
    try:
        async with asyncio.timeout(5):
            reply = await client.call("x")
            await legacy.initialize()
            status, answer, _ = await legacy.request("tools/call", {"name": "x", "arguments": {}})
    finally:
        await client.close()
        await legacy.close()
    assert reply.error["code"] == -32600 and "cannot read" in reply.error["message"]
    assert status == 200 and answer["id"] == 1 and "cannot read" in answer["error"]["message"], answer


async def test_a_lone_surrogate_for_a_stdio_child_is_refused_at_once(tmp_path: Path, serve: Serve) -> None:
    """A stdio child cannot read a line with a lone surrogate and never answers it: the proxy refuses
    such a request at once, both eras, instead of waiting for the call's `timeout`."""
    proxy = await serve(stdio_config(tmp_path, {"timeout": "30s", "request_timeout": "30s"}))
    client = ModernClient(proxy.url(), capabilities={})
    legacy = V1Client(proxy.url(), capabilities={})
    try:
        async with asyncio.timeout(5):
            reply = await client.call("greet", {"name": "\ud800"})
            await legacy.initialize()
            status, answer, _ = await legacy.request(
                "tools/call", {"name": "greet", "arguments": {"name": "\udfff"}}
            )
            fine = await client.call("greet", {"name": "\U0001f600"})  # a pair is text: it passes
    finally:
        await client.close()
        await legacy.close()
    assert "lone surrogate" in reply.error["message"], reply.message
    assert "lone surrogate" in answer["error"]["message"], answer
    assert fine.result["content"][0]["text"] == "Hello, \U0001f600!"


async def test_a_task_capable_call_queued_behind_max_concurrency_gets_its_handle_at_detach_after(
    tmp_path: Path, serve: Serve
) -> None:
    """`detach_after` (100 ms) counts from the request's arrival while it waits for a
    `max_concurrency` slot: the handle comes long before the slot frees (1 s), and the call runs after."""
    proxy = await serve(stdio_config(tmp_path, server={"max_concurrency": 1}))
    plain = ModernClient(proxy.url(), capabilities={})
    tasks = ModernClient(proxy.url())
    try:
        holding = asyncio.ensure_future(plain.call("slow_compute", {"seconds": 1, "label": "holder"}))
        await asyncio.sleep(0.1)
        started = time.monotonic()
        queued = await tasks.call("slow_compute", {"seconds": 0.1, "label": "queued"})
        waited = time.monotonic() - started
        assert "taskId" in queued.result and waited < 0.6, (waited, queued.message)
        done = await tasks.wait_terminal(queued.result["taskId"], timeout=10)
        assert done["status"] == "completed" and "computed queued" in json.dumps(done)
        await holding
    finally:
        await plain.close()
        await tasks.close()
