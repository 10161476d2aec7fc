"""`proxy.upstream.pooling.shed_headers` (issue 16): a reply stream a detached call holds for hours
keeps none of its header maps, aiohttp's C parser's header-pair lists included, and its connection
still serves the next request with whole headers once the stream ends."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web
from support.servers import served_app

from proxy.upstream.pooling import shed_headers


@pytest.fixture
async def sse_server() -> AsyncIterator[tuple[str, asyncio.Event, list[object]]]:
    """A server whose POST answers an SSE stream with a few headers: one event, then (once `go`
    is set) a second and the end. `peers` records each request's client port."""
    go = asyncio.Event()
    peers: list[object] = []

    async def stream(request: web.Request) -> web.StreamResponse:
        peers.append(request.transport.get_extra_info("peername")[1] if request.transport else None)
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Mcp-Session-Id": "s-1", "X-Upstream": "one"}
        )
        await resp.prepare(request)
        await resp.write(b"data: first\n\n")
        await asyncio.wait_for(go.wait(), 10)
        await resp.write(b"data: second\n\n")
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/", stream)
    async with served_app(app) as port:
        yield f"http://127.0.0.1:{port}/", go, peers


def _header_pair_lists(resp: aiohttp.ClientResponse) -> list[list]:
    parser = resp._protocol._parser  # type: ignore[attr-defined]
    return [
        held
        for held in gc.get_referents(parser)
        if type(held) is list and held and all(type(p) is tuple and len(p) == 2 for p in held)
    ]


async def test_a_held_reply_keeps_no_header_maps_and_its_connection_serves_the_next_request_whole(
    sse_server,
) -> None:
    url, go, peers = sse_server
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as http:
        resp = await http.post(url, data=b"{}")
        assert resp.headers["X-Upstream"] == "one"
        # aiohttp's C parser holds the head's pairs while the body is read
        c_parser = bool(_header_pair_lists(resp))
        shed_headers(resp)
        assert _header_pair_lists(resp) == [] and len(resp.headers) == 0
        assert await resp.content.readuntil(b"\n\n") == b"data: first\n\n"
        go.set()
        assert await resp.content.read() == b"data: second\n\n"
        resp.release()
        again = await http.post(url, data=b"{}")  # the same connection (limit=1), a new message on it
        assert again.headers["Content-Type"] == "text/event-stream" and again.headers["X-Upstream"] == "one"
        assert again.headers["Mcp-Session-Id"] == "s-1"
        assert await again.content.read() == b"data: first\n\ndata: second\n\n"
        again.release()
    assert len(peers) == 2 and peers[0] == peers[1]
    if not c_parser:
        pytest.skip(
            "aiohttp runs its pure-Python parser here (AIOHTTP_NO_EXTENSIONS): no parser lists to shed; the "
            "rest held"
        )


async def test_a_reply_whose_body_ended_is_left_to_its_connection(sse_server) -> None:
    """Once a reply's body has ended, aiohttp has given its connection back and the parser may be
    reading another reply's head: shed_headers must not touch the parser's lists then."""
    url, go, _peers = sse_server
    go.set()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as http:
        resp = await http.post(url, data=b"{}")
        assert await resp.content.read() == b"data: first\n\ndata: second\n\n"
        parser = resp._protocol._parser if resp._protocol is not None else None  # type: ignore[attr-defined]
        held = [list(x) for x in gc.get_referents(parser) if type(x) is list] if parser is not None else []
        shed_headers(resp)
        assert (
            [list(x) for x in gc.get_referents(parser) if type(x) is list] if parser is not None else []
        ) == held
        resp.release()
