"""A retried call never runs twice (issue "idempotency keys, duplicate joining"): a `tools/call` with
an idempotency key (the `Idempotency-Key` header or `params._meta["mcp-tasks-proxy/idempotencyKey"]`)
joins the call its key already names, and a tool with `dedupe` joins identical calls. The legacy
fixture server (official `mcp` SDK) counts the starts of `slow_compute` by label."""

from __future__ import annotations

import asyncio
import json
import sys
import uuid
from pathlib import Path

import aiohttp
import fastmcp_tasks  # noqa: F401  (registers the tasks extension on every Client)
import pytest
from fastmcp import Client
from mcp.client.session import ClientSession
from mcp.client.streamable_http import streamable_http_client
from support.clients import LEGACY_HEADERS as RAW_LEGACY_HEADERS
from support.clients import LEGACY_INITIALIZE, TASKS_CAPS, AuthClient, ModernClient, envelope
from support.console import CONSOLE_TOKEN, client_for, console_config
from support.proxy import Serve, make_config, running_proxy, stdio_config, with_auth
from support.servers import ROOT, ServerProcess, free_port
from support.v1_client import V1Client

from proxy.calls.keys import KEY_META
from proxy.front.auth import hash_token

KEY = "Idempotency-Key"
FIXTURE_SERVER = ROOT / "tests" / "fixtures" / "legacy_server.py"
LEGACY_HEADERS = {**RAW_LEGACY_HEADERS, "MCP-Protocol-Version": "2025-11-25"}


def fresh(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


async def starts(client: ModernClient, label: str) -> int:
    """How often the upstream started `slow_compute` for `label` (asked without the tasks
    extension, so a loaded host never turns the answer into a task)."""
    reply = await client.request("tools/call", {"name": "started_log", "arguments": {}}, capabilities={})
    return int(json.loads(reply.result["content"][0]["text"]).get(label, 0))


async def joined_count(base: str) -> float:
    """`calls_total{outcome="joined"}` of `slow_compute` on server `legacy`, from /metrics."""
    async with aiohttp.ClientSession() as http, http.get(f"{base}/metrics") as resp:
        text = await resp.text()
    series = 'mcp_tasks_proxy_calls_total{outcome="joined",server="legacy",tool="slow_compute"} '
    return sum(float(line.removeprefix(series)) for line in text.splitlines() if line.startswith(series))


async def test_a_retry_after_a_cut_request_joins_the_call_and_the_upstream_runs_it_once(
    legacy_url: str, tmp_path: Path
) -> None:
    """The first request is cut 20 ms in, before its handle (detach after 50 ms): the call goes on
    as a task under the key, a task-capable retry gets that task and a plain retry its result."""
    label, key = fresh("cut"), fresh("key")
    async with running_proxy(make_config(legacy_url, tmp_path)) as proxy:
        client = ModernClient(proxy.url())
        plain = ModernClient(proxy.url(), capabilities={})
        try:
            await client.warm_up()
            params = {"name": "slow_compute", "arguments": {"seconds": 0.5, "label": label}}
            body = {
                "jsonrpc": "2.0",
                "id": 1,
                "method": "tools/call",
                "params": {**params, "_meta": envelope(client.capabilities)},
            }
            headers = {**client.headers_for("tools/call", params), KEY: key}
            with pytest.raises(asyncio.TimeoutError):
                async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.02)) as http:
                    async with http.post(proxy.url(), json=body, headers=headers) as resp:
                        await resp.read()
            retried = await client.call("slow_compute", {"seconds": 0.5, "label": label}, headers={KEY: key})
            assert retried.result["resultType"] == "task", retried.message
            done = await client.wait_terminal(retried.result["taskId"])
            assert done["result"]["content"][0]["text"] == f"computed {label} after 0.5s"
            again = await plain.call("slow_compute", {"seconds": 0.5, "label": label}, headers={KEY: key})
            assert again.result["content"][0]["text"] == f"computed {label} after 0.5s"
            assert await starts(client, label) == 1
        finally:
            await client.close()
            await plain.close()


async def test_an_answer_given_synchronously_is_kept_under_its_key(
    legacy_url: str, tmp_path: Path, serve: Serve, capsys: pytest.CaptureFixture[str]
) -> None:
    """A plain (attached) call keeps its outcome under its key before it answers: the retry after a
    cut answer gets the same answer, the key given in the header or in `_meta` alike; the key
    reused for other arguments is refused (HTTP 422) and never runs; a key that is not a short
    printable string is refused (HTTP 400)."""
    label, other, key = fresh("sync"), fresh("other"), fresh("key")
    proxy = await serve(make_config(legacy_url, tmp_path))
    plain = ModernClient(proxy.url(), capabilities={})
    try:
        arguments = {"seconds": 0.01, "label": label}
        joined_before = await joined_count(proxy.base)
        first = await plain.call("slow_compute", arguments, headers={KEY: key})
        by_header = await plain.call("slow_compute", arguments, headers={KEY: key})
        by_meta = await plain.call("slow_compute", arguments, meta={KEY_META: key})
        assert first.result == by_header.result == by_meta.result
        assert first.result["content"][0]["text"] == f"computed {label} after 0.01s"
        conflict = await plain.call("slow_compute", {"seconds": 0.01, "label": other}, headers={KEY: key})
        assert conflict.status == 422 and conflict.error["code"] == -32602, conflict.message
        assert "idempotency key" in conflict.error["message"]
        for bad in ("", "x" * 256, "tab\there", 7):
            refused = await plain.call("slow_compute", arguments, meta={KEY_META: bad})
            assert refused.status == 400 and refused.error["code"] == -32602, (bad, refused.message)
        assert await starts(plain, label) == 1 and await starts(plain, other) == 0
        assert await joined_count(proxy.base) - joined_before == 2  # the two retries (a process-wide counter)
        logged = capsys.readouterr()
        assert "call_joined" in logged.err + logged.out and "call_key_conflict" in logged.err + logged.out
    finally:
        await plain.close()


async def test_a_key_belongs_to_its_principal(legacy_url: str, tmp_path: Path, serve: Serve) -> None:
    """The same key from two principals names two calls: each runs once, for its own principal."""
    tokens = {"alice": hash_token("alice-secret-123"), "bob": hash_token("bob-secret-1234")}
    proxy = await serve(with_auth(legacy_url, tmp_path, {"mode": "bearer", "tokens": tokens}))
    alice = AuthClient(proxy.url(), {"Authorization": "Bearer alice-secret-123"})
    bob = AuthClient(proxy.url(), {"Authorization": "Bearer bob-secret-1234"})
    label, key = fresh("who"), fresh("key")
    try:
        arguments = {"seconds": 0.3, "label": label}
        created = [
            (await who.call("slow_compute", arguments, headers={KEY: key})).result
            for who in (alice, bob, alice)
        ]
        assert [c["resultType"] for c in created] == ["task"] * 3, created
        assert created[0]["taskId"] == created[2]["taskId"] != created[1]["taskId"]
        assert "unknown" in (await alice.get(created[1]["taskId"])).error["message"]  # bob's
        assert (await alice.wait_terminal(created[0]["taskId"]))["status"] == "completed"
        assert (await bob.wait_terminal(created[1]["taskId"]))["status"] == "completed"
        assert await starts(alice, label) == 2
    finally:
        await alice.close()
        await bob.close()


async def test_a_key_holds_across_a_restart(legacy_url: str, tmp_path: Path, serve: Serve) -> None:
    """The slot lives in the task store: after a restart on the same store the retry gets the task
    the key named (its outcome once it ended), and the upstream runs the call once."""
    label, key = fresh("restart"), fresh("key")
    arguments = {"seconds": 0.2, "label": label}
    first = await serve(make_config(legacy_url, tmp_path))
    client = ModernClient(first.url())
    try:
        created = (await client.call("slow_compute", arguments, headers={KEY: key})).result
        assert (await client.wait_terminal(created["taskId"]))["status"] == "completed"
        await first.stop()
        second = await serve(make_config(legacy_url, tmp_path))
        client.url = second.url()
        retried = await client.call("slow_compute", arguments, headers={KEY: key})
        assert retried.result["content"][0]["text"] == f"computed {label} after 0.2s", retried.message
        assert await starts(client, label) == 1
    finally:
        await client.close()


async def test_a_key_holds_across_a_restart_that_came_while_its_call_ran(
    legacy_url: str, tmp_path: Path, serve: Serve
) -> None:
    """A restart while the keyed call runs: the stopping proxy cancels the call and records its
    task as failed by the shutdown; the retry on the restarted proxy gets that outcome, the task's
    own error (the call ended: the stored outcome, saying the shutdown stopped it), never a second run."""
    label, key = fresh("restart-running"), fresh("key")
    arguments = {"seconds": 30, "label": label}
    first = await serve(make_config(legacy_url, tmp_path))
    client = ModernClient(first.url())
    try:
        created = (await client.call("slow_compute", arguments, headers={KEY: key})).result
        assert created["resultType"] == "task"
        await client.wait_status(created["taskId"], ("working",))
        await first.stop()
        second = await serve(make_config(legacy_url, tmp_path))
        client.url = second.url()
        retried = await client.call("slow_compute", arguments, headers={KEY: key})
        task = (await client.get(created["taskId"])).result
        assert task["status"] == "failed" and retried.error == task["error"], retried.message
        assert "shut down while this call was running" in retried.error["message"]
        assert await starts(client, label) == 1
    finally:
        await client.close()


@pytest.mark.parametrize("dedupe", [True, False], ids=["dedupe", "no-dedupe"])
async def test_dedupe_joins_identical_calls_without_a_key(
    legacy_url: str, tmp_path: Path, serve: Serve, dedupe: bool
) -> None:
    """`tools.<tool>.dedupe` joins a blind retry (same principal, tool and arguments) to the call
    still running or ended within the window; without it, two identical calls are two calls."""
    tools = {"slow_compute": {"dedupe": {"window": "10m"}}} if dedupe else {}
    proxy = await serve(make_config(legacy_url, tmp_path, server={"tasks": {"tools": tools}}))
    client = ModernClient(proxy.url())
    label = fresh("dedupe")
    try:
        arguments = {"seconds": 0.3, "label": label}
        first, second = [(await client.call("slow_compute", arguments)).result for _ in range(2)]
        assert (first["taskId"] == second["taskId"]) is dedupe
        await client.wait_terminal(second["taskId"])
        after = await client.call("slow_compute", arguments)
        if dedupe:  # ended within the window: its outcome
            assert after.result["content"][0]["text"] == f"computed {label} after 0.3s"
        assert await starts(client, label) == (1 if dedupe else 3)
    finally:
        await client.close()


async def test_fastmcp_client_passes_the_key_in_meta(legacy_url: str, tmp_path: Path, serve: Serve) -> None:
    """FastMCP's client (2026-07-28, tasks extension) gives the key in `call_tool(meta=…)`: the
    second call with it gets the first one's result, and the upstream runs the call once."""
    proxy = await serve(make_config(legacy_url, tmp_path))
    label, key = fresh("fastmcp"), fresh("key")
    async with Client(proxy.url()) as client:
        assert client.protocol_version == "2026-07-28"
        arguments = {"seconds": 0.2, "label": label}
        results = [await client.call_tool("slow_compute", arguments, meta={KEY_META: key}) for _ in range(2)]
        counted = await client.call_tool("started_log", {})
    assert [r.content[0].text for r in results] == [f"computed {label} after 0.2s"] * 2
    assert json.loads(counted.content[0].text)[label] == 1


async def test_a_v1_task_request_with_a_key_joins_the_task_its_key_names(
    legacy_url: str, tmp_path: Path, serve: Serve
) -> None:
    """A 2025-11-25 client asking for a v1 task (`params.task`) with the key in `_meta`: the retry
    gets the same task, and after it ended still that task (a task-augmented request is answered
    with a CreateTaskResult, whose result comes from tasks/result; it got the bare result, which a
    TypeScript 1.x client's schema check refuses); the upstream ran once."""
    proxy = await serve(make_config(legacy_url, tmp_path))
    v1 = V1Client(proxy.url())
    label, key = fresh("v1"), fresh("key")
    try:
        await v1.initialize()
        arguments = {"seconds": 0.3, "label": label}
        first, again = [
            await v1.call_as_task("slow_compute", arguments, meta={KEY_META: key}) for _ in range(2)
        ]
        assert first["taskId"] == again["taskId"]
        _, message, _ = await v1.request("tasks/result", {"taskId": first["taskId"]})
        assert message["result"]["content"][0]["text"] == f"computed {label} after 0.3s"
        params = {"name": "slow_compute", "arguments": arguments, "task": {}, "_meta": {KEY_META: key}}
        _, ended, _ = await v1.request("tools/call", params)
        task = ended["result"]["task"]
        assert task["taskId"] == first["taskId"] and task["status"] == "completed", ended
        _, counted, _ = await v1.request("tools/call", {"name": "started_log", "arguments": {}})
        assert json.loads(counted["result"]["content"][0]["text"])[label] == 1
    finally:
        await v1.close()


async def test_the_console_shows_how_many_requests_a_task_served(
    legacy_url: str, tmp_path: Path, serve: Serve
) -> None:
    """Two retries joined a keyed task: its console detail says it served 3 requests."""
    proxy = await serve(console_config(legacy_url, tmp_path / "store"))
    client = client_for(proxy)
    key = fresh("key")
    try:
        arguments = {"seconds": 0.3, "label": fresh("console")}
        task_ids = {
            (await client.call("slow_compute", arguments, headers={KEY: key})).result["taskId"]
            for _ in range(3)
        }
        assert len(task_ids) == 1
        (task_id,) = task_ids
        async with aiohttp.ClientSession() as http:
            url = f"{proxy.base}/console/api/tasks/{task_id}"
            async with http.get(url, headers={"Authorization": f"Bearer {CONSOLE_TOKEN}"}) as resp:
                assert resp.status == 200 and (await resp.json())["requests"] == 3
    finally:
        await client.close()


@pytest.mark.parametrize("upstream", ["http", "stdio"])
async def test_the_mcp_sdk_client_passes_the_key_in_meta_on_the_legacy_wire(
    legacy_url: str, tmp_path: Path, serve: Serve, upstream: str
) -> None:
    """The official `mcp` SDK client (2025-11-25 handshake, plain `tools/call` relayed on its own
    session, to an HTTP upstream and to a stdio child) gives the key in `call_tool(meta=…)`: the
    second call gets the first one's result, and the upstream ran the call once."""
    config = make_config(legacy_url, tmp_path) if upstream == "http" else stdio_config(tmp_path)
    proxy = await serve(config)
    label, key = fresh("sdk"), fresh("key")
    async with streamable_http_client(proxy.url()) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        arguments = {"seconds": 0.2, "label": label}
        results = [await session.call_tool("slow_compute", arguments, meta={KEY_META: key}) for _ in range(2)]
        counted = await session.call_tool("started_log", {})
    assert [r.content[0].text for r in results] == [f"computed {label} after 0.2s"] * 2
    assert json.loads(counted.content[0].text)[label] == 1


@pytest.mark.parametrize("version", ["2025-11-25", "2025-06-18"])
async def test_a_legacy_call_cut_before_its_answer_is_joined_by_its_retry(
    legacy_url: str, tmp_path: Path, version: str
) -> None:
    """A handshake-era client's keyed `tools/call` is cut 50 ms in: the relay goes on without it
    and keeps the answer under the key, and the retry gets it; the upstream ran the call once. The
    key reused with other arguments is refused and never run."""
    label, key = fresh("legacy-cut"), fresh("key")
    initialize = {**LEGACY_INITIALIZE, "params": {**LEGACY_INITIALIZE["params"], "protocolVersion": version}}
    async with running_proxy(make_config(legacy_url, tmp_path)) as proxy:
        async with aiohttp.ClientSession() as http:
            async with http.post(proxy.url(), json=initialize, headers=LEGACY_HEADERS) as resp:
                assert (await resp.text()).count(version) >= 1
                headers = {
                    **LEGACY_HEADERS,
                    "Mcp-Session-Id": resp.headers["Mcp-Session-Id"],
                    "MCP-Protocol-Version": version,
                    KEY: key,
                }
            params = {"name": "slow_compute", "arguments": {"seconds": 0.4, "label": label}}
            body = {"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": params}
            with pytest.raises(asyncio.TimeoutError):
                async with http.post(
                    proxy.url(), json=body, headers=headers, timeout=aiohttp.ClientTimeout(total=0.05)
                ) as cut:
                    await cut.read()
            async with http.post(proxy.url(), json={**body, "id": 3}, headers=headers) as resp:
                text = await resp.text()
            answer = (
                json.loads(text.split("data: ")[-1])
                if text.startswith(("event", "data", ":", "id"))
                else json.loads(text)
            )
            assert (
                answer["id"] == 3 and answer["result"]["content"][0]["text"] == f"computed {label} after 0.4s"
            ), answer
            counted = {
                "jsonrpc": "2.0",
                "id": 4,
                "method": "tools/call",
                "params": {"name": "started_log", "arguments": {}},
            }
            unkeyed = {name: value for name, value in headers.items() if name != KEY}
            async with http.post(proxy.url(), json=counted, headers=unkeyed) as resp:
                text = await resp.text()
            assert f'\\"{label}\\": 1' in text, text
            # the key reused with other arguments: refused with the conflict, never run
            other = {"name": "slow_compute", "arguments": {"seconds": 0.1, "label": label + "-other"}}
            conflict = {"jsonrpc": "2.0", "id": 5, "method": "tools/call", "params": other}
            async with http.post(proxy.url(), json=conflict, headers=headers) as resp:
                text = await resp.text()
            refused = json.loads(text.split("data: ")[-1]) if "data: " in text else json.loads(text)
            assert refused["id"] == 5 and refused["error"]["code"] == -32602, refused
            assert key not in refused["error"]["message"]  # the key is a secret of its client
            async with http.post(proxy.url(), json={**counted, "id": 6}, headers=unkeyed) as resp:
                assert f"{label}-other" not in await resp.text()


async def test_a_legacy_retry_that_waits_for_its_keyed_call_gets_keepalives(
    legacy_url: str, tmp_path: Path
) -> None:
    """A handshake-era retry that joins its key's call still running waits on an SSE stream with
    keep-alive comments every `sse_keepalive` (an idle-timeout balancer must not cut it), and gets
    the answer as its event; a retry that takes only JSON gets JSON. (The wait was silent.)"""
    label, key = fresh("legacy-join"), fresh("key")
    config = make_config(legacy_url, tmp_path)
    config.listen.sse_keepalive = 0.1
    params = {"name": "slow_compute", "arguments": {"seconds": 1.2, "label": label}}
    body = {"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": params}
    async with running_proxy(config) as proxy, aiohttp.ClientSession() as http:
        async with http.post(proxy.url(), json=LEGACY_INITIALIZE, headers=LEGACY_HEADERS) as resp:
            headers = {**LEGACY_HEADERS, "Mcp-Session-Id": resp.headers["Mcp-Session-Id"], KEY: key}
        with pytest.raises(asyncio.TimeoutError):
            async with http.post(
                proxy.url(), json=body, headers=headers, timeout=aiohttp.ClientTimeout(total=0.05)
            ) as cut:
                await cut.read()
        json_only = {**headers, "Accept": "application/json"}

        async def join_as_json() -> aiohttp.ClientResponse:
            async with http.post(proxy.url(), json={**body, "id": 4}, headers=json_only) as resp:
                await resp.read()
                return resp

        waiting = asyncio.create_task(join_as_json())
        async with http.post(proxy.url(), json={**body, "id": 3}, headers=headers) as resp:
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            assert resp.headers["Mcp-Session-Id"] == headers["Mcp-Session-Id"]
            text = await resp.text()
        assert text.count(": keepalive") >= 5, text
        answer = json.loads(text.split("data: ")[-1])
        assert answer["id"] == 3 and answer["result"]["content"][0]["text"] == f"computed {label} after 1.2s"
        resp = await waiting
        assert resp.headers["Content-Type"].startswith("application/json")
        assert (await resp.json())["result"] == answer["result"]


async def test_a_task_capable_retry_of_a_call_attached_without_tasks_gets_a_task(
    legacy_url: str, tmp_path: Path, serve: Serve
) -> None:
    """The first request has no tasks extension, so its keyed call stays attached; past
    `detach_after` the call is shared as a task under its key, so a task-capable retry gets that
    task's handle while the first request still gets its result; the upstream ran once."""
    proxy = await serve(make_config(legacy_url, tmp_path))
    plain, tasked = ModernClient(proxy.url(), capabilities={}), ModernClient(proxy.url())
    label, key = fresh("share"), fresh("key")
    try:
        arguments = {"seconds": 0.8, "label": label}
        first = asyncio.ensure_future(plain.call("slow_compute", arguments, headers={KEY: key}))
        await asyncio.sleep(0.3)
        retried = await tasked.call("slow_compute", arguments, headers={KEY: key})
        assert retried.result["resultType"] == "task", retried.message
        done = await tasked.wait_terminal(retried.result["taskId"])
        expected = f"computed {label} after 0.8s"
        assert done["status"] == "completed" and done["result"]["content"][0]["text"] == expected
        assert (await first).result["content"][0]["text"] == expected
        assert await starts(plain, label) == 1
    finally:
        await plain.close()
        await tasked.close()


async def test_a_retry_that_lost_its_mrtr_round_gets_it_again(
    legacy_url: str, tmp_path: Path, serve: Serve
) -> None:
    """A keyed call asks a question (an MRTR round, SEP-2322); a retry with the key (its client lost
    the round) gets the same round back, and its `requestState` carries the call to its end."""
    proxy = await serve(make_config(legacy_url, tmp_path))
    client = ModernClient(proxy.url(), capabilities={"elicitation": {}})
    key = fresh("key")
    try:
        arguments = {"filename": f"{fresh('file')}.txt"}
        first = await client.call("confirm_delete", arguments, headers={KEY: key})
        assert first.result["resultType"] == "input_required", first.message
        again = await client.call("confirm_delete", arguments, headers={KEY: key})
        assert again.result == first.result
        (question,) = first.result["inputRequests"]
        params = {
            "name": "confirm_delete",
            "arguments": arguments,
            "requestState": first.result["requestState"],
            "inputResponses": {question: {"action": "accept", "content": {"confirm": True}}},
        }
        done = await client.request("tools/call", params, headers={KEY: key})
        assert done.result["content"][0]["text"] == f"deleted {arguments['filename']}", done.message
        after = await client.call("confirm_delete", arguments, headers={KEY: key})
        assert after.result == done.result
    finally:
        await client.close()


async def test_a_shared_keyed_call_resumed_with_tasks_detaches_into_its_own_task(
    legacy_url: str, tmp_path: Path, serve: Serve
) -> None:
    """A keyed call without the tasks extension is shared as a task past `detach_after` (its key's
    task), then asks a question (an MRTR round). The answer comes with the tasks extension, and the
    call, still working past the deadline, detaches: into the task it was shared as, whose id
    is taken already (not a second task, not an error)."""
    proxy = await serve(make_config(legacy_url, tmp_path))
    asker = ModernClient(proxy.url(), capabilities={"elicitation": {}})
    key = fresh("key")
    try:
        arguments = {"delay": 0.3, "seconds": 0.6}
        first = await asker.call("ask_then_work", arguments, headers={KEY: key})
        assert first.result["resultType"] == "input_required", first.message
        (question,) = first.result["inputRequests"]
        params = {
            "name": "ask_then_work",
            "arguments": arguments,
            "requestState": first.result["requestState"],
            "inputResponses": {question: {"action": "accept", "content": {"name": "Ada"}}},
        }
        capabilities = {"elicitation": {}, **TASKS_CAPS}
        resumed = await asker.request("tools/call", params, headers={KEY: key}, capabilities=capabilities)
        assert resumed.result["resultType"] == "task", resumed.message
        assert resumed.result["statusMessage"].startswith("still running upstream"), resumed.result
        asker.capabilities = capabilities
        done = await asker.wait_terminal(resumed.result["taskId"])
        assert done["status"] == "completed", done
        assert done["result"]["content"][0]["text"] == "Hello Ada, the work took 0.6s", done
    finally:
        await asker.close()


async def test_a_call_that_never_reached_the_upstream_lets_its_key_go(tmp_path: Path, serve: Serve) -> None:
    """The upstream is down (nothing listens on its port): the keyed call fails without reaching
    it, so its key is let go, and the retry once the upstream is up runs the call."""
    port = free_port()
    proxy = await serve(make_config(f"http://127.0.0.1:{port}/mcp", tmp_path))
    plain = ModernClient(proxy.url(), capabilities={})
    key, label = fresh("key"), fresh("down")
    arguments = {"seconds": 0.01, "label": label}
    try:
        down = await plain.call("slow_compute", arguments, headers={KEY: key})
        assert "unreachable" in down.error["message"], down.message
        upstream = ServerProcess([sys.executable, str(FIXTURE_SERVER), "--port", str(port)])
        try:
            up = await plain.call("slow_compute", arguments, headers={KEY: key})
            assert up.result["content"][0]["text"] == f"computed {label} after 0.01s", up.message
        finally:
            upstream.stop()
    finally:
        await plain.close()


async def test_a_legacy_call_that_never_reached_the_upstream_lets_its_key_go(
    tmp_path: Path, serve: Serve
) -> None:
    """The same on the handshake-era wire: the upstream stops after the session opened, the keyed
    call finds nothing listening; once it is back (a new process), the retry on the old session
    gets its 404 (no such session: it ran nothing), and the retry in a new session runs the call.
    (The slot kept "whether it ran is unknown" for the whole window: the retry could never run.)"""
    port = free_port()
    proxy = await serve(make_config(f"http://127.0.0.1:{port}/mcp", tmp_path))
    key, label = fresh("key"), fresh("legacy-down")
    params = {"name": "slow_compute", "arguments": {"seconds": 0.01, "label": label}}
    body = {"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": params}

    async def session(http: aiohttp.ClientSession) -> dict[str, str]:
        async with http.post(proxy.url(), json=LEGACY_INITIALIZE, headers=LEGACY_HEADERS) as resp:
            assert resp.status == 200, await resp.text()
            return {**LEGACY_HEADERS, "Mcp-Session-Id": resp.headers["Mcp-Session-Id"], KEY: key}

    async with aiohttp.ClientSession() as http:
        upstream = ServerProcess([sys.executable, str(FIXTURE_SERVER), "--port", str(port)])
        try:
            headers = await session(http)
        finally:
            upstream.stop()
        async with http.post(proxy.url(), json=body, headers=headers) as resp:
            text = await resp.text()
        assert "unreachable" in text, text
        upstream = ServerProcess([sys.executable, str(FIXTURE_SERVER), "--port", str(port)])
        try:
            async with http.post(proxy.url(), json={**body, "id": 3}, headers=headers) as resp:
                assert resp.status == 404, await resp.text()  # the new process knows no such session
            async with http.post(proxy.url(), json={**body, "id": 4}, headers=await session(http)) as resp:
                text = await resp.text()
        finally:
            upstream.stop()
    answer = json.loads(text.split("data: ")[-1]) if "data: " in text else json.loads(text)
    assert answer["result"]["content"][0]["text"] == f"computed {label} after 0.01s", answer


async def test_a_keyed_stdio_call_cancelled_before_the_child_had_it_lets_its_key_go(
    tmp_path: Path, serve: Serve
) -> None:
    """A keyed legacy call queued for a stdio child's one slot (`max_concurrency: 1`) and cancelled
    there never reached the child: its key lets go, and the retry runs it. (The slot kept "whether
    it ran is unknown" for the whole window.)"""
    proxy = await serve(stdio_config(tmp_path, server={"max_concurrency": 1}))
    async with aiohttp.ClientSession() as http:
        async with http.post(proxy.url(), json=LEGACY_INITIALIZE, headers=LEGACY_HEADERS) as resp:
            headers = {**LEGACY_HEADERS, "Mcp-Session-Id": resp.headers["Mcp-Session-Id"]}
        busy = {"name": "slow_compute", "arguments": {"seconds": 1.0, "label": fresh("busy")}}
        label = fresh("queued")
        queued = {"name": "slow_compute", "arguments": {"seconds": 0.01, "label": label}}

        async def post(body: dict, extra: dict) -> str:
            async with http.post(proxy.url(), json=body, headers={**headers, **extra}) as resp:
                return await resp.text()

        first = asyncio.ensure_future(
            post({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": busy}, {})
        )
        await asyncio.sleep(0.3)
        body = {"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": queued}
        waiting = asyncio.ensure_future(post(body, {KEY: label}))
        await asyncio.sleep(0.3)
        cancel = {"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 2}}
        assert await post(cancel, {}) == ""
        assert "before it was sent" in await waiting
        await first
        text = await post({**body, "id": 3}, {KEY: label})
    answer = json.loads(text.split("data: ")[-1]) if "data: " in text else json.loads(text)
    assert answer["result"]["content"][0]["text"] == f"computed {label} after 0.01s", answer


async def test_keys_are_read_the_same_whatever_their_spelling(
    legacy_url: str, tmp_path: Path, serve: Serve
) -> None:
    """A JSON null under the `_meta` key leaves the header's key in force; surrounding whitespace
    does not make another key; 1 and 1.0 (and no arguments and `{}`) are the same arguments; two
    `Idempotency-Key` headers are refused."""
    proxy = await serve(make_config(legacy_url, tmp_path))
    plain = ModernClient(proxy.url(), capabilities={})
    key, label = fresh("key"), fresh("spelling")
    try:
        first = await plain.call("slow_compute", {"seconds": 1, "label": label}, headers={KEY: key})
        same = [
            await plain.call("slow_compute", {"seconds": 1.0, "label": label}, headers={KEY: f" {key} "}),
            await plain.call("slow_compute", {"seconds": 1, "label": label}, meta={KEY_META: f"{key}\t"}),
            await plain.call(
                "slow_compute", {"seconds": 1, "label": label}, headers={KEY: key}, meta={KEY_META: None}
            ),
        ]
        assert all(reply.result == first.result for reply in same), [r.message for r in same]
        assert await starts(plain, label) == 1
        body = {
            "jsonrpc": "2.0",
            "id": 9,
            "method": "tools/call",
            "params": {"name": "greet", "arguments": {"name": "x"}, "_meta": envelope({})},
        }
        headers = plain.headers_for("tools/call", body["params"])
        async with plain.http.post(
            plain.url, data=json.dumps(body), headers=[*headers.items(), (KEY, "a"), (KEY, "b")]
        ) as resp:
            assert resp.status == 400 and "one Idempotency-Key" in (await resp.json())["error"]["message"]
    finally:
        await plain.close()


async def test_a_key_keeps_its_outcome_after_its_task_expired(
    legacy_url: str, tmp_path: Path, serve: Serve
) -> None:
    """A keyed task kept 1 s after it ends (`ttl`): once it expired, the retry still gets its result
    from the key, which holds for the window."""
    proxy = await serve(make_config(legacy_url, tmp_path, tasks={"ttl": "1s"}))
    client = ModernClient(proxy.url())
    label, key = fresh("expired"), fresh("key")
    try:
        arguments = {"seconds": 0.2, "label": label}
        created = (await client.call("slow_compute", arguments, headers={KEY: key})).result
        assert (await client.wait_terminal(created["taskId"]))["status"] == "completed"
        await asyncio.sleep(1.5)
        assert "unknown" in (await client.get(created["taskId"])).error["message"]
        retried = await client.call("slow_compute", arguments, headers={KEY: key})
        assert retried.result["content"][0]["text"] == f"computed {label} after 0.2s", retried.message
        assert await starts(client, label) == 1
    finally:
        await client.close()


async def test_an_mrtr_round_nobody_answered_leaves_its_key_with_the_timeout(
    legacy_url: str, tmp_path: Path, serve: Serve
) -> None:
    """A keyed call's question is not answered within `input_timeout` (300 ms): the call fails, and a
    retry with the key gets that failure, not the dead round again."""
    proxy = await serve(make_config(legacy_url, tmp_path, tasks={"input_timeout": "300ms"}))
    client = ModernClient(proxy.url(), capabilities={"elicitation": {}})
    key = fresh("key")
    try:
        arguments = {"filename": f"{fresh('file')}.txt"}
        first = await client.call("confirm_delete", arguments, headers={KEY: key})
        assert first.result["resultType"] == "input_required", first.message
        async with asyncio.timeout(5):
            retried = await client.call("confirm_delete", arguments, headers={KEY: key})
            while "error" not in retried.message:
                await asyncio.sleep(0.1)
                retried = await client.call("confirm_delete", arguments, headers={KEY: key})
        assert "input timed out" in retried.error["message"], retried.message
    finally:
        await client.close()
