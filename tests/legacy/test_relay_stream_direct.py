"""`RelayStream.push` (legacy/replay.py): the pump writes an event into the client connection itself
while that connection's writer has sent everything and waits; otherwise it wakes the writer.
Either way every event reaches the client once, in order, and stays in the replay buffer."""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import pytest
from aiohttp import web

from proxy.legacy.replay import RelayStream
from proxy.protocol.sse import SSE_HEADERS, SseEvent, iter_events
from proxy.runtime import flow

Client = Callable[..., Awaitable[object]]


def _event(n: int) -> SseEvent:
    return SseEvent("message", f'{{"n":{n}}}', None, None)


async def _serve(request: web.Request, stream: RelayStream, after: int = 0) -> web.StreamResponse:
    response = web.StreamResponse(headers=SSE_HEADERS)
    await response.prepare(request)
    direct = functools.partial(flow.write_without_waiting, request, response)
    async for frame in stream.frames(after, 30.0, stream.take_over(), direct):
        await response.write(frame)
    await response.write_eof()
    return response


async def _ids(resp: object) -> list[str]:
    return [event.id or "" async for event in iter_events(resp.content.iter_any())]  # type: ignore[attr-defined]


Pump = Callable[[web.Request, RelayStream], Coroutine[Any, Any, None]]


async def _one_stream(aiohttp_client: Client, pump: Pump) -> list[str]:
    """The event ids one client connection receives of a stream fed by `pump` (which gets the
    request and the stream, and must close it)."""
    client = await aiohttp_client(_resumable(pump))
    async with client.get("/") as resp:  # type: ignore[attr-defined]
        return await _ids(resp)


async def test_pushed_events_reach_a_waiting_writer_once_each_in_order(aiohttp_client: Client) -> None:
    wakes: list[int] = []
    kept: list[RelayStream] = []

    async def pump(_request: web.Request, stream: RelayStream) -> None:
        kept.append(stream)
        await asyncio.sleep(0)  # the writer reaches its wait first
        for n in range(1, 201):
            before = stream._wake
            await stream.push(_event(n))
            wakes.append(int(stream._wake is not before))
            if n % 50 == 0:
                stream.append(_event(-n))  # a plain append between pushes (e.g. a v1 status)
                await asyncio.sleep(0)
        stream.close()

    ids = await _one_stream(aiohttp_client, pump)
    assert _seqs(ids) == list(range(1, 205))  # 200 pushed + 4 appended, each once
    assert sum(wakes) < 20  # most pushes went out without waking the writer
    assert kept[0].replay_from(0) == (1, False)  # ... and all of them stayed in the replay buffer


@pytest.mark.parametrize("obstacle", ["paused", "no room"])
async def test_an_event_the_connection_cannot_take_now_goes_through_the_writer(
    aiohttp_client: Client, obstacle: str
) -> None:
    """The second event meets a connection paused for its client, or one too big for the write
    room: it wakes the writer instead; the third goes out directly again."""
    delivered: list[int] = []

    async def pump(request: web.Request, stream: RelayStream) -> None:
        await asyncio.sleep(0)
        await stream.push(_event(1))
        if obstacle == "paused":
            request.protocol.pause_writing()  # as a transport does for a client that stopped reading
            await stream.push(_event(2))
            request.protocol.resume_writing()
        else:
            await stream.push(SseEvent("message", "x" * flow.ROOM_BYTES, None, None))
        delivered.append(stream._delivered)
        await asyncio.sleep(0.01)  # the woken writer sends it and waits again
        await stream.push(_event(3))
        delivered.append(stream._delivered)
        stream.close()

    ids = await _one_stream(aiohttp_client, pump)
    assert delivered == [1, 3]
    assert _seqs(ids) == [1, 2, 3]


def _resumable(pump: Pump) -> web.Application:
    """`GET /` starts a stream fed by `pump` and serves it; `GET /resume?after=N` serves that stream
    again from event N (a resumption, or a second connection taking it over)."""
    streams: list[RelayStream] = []

    async def first(request: web.Request) -> web.StreamResponse:
        stream = RelayStream(kind="post")
        streams.append(stream)
        stream.feed(pump(request, stream), "test pump")
        return await _serve(request, stream)

    async def resume(request: web.Request) -> web.StreamResponse:
        return await _serve(request, streams[0], after=int(request.query["after"]))

    app = web_app(first)
    app.router.add_get("/resume", resume)
    return app


def _seqs(ids: list[str]) -> list[int]:
    return [int(i.rpartition(":")[2]) for i in ids]


async def test_a_resumption_replays_events_the_pump_wrote_directly(aiohttp_client: Client) -> None:
    first_done = asyncio.Event()
    direct: list[int] = []

    async def pump(_request: web.Request, stream: RelayStream) -> None:
        await asyncio.sleep(0)
        for n in range(1, 4):
            await stream.push(_event(n))
        direct.append(stream._delivered)  # 3: all three went out through the pump's own writes
        stream.cut()  # the connection drops; the stream goes on
        await first_done.wait()
        await stream.push(_event(4))
        stream.close()

    client = await aiohttp_client(_resumable(pump))
    async with client.get("/") as resp:  # type: ignore[attr-defined]
        seen = await _ids(resp)
    assert _seqs(seen) == [1, 2, 3] and direct == [3]
    first_done.set()
    async with client.get("/resume", params={"after": "1"}) as resp:  # type: ignore[attr-defined]
        resumed = await _ids(resp)
    assert _seqs(resumed) == [2, 3, 4]


async def test_a_connection_taking_the_stream_over_gets_the_rest_and_the_old_one_nothing_more(
    aiohttp_client: Client,
) -> None:
    """A second connection takes the stream over (a client resuming while its first connection
    still waits, registered for direct writes): no event goes out on both."""

    async def pump(_request: web.Request, stream: RelayStream) -> None:
        await asyncio.sleep(0)
        for n in range(1, 6):
            await stream.push(_event(n))
        while stream.owner < 2:  # the second connection's ticket
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # it sent 4 and 5 again from the buffer and waits, registered
        for n in range(6, 11):
            await stream.push(_event(n))
        stream.close()

    client = await aiohttp_client(_resumable(pump))
    first_ids: list[str] = []
    second_ids: list[str] = []
    async with client.get("/") as resp:  # type: ignore[attr-defined]
        async for event in iter_events(resp.content.iter_any()):  # type: ignore[attr-defined]
            first_ids.append(event.id or "")
            if len(first_ids) == 5:
                async with client.get("/resume", params={"after": "3"}) as again:  # type: ignore[attr-defined]
                    second_ids = await _ids(again)
    assert _seqs(first_ids) == [1, 2, 3, 4, 5]
    assert _seqs(second_ids) == list(range(4, 11))


def web_app(handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.Application:
    app = web.Application()
    app.router.add_get("/", handler)
    return app


async def test_a_client_too_slow_for_the_replay_buffer_is_told_what_it_lost(aiohttp_client: Client) -> None:
    """A connected client that reads so slowly that events leave the replay buffer before its
    connection can send them gets a `replay_gap` notice in their place, never a silent gap."""
    pumped = asyncio.Event()
    big = "x" * 64 * 1024

    async def first(request: web.Request) -> web.StreamResponse:
        stream = RelayStream(kind="post", server="slow", max_events=4)

        async def pump() -> None:
            for n in range(1, 201):  # 12.8 MB: more than the socket buffers hold for a client not reading
                await stream.push(SseEvent("message", f"{n} {big}", None, None))
                await asyncio.sleep(0)
            stream.close()
            pumped.set()

        stream.feed(pump(), "test pump")
        return await _serve(request, stream)

    client = await aiohttp_client(web_app(first))
    async with client.get("/") as resp:  # type: ignore[attr-defined]
        await asyncio.wait_for(pumped.wait(), 30)  # reading nothing meanwhile
        events = [event async for event in iter_events(resp.content.iter_any())]  # type: ignore[attr-defined]
    numbered = [int(e.data.split(" ", 1)[0]) for e in events if not e.data.startswith("{")]
    notices = [json.loads(e.data)["params"]["data"] for e in events if e.data.startswith("{")]
    assert len(notices) >= 1 and all(n["error"] == "replay_gap" for n in notices), notices
    assert numbered[-1] == 200 and len(numbered) + sum(n["lostEvents"] for n in notices) == 200
    assert numbered == sorted(set(numbered))  # in order, each once
