"""Upstreams that misbehave on purpose: every wait on them is bounded by config, their redirects are
not followed (configured headers stay with the configured URL), oversized or mismatched replies are
JSON-RPC errors, and /readyz tells the truth. Both eras, scaled-down timings."""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from support.clients import LEGACY_HEADERS as RAW_LEGACY_HEADERS
from support.clients import LEGACY_INITIALIZE as INIT
from support.clients import ModernClient
from support.proxy import Serve
from support.servers import ROOT, ServerProcess, served_app

from proxy.config import config_from_data

LEGACY_HEADERS = {**RAW_LEGACY_HEADERS, "MCP-Protocol-Version": "2025-11-25"}
SECRET = "upstream-api-key-do-not-leak"


@pytest.fixture(scope="module")
def hostile() -> Iterator[str]:
    server = ServerProcess(
        [sys.executable, str(ROOT / "tests" / "fixtures" / "hostile_upstream.py"), "--port", "0"]
    )
    yield server.url
    server.stop()


def hostile_config(base: str, tmp_path: Path, mode: str, **server: object):
    entry = {
        "url": f"{base}/{mode}/mcp",
        "init_timeout": "300ms",
        "request_timeout": "300ms",
        "timeout": "5s",
        "headers": {"Authorization": f"Bearer {SECRET}"},
        **server,
    }
    return config_from_data(
        {
            "store": {"path": str(tmp_path / "store"), "durable": False},
            "tasks": {"detach_after": "2s", "poll_interval": "100ms"},
            "mcpServers": {mode.replace("-", "_"): entry},
        }
    )


async def legacy_post(url: str, body: dict, headers: dict | None = None) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as http:
        async with http.post(url, json=body, headers={**LEGACY_HEADERS, **(headers or {})}) as resp:
            text = await resp.text()
            if resp.headers.get("Content-Type", "").startswith("text/event-stream"):
                data = [
                    line[6:] for line in text.splitlines() if line.startswith("data: ") and line[6:].strip()
                ]
                return resp.status, json.loads(data[-1])
            return resp.status, json.loads(text)


async def open_session(http: aiohttp.ClientSession, url: str) -> str:
    """A legacy session through the proxy at `url` (its `initialize`); its `Mcp-Session-Id`."""
    async with http.post(url, json=INIT, headers=LEGACY_HEADERS) as resp:
        return resp.headers["Mcp-Session-Id"]


async def readyz(base: str) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{base}/readyz") as resp:
            return resp.status, await resp.json()


@pytest.mark.parametrize("tasks", [True, False], ids=["tasks-extension", "no-extension"])
async def test_hung_tools_list_never_hangs_a_call(
    hostile: str, tmp_path: Path, tasks: bool, serve: Serve
) -> None:
    proxy = await serve(hostile_config(hostile, tmp_path, "hang-list"))
    client = ModernClient(proxy.url(), capabilities=None if tasks else {})
    try:
        async with aiohttp.ClientSession() as http, http.get(f"{hostile}/lists") as resp:
            before = (await resp.json()).get("hang-list", 0)
        started = time.monotonic()
        async with asyncio.timeout(5):
            reply = await client.call("ok")
        assert reply.result["content"][0]["text"] == "ok"
        assert time.monotonic() - started < 3
        # The failure is remembered: the next calls do not wait for a tools/list again (each waited
        # request_timeout for one, and a task-capable call's handle then said it ran upstream).
        for _ in range(3):
            assert (await client.call("ok")).result["content"][0]["text"] == "ok"
        async with aiohttp.ClientSession() as http, http.get(f"{hostile}/lists") as resp:
            assert (await resp.json())["hang-list"] - before == 1
        listing = await client.request("tools/list")
        assert listing.error["code"] == -32603 and "request_timeout" in listing.error["message"]
        status, body = await readyz(proxy.base)
        assert status == 503 and body["checks"]["upstream:hang_list"] != "ok", body
    finally:
        await client.close()


async def test_hung_initialize_is_a_bounded_error_in_both_eras(
    hostile: str, tmp_path: Path, serve: Serve
) -> None:
    proxy = await serve(hostile_config(hostile, tmp_path, "hang-init"))
    client = ModernClient(proxy.url())
    try:
        async with asyncio.timeout(5):
            reply = await client.call("ok")
        assert reply.error["code"] == -32603 and "init_timeout" in reply.error["message"], reply.message
        async with asyncio.timeout(5):
            status, body = await legacy_post(proxy.url(), INIT)
        assert (
            status == 200 and body["error"]["code"] == -32603 and "init_timeout" in body["error"]["message"]
        )
        status, ready = await readyz(proxy.base)
        assert status == 503 and "initialize" in ready["checks"]["upstream:hang_init"]
    finally:
        await client.close()


async def test_redirects_are_not_followed_and_never_carry_configured_headers(
    hostile: str, tmp_path: Path, serve: Serve
) -> None:
    proxy = await serve(hostile_config(hostile, tmp_path, "redirect"))
    client = ModernClient(proxy.url())
    try:
        reply = await client.call("ok")
        assert reply.error["code"] == -32603 and "redirect" in reply.error["message"]
        status, body = await legacy_post(proxy.url(), INIT)
        assert status == 200 and "redirect" in body["error"]["message"]
    finally:
        await client.close()
    await proxy.stop()
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{hostile}/seen") as resp:
            seen = await resp.json()
    assert seen == []  # the redirect target never heard from the proxy, let alone its API key


@pytest.mark.parametrize("tool", ["big", "big_sse"])
async def test_oversized_upstream_replies_are_errors_in_both_eras(
    hostile: str, tmp_path: Path, tool: str, serve: Serve
) -> None:
    config = hostile_config(hostile, tmp_path, "ok", max_response_bytes=256 * 1024)
    proxy = await serve(config)
    client = ModernClient(proxy.url(), capabilities={})
    try:
        reply = await client.call(tool, {"kb": 1024})
        assert (
            reply.status < 500
            and reply.error["code"] == -32603
            and "max_response_bytes" in reply.error["message"]
        )
        assert (await client.call(tool, {"kb": 16})).result["content"][0]["text"].startswith(("x", "y"))
        async with aiohttp.ClientSession() as http:
            session = {
                "Mcp-Session-Id": await open_session(http, proxy.url()),
                "MCP-Protocol-Version": "2025-11-25",
            }
            call = {
                "jsonrpc": "2.0",
                "id": 2,
                "method": "tools/call",
                "params": {"name": tool, "arguments": {"kb": 1024}},
            }
            async with http.post(proxy.url(), json=call, headers={**LEGACY_HEADERS, **session}) as resp:
                if tool == "big":  # a JSON reply announces its size: refused before a byte is relayed
                    assert (
                        resp.status == 200 and "max_response_bytes" in (await resp.json())["error"]["message"]
                    )
                else:  # an SSE stream is never relayed whole: the unanswered call gets its JSON-RPC error
                    text = await resp.text()
                    events = (
                        [
                            json.loads(line[5:])
                            for line in text.splitlines()
                            if line.startswith("data:") and line[5:].strip()  # not a priming event
                        ]
                        if resp.headers["Content-Type"].startswith("text/event-stream")
                        else [json.loads(text)]  # the error alone, soon: plain JSON
                    )
                    answer = [e for e in events if e.get("id") == 2]
                    assert len(answer) == 1 and answer[0]["error"]["code"] == -32603, events
                    assert (
                        "broke its stream" in answer[0]["error"]["message"]
                        and "larger than" in answer[0]["error"]["message"]
                    )
            if tool == "big":  # a keyed call keeps that error: its retry gets it again (the call ran)
                keyed = {
                    **call,
                    "params": {**call["params"], "_meta": {"mcp-tasks-proxy/idempotencyKey": "big"}},
                }
                answers = []
                for _ in range(2):
                    async with http.post(
                        proxy.url(), json=keyed, headers={**LEGACY_HEADERS, **session}
                    ) as resp:
                        answers.append((await resp.json())["error"])
                assert answers[0] == answers[1] and "max_response_bytes" in answers[0]["message"], answers
        assert (await client.call("ok")).result["content"][0]["text"] == "ok"  # still serving
    finally:
        await client.close()


async def test_a_reply_for_another_id_is_refused(hostile: str, tmp_path: Path, serve: Serve) -> None:
    proxy = await serve(hostile_config(hostile, tmp_path, "ok"))
    client = ModernClient(proxy.url(), capabilities={})
    try:
        reply = await client.call("wrong_id")
        assert reply.error["code"] == -32603 and "response for id" in reply.error["message"], reply.message
    finally:
        await client.close()


@pytest.mark.parametrize(
    ("tool", "said"),
    [
        ("empty_202", "answered the request with HTTP 202 and no body"),
        ("null_result", "answered with a result that is not an object"),
        ("bad_error", "answered with a malformed JSON-RPC error"),
        ("text_429", "answered HTTP 429 (retry after 7 s): slow down"),
        ("sse_null_result", "answered with a result that is not an object"),
        ("drop", "dropped the connection before it answered"),
        ("bad_error_500", "answered with a malformed JSON-RPC error"),
        ("error_500_no_id", "it broke"),
        ("error_400_no_id", "it refused"),
    ],
)
async def test_a_legacy_call_whose_upstream_sends_no_fit_answer_gets_an_error_in_a_200(
    hostile: str, tmp_path: Path, tool: str, said: str, serve: Serve
) -> None:
    """On the legacy relay an upstream's empty 202, a `result: null`, a malformed error or a plain-text
    429 went to the client as they came: an `mcp` 1.x client waits forever for the answer an empty
    202 or an unparseable response never gives, and drops its transport on a 429. Each is now a
    -32603 under the request's id in an HTTP 200, and the session goes on (a call after it). An
    upstream's own error in a 4xx or 5xx comes in an HTTP 200 too (a 400 dropped a 1.x client). A
    `{"jsonrpc": "2.0"}` event, no JSON-RPC message, is dropped. A connection dropped after the
    request went out no longer says "unreachable": the call may have run."""
    proxy = await serve(hostile_config(hostile, tmp_path, "ok"))
    async with aiohttp.ClientSession() as http:
        session = {"Mcp-Session-Id": await open_session(http, proxy.url())}
        call = {"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {"name": tool, "arguments": {}}}
        # (`drop` until a fresh connection carries it: on a pooled one, each initialize's, the
        # client is told of a dropped reused connection instead)
        for _ in range(4 if tool == "drop" else 1):
            async with http.post(proxy.url(), json=call, headers={**LEGACY_HEADERS, **session}) as resp:
                status, text = resp.status, await resp.text()
            if "reused connection" not in text:
                break
        after = {"jsonrpc": "2.0", "id": 3, "method": "tools/call", "params": {"name": "ok", "arguments": {}}}
        async with http.post(proxy.url(), json=after, headers={**LEGACY_HEADERS, **session}) as resp:
            assert resp.status == 200 and (await resp.json())["result"]["content"][0]["text"] == "ok"
    messages = [
        json.loads(line[5:]) for line in text.splitlines() if line.startswith("data:") and line[5:].strip()
    ] or [json.loads(text)]
    assert status == 200 and len(messages) == 1, (status, text)
    error = messages[0]["error"]
    code = -32000 if tool.startswith("error_") else -32603  # (those are the upstream's own errors)
    assert messages[0]["id"] == 2 and error["code"] == code and said in error["message"], messages
    if tool == "bad_error":
        assert error["data"] == {"upstreamError": {"code": "bad", "message": 123}}, error
    if tool == "bad_error_500":
        assert error["data"] == {"upstreamError": "boom"}, error
    if tool in ("empty_202", "text_429"):  # the 2026-07-28 path quoted such a body as `b''`, `b'slow down'`
        client = ModernClient(proxy.url(), capabilities={})
        try:
            modern = (await client.call(tool)).error
        finally:
            await client.close()
        assert modern["code"] == -32603 and "b'" not in modern["message"], modern
        assert ("HTTP 202 with no body" if tool == "empty_202" else "HTTP 429: slow down") in modern[
            "message"
        ]
    if tool == "drop":
        assert "unreachable" not in error["message"] and "may have run there" in error["message"], error
        client = ModernClient(proxy.url(), capabilities={})
        try:
            for _ in range(4):
                modern = (await client.call("drop")).error
                if "reused connection" not in modern["message"]:
                    break
        finally:
            await client.close()
        assert "dropped the connection before it answered" in modern["message"], modern


async def test_a_legacy_initialize_answered_with_no_answer_opens_no_session(
    hostile: str, tmp_path: Path, serve: Serve
) -> None:
    """An upstream that answers `initialize` with `result: null` and a session id: the client gets
    -32603, and no `Mcp-Session-Id` for a session it could never use (it was held open, counted
    against `max_sessions_per_principal`, until `legacy_session_idle`)."""
    proxy = await serve(hostile_config(hostile, tmp_path, "null-init"))
    async with aiohttp.ClientSession() as http:
        async with http.post(proxy.url(), json=INIT, headers=LEGACY_HEADERS) as resp:
            reply = await resp.json()
            assert resp.status == 200 and "Mcp-Session-Id" not in resp.headers, (resp.headers, reply)
    assert reply["error"]["code"] == -32603 and "not an object" in reply["error"]["message"], reply


async def test_a_slow_call_is_bounded_by_its_hard_timeout_not_request_timeout(
    hostile: str, tmp_path: Path, serve: Serve
) -> None:
    proxy = await serve(hostile_config(hostile, tmp_path, "ok", timeout="400ms", request_timeout="5s"))
    client = ModernClient(proxy.url(), capabilities={})
    try:
        assert (await client.call("slow", {"seconds": 0.6})).error["message"].count("hard timeout") == 1
        assert (await client.call("slow", {"seconds": 0.05})).result["content"][0]["text"] == "ok"
    finally:
        await client.close()


async def test_a_legacy_initialize_answered_404_names_the_url_not_a_lost_session(
    tmp_path: Path, serve: Serve
) -> None:
    """An upstream URL where no MCP endpoint answers (HTTP 404 to `initialize`): the client gets
    -32603 naming the upstream's status and the config key to check, with no session. It got the
    404 itself, which a legacy client reads as "session gone" although it had none yet."""
    async with served_app(web.Application()) as port:  # no routes: 404 for every path
        config = config_from_data(
            {
                "store": {"path": str(tmp_path / "store"), "durable": False},
                "mcpServers": {"nowhere": {"url": f"http://127.0.0.1:{port}/mcp", "init_timeout": "1s"}},
            }
        )
        proxy = await serve(config)
        async with aiohttp.ClientSession() as http:
            async with http.post(proxy.url(), json=INIT, headers=LEGACY_HEADERS) as resp:
                reply = await resp.json()
                assert resp.status == 200 and "Mcp-Session-Id" not in resp.headers, reply
    assert reply["id"] == INIT["id"] and reply["error"]["code"] == -32603, reply
    assert "answered initialize with HTTP 404" in reply["error"]["message"]
    assert "check mcpServers.nowhere.url" in reply["error"]["message"]


async def test_a_legacy_call_whose_upstream_is_silent_is_told_it_did_not_answer(
    hostile: str, tmp_path: Path, serve: Serve
) -> None:
    """A legacy call whose upstream sends nothing, not even its headers, within the call's `timeout`
    (400 ms) gets -32603 saying the upstream did not answer within it (it said "unreachable": the
    upstream had been reached)."""
    proxy = await serve(hostile_config(hostile, tmp_path, "ok", timeout="400ms", request_timeout="5s"))
    async with aiohttp.ClientSession() as http:
        session = await open_session(http, proxy.url())
    call = {
        "jsonrpc": "2.0",
        "id": 2,
        "method": "tools/call",
        "params": {"name": "slow", "arguments": {"seconds": 5}},
    }
    _, reply = await legacy_post(proxy.url(), call, {"Accept": "application/json", "Mcp-Session-Id": session})
    error = reply["error"]
    assert error == {"code": -32603, "message": "upstream ok did not answer within 0.4 s (timeout)"}, error


async def test_a_legacy_stream_that_stalls_midway_is_cut_at_the_calls_hard_timeout(
    hostile: str, tmp_path: Path, serve: Serve
) -> None:
    """On the legacy relay, an upstream SSE stream that sent a notification and then went silent is
    cut at the call's hard timeout (400 ms here), not left open: the notification reached the
    client, then the proxy's JSON-RPC error for the unanswered call."""
    proxy = await serve(hostile_config(hostile, tmp_path, "ok", timeout="400ms", request_timeout="5s"))
    async with aiohttp.ClientSession() as http:
        session = {"Mcp-Session-Id": await open_session(http, proxy.url())}
        call = {
            "jsonrpc": "2.0",
            "id": 2,
            "method": "tools/call",
            "params": {"name": "stall_sse", "arguments": {"seconds": 30}, "_meta": {"progressToken": "p"}},
        }
        started = time.monotonic()
        async with http.post(proxy.url(), json=call, headers={**LEGACY_HEADERS, **session}) as resp:
            text = await resp.text()
        waited = time.monotonic() - started
    events = [
        json.loads(line[5:]) for line in text.splitlines() if line.startswith("data:") and line[5:].strip()
    ]
    assert [e.get("method") for e in events] == ["notifications/progress", None], events
    assert events[1]["id"] == 2 and events[1]["error"]["code"] == -32603, events
    assert "upstream ok" in events[1]["error"]["message"], events
    assert waited < 2, waited  # the hard timeout (0.4 s), not request_timeout (5 s) nor the upstream's 30 s


async def test_readyz_stays_ready_while_one_of_two_servers_is_broken(
    legacy_url: str, tmp_path: Path, serve: Serve
) -> None:
    """The documented rule: 503 only when every server is broken (or the store, or a drain)."""
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{closed.getsockname()[1]}/mcp"
    servers = {"good": {"url": legacy_url}, "dead": {"url": dead, "init_timeout": "1s"}}
    config = config_from_data({"store": {"path": str(tmp_path / "store")}, "mcpServers": servers})
    proxy = await serve(config)
    status, body = await readyz(proxy.base)
    assert status == 200 and body["ready"] is True, body
    assert body["checks"]["upstream:good"] == "ok" and body["checks"]["upstream:dead"] != "ok"
    await proxy.close()
    only_dead = config_from_data(
        {"store": {"path": str(tmp_path / "store2")}, "mcpServers": {"dead": servers["dead"]}}
    )
    proxy = await serve(only_dead)
    status, body = await readyz(proxy.base)
    assert status == 503 and body["ready"] is False and body["checks"]["upstream:dead"] != "ok"


async def test_concurrent_callers_share_one_session_attempt_and_each_waits_init_timeout_at_most(
    hostile: str, tmp_path: Path, serve: Serve
) -> None:
    """Behind an upstream that never answers `initialize` (init_timeout 300 ms), ten concurrent calls
    all fail within about one init_timeout, not one after another (ten of them queued: 3 s)."""
    proxy = await serve(hostile_config(hostile, tmp_path, "hang-init"))
    client = ModernClient(proxy.url(), capabilities={})
    try:
        started = time.monotonic()
        replies = await asyncio.gather(*(client.call("ok") for _ in range(10)))
        elapsed = time.monotonic() - started
    finally:
        await client.close()
    for reply in replies:
        assert "within 0.3 s (init_timeout)" in reply.error["message"], reply
    assert elapsed < 1.5, elapsed


async def test_readyz_answers_within_a_balancers_check_timeout_behind_a_hung_upstream(
    hostile: str, legacy_url: str, tmp_path: Path, serve: Serve
) -> None:
    """Each check is bounded (1.5 s) so `/readyz` answers before HAProxy's `timeout check 2s` would
    mark the replica down for one stuck server (init_timeout here: 3 s)."""
    servers = {
        "good": {"url": legacy_url},
        "stuck": {"url": f"{hostile}/hang-init/mcp", "init_timeout": "3s"},
    }
    proxy = await serve(config_from_data({"store": {"path": str(tmp_path / "store")}, "mcpServers": servers}))
    started = time.monotonic()
    status, body = await readyz(proxy.base)
    waited = time.monotonic() - started
    assert status == 200 and body["checks"]["upstream:stuck"] != "ok", body
    assert waited < 1.9, waited


@pytest.mark.parametrize("mode", ["hang-list", "hang-init"])
async def test_a_task_capable_call_gets_its_handle_at_detach_after_whatever_the_proxy_waits_on(
    hostile: str, tmp_path: Path, serve: Serve, mode: str
) -> None:
    """`detach_after` 150 ms counts from the request's arrival, through the `tools/list` lookup of the
    `Mcp-Param` headers (hang-list: it waits request_timeout, 1 s) and the session start (hang-init:
    init_timeout, 1 s): the handle comes long before either bound, and the task records the
    upstream's later failure (hang-init) or the call's result (hang-list)."""
    config = hostile_config(hostile, tmp_path, mode, init_timeout="1s", request_timeout="1s")
    config.tasks.detach_after = 0.15
    proxy = await serve(config)
    if mode == "hang-init":
        # The start-up warm-up's failed attempt answers callers for as long again as it took (1 s):
        # past that, the call waits on a fresh attempt, which is the wait this test is about.
        await asyncio.sleep(1.2)
    client = ModernClient(proxy.url())
    try:
        started = time.monotonic()
        reply = await client.call("slow", {"seconds": 0.5})
        waited = time.monotonic() - started
        assert reply.result.get("resultType") == "task" or "taskId" in reply.result, reply.message
        assert waited < 0.7, waited
        done = await client.wait_terminal(reply.result["taskId"], timeout=5)
    finally:
        await client.close()
    if mode == "hang-init":
        assert done["status"] == "failed" and "init_timeout" in json.dumps(done), done
    else:
        assert done["status"] == "completed", done


@pytest.mark.parametrize("tasks", [True, False], ids=["tasks-extension", "no-extension"])
async def test_one_call_behind_a_hung_initialize_waits_one_init_timeout(
    hostile: str, tmp_path: Path, serve: Serve, tasks: bool
) -> None:
    """A call needs the session twice (the tool lookup, then the call itself): with `init_timeout`
    1 s it fails after about 1 s, not 2 (the failed attempt answers the second ask at once), and
    the error names the bound it hit."""
    proxy = await serve(
        hostile_config(hostile, tmp_path, "hang-init", init_timeout="1s", request_timeout="1s")
    )
    await asyncio.sleep(1.2)  # past the warm-up's failed attempt (see the test above): a fresh one
    client = ModernClient(proxy.url(), capabilities=None if tasks else {})
    try:
        started = time.monotonic()
        reply = await client.call("ok")
        waited = time.monotonic() - started
    finally:
        await client.close()
    if tasks:  # detach_after 2 s: the call failed before its handle was due
        assert reply.error is not None or reply.result.get("resultType") == "task", reply.message
    assert reply.error is None or "within 1 s (init_timeout)" in reply.error["message"], reply.message
    assert waited < 1.5, waited


async def test_a_legacy_initialize_behind_a_hung_initialize_waits_one_init_timeout(
    hostile: str, tmp_path: Path, serve: Serve
) -> None:
    """A legacy client's `initialize` needs two upstream initializes (the proxy's own session, which
    says whether the upstream has tasks, then the client's): with `init_timeout` 1 s it fails after
    about 1 s, not 2 (the proxy's failed attempt answers the client at once), alone or six at once."""
    proxy = await serve(hostile_config(hostile, tmp_path, "hang-init", init_timeout="1s"))
    await asyncio.sleep(1.2)  # past the warm-up's failed attempt: a fresh one
    started = time.monotonic()
    status, alone = await legacy_post(proxy.url(), INIT)
    waited = time.monotonic() - started
    await asyncio.sleep(1.2)
    started = time.monotonic()
    six = await asyncio.gather(*(legacy_post(proxy.url(), INIT) for _ in range(6)))
    together = time.monotonic() - started
    assert status == 200 and "within 1 s (init_timeout)" in alone["error"]["message"], alone
    assert waited < 1.5 and together < 1.5, (waited, together)
    assert all(body["error"]["code"] == -32603 for _, body in six), six


async def test_a_stdio_child_that_never_answers_initialize_bounds_every_caller(
    tmp_path: Path, serve: Serve
) -> None:
    """A child that never answers `initialize` (`init_timeout` 1 s, `timeout` 8 s): one call fails in
    about 1 s naming init_timeout (not three tries of 3 s each, twice), and six concurrent calls
    after it share that failure instead of queueing one start after another."""
    hang = {"command": sys.executable, "args": ["-c", "import time; time.sleep(3600)"]}
    config = config_from_data(
        {
            "store": {"path": str(tmp_path / "store"), "durable": False},
            "mcpServers": {"hang": {**hang, "init_timeout": "1s", "timeout": "8s"}},
        }
    )
    proxy = await serve(config)
    await asyncio.sleep(1.5)  # past the warm-up's failed start (its failure answers for as long again)
    client = ModernClient(proxy.url(), capabilities={})
    try:
        started = time.monotonic()
        one = await client.call("anything")
        alone = time.monotonic() - started
        started = time.monotonic()
        six = await asyncio.gather(*(client.call("anything") for _ in range(6)))
        together = time.monotonic() - started
    finally:
        await client.close()
    assert "within 1 s (init_timeout)" in one.error["message"] and alone < 1.8, (alone, one.message)
    assert all(reply.error is not None for reply in six) and together < 1.8, together
