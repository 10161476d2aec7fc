"""`ModernReply.relay` (front/endpoint.py): an upstream reader writes a notification to the client
itself only when that cannot wait for the client: the reply is an SSE stream already, its connection
is not paused for a slow client, and the frame leaves the write buffer under ROOM_BYTES.
Otherwise it answers False and the handler's own `notify` (which may wait) sends it."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import aiohttp
from aiohttp import web

from proxy.front.endpoint import ModernReply
from proxy.protocol import jsonrpc
from proxy.protocol.sse import iter_events
from proxy.runtime.flow import ROOM_BYTES


def _progress(n: int, message: str = "") -> dict:
    return jsonrpc.notification(
        "notifications/progress", {"progressToken": "t", "progress": n, "message": message}
    )


async def test_relay_writes_only_into_a_started_stream_with_room(
    aiohttp_client: Callable[..., Awaitable[object]],
) -> None:
    answers: list[object] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        reply = ModernReply(request)
        answers.append(await reply.relay(_progress(1)))  # not SSE yet: the handler's to send
        await reply.notify(_progress(2))  # starts the stream
        answers.append(await reply.relay(_progress(3)))
        answers.append(await reply.relay(_progress(4, "x" * ROOM_BYTES)))  # no room for it
        request.protocol.pause_writing()  # as a transport does for a client that stopped reading
        answers.append(await reply.relay(_progress(5)))
        request.protocol.resume_writing()
        answers.append(await reply.relay(_progress(6)))
        return await reply.finish(jsonrpc.response(1, {}))

    app = web.Application()
    app.router.add_post("/", handler)
    client = await aiohttp_client(app)
    async with client.post("/", data=b"{}") as resp:  # type: ignore[attr-defined]
        assert resp.status == 200
        events = [jsonrpc.loads(event.data) async for event in iter_events(resp.content.iter_any())]
    assert answers == [False, True, False, False, True]
    assert [e.get("params", {}).get("progress") for e in events] == [2, 3, 6, None]


async def test_relay_refuses_a_closed_connection(aiohttp_client: Callable[..., Awaitable[object]]) -> None:
    done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()

    async def handler(request: web.Request) -> web.StreamResponse:
        reply = ModernReply(request)
        await reply.notify(_progress(1))
        assert request.transport is not None
        request.transport.close()
        done.set_result(await reply.relay(_progress(2)))
        return reply.stream or web.Response()

    app = web.Application()
    app.router.add_post("/", handler)
    client = await aiohttp_client(app)
    try:
        async with client.post("/", data=b"{}") as resp:  # type: ignore[attr-defined]
            await resp.read()
    except aiohttp.ClientError:
        pass
    assert await asyncio.wait_for(done, timeout=5) is False
