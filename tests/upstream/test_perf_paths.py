"""Hot-path changes of issue "Performance" that must not change behaviour: the JSON codec writes the
bytes `json` wrote and reads the values `json` read, and a modern call's upstream connection goes
back to the pool (one TCP connection for many calls, not one per call)."""

from __future__ import annotations

import asyncio
import json
import math
import secrets
from pathlib import Path

import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st
from support.clients import ModernClient
from support.proxy import Serve, make_config

from proxy.protocol import jsonrpc
from proxy.protocol.sse import EventTooLargeError, ReaderEvents, SseEvent, SseParser, iter_events

JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=400, deadline=None)
@given(JSON_VALUES)
def test_codec_writes_and_reads_what_json_did(value: object) -> None:
    expected = json.dumps(value, separators=(",", ":")).encode()
    assert jsonrpc.dumps(value) == expected
    assert jsonrpc.dumps_str(value) == expected.decode()
    assert jsonrpc.loads(expected) == json.loads(expected)
    assert jsonrpc.loads(expected.decode()) == json.loads(expected)
    assert jsonrpc.loads(bytearray(expected)) == json.loads(expected)


def test_codec_writes_every_ascii_character_as_json_did() -> None:
    """Found by the property test above: DEL (0x7f) is escaped by json, written raw by orjson."""
    every = "".join(chr(c) for c in range(128))
    value = {every: [every, {c: c for c in every}]}
    assert jsonrpc.dumps(value) == json.dumps(value, separators=(",", ":")).encode()


@pytest.mark.parametrize(
    "value",
    [
        {"taskId": "a1b2c3d4e5f6", "n": 1e-07, "m": [2.5e16, "4e5", ":4e5", "[1e5"]},
        {"id": "4e5f", "progress": 17, "total": 200.0},
        [1e-07],
        1e16,
        -2.5e-9,
        {"s": "12345678901234567890123", "n": 12345678901234567890123, "m": -12345678901234567890},
        [-9300000000000000001, -9223372036854775808, -9223372036854775809, 18446744073709551616],
        [0.00001, "0.00001", 10.00001],
    ],
)
def test_codec_tells_numbers_from_strings_that_look_like_them(value: object) -> None:
    """Hex ids and digit runs inside strings take the fast path; the numbers beside them do not."""
    expected = json.dumps(value, separators=(",", ":")).encode()
    assert jsonrpc.dumps(value) == expected
    for raw in (expected, json.dumps(value, indent=1).encode(), json.dumps(value)):
        parsed = jsonrpc.loads(raw)
        assert parsed == json.loads(raw) and json.dumps(parsed) == json.dumps(json.loads(raw))


@pytest.mark.parametrize(
    "raw",
    [
        b'{"a":NaN,"b":[Infinity,-Infinity]}',
        b"[1e400]",
        b'"\\ud800"',
        b"123456789012345678901234567890",
        b'{"x":"\\u00e9\xc3\xa9"}',
        b"[1e-07,0.00001,1e16,2.5e-9]",
        b"\xef\xbb\xbf{}",
    ],
)
def test_codec_edge_cases_round_trip_as_json(raw: bytes) -> None:
    value = jsonrpc.loads(raw)
    plain = json.loads(raw)
    assert jsonrpc.dumps(value) == json.dumps(plain, separators=(",", ":")).encode()
    if isinstance(plain, list) and plain and isinstance(plain[0], float) and math.isinf(plain[0]):
        assert isinstance(value[0], float) and math.isinf(value[0])


@pytest.mark.parametrize("raw", [b"{", b"\xff", b"", b"[1,]", b'{"a":1}x'])
def test_codec_refuses_what_json_refused_with_its_message(raw: bytes) -> None:
    with pytest.raises(ValueError) as ours:
        jsonrpc.loads(raw)
    with pytest.raises(ValueError) as theirs:
        json.loads(raw)
    assert type(ours.value) is type(theirs.value) and str(ours.value) == str(theirs.value)


async def _counting_upstream() -> tuple[web.AppRunner, str, list[int]]:
    """A legacy upstream whose SSE replies end a moment after the response event (as the SDK
    server's do), recording the client port of every tools/call."""
    ports: list[int] = []

    async def mcp(request: web.Request) -> web.StreamResponse:
        if request.method != "POST":
            # no standalone stream; DELETE ends the session
            return web.Response(status=405 if request.method == "GET" else 200)
        body = await request.json()
        if "id" not in body:
            return web.Response(status=202)
        if body["method"] == "initialize":
            result = {
                "protocolVersion": "2025-11-25",
                "capabilities": {"tools": {}},
                "serverInfo": {"name": "count", "version": "1"},
            }
            return web.json_response(
                {"jsonrpc": "2.0", "id": body["id"], "result": result},
                headers={"Mcp-Session-Id": secrets.token_hex(8)},
            )
        if body["method"] == "tools/list":
            return web.json_response(
                {
                    "jsonrpc": "2.0",
                    "id": body["id"],
                    "result": {"tools": [{"name": "greet", "inputSchema": {"type": "object"}}]},
                }
            )
        ports.append(request.transport.get_extra_info("peername")[1])
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        msg = {
            "jsonrpc": "2.0",
            "id": body["id"],
            "result": {"content": [{"type": "text", "text": "hi"}], "isError": False},
        }
        await resp.write(b"event: message\ndata: " + json.dumps(msg).encode() + b"\n\n")
        await asyncio.sleep(0.02)  # the end of the stream comes after the response
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_route("*", "/mcp", mcp)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}/mcp", ports


async def test_modern_calls_reuse_the_upstream_connection(tmp_path: Path, serve: Serve) -> None:
    runner, url, ports = await _counting_upstream()
    try:
        proxy = await serve(make_config(url, tmp_path / "store", tasks={"detach_after": "5s"}))
        client = ModernClient(proxy.url())
        try:
            for _ in range(6):
                assert (await client.call("greet")).result["content"][0]["text"] == "hi"
                await asyncio.sleep(0.05)  # the previous stream has ended and its connection is idle
        finally:
            await client.close()
        await proxy.stop()
        # The pool may hold a few connections (opened by the session's start-up requests), but the
        # later calls run on connections used before: none opens a new one.
        assert len(ports) == 6 and set(ports[3:]) <= set(ports[:3]), f"client ports of the 6 calls: {ports}"
    finally:
        await runner.cleanup()


class _Chunks:
    """A byte source with aiohttp StreamReader's `readany()` (b"" at the end)."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = list(chunks)

    async def readany(self) -> bytes:
        return self.chunks.pop(0) if self.chunks else b""

    async def iter_any(self):  # type: ignore[no-untyped-def]
        while chunk := await self.readany():
            yield chunk


async def _both(chunks: list[bytes], limit: int | None) -> tuple[list[object], list[object]]:
    out = []
    for read in (
        lambda c: ReaderEvents(c, max_event_bytes=limit),
        lambda c: iter_events(c.iter_any(), max_event_bytes=limit),
    ):
        got: list[object] = []
        try:
            async for event in read(_Chunks(chunks)):
                got.append(event)
        except EventTooLargeError as exc:
            got.append(str(exc))
        out.append(got)
    return out[0], out[1]


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.sampled_from(
            [
                b"data: a",
                b"\n",
                b"\r\n",
                b"id: 7\n",
                b"retry: 30\n",
                b"event: x\n",
                b": c\n",
                b"data: " + b"z" * 40,
            ]
        ),
        max_size=30,
    ),
    st.integers(1, 7),
    st.sampled_from([None, 64]),
)
def test_reader_events_match_iter_events(parts: list[bytes], size: int, limit: int | None) -> None:
    """Held call streams read through ReaderEvents (no async generator): same events, same end,
    same too-large error after the events of that chunk, however the bytes are split."""
    raw = b"".join(parts)
    chunks = [raw[i : i + size] for i in range(0, len(raw), size)]
    a, b = asyncio.run(_both(chunks, limit))
    assert a == b


def _parse(chunks: list[bytes]) -> list[SseEvent]:
    parser = SseParser()
    events = [event for chunk in chunks for event in parser.feed(chunk)[0]]
    return events + parser.end()


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.sampled_from(
            [b"data: a", b"\n", b"\r\n", b"id: 7\n", b"retry: 3x\n", b"event: x\n", b":c\n", b"data:\xc3\xa9"]
        ),
        max_size=30,
    ),
    st.integers(1, 7),
)
def test_sse_events_do_not_depend_on_how_the_bytes_are_split(parts: list[bytes], size: int) -> None:
    raw = b"".join(parts)
    assert _parse([raw[i : i + size] for i in range(0, len(raw), size)]) == _parse([raw])


def test_sse_parser_knows_when_the_bytes_stop_inside_an_event() -> None:
    parser = SseParser()
    for chunk, inside in (
        (b"event: message\n", True),
        (b'data: {"id"', True),
        (b": 1}\n", True),
        (b"\n", False),  # dispatched
        (b": keepalive\n\n", False),
        (b"da", True),
    ):
        parser.feed(chunk)
        assert parser.mid_event is inside, chunk


def test_sse_parser_reads_fields_comments_and_split_characters() -> None:
    chunks = [b": hi\r\nevent: up\r\nid: 4\nretry: 25\ndata: one\ndata:two\ndata: \xc3", b"\xa9\n", b"\r\n"]
    assert _parse(chunks) == [SseEvent("up", "one\ntwo\n\u00e9", "4", 25)]
    assert _parse([b"data: \xff\n\n", b"retry: \xd9\xa3\ndata: x\n"]) == [
        SseEvent("message", "\ufffd", None, None),
        SseEvent("message", "x", None, None),  # a non-ASCII digit is no retry
    ]
    assert _parse([b"retry: " + b"9" * 5000 + b"\ndata: y\n\n"]) == [SseEvent("message", "y", None, None)]
