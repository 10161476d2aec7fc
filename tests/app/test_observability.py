"""Logs, metrics and health endpoints."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import aiohttp
import structlog
from support.clients import ModernClient
from support.logs import json_log
from support.proxy import Serve, make_config
from support.v1_client import V1Client

from proxy.config import config_from_data
from proxy.runtime.logs import configure_logging


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample in a Prometheus text exposition (0 when absent)."""
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        if head.split("{")[0] != name:
            continue
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            return float(value)
    return 0.0


async def scrape(base: str) -> str:
    async with aiohttp.ClientSession() as http, http.get(f"{base}/metrics") as resp:
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/plain")
        return await resp.text()


async def test_metrics_count_calls_tasks_latencies_and_limits(
    legacy_url: str, tmp_path: Path, serve: Serve
) -> None:
    config = make_config(legacy_url, tmp_path / "store")
    config.limits.tasks_rate = "2/second"
    proxy = await serve(config)
    before = await scrape(proxy.base)
    client = ModernClient(proxy.url())
    try:
        await client.call("greet", {"name": "m"})
        created = (await client.call("slow_compute", {"seconds": 0.2, "label": "metrics"})).result
        import asyncio

        await asyncio.sleep(0.5)
        for _ in range(3):
            await client.get(created["taskId"])
    finally:
        await client.close()
    after = await scrape(proxy.base)
    await proxy.stop()

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("mcp_tasks_proxy_calls_total", server="legacy", tool="greet", outcome="sync") == 1
    assert delta("mcp_tasks_proxy_calls_total", server="legacy", tool="slow_compute", outcome="detached") == 1
    assert delta("mcp_tasks_proxy_detach_latency_seconds_count") == 1
    assert delta("mcp_tasks_proxy_upstream_latency_seconds_count", server="legacy", method="tools/call") >= 2
    assert delta("mcp_tasks_proxy_tasks_total", status="working") == 1
    assert delta("mcp_tasks_proxy_tasks_total", status="completed") == 1
    assert delta("mcp_tasks_proxy_task_age_seconds_count", status="completed") == 1
    assert delta("mcp_tasks_proxy_limit_rejections_total", limit="tasks_rate") == 1
    assert (
        metric(after, "mcp_tasks_proxy_store_tasks") >= 1 and metric(after, "mcp_tasks_proxy_store_bytes") > 0
    )
    for name in (
        "mcp_tasks_proxy_input_wait_seconds",
        "mcp_tasks_proxy_tasks_orphaned_total",
        "mcp_tasks_proxy_live_tasks",
    ):
        assert name in after


async def test_one_log_line_per_request_and_per_transition_without_payloads(
    legacy_url: str, tmp_path: Path, capsys, serve: Serve
) -> None:
    secret_argument = "do-not-log-this-7c1e"
    with json_log(capsys) as lines:
        proxy = await serve(make_config(legacy_url, tmp_path / "store"))
        client = ModernClient(proxy.url())
        try:
            created = (await client.call("slow_compute", {"seconds": 0.2, "label": secret_argument})).result
            await client.wait_terminal(created["taskId"])
        finally:
            await client.close()
        await proxy.stop()
    requests = [entry for entry in lines if entry["event"] == "request"]
    call_line = next(e for e in requests if e.get("rpc_method") == "tools/call")
    assert (
        call_line["tool"] == "slow_compute"
        and call_line["server"] == "legacy"
        and call_line["task_id"] == created["taskId"]
    )
    assert (
        call_line["principal"]
        and call_line["request_id"]
        and call_line["status"] == 200
        and "duration_ms" in call_line
    )
    transitions = [e for e in lines if e["event"] == "task_transition" and e["task_id"] == created["taskId"]]
    assert [t["to"] for t in transitions] == ["working", "completed"]
    assert transitions[-1]["from"] == "working" and transitions[-1]["age_ms"] >= 0
    assert secret_argument not in json.dumps(lines)


async def test_one_call_can_be_followed_from_client_to_upstream(
    legacy_url: str, tmp_path: Path, capsys, serve: Serve
) -> None:
    """Each answer names its request (`X-Request-Id`, the id of its log line); the line names what
    the upstream knows the call by (its JSON-RPC id, and the progress token the proxy sent), and
    the client's own `X-Request-Id`; `/metrics` counts the requests being answered."""
    with json_log(capsys) as lines:
        proxy = await serve(make_config(legacy_url, tmp_path / "store"))
        modern = ModernClient(proxy.url(), capabilities={})
        legacy = V1Client(proxy.url(), capabilities={})
        try:
            reply = await modern.call("greet", {"name": "traced"}, headers={"X-Request-Id": "client-42"})
            await legacy.initialize()
            async with aiohttp.ClientSession() as http:
                body = {"jsonrpc": "2.0", "id": 7, "method": "tools/call"}
                body["params"] = {"name": "greet", "arguments": {"name": "relayed"}}
                async with http.post(proxy.url(), json=body, headers=legacy._headers()) as resp:
                    relayed_id = resp.headers["X-Request-Id"]
                    await resp.read()
                keyed = {**legacy._headers(), "Idempotency-Key": "followed"}  # (relayed in a task of its own)
                async with http.post(proxy.url(), json={**body, "id": 8}, headers=keyed) as resp:
                    keyed_id = resp.headers["X-Request-Id"]
                    await resp.read()
            slow = asyncio.ensure_future(modern.call("slow_compute", {"seconds": 0.6, "label": "in-flight"}))
            await asyncio.sleep(0.3)
            in_flight = metric(
                await scrape(proxy.base), "mcp_tasks_proxy_http_requests_in_flight", kind="mcp"
            )
            assert (await slow).status == 200
        finally:
            await modern.close()
            await legacy.close()
        await proxy.stop()
    assert in_flight == 1  # the slow call (the scrape itself is not an MCP request)
    assert reply.request_id
    modern_line = next(e for e in lines if e["event"] == "request" and e["request_id"] == reply.request_id)
    assert modern_line["client_request_id"] == "client-42" and modern_line["tool"] == "greet"
    assert isinstance(modern_line["upstream_request_id"], int)
    assert modern_line["upstream_progress_token"].startswith("mtp-")
    for request_id in (relayed_id, keyed_id):
        relayed_line = next(e for e in lines if e["event"] == "request" and e["request_id"] == request_id)
        assert relayed_line["era"] == "legacy" and isinstance(relayed_line["upstream_request_id"], int)


async def test_readyz_names_the_failing_check(tmp_path: Path, serve: Serve) -> None:
    config = config_from_data(
        {
            "store": {"path": str(tmp_path / "store"), "durable": False},
            "mcpServers": {"down": {"url": "http://127.0.0.1:9/mcp"}},
        }
    )
    proxy = await serve(config)
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{proxy.base}/healthz") as resp:
            assert resp.status == 200 and (await resp.json())["status"] == "ok"
        async with http.get(f"{proxy.base}/readyz") as resp:
            body = await resp.json()
            assert resp.status == 503 and body["ready"] is False
            assert body["checks"]["store"] == "ok" and "unreachable" in body["checks"]["upstream:down"]


async def test_input_wait_and_orphan_metrics_move(legacy_url: str, tmp_path: Path, serve: Serve) -> None:
    config = make_config(legacy_url, tmp_path / "store")
    proxy = await serve(config)
    before = await scrape(proxy.base)
    client = ModernClient(
        proxy.url(), capabilities={"elicitation": {}, "extensions": {"io.modelcontextprotocol/tasks": {}}}
    )
    try:
        await client.warm_up()
        created = (await client.call("confirm_delete", {"filename": "m.txt", "delay": 0.2})).result
        task = await client.wait_status(created["taskId"], ("input_required",))
        key = next(iter(task["inputRequests"]))
        await client.request(
            "tasks/update",
            {
                "taskId": created["taskId"],
                "inputResponses": {key: {"action": "accept", "content": {"confirm": True}}},
            },
        )
        await client.wait_terminal(created["taskId"])
        orphan = (await client.call("slow_compute", {"seconds": 30, "label": "orphan-metric"})).result
    finally:
        await client.close()
    # Forget the live call as a crashed process would, then read the task: it is failed as an orphan.
    from proxy.app import TASKS_KEY
    from proxy.tasks.model import Change

    service = proxy.app[TASKS_KEY]
    call = service.live.pop(orphan["taskId"])
    await service.store.update(orphan["taskId"], Change(owner="a-node-whose-lease-lapsed"))
    reader = ModernClient(proxy.url())
    try:
        assert (await reader.get(orphan["taskId"])).result["status"] == "failed"
    finally:
        await reader.close()
        call.cancel("test over")
    after = await scrape(proxy.base)
    await proxy.stop()
    assert (
        metric(after, "mcp_tasks_proxy_input_wait_seconds_count")
        - metric(before, "mcp_tasks_proxy_input_wait_seconds_count")
        == 1
    )
    assert (
        metric(after, "mcp_tasks_proxy_tasks_orphaned_total", fate="failed")
        - metric(before, "mcp_tasks_proxy_tasks_orphaned_total", fate="failed")
        == 1
    )


async def test_log_payloads_true_logs_request_bodies(
    legacy_url: str, tmp_path: Path, capsys, serve: Serve
) -> None:
    configure_logging("info")
    marker = "payload-marker-51ab"
    try:
        config = make_config(legacy_url, tmp_path / "store")
        config.logging.log_payloads = True
        config.listen.max_body = 4096
        proxy = await serve(config)
        client = ModernClient(proxy.url())
        try:
            await client.call("greet", {"name": marker})
            too_large = await client.call("greet", {"name": "x" * 8192})
            params = {"name": "greet", "arguments": {"name": "x"}}
            not_utf8 = b'{"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {"name": "\xff\xfe"}}'
            refused = await client.post_raw(not_utf8, client.headers_for("tools/call", params))
        finally:
            await client.close()
        await proxy.stop()
        err = capsys.readouterr().err
    finally:
        structlog.reset_defaults()
    assert "request_payload" in err and marker in err
    # the body's own bounds come first: a body over max_body is the endpoint's JSON-RPC 413, not logged
    assert too_large.status == 413 and too_large.error["code"] == -32600, too_large.message
    assert "x" * 8192 not in err
    # a body that is not UTF-8 is logged (replacement characters) and answered as without logging
    assert refused.status == 400 and refused.error["code"] == -32700, refused.message
    assert "\ufffd\ufffd" in err, err


async def test_made_up_tool_names_add_no_series_and_never_break_metrics(
    legacy_url: str, tmp_path: Path, serve: Serve
) -> None:
    """300 tool names the upstream refuses, and one that is a lone surrogate, through both eras:
    `/metrics` still answers 200 and the `tool` label holds only the tools the upstream listed or
    answered, and `other`."""
    proxy = await serve(make_config(legacy_url, tmp_path / "store", name="labels"))
    legacy = V1Client(proxy.url(), capabilities={})
    try:
        await legacy.initialize()
        for i in range(300):
            status, _, _ = await legacy.request("tools/call", {"name": f"made-up-{i}", "arguments": {}})
            assert status < 500
        status, _, _ = await legacy.request("tools/call", {"name": "\ud800", "arguments": {}})
        assert status < 500
        status, _, _ = await legacy.request("no/such-\ud800", {})
        assert status < 500
        # A tool the upstream listed keeps its own label, though its SSE reply is not read.
        status, message, _ = await legacy.request("tools/list", {})
        assert status == 200 and "started_log" in {tool["name"] for tool in message["result"]["tools"]}
        status, _, _ = await legacy.request("tools/call", {"name": "started_log"})
        assert status == 200
    finally:
        await legacy.close()
    client = ModernClient(proxy.url(), capabilities={})  # (no tasks: a slow moment cannot detach the call)
    try:
        assert (await client.call("greet", {"name": "m"})).result["content"][0]["text"] == "Hello, m!"
        await client.call("\ud800", {})
    finally:
        await client.close()
    text = await scrape(proxy.base)
    tools = tool_labels(text, "labels")
    assert tools == {"greet", "started_log", "other"}, tools


async def test_client_chosen_names_are_bound_cut_on_the_2026_wire(
    legacy_url: str, tmp_path: Path, capsys, serve: Serve
) -> None:
    """A 2026-07-28 call whose tool name is 1,000 characters (its `Mcp-Name` header matching) and a
    request with a 1,000-character method: their log lines hold at most 256 and 128 characters."""
    with json_log(capsys) as lines:
        proxy = await serve(make_config(legacy_url, tmp_path / "store"))
        client = ModernClient(proxy.url())
        try:
            assert (await client.call("t" * 1000, {})).status < 500
            assert (await client.request("m/" + "x" * 998, {})).status < 500
        finally:
            await client.close()
        await proxy.stop()
    requests = [entry for entry in lines if entry["event"] == "request" and entry.get("era") == "modern"]
    assert {entry["rpc_method"][:2] for entry in requests} >= {"to", "m/"}
    assert max(len(entry.get("tool", "")) for entry in requests) == 256
    assert max(len(entry["rpc_method"]) for entry in requests) == 128


def tool_labels(text: str, server: str) -> set[str]:
    """The `tool` label values of `calls_total` for `server` in a `/metrics` page."""
    return {
        line.split('tool="', 1)[1].split('"', 1)[0]
        for line in text.splitlines()
        if line.startswith("mcp_tasks_proxy_calls_total{") and f'server="{server}"' in line
    }


IS_ERROR_CHILD = """
import json, sys
for line in sys.stdin:
    msg = json.loads(line)
    method = msg.get("method")
    if method == "initialize":
        info = {"name": "n", "version": "0"}
        result = {"protocolVersion": "2025-06-18", "capabilities": {"tools": {}}, "serverInfo": info}
    elif method == "tools/list":
        result = {"tools": [{"name": "real", "inputSchema": {"type": "object"}}]}
    elif method == "tools/call":
        name = msg["params"]["name"]
        result = {"content": [{"type": "text", "text": name}], "isError": name != "real"}
    else:
        continue
    print(json.dumps({"jsonrpc": "2.0", "id": msg["id"], "result": result}), flush=True)
"""


async def test_tools_an_upstream_answers_with_is_error_add_no_series(tmp_path: Path, serve: Serve) -> None:
    """Most SDKs answer a tool they do not have with an `isError` result, not a JSON-RPC error: 600
    such names still add no series, and the listed tool keeps its label (it used to be crowded out)."""
    config = config_from_data(
        {
            "store": {"path": str(tmp_path / "store"), "durable": False},
            "mcpServers": {"is_error": {"command": sys.executable, "args": ["-c", IS_ERROR_CHILD]}},
        }
    )
    proxy = await serve(config)
    client = ModernClient(proxy.url(), capabilities={})
    try:
        for i in range(600):
            assert (await client.call(f"junk-{i}")).result["isError"] is True
        assert (await client.call("real")).result["isError"] is False
    finally:
        await client.close()
    text = await scrape(proxy.base)
    tools = tool_labels(text, "is_error")
    assert tools == {"real", "other"}, sorted(tools)[:10]
