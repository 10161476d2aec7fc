"""The operator console's JSON API: access (none, client token, console token, cookie + CSRF),
filters, pagination over 1,000 tasks, cancel, the event stream, other servers and expired tasks."""

from __future__ import annotations

import asyncio
import json
import time
import tomllib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from multidict import CIMultiDict
from support.clients import LEGACY_HEADERS, LEGACY_INITIALIZE, ModernClient
from support.console import CLIENT_TOKEN, CONSOLE_TOKEN, client_for, console_config, seed
from support.proxy import RunningProxy, Serve, make_config
from support.records import make_record
from support.redis_server import RedisServer
from support.relay import relay_to
from support.servers import free_port

from proxy.app import REPLICAS_KEY, TASKS_KEY
from proxy.config import ConfigError, config_from_data, load_config
from proxy.console.events import MAX_STREAMS, ConsoleHub, TooManyStreamsError
from proxy.front.auth import hash_token
from proxy.replicas.registry import Registry
from proxy.runtime.fanout import DEFAULT_LIMIT, OVERFLOW, Fanout
from proxy.tasks.model import TaskStatus, now_ms, principal_hash
from proxy.tasks.types import TaskChange, TaskEvent

ROOT = Path(__file__).resolve().parents[2]
BEARER = {"Authorization": f"Bearer {CONSOLE_TOKEN}"}


@pytest.fixture
async def console(legacy_url: str, tmp_path: Path, serve: Serve) -> AsyncIterator[RunningProxy]:
    proxy = await serve(console_config(legacy_url, tmp_path / "store"))
    yield proxy


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    # cookies for 127.0.0.1
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as session:
        yield session


async def get_json(http: aiohttp.ClientSession, url: str, headers: Any = None) -> tuple[int, Any]:
    async with http.get(url, headers=headers) as resp:
        assert resp.content_type == "application/json", (resp.status, await resp.text())
        return resp.status, await resp.json()


async def post_json(
    http: aiohttp.ClientSession, url: str, headers: dict | None = None, **kwargs: Any
) -> tuple[int, Any]:
    async with http.post(url, headers=headers, **kwargs) as resp:
        assert resp.content_type == "application/json", (resp.status, await resp.text())
        return resp.status, await resp.json()


# -- on/off and access ---------------------------------------------------------------------------


async def test_the_console_is_off_without_its_config_section(
    legacy_url: str, tmp_path: Path, http: aiohttp.ClientSession, serve: Serve
) -> None:
    proxy = await serve(make_config(legacy_url, tmp_path / "store"))
    for path in ("/console/", "/console/api/tasks", "/console/api/session", "/console/api/running"):
        status, body = await get_json(http, proxy.base + path, BEARER)
        assert status == 404 and "error" in body


async def test_access_needs_a_console_token_or_a_signed_in_cookie(
    console: RunningProxy, http: aiohttp.ClientSession
) -> None:
    api = console.base + "/console/api/tasks"
    status, body = await get_json(http, api)
    assert status == 401 and "sign in" in body["error"]["message"]
    for client_token in ({}, {"Authorization": f"Bearer {CLIENT_TOKEN}"}):  # what is running, too
        status, body = await get_json(http, console.base + "/console/api/running", client_token)
        assert status == 401 and "requests" not in body
    # a client token never opens it
    status, body = await get_json(http, api, {"Authorization": f"Bearer {CLIENT_TOKEN}"})
    assert status == 401 and "not a console token" in body["error"]["message"]
    status, body = await get_json(http, api, BEARER)
    assert status == 200 and body == {"tasks": [], "nextCursor": None}
    # two Authorization headers, whichever is the console's: refused (the first one counted)
    for pair in ((BEARER["Authorization"], "Bearer guess"), ("Bearer guess", BEARER["Authorization"])):
        status, body = await get_json(http, api, CIMultiDict([("Authorization", value) for value in pair]))
        assert status == 401 and "send one Authorization header" in body["error"]["message"]
    # A console token is never a client principal; the client token still works there.
    mcp = ModernClient(console.url("legacy"))
    try:
        refused = await mcp.call("greet", {"name": "x"}, headers=BEARER)
        assert refused.status == 401
    finally:
        await mcp.close()
    client = client_for(console)
    try:
        assert (await client.call("greet", {"name": "x"})).result["content"][0]["text"] == "Hello, x!"
    finally:
        await client.close()
    # The page shell is public (it holds no data) and locked down.
    async with http.get(console.base + "/console/") as resp:
        assert resp.status == 200 and resp.content_type == "text/html"
        assert (
            "frame-ancestors 'none'" in resp.headers["Content-Security-Policy"]
            and resp.headers["X-Frame-Options"] == "DENY"
        )
    async with http.get(console.base + "/console/static/console.js") as resp:
        assert resp.status == 200 and "EventSource" in await resp.text()
    async with http.get(console.base + "/console", allow_redirects=False) as resp:
        assert resp.status == 302 and resp.headers["Location"] == "/console/"


async def test_sign_in_sets_a_strict_httponly_cookie_and_mutations_need_the_csrf_token(
    console: RunningProxy, http: aiohttp.ClientSession
) -> None:
    base = console.base + "/console"
    status, body = await post_json(http, base + "/login", data={"token": CLIENT_TOKEN})
    assert status == 401 and "unknown console token" in body["error"]["message"]
    status, body = await post_json(
        http, base + "/login", data=b"{not json", headers={"Content-Type": "application/json"}
    )
    assert status == 400 and "not JSON" in body["error"]["message"]
    status, body = await post_json(http, base + "/login", json={"token": 42})
    assert status == 401
    status, body = await post_json(
        http, base + "/login", data={"token": "x"}, headers={"Origin": "http://127.0.0.1:1"}
    )
    assert status == 403 and "cross-origin" in body["error"]["message"]
    # An origin the proxy never answers (DNS rebinding): refused before the console, in its shape
    # (it was a JSON-RPC error with `code`, which the page cannot read), and on an MCP path not.
    status, body = await post_json(
        http, base + "/login", data={"token": "x"}, headers={"Origin": "http://evil.example"}
    )
    assert (
        status == 403 and body["error"]["status"] == 403 and "is not allowed here" in body["error"]["message"]
    )
    async with http.post(console.base + "/mcp", json={}, headers={"Origin": "http://evil.example"}) as resp:
        assert resp.status == 403 and (await resp.json())["error"]["code"] == -32600
    async with http.post(base + "/login", data={"token": CONSOLE_TOKEN}) as resp:
        assert resp.status == 200
        signed_in = await resp.json()
        cookie = resp.headers["Set-Cookie"]
    assert signed_in["operator"] == "alice" and len(signed_in["csrf"]) >= 32
    assert (
        "HttpOnly" in cookie
        and "SameSite=Strict" in cookie
        and "Path=/console/" in cookie
        and CONSOLE_TOKEN not in cookie
    )
    status, session = await get_json(http, base + "/api/session")
    assert (
        status == 200
        and session["operator"] == "alice"
        and session["csrf"] == signed_in["csrf"]
        and session["servers"] == ["legacy", "other"]
    )
    assert (await get_json(http, base + "/api/tasks"))[0] == 200
    cancel = base + "/api/tasks/no-such-task/cancel"
    status, body = await post_json(http, cancel)
    assert status == 403 and "X-CSRF-Token" in body["error"]["message"]
    status, body = await post_json(http, cancel, {"X-CSRF-Token": "wrong"})
    assert status == 403
    status, body = await post_json(
        http, cancel, {"X-CSRF-Token": signed_in["csrf"], "Sec-Fetch-Site": "cross-site"}
    )
    assert status == 403 and "cross-site" in body["error"]["message"]
    status, body = await post_json(http, cancel, {"X-CSRF-Token": signed_in["csrf"]})
    assert status == 404 and "unknown or expired" in body["error"]["message"]  # past the guard
    # A wrong bearer token never falls back to the cookie.
    assert (await get_json(http, base + "/api/tasks", {"Authorization": "Bearer nope"}))[0] == 401
    status, _ = await post_json(http, base + "/logout", {"X-CSRF-Token": signed_in["csrf"]})
    assert status == 200
    assert (await get_json(http, base + "/api/tasks"))[0] == 401


async def test_sign_out_revokes_a_copied_cookie(console: RunningProxy, http: aiohttp.ClientSession) -> None:
    base = console.base + "/console"
    async with http.post(base + "/login", data={"token": CONSOLE_TOKEN}) as resp:
        csrf = (await resp.json())["csrf"]
        cookie = resp.cookies["mcp_tasks_proxy_console"].value
    async with aiohttp.ClientSession() as thief:  # keeps a copy of the cookie
        copied = {"Cookie": f"mcp_tasks_proxy_console={cookie}"}
        assert (await get_json(thief, base + "/api/session", copied))[0] == 200
        assert (await post_json(http, base + "/logout", {"X-CSRF-Token": csrf}))[0] == 200
        assert (await get_json(thief, base + "/api/session", copied))[0] == 401


async def _raw(proxy: RunningProxy, request: bytes) -> int:
    """Send raw bytes (headers aiohttp's client would refuse to build); return the HTTP status."""
    host, port = proxy.base.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(request)
        await writer.drain()
        status_line = await asyncio.wait_for(reader.readline(), 10)
        return int(status_line.split()[1])
    finally:
        writer.close()


async def test_malformed_console_input_is_4xx_never_500(
    console: RunningProxy, http: aiohttp.ClientSession
) -> None:
    base = console.base + "/console"
    status, _ = await post_json(
        http, base + "/login", data=b'{"token":"\\ud800"}', headers={"Content-Type": "application/json"}
    )
    assert status == 401
    deep = b'{"token":' + b"[" * 100_000 + b"]" * 100_000 + b"}"  # past what JSON parsing follows
    status, _ = await post_json(
        http, base + "/login", data=deep, headers={"Content-Type": "application/json"}
    )
    assert status == 400
    for ctype in ("application/json; charset=foo", "application/x-www-form-urlencoded; charset=foo"):
        status, _ = await post_json(http, base + "/login", data=b"token=x", headers={"Content-Type": ctype})
        assert status == 400, ctype
    host = console.base.removeprefix("http://")
    for header in (b"Authorization: Bearer ab\xff", b"Cookie: mcp_tasks_proxy_console=ab\xffcd"):
        status = await _raw(
            console,
            b"GET /console/api/tasks HTTP/1.1\r\nHost: "
            + host.encode()
            + b"\r\n"
            + header
            + b"\r\nConnection: close\r\n\r\n",
        )
        assert status == 401, header
    async with http.post(base + "/login", data={"token": CONSOLE_TOKEN}) as resp:
        cookie = resp.cookies["mcp_tasks_proxy_console"].value
    status = await _raw(
        console,
        b"POST /console/api/tasks/x/cancel HTTP/1.1\r\nHost: "
        + host.encode()
        + b"\r\nCookie: mcp_tasks_proxy_console="
        + cookie.encode()
        + b"\r\nX-CSRF-Token: \xff\xfe\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
    )
    assert status == 403
    status = await _raw(
        console,
        b"POST /mcp HTTP/1.1\r\nHost: " + host.encode() + b"\r\nAuthorization: Bearer ab\xff\r\n"
        b"Content-Type: application/json\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}",
    )
    assert 400 <= status < 500
    status, body = await get_json(http, base + "/api/nope", BEARER)
    assert status == 404 and body["error"]["status"] == 404  # the console's own error shape


# -- listing -------------------------------------------------------------------------------------


async def test_filters_and_pagination_over_a_thousand_tasks(
    legacy_url: str, tmp_path: Path, http: aiohttp.ClientSession, serve: Serve
) -> None:
    start = now_ms()
    statuses = [TaskStatus.COMPLETED, TaskStatus.FAILED, TaskStatus.CANCELLED]
    records = [
        make_record(
            task_id=f"t{i:04d}",
            created_ms=start - 10_000 + i,
            server=("legacy", "other")[i % 2],
            tool=f"tool{i % 5}",
            principal=f"p{i % 4}",
            status=statuses[i % 3],
            ttl_ms=600_000,
        )
        for i in range(1000)
    ]
    await seed(tmp_path / "store", records)
    proxy = await serve(console_config(legacy_url, tmp_path / "store"))

    async def walk(limit: int = 100, **filters: str) -> list[str]:
        ids: list[str] = []
        cursor = None
        for _ in range(1001):
            query = {**filters, "limit": str(limit), **({"cursor": cursor} if cursor else {})}
            async with http.get(proxy.base + "/console/api/tasks", params=query, headers=BEARER) as resp:
                assert resp.status == 200, await resp.text()
                page = await resp.json()
            assert len(page["tasks"]) <= limit
            ids.extend(t["taskId"] for t in page["tasks"])
            cursor = page["nextCursor"]
            if cursor is None:
                return ids
        raise AssertionError("the listing never ended")

    everything = await walk()
    # newest first, each once
    assert everything == [r.task_id for r in sorted(records, key=lambda r: -r.created_ms)]
    assert len(everything) == 1000

    def expected(keep) -> list[str]:
        return [r.task_id for r in sorted(records, key=lambda r: -r.created_ms) if keep(r)]

    assert await walk(status="failed") == expected(lambda r: r.status is TaskStatus.FAILED)
    assert await walk(server="other", tool="tool3") == expected(
        lambda r: r.server == "other" and r.tool == "tool3"
    )
    p2 = principal_hash("p2")
    assert await walk(limit=7, principal=p2) == expected(lambda r: r.principal == "p2")
    assert await walk(limit=50, principal=p2, status="cancelled") == expected(
        lambda r: r.principal == "p2" and r.status is TaskStatus.CANCELLED
    )
    assert await walk(server="retired") == []
    status, first = await get_json(http, proxy.base + "/console/api/tasks?limit=1", BEARER)
    assert first["tasks"][0] == {
        "taskId": "t0999",
        "status": "completed",
        "statusMessage": None,
        "server": "other",
        "tool": "tool4",
        "principalHash": principal_hash("p3"),
        "createdMs": start - 10_000 + 999,
        "lastUpdatedMs": start - 10_000 + 999,
        "version": 1,
    }
    for query, word in (
        ("status=bogus", "status"),
        ("limit=0", "limit"),
        ("limit=201", "limit"),
        ("limit=x", "limit"),
        ("cursor=garbage", "cursor"),
        ("principal=p2", "principal"),
        ("tool=" + "x" * 600, "tool"),
    ):
        status, body = await get_json(http, f"{proxy.base}/console/api/tasks?{query}", BEARER)
        assert status == 400 and word in body["error"]["message"], (query, body)


# -- detail, cancel, the event stream -------------------------------------------------------------


async def read_events(resp: aiohttp.ClientResponse, until, timeout: float = 10.0) -> list[tuple[str, Any]]:
    """SSE events (`(event, data)`, comments as `(":", text)`) until `until(events)` is true."""
    events: list[tuple[str, Any]] = []
    name, data = "message", ""
    async with asyncio.timeout(timeout):
        while not until(events):
            line = (await resp.content.readline()).decode()
            if not line:
                raise AssertionError(f"the stream ended: {events}")
            line = line.rstrip("\n")
            if line.startswith(":"):
                events.append((":", line[1:].strip()))
            elif line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data = line[5:].strip()
            elif line == "" and data:
                events.append((name, json.loads(data)))
                name, data = "message", ""
    return events


async def test_detail_and_operator_cancel_of_a_running_task_stop_it_upstream(
    console: RunningProxy, http: aiohttp.ClientSession, capsys: pytest.CaptureFixture[str]
) -> None:
    client = client_for(console, "other")
    try:
        async with http.get(console.base + "/console/api/events", headers=BEARER) as stream:
            assert stream.headers["Content-Type"] == "text/event-stream"
            await read_events(stream, lambda ev: any(e[0] == "ready" for e in ev))
            created = (await client.call("slow_compute", {"seconds": 30, "label": "console-cancel"})).result
            task_id = created["taskId"]
            seen = await read_events(
                stream, lambda ev: any(e[0] == "task" and e[1]["taskId"] == task_id for e in ev)
            )
            event = next(e[1] for e in seen if e[0] == "task")
            assert (
                event["status"] == "working"
                and event["previousStatus"] is None
                and event["server"] == "other"
            )
            assert (
                event["principalHash"] == principal_hash("ci")
                and "ci" not in event.values()
                and "principal" not in event
            )

            status, task = await get_json(http, f"{console.base}/console/api/tasks/{task_id}", BEARER)
            assert (
                status == 200 and task["status"] == "working" and task["runningHere"] and task["ownerAlive"]
            )
            assert (
                [h["status"] for h in task["history"]] == ["working"]
                and task["outcome"] is None
                and "principal" not in task
            )
            # the id its request had upstream: what the proxy's log lines and the upstream's call it
            assert isinstance(task["upstreamRequestId"], int), task

            status, cancelled = await post_json(
                http, f"{console.base}/console/api/tasks/{task_id}/cancel", BEARER
            )
            assert (
                status == 200
                and cancelled["status"] == "cancelled"
                and cancelled["statusMessage"] == "cancelled by operator"
            )
            assert [h["status"] for h in cancelled["history"]] == ["working", "cancelled"]
            seen = await read_events(
                stream, lambda ev: any(e[0] == "task" and e[1]["status"] == "cancelled" for e in ev)
            )
            assert (
                next(e[1] for e in seen if e[0] == "task" and e[1]["status"] == "cancelled")["previousStatus"]
                == "working"
            )
        assert (await client.get(task_id)).result["status"] == "cancelled"  # what the client sees
        async with asyncio.timeout(5):  # the upstream call was stopped (notifications/cancelled)
            while "console-cancel" not in (await client.call("cancelled_log")).result["content"][0]["text"]:
                await asyncio.sleep(0.05)
        status, again = await post_json(http, f"{console.base}/console/api/tasks/{task_id}/cancel", BEARER)
        assert status == 409 and again["error"]["task"]["status"] == "cancelled"
    finally:
        await client.close()
    captured = capsys.readouterr()
    logged = [line for line in (captured.out + captured.err).splitlines() if "task_cancelled" in line]
    assert logged and "operator" in logged[0]


async def test_completed_results_preview_and_other_servers_and_expired_tasks(
    legacy_url: str, tmp_path: Path, http: aiohttp.ClientSession, serve: Serve
) -> None:
    long_text = "x" * 10_000
    await seed(
        tmp_path / "store",
        [
            make_record(
                task_id="elsewhere",
                server="retired",
                principal="someone",
                status=TaskStatus.COMPLETED,
                created_ms=now_ms() - 3_000,
                outcome={"result": {"content": [{"type": "text", "text": long_text}]}},
            ),
            make_record(
                task_id="failed-one",
                server="legacy",
                principal="ci",
                status=TaskStatus.FAILED,
                created_ms=now_ms() - 2_000,
                outcome={"error": {"code": -32603, "message": "upstream exploded"}},
            ),
            make_record(
                task_id="gone",
                server="legacy",
                principal="ci",
                status=TaskStatus.COMPLETED,
                created_ms=now_ms() - 5_000,
                ttl_ms=1,
                outcome={"result": {}},
            ),
        ],
    )
    proxy = await serve(console_config(legacy_url, tmp_path / "store"))
    api = proxy.base + "/console/api/tasks"
    # An operator sees every server's tasks, even a server no longer configured.
    status, task = await get_json(http, f"{api}/elsewhere", BEARER)
    assert (
        status == 200 and task["server"] == "retired" and task["principalHash"] == principal_hash("someone")
    )
    assert (
        task["outcome"]["kind"] == "result"
        and task["outcome"]["truncated"]
        and task["outcome"]["sizeBytes"] > 10_000
    )
    assert len(task["outcome"]["preview"]) == 4000
    status, body = await post_json(http, f"{api}/elsewhere/cancel", BEARER)
    assert status == 409 and "already completed" in body["error"]["message"]
    status, task = await get_json(http, f"{api}/failed-one", BEARER)
    assert task["outcome"] == {
        "kind": "error",
        "sizeBytes": len('{"code":-32603,"message":"upstream exploded"}'),
        "preview": json.dumps({"code": -32603, "message": "upstream exploded"}, indent=2),
        "truncated": False,
    }
    # ... while a client still sees only its own server's tasks.
    client = client_for(proxy, "legacy")
    try:
        assert (await client.get("elsewhere")).error["code"] == -32602
        assert (await client.get("failed-one")).result["status"] == "failed"
    finally:
        await client.close()
    # An expired task is gone for the console too: unknown, not listed, not cancellable.
    for method, url in (("GET", f"{api}/gone"), ("POST", f"{api}/gone/cancel")):
        async with http.request(method, url, headers=BEARER) as resp:
            assert resp.status == 404 and "unknown or expired" in (await resp.json())["error"]["message"]
    status, page = await get_json(http, api, BEARER)
    assert [t["taskId"] for t in page["tasks"]] == ["failed-one", "elsewhere"]


async def test_overview_and_a_stream_with_keepalives_that_ends_at_shutdown(
    legacy_url: str, tmp_path: Path, http: aiohttp.ClientSession, serve: Serve
) -> None:
    config = console_config(legacy_url, tmp_path / "store", listen={"sse_keepalive": "200ms"})
    proxy = await serve(config)
    status, overview = await get_json(http, proxy.base + "/console/api/overview", BEARER)
    assert (
        status == 200
        and overview["upstreams"] == {"legacy": "ok", "other": "ok"}
        and overview["store"] == "ok"
    )
    assert set(overview["tasksByStatus"]) <= {s.value for s in TaskStatus}
    buckets = overview["detachDelay"]["buckets"]
    assert (
        buckets[-1]["le"] == "+Inf" and sum(b["count"] for b in buckets) == overview["detachDelay"]["count"]
    )
    stream = await http.get(proxy.base + "/console/api/events", headers=BEARER)
    events = await read_events(stream, lambda ev: sum(e[0] == ":" for e in ev) >= 2, timeout=5)
    assert events[0][0] == "ready" and events[1] == (":", "keepalive")
    stopped = time.monotonic()
    await proxy.stop()
    # The proxy has shut down with the stream open: the stream did not hold the shutdown up, and it ended.
    try:
        assert time.monotonic() - stopped < 5
        async with asyncio.timeout(5):
            await stream.content.read()
    finally:
        stream.release()


async def _running_until(
    http: aiohttp.ClientSession, proxy: RunningProxy, found: Any, timeout: float = 10.0
) -> dict[str, Any]:
    """Poll `GET /console/api/running` until `found(body)` holds (bounded by `timeout`, s)."""
    async with asyncio.timeout(timeout):
        while True:
            status, body = await get_json(http, proxy.base + "/console/api/running", BEARER)
            assert status == 200, body
            if found(body):
                return body
            await asyncio.sleep(0.05)


async def _legacy_call(http: aiohttp.ClientSession, url: str, tool: str, arguments: dict) -> dict:
    """A handshake-era client: initialize, then one `tools/call` on its session; the call's reply."""
    headers = {**LEGACY_HEADERS, "Authorization": f"Bearer {CLIENT_TOKEN}"}
    async with http.post(url, json=LEGACY_INITIALIZE, headers=headers) as resp:
        assert resp.status == 200 and "protocolVersion" in await resp.text()
        headers["Mcp-Session-Id"] = resp.headers["Mcp-Session-Id"]
    call = {
        "jsonrpc": "2.0",
        "id": 2,
        "method": "tools/call",
        "params": {"name": tool, "arguments": arguments},
    }
    async with http.post(url, json=call, headers=headers) as resp:
        text = await resp.text()
    data = [line[5:].strip() for line in text.splitlines() if line.startswith("data:")]
    return json.loads(data[-1] if data else text)


async def test_running_lists_synchronous_calls_of_both_eras_with_their_ids_until_they_answer(
    console: RunningProxy, http: aiohttp.ClientSession
) -> None:
    """Calls that never become tasks (the client did not ask for tasks) are visible while they run:
    server, tool, era, principal hash, the request id the client gets back and the upstream's
    request id; they leave the list when they answer."""
    status, body = await get_json(http, console.base + "/console/api/running", BEARER)
    node = console.app[TASKS_KEY].node
    assert status == 200 and body == {"requests": [], "replicas": [{"replica": node, "total": 0}], "total": 0}
    modern = client_for(console)
    modern.capabilities = {}  # no tasks extension: the call stays synchronous however long it runs
    label = f"running-{time.monotonic_ns()}"
    try:
        first = asyncio.create_task(modern.call("slow_compute", {"seconds": 1.5, "label": label}))
        second = asyncio.create_task(
            _legacy_call(http, console.url("other"), "slow_compute", {"seconds": 1.5, "label": label})
        )

        def both(body: dict) -> bool:
            return {(r.get("era"), "upstreamRequestId" in r) for r in body["requests"]} >= {
                ("modern", True),
                ("legacy", True),
            }

        listed = await _running_until(http, console, both)
        rows = {row["era"]: row for row in listed["requests"]}
        assert listed["replicas"] == [{"replica": node, "total": 2}] and listed["total"] == 2
        for era, server in (("modern", "legacy"), ("legacy", "other")):
            row = rows[era]
            assert (
                row["server"] == server
                and row["rpcMethod"] == "tools/call"
                and row["tool"] == "slow_compute"
                and row["httpMethod"] == "POST"
                and row["principalHash"] == principal_hash("ci")
                and row["replica"] == node
                and 0 <= row["ageMs"] < 10_000
                and abs(row["startedMs"] - now_ms()) < 10_000
            ), row
        reply = await first
        assert reply.result["content"][0]["text"] == f"computed {label} after 1.5s"
        assert reply.request_id == rows["modern"]["requestId"]  # the id the client can name to an operator
        assert (await second)["result"]["content"][0]["text"] == f"computed {label} after 1.5s"
        for limit in ("1", ""):  # (empty: the default)
            status, body = await get_json(http, console.base + f"/console/api/running?limit={limit}", BEARER)
            assert status == 200 and body["requests"] == []  # the console's own requests are not listed
        for bad in ("0", "501", "x", "+5", "1_0", "\u0665", "-1"):
            status, body = await get_json(http, console.base + f"/console/api/running?limit={bad}", BEARER)
            assert status == 400 and "limit" in body["error"]["message"]
    finally:
        await modern.close()


def _strict_json(text: str) -> Any:
    """`text` as strict JSON (NaN and infinities refused, as browsers' JSON.parse does)."""

    def refuse(constant: str) -> Any:
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


async def _replica_pair(
    serve: Serve, legacy_url: str, store: dict[str, Any], *, store_of_a: dict[str, Any] | None = None
) -> tuple[RunningProxy, RunningProxy]:
    """Replicas A and B of one console config on a shared Redis store (`store_of_a`: A's own view of
    it, through a relay), each at the free port it advertises."""
    replicas = {"secret": "running-console-" + "s" * 24, "hop_timeout": "1s"}
    pair = []
    for own in (store_of_a or store, store):
        config = console_config(legacy_url, own, replicas=replicas, listen={"port": free_port()})
        pair.append(await serve(config, at_listen_port=True))
    return pair[0], pair[1]


async def _odd_peer(aiohttp_server: Any, node: str, body: str) -> str:
    """A peer at a free port whose `/_replica/running` answers `body`: its base URL."""

    async def running(request: web.Request) -> web.Response:
        return web.Response(text=body, content_type="application/json")

    app = web.Application()
    app.router.add_post("/_replica/running", running)
    server = await aiohttp_server(app)
    return str(server.make_url("")).rstrip("/")


@pytest.mark.redis
async def test_running_on_one_replica_lists_every_live_replicas_calls_and_names_those_that_cannot(
    legacy_url: str,
    http: aiohttp.ClientSession,
    serve: Serve,
    aiohttp_server: Any,
    redis_server: RedisServer,
    redis_prefix: str,
) -> None:
    """Two replicas behind one console: a synchronous call on B shows up in A's console answer under
    B's node id. Registered replicas that cannot be reached, run an earlier version, answer for
    another node (a stale record), or answer nonsense are named with the reason, and the answer
    still comes (bounded by `replicas.hop_timeout`), as strict JSON with only well-formed views."""
    a, b = await _replica_pair(serve, legacy_url, {"url": redis_server.url, "prefix": redis_prefix})
    node_a, node_b = a.app[TASKS_KEY].node, b.app[TASKS_KEY].node
    odd = await _odd_peer(
        aiohttp_server,
        "odd",
        '{"node":"odd","total":"many","requests":[{"ageMs":NaN,"server":"s"},7,'
        '{"ageMs":5,"startedMs":"x","upstreamRequestId":1e300,"server":"x","tool":{"deep":1},"requestId":"r-odd",'
        '"era":"' + "e" * 300 + '"}],"relayed":"x"}',
    )
    deep = await _odd_peer(aiohttp_server, "deep", "[" * 100_000 + "]" * 100_000)
    shared = b.app[REPLICAS_KEY].shared
    records = [
        Registry(shared, node="ghost", url="http://127.0.0.1:9", lease_ms=60_000),  # nothing listens there
        Registry(shared, node="older", url=legacy_url.removesuffix("/mcp"), lease_ms=60_000),  # 404
        Registry(shared, node="stale", url=b.base, lease_ms=60_000),  # B's address under another id
        Registry(shared, node="odd", url=odd, lease_ms=60_000),
        Registry(shared, node="deep", url=deep, lease_ms=60_000),
    ]
    for record in records:
        await record.announce()
    on_b = client_for(b)
    on_b.capabilities = {}
    label = f"replica-running-{time.monotonic_ns()}"
    try:
        call = asyncio.create_task(on_b.call("slow_compute", {"seconds": 1.0, "label": label}))
        listed = await _running_until(
            http, a, lambda body: any(r["replica"] == node_b for r in body["requests"])
        )
        async with http.get(a.base + "/console/api/running", headers=BEARER) as resp:
            strict = _strict_json(await resp.text())
        assert strict["total"] == listed["total"] == 2  # B's call and the odd peer's one well-formed view
        row = next(r for r in listed["requests"] if r["replica"] == node_b)
        assert row["tool"] == "slow_compute" and row["server"] == "legacy"
        assert [r for r in listed["requests"] if r["replica"] == "odd"] == [
            {"ageMs": 5, "server": "x", "requestId": "r-odd", "replica": "odd"}
        ]
        by_node = {entry["replica"]: entry for entry in listed["replicas"]}
        assert by_node[node_a] == {"replica": node_a, "total": 0}
        assert by_node[node_b] == {"replica": node_b, "total": 1}
        assert by_node["odd"] == {"replica": "odd", "total": 1}
        assert "could not be reached" in by_node["ghost"]["error"]
        assert (
            by_node["older"]["error"]
            == "replica older runs a version that cannot list its requests (HTTP 404)"
        )
        assert "a stale registry record" in by_node["stale"]["error"]
        assert "deep" in by_node["deep"]["error"]
        reply = await call
        assert reply.request_id == row["requestId"]
    finally:
        for record in records:
            await record.withdraw()
        await on_b.close()


@pytest.mark.redis
async def test_a_relayed_call_is_listed_once_and_a_cut_registry_still_lists_this_replica(
    legacy_url: str, http: aiohttp.ClientSession, serve: Serve, redis_server: RedisServer, redis_prefix: str
) -> None:
    """A legacy session opened on B, its call sent to A: A relays it to B. The console lists it
    once, on B (which runs it upstream), with `relayedBy` A and A's request id (the client's
    `X-Request-Id`) as `relayedRequestId`. With A cut off from Redis, A's console still answers
    200 with A's own requests and names the registry it cannot read."""
    store = {"url": redis_server.url, "prefix": redis_prefix, "timeout": "500ms"}
    async with relay_to(redis_server) as (relay, relayed_url):
        a, b = await _replica_pair(serve, legacy_url, store, store_of_a={**store, "url": relayed_url})
        node_a, node_b = a.app[TASKS_KEY].node, b.app[TASKS_KEY].node
        headers = {**LEGACY_HEADERS, "Authorization": f"Bearer {CLIENT_TOKEN}"}
        async with http.post(b.url("legacy"), json=LEGACY_INITIALIZE, headers=headers) as resp:
            assert resp.status == 200 and "protocolVersion" in await resp.text()
            headers["Mcp-Session-Id"] = resp.headers["Mcp-Session-Id"]
        arguments = {"seconds": 1.5, "label": f"relayed-{time.monotonic_ns()}"}
        body = {
            "jsonrpc": "2.0",
            "id": 2,
            "method": "tools/call",
            "params": {"name": "slow_compute", "arguments": arguments},
        }
        call = asyncio.create_task(http.post(a.url("legacy"), json=body, headers=headers))
        listed = await _running_until(
            http, a, lambda body: any("upstreamRequestId" in r for r in body["requests"])
        )
        [row] = listed["requests"]
        assert row["replica"] == node_b and row["relayedBy"] == node_a and row["era"] == "legacy"
        assert listed["total"] == 1 and {r["replica"]: r["total"] for r in listed["replicas"]} == {
            node_a: 1,
            node_b: 1,
        }
        async with await call as resp:
            assert resp.headers["X-Request-Id"] == row["relayedRequestId"]
            assert "computed" in await resp.text()
        on_a = client_for(a)
        on_a.capabilities = {}
        try:
            local = asyncio.create_task(on_a.call("slow_compute", {"seconds": 2.0, "label": "cut"}))
            await _running_until(http, a, lambda body: bool(body["requests"]))
            relay.pause()  # A's link to Redis hangs: the registry read times out (store timeout 500 ms)
            try:
                status, cut = await get_json(http, a.base + "/console/api/running", BEARER)
            finally:
                relay.resume()
            assert status == 200 and [r["replica"] for r in cut["requests"]] == [node_a]
            assert cut["replicas"][0] == {"replica": node_a, "total": 1}
            assert cut["replicas"][1]["replica"] is None
            assert "registry cannot be read" in cut["replicas"][1]["error"]
            assert "computed" in (await local).result["content"][0]["text"]
        finally:
            await on_a.close()


async def test_a_task_waiting_for_input_shows_its_questions_and_an_operator_can_cancel_it(
    console: RunningProxy, http: aiohttp.ClientSession
) -> None:
    # A task run by this node (its lease is alive) that waits for an answer; no live call here to stop.
    question = {
        "method": "elicitation/create",
        "params": {"message": "Deploy to prod?", "requestedSchema": {"type": "object"}},
    }
    await console.store.create(
        make_record(
            task_id="asking",
            principal="ci",
            server="legacy",
            owner=console.app[TASKS_KEY].node,
            status=TaskStatus.INPUT_REQUIRED,
            input_requests={"q1": question},
        )
    )
    status, page = await get_json(http, console.base + "/console/api/tasks?status=input_required", BEARER)
    assert status == 200 and [t["taskId"] for t in page["tasks"]] == ["asking"]
    status, task = await get_json(http, console.base + "/console/api/tasks/asking", BEARER)
    assert task["inputRequests"] == {"q1": question} and task["ownerAlive"] and not task["runningHere"]
    status, cancelled = await post_json(http, console.base + "/console/api/tasks/asking/cancel", BEARER)
    assert status == 200 and cancelled["status"] == "cancelled" and cancelled["inputRequests"] == {}


async def test_a_slow_reader_gets_resync_instead_of_an_unbounded_queue() -> None:
    hub, changes = ConsoleHub(), Fanout[TaskEvent]("task changes")
    with hub.subscribe(changes) as subscription:
        for i in range(DEFAULT_LIMIT + 5):
            changes.publish(TaskChange(TaskStatus.WORKING, make_record(task_id=f"r{i}")))
        drained = []
        while not subscription.empty():
            drained.append(subscription.get_nowait())
        assert OVERFLOW in drained and len(drained) <= DEFAULT_LIMIT  # the stream sends `resync` for it
    streams = [hub.subscribe(changes) for _ in range(MAX_STREAMS)]
    for stream in streams:
        stream.__enter__()
    try:
        with pytest.raises(TooManyStreamsError), hub.subscribe(changes):
            pass
    finally:
        for stream in streams:
            stream.__exit__(None, None, None)


# -- config --------------------------------------------------------------------------------------


def test_console_config_refuses_plain_tokens_and_client_tokens() -> None:
    base = {"mcpServers": {"a": {"url": "http://127.0.0.1:1/mcp"}}}
    with pytest.raises(ConfigError, match="console: tokens.alice must be a hash"):
        config_from_data({**base, "console": {"tokens": {"alice": "plain-secret"}}})
    with pytest.raises(ConfigError, match="console.tokens"):
        config_from_data({**base, "console": {"tokens": {}}})
    shared = hash_token("shared")
    with pytest.raises(ConfigError, match="also a client token"):
        config_from_data(
            {
                **base,
                "auth": {"mode": "bearer", "tokens": {"ci": shared}},
                "console": {"tokens": {"alice": shared.upper().replace("SHA256", "sha256")}},
            }
        )
    assert config_from_data(base).console is None
    assert (
        config_from_data(
            {**base, "console": {"tokens": {"alice": hash_token("alice-token-for-tests")}}}
        ).console.session_ttl
        == 8 * 3600
    )


async def test_the_example_console_config_serves_the_console(
    legacy_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    http: aiohttp.ClientSession,
    serve: Serve,
) -> None:
    monkeypatch.setenv("UPSTREAM_URL", legacy_url)
    config = load_config(ROOT / "config" / "console.yaml")
    config.store.path = str(tmp_path / "store")
    proxy = await serve(config)
    status, session = await get_json(
        http,
        proxy.base + "/console/api/session",
        {"Authorization": "Bearer example-console-token-change-me"},
    )
    assert status == 200 and session["operator"] == "alice" and session["csrf"] is None
    status, _ = await get_json(
        http, proxy.base + "/console/api/session", {"Authorization": "Bearer example-client-token"}
    )
    assert status == 401


def test_the_page_ships_in_the_wheel_as_package_data() -> None:
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"][
        "proxy.console"
    ]
    package = ROOT / "proxy" / "console"
    shipped = {path for pattern in patterns for path in package.glob(pattern)}
    assert {"index.html", "console.js", "console.css"} <= {p.name for p in (package / "static").iterdir()}
    assert set((package / "static").iterdir()) <= shipped
