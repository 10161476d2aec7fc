"""Tracing end to end (README "Operations", tracing): three replicas of config/replicas.yaml on a real
redis-server behind HAProxy, tracing turned on by the standard `OTEL_EXPORTER_OTLP_ENDPOINT`
variable, exporting OTLP/HTTP to a real receiver that decodes the protobuf. A client-supplied
`traceparent` (header and `_meta`) ends in the same trace as the proxy's spans and the upstream's
received context; a detached call with one input round answered through a second replica and a
cancel from a third makes one connected trace, its `task` span on the owner linked to both."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator

import aiohttp
import pytest
from support.clients import LEGACY_INITIALIZE, ModernClient
from support.otlp import OtlpReceiver, ReceivedSpan
from support.servers import ROOT

sys.path.insert(0, str(ROOT))
from scripts.cluster import Cluster  # noqa: E402

pytestmark = [pytest.mark.redis, pytest.mark.haproxy]

ELICIT_CAPS = {"elicitation": {}, "extensions": {"io.modelcontextprotocol/tasks": {}}}
WEB, LOCAL = "/servers/web/mcp", "/servers/local/mcp"
RELAYED_TRACE = "6bf92f3577b34da6a3ce929d0e0e4737"
RELAYED_SPAN = "20f067aa0ba902b8"
SERVER_KIND = 2  # SPAN_KIND_SERVER in OTLP
CLIENT_TRACE = "5bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "10f067aa0ba902b7"
CONTEXT = {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"}
SETTINGS = {
    "MCP_LEASE": "1s",
    "MCP_DETACH_AFTER": "150ms",
    "MCP_POLL_INTERVAL": "50ms",
    "MCP_DRAIN_TIMEOUT": "5s",
    "MCP_DRAIN_DETACHED": "5s",
    "MCP_INPUT_TIMEOUT": "30s",
    "MCP_HOP_TIMEOUT": "2s",
    "OTEL_BSP_SCHEDULE_DELAY": "100",  # ms: export soon after a span ends
}


@pytest.fixture
async def receiver() -> AsyncIterator[OtlpReceiver]:
    found = await OtlpReceiver().start()
    yield found
    await found.stop()


@pytest.fixture
async def traced_cluster(legacy_url: str, receiver: OtlpReceiver) -> AsyncIterator[Cluster]:
    settings = {**SETTINGS, "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint}
    cluster = Cluster(upstream_url=legacy_url, settings=settings, check_inter="100ms")
    await asyncio.to_thread(cluster.start)
    try:
        yield cluster
    finally:
        await asyncio.to_thread(cluster.stop)


def in_trace(spans: list[ReceivedSpan]) -> list[ReceivedSpan]:
    return [span for span in spans if span.trace_id == CLIENT_TRACE]


async def test_one_detached_call_across_three_replicas_is_one_connected_trace(
    traced_cluster: Cluster, receiver: OtlpReceiver
) -> None:
    c0, c1, c2 = (ModernClient(url + WEB, capabilities=ELICIT_CAPS) for url in traced_cluster.replica_urls)
    try:
        # the context in a header only: the upstream gets the same trace in its header and its _meta
        echo = await c1.call("echo_meta", {}, headers=CONTEXT)
        payload = json.loads(echo.result["content"][0]["text"])
        assert payload["meta"]["traceparent"].split("-")[1] == CLIENT_TRACE
        assert payload["headers"]["traceparent"].split("-")[1] == CLIENT_TRACE
        # the context in _meta only: the same
        echo = await c2.call("echo_meta", {}, meta=CONTEXT)
        payload = json.loads(echo.result["content"][0]["text"])
        assert payload["meta"]["traceparent"].split("-")[1] == CLIENT_TRACE
        assert payload["headers"]["traceparent"].split("-")[1] == CLIENT_TRACE

        created = (await c0.call("ask_then_work", {"delay": 0.4, "seconds": 30}, meta=CONTEXT)).result
        assert created["resultType"] == "task", created
        task_id = created["taskId"]
        async with asyncio.timeout(10):
            while not (task := (await c1.get(task_id, meta=CONTEXT)).result).get("inputRequests"):
                await asyncio.sleep(0.05)
        ((key, _),) = task["inputRequests"].items()
        answer = {key: {"action": "accept", "content": {"name": "Ada"}}}
        ack = await c1.request("tasks/update", {"taskId": task_id, "inputResponses": answer}, meta=CONTEXT)
        assert ack.result == {"resultType": "complete"}
        cancelled = await c2.request("tasks/cancel", {"taskId": task_id}, meta=CONTEXT)
        assert cancelled.result == {"resultType": "complete"}
        assert (await c0.get(task_id)).result["status"] == "cancelled"
    finally:
        for client in (c0, c1, c2):
            await client.close()

    def task_span_ended(spans: list[ReceivedSpan]) -> bool:
        return any(s.name == "task" and s.attributes.get("mcp_tasks_proxy.task_id") == task_id for s in spans)

    def connected(spans: list[ReceivedSpan]) -> bool:
        ids = {s.span_id for s in spans}
        return all(s.parent_span_id == CLIENT_SPAN or s.parent_span_id in ids for s in spans)

    def all_arrived(spans: list[ReceivedSpan]) -> bool:
        traced = in_trace(spans)
        names = {s.name for s in traced}
        wanted = {"replica tasks/answer", "replica tasks/cancel", "tasks/update", "tasks/cancel"}
        # a child span ends, so is exported, before its parent: each replica's batch comes on its own
        return task_span_ended(spans) and wanted <= names and connected(traced)

    try:
        await receiver.wait_for(all_arrived, timeout=15)
    except TimeoutError:
        pass  # the assertions below say which span is missing
    spans = in_trace(receiver.spans)
    (task_span,) = [s for s in spans if s.name == "task"]
    assert task_span.service == "mcp-tasks-proxy"
    assert task_span.events[:2] == ["detached", "input_requested"]
    assert {"input_answered", "cancel_requested"} <= set(task_span.events)
    assert task_span.events[-1] == "cancelled"
    by_id = {s.span_id: s for s in spans}
    creator = by_id[task_span.parent_span_id]
    assert creator.name == "tools/call ask_then_work" and creator.parent_span_id == CLIENT_SPAN
    # the owner's task span links to the hops that answered and cancelled it
    linked = {by_id[span_id].name for _, span_id in task_span.links if span_id in by_id}
    assert {"replica tasks/answer", "replica tasks/cancel"} <= linked
    # the requests on the other replicas link to the task span
    for method in ("tasks/get", "tasks/update", "tasks/cancel"):
        assert any(s.name == method and (CLIENT_TRACE, task_span.span_id) in s.links for s in spans), method
    # one connected trace: every span hangs off the client's span or another span of the trace
    for span in spans:
        assert span.parent_span_id == CLIENT_SPAN or span.parent_span_id in by_id, (
            span.name,
            span.attributes,
        )
    # the replica that took the cancel hopped it to the owner inside its own request's span
    hop = next(s for s in spans if s.name == "replica tasks/cancel")
    chain = []
    current: ReceivedSpan | None = hop
    while current is not None:
        chain.append(current.name)
        current = by_id.get(current.parent_span_id)
    assert chain[-1] == "tasks/cancel", chain
    # nothing of a payload in any attribute
    for span in spans:
        assert "Ada" not in json.dumps(span.attributes)


async def test_a_legacy_request_relayed_to_its_sessions_replica_continues_the_trace_there(
    traced_cluster: Cluster, receiver: OtlpReceiver
) -> None:
    """A 2025-11-25 session on the stdio upstream lives on the replica that opened it (its child
    process); a request for it sent to another replica is relayed there. The relaying replica's
    request span, the hop's HTTP span and the owner's request span are one chain in the client's
    trace, and the owner's stdio child gets that trace in `_meta`."""
    head = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
    owner, other = traced_cluster.replica_urls[0] + LOCAL, traced_cluster.replica_urls[1] + LOCAL
    async with aiohttp.ClientSession() as http:
        async with http.post(owner, json=LEGACY_INITIALIZE, headers=head) as resp:
            assert resp.status == 200
            sid = resp.headers["Mcp-Session-Id"]
            await resp.read()
        head = {**head, "Mcp-Session-Id": sid, "MCP-Protocol-Version": "2025-11-25"}
        async with http.post(
            owner, json={"jsonrpc": "2.0", "method": "notifications/initialized"}, headers=head
        ):
            pass
        call = {
            "jsonrpc": "2.0",
            "id": 2,
            "method": "tools/call",
            "params": {"name": "echo_meta", "arguments": {}},
        }
        context = {"traceparent": f"00-{RELAYED_TRACE}-{RELAYED_SPAN}-01"}
        async with http.post(other, json=call, headers={**head, **context}) as resp:
            assert resp.status == 200
            text = await resp.text()
    events = [line[5:].strip() for line in text.splitlines() if line.startswith("data:")]
    reply = next(json.loads(event) for event in events if event) if events else json.loads(text)
    meta = json.loads(reply["result"]["content"][0]["text"])["meta"]
    assert meta["traceparent"].split("-")[1] == RELAYED_TRACE

    def chain_arrived(spans: list[ReceivedSpan]) -> bool:
        mine = [s for s in spans if s.trace_id == RELAYED_TRACE and s.name == "tools/call echo_meta"]
        return len([s for s in mine if s.kind == SERVER_KIND]) >= 2

    spans = [s for s in await receiver.wait_for(chain_arrived, timeout=15) if s.trace_id == RELAYED_TRACE]
    by_id = {s.span_id: s for s in spans}
    servers = [s for s in spans if s.name == "tools/call echo_meta" and s.kind == SERVER_KIND]
    relaying = next(s for s in servers if s.parent_span_id == RELAYED_SPAN)
    on_owner = next(s for s in servers if s is not relaying)
    hop = by_id[on_owner.parent_span_id]  # the HTTP exchange of the relay, under the relaying span
    assert hop.name == "POST" and hop.parent_span_id == relaying.span_id
    assert on_owner.attributes["mcp_tasks_proxy.era"] == "legacy"
