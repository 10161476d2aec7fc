"""Acceptance: a real third-party upstream (server-everything from npm) behind the proxy, driven by
FastMCP's client with the tasks extension (fastmcp-tasks)."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from pathlib import Path

import fastmcp_tasks  # noqa: F401  (registers the tasks extension on every Client)
import pytest
from fastmcp import Client
from support.proxy import Serve
from support.redis_server import RedisServer
from support.relay import relay_to
from support.servers import ROOT, ServerProcess, npm_install

from proxy.app import DRAIN_KEY, POOLS_KEY
from proxy.calls.keys import KEY_META
from proxy.config import config_from_data
from proxy.tasks.model import TaskStatus
from proxy.tasks.store import ListFilter

pytestmark = [
    pytest.mark.node,
    pytest.mark.timeout(900),
]  # first run installs its tools (npm, a venv): longer than the suite's 300 s
EVERYTHING = "@modelcontextprotocol/server-everything@2026.8.31"
NODE_DIR = ROOT / ".node" / "everything"


def _install_everything() -> Path:
    entry = NODE_DIR / "node_modules" / "@modelcontextprotocol" / "server-everything" / "dist" / "index.js"
    if not entry.exists():
        npm_install(NODE_DIR, EVERYTHING)
    return entry


@pytest.fixture(scope="module")
def everything_url() -> Iterator[str]:
    """server-everything over Streamable HTTP on a free port (a thin wrapper prints the ready line)."""
    entry = _install_everything()
    wrapper = ROOT / "tests" / "fixtures" / "run_node_server.py"
    server = ServerProcess(
        [sys.executable, str(wrapper), "node", str(entry), "streamableHttp"], env={"NODE_NO_WARNINGS": "1"}
    )
    yield server.url
    server.stop()


async def test_long_operation_becomes_a_task_and_returns_the_direct_content(
    everything_url: str, tmp_path: Path, serve: Serve
) -> None:
    config = config_from_data(
        {
            "store": {"path": str(tmp_path / "store")},
            "tasks": {"detach_after": "1s", "poll_interval": "200ms"},
            "mcpServers": {"everything": {"url": everything_url}},
        }
    )
    args = {"duration": 4, "steps": 4}
    proxy = await serve(config)

    async def direct() -> object:
        async with Client(everything_url) as client:
            return await client.call_tool("trigger-long-running-operation", args)

    async def proxied() -> object:
        async with Client(proxy.url()) as client:
            assert client.protocol_version == "2026-07-28"
            result = await client.call_tool("trigger-long-running-operation", args)
            echo = await client.call_tool("echo", {"message": "hello"})
            return result, echo

    direct_result, (proxied_result, echo) = await asyncio.gather(direct(), proxied())
    assert [c.model_dump() for c in proxied_result.content] == [c.model_dump() for c in direct_result.content]
    assert "hello" in echo.content[0].text
    records, _ = await proxy.store.list_tasks(ListFilter())
    long_ops = [r for r in records if r.tool == "trigger-long-running-operation"]
    assert len(long_ops) == 1 and long_ops[0].status is TaskStatus.COMPLETED
    assert not [r for r in records if r.tool == "echo"], "echo must stay synchronous"


async def test_elicitation_is_answered_through_fastmcp_handler(
    everything_url: str, tmp_path: Path, serve: Serve
) -> None:
    config = config_from_data(
        {
            "store": {"path": str(tmp_path / "store")},
            "tasks": {"detach_after": "1s"},
            "mcpServers": {"everything": {"url": everything_url}},
        }
    )
    asked: list[str] = []

    async def on_elicit(message, response_type, params, context):
        asked.append(message)
        return {"name": "Ada Lovelace", "check": True, "email": "ada@example.com"}

    proxy = await serve(config)
    async with Client(proxy.url(), elicitation_handler=on_elicit) as client:
        result = await client.call_tool("trigger-elicitation-request", {})
    await proxy.stop()
    text = "\n".join(c.text for c in result.content if getattr(c, "text", None))
    assert asked == ["Please provide inputs for the following fields:"]
    assert "Ada Lovelace" in text and "ada@example.com" in text


async def test_upstream_v1_task_backs_a_v2_task_and_a_synchronous_call(
    everything_url: str, tmp_path: Path, serve: Serve
) -> None:
    """server-everything's `simulate-research-query` (`taskSupport: required`, the upstream's own
    v1 task): FastMCP's tasks client gets a v2 task that completes with the upstream's result; a
    2026-07-28 client without the extension gets the synchronous result."""
    from support.clients import ModernClient

    config = config_from_data(
        {
            "store": {"path": str(tmp_path / "store")},
            "tasks": {"detach_after": "1s", "poll_interval": "200ms"},
            "mcpServers": {"everything": {"url": everything_url}},
        }
    )
    proxy = await serve(config)

    async def with_tasks() -> str:
        async with Client(proxy.url()) as client:
            result = await client.call_tool("simulate-research-query", {"topic": "tides"})
            return result.content[0].text

    async def without_extension() -> dict:
        plain = ModernClient(proxy.url(), capabilities={})
        try:
            reply = await plain.call("simulate-research-query", {"topic": "moons"})
            assert reply.status == 200, reply.message
            return reply.result
        finally:
            await plain.close()

    tasked, synchronous = await asyncio.gather(with_tasks(), without_extension())
    assert tasked.startswith("# Research Report: tides")
    assert synchronous["resultType"] == "complete" and synchronous.get("isError") is not True
    assert synchronous["content"][0]["text"].startswith("# Research Report: moons")
    records, _ = await proxy.store.list_tasks(ListFilter())
    assert [r.status for r in records if r.tool == "simulate-research-query"] == [TaskStatus.COMPLETED]


async def test_a_key_joins_a_call_an_upstream_task_backs(
    everything_url: str, tmp_path: Path, serve: Serve
) -> None:
    """An idempotency key on a tool the upstream runs as its own task: the retry gets the same
    task's result, and the proxy made one task of the two calls."""
    config = config_from_data(
        {
            "store": {"path": str(tmp_path / "store")},
            "tasks": {"detach_after": "1s", "poll_interval": "200ms"},
            "mcpServers": {"everything": {"url": everything_url}},
        }
    )
    proxy = await serve(config)
    async with Client(proxy.url()) as client:
        texts = [
            (await client.call_tool("simulate-research-query", {"topic": "reefs"}, meta={KEY_META: "k-1"}))
            .content[0]
            .text
            for _ in range(2)
        ]
    assert texts[0] == texts[1] and texts[0].startswith("# Research Report: reefs")
    records, _ = await proxy.store.list_tasks(ListFilter())
    assert len([r for r in records if r.tool == "simulate-research-query"]) == 1


async def test_v1_client_keeps_the_plain_pass_through_to_an_upstream_with_tasks(
    everything_url: str, tmp_path: Path, serve: Serve
) -> None:
    """In front of an upstream with v1 tasks of its own, a v1 client talks to those: the proxy
    neither declares its own `capabilities.tasks` nor serves `tasks/*` (they reach the upstream)."""
    from support.v1_client import V1Client

    config = config_from_data(
        {"store": {"path": str(tmp_path / "store")}, "mcpServers": {"everything": {"url": everything_url}}}
    )
    proxy = await serve(config)
    client = V1Client(proxy.url())
    try:
        init = await client.initialize()
        assert "tasks" in init["capabilities"]  # the upstream's own declaration, relayed
        task = await client.call_as_task("simulate-research-query", {"topic": "reefs"})
        status, message, _ = await client.request("tasks/get", {"taskId": task["taskId"]})
        assert status == 200 and message["result"]["taskId"] == task["taskId"]
        records, _ = await proxy.store.list_tasks(ListFilter())
        assert records == []  # the upstream's task, not the proxy's
        status, message, _ = await client.request("tasks/cancel", {"taskId": task["taskId"]})
        assert message["result"]["status"] == "cancelled"
    finally:
        await client.close()


async def test_upstream_task_question_becomes_input_required_and_is_answered(
    everything_url: str, tmp_path: Path, serve: Serve
) -> None:
    """The upstream's own task asks (elicitation on its `tasks/result` stream): the v2 task goes
    `input_required`, FastMCP answers through `tasks/update`, and the upstream's task completes."""
    config = config_from_data(
        {
            "store": {"path": str(tmp_path / "store")},
            "tasks": {"poll_interval": "200ms"},
            "mcpServers": {"everything": {"url": everything_url}},
        }
    )
    asked: list[str] = []

    async def on_elicit(message, response_type, params, context):
        asked.append(message)
        return {"interpretation": "technical"}

    proxy = await serve(config)
    async with Client(proxy.url(), elicitation_handler=on_elicit) as client:
        result = await client.call_tool("simulate-research-query", {"topic": "python", "ambiguous": True})
    await proxy.stop()
    assert asked and "multiple interpretations" in asked[0]
    assert "Clarification**: technical" in result.content[0].text


async def test_upstream_task_question_fails_a_call_without_the_extension_at_once(
    everything_url: str, tmp_path: Path, serve: Serve
) -> None:
    """Without the tasks extension nothing can carry the upstream task's question: the client gets
    -32603 saying so as soon as it is asked (not after input_timeout), and the upstream task is cancelled."""
    from support.clients import ModernClient

    config = config_from_data(
        {"store": {"path": str(tmp_path / "store")}, "mcpServers": {"everything": {"url": everything_url}}}
    )
    proxy = await serve(config)
    plain = ModernClient(proxy.url(), capabilities={"elicitation": {}})
    try:
        async with asyncio.timeout(15):
            reply = await plain.call("simulate-research-query", {"topic": "python", "ambiguous": True})
        assert reply.error["code"] == -32603 and "elicitation/create" in reply.error["message"], reply.message
    finally:
        await plain.close()


@pytest.mark.redis
async def test_an_upstream_task_whose_own_task_cannot_be_made_is_cancelled_upstream(
    everything_url: str, tmp_path: Path, serve: Serve, redis_server: RedisServer, redis_prefix: str
) -> None:
    """The upstream made its own task, but the proxy's task that would follow it cannot be made:
    Redis takes the create and its reply is held past `store.timeout` (500 ms). The client is told
    so (-32603, HTTP 503), the task the store took reads `failed`, and the upstream's task is
    cancelled (`tasks/cancel`) rather than left running with nobody to follow it while the client
    tries again."""
    from support.clients import ModernClient

    async with relay_to(redis_server) as (relay, relayed_url):
        store = {"url": relayed_url, "prefix": redis_prefix, "timeout": "500ms", "lease": "20s"}
        config = config_from_data({"store": store, "mcpServers": {"everything": {"url": everything_url}}})
        proxy = await serve(config)
        client = ModernClient(proxy.url())
        try:
            # The upstream session, and the store's scripts loaded by a first task (cancelled at once).
            warm = (await client.call("simulate-research-query", {"topic": "warm-up"})).result
            await client.request("tasks/cancel", {"taskId": warm["taskId"]})
            await client.wait_terminal(warm["taskId"])
            relay.pause_after(b"simulate-research-query")  # the create of the proxy's task, its reply held
            refused = await client.call("simulate-research-query", {"topic": "tides"})
            assert refused.status == 503 and refused.error["code"] == -32603, refused.message
            assert "could not become a task" in refused.error["message"], refused.message
            relay.resume()
            session = await proxy.app[POOLS_KEY]["everything"].session({})  # the session that created it
            async with asyncio.timeout(10):
                while True:
                    listed = await session.request("tasks/list", {}, handler=None)
                    statuses = [task["status"] for task in listed["result"]["tasks"]]
                    if statuses and "working" not in statuses:
                        break
                    await asyncio.sleep(0.05)
            assert statuses == ["cancelled", "cancelled"], listed
            async with asyncio.timeout(10):  # the record the store took: ended with the refusal
                while TaskStatus.WORKING in [r.status for r in await _records(proxy)]:
                    await asyncio.sleep(0.05)
            records = await _records(proxy)
            assert [r.status for r in records] == [TaskStatus.CANCELLED, TaskStatus.FAILED], records
        finally:
            relay.resume()
            await client.close()


async def _records(proxy) -> list:
    """The proxy's stored tasks, oldest first."""
    records, _ = await proxy.store.list_tasks(ListFilter())
    return sorted(records, key=lambda r: r.created_ms)


async def test_a_synchronous_call_an_upstream_task_backs_gets_the_drains_error(
    everything_url: str, tmp_path: Path, serve: Serve
) -> None:
    """A client without the tasks extension waits on a tool the upstream runs as its own task
    (about 4 s); the shutdown drain starts and is cut short (a second signal): the client gets the
    shutdown's -32603 at once, not a cut connection at drain_timeout, and the upstream's task is
    cancelled."""
    from support.clients import ModernClient

    config = config_from_data(
        {"store": {"path": str(tmp_path / "store")}, "mcpServers": {"everything": {"url": everything_url}}}
    )
    proxy = await serve(config)
    plain = ModernClient(proxy.url(), capabilities={})
    try:
        waiting = asyncio.create_task(plain.call("simulate-research-query", {"topic": "drained"}))
        session = await proxy.app[POOLS_KEY]["everything"].session({})
        async with asyncio.timeout(10):  # the upstream's task exists: the call waits on it
            while not (await session.request("tasks/list", {}, handler=None))["result"]["tasks"]:
                await asyncio.sleep(0.05)
        drain = proxy.app[DRAIN_KEY]
        drain.start(30.0)
        drain.cut()
        async with asyncio.timeout(3):
            reply = await waiting
        assert reply.error["code"] == -32603, reply.message
        assert "cut short by a second SIGTERM or SIGINT" in reply.error["message"], reply.message
        async with asyncio.timeout(10):
            while True:
                listed = await session.request("tasks/list", {}, handler=None)
                if [task["status"] for task in listed["result"]["tasks"]] != ["working"]:
                    break
                await asyncio.sleep(0.05)
        assert [task["status"] for task in listed["result"]["tasks"]] == ["cancelled"], listed
    finally:
        await plain.close()
