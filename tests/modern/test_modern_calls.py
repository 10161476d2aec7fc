"""Modern-era (2026-07-28) tools/call through the proxy: sync results, detach into tasks, tasks/* rules.

Raw HTTP against a real legacy upstream (tests/fixtures/legacy_server.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import sys
import time
from collections.abc import Iterator

import pytest
from support.clients import ModernClient, envelope
from support.proxy import RunningProxy, Serve, make_config
from support.servers import ServerProcess

from proxy.app import TASKS_KEY
from proxy.config import config_from_data
from proxy.protocol.sse import iter_events
from proxy.tasks.model import Change, TaskStatus

ISO = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}")


async def cancelled_labels(client: ModernClient) -> list[str]:
    """Labels of slow_compute calls the upstream saw cancelled."""
    reply = await client.call("cancelled_log")
    return [entry.get("label") for entry in json.loads(reply.result["content"][0]["text"])]


async def test_fast_call_returns_plain_result(flow_client: ModernClient) -> None:
    reply = await flow_client.call("greet", {"name": "World"})
    assert reply.status == 200
    assert reply.result["resultType"] == "complete"
    assert reply.result["content"][0]["text"] == "Hello, World!"
    assert "taskId" not in reply.result


async def test_slow_call_becomes_task_and_completes(
    flow_client: ModernClient, flow_proxy: RunningProxy
) -> None:
    reply = await flow_client.call("slow_compute", {"seconds": 0.5, "label": "lifecycle"})
    created = reply.result
    assert created["resultType"] == "task"
    for key in ("taskId", "status", "createdAt", "lastUpdatedAt", "ttlMs", "pollIntervalMs", "statusMessage"):
        assert key in created, key
    assert ISO.match(created["createdAt"]) and ISO.match(created["lastUpdatedAt"])
    assert created["ttlMs"] == 600_000 and created["pollIntervalMs"] == 100
    assert (
        not {"task", "result", "error", "inputRequests", "ttl", "pollInterval", "requestState"}
        & created.keys()
    )
    assert len(created["taskId"]) >= 22  # >= 128 bits of urlsafe base64
    # The record is committed before the handle is sent: an immediate poll resolves.
    first = (await flow_client.get(created["taskId"])).result
    assert first["taskId"] == created["taskId"] and first["resultType"] == "complete"
    done = await flow_client.wait_terminal(created["taskId"])
    assert done["status"] == "completed"
    assert done["result"]["content"][0]["text"] == "computed lifecycle after 0.5s"
    assert done["result"]["resultType"] == "complete"
    assert (await flow_proxy.store.get(created["taskId"])).status == "completed"


async def test_without_extension_slow_call_stays_synchronous(proxy: RunningProxy) -> None:
    plain = ModernClient(proxy.url(), capabilities={})
    try:
        reply = await plain.call("slow_compute", {"seconds": 0.3, "label": "sync"})
        assert reply.result["resultType"] == "complete"
        assert reply.result["content"][0]["text"] == "computed sync after 0.3s"
    finally:
        await plain.close()


async def test_progress_updates_status_message_of_detached_call(flow_client: ModernClient) -> None:
    created = (await flow_client.call("slow_compute", {"seconds": 1, "label": "progress"})).result
    async with asyncio.timeout(5):
        while True:
            task = (await flow_client.get(created["taskId"])).result
            if re.match(r"^\d+/10: tick \d+$", task.get("statusMessage", "")):
                break
            await asyncio.sleep(0.05)
    await flow_client.wait_terminal(created["taskId"])


async def test_progress_of_a_detached_call_is_written_at_most_once_per_progress_interval(
    legacy_url: str, tmp_path, serve: Serve
) -> None:
    # slow_compute sends progress every 0.1 s: 15 notifications in 1.5 s. With progress_interval
    # 400ms the record changes at most once per 0.4 s, the task's create counting as the first
    # write, so a client polling every 20 ms sees the create's text, then at most 4 progress texts
    # while the call works (one write per notification shows ~15), the first of them no sooner
    # than one interval after the handle (less the time the handle took to arrive).
    server = {"tasks": {"detach_after": "20ms", "progress_interval": "400ms"}}
    proxy = await serve(make_config(legacy_url, tmp_path / "s", server=server))
    client = ModernClient(proxy.url())
    try:
        created = (await client.call("slow_compute", {"seconds": 1.5, "label": "coalesced"})).result
        handed = time.monotonic()
        seen: list[tuple[float, str]] = []
        async with asyncio.timeout(10):
            while (task := (await client.get(created["taskId"])).result)["status"] == "working":
                if task.get("statusMessage") and task["statusMessage"] not in [text for _, text in seen]:
                    seen.append((time.monotonic() - handed, task["statusMessage"]))
                await asyncio.sleep(0.02)
        assert task["status"] == "completed", task
        assert re.match(r"^(\d+)/\1: tick \1$", task["statusMessage"]), task  # the last text landed
        assert 2 <= len(seen) <= 5, seen
        assert "tick" not in seen[0][1], seen  # the create's own text first
        assert seen[1][0] >= 0.3, seen  # no progress write right behind the create
    finally:
        await client.close()


async def test_progress_is_relayed_on_sse_for_synchronous_call(proxy: RunningProxy) -> None:
    plain = ModernClient(proxy.url(), capabilities={})
    try:
        reply = await plain.call(
            "slow_compute", {"seconds": 0.3, "label": "sse"}, meta={"progressToken": "p-1"}
        )
        assert reply.content_type.startswith("text/event-stream")
        progress = [n for n in reply.notifications if n["method"] == "notifications/progress"]
        assert len(progress) >= 2
        assert all(n["params"]["progressToken"] == "p-1" for n in progress)
        assert reply.result["content"][0]["text"] == "computed sse after 0.3s"
    finally:
        await plain.close()


async def test_a_synchronous_call_relaying_progress_gets_every_notification_and_its_result(
    legacy_url: str, tmp_path, serve: Serve
) -> None:
    """A call's wait for its next events has one wake-up: notifications relayed before it rings
    neither end the wait early nor add a keepalive each (one at most every `sse_keepalive`)."""
    config = make_config(legacy_url, tmp_path / "store", tasks={"detach_after": "10s"})
    config.listen.sse_keepalive = 0.15  # progress comes every 0.1 s: more often than the keepalive
    proxy = await serve(config)
    plain = ModernClient(proxy.url(), capabilities={})
    try:
        params = {
            "name": "slow_compute",
            "arguments": {"seconds": 0.7, "label": "kept"},
            "_meta": {**envelope({}), "progressToken": "p-2"},
        }
        body = {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": params}
        async with plain.http.post(
            plain.url, data=json.dumps(body), headers=plain.headers_for("tools/call", params)
        ) as resp:
            raw = await asyncio.wait_for(resp.read(), timeout=10)
        events = [
            json.loads(line[len(b"data: ") :]) for line in raw.splitlines() if line.startswith(b"data: ")
        ]
        progress = [e for e in events if e.get("method") == "notifications/progress"]
        assert len(progress) >= 4 and all(e["params"]["progressToken"] == "p-2" for e in progress)
        steps = [e["params"]["progress"] for e in progress]
        assert steps == sorted(set(steps)), steps  # each once, in order, queued or written at once
        assert raw.count(b": keepalive") <= 6, raw  # one per 0.15 s at most in 0.7 s
        assert events[-1]["result"]["content"][0]["text"] == "computed kept after 0.7s"
    finally:
        await plain.close()


async def test_tool_error_ends_completed_with_is_error(flow_client: ModernClient) -> None:
    created = (await flow_client.call("failing_job")).result
    assert created["resultType"] == "task"
    done = await flow_client.wait_terminal(created["taskId"])
    assert done["status"] == "completed"
    assert done["result"]["isError"] is True


async def test_upstream_jsonrpc_error_ends_failed_with_error_inlined(flow_client: ModernClient) -> None:
    created = (await flow_client.call("protocol_error_job")).result
    done = await flow_client.wait_terminal(created["taskId"])
    assert done["status"] == "failed"
    assert done["error"] == {"code": -32603, "message": "protocol_error_job exploded"}
    assert "result" not in done
    assert "protocol_error_job exploded" in done["statusMessage"]


async def test_fast_upstream_error_is_a_synchronous_jsonrpc_error(client: ModernClient) -> None:
    await client.warm_up()  # the upstream session is open: only the call counts
    reply = await client.call("instant_error")
    assert reply.error["code"] == -32603
    assert "instant_error exploded" in reply.error["message"]


async def test_cancel_is_sticky_and_reaches_upstream(flow_client: ModernClient) -> None:
    created = (await flow_client.call("slow_compute", {"seconds": 0.6, "label": "cancel-sticky"})).result
    ack = await flow_client.request("tasks/cancel", {"taskId": created["taskId"]})
    assert ack.result == {"resultType": "complete"}
    assert (await flow_client.get(created["taskId"])).result["status"] == "cancelled"
    async with asyncio.timeout(5):
        while "cancel-sticky" not in await cancelled_labels(flow_client):
            await asyncio.sleep(0.05)
    await asyncio.sleep(0.8)  # past the time the upstream call would have completed
    assert (await flow_client.get(created["taskId"])).result["status"] == "cancelled"


async def test_cancel_of_terminal_task_is_an_idempotent_ack(flow_client: ModernClient) -> None:
    created = (await flow_client.call("slow_compute", {"seconds": 0.2, "label": "done-first"})).result
    await flow_client.wait_terminal(created["taskId"])
    for _ in range(2):
        ack = await flow_client.request("tasks/cancel", {"taskId": created["taskId"]})
        assert ack.result == {"resultType": "complete"}
    assert (await flow_client.get(created["taskId"])).result["status"] == "completed"


async def test_late_upstream_completion_after_cancel_stays_cancelled(
    proxy: RunningProxy, client: ModernClient, capsys
) -> None:
    # The task is cancelled from outside the call (as the operator CLI or another process would),
    # so the upstream is not told and answers later: that late answer must be discarded.
    created = (await client.call("quiet_compute", {"seconds": 0.3})).result
    await proxy.store.update(
        created["taskId"], Change(status=TaskStatus.CANCELLED, status_message="cancelled elsewhere")
    )
    async with asyncio.timeout(5):
        while created["taskId"] in proxy.app[TASKS_KEY].live:
            await asyncio.sleep(0.02)  # the upstream call has ended and tried to record its result
    record = await proxy.store.get(created["taskId"])
    assert record.status == "cancelled" and record.outcome is None
    logs = capsys.readouterr()
    assert "late_outcome_discarded" in logs.out + logs.err


async def test_tasks_methods_require_the_extension_on_that_request(flow_client: ModernClient) -> None:
    created = (await flow_client.call("slow_compute", {"seconds": 0.2, "label": "gate"})).result
    for method, params in (
        ("tasks/get", {"taskId": created["taskId"]}),
        ("tasks/update", {"taskId": created["taskId"], "inputResponses": {}}),
        ("tasks/cancel", {"taskId": created["taskId"]}),
        ("tasks/get", {"taskId": "no-such-task"}),
    ):
        reply = await flow_client.request(method, params, capabilities={})
        assert reply.status == 400
        assert reply.error["code"] == -32021
        assert reply.error["data"] == {
            "requiredCapabilities": {"extensions": {"io.modelcontextprotocol/tasks": {}}}
        }
    assert (await flow_client.get(created["taskId"])).status == 200


async def test_unknown_task_id_is_invalid_params(flow_client: ModernClient) -> None:
    for method, params in (
        ("tasks/get", {"taskId": "tasks-nonexistent"}),
        ("tasks/update", {"taskId": "tasks-nonexistent", "inputResponses": {}}),
        ("tasks/cancel", {"taskId": "tasks-nonexistent"}),
        ("tasks/get", {"taskId": 42}),
    ):
        reply = await flow_client.request(method, params)
        assert reply.error["code"] == -32602, (method, reply.message)


async def test_removed_task_methods_are_method_not_found(client: ModernClient) -> None:
    for method in ("tasks/result", "tasks/list"):
        reply = await client.request(
            method, {"taskId": "x"} if method == "tasks/result" else {}, headers={"Mcp-Name": ""}
        )
        assert reply.status == 404
        assert reply.error["code"] == -32601


async def test_tasks_update_acknowledges_and_ignores_unknown_keys(flow_client: ModernClient) -> None:
    created = (await flow_client.call("slow_compute", {"seconds": 0.2, "label": "update"})).result
    ack = await flow_client.request(
        "tasks/update", {"taskId": created["taskId"], "inputResponses": {"nope": {"action": "accept"}}}
    )
    assert ack.result == {"resultType": "complete"}
    assert (await flow_client.wait_terminal(created["taskId"]))["status"] == "completed"


async def test_mcp_name_header_on_tasks_get_is_optional_but_checked(client: ModernClient) -> None:
    created = (await client.call("slow_compute", {"seconds": 0.2, "label": "hdr"})).result
    headers = client.headers_for("tasks/get", {})
    body = {
        "jsonrpc": "2.0",
        "id": 9,
        "method": "tasks/get",
        "params": {
            "taskId": created["taskId"],
            "_meta": {
                "io.modelcontextprotocol/protocolVersion": "2026-07-28",
                "io.modelcontextprotocol/clientCapabilities": {
                    "extensions": {"io.modelcontextprotocol/tasks": {}}
                },
            },
        },
    }
    without = await client.post_raw(json.dumps(body).encode(), headers)
    assert without.result["taskId"] == created["taskId"]
    mismatch = await client.post_raw(json.dumps(body).encode(), {**headers, "Mcp-Name": "someone-else"})
    assert mismatch.status == 400 and mismatch.error["code"] == -32020


async def test_client_that_drops_after_the_handle_finds_the_result_from_a_new_connection(
    proxy: RunningProxy,
) -> None:
    first = ModernClient(proxy.url())
    created = (await first.call("slow_compute", {"seconds": 0.3, "label": "reconnect"})).result
    await first.close()
    second = ModernClient(proxy.url())
    try:
        done = await second.wait_terminal(created["taskId"])
        assert done["result"]["content"][0]["text"] == "computed reconnect after 0.3s"
    finally:
        await second.close()


async def test_client_disconnect_before_detach_cancels_upstream(
    legacy_url: str, tmp_path, serve: Serve
) -> None:
    config = make_config(legacy_url, tmp_path / "s", tasks={"detach_after": "10s"})
    proxy = await serve(config)
    client = ModernClient(proxy.url())
    try:
        call = asyncio.create_task(client.call("slow_compute", {"seconds": 5, "label": "hangup"}))
        await asyncio.sleep(0.3)
        call.cancel()
        async with asyncio.timeout(5):
            while "hangup" not in await cancelled_labels(client):
                await asyncio.sleep(0.05)
    finally:
        await client.close()


async def test_required_tool_is_always_a_task_and_refused_without_extension(
    legacy_url: str, tmp_path, serve: Serve
) -> None:
    server = {"tasks": {"tools": {"greet": {"mode": "required"}}}}
    proxy = await serve(make_config(legacy_url, tmp_path / "s", server=server))
    client = ModernClient(proxy.url())
    try:
        created = (await client.call("greet", {"name": "Req"})).result
        assert created["resultType"] == "task"
        done = await client.wait_terminal(created["taskId"])
        assert done["result"]["content"][0]["text"] == "Hello, Req!"
        refused = await client.call("greet", {"name": "Req"}, capabilities={})
        assert refused.status == 400
        assert refused.error["code"] == -32021
        assert (
            refused.error["data"]["requiredCapabilities"]["extensions"]["io.modelcontextprotocol/tasks"] == {}
        )
    finally:
        await client.close()


async def test_forbidden_tool_never_becomes_a_task(legacy_url: str, tmp_path, serve: Serve) -> None:
    server = {"tasks": {"tools": {"slow_compute": {"mode": "forbidden"}}}}
    proxy = await serve(make_config(legacy_url, tmp_path / "s", server=server))
    client = ModernClient(proxy.url())
    try:
        reply = await client.call("slow_compute", {"seconds": 0.3, "label": "forbidden"})
        assert reply.result["resultType"] == "complete"
    finally:
        await client.close()


async def test_per_tool_detach_after_overrides_server_default(
    legacy_url: str, tmp_path, serve: Serve
) -> None:
    server = {"tasks": {"detach_after": "5s", "tools": {"slow_compute": {"detach_after": "20ms"}}}}
    proxy = await serve(make_config(legacy_url, tmp_path / "s", server=server))
    client = ModernClient(proxy.url())
    try:
        assert (await client.call("slow_compute", {"seconds": 0.3})).result["resultType"] == "task"
        assert (await client.call("greet", {"name": "x"})).result["resultType"] == "complete"
    finally:
        await client.close()


async def test_tasks_survive_a_restart_and_orphans_fail_with_a_restart_message(
    legacy_url: str, tmp_path, serve: Serve
) -> None:
    config = make_config(legacy_url, tmp_path / "s")
    config.store.durable = True
    proxy = await serve(config)
    client = ModernClient(proxy.url())
    done_id = (await client.call("slow_compute", {"seconds": 0.1, "label": "before"})).result["taskId"]
    await client.wait_terminal(done_id)
    orphan_id = (await client.call("slow_compute", {"seconds": 5, "label": "orphan"})).result["taskId"]
    await client.close()
    await proxy.stop()
    config2 = make_config(legacy_url, tmp_path / "s")
    proxy2 = await serve(config2)
    client = ModernClient(proxy2.url())
    try:
        done = (await client.get(done_id)).result
        assert (
            done["status"] == "completed"
            and done["result"]["content"][0]["text"] == "computed before after 0.1s"
        )
        orphan = (await client.get(orphan_id)).result
        assert orphan["status"] == "failed"
        assert "shut down" in orphan["error"]["message"] or "restarted" in orphan["error"]["message"]
    finally:
        await client.close()


async def test_upstream_unreachable_names_the_cause(tmp_path, serve: Serve) -> None:
    config = config_from_data(
        {
            "store": {"path": str(tmp_path / "s"), "durable": False},
            "mcpServers": {"down": {"url": "http://127.0.0.1:9/mcp"}},
        }
    )
    proxy = await serve(config)
    client = ModernClient(proxy.url())
    try:
        reply = await client.call("anything")
        assert reply.error["code"] == -32603
        assert "unreachable" in reply.error["message"] and "down" in reply.error["message"]
    finally:
        await client.close()


# --- subscriptions/listen ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def conformance_url() -> Iterator[str]:
    """The conformance fixture server: advertises listChanged and has list-changing tools."""
    server = ServerProcess([sys.executable, "tests/fixtures/conformance_server.py", "--port", "0"])
    yield server.url
    server.stop()


async def read_listen_stream(
    client: ModernClient, notifications: dict, *, until: int, trigger=None, timeout: float = 3.0
) -> list[dict]:
    """Open a subscriptions/listen stream, run `trigger()` after the first frame, return the first `until`
    frames."""
    params = {"notifications": notifications, "_meta": envelope({})}
    body = json.dumps(
        {"jsonrpc": "2.0", "id": "listen-1", "method": "subscriptions/listen", "params": params}
    )
    frames: list[dict] = []
    async with client.http.post(
        client.url, data=body, headers=client.headers_for("subscriptions/listen", params)
    ) as resp:
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                async for event in iter_events(resp.content.iter_any()):
                    if event.data:
                        frames.append(json.loads(event.data))
                        if len(frames) == 1 and trigger is not None:
                            await trigger()
                        if len(frames) >= until:
                            break
    return frames


async def test_listen_acknowledges_then_relays_the_upstream_list_changes_it_asked_for(
    conformance_url: str, tmp_path, serve: Serve
) -> None:
    proxy = await serve(make_config(conformance_url, tmp_path / "store"))
    client = ModernClient(proxy.url(), capabilities={})
    try:
        discover = (await client.request("server/discover")).result
        assert discover["capabilities"]["tools"]["listChanged"] is True  # relayed, so advertised
        assert "subscribe" not in discover["capabilities"]["resources"]  # resource subscriptions are not

        async def change_tools() -> None:
            await client.call("test_trigger_tool_change")

        frames = await read_listen_stream(
            client,
            {"toolsListChanged": True, "resourceSubscriptions": ["test://x"]},
            until=2,
            trigger=change_tools,
        )
        ack, change = frames
        assert ack["method"] == "notifications/subscriptions/acknowledged"
        assert ack["params"] == {
            "notifications": {"toolsListChanged": True},
            "_meta": {"io.modelcontextprotocol/subscriptionId": "listen-1"},
        }
        assert change["method"] == "notifications/tools/list_changed"
        assert change["params"]["_meta"]["io.modelcontextprotocol/subscriptionId"] == "listen-1"
        # A stream that asked for prompt changes only never sees a tool change.
        frames = await read_listen_stream(
            client, {"promptsListChanged": True}, until=3, trigger=change_tools, timeout=1.0
        )
        assert [f["method"] for f in frames] == ["notifications/subscriptions/acknowledged"]
    finally:
        await client.close()


async def test_listen_relays_changes_the_upstream_sends_on_its_standalone_stream(
    conformance_url: str, tmp_path, serve: Serve
) -> None:
    proxy = await serve(make_config(conformance_url, tmp_path / "store"))
    client = ModernClient(proxy.url(), capabilities={})
    try:

        async def change_tools_later() -> None:
            await client.call("announce_tool_change_later")

        frames = await read_listen_stream(
            client, {"toolsListChanged": True}, until=2, trigger=change_tools_later
        )
        assert [f["method"] for f in frames] == [
            "notifications/subscriptions/acknowledged",
            "notifications/tools/list_changed",
        ]
    finally:
        await client.close()


async def test_listen_for_task_ids_needs_the_extension_and_a_filter(client: ModernClient) -> None:
    refused = await client.request(
        "subscriptions/listen", {"notifications": {"taskIds": ["t"]}}, capabilities={}
    )
    assert refused.status == 400 and refused.error["code"] == -32021
    assert refused.error["data"]["requiredCapabilities"] == {
        "extensions": {"io.modelcontextprotocol/tasks": {}}
    }
    assert (await client.request("subscriptions/listen", {})).error["code"] == -32602


async def test_mcp_param_headers_must_mirror_annotated_arguments(
    conformance_url: str, tmp_path, serve: Serve
) -> None:
    """SEP-2243: for a tool whose inputSchema marks `region` with x-mcp-header "Region", the
    Mcp-Param-Region header must be present exactly when the argument is, and equal it."""
    proxy = await serve(make_config(conformance_url, tmp_path / "store"))
    client = ModernClient(proxy.url(), capabilities={})
    try:

        def call(region, header=None):
            headers = {"Mcp-Param-Region": header} if header is not None else None
            return client.call(
                "test_header_param", {} if region is None else {"region": region}, headers=headers
            )

        assert (await call("eu", "eu")).result["content"][0]["text"] == "region=eu"
        assert (await call("Hello", "=?base64?SGVsbG8=?=")).result["content"][0]["text"] == "region=Hello"
        # no suffix: a literal
        assert (await call("=?base64?SGVsbG8=", "=?base64?SGVsbG8=")).status == 200
        for region, header in (
            ("eu", None),
            ("eu", "us"),
            ("Hello", "=?base64?SGVsbG8?="),
            ("Hello", "=?base64?SG!!bG8=?="),
            (None, "eu"),
        ):
            refused = await call(region, header)
            assert refused.status == 400 and refused.error["code"] == -32020, (region, header)
        # Tools without annotations ignore stray Mcp-Param-* headers.
        assert (await client.call("greet", {"name": "x"}, headers={"Mcp-Param-Region": "eu"})).status == 200
    finally:
        await client.close()


def test_param_header_names_follow_the_annotation_rules() -> None:
    from proxy.protocol.era import param_header_names

    schema = {
        "properties": {
            "a": {"type": "string", "x-mcp-header": "A"},
            "n": {"type": "integer", "x-mcp-header": "N"},
            "obj": {"type": "object", "x-mcp-header": "O"},
            "bad": {"type": "string", "x-mcp-header": "no spaces"},
            "plain": {"type": "string"},
        }
    }
    assert param_header_names(schema) == {"a": "A", "n": "N"}
    assert param_header_names(None) == {}
