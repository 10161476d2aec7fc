"""Replicas (README "Replicas"): a real redis-server, three proxy replicas of config/replicas.yaml and
HAProxy (config/haproxy.cfg, round-robin, no stickiness) in front, started by scripts/cluster.py;
driven by the `mcp` SDK client (legacy era), FastMCP's client with fastmcp-tasks, and raw HTTP
where a test must pick the replica. Timings are scaled down: lease 1 s."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import re
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import fastmcp_tasks  # noqa: F401  (registers the tasks extension on every FastMCP Client)
import mcp.types as types
import pytest
from fastmcp import Client
from mcp.client.session import ClientRequestContext, ClientSession
from mcp.client.streamable_http import streamable_http_client
from multidict import CIMultiDict
from support.clients import LEGACY_HEADERS, LEGACY_INITIALIZE, ModernClient, Reply, envelope
from support.servers import ROOT
from support.v1_client import V1Client

from proxy.config import ConfigError, config_from_data
from proxy.protocol.sse import iter_events
from proxy.replicas import advertised_url

sys.path.insert(0, str(ROOT))
from scripts.cluster import Cluster  # noqa: E402

pytestmark = [pytest.mark.redis, pytest.mark.haproxy]

# short for test speed, long enough that a replica starved of CPU
# by a loaded machine still renews (every third)
LEASE_S = 1.0
SETTINGS = {
    "MCP_LEASE": "1s",
    "MCP_DETACH_AFTER": "150ms",
    "MCP_POLL_INTERVAL": "50ms",
    "MCP_DRAIN_TIMEOUT": "5s",
    "MCP_DRAIN_DETACHED": "20s",
    "MCP_INPUT_TIMEOUT": "30s",
    "MCP_HOP_TIMEOUT": "2s",
}
ELICIT_CAPS = {"elicitation": {}, "extensions": {"io.modelcontextprotocol/tasks": {}}}
ACCEPT = {"action": "accept", "content": {"confirm": True}}
WEB, LOCAL = "/servers/web/mcp", "/servers/local/mcp"


@pytest.fixture(scope="module")
def cluster(legacy_url: str) -> Iterator[Cluster]:
    """One cluster for the module (the destructive tests run last and leave it whole)."""
    with Cluster(upstream_url=legacy_url, settings=SETTINGS, check_inter="100ms") as running:
        yield running


@pytest.fixture
async def clients(cluster: Cluster) -> AsyncIterator[list[ModernClient]]:
    """A raw 2026-07-28 client (tasks extension and elicitation) on each replica directly."""
    made = [ModernClient(url + WEB, capabilities=ELICIT_CAPS) for url in cluster.replica_urls]
    yield made
    for client in made:
        await client.close()


async def _cancelled_upstream(client: ModernClient, label: str) -> list[dict]:
    reply = await client.call("cancelled_log")
    return [e for e in json.loads(reply.result["content"][0]["text"]) if e["label"] == label]


async def _wait_cancelled_upstream(client: ModernClient, label: str, timeout: float = 5.0) -> dict:
    async with asyncio.timeout(timeout):
        while not (seen := await _cancelled_upstream(client, label)):
            await asyncio.sleep(0.02)
    return seen[0]


async def _metric(url: str, name: str) -> float:
    """The sum of a Prometheus sample `name` (all labels) on a replica's /metrics."""
    async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics") as resp:
        text = await resp.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


async def _request_lines(cluster: Cluster, i: int, field: str, request_id: str) -> list[dict]:
    """Replica `i`'s log lines whose `field` is `request_id`, once its `request` line is among them
    (written as the response ends, which the client may see first); waits at most 5 s."""
    async with asyncio.timeout(5):
        while True:
            text = cluster.log_path(i).read_text(errors="replace")
            lines = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
            found = [e for e in lines if e.get(field) == request_id]
            if any(e["event"] == "request" for e in found):
                return found
            await asyncio.sleep(0.02)


def _node_of(cluster: Cluster, i: int) -> str:
    """Replica `i`'s node id, from its latest start line in its log."""
    nodes = re.findall(r'"node": ?"([^"]+)"', cluster.log_path(i).read_text(errors="replace"))
    assert nodes, "replica log has no node id"
    return nodes[-1]


# -- any replica serves any task ----------------------------------------------------------------


async def test_odd_methods_and_session_ids_get_the_answer_one_process_gives(cluster: Cluster) -> None:
    """With replicas, a `method` that is an array or object is a 400 and a non-ASCII (not even
    UTF-8) `Mcp-Session-Id` a 404, as from one process: routing never fails on them (it was a 500)."""
    url = cluster.replica_urls[0] + WEB
    async with aiohttp.ClientSession() as http:
        for method in (["tools/call"], {"a": 1}):
            body = {"jsonrpc": "2.0", "id": 1, "method": method, "params": {}}
            async with http.post(url, json=body, headers=LEGACY_HEADERS) as resp:
                assert resp.status == 400, await resp.text()
    host, port = cluster.replica_urls[0].removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    body = b'{"jsonrpc":"2.0","id":1,"method":"ping"}'
    writer.write(
        b"POST " + WEB.encode() + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Accept: application/json, text/event-stream\r\nMcp-Session-Id: \xff\xfe-not-ours\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body
    )
    await writer.drain()
    head = await asyncio.wait_for(reader.readline(), 10)
    writer.close()
    await writer.wait_closed()
    assert head.split()[1] == b"404", head


async def test_poll_answer_and_cancel_through_other_replicas(
    cluster: Cluster, clients: list[ModernClient]
) -> None:
    c0, c1, c2 = clients
    await c0.warm_up()
    created = (await c0.call("slow_compute", {"seconds": 30, "label": "xr-cancel"})).result
    assert created["resultType"] == "task"
    task_id = created["taskId"]
    assert (await c1.get(task_id)).result["status"] == "working"
    assert (await c2.get(task_id)).result["status"] == "working"
    hops_before = await _metric(
        cluster.replica_urls[2], 'mcp_tasks_proxy_replica_hop_seconds_count{op="tasks/cancel"}'
    )
    assert (await c2.request("tasks/cancel", {"taskId": task_id})).result == {"resultType": "complete"}
    assert (await c1.get(task_id)).result["status"] == "cancelled"
    # The owner (replica 0) got the cancel over the hop and sent notifications/cancelled for the
    # upstream's own request id: the SDK upstream only cancels the handler on a matching id.
    seen = await _wait_cancelled_upstream(c1, "xr-cancel")
    assert seen["reason"] == "notifications/cancelled"
    assert (
        await _metric(cluster.replica_urls[2], 'mcp_tasks_proxy_replica_hop_seconds_count{op="tasks/cancel"}')
        == hops_before + 1
    )

    # A question asked on replica 0's call, answered through replica 2, polled through replica 1.
    created = (await c0.call("confirm_delete", {"filename": "xr.txt", "delay": 0.3})).result
    assert created["resultType"] == "task"
    task = await c1.wait_status(created["taskId"], ("input_required",))
    ((key, question),) = task["inputRequests"].items()
    assert question["method"] == "elicitation/create"
    assert (
        await c2.request("tasks/update", {"taskId": created["taskId"], "inputResponses": {key: ACCEPT}})
    ).result == {"resultType": "complete"}
    # the answered key left before the ack
    assert "inputRequests" not in (await c1.get(created["taskId"])).result
    done = await c1.wait_terminal(created["taskId"])
    assert done["status"] == "completed" and done["result"]["content"][0]["text"] == "deleted xr.txt"


async def test_a_cancel_through_another_replica_reaches_the_upstream_before_any_sweep(
    legacy_url: str,
) -> None:
    """The replica that takes a cancel for another's task hops it to the owner, which cancels the
    upstream request at once. Without the hop, only the owner's sweep (every half lease: 30 s
    here, and none runs in this test's first 30 s) would notice the task ended elsewhere."""
    settings = {**SETTINGS, "MCP_LEASE": "60s", "MCP_STDIO_DISABLED": "true"}
    with Cluster(upstream_url=legacy_url, replicas=2, settings=settings) as pair:
        owner, other = (ModernClient(url + WEB, capabilities=ELICIT_CAPS) for url in pair.replica_urls)
        try:
            await owner.warm_up()
            # No progress from this tool: a progress write would also find the task ended elsewhere.
            created = (await owner.call("quiet_compute", {"seconds": 30, "label": "xr-prompt"})).result
            assert created["resultType"] == "task"
            sent = time.time()
            cancelled = await other.request("tasks/cancel", {"taskId": created["taskId"]})
            assert cancelled.result == {"resultType": "complete"}
            seen = await _wait_cancelled_upstream(other, "xr-prompt", timeout=10)
            assert seen["reason"] == "notifications/cancelled"
            assert seen["at"] - sent < 2.0, f"the upstream saw the cancel {seen['at'] - sent:.2f} s later"
        finally:
            await owner.close()
            await other.close()


async def test_mrtr_rounds_on_different_replicas(cluster: Cluster, clients: list[ModernClient]) -> None:
    c0, c1, c2 = clients
    await c0.warm_up()
    first = (await c0.call("ask_then_work", {"seconds": 0})).result
    assert first["resultType"] == "input_required"
    ((key, _),) = first["inputRequests"].items()
    retry = {
        "name": "ask_then_work",
        "arguments": {"seconds": 0},
        "inputResponses": {key: {"action": "accept", "content": {"name": "Ada"}}},
        "requestState": first["requestState"],
    }
    second = await c1.request("tools/call", retry)
    assert second.result["content"][0]["text"] == "Hello Ada, the work took 0s"
    # relayed to replica 0, which holds the call: its line names the id the client got from replica 1
    assert second.request_id
    served = await _request_lines(cluster, 0, "relayed_request_id", second.request_id)
    assert [line["event"] for line in served] == ["request"], served
    relaying = await _request_lines(cluster, 1, "request_id", second.request_id)
    ends = [line for line in relaying if line["event"] == "request"]
    assert [(line["era"], line["rpc_method"]) for line in ends] == [("modern", "tools/call")], ends
    replayed = await c2.request("tools/call", retry)  # single use, whichever replica sees it
    assert replayed.error["code"] == -32602

    # Round 2 that outlives detach_after becomes a task on the replica holding the call.
    first = (await c2.call("ask_then_work", {"seconds": 0.5})).result
    ((key, _),) = first["inputRequests"].items()
    handle = (
        await c0.request(
            "tools/call",
            {
                **retry,
                "arguments": {"seconds": 0.5},
                "requestState": first["requestState"],
                "inputResponses": {key: {"action": "accept", "content": {"name": "Bo"}}},
            },
        )
    ).result
    assert handle["resultType"] == "task"
    done = await c1.wait_terminal(handle["taskId"])
    assert done["result"]["content"][0]["text"] == "Hello Bo, the work took 0.5s"


async def test_fastmcp_client_through_the_load_balancer(cluster: Cluster) -> None:
    asked: list[str] = []

    async def on_elicit(message, response_type, params, context):
        asked.append(message)
        return {"confirm": True}

    async with Client(cluster.url + WEB, elicitation_handler=on_elicit) as client:
        slow = await client.call_tool("slow_compute", {"seconds": 0.6, "label": "fastmcp-lb"})
        confirmed = await client.call_tool("confirm_delete", {"filename": "lb.txt", "delay": 0.3})
    assert slow.content[0].text == "computed fastmcp-lb after 0.6s"
    assert confirmed.content[0].text == "deleted lb.txt" and asked == ["Delete lb.txt?"]


async def _legacy_session(url: str, calls: int = 4) -> list[str]:
    async def on_elicit(
        context: ClientRequestContext, params: types.ElicitRequestParams
    ) -> types.ElicitResult:
        return types.ElicitResult(action="accept", content={"confirm": True})

    texts = []
    async with (
        streamable_http_client(url) as (read, write),
        ClientSession(read, write, elicitation_callback=on_elicit) as session,
    ):
        await session.initialize()
        assert "greet" in [t.name for t in (await session.list_tools()).tools]
        # round-robin: most of these land on a replica that relays to the session's owner
        for i in range(calls):
            texts.append((await session.call_tool("greet", {"name": f"n{i}"})).content[0].text)
        texts.append((await session.call_tool("confirm_delete", {"filename": "legacy.txt"})).content[0].text)
        texts.append(
            (await session.call_tool("slow_compute", {"seconds": 0.3, "label": "legacy-lb"})).content[0].text
        )
    return texts


@pytest.mark.parametrize("path", [WEB, LOCAL], ids=["http-upstream", "stdio-upstream"])
async def test_legacy_sessions_work_through_any_replica(cluster: Cluster, path: str) -> None:
    texts = await asyncio.wait_for(_legacy_session(cluster.url + path), timeout=30)
    assert texts == [
        "Hello, n0!",
        "Hello, n1!",
        "Hello, n2!",
        "Hello, n3!",
        "deleted legacy.txt",
        "computed legacy-lb after 0.3s",
    ]


async def test_a_repeated_session_header_is_refused_by_the_owner_through_another_replica(
    cluster: Cluster,
) -> None:
    """Two `Mcp-Session-Id` headers reach the session's owner as the client sent them, through the
    replica that relays them, and get its 400. The relay kept only the last one, so the owner
    looked up the other id (404), while the relaying replica had routed by the first."""
    owner, relaying = (url + WEB for url in cluster.replica_urls[:2])
    async with aiohttp.ClientSession() as http:
        async with http.post(owner, json=LEGACY_INITIALIZE, headers=LEGACY_HEADERS) as resp:
            sid = resp.headers["Mcp-Session-Id"]
        headers = CIMultiDict({**LEGACY_HEADERS, "MCP-Protocol-Version": "2025-11-25", "Mcp-Session-Id": sid})
        headers.add("Mcp-Session-Id", "another-session")
        body = {"jsonrpc": "2.0", "id": 2, "method": "tools/list"}
        async with http.post(relaying, json=body, headers=headers) as resp:
            reply = await resp.json()
        assert resp.status == 400 and "2 Mcp-Session-Id headers" in reply["error"]["message"], reply
        async with http.delete(owner, headers={"Mcp-Session-Id": sid}):
            pass


@pytest.mark.parametrize("path", [WEB, LOCAL], ids=["http-upstream", "stdio-upstream"])
async def test_v1_tasks_through_the_load_balancer(
    cluster: Cluster, clients: list[ModernClient], path: str
) -> None:
    client = V1Client(cluster.url + path)
    try:
        await client.initialize()
        task = await client.call_as_task("slow_compute", {"seconds": 0.5, "label": f"v1-lb{path}"})
        for _ in range(3):  # each lands on another replica, relayed to the session's
            status, message, _ = await client.request("tasks/get", {"taskId": task["taskId"]})
            assert status == 200 and message["result"]["status"] in ("working", "completed")
        status, message, _ = await client.request("tasks/result", {"taskId": task["taskId"]})
        assert message["result"]["content"][0]["text"] == f"computed v1-lb{path} after 0.5s"
        doomed = await client.call_as_task("slow_compute", {"seconds": 30, "label": f"v1-cancel{path}"})
        status, message, _ = await client.request("tasks/cancel", {"taskId": doomed["taskId"]})
        assert message["result"]["status"] == "cancelled"
    finally:
        await client.close()
    if path == WEB:  # the fixture's cancel log is per process: the HTTP upstream's
        assert (await _wait_cancelled_upstream(clients[0], f"v1-cancel{path}"))[
            "reason"
        ] == "notifications/cancelled"


async def test_forward_hop_latency(cluster: Cluster, clients: list[ModernClient]) -> None:
    """Cancels and updates through a replica that does not own the task: the figure is printed
    (the issue's target is p99 < 100 ms on loopback; not asserted on a shared 2-core machine)."""
    c0, c1, _ = clients
    await c0.warm_up()
    created = await asyncio.gather(
        *(c0.call("slow_compute", {"seconds": 30, "label": f"hop-{i}"}) for i in range(30))
    )
    ids = [r.result["taskId"] for r in created]
    asking = (await c0.call("multi_input", {"delay": 0.2})).result
    await c1.wait_status(asking["taskId"], ("input_required",))
    update_ms = []
    for _ in range(100):  # answers for keys the call does not have: a full hop each, nothing changes
        started = time.perf_counter()
        assert (
            await c1.request("tasks/update", {"taskId": asking["taskId"], "inputResponses": {"nope": ACCEPT}})
        ).status == 200
        update_ms.append((time.perf_counter() - started) * 1000)
    cancel_ms = []
    for task_id in ids:
        started = time.perf_counter()
        assert (await c1.request("tasks/cancel", {"taskId": task_id})).result == {"resultType": "complete"}
        cancel_ms.append((time.perf_counter() - started) * 1000)
    await c1.request("tasks/cancel", {"taskId": asking["taskId"]})
    for i in range(30):  # every cancel reached the upstream call
        assert (await _wait_cancelled_upstream(c1, f"hop-{i}"))["reason"] == "notifications/cancelled"

    def p(values: list[float], q: float) -> float:
        return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]

    hop = "mcp_tasks_proxy_replica_hop_seconds"
    hops = await _metric(cluster.replica_urls[1], f"{hop}_count")
    within_10ms = await _metric(cluster.replica_urls[1], f'{hop}_bucket{{le="0.01"')
    within_100ms = await _metric(cluster.replica_urls[1], f'{hop}_bucket{{le="0.1"')
    print(
        f"\nreplica hop alone (replica 1 -> owner, its histogram): {hops:g} hops, {within_10ms / hops:.1%} "
        f"within 10 ms, "
        f"{within_100ms / hops:.1%} within 100 ms"
    )
    print(
        f"replica hop, client-observed through a non-owner: tasks/update p50 {p(update_ms, 50):.1f} ms p99 "
        f"{p(update_ms, 99):.1f} ms; "
        f"tasks/cancel p50 {p(cancel_ms, 50):.1f} ms p99 {p(cancel_ms, 99):.1f} ms "
        f"(n={len(update_ms)}/{len(cancel_ms)})"
    )


async def test_internal_endpoints_and_relay_marks_need_the_shared_secret(cluster: Cluster) -> None:
    async with aiohttp.ClientSession() as http:
        for headers in ({}, {"X-Mcp-Replica-Secret": "not-the-secret-" * 3}):
            for op in ("tasks/cancel", "tasks/answer", "running", "ping"):
                async with http.post(
                    f"{cluster.replica_urls[0]}/_replica/{op}", json={"taskId": "x"}, headers=headers
                ) as resp:
                    assert resp.status == 403
        async with http.post(
            f"{cluster.replica_urls[0]}/_replica/tasks/cancel",
            json=[1],
            headers={"X-Mcp-Replica-Secret": cluster.secret},
        ) as resp:
            assert resp.status == 400
        # A client that claims its request was relayed by a replica,
        # without the secret, is routed like any other.
        sid = await _open_legacy(http, cluster.replica_urls[0] + WEB)
        headers = {
            **LEGACY_HEADERS,
            "Mcp-Session-Id": sid,
            "MCP-Protocol-Version": "2025-11-25",
            "X-Mcp-Replica-Forwarded": "someone",
        }
        async with http.post(
            cluster.replica_urls[1] + WEB, json={"jsonrpc": "2.0", "id": 1, "method": "ping"}, headers=headers
        ) as resp:
            assert resp.status == 200 and '"result":{}' in (await resp.text()).replace(" ", "")


def test_replicas_config_needs_a_shared_store_a_secret_and_an_address() -> None:
    base: dict[str, Any] = {"mcpServers": {"a": {"url": "http://127.0.0.1:1/mcp"}}}
    redis = {"url": "redis://127.0.0.1:6379/0"}
    with pytest.raises(ConfigError, match="replicas need a shared store"):
        config_from_data({**base, "replicas": {"secret": "s" * 32}})
    with pytest.raises(ConfigError, match="secret"):
        config_from_data({**base, "store": redis, "replicas": {"secret": "short"}})
    with pytest.raises(ConfigError, match="advertise"):
        config_from_data(
            {**base, "store": redis, "replicas": {"secret": "s" * 32, "advertise": "10.0.0.5:8080/x"}}
        )
    config = config_from_data(
        {**base, "store": redis, "replicas": {"secret": "s" * 32, "advertise": "http://10.0.0.5:{port}"}}
    )
    config.listen.port = 8123
    assert advertised_url(config) == "http://10.0.0.5:8123"
    config = config_from_data(
        {**base, "store": redis, "listen": {"host": "0.0.0.0"}, "replicas": {"secret": "s" * 32}}
    )
    with pytest.raises(ValueError, match="advertise"):
        advertised_url(config)


# -- the store goes away for longer than the lease -----------------------------------------------


async def test_redis_outage_longer_than_the_lease_fails_no_live_replicas_tasks(
    cluster: Cluster, clients: list[ModernClient]
) -> None:
    """After Redis comes back every lease has lapsed by the clock; no replica takes the others' for lost."""
    import redis.asyncio as aioredis

    for client in clients:
        await client.warm_up()
    ids = [
        (await c.call("slow_compute", {"seconds": 4, "label": "outage"})).result["taskId"]
        for c in clients
        for _ in range(2)
    ]
    store = aioredis.from_url(cluster.redis_url)
    try:  # AOF now, so that a restart keeps the records (the rewrite holds what is there)
        await store.config_set("appendonly", "yes")
        async with asyncio.timeout(10):
            while (info := await store.info("persistence"))["aof_rewrite_in_progress"] or info[
                "aof_rewrite_scheduled"
            ]:
                await asyncio.sleep(0.02)
    finally:
        await store.aclose()
    port = cluster.redis.port
    cluster.redis.kill()
    # While the shared session map is unreadable a legacy session can be neither opened nor looked
    # up: 503 naming the store (a session other replicas could never find would break the client).
    init = LEGACY_INITIALIZE
    headers = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
    async with aiohttp.ClientSession() as http:
        async with http.post(cluster.replica_urls[0] + WEB, json=init, headers=headers) as resp:
            refused = await resp.json()
        assert (
            resp.status == 503
            and refused["error"]["code"] == -32603
            and "store" in refused["error"]["message"]
        ), refused
        ping = {"jsonrpc": "2.0", "id": 2, "method": "ping"}
        async with http.post(
            cluster.replica_urls[0] + WEB, json=ping, headers={**headers, "Mcp-Session-Id": "elsewhere"}
        ) as resp:
            assert resp.status == 503, await resp.text()
    ended: dict[str, dict] = {}

    async def poll(client: ModernClient, task_id: str) -> None:  # through another replica, all along
        while task_id not in ended:
            with contextlib.suppress(Exception):
                task = (await client.get(task_id)).result
                if task.get("status") in ("completed", "failed", "cancelled"):
                    ended[task_id] = task
            await asyncio.sleep(0.01)

    pollers = [
        asyncio.ensure_future(poll(clients[(i // 2 + 1) % 3], task_id)) for i, task_id in enumerate(ids)
    ]
    # Replica 2 is paused across the restart (a stall, not a death): the others see the store back
    # before it has renewed its lease, and poll its tasks all along.
    cluster.procs[2].send_signal(signal.SIGSTOP)
    try:
        await asyncio.sleep(4 * LEASE_S)  # every lease lapses
        cluster.redis.appendonly = True
        await asyncio.to_thread(cluster.redis.start, port=port)
        await asyncio.sleep(LEASE_S / 2)
        cluster.procs[2].send_signal(signal.SIGCONT)
        async with asyncio.timeout(15):
            await asyncio.gather(*pollers)
    finally:
        cluster.procs[2].send_signal(signal.SIGCONT)
        for poller in pollers:
            poller.cancel()
    statuses = [ended[t]["status"] for t in ids]
    assert statuses == ["completed"] * len(ids), [ended[t].get("statusMessage") for t in ids]
    for i in range(3):
        await asyncio.to_thread(_wait_ready, cluster, i)


def _wait_ready(cluster: Cluster, i: int) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(cluster.replica_urls[i] + "/readyz", timeout=1) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"replica {i} not ready again")


async def test_a_replica_with_another_secret_is_reported_and_its_updates_fail(
    cluster: Cluster, clients: list[ModernClient]
) -> None:
    """A 4th replica with a different secret: it logs the peers that refuse it and /readyz says so;
    a tasks/update through it for a task on another replica is an error, not a false "complete"."""

    from scripts.cluster import free_port

    port = free_port()
    log_path = cluster.workdir / "odd-replica.log"
    with open(log_path, "ab") as log:
        odd = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "proxy",
                "--config",
                str(ROOT / "config" / "replicas.yaml"),
                "--port",
                str(port),
            ],
            cwd=ROOT,
            env={**cluster.env, "MCP_REPLICA_SECRET": "another-secret-" + "x" * 32},
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
    odd_url = f"http://127.0.0.1:{port}"
    odd_client = ModernClient(odd_url + WEB, capabilities=ELICIT_CAPS)
    try:
        async with aiohttp.ClientSession() as http, asyncio.timeout(20):
            while True:
                with contextlib.suppress(aiohttp.ClientError):
                    async with http.get(odd_url + "/readyz") as resp:
                        checks = (await resp.json())["checks"]
                        if "replicas" in checks:
                            break
                await asyncio.sleep(0.05)
        assert (
            resp.status == 200
            and "refused by" in checks["replicas"]
            and "replicas.secret" in checks["replicas"]
        )
        assert "replica_peer_refused" in log_path.read_text()
        c0 = clients[0]
        await c0.warm_up()
        created = (await c0.call("confirm_delete", {"filename": "odd.txt", "delay": 0.3})).result
        task = await c0.wait_status(created["taskId"], ("input_required",))
        ((key, _),) = task["inputRequests"].items()
        refused = await odd_client.request(
            "tasks/update", {"taskId": created["taskId"], "inputResponses": {key: ACCEPT}}
        )
        assert refused.status == 503 and refused.error["code"] == -32603, refused
        assert "not delivered" in refused.error["message"] and "403" in refused.error["message"]
        assert (await c0.get(created["taskId"])).result["status"] == "input_required"  # nothing was answered
        assert (await c0.request("tasks/cancel", {"taskId": created["taskId"]})).result == {
            "resultType": "complete"
        }
    finally:
        await odd_client.close()
        odd.terminate()
        await asyncio.to_thread(odd.wait, 30)


async def test_header_auth_relayed_requests_keep_their_principal(legacy_url: str, tmp_path: Any) -> None:
    """auth.mode header, trusted_peers = the auth proxy's address (127.0.0.3 here): a request relayed
    between replicas comes from a replica's address, yet keeps the principal the first one took.
    And a relayed stream whose peer stops answering (SIGSTOP) is cut within a few keepalives."""
    config = tmp_path / "replicas-header.yaml"
    text = (
        (ROOT / "config" / "replicas.yaml")
        .read_text()
        .replace("\nlisten:\n", "\nlisten:\n  sse_keepalive: 200ms\n", 1)
    )
    assert "sse_keepalive: 200ms" in text
    config.write_text(
        text + "\nauth:\n  mode: header\n  header:\n    name: X-User\n    trusted_peers: [127.0.0.3]\n"
    )
    with Cluster(upstream_url=legacy_url, settings=SETTINGS, config=config, check_inter="100ms") as two:

        def client(i: int) -> ModernClient:
            made = ModernClient(two.replica_urls[i] + WEB, capabilities=ELICIT_CAPS)
            made.http = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(local_addr=("127.0.0.3", 0)), headers={"X-User": "alice"}
            )
            return made

        c0, c1 = client(0), client(1)
        try:
            stranger = ModernClient(two.replica_urls[0] + WEB)
            try:
                assert (await stranger.call("greet", {"name": "x"})).status == 401  # not from the auth proxy
            finally:
                await stranger.close()
            sid = await _open_legacy(c0.http, two.replica_urls[0] + WEB)
            assert await _legacy_ping(c1.http, two.replica_urls[1] + WEB, sid) == 200  # relayed to replica 0
            first = (await c0.call("ask_then_work", {"seconds": 0})).result
            ((key, _),) = first["inputRequests"].items()
            second = await c1.request(
                "tools/call",
                {
                    "name": "ask_then_work",
                    "arguments": {"seconds": 0},
                    "requestState": first["requestState"],
                    "inputResponses": {key: {"action": "accept", "content": {"name": "Ada"}}},
                },
            )
            assert second.result["content"][0]["text"] == "Hello Ada, the work took 0s", second
            forged = {
                **LEGACY_HEADERS,
                "Mcp-Session-Id": sid,
                "MCP-Protocol-Version": "2025-11-25",
                "X-Mcp-Replica-Principal": "alice",
            }
            async with (
                aiohttp.ClientSession() as plain,
                plain.post(
                    two.replica_urls[1] + WEB,
                    json={"jsonrpc": "2.0", "id": 1, "method": "ping"},
                    headers=forged,
                ) as resp,
            ):
                assert resp.status == 401  # the principal header alone, without the replicas' secret
            # A relayed GET stream: the owner freezes; the relaying
            # replica cuts it (3 keepalives + hop_timeout).
            headers = {
                **LEGACY_HEADERS,
                "Accept": "text/event-stream",
                "Mcp-Session-Id": sid,
                "MCP-Protocol-Version": "2025-11-25",
            }
            async with c1.http.get(two.replica_urls[1] + WEB, headers=headers) as stream:
                assert stream.status == 200
                await asyncio.wait_for(stream.content.readany(), 5)  # keepalives flow
                two.procs[0].send_signal(signal.SIGSTOP)
                try:
                    frozen = time.monotonic()
                    with contextlib.suppress(aiohttp.ClientError):
                        while await asyncio.wait_for(stream.content.readany(), 10):
                            pass
                    assert time.monotonic() - frozen < 0.6 + 2 + 1.5
                finally:
                    two.procs[0].send_signal(signal.SIGCONT)
        finally:
            await c0.close()
            await c1.close()


# -- rolling deploys: one replica drains ---------------------------------------------------------


async def test_sigterm_drains_detached_calls_while_the_others_serve_them(
    cluster: Cluster, clients: list[ModernClient]
) -> None:
    c0, c1, c2 = clients
    await c1.warm_up()
    finishing = (await c1.call("slow_compute", {"seconds": 1.5, "label": "drained"})).result["taskId"]
    cancelled = (await c1.call("slow_compute", {"seconds": 30, "label": "drained-cancel"})).result["taskId"]
    terminating = asyncio.ensure_future(asyncio.to_thread(cluster.terminate, 1))
    try:
        async with aiohttp.ClientSession() as http, asyncio.timeout(5):
            while True:  # not ready at once
                async with http.get(cluster.replica_urls[1] + "/readyz") as resp:
                    if resp.status == 503:
                        assert (await resp.json())["checks"]["drain"].startswith("draining")
                        break
                await asyncio.sleep(0.02)
        # a new call: refused, so a balancer retries it elsewhere
        refused = await c1.call("greet", {"name": "late"})
        assert (
            refused.status == 503
            and refused.error["code"] == -32603
            and "shutting down" in refused.error["message"]
        )
        # task methods still served while draining
        assert (await c1.get(finishing)).result["status"] == "working"
        # the hop reaches it
        assert (await c2.request("tasks/cancel", {"taskId": cancelled})).result == {"resultType": "complete"}
        assert (await _wait_cancelled_upstream(c0, "drained-cancel"))["reason"] == "notifications/cancelled"
        done = await c0.wait_terminal(finishing)  # polled through another replica; the call ran to its end
        assert (
            done["status"] == "completed"
            and done["result"]["content"][0]["text"] == "computed drained after 1.5s"
        )
        assert await asyncio.wait_for(terminating, timeout=30) == 0  # and then the replica exited
    finally:
        await asyncio.wait_for(terminating, timeout=60)
        await asyncio.to_thread(cluster.restart, 1)


async def test_a_synchronous_call_keeps_its_drain_timeout_past_drain_detached(legacy_url: str) -> None:
    """One replica, `drain_detached` 1 s below `drain_timeout` 3 s: a synchronous call that needs
    2 s gets its result, and the replica then exits; the listen stream it cuts at the end is logged
    as cut by the shutdown. (At drain_detached the replica cut every request still running: the
    client saw its connection close with no answer, and the log blamed the client.)"""
    settings = {"MCP_LEASE": "1s", "MCP_DETACH_AFTER": "10s", "MCP_DRAIN_TIMEOUT": "3s"}
    settings |= {"MCP_DRAIN_DETACHED": "1s", "MCP_DRAIN_GRACE": "0s"}
    with Cluster(upstream_url=legacy_url, settings=settings, replicas=1) as one:
        plain = ModernClient(one.replica_urls[0] + WEB, capabilities={})
        try:
            await plain.warm_up()
            call = asyncio.ensure_future(plain.call("slow_compute", {"seconds": 2, "label": "kept-drain"}))
            listen = asyncio.ensure_future(plain.request("subscriptions/listen", {"notifications": {}}))
            await asyncio.sleep(0.3)
            proc = one.procs[0]
            assert proc is not None
            proc.send_signal(signal.SIGTERM)
            reply = await asyncio.wait_for(call, 10)
            assert reply.result["content"][0]["text"] == "computed kept-drain after 2s", reply.message
            assert await asyncio.to_thread(proc.wait, 10) == 0
            with contextlib.suppress(aiohttp.ClientError):
                await asyncio.wait_for(listen, 5)  # cut: the stream lasts as long as its client
        finally:
            await plain.close()
        lines = [
            json.loads(line) for line in one.log_path(0).read_text().splitlines() if line.startswith("{")
        ]
    events = [line["event"] for line in lines if line.get("rpc_method") == "subscriptions/listen"]
    assert "request_cut_at_shutdown" in events and "client_disconnected" not in events, events


async def test_draining_owner_keeps_its_legacy_question_while_another_replica_adopts_the_session(
    cluster: Cluster,
) -> None:
    """One SDK session through HAProxy: a call that asks a question after a while, greets alongside,
    and the session's owner is SIGTERMed: its new requests move to another replica (adoption, same
    upstream session) while the owner still relays the question and takes its answer."""
    import redis.asyncio as aioredis

    asked: list[str] = []

    async def on_elicit(
        context: ClientRequestContext, params: types.ElicitRequestParams
    ) -> types.ElicitResult:
        asked.append(params.message)
        return types.ElicitResult(action="accept", content={"confirm": True})

    store = aioredis.from_url(cluster.redis_url)
    terminating: asyncio.Future[int] | None = None
    owner_i = -1
    try:
        before = set(await store.keys("*session:web:*"))
        async with (
            streamable_http_client(cluster.url + WEB) as (read, write),
            ClientSession(read, write, elicitation_callback=on_elicit) as session,
        ):
            await session.initialize()
            (key,) = set(await store.keys("*session:web:*")) - before
            owner = json.loads(await store.get(key))["owner"]
            owner_i = [_node_of(cluster, i) for i in range(3)].index(owner)
            confirm = asyncio.ensure_future(
                session.call_tool("confirm_delete", {"filename": "adopted.txt", "delay": 0.6})
            )
            stop = asyncio.Event()
            greeted: list[str] = []

            async def greets() -> None:
                while not stop.is_set():
                    greeted.append(
                        (await session.call_tool("greet", {"name": f"g{len(greeted)}"})).content[0].text
                    )

            looping = asyncio.ensure_future(greets())
            await asyncio.sleep(0.2)
            terminating = asyncio.ensure_future(asyncio.to_thread(cluster.terminate, owner_i, 30))
            result = await asyncio.wait_for(confirm, 10)
            await asyncio.sleep(0.3)  # a few more greets, on the adopter
            stop.set()
            await asyncio.wait_for(looping, 10)
        assert asked and "adopted.txt" in result.content[0].text and not result.is_error, result
        assert greeted and all(text.startswith("Hello, g") for text in greeted)
        assert await asyncio.wait_for(terminating, 15) == 0  # the owner exits once its exchanges are over
    finally:
        await store.aclose()
        if terminating is not None:
            await asyncio.wait_for(terminating, 60)
        if owner_i >= 0 and not cluster.alive(owner_i):
            await asyncio.to_thread(cluster.restart, owner_i)


# -- a replica dies -----------------------------------------------------------------------------


async def _open_legacy(http: aiohttp.ClientSession, url: str) -> str:
    init = {**LEGACY_INITIALIZE, "id": 0}
    async with http.post(url, json=init, headers=LEGACY_HEADERS) as resp:
        assert resp.status == 200
        await resp.read()
        return resp.headers["Mcp-Session-Id"]


async def _legacy_ping(http: aiohttp.ClientSession, url: str, sid: str) -> int:
    headers = {**LEGACY_HEADERS, "Mcp-Session-Id": sid, "MCP-Protocol-Version": "2025-11-25"}
    async with http.post(url, json={"jsonrpc": "2.0", "id": 7, "method": "ping"}, headers=headers) as resp:
        await resp.read()
        return resp.status


async def _relayed_call(http: aiohttp.ClientSession, url: str, sid: str, label: str) -> tuple[int, dict]:
    """A 20 s `slow_compute` under `label` on legacy session `sid` at `url` (Accept: both forms):
    the HTTP status and the last message of its reply, JSON or SSE."""
    headers = {**LEGACY_HEADERS, "Mcp-Session-Id": sid, "MCP-Protocol-Version": "2025-11-25"}
    call = {
        "jsonrpc": "2.0",
        "id": 42,
        "method": "tools/call",
        "params": {"name": "slow_compute", "arguments": {"seconds": 20, "label": label}},
    }
    async with http.post(url, json=call, headers=headers) as resp:
        if not resp.headers["Content-Type"].startswith("text/event-stream"):
            return resp.status, await resp.json()
        messages = [json.loads(e.data) async for e in iter_events(resp.content.iter_any()) if e.data]
    return resp.status, messages[-1]


def _started(reply: Reply, label: str) -> int:
    """How many times the upstream started `slow_compute` under `label` (its `started_log`)."""
    return int(json.loads(reply.result["content"][0]["text"]).get(label, 0))


async def test_sigkill_ends_or_reruns_the_dead_replicas_tasks(
    cluster: Cluster, clients: list[ModernClient]
) -> None:
    c0, c1, c2 = clients
    await c2.warm_up()
    failing = (await c2.call("slow_compute", {"seconds": 30, "label": "killed"})).result["taskId"]
    unread = (await c2.call("slow_compute", {"seconds": 30, "label": "killed-unread"})).result["taskId"]
    rerun = (await c2.call("quiet_compute", {"seconds": 1})).result["taskId"]
    node = _node_of(cluster, 2)
    async with aiohttp.ClientSession() as http:
        web_sid = await _open_legacy(http, cluster.replica_urls[2] + WEB)
        stdio_sid = await _open_legacy(http, cluster.replica_urls[2] + LOCAL)
        # a v1 task of a session of replica 2 (every client is one principal here: a session lists
        # only the tasks it created)
        v1 = V1Client(cluster.replica_urls[2] + WEB)
        await v1.initialize()
        listed = await v1.call_as_task("slow_compute", {"seconds": 0.1, "label": "v1-listed"})
        assert await _legacy_ping(http, cluster.replica_urls[0] + WEB, web_sid) == 200  # relayed to replica 2
        # legacy calls relayed to replica 2, running when replica 2 dies: on the HTTP upstream's
        # session its reply stream has begun; on the stdio child's, its reply has not (a stdio
        # reply stays silent for sse_keepalive, in case the answer comes alone)
        relayed = {
            "web": asyncio.ensure_future(
                _relayed_call(http, cluster.replica_urls[0] + WEB, web_sid, "relayed-web")
            ),
            "local": asyncio.ensure_future(
                _relayed_call(http, cluster.replica_urls[0] + LOCAL, stdio_sid, "relayed-local")
            ),
        }
        async with asyncio.timeout(10):  # until the HTTP upstream runs its own (the child's dies with it)
            while _started(await c0.call("started_log"), "relayed-web") != 1:
                await asyncio.sleep(0.05)

        cluster.kill(2)
        killed_at = time.monotonic()
        # replica 0 ends each with an error under its id (the stream's last event, or a JSON body in an
        # HTTP 200, as the legacy wire answers a failed request), never with a bare cut, and never
        # serves the call again itself
        for which, call in relayed.items():
            status, answer = await asyncio.wait_for(call, timeout=10)
            assert status == 200, (which, status)
            assert answer["id"] == 42 and answer["error"]["code"] == -32603, answer
            assert f"proxy replica {node} serving this session was lost" in answer["error"]["message"]
        task = await c0.wait_status(failing, ("failed",), timeout=10)
        elapsed = time.monotonic() - killed_at
        assert elapsed < 2 * LEASE_S + 0.3, f"took {elapsed:.2f} s"  # the bound plus polling/scheduling slack
        assert re.search(
            rf"proxy replica running this call \(node {re.escape(node)}\) was lost", task["statusMessage"]
        )
        # (the upstream may run the call on: the kernel's close of the upstream connection does not stop it)
        assert "whether the upstream finished the call is unknown" in task["statusMessage"], task
        # so the survivor that took it over sent the upstream its cancel, on the dead replica's session
        cancelled = await _wait_cancelled_upstream(c0, "killed", timeout=10)
        assert cancelled["reason"] == "notifications/cancelled", cancelled
        # Nobody read `unread`: the survivors' sweep (every half
        # lease) ended it; the CLI reads the store as is.
        await asyncio.sleep(max(0.0, 2 * LEASE_S - (time.monotonic() - killed_at)))
        shown = await asyncio.to_thread(
            subprocess.run,
            [
                sys.executable,
                "-m",
                "proxy",
                "tasks",
                "--config",
                str(ROOT / "config" / "replicas.yaml"),
                "show",
                unread,
            ],
            env=cluster.env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert json.loads(shown.stdout)["status"] == "failed", shown.stdout + shown.stderr
        # on_restart: rerun: a survivor sends the call again and it completes.
        done = await c1.wait_terminal(rerun, timeout=10)
        assert (
            done["status"] == "completed"
            and done["result"]["content"][0]["text"] == "quietly computed after 1s"
        )
        assert _started(await c0.call("started_log"), "relayed-web") == 1  # it did not run twice
        # Legacy sessions of the dead replica: HTTP upstream adopted
        # (same upstream session), stdio gone (404).
        assert await _legacy_ping(http, cluster.replica_urls[0] + WEB, web_sid) == 200
        # now relayed to replica 0
        assert await _legacy_ping(http, cluster.replica_urls[1] + WEB, web_sid) == 200
        assert await _legacy_ping(http, cluster.replica_urls[0] + LOCAL, stdio_sid) == 404
        # the v1 session, adopted by replica 0, still lists its own task (which session made it was
        # kept in replica 2's memory only: the list came back empty)
        v1.url = cluster.replica_urls[0] + WEB
        status, message, _ = await v1.request("tasks/list")
        assert [t["taskId"] for t in message["result"]["tasks"]] == [listed["taskId"]], message
        await v1.close()
    await asyncio.to_thread(cluster.restart, 2)


async def test_a_replica_restarted_at_once_on_its_address_leaves_no_session_unknown(legacy_url: str) -> None:
    """SIGKILL, then a new process on the same address well within the dead one's lease (as
    systemd, supervisord or a container restart does): the dead replica's legacy sessions of an
    HTTP upstream are adopted at once, wherever their next request lands. The session map still
    named the dead node, whose registry record pointed at the address the new process holds, so
    every hop reached the new process, which answered 404 ("unknown or expired session") until the
    old lease lapsed: a client following the spec drops its session at the first 404."""
    settings = {**SETTINGS, "MCP_LEASE": "30s"}
    with Cluster(upstream_url=legacy_url, replicas=2, settings=settings) as two:
        async with aiohttp.ClientSession() as http:

            async def ping(url: str, sid: str) -> dict:
                headers = {**LEGACY_HEADERS, "Mcp-Session-Id": sid, "MCP-Protocol-Version": "2025-11-25"}
                body = {"jsonrpc": "2.0", "id": 7, "method": "ping"}
                async with http.post(url + WEB, json=body, headers=headers) as resp:
                    return {"status": resp.status, **(await resp.json())}

            through_other = await _open_legacy(http, two.replica_urls[0] + WEB)
            through_itself = await _open_legacy(http, two.replica_urls[0] + WEB)
            assert await _legacy_ping(http, two.replica_urls[1] + WEB, through_other) == 200  # relayed
            two.kill(0)
            await asyncio.to_thread(two.restart, 0)
            started = time.monotonic()
            # through the survivor (its hop reaches the new process), and straight to the new process
            assert await ping(two.replica_urls[1], through_other) == {
                "status": 200,
                "jsonrpc": "2.0",
                "id": 7,
                "result": {},
            }
            assert await ping(two.replica_urls[0], through_itself) == {
                "status": 200,
                "jsonrpc": "2.0",
                "id": 7,
                "result": {},
            }
            # and on from either replica, now that each has an owner that is up
            for url in two.replica_urls:
                for sid in (through_other, through_itself):
                    assert (await ping(url, sid)).get("result") == {}, (url, sid)
            assert time.monotonic() - started < 10  # not the dead node's lease (30 s)


def _open_counts(cluster: Cluster) -> dict[int, int]:
    """Requests HAProxy has open on each replica right now (stats `scur`), by slot."""
    import csv
    import io

    with urllib.request.urlopen(f"http://127.0.0.1:{cluster.stats_port}/stats;csv", timeout=1) as resp:
        rows = csv.DictReader(io.StringIO(resp.read().decode().lstrip("# ")))
        return {
            int(r["svname"][1:]): int(r["scur"] or 0)
            for r in rows
            if r.get("pxname") == "replicas" and r["svname"].startswith("r")
        }


def _busy_slot(cluster: Cluster, before: dict[int, int]) -> int | None:
    """The one replica with more requests open than in `before` (connections earlier tests left
    open count in `scur` too), if exactly one."""
    busy = [slot for slot, n in _open_counts(cluster).items() if n > before.get(slot, 0)]
    return busy[0] if len(busy) == 1 else None


async def test_a_call_whose_replica_dies_is_not_sent_again_by_the_balancer(
    cluster: Cluster, clients: list[ModernClient]
) -> None:
    """A synchronous call in flight on a replica that is SIGKILLed: the upstream saw it start once,
    and the client gets an error from the balancer, not a silent second run on another replica."""
    sync = ModernClient(cluster.url + WEB, capabilities={})  # no tasks extension: the call stays synchronous
    try:
        await sync.warm_up()
        body = {
            "jsonrpc": "2.0",
            "id": 1,
            "method": "tools/call",
            "params": {"name": "slow_compute", "arguments": {"seconds": 3, "label": "lb-once"}, "_meta": {}},
        }
        body["params"]["_meta"] = envelope({})
        headers = sync.headers_for("tools/call", body["params"])

        async def post() -> int:
            try:
                async with sync.http.post(sync.url, data=json.dumps(body).encode(), headers=headers) as resp:
                    await resp.read()
                    return resp.status
            except aiohttp.ClientError:  # the response had begun (keepalives) and was cut
                return 0

        before = await asyncio.to_thread(_open_counts, cluster)
        sent = asyncio.ensure_future(post())
        # until the upstream runs the call (polled, not a fixed sleep: a loaded machine is slow)
        for _ in range(50):
            await asyncio.sleep(0.1)
            if (
                json.loads((await clients[0].call("started_log")).result["content"][0]["text"]).get("lb-once")
                == 1
            ):
                break
        busy = None
        for _ in range(20):  # and HAProxy shows it open on exactly one replica
            busy = await asyncio.to_thread(_busy_slot, cluster, before)
            if busy is not None:
                break
            await asyncio.sleep(0.1)
        assert busy is not None and not sent.done()
        await asyncio.to_thread(cluster.kill, busy)
        status = await asyncio.wait_for(sent, timeout=10)
        assert status == 0 or status >= 500  # an error, not the result of a second run
        survivor = clients[(busy + 1) % 3]
        reply = await survivor.call("started_log")
        assert json.loads(reply.result["content"][0]["text"]).get("lb-once") == 1
        await asyncio.to_thread(cluster.restart, busy)
    finally:
        await sync.close()


# -- rolling restart under load -----------------------------------------------------------------


class _Client(ModernClient):
    """A raw client that keeps a reply that is not JSON-RPC (a balancer's error page) as `{"raw": ...}`."""

    async def post_raw(self, data: bytes, headers: dict[str, str]) -> Reply:
        try:
            return await super().post_raw(data, headers)
        except ValueError:
            # not sent twice in the passing case
            async with self.http.post(self.url, data=data, headers=headers) as resp:
                return Reply(
                    resp.status,
                    {"raw": (await resp.text())[:300], "again": True},
                    [],
                    resp.headers.get("Content-Type", ""),
                )


class Load:
    """Continuous mixed load through HAProxy until `stop` is set: detached and synchronous modern
    calls (tasks polled to the end through the balancer) and a legacy session's calls."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.stop = asyncio.Event()
        self.problems: list[str] = []
        self.tasks_done = 0
        self.sync_done = 0
        self.legacy_done = 0

    async def detached(self, worker: int) -> None:
        client = _Client(self.url + WEB)
        try:
            n = 0
            while not self.stop.is_set():
                n += 1
                label, seconds = f"roll-{worker}-{n}", round(random.uniform(0.2, 1.0), 2)
                reply = await client.call("slow_compute", {"seconds": seconds, "label": label})
                if "result" not in reply.message:
                    self.problems.append(f"{label} {time.strftime('%X')}: {reply.status} {reply.message}")
                    continue
                result = reply.result
                if result.get("resultType") == "task":
                    async with asyncio.timeout(30):
                        while True:
                            got = await client.get(result["taskId"])
                            if "result" not in got.message:
                                # unknown id, or worse
                                self.problems.append(
                                    f"{label} tasks/get {time.strftime('%X')}: {got.status} {got.message}"
                                )
                                break
                            if got.result["status"] in ("completed", "failed", "cancelled"):
                                result = got.result.get("result", got.result)
                                break
                            await asyncio.sleep(0.05)
                    self.tasks_done += 1
                if result.get("content", [{}])[0].get("text") != f"computed {label} after {seconds:g}s":
                    self.problems.append(f"{label}: {result}")
        finally:
            await client.close()

    async def sync(self, pause_s: float = 0.02) -> None:
        """Synchronous greets on one keep-alive connection, `pause_s` (s) apart (0: back to back)."""
        client = _Client(self.url + WEB, capabilities={})
        try:
            while not self.stop.is_set():
                reply = await client.call("greet", {"name": "sync"})
                if reply.message.get("result", {}).get("content", [{}])[0].get("text") != "Hello, sync!":
                    self.problems.append(f"sync greet: {reply.status} {reply.message}")
                self.sync_done += 1
                await asyncio.sleep(pause_s)
        finally:
            await client.close()

    async def legacy(self) -> None:
        async with (
            streamable_http_client(self.url + WEB) as (read, write),
            ClientSession(read, write) as session,
        ):
            await session.initialize()
            while not self.stop.is_set():
                text = (await session.call_tool("greet", {"name": "legacy"})).content[0].text
                if text != "Hello, legacy!":
                    self.problems.append(f"legacy greet: {text}")
                self.legacy_done += 1
                await asyncio.sleep(0.05)


async def test_a_replica_with_nothing_to_run_listens_until_haproxy_has_taken_it_out(cluster: Cluster) -> None:
    # listen.drain_grace (the cluster: 5 x HAProxy's 100 ms check interval): the replica stops
    # listening only after HAProxy counts it DOWN, so HAProxy never sends a request on a connection
    # the replica is closing.
    states: list[str] = []
    stopping = asyncio.ensure_future(asyncio.to_thread(cluster.terminate, 2))
    started = time.monotonic()
    while not stopping.done():
        states.append((await asyncio.to_thread(cluster.server_states)).get("r2", "?"))
        await asyncio.sleep(0.02)
    took = time.monotonic() - started
    await stopping
    await asyncio.to_thread(cluster.restart, 2)
    assert "DOWN" in states, states
    assert took >= 0.5, took


async def test_rolling_restart_under_load_loses_nothing(cluster: Cluster) -> None:
    # Back-to-back calls keep HAProxy's pooled connections to every replica busy: a replica that
    # stopped listening before HAProxy took it out (listen.drain_grace 0s) closed one of them as a
    # request went out on it, and HAProxy dropped that client's connection unanswered (1-2
    # ServerDisconnectedError in 3 rolling restarts with 8 such clients).
    load = Load(cluster.url)
    workers = (
        [asyncio.ensure_future(load.detached(i)) for i in range(4)]
        + [asyncio.ensure_future(load.sync()), asyncio.ensure_future(load.legacy())]
        + [asyncio.ensure_future(load.sync(pause_s=0)) for _ in range(4)]
    )
    try:
        await asyncio.sleep(0.5)
        for _ in range(2):
            await asyncio.wait_for(asyncio.to_thread(cluster.rolling_restart), timeout=120)
        await asyncio.sleep(0.5)
    finally:
        load.stop.set()
        results = await asyncio.wait_for(asyncio.gather(*workers, return_exceptions=True), timeout=60)
    errors = [repr(r) for r in results if isinstance(r, BaseException)]
    print(
        f"\nrolling restart: {load.tasks_done} tasks, {load.sync_done} sync calls, {load.legacy_done} legacy "
        f"calls"
    )
    assert errors == [] and load.problems == [], "\n".join(errors + load.problems)
    assert load.tasks_done >= 8 and load.sync_done > 0 and load.legacy_done > 0
    assert all(cluster.alive(i) for i in range(3))
