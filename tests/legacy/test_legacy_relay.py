"""The HTTP legacy relay owns its protocol state (issue 13), tested over raw HTTP against an upstream
that gets ids, sessions and streams wrong on purpose (tests/fixtures/relay_upstream.py): the proxy's
own JSON-RPC ids toward the upstream and SSE event ids toward the client, `Last-Event-ID` served
from its own buffer, keepalives on relayed streams, an error for every request a stream leaves
unanswered, cancels that never reach the upstream for answered or queued requests, and exactly one
response per upstream request id."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any
from unittest.mock import ANY

import aiohttp
import pytest
from aiohttp import web
from multidict import CIMultiDict
from support.clients import ModernClient
from support.logs import json_log
from support.proxy import Serve, make_config, stdio_config
from support.servers import FIXTURE_STDIO, ROOT, ServerProcess, black_hole, python_venv, served_app

from proxy.app import ENDPOINTS_KEY
from proxy.config import config_from_data
from proxy.protocol.sse import iter_events
from proxy.runtime import metrics
from proxy.upstream.connections import UpstreamHttp
from proxy.upstream.http import UpstreamSession
from proxy.upstream.types import SessionBrokenError, UpstreamError

LEGACY = "2025-11-25"
ELICIT_TASKS = {"elicitation": {}, "extensions": {"io.modelcontextprotocol/tasks": {}}}


@pytest.fixture(scope="module")
def upstream() -> Iterator[str]:
    server = ServerProcess([sys.executable, "tests/fixtures/relay_upstream.py", "--port", "0"])
    yield server.url
    server.stop()


def relay_config(upstream_url: str, tmp_path: Path, server: dict | None = None, **listen: object):
    return config_from_data(
        {
            "listen": {"sse_keepalive": "50ms", **listen},
            "store": {"path": str(tmp_path / "store"), "durable": False},
            "tasks": {"detach_after": "50ms", "ttl": "10m", "poll_interval": "50ms"},
            "mcpServers": {"bad": {"url": upstream_url, "timeout": "5s", **(server or {})}},
        }
    )


@pytest.fixture
async def proxy_url(upstream: str, tmp_path: Path, serve: Serve) -> AsyncIterator[str]:
    proxy = await serve(relay_config(upstream, tmp_path))
    yield proxy.url()


class Legacy:
    """A raw 2025-11-25 client session through the proxy."""

    def __init__(self, url: str, http: aiohttp.ClientSession) -> None:
        self.url, self.http, self.sid = url, http, ""

    def headers(self, **extra: str) -> dict[str, str]:
        h = {
            "Content-Type": "application/json",
            "Accept": "application/json, text/event-stream",
            "MCP-Protocol-Version": LEGACY,
        }
        if self.sid:
            h["Mcp-Session-Id"] = self.sid
        return {**h, **extra}

    async def open(self, capabilities: dict | None = None) -> Legacy:
        body = {
            "jsonrpc": "2.0",
            "id": "init",
            "method": "initialize",
            "params": {
                "protocolVersion": LEGACY,
                "capabilities": capabilities or {},
                "clientInfo": {"name": "raw", "version": "0"},
            },
        }
        async with self.http.post(self.url, json=body, headers=self.headers()) as resp:
            assert resp.status == 200, await resp.text()
            self.sid = resp.headers["Mcp-Session-Id"]
            assert (await reply_of(resp))["id"] == "init"
        await self.post({"jsonrpc": "2.0", "method": "notifications/initialized"})
        return self

    async def post(self, body: dict) -> int:
        async with self.http.post(self.url, json=body, headers=self.headers()) as resp:
            await resp.read()
            return resp.status

    def call(self, rid: object, tool: str, **args: object):
        return self.http.post(self.url, json=call_body(rid, tool, **args), headers=self.headers())


def call_body(rid: object, tool: str, **args: object) -> dict:
    """A `tools/call` request of `tool` with `args`, under id `rid`."""
    return {"jsonrpc": "2.0", "id": rid, "method": "tools/call", "params": {"name": tool, "arguments": args}}


async def read_events(resp: aiohttp.ClientResponse) -> list:
    return [event async for event in iter_events(resp.content.iter_any())]


async def next_message(events: AsyncIterator[Any]) -> dict:
    """The next JSON-RPC message of an SSE stream (events without data, like the priming one, skipped)."""
    while not (event := await anext(events)).data:
        pass
    return json.loads(event.data)


async def reply_of(resp: aiohttp.ClientResponse) -> dict:
    """The JSON-RPC reply of a request, JSON or SSE (a reply slower than `sse_keepalive` comes on SSE)."""
    if resp.headers.get("Content-Type", "").startswith("text/event-stream"):
        return json.loads([e for e in await read_events(resp) if e.data.strip()][-1].data)
    return await resp.json()


async def upstream_log(upstream: str) -> list[dict]:
    async with aiohttp.ClientSession() as http, http.get(upstream.removesuffix("/mcp") + "/log") as resp:
        return await resp.json()


async def upstream_sessions(upstream: str) -> list[str]:
    async with aiohttp.ClientSession() as http, http.get(upstream.removesuffix("/mcp") + "/sessions") as resp:
        return await resp.json()


# -- item 1: ids ---------------------------------------------------------------------------------


async def test_own_request_ids_toward_the_upstream(upstream: str, proxy_url: str) -> None:
    async with aiohttp.ClientSession() as http:
        a, b = await Legacy(proxy_url, http).open(), await Legacy(proxy_url, http).open()
        async with a.call("same-id", "echo", x=1) as resp:  # JSON reply
            assert (await reply_of(resp))["id"] == "same-id"
        async with b.call("same-id", "sse_echo") as resp:  # SSE reply
            events = await read_events(resp)
        final = json.loads(events[-1].data)
        assert final["id"] == "same-id" and final["result"]["content"][0]["text"] == "sse_echo done"
    seen = [
        entry["message"]
        for entry in await upstream_log(upstream)
        if entry["message"].get("method") == "tools/call"
    ]
    assert seen and all(isinstance(m["id"], int) for m in seen[-2:])  # the proxy's ids, never the client's


async def test_an_upstream_session_never_sees_its_initialize_id_again(upstream: str, proxy_url: str) -> None:
    """The `initialize` that opens an upstream session takes an id before the session exists; the
    session's own requests go on after it (MCP basic protocol: a requestor never reuses an id within
    a session)."""
    async with aiohttp.ClientSession() as http:
        start = len(await upstream_log(upstream))
        client = await Legacy(proxy_url, http).open()
        for rid in (1, 2, 3):
            async with client.call(rid, "echo", x=rid) as resp:
                assert (await reply_of(resp))["id"] == rid
    sent = [entry for entry in (await upstream_log(upstream))[start:] if "id" in entry["message"]]
    [initialize] = [e["message"] for e in sent if e["message"]["method"] == "initialize"]
    session = {e["session"] for e in sent if e["message"]["method"] == "tools/call"}.pop()
    in_session = [e["message"]["id"] for e in sent if e["session"] == session]
    assert len(in_session) == 3 and initialize["id"] not in in_session, (initialize["id"], in_session)


async def test_own_event_ids_scoped_to_session_and_stream(proxy_url: str) -> None:
    async with aiohttp.ClientSession() as http:
        a, b = await Legacy(proxy_url, http).open(), await Legacy(proxy_url, http).open()
        ids = []
        for client in (a, a, b):
            async with client.call(1, "sse_echo") as resp:
                ids.append([e.id for e in await read_events(resp)])
    assert all(i not in ("1", "2") for stream in ids for i in stream)  # never the upstream's reused ids
    tokens = {i.rpartition(":")[0] for stream in ids for i in stream}
    assert len(tokens) == 3  # one token per stream, none shared between sessions
    # numbered from 1, in order: the two events, after the proxy's priming event when the first one
    # took longer than QUICK_ANSWER_S to come (none is needed before an event that has an id)
    seqs = [int(i.rpartition(":")[2]) for i in ids[0]]
    assert seqs == list(range(1, len(seqs) + 1)) and len(seqs) in (2, 3), seqs


async def test_server_requests_get_proxy_ids_and_one_answer_each(upstream: str, proxy_url: str) -> None:
    async with aiohttp.ClientSession() as http:
        a, b = (
            await Legacy(proxy_url, http).open({"elicitation": {}}),
            await Legacy(proxy_url, http).open({"elicitation": {}}),
        )

        async def ask(client: Legacy, answer: str) -> tuple[str, dict]:
            async with client.call(5, "ask") as resp:
                it = iter_events(resp.content.iter_any())
                question = await next_message(it)
                assert question["method"] == "elicitation/create" and question["id"] != 0
                reply = {
                    "jsonrpc": "2.0",
                    "id": question["id"],
                    "result": {"action": "accept", "content": {"who": answer}},
                }
                assert await client.post(reply) == 202
                assert await client.post(reply) == 202  # a duplicate: dropped, never forwarded
                assert await client.post({**reply, "id": "mtp-unknown"}) == 202
                final = json.loads((await anext(it)).data)
                return question["id"], final

        (qa, ra), (qb, rb) = await asyncio.gather(ask(a, "alice"), ask(b, "bob"))
    assert qa != qb
    assert "alice" in ra["result"]["content"][0]["text"] and "bob" in rb["result"]["content"][0]["text"]
    responses = [e for e in await upstream_log(upstream) if "method" not in e["message"]]
    per_session: dict[str, int] = {}
    for entry in responses[-2:]:
        assert entry["message"]["id"] == 0  # both sessions asked with id 0
        per_session[entry["session"]] = per_session.get(entry["session"], 0) + 1
    assert len(per_session) == 2 and set(per_session.values()) == {1}
    assert len([e for e in responses if e["message"].get("id") == "mtp-unknown"]) == 0


# -- item 1: streams -----------------------------------------------------------------------------


async def test_keepalive_on_relayed_post_and_get_streams(proxy_url: str) -> None:
    async with aiohttp.ClientSession() as http:
        client = await Legacy(proxy_url, http).open()
        async with client.call(1, "slow", ms=300) as resp:
            raw = await resp.read()
        assert raw.count(b": keepalive") >= 2 and raw.rstrip().endswith(b"}")
        async with http.get(proxy_url, headers=client.headers(Accept="text/event-stream")) as resp:
            assert resp.status == 200
            chunk = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 2)
        assert chunk.startswith(b": keepalive")


async def test_an_answer_that_comes_alone_and_soon_goes_out_as_plain_json(proxy_url: str) -> None:
    """The upstream answers on SSE at once, with nothing before its answer: the client, whose
    Accept takes both, gets one JSON body (one write, not four); a client that takes SSE alone gets
    the stream, and so does a call slower than QUICK_ANSWER_S (50 ms), opened by a priming event."""
    async with aiohttp.ClientSession() as http:
        client = await Legacy(proxy_url, http).open()
        async with client.call(4, "slow", ms=0) as resp:
            assert resp.headers["Content-Type"].startswith("application/json")
            assert await resp.json() == {
                "jsonrpc": "2.0",
                "id": 4,
                "result": {"content": [{"type": "text", "text": "slow done"}], "isError": False},
            }
        only_sse = client.headers(Accept="text/event-stream")
        async with http.post(proxy_url, json=call_body(5, "slow", ms=0), headers=only_sse) as resp:
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            events = await read_events(resp)
        assert json.loads(events[-1].data)["id"] == 5
        async with client.call(6, "slow", ms=200) as resp:  # slower: a stream, resumable from its start
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            events = [e for e in await read_events(resp) if e.id is not None]
        assert events[0].data == "" and json.loads(events[-1].data)["id"] == 6


async def test_a_get_whose_accept_rules_out_sse_gets_406(proxy_url: str) -> None:
    """A GET opens an SSE stream, so one whose `Accept` names only JSON is refused (406), not
    answered with a stream it said it cannot take; `*/*` takes the stream."""
    async with aiohttp.ClientSession() as http:
        client = await Legacy(proxy_url, http).open()
        async with http.get(proxy_url, headers=client.headers(Accept="application/json")) as resp:
            assert resp.status == 406
            body = await resp.json()
        assert body["error"]["code"] == -32600 and "text/event-stream" in body["error"]["message"]
        async with http.get(
            proxy_url, headers=client.headers(Accept="text/event-stream;q=0, application/json")
        ) as resp:
            assert resp.status == 406  # q=0: "not acceptable" (RFC 9110 §12.4.2)
        for takes in ("*/*", ""):  # (an empty header names no preference)
            async with http.get(proxy_url, headers=client.headers(Accept=takes)) as resp:
                assert resp.status == 200, takes
                assert resp.headers["Content-Type"].startswith("text/event-stream")


@pytest.mark.parametrize("tool", ["die", "close_early"])
async def test_stream_that_dies_or_closes_gets_an_error(proxy_url: str, tool: str) -> None:
    async with aiohttp.ClientSession() as http:
        client = await Legacy(proxy_url, http).open()
        async with client.call("mine", tool) as resp:
            events = await asyncio.wait_for(read_events(resp), 5)
    messages = [json.loads(e.data) for e in events if e.data]
    assert messages[0]["method"] == "notifications/message"
    assert messages[-1]["id"] == "mine" and messages[-1]["error"]["code"] == -32603
    assert "upstream bad" in messages[-1]["error"]["message"]


async def test_polling_upstream_resumed_through_the_proxys_ids(proxy_url: str) -> None:
    async with aiohttp.ClientSession() as http:
        client = await Legacy(proxy_url, http).open()
        async with client.call(9, "poll") as resp:
            events = await asyncio.wait_for(read_events(resp), 5)  # cut like the upstream cut it
        # the upstream's priming event, with its `retry`, after the proxy's own only when the
        # upstream's took longer than QUICK_ANSWER_S
        assert [(e.data, e.retry) for e in events][-1] == ("", 50)
        assert [(e.data, e.retry) for e in events][:-1] in ([], [("", None)])
        assert ":" in (events[-1].id or "")
        headers = client.headers(Accept="text/event-stream", **{"Last-Event-ID": events[-1].id})
        async with http.get(proxy_url, headers=headers) as resp:
            assert resp.status == 200
            rest = await asyncio.wait_for(read_events(resp), 5)
    final = json.loads(rest[-1].data)
    assert final["id"] == 9 and final["result"]["content"][0]["text"] == "poll done"


async def test_resume_after_client_disconnect_without_upstream_event_store(proxy_url: str) -> None:
    async with aiohttp.ClientSession() as http:
        client = await Legacy(proxy_url, http).open()
        resp = await client.call(3, "sse_echo", ms=200).__aenter__()
        events = iter_events(resp.content.iter_any())
        while not (first := await anext(events)).data:  # (a priming event, if one came first)
            pass
        resp.close()  # the connection is gone; the call goes on in the proxy
        await asyncio.sleep(0.4)
        headers = client.headers(Accept="text/event-stream", **{"Last-Event-ID": first.id})
        async with http.get(proxy_url, headers=headers) as again:
            rest = await asyncio.wait_for(read_events(again), 5)
    assert [json.loads(e.data).get("id") for e in rest] == [3]
    assert int(rest[0].id.rpartition(":")[2]) == int(first.id.rpartition(":")[2]) + 1


async def test_get_stream_replays_missed_events_then_goes_on_live(upstream: str, proxy_url: str) -> None:
    async with aiohttp.ClientSession() as http:
        client = await Legacy(proxy_url, http).open()
        upstream_sid = (await upstream_sessions(upstream))[-1]

        async def push(n: int) -> None:
            async with http.post(
                upstream.removesuffix("/mcp") + f"/push?session={upstream_sid}", json=n
            ) as r:
                assert r.status == 204

        async def next_message(it: AsyncIterator) -> tuple[str, int]:
            async with asyncio.timeout(5):
                while True:
                    event = await anext(it)
                    if event.data:
                        return event.id, json.loads(event.data)["params"]["data"]

        resp = await http.get(proxy_url, headers=client.headers(Accept="text/event-stream")).__aenter__()
        await push(1)
        first_id, n = await next_message(iter_events(resp.content.iter_any()))
        assert n == 1
        resp.close()
        await asyncio.sleep(0.1)
        await push(2)
        await push(3)
        await asyncio.sleep(0.2)  # both are read from the upstream while no client is attached
        headers = client.headers(Accept="text/event-stream", **{"Last-Event-ID": first_id})
        async with http.get(proxy_url, headers=headers) as again:
            it = iter_events(again.content.iter_any())
            assert [(await next_message(it))[1] for _ in range(2)] == [2, 3]
            await push(4)
            assert (await next_message(it))[1] == 4


async def test_an_ended_stream_stays_resumable_for_the_linger_time_then_is_forgotten(
    upstream: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    serve: Serve,
) -> None:
    """An ended reply stream is resumable for LINGER_S (scaled down here), then forgotten by the
    relay's sweep: also in a session that opens no further stream, and behind a stream that is
    still open (a long call)."""
    monkeypatch.setattr("proxy.legacy.streams.LINGER_S", 0.3)
    proxy = await serve(relay_config(upstream, tmp_path))
    async with aiohttp.ClientSession() as http:
        client = await Legacy(proxy.url(), http).open()
        long_call = await client.call(1, "slow", ms=4000).__aenter__()  # opened first, open throughout
        async with client.call(2, "sse_echo") as resp:
            ended_id = [e for e in await read_events(resp) if e.data.strip()][-1].id
        headers = client.headers(Accept="text/event-stream", **{"Last-Event-ID": ended_id})
        async with http.get(proxy.url(), headers=headers) as again:
            assert again.status == 200  # resumable at once: nothing after that id, so the replay just ends
            assert [e for e in await asyncio.wait_for(read_events(again), 5) if e.data.strip()] == []
        # Unread from now on (a resumption is a read: it starts the linger time again). The sweep
        # runs every LINGER_S / 2, so the stream is gone after 1.5 x LINGER_S.
        await asyncio.sleep(0.3 * 1.5 + 0.2)
        async with http.get(proxy.url(), headers=headers) as again:
            assert again.status == 400
            assert "Last-Event-ID" in (await again.json())["error"]["message"]
        long_call.close()


async def test_replay_buffer_is_bounded_and_a_new_get_reuses_the_live_upstream_stream(
    upstream: str, tmp_path: Path, serve: Serve
) -> None:
    proxy = await serve(relay_config(upstream, tmp_path, replay_events=2))
    async with aiohttp.ClientSession() as http:
        client = await Legacy(proxy.url(), http).open()
        upstream_sid = (await upstream_sessions(upstream))[-1]

        async def push(n: int) -> None:
            async with http.post(
                upstream.removesuffix("/mcp") + f"/push?session={upstream_sid}", json=n
            ) as r:
                assert r.status == 204

        async def messages(resp: aiohttp.ClientResponse, count: int) -> list[tuple[str, int]]:
            out: list[tuple[str, int]] = []
            async with asyncio.timeout(5):
                async for event in iter_events(resp.content.iter_any()):
                    if event.data:
                        out.append((event.id, json.loads(event.data)["params"]["data"]))
                        if len(out) == count:
                            return out
            return out

        resp = await http.get(proxy.url(), headers=client.headers(Accept="text/event-stream")).__aenter__()
        await push(1)
        [(first_id, _)] = await messages(resp, 1)
        resp.close()
        for n in (2, 3, 4, 5):
            await push(n)
        await asyncio.sleep(0.2)
        headers = client.headers(Accept="text/event-stream", **{"Last-Event-ID": first_id})
        async with http.get(proxy.url(), headers=headers) as again:
            notice, *kept = await messages(again, 3)
            assert [n for _, n in kept] == [4, 5]  # only the last replay_events are kept
            # and the resumption opens with an error naming what is lost (no id: not part of the stream)
            assert notice[0] is None and notice[1]["error"] == "replay_gap", notice
            assert notice[1]["lostEvents"] == 2 and "replay buffer" in notice[1]["message"]
        async with http.get(proxy.url(), headers=client.headers(Accept="text/event-stream")) as fresh:
            assert fresh.status == 200
            await push(6)
            assert [n for _, n in await messages(fresh, 1)] == [6]
    await proxy.stop()
    async with aiohttp.ClientSession() as http, http.get(upstream.removesuffix("/mcp") + "/gets") as r:
        mine = [g for g in await r.json() if g["session"] == upstream_sid]
    assert mine == [{"session": upstream_sid, "last_event_id": None}]  # one upstream GET served all three


async def test_unknown_or_foreign_last_event_id_is_refused(proxy_url: str) -> None:
    async with aiohttp.ClientSession() as http:
        a, b = await Legacy(proxy_url, http).open(), await Legacy(proxy_url, http).open()
        async with a.call(1, "sse_echo") as resp:
            event_id = (await read_events(resp))[0].id
        token = event_id.rpartition(":")[0]
        never_minted = (f"{token}:0", f"{token}:01", f"{token}:+1")  # the stream's own token, no id of it
        for client, value in ((b, event_id), (a, "not-ours"), (a, "zzz:1"), *((a, v) for v in never_minted)):
            async with http.get(
                proxy_url, headers=client.headers(Accept="text/event-stream", **{"Last-Event-ID": value})
            ) as resp:
                assert resp.status == 400
                assert "Last-Event-ID" in (await resp.json())["error"]["message"]


# -- item 1: cancels -----------------------------------------------------------------------------


async def test_cancel_maps_in_flight_and_drops_answered_or_unknown(upstream: str, proxy_url: str) -> None:
    start = len(await upstream_log(upstream))
    async with aiohttp.ClientSession() as http:
        client = await Legacy(proxy_url, http).open()
        async with client.call(1, "echo") as resp:
            await resp.read()
        cancel = {"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 1}}
        assert await client.post(cancel) == 202  # answered already
        assert await client.post({**cancel, "params": {"requestId": "never"}}) == 202
        before = len(await upstream_log(upstream))
        async with client.call("slow-one", "wait_cancel") as resp:
            await asyncio.sleep(0.2)
            assert await client.post({**cancel, "params": {"requestId": "slow-one", "reason": "user"}}) == 202
            events = await asyncio.wait_for(read_events(resp), 3)
        assert json.loads(events[-1].data)["id"] == "slow-one"
    log = await upstream_log(upstream)
    call_id = next(e["message"]["id"] for e in log[before:] if e["message"].get("method") == "tools/call")
    cancels = [e["message"] for e in log[start:] if e["message"].get("method") == "notifications/cancelled"]
    # One cancel, for the request in flight, under the upstream's id, with the client's reason.
    assert [c["params"] for c in cancels] == [{"requestId": call_id, "reason": "user"}]


@pytest.mark.parametrize("accept", ["application/json, text/event-stream", "application/json"])
async def test_a_call_whose_upstream_sent_no_headers_yet_ends_on_cancel_and_on_delete(
    upstream: str, tmp_path: Path, serve: Serve, accept: str
) -> None:
    """An upstream that has not even sent its response headers (`slow_json`: 30 s of silence) and
    ignores cancels: a cancelled call still ends CANCEL_GRACE_S (1 s) later with -32800, and a call
    on a deleted session at once with -32603, for a client that takes SSE (before its reply switched
    to SSE: `sse_keepalive` 10 s here) and for one that takes JSON only (it never switches). Both
    waited for the call's whole `timeout` (30 s) before."""
    proxy = await serve(relay_config(upstream, tmp_path, {"timeout": "30s"}, sse_keepalive="10s"))
    async with aiohttp.ClientSession() as http:
        client = await Legacy(proxy.url(), http).open()

        async def call(rid: str) -> dict:
            body = call_body(rid, "slow_json", ms=30000)
            async with http.post(proxy.url(), json=body, headers=client.headers(Accept=accept)) as resp:
                return await reply_of(resp)

        cancelled = asyncio.create_task(call("c"))
        await asyncio.sleep(0.3)  # the upstream has the call
        started = time.monotonic()
        cancel = {"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": "c"}}
        assert await client.post(cancel) == 202
        reply = await asyncio.wait_for(cancelled, 5)
        waited = time.monotonic() - started
        assert reply["id"] == "c" and reply["error"]["code"] == -32800, reply
        assert "did not end the request within 1 s" in reply["error"]["message"] and 0.9 < waited < 3, waited
        on_deleted = asyncio.create_task(call("d"))
        await asyncio.sleep(0.3)
        async with http.delete(proxy.url(), headers=client.headers()) as deleted:
            assert deleted.status < 300
        reply = await asyncio.wait_for(on_deleted, 2)
        assert reply["id"] == "d" and reply["error"]["code"] == -32603, reply
        assert "the session ended" in reply["error"]["message"]


async def test_an_initialize_on_a_session_the_upstream_expired_gets_its_404(
    upstream: str, proxy_url: str
) -> None:
    """A client that initializes again on its session after the upstream forgot it gets the
    upstream's 404 (session gone: initialize without the header), and the proxy session ends; not
    the "check the URL" error an initialize without a session gets for a 404."""
    async with aiohttp.ClientSession() as http:
        client = await Legacy(proxy_url, http).open()
        upstream_sid = (await upstream_sessions(upstream))[-1]
        async with http.delete(upstream, headers={"Mcp-Session-Id": upstream_sid}) as resp:
            assert resp.status == 200
        params = {
            "protocolVersion": LEGACY,
            "capabilities": {},
            "clientInfo": {"name": "raw", "version": "0"},
        }
        again = {"jsonrpc": "2.0", "id": "again", "method": "initialize", "params": params}
        async with http.post(proxy_url, json=again, headers=client.headers()) as resp:
            assert resp.status == 404, await resp.text()
        async with client.call(3, "echo") as resp:
            assert resp.status == 404  # the proxy session ended with the upstream's


@pytest.mark.parametrize("kind", ["http", "stdio"])
async def test_an_initialize_without_an_id_is_refused_and_opens_no_session(
    upstream: str, tmp_path: Path, serve: Serve, kind: str
) -> None:
    """`initialize` sent as a notification (no `id`): 400 with -32600 and no session. In front of an
    HTTP upstream it was a 500 (a KeyError); in front of a stdio child, a response with a null id
    and a new session."""
    config = relay_config(upstream, tmp_path) if kind == "http" else stdio_config(tmp_path)
    proxy = await serve(config)
    params = {"protocolVersion": LEGACY, "capabilities": {}, "clientInfo": {"name": "raw", "version": "0"}}
    async with aiohttp.ClientSession() as http:
        headers = Legacy(proxy.url(), http).headers()
        body = {"jsonrpc": "2.0", "method": "initialize", "params": params}
        async with http.post(proxy.url(), json=body, headers=headers) as resp:
            reply = await resp.json()
            assert resp.status == 400 and "Mcp-Session-Id" not in resp.headers, reply
        assert reply["error"]["code"] == -32600 and "needs an `id`" in reply["error"]["message"]


async def test_an_unsupported_protocol_version_or_a_repeated_header_is_a_400(
    upstream: str, proxy_url: str
) -> None:
    """On a legacy session, an `MCP-Protocol-Version` that is no legacy revision is a 400 (2025-11-25
    transports), and so are two `MCP-Protocol-Version` or two `Mcp-Session-Id` headers; they were
    relayed (the first of two counted). The session goes on."""
    async with aiohttp.ClientSession() as http:
        client = await Legacy(proxy_url, http).open()
        body = call_body(7, "echo")
        doubled = CIMultiDict(client.headers())
        doubled.add("Mcp-Session-Id", "another")
        twice = CIMultiDict(client.headers())
        twice.add("MCP-Protocol-Version", "2025-06-18")
        for headers, expected in (
            (client.headers(**{"MCP-Protocol-Version": "abc"}), "unsupported MCP-Protocol-Version 'abc'"),
            (client.headers(**{"MCP-Protocol-Version": "2026-07-28"}), "unsupported MCP-Protocol-Version"),
            (doubled, "2 Mcp-Session-Id headers"),
            (twice, "2 MCP-Protocol-Version headers"),
        ):
            async with http.post(proxy_url, json=body, headers=headers) as resp:
                reply = await resp.json()
            assert resp.status == 400 and reply["id"] == 7 and reply["error"]["code"] == -32600, reply
            assert expected in reply["error"]["message"], reply
        get = client.headers(**{"MCP-Protocol-Version": "abc", "Accept": "text/event-stream"})
        async with http.get(proxy_url, headers=get) as resp:
            assert resp.status == 400
        async with client.call(8, "echo") as resp:
            assert (await reply_of(resp))["id"] == 8


# -- item 2: one response per upstream id; broken sessions ----------------------------------------


async def test_update_and_cancel_race_sends_one_response(upstream: str, proxy_url: str) -> None:
    client = ModernClient(proxy_url, capabilities=ELICIT_TASKS)
    try:
        for _ in range(3):
            created = (await client.call("ask", {"delay_ms": 150})).result
            assert created["resultType"] == "task"
            task = await client.wait_status(created["taskId"], ("input_required",))
            key = next(iter(task["inputRequests"]))
            answer = {
                "taskId": created["taskId"],
                "inputResponses": {key: {"action": "accept", "content": {}}},
            }
            await asyncio.gather(
                client.request("tasks/update", answer),
                client.request("tasks/cancel", {"taskId": created["taskId"]}),
            )
            await asyncio.sleep(0.2)
            assert (await client.call("echo", {"after": "race"})).result["content"][0][
                "text"
            ] == '{"after": "race"}'
    finally:
        await client.close()
    counts: dict[tuple, int] = {}
    for entry in await upstream_log(upstream):
        message = entry["message"]
        if "method" not in message:
            counts[(entry["session"], message["id"])] = counts.get((entry["session"], message["id"]), 0) + 1
    assert counts and set(counts.values()) == {1}


@pytest.mark.parametrize("stubborn", [False, True])
async def test_cancel_answers_questions_first_and_cancels_only_a_request_still_running(
    upstream: str, proxy_url: str, stubborn: bool
) -> None:
    client = ModernClient(proxy_url, capabilities=ELICIT_TASKS)
    try:
        created = (await client.call("ask", {"delay_ms": 150, "stubborn": stubborn})).result
        await client.wait_status(created["taskId"], ("input_required",))
        before = len(await upstream_log(upstream))
        await client.request("tasks/cancel", {"taskId": created["taskId"]})
        await asyncio.sleep(1.0)  # past the grace the proxy gives the upstream to end the request itself
    finally:
        await client.close()
    after = [e["message"] for e in (await upstream_log(upstream))[before:]]
    answers = [i for i, m in enumerate(after) if "method" not in m]
    cancels = [i for i, m in enumerate(after) if m.get("method") == "notifications/cancelled"]
    assert len(answers) == 1 and after[answers[0]]["error"]["code"] == -32800
    if stubborn:  # still running after its question failed: cancelled, after the answer
        assert len(cancels) == 1 and cancels[0] > answers[0]
    else:  # it ended by itself: a cancel would name a request already answered
        assert cancels == []


async def test_broken_session_leaves_the_pool_and_undelivered_call_is_retried(
    upstream: str, proxy_url: str
) -> None:
    client = ModernClient(proxy_url, capabilities={})
    try:
        assert (await client.call("echo", {"n": 1})).status == 200
        before = await upstream_sessions(upstream)
        reply = await client.call("break")
        assert "closed the stream before answering" in reply.error["message"]
        assert (await client.call("echo", {"n": 2})).result["content"][0]["text"] == '{"n": 2}'
        assert len(await upstream_sessions(upstream)) == len(before) + 1  # a new upstream session
    finally:
        await client.close()
    http = UpstreamHttp(server="bad", keepalive_s=4)
    try:
        session = UpstreamSession(http, upstream, server="bad")
        await session.open()
        with pytest.raises(UpstreamError):
            await session.request("tools/call", {"name": "break"}, handler=None)
        assert session.broken
        with pytest.raises(SessionBrokenError):  # nothing came back on a broken session: not delivered
            await session.request("tools/call", {"name": "echo"}, handler=None)
        await session.close()
    finally:
        await http.close()


async def test_second_answer_for_one_upstream_id_is_never_sent(upstream: str) -> None:
    http = UpstreamHttp(server="bad", keepalive_s=4)
    try:
        session = UpstreamSession(http, upstream, server="bad", capabilities={"elicitation": {}})
        await session.open()

        async def on_message(msg: dict) -> None:
            if msg.get("method") == "elicitation/create":
                await asyncio.gather(  # an answer and a cancel's error at once
                    session.respond(msg["id"], error={"code": -32800, "message": "cancelled"}),
                    session.respond(msg["id"], result={"action": "accept", "content": {}}),
                )

        reply = await session.request("tools/call", {"name": "ask"}, handler=on_message)
        assert "cancelled" in reply["result"]["content"][0]["text"]
        assert (await session.request("tools/call", {"name": "echo", "arguments": {"ok": 1}}, handler=None))[
            "result"
        ]
        sid = session.session_id
        await session.close()
    finally:
        await http.close()
    answers = [
        e for e in await upstream_log(upstream) if e["session"] == sid and "method" not in e["message"]
    ]
    assert len(answers) == 1


# -- stdio: a cancelled queued call is never sent ------------------------------------------------


async def test_stdio_queued_call_cancelled_is_never_sent(tmp_path: Path, serve: Serve) -> None:
    proxy = await serve(stdio_config(tmp_path, server={"max_concurrency": 1}))
    async with aiohttp.ClientSession() as http:
        client = await Legacy(proxy.url(), http).open()
        first = asyncio.ensure_future(client.call("a", "slow_compute", seconds=1.0, label="A").__aenter__())
        await asyncio.sleep(0.2)
        started = time.monotonic()
        queued = asyncio.ensure_future(client.call("b", "slow_compute", seconds=0.1, label="B").__aenter__())
        await asyncio.sleep(0.2)
        assert (
            await client.post(
                {"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": "b"}}
            )
            == 202
        )
        resp = await asyncio.wait_for(queued, 2)
        body = await resp.json()
        assert body["id"] == "b" and body["error"]["code"] == -32800
        assert time.monotonic() - started < 0.9  # answered while A still held the only slot
        done = await first
        assert (await done.json())["result"]["content"][0]["text"] == "computed A after 1s"
        async with client.call("log", "cancelled_log") as log_resp:
            text = (await log_resp.json())["result"]["content"][0]["text"]
        assert "B" not in [entry["label"] for entry in json.loads(text)]
        resp.release()
        done.release()


async def test_stdio_child_gets_one_cancel_only_for_the_request_in_flight(
    tmp_path: Path, serve: Serve
) -> None:
    """The README's rule on stdio: a child never gets `notifications/cancelled` for a request it
    already answered or never saw. The child's own log of every cancel it received holds exactly
    one: for the running call, under the id the child knows it by."""
    config = stdio_config(tmp_path)
    config.listen.sse_keepalive = 0.05  # the reply stream opens at once (a keepalive), not at the answer
    proxy = await serve(config)

    async def child_log(client: Legacy, tool: str) -> Any:
        async with client.call(f"log-{tool}", tool) as resp:
            return json.loads((await resp.json())["result"]["content"][0]["text"])

    async with aiohttp.ClientSession() as http:
        client = await Legacy(proxy.url(), http).open()
        async with client.call(1, "greet", name="answered") as resp:
            assert "Hello" in (await resp.json())["result"]["content"][0]["text"]
        cancel = {"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 1}}
        assert await client.post(cancel) == 202  # answered already
        assert await client.post({**cancel, "params": {"requestId": "never-sent"}}) == 202
        async with client.call("running", "slow_compute", seconds=10, label="one-cancel") as resp:
            async with asyncio.timeout(5):
                while "one-cancel" not in await child_log(client, "started_log"):
                    await asyncio.sleep(0.02)
            assert await client.post({**cancel, "params": {"requestId": "running", "reason": "user"}}) == 202
            events = await asyncio.wait_for(read_events(resp), 5)
        final = json.loads(events[-1].data)
        assert final["id"] == "running" and "error" in final
        async with asyncio.timeout(5):
            while not (
                ended := [e for e in await child_log(client, "cancelled_log") if e["label"] == "one-cancel"]
            ):
                await asyncio.sleep(0.02)
        received = await child_log(client, "cancels_received")
    assert received == [{"requestId": ended[0]["requestId"], "reason": "user"}]


async def test_stdio_bridge_keeps_a_silent_call_alive(tmp_path: Path, serve: Serve) -> None:
    config = stdio_config(tmp_path)
    config.listen.sse_keepalive = 0.05
    proxy = await serve(config)
    async with aiohttp.ClientSession() as http:
        client = await Legacy(proxy.url(), http).open()
        async with client.call("k", "slow_compute", seconds=0.3, label="K") as resp:
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            raw = await resp.read()
    await proxy.stop()
    # a priming event (an id, no data: SEP-1699) once the reply turns to SSE, then keepalives
    assert raw.startswith(b"event: message\nid: ") and raw.count(b": keepalive") >= 3
    final = json.loads(
        [e for e in raw.decode().split("\n\n") if e.startswith("event: message")][-1].split("data: ", 1)[1]
    )
    assert final["id"] == "k" and final["result"]["content"][0]["text"] == "computed K after 0.3s"


# -- review fixes ---------------------------------------------------------------------------------


async def _run_json(argv: list[str]) -> object:
    """Run a client script off the event loop the proxy serves on; its last stdout line as JSON."""
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout=120)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, err.decode()[-3000:]
    return json.loads(out.decode().strip().splitlines()[-1])


@pytest.mark.timeout(900)  # first run installs its tools (npm, a venv): longer than the suite's 300 s
async def test_upstream_errors_go_out_in_http_200_and_keep_an_mcp1_client_alive(
    upstream: str, tmp_path: Path, serve: Serve
) -> None:
    """protocol.md §1.4.4: on the legacy wire a JSON-RPC error for a request comes in an HTTP 200;
    an `mcp` 1.x client raises on any other status inside its task group and loses its transport."""
    proxy = await serve(relay_config(upstream, tmp_path, {"timeout": "200ms"}))
    async with aiohttp.ClientSession() as http:
        client = await Legacy(proxy.url(), http).open()
        body = {
            "jsonrpc": "2.0",
            "id": 1,
            "method": "tools/call",
            "params": {"name": "slow_json", "arguments": {"ms": 500}},
        }
        # no SSE: stays JSON
        async with http.post(
            proxy.url(), json=body, headers=client.headers(Accept="application/json")
        ) as resp:
            # timed out before its headers
            assert resp.status == 200 and (await resp.json())["error"]["code"] == -32603
        # still counted as an error, though in a 200
        async with http.get(proxy.base + "/metrics") as resp:
            assert 'calls_total{outcome="error",server="bad",tool="slow_json"} 1.0' in await resp.text()
    python = python_venv(ROOT / ".venvs" / "mcp126", "mcp==1.26.0")
    calls = await _run_json(
        [
            str(python),
            "tests/fixtures/mcp1_relay_client.py",
            proxy.url(),
            'slow_json:{"ms": 500}',
            'echo:{"x": 1}',
        ]
    )
    await proxy.stop()
    assert isinstance(calls, list) and calls[0]["error"] == -32603 and "timeout" in calls[0]["message"], calls
    assert calls[1] == {"text": '{"x": 1}'}, calls


async def test_sessionless_ids_and_cancels_are_scoped_to_the_principal(
    upstream: str, tmp_path: Path, serve: Serve
) -> None:
    """A session-less upstream: Bob's cancel for id 1 never touches Alice's request 1, and two
    principals using id 1 at once keep their own mappings (fresh upstream id per request)."""
    config = config_from_data(
        {
            "listen": {"sse_keepalive": "50ms"},
            "auth": {
                "mode": "header",
                "header": {"name": "X-Forwarded-User", "trusted_peers": ["127.0.0.1"]},
            },
            "store": {"path": str(tmp_path / "store"), "durable": False},
            "mcpServers": {"bad": {"url": upstream.removesuffix("/mcp") + "/stateless", "timeout": "5s"}},
        }
    )
    headers = {
        "Content-Type": "application/json",
        "Accept": "application/json, text/event-stream",
        "MCP-Protocol-Version": LEGACY,
    }
    call = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "tools/call",
        "params": {"name": "wait_cancel", "arguments": {"ms": 1500}},
    }
    cancel = {"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 1}}
    proxy = await serve(config)
    async with aiohttp.ClientSession() as http:

        async def post(user: str, body: dict) -> tuple[int, dict | None]:
            async with http.post(
                proxy.url(), json=body, headers={**headers, "X-Forwarded-User": user}
            ) as resp:
                if resp.status == 202:
                    return 202, None
                return resp.status, await reply_of(resp)

        async def calls_seen(n: int) -> None:
            async with asyncio.timeout(5):
                while (
                    len(
                        [
                            m
                            for m in (await upstream_log(upstream))[before:]
                            if m["message"].get("method") == "tools/call"
                        ]
                    )
                    < n
                ):
                    await asyncio.sleep(0.02)

        before = len(await upstream_log(upstream))
        bob = asyncio.ensure_future(post("bob", call))
        await calls_seen(1)
        alice = asyncio.ensure_future(post("alice", call))  # the newest mapping of client id 1
        await calls_seen(2)
        assert await post("carol", cancel) == (202, None)  # carol has no request 1: nothing goes upstream
        assert await post("bob", cancel) == (202, None)  # bob cancels HIS request 1 only
        status, reply = await bob
        assert status == 200 and reply["id"] == 1 and reply["error"]["code"] == -32800
        status, reply = await alice
        assert (
            status == 200 and reply["id"] == 1 and reply["result"]["content"][0]["text"] == "wait_cancel done"
        )
    await proxy.stop()
    seen = [entry["message"] for entry in (await upstream_log(upstream))[before:]]
    calls = [m["id"] for m in seen if m.get("method") == "tools/call"]
    cancels = [m["params"]["requestId"] for m in seen if m.get("method") == "notifications/cancelled"]
    assert len(calls) == 2 and calls[0] != calls[1]  # a fresh upstream id per request
    assert len(cancels) == 1 and cancels[0] in calls


async def test_sessions_per_principal_are_capped_before_an_initialize_reaches_the_upstream(
    upstream: str, tmp_path: Path, serve: Serve
) -> None:
    """limits.max_sessions_per_principal: three initializes of one principal at once open two
    sessions; the third gets HTTP 429 naming the limit, no session id, and never reaches the upstream.
    An initialize on a session held is not refused; one that failed holds no place. Another
    principal is not held back, and a DELETE frees a place."""
    config = config_from_data(
        {
            "auth": {
                "mode": "header",
                "header": {"name": "X-Forwarded-User", "trusted_peers": ["127.0.0.1"]},
            },
            "limits": {"max_sessions_per_principal": 2},
            "store": {"path": str(tmp_path / "store"), "durable": False},
            "mcpServers": {"bad": {"url": upstream, "timeout": "5s"}},
        }
    )
    headers = {
        "Content-Type": "application/json",
        "Accept": "application/json, text/event-stream",
        "MCP-Protocol-Version": LEGACY,
    }
    initialize = {
        "jsonrpc": "2.0",
        "id": "init",
        "method": "initialize",
        "params": {
            "protocolVersion": LEGACY,
            "capabilities": {},
            "clientInfo": {"name": "raw", "version": "0"},
        },
    }
    refused = metrics.LIMIT_REJECTIONS.labels("max_sessions_per_principal")
    refused_before = refused._value.get()
    proxy = await serve(config)

    async def initializes_seen() -> int:
        return len([m for m in await upstream_log(upstream) if m["message"].get("method") == "initialize"])

    seen_before = await initializes_seen()
    async with aiohttp.ClientSession() as http:

        async def open_session(user: str, sid: str = "", client: str = "raw") -> tuple[int, str | None, dict]:
            body = {**initialize, "params": {**initialize["params"], "clientInfo": {"name": client}}}
            extra = {"Mcp-Session-Id": sid} if sid else {}
            async with http.post(
                proxy.url(), json=body, headers={**headers, "X-Forwarded-User": user, **extra}
            ) as resp:
                return resp.status, resp.headers.get("Mcp-Session-Id"), await reply_of(resp)

        opened = await asyncio.gather(*(open_session("alice") for _ in range(3)))
        assert sorted(status for status, _, _ in opened) == [200, 200, 429]
        ((_, sid, reply),) = [o for o in opened if o[0] == 429]
        assert sid is None and reply["id"] == "init"
        assert reply["error"]["code"] == -32603 and reply["error"]["data"] == {
            "limit": "max_sessions_per_principal",
            "max": 2,
        }
        assert await initializes_seen() - seen_before == 2  # the refused one never left the proxy
        assert refused._value.get() - refused_before == 1
        alice_sid = next(sid for status, sid, _ in opened if status == 200)
        assert await open_session("alice", sid=alice_sid or "") == (
            200,
            alice_sid,
            {"jsonrpc": "2.0", "id": "init", "result": ANY},
        )  # initialize again on a session held: it opens none, so the cap does not refuse it
        # An initialize the upstream refused, or whose answer is unreadable, leaves no session
        # behind: the client never got its id, so it holds no place.
        for client in ("refused", "garbled"):
            status, sid, reply = await open_session("carol", client=client)
            assert sid is None and "error" in reply, (client, status, reply)
        assert [(await open_session("carol"))[0] for _ in range(3)] == [200, 200, 429]
        status, bob_sid, _ = await open_session("bob")
        assert status == 200 and bob_sid
        async with http.delete(
            proxy.url(), headers={**headers, "X-Forwarded-User": "alice", "Mcp-Session-Id": alice_sid or ""}
        ) as resp:
            assert resp.status == 200
        status, again, _ = await open_session("alice")
        assert status == 200 and again
        assert (await open_session("alice"))[0] == 429
    await proxy.stop()


async def test_get_and_delete_on_an_upstream_that_never_answers_are_bounded(
    upstream: str, tmp_path: Path, serve: Serve
) -> None:
    """DELETE is bounded by request_timeout; a GET's wait for the upstream's headers by
    connect_timeout + request_timeout, with keepalives on the client's stream meanwhile."""
    config = relay_config(upstream, tmp_path, {"request_timeout": "300ms", "connect_timeout": "200ms"})
    proxy = await serve(config)
    async with aiohttp.ClientSession() as http:
        client = await Legacy(proxy.url(), http).open()
        async with client.call(1, "hang") as resp:
            assert (await reply_of(resp))["result"]["content"][0]["text"] == "hanging"
        started = time.monotonic()
        async with (
            asyncio.timeout(5),
            http.get(proxy.url(), headers=client.headers(Accept="text/event-stream")) as resp,
        ):
            assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
            body = await resp.text()  # ends once the upstream's bound is over
        assert body.count(": keepalive") >= 3, body
        assert 0.4 < time.monotonic() - started < 3
        started = time.monotonic()
        async with asyncio.timeout(5), http.delete(proxy.url(), headers=client.headers()) as resp:
            assert resp.status == 504 and "request_timeout" in (await resp.json())["error"]["message"]
        assert time.monotonic() - started < 2


@pytest.mark.parametrize("how", ["client_leaves", "tasks_cancel"])
async def test_stdio_cancel_of_a_queued_modern_call_never_reaches_the_child(
    tmp_path: Path, how: str, serve: Serve
) -> None:
    """max_concurrency 1: A holds the slot, B waits for it. B abandoned (its client leaves, or
    tasks/cancel of its task) must reach the child neither as a tools/call nor as a cancel."""
    stdin_log = tmp_path / "stdin.jsonl"
    fixture = Path(__file__).resolve().parents[1] / "fixtures" / "legacy_server.py"
    server = {
        "command": "sh",
        "args": ["-c", f"tee {stdin_log} | {sys.executable} {fixture} --stdio"],
        "max_concurrency": 1,
    }
    config = config_from_data(
        {
            "store": {"path": str(tmp_path / "store"), "durable": False},
            "tasks": {"detach_after": "100ms", "ttl": "10m", "poll_interval": "50ms"},
            "mcpServers": {"fx": server},
        }
    )
    proxy = await serve(config)
    client = ModernClient(proxy.url(), capabilities=None if how == "tasks_cancel" else {})
    try:
        await client.call("greet", {"name": "warm-up"})
        a = asyncio.ensure_future(client.call("slow_compute", {"seconds": 1.0, "label": "A"}))
        async with asyncio.timeout(5):
            while "slow_compute" not in stdin_log.read_text():
                await asyncio.sleep(0.02)
        if how == "tasks_cancel":
            b = (await client.call("slow_compute", {"seconds": 0.1, "label": "B"})).result
            assert b["resultType"] == "task", b  # detached while still queued for the slot
            assert (await client.request("tasks/cancel", {"taskId": b["taskId"]})).status == 200
            assert (await client.wait_terminal(b["taskId"]))["status"] == "cancelled"
        else:
            b_call = asyncio.ensure_future(client.call("slow_compute", {"seconds": 0.1, "label": "B"}))
            await asyncio.sleep(0.2)
            b_call.cancel()  # the client closes B's request stream while B waits for the slot
            with pytest.raises(asyncio.CancelledError):
                await b_call
            await asyncio.sleep(0.2)
        reply = await a
        if reply.result.get("resultType") == "task":
            await client.wait_terminal(reply.result["taskId"])
        await client.call("greet", {"name": "after"})  # the child has read everything sent before
    finally:
        await client.close()
    await proxy.stop()
    sent = [json.loads(line) for line in stdin_log.read_text().splitlines() if line.strip()]
    labels = [
        m["params"]["arguments"].get("label")
        for m in sent
        if m.get("method") == "tools/call" and m["params"]["name"] == "slow_compute"
    ]
    assert labels == ["A"], sent
    assert not [m for m in sent if m.get("method") == "notifications/cancelled"], sent


async def test_silently_broken_session_retries_only_what_is_safe_to_send_twice(
    upstream: str, proxy_url: str
) -> None:
    """A pooled upstream session that broke unannounced: the first request on it gets a stream that
    closes with no event. A non-call (tools/list) is sent again on a new session and works; a
    tools/call is not (the upstream accepted it; whether the tool ran is unknowable), it fails with
    -32603, and the session has left the pool for the next call."""
    client = ModernClient(proxy_url, capabilities={})

    async def break_latest() -> str:
        sid = (await upstream_sessions(upstream))[-1]
        async with (
            aiohttp.ClientSession() as http,
            http.post(upstream.removesuffix("/mcp") + f"/break?session={sid}") as resp,
        ):
            assert resp.status == 204
        return sid

    try:
        assert (await client.call("echo", {"n": 1})).status == 200
        broken = await break_latest()
        before = len(await upstream_log(upstream))
        listing = await client.request("tools/list")
        assert "echo" in [t["name"] for t in listing.result["tools"]], listing.message
        lists = [
            e["session"]
            for e in (await upstream_log(upstream))[before:]
            if e["message"].get("method") == "tools/list"
        ]
        assert lists[0] == broken and len(lists) == 2 and lists[1] != broken  # sent again, on a new session
        broken = await break_latest()
        before = len(await upstream_log(upstream))
        reply = await client.call("echo", {"n": 2})
        assert (
            reply.error["code"] == -32603 and "closed the stream before answering" in reply.error["message"]
        )
        calls = [
            e["session"]
            for e in (await upstream_log(upstream))[before:]
            if e["message"].get("method") == "tools/call"
        ]
        assert calls == [broken]  # never sent twice
        assert (await client.call("echo", {"n": 3})).result["content"][0]["text"] == '{"n": 3}'
    finally:
        await client.close()


async def test_slow_json_upstream_reply_switches_to_sse_with_keepalives(proxy_url: str) -> None:
    """A JSON-mode upstream slower than `sse_keepalive`: a client that accepts SSE gets its reply on
    an SSE stream with keepalives meanwhile (as in front of stdio); one that does not gets JSON."""
    async with aiohttp.ClientSession() as http:
        client = await Legacy(proxy_url, http).open()
        async with client.call(7, "slow_json", ms=400) as resp:
            assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
            text = await resp.text()
        assert text.count(": keepalive") >= 2, text
        data = [
            json.loads(line[5:])
            for line in text.splitlines()
            if line.startswith("data:") and line[5:].strip()
        ]
        assert data == [
            {
                "jsonrpc": "2.0",
                "id": 7,
                "result": {"content": [{"type": "text", "text": "slow_json done"}], "isError": False},
            }
        ]
        body = {
            "jsonrpc": "2.0",
            "id": 8,
            "method": "tools/call",
            "params": {"name": "slow_json", "arguments": {"ms": 200}},
        }
        async with http.post(proxy_url, json=body, headers=client.headers(Accept="application/json")) as resp:
            assert resp.headers["Content-Type"].startswith("application/json")
            assert (await resp.json())["id"] == 8


async def test_resuming_get_takes_the_stream_over_from_a_connection_still_attached(
    upstream: str, proxy_url: str
) -> None:
    """2025-11-25 transports: a message is never broadcast on two streams. A GET with Last-Event-ID
    while the first GET connection is still open: the new one gets what follows, the old one ends."""
    async with aiohttp.ClientSession() as http:
        client = await Legacy(proxy_url, http).open()
        upstream_sid = (await upstream_sessions(upstream))[-1]

        async def push(n: int) -> None:
            async with http.post(
                upstream.removesuffix("/mcp") + f"/push?session={upstream_sid}", json=n
            ) as r:
                assert r.status == 204

        async def messages(it: AsyncIterator, count: int) -> list:
            out: list = []
            async with asyncio.timeout(5):
                async for event in it:
                    if event.data:
                        out.append((event.id, json.loads(event.data)["params"]["data"]))
                        if len(out) == count:
                            break
            return out

        old = await http.get(proxy_url, headers=client.headers(Accept="text/event-stream")).__aenter__()
        old_events = iter_events(old.content.iter_any())
        await push(1)
        [(first_id, _)] = await messages(old_events, 1)
        headers = client.headers(Accept="text/event-stream", **{"Last-Event-ID": first_id})
        async with http.get(proxy_url, headers=headers) as new:
            async with asyncio.timeout(5):
                rest = [e async for e in old_events if e.data]  # the old connection ends
            await push(2)
            assert [n for _, n in await messages(iter_events(new.content.iter_any()), 1)] == [2]
        assert rest == []  # 2 went to the new connection only
        old.release()


# -- found by a newcomer's run (2026-12-02) ------------------------------------------------------


async def test_an_upstream_withdrawn_question_reaches_the_client_under_its_proxy_id(
    upstream: str, proxy_url: str
) -> None:
    """The upstream's `notifications/cancelled` for its own question names the proxy id the client
    got the question under; the client's late answer is then not forwarded."""
    async with aiohttp.ClientSession() as http:
        client = await Legacy(proxy_url, http).open({"elicitation": {}})
        async with client.call(6, "ask", withdraw_ms=100) as resp:
            it = iter_events(resp.content.iter_any())
            question = await next_message(it)
            cancel = await next_message(it)
            final = await next_message(it)
        assert question["method"] == "elicitation/create"
        assert (
            cancel["method"] == "notifications/cancelled" and cancel["params"]["requestId"] == question["id"]
        )
        assert final["id"] == 6
        late = {"jsonrpc": "2.0", "id": question["id"], "result": {"action": "accept", "content": {}}}
        assert await client.post(late) == 202
    upstream_sid = (await upstream_sessions(upstream))[-1]
    assert [
        e
        for e in await upstream_log(upstream)
        if e["session"] == upstream_sid and "method" not in e["message"]
    ] == []


async def test_a_last_event_id_past_the_newest_event_is_refused(proxy_url: str) -> None:
    async with aiohttp.ClientSession() as http:
        client = await Legacy(proxy_url, http).open()
        async with client.call(1, "sse_echo") as resp:
            token = (await read_events(resp))[-1].id.rpartition(":")[0]
        async with http.get(
            proxy_url, headers=client.headers(Accept="text/event-stream", **{"Last-Event-ID": f"{token}:999"})
        ) as again:
            assert again.status == 400


@pytest.mark.parametrize(
    "extra",
    [{"Content-Type": "text/plain", "Accept": "application/json"}, {"Content-Type": "", "Accept": ""}],
)
async def test_a_client_without_json_content_type_or_sse_accept_is_served_json(
    proxy_url: str, extra: dict
) -> None:
    """README "Transport leniency": the upstream is asked properly whatever the client sent, and a
    client that takes no SSE gets the answer as one JSON body (the upstream replied on SSE)."""
    async with aiohttp.ClientSession() as http:
        client = await Legacy(proxy_url, http).open()
        headers = {k: v for k, v in client.headers(**extra).items() if v}
        body = json.dumps(
            {
                "jsonrpc": "2.0",
                "id": 4,
                "method": "tools/call",
                "params": {"name": "sse_echo", "arguments": {}},
            }
        )
        async with http.post(
            proxy_url, data=body, headers=headers, skip_auto_headers=["Content-Type"]
        ) as resp:
            assert resp.status == 200, await resp.text()
            assert resp.headers["Content-Type"].startswith("application/json")
            reply = await resp.json()
    assert reply["id"] == 4 and "result" in reply


async def test_deleting_a_session_mid_call_ends_its_stream_with_an_error(proxy_url: str) -> None:
    async with aiohttp.ClientSession() as http:
        client = await Legacy(proxy_url, http).open()
        async with client.call(8, "slow", ms=4000) as resp:
            async with http.delete(proxy_url, headers=client.headers()) as gone:
                assert gone.status == 200
            events = [e for e in await asyncio.wait_for(read_events(resp), 5) if e.data.strip()]
    error = json.loads(events[-1].data)
    assert error["id"] == 8 and "session ended" in error["error"]["message"]


async def test_a_2025_06_18_session_is_not_offered_v1_tasks(proxy_url: str) -> None:
    """v1 tasks are 2025-11-25's: an older session gets no `capabilities.tasks`, and its
    `params.task` is passed through as any other param (a synchronous answer)."""
    async with aiohttp.ClientSession() as http:
        client = Legacy(proxy_url, http)
        old = {"MCP-Protocol-Version": "2025-06-18"}
        init = {
            "jsonrpc": "2.0",
            "id": 0,
            "method": "initialize",
            "params": {
                "protocolVersion": "2025-06-18",
                "capabilities": {},
                "clientInfo": {"name": "old", "version": "0"},
            },
        }
        async with http.post(proxy_url, json=init, headers=client.headers(**old)) as resp:
            client.sid = resp.headers["Mcp-Session-Id"]
            result = (await resp.json())["result"]
        assert result["protocolVersion"] == "2025-06-18" and "tasks" not in result["capabilities"]
        call = {
            "jsonrpc": "2.0",
            "id": 1,
            "method": "tools/call",
            "params": {"name": "echo", "arguments": {"a": 1}, "task": {"ttl": 60000}},
        }
        async with http.post(proxy_url, json=call, headers=client.headers(**old)) as resp:
            reply = await reply_of(resp)
    assert reply["id"] == 1 and json.loads(reply["result"]["content"][0]["text"]) == {"a": 1}


async def test_deleting_a_session_mid_call_answers_a_json_only_client_and_a_late_stream(
    proxy_url: str,
) -> None:
    """The session's end reaches every kind of waiting reply: a JSON-only client's (one JSON body
    with the error) and a reply already switched to SSE while a slow JSON upstream was awaited."""
    async with aiohttp.ClientSession() as http:
        client = await Legacy(proxy_url, http).open()
        body = call_body(11, "slow", ms=4000)
        json_only = asyncio.ensure_future(
            http.post(proxy_url, json=body, headers=client.headers(Accept="application/json"))
        )
        async with client.call(12, "slow_json", ms=4000) as late:
            # switched after sse_keepalive
            assert late.headers["Content-Type"].startswith("text/event-stream")
            async with http.delete(proxy_url, headers=client.headers()) as gone:
                assert gone.status == 200
            events = [e for e in await asyncio.wait_for(read_events(late), 5) if e.data.strip()]
        resp = await asyncio.wait_for(json_only, 5)
        async with resp:
            assert resp.status == 200
            reply = await resp.json()
    assert (
        json.loads(events[-1].data)["id"] == 12
        and "session ended" in json.loads(events[-1].data)["error"]["message"]
    )
    assert reply["id"] == 11 and "session ended" in reply["error"]["message"]


async def test_a_2025_06_18_session_without_the_version_header_and_a_required_tool(
    upstream: str, tmp_path: Path, serve: Serve
) -> None:
    """The version the session's initialize asked for counts when a request has no
    MCP-Protocol-Version; a `mode: required` tool refuses a 2025-06-18 session's calls."""
    config = relay_config(upstream, tmp_path, server={"tasks": {"tools": {"slow": {"mode": "required"}}}})
    proxy = await serve(config)
    async with aiohttp.ClientSession() as http:
        client = Legacy(proxy.url(), http)
        init = {
            "jsonrpc": "2.0",
            "id": 0,
            "method": "initialize",
            "params": {
                "protocolVersion": "2025-06-18",
                "capabilities": {},
                "clientInfo": {"name": "old", "version": "0"},
            },
        }
        async with http.post(
            proxy.url(), json=init, headers=client.headers(**{"MCP-Protocol-Version": "2025-06-18"})
        ) as resp:
            client.sid = resp.headers["Mcp-Session-Id"]
        no_header = {k: v for k, v in client.headers().items() if k != "MCP-Protocol-Version"}
        task = {"ttl": 60000}
        echo = {
            "jsonrpc": "2.0",
            "id": 1,
            "method": "tools/call",
            "params": {"name": "echo", "arguments": {"a": 1}, "task": task},
        }
        async with http.post(proxy.url(), json=echo, headers=no_header) as resp:
            assert json.loads((await reply_of(resp))["result"]["content"][0]["text"]) == {"a": 1}
        slow = {
            "jsonrpc": "2.0",
            "id": 2,
            "method": "tools/call",
            "params": {"name": "slow", "arguments": {}, "task": task},
        }
        async with http.post(proxy.url(), json=slow, headers=no_header) as resp:
            assert (await reply_of(resp))["error"]["code"] == -32601


async def test_a_json_only_client_does_not_leave_the_upstreams_question_waiting(proxy_url: str) -> None:
    """A client that takes no SSE cannot see a server→client request: the proxy answers it upstream
    with -32601 at once, so the call ends now rather than at its timeout."""
    async with aiohttp.ClientSession() as http:
        client = await Legacy(proxy_url, http).open({"elicitation": {}})
        body = {
            "jsonrpc": "2.0",
            "id": 13,
            "method": "tools/call",
            "params": {"name": "ask", "arguments": {}},
        }
        async with http.post(proxy_url, json=body, headers=client.headers(Accept="application/json")) as resp:
            assert resp.headers["Content-Type"].startswith("application/json")
            reply = await asyncio.wait_for(resp.json(), 3)  # the fixture waits 5 s for an answer
    text = json.loads(reply["result"]["content"][0]["text"])
    assert reply["id"] == 13 and text["code"] == -32601 and "text/event-stream" in text["message"]


# -- one session machine, two upstream kinds -----------------------------------------------------


@pytest.mark.parametrize("kind", ["http", "stdio"])
async def test_a_cancelled_request_ends_the_same_way_on_both_upstream_kinds(
    legacy_url: str, tmp_path: Path, kind: str, serve: Serve
) -> None:
    """A legacy client's `notifications/cancelled` reaches the upstream under the proxy's id, and
    the request's reply ends within the cancel grace with -32800, whatever the upstream kind (a stdio
    child that answers a cancelled request with nothing used to hold its client until the call's
    timeout)."""
    config = make_config(legacy_url, tmp_path / "store")
    if kind == "stdio":
        config = stdio_config(tmp_path)
        config.mcpServers = {"legacy": config.mcpServers["fx"].model_copy(update=FIXTURE_STDIO)}
    label = f"cancel-{kind}"
    proxy = await serve(config)
    async with aiohttp.ClientSession() as http:
        client = await Legacy(proxy.url(), http).open()

        async def call() -> dict:
            async with client.call("c1", "slow_compute", seconds=10, label=label) as resp:
                return await reply_of(resp)

        started = time.monotonic()
        replied = asyncio.ensure_future(call())
        await asyncio.sleep(0.5)  # running upstream by now
        cancel = {"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": "c1"}}
        assert await client.post(cancel) == 202
        reply = await asyncio.wait_for(replied, 5)
        assert reply["id"] == "c1" and reply["error"]["code"] == -32800, reply
        assert time.monotonic() - started < 4
        async with client.call("log", "cancelled_log") as log_resp:
            entries = json.loads((await reply_of(log_resp))["result"]["content"][0]["text"])
    await proxy.stop()
    assert [e["reason"] for e in entries if e["label"] == label] == ["notifications/cancelled"]


@pytest.mark.timeout(900)  # first run builds the mcp 1.26 venv
async def test_an_upstream_refusal_with_a_made_up_id_keeps_its_status_and_error(
    tmp_path: Path, serve: Serve
) -> None:
    """`mcp` 1.26 answers a request without `Mcp-Session-Id` with HTTP 400 and an error whose id is
    `"server-error"`: that is its answer to this request, so the client gets the 400 and the error
    under its own id (not a 200 saying the reply was for another request)."""
    python = python_venv(ROOT / ".venvs" / "mcp126", "mcp==1.26.0")
    upstream = ServerProcess([str(python), "tests/fixtures/conformance_server_mcp1.py", "--port", "0"])
    try:
        proxy = await serve(make_config(upstream.url, tmp_path / "store"))
        headers = {
            "Content-Type": "application/json",
            "Accept": "application/json, text/event-stream",
            "MCP-Protocol-Version": "2025-06-18",
        }
        body = {"jsonrpc": "2.0", "id": 7, "method": "tools/list"}
        async with (
            aiohttp.ClientSession() as http,
            http.post(proxy.url(), json=body, headers=headers) as resp,
        ):
            status, answer = resp.status, await resp.json()
    finally:
        upstream.stop()
    assert status == 400, (status, answer)
    assert answer["id"] == 7 and "session" in answer["error"]["message"].lower(), answer


async def test_idle_sessions_expire_and_their_upstream_sessions_are_deleted(
    upstream: str, tmp_path: Path, serve: Serve
) -> None:
    """2,000 sessions opened and abandoned: after `legacy_session_idle` the proxy holds none of them,
    each upstream session got its DELETE, and a request on one gets the era's 404; a session in use
    stays."""
    proxy = await serve(relay_config(upstream, tmp_path, legacy_session_idle="400ms"))
    sessions = proxy.app[ENDPOINTS_KEY]["bad"].legacy.sessions
    init = {
        "jsonrpc": "2.0",
        "id": 0,
        "method": "initialize",
        "params": {
            "protocolVersion": LEGACY,
            "capabilities": {},
            "clientInfo": {"name": "t", "version": "0"},
        },
    }
    headers = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
    async with aiohttp.ClientSession() as http:
        gate = asyncio.Semaphore(50)

        async def open_one() -> tuple[str, str | None]:
            """(proxy session id, its upstream session id)."""
            async with gate, http.post(proxy.url(), json=init, headers=headers) as resp:
                assert resp.status == 200
                sid = resp.headers["Mcp-Session-Id"]
                return sid, sessions.describe(sid)[0]

        opened = await asyncio.gather(*(open_one() for _ in range(2000)))
        abandoned = [sid for sid, _ in opened]
        upstream_ids = [upstream_id for _, upstream_id in opened[:20]]
        kept, _ = await open_one()
        ping = {"jsonrpc": "2.0", "id": 1, "method": "ping"}
        in_use = {**headers, "Mcp-Session-Id": kept, "MCP-Protocol-Version": LEGACY}
        async with asyncio.timeout(10):
            while any(sessions.knows(sid) for sid in abandoned):
                async with http.post(proxy.url(), json=ping, headers=in_use) as resp:
                    assert resp.status == 200
                await asyncio.sleep(0.1)
        assert sessions.knows(kept)
        gone = {**headers, "Mcp-Session-Id": abandoned[0], "MCP-Protocol-Version": LEGACY}
        async with http.post(proxy.url(), json=ping, headers=gone) as resp:
            assert resp.status == 404
        for upstream_id in upstream_ids:
            direct = {**headers, "Mcp-Session-Id": upstream_id, "MCP-Protocol-Version": LEGACY}
            async with http.post(upstream, json=ping, headers=direct) as resp:
                assert resp.status == 404  # deleted upstream


async def test_a_silent_call_whose_connection_drops_is_resumed_from_the_priming_event(proxy_url: str) -> None:
    """A reply that says nothing before its client's connection drops (here a JSON upstream slower than
    `sse_keepalive`): the proxy's priming event gave it an id, so the client resumes and gets the answer."""
    async with aiohttp.ClientSession() as http:
        client = await Legacy(proxy_url, http).open()
        resp = await client.call(8, "slow_json", ms=400).__aenter__()
        priming = await anext(iter_events(resp.content.iter_any()))
        resp.close()  # the connection drops before any message
        assert priming.data == "" and ":" in (priming.id or ""), priming
        headers = client.headers(Accept="text/event-stream", **{"Last-Event-ID": priming.id})
        async with http.get(proxy_url, headers=headers) as again:
            assert again.status == 200
            rest = [e for e in await asyncio.wait_for(read_events(again), 5) if e.data]
    assert [json.loads(e.data)["id"] for e in rest] == [8]


async def test_a_keyed_call_cancelled_while_a_json_upstream_is_late_settles_its_key_at_once(
    upstream: str, tmp_path: Path, serve: Serve
) -> None:
    """A keyed call the client cancels and leaves while a JSON-mode upstream has not answered (the
    late path, after `sse_keepalive`): the request leaves the session's in-flight set and its key
    gets its outcome at once. Before, both stayed: the session never went idle, and each retry with
    the key waited out the whole `timeout` for an outcome no one would write."""
    proxy = await serve(relay_config(upstream, tmp_path, {"timeout": "8s"}, sse_keepalive="200ms"))
    async with aiohttp.ClientSession() as http:
        client = await Legacy(proxy.url(), http).open()
        body = {
            "jsonrpc": "2.0",
            "id": 7,
            "method": "tools/call",
            "params": {"name": "slow_json", "arguments": {"ms": 3000}},
        }
        keyed = client.headers(**{"Idempotency-Key": "late-cancel"})
        resp = await http.post(proxy.url(), json=body, headers=keyed)
        assert resp.headers["Content-Type"].startswith("text/event-stream")  # the late path
        cancel = {"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 7}}
        assert await client.post(cancel) == 202
        resp.close()  # the client goes away
        session = proxy.app[ENDPOINTS_KEY]["bad"].legacy.sessions.get(client.sid, "anonymous")
        assert session is not None
        async with asyncio.timeout(4):  # the proxy gives up on the cancelled request 1 s after the cancel
            while session.pending:
                await asyncio.sleep(0.05)
        started = time.monotonic()
        async with http.post(proxy.url(), json={**body, "id": 8}, headers=keyed) as retry:
            reply = await reply_of(retry)
        assert time.monotonic() - started < 3, reply  # not the 8 s timeout
        assert reply["error"]["code"] == -32603 and "whether it ran is unknown" in reply["error"]["message"]


@pytest.mark.parametrize("late", [False, True], ids=["at-once", "after-sse-keepalive"])
@pytest.mark.parametrize("refusal", ["connect timeout", 307, 401, 403])
async def test_a_keyed_call_the_upstream_never_ran_lets_its_key_go(
    refusal: str | int, late: bool, tmp_path: Path, serve: Serve
) -> None:
    """A keyed call refused before the upstream ran it (no connection within `connect_timeout`, a
    307/308 redirect, a 401/403 sign-in refusal) lets its key go, so a retry with the key (once the
    upstream is fixed) runs, not "whether it ran is unknown" until the key expires; the same
    whether the refusal comes at once or after `sse_keepalive` switched the reply to SSE."""
    seen: list[dict] = []

    async def refuse(request: web.Request) -> web.Response:
        seen.append(await request.json())
        if late:
            await asyncio.sleep(0.2)  # past sse_keepalive (50 ms)
        headers = {"Location": "http://127.0.0.1:9/mcp"} if refusal == 307 else None
        return web.Response(status=int(refusal), text="no", headers=headers)

    app = web.Application()
    app.router.add_post("/mcp", refuse)
    async with contextlib.AsyncExitStack() as stack:
        if refusal == "connect timeout":
            port = stack.enter_context(black_hole())
        else:
            port = await stack.enter_async_context(served_app(app))
        url = f"http://127.0.0.1:{port}/mcp"
        proxy = await serve(relay_config(url, tmp_path, {"connect_timeout": "200ms"}))
        async with aiohttp.ClientSession() as http:
            keyed = Legacy(proxy.url(), http).headers(**{"Idempotency-Key": "never-ran"})  # session-less
            replies = []
            for rid in (1, 2):
                async with http.post(
                    proxy.url(), json=call_body(rid, "echo", text="hi"), headers=keyed
                ) as resp:
                    replies.append(await reply_of(resp))
    for rid, reply in zip((1, 2), replies, strict=True):
        assert reply["id"] == rid and reply["error"]["code"] == -32603, reply
        assert "whether it ran is unknown" not in reply["error"]["message"], reply
    assert (
        replies[0]["error"]["message"] == replies[1]["error"]["message"]
    )  # the retry met the upstream again
    calls = [message for message in seen if message.get("method") == "tools/call"]
    assert len(calls) == (0 if refusal == "connect timeout" else 2)


async def test_a_question_the_client_leaves_unanswered_is_answered_upstream_at_input_timeout(
    upstream: str, tmp_path: Path, serve: Serve
) -> None:
    """README "Mid-flight questions": a question nobody answers within `input_timeout` is answered
    upstream with an error, and the client sees it withdrawn (`notifications/cancelled` under its
    proxy id). The relay left it to the call's `timeout` (30 min by default), with keepalives
    that defeat a client's read timeout."""
    proxy = await serve(relay_config(upstream, tmp_path, {"tasks": {"input_timeout": "300ms"}}))
    async with aiohttp.ClientSession() as http:
        client = await Legacy(proxy.url(), http).open({"elicitation": {}})
        started = time.monotonic()
        async with client.call(5, "ask") as resp:
            events = await asyncio.wait_for(read_events(resp), 4)
        took = time.monotonic() - started
    question, cancelled, final = [json.loads(e.data) for e in events if e.data]
    assert question["method"] == "elicitation/create", question
    assert cancelled["method"] == "notifications/cancelled", cancelled
    assert cancelled["params"]["requestId"] == question["id"], cancelled
    assert "input timed out" in cancelled["params"]["reason"], cancelled
    assert final["id"] == 5 and "input timed out" in final["result"]["content"][0]["text"], final
    assert took < 3, took  # not the 5 s the upstream gives its question
    answers = [e["message"] for e in await upstream_log(upstream) if "method" not in e["message"]]
    assert answers[-1]["error"]["code"] == -32603, answers[-1]


async def test_a_question_the_client_did_not_declare_is_refused_upstream_not_relayed(
    upstream: str, proxy_url: str
) -> None:
    """An upstream that asks for elicitation a client never declared (2025-11-25 "Client
    Features"): the upstream gets -32601 at once, and the client never sees the question."""
    async with aiohttp.ClientSession() as http:
        client = await Legacy(proxy_url, http).open({})
        async with client.call(5, "ask") as resp:
            reply = await asyncio.wait_for(reply_of(resp), 4)
        # a capability declared as a bare `true` (as some clients write it) counts as declared
        lenient = await Legacy(proxy_url, http).open({"elicitation": True})
        async with lenient.call(6, "ask") as resp:
            asked = await asyncio.wait_for(next_message(iter_events(resp.content.iter_any())), 4)
    assert asked["method"] == "elicitation/create", asked
    text = reply["result"]["content"][0]["text"]
    assert "did not declare the elicitation capability" in text, reply
    answers = [e["message"] for e in await upstream_log(upstream) if "method" not in e["message"]]
    assert answers[-1]["error"]["code"] == -32601, answers[-1]


async def test_a_stdio_child_s_question_waits_input_timeout_and_needs_the_capability(
    tmp_path: Path, serve: Serve
) -> None:
    """In front of a stdio child the same: an unanswered question is answered to the child with
    the timeout's error (and withdrawn from the client), and a client without the capability is
    never asked."""
    proxy = await serve(stdio_config(tmp_path, {"tasks": {"input_timeout": "300ms"}}))
    async with aiohttp.ClientSession() as http:
        asked = await Legacy(proxy.url(), http).open({"elicitation": {}})
        async with asked.call(5, "confirm_delete", filename="a.txt") as resp:
            events = await asyncio.wait_for(read_events(resp), 5)
        messages = [json.loads(e.data) for e in events if e.data]
        assert [m.get("method") for m in messages[:2]] == ["elicitation/create", "notifications/cancelled"]
        assert messages[1]["params"]["requestId"] == messages[0]["id"], messages
        assert "input timed out" in json.dumps(messages[-1]), messages[-1]
        never = await Legacy(proxy.url(), http).open({})
        async with never.call(6, "confirm_delete", filename="b.txt") as resp:
            reply = await asyncio.wait_for(reply_of(resp), 5)
        assert "did not declare the elicitation capability" in json.dumps(reply), reply


async def test_a_retry_waiting_on_a_key_its_first_call_lets_go_runs_the_call_itself(
    tmp_path: Path, serve: Serve, capsys: pytest.CaptureFixture[str]
) -> None:
    """A retry that joined a keyed call still connecting, whose connection then times out (it
    never reached the upstream: the key lets go), runs the call itself rather than telling its
    client to send it again, as long as nothing went to that client yet."""
    with black_hole() as port:
        config = relay_config(
            f"http://127.0.0.1:{port}/mcp", tmp_path, {"connect_timeout": "400ms"}, sse_keepalive="5s"
        )
        proxy = await serve(config)
        async with aiohttp.ClientSession() as http:
            keyed = Legacy(proxy.url(), http).headers(**{"Idempotency-Key": "let-go-while-waiting"})

            async def call(rid: int) -> dict:
                async with http.post(
                    proxy.url(), json=call_body(rid, "echo", text="hi"), headers=keyed
                ) as resp:
                    return await reply_of(resp)

            with json_log(capsys) as lines:
                first = asyncio.ensure_future(call(1))
                await asyncio.sleep(0.15)  # the first holds the key, connecting
                retry = await call(2)
                await first
    assert retry["id"] == 2 and "unreachable" in retry["error"]["message"], retry  # its own attempt
    assert [line for line in lines if line["event"] == "call_joined"], lines  # it did wait on the first
