"""`RelayStream.push` (legacy/replay.py): the pump writes an event into the client connection itself
while that connection's writer has sent everything and waits; otherwise it wakes the writer.
Either way every event reaches the client once, in order, and stays in the replay buffer."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable

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


async def test_pushed_events_reach_a_waiting_writer_once_each_in_order(aiohttp_client: Client) -> None:
    streams: list[RelayStream] = []
    wakes: list[int] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        stream = RelayStream(kind="post")
        streams.append(stream)

        async def pump() -> None:
            await asyncio.sleep(0)  # the writer reaches its wait first
            for n in range(1, 201):
                before = stream._wake
                await stream.push(_event(n))
                wakes.append(int(stream._wake is not before))
                if n % 50 == 0:
                    stream.append(_event(-n))  # a plain append between pushes (e.g. a v1 status)
                    await asyncio.sleep(0)
            stream.close()

        stream.feed(pump(), "test pump")
        return await _serve(request, stream)

    client = await aiohttp_client(web_app(handler))
    async with client.get("/") as resp:  # type: ignore[attr-defined]
        ids = await _ids(resp)
    stream = streams[0]
    assert ids == [stream.event_id(seq) for seq in range(1, 205)]  # 200 pushed + 4 appended, each once
    assert sum(wakes) < 20  # most pushes went out without waking the writer
    assert stream.replay_from(0) == (1, False)  # ... and all of them stayed in the replay buffer


async def test_a_paused_connection_gets_its_events_through_the_writer(aiohttp_client: Client) -> None:
    written: list[bool] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        stream = RelayStream(kind="post")

        async def pump() -> None:
            await asyncio.sleep(0)
            await stream.push(_event(1))
            written.append(stream._delivered == 1)
            request.protocol.pause_writing()  # as a transport does for a client that stopped reading
            await stream.push(_event(2))
            written.append(stream._delivered == 2)
            request.protocol.resume_writing()
            await asyncio.sleep(0.01)
            await stream.push(_event(3))
            stream.close()

        stream.feed(pump(), "test pump")
        return await _serve(request, stream)

    client = await aiohttp_client(web_app(handler))
    async with client.get("/") as resp:  # type: ignore[attr-defined]
        ids = await _ids(resp)
    assert written == [True, False]  # the second went through the woken writer
    assert [i.rpartition(":")[2] for i in ids] == ["1", "2", "3"]


async def test_a_resumption_replays_events_the_pump_wrote_directly(aiohttp_client: Client) -> None:
    stream_box: list[RelayStream] = []
    first_done = asyncio.Event()
    direct: list[int] = []

    async def first(request: web.Request) -> web.StreamResponse:
        stream = RelayStream(kind="post")
        stream_box.append(stream)

        async def pump() -> None:
            await asyncio.sleep(0)
            for n in range(1, 4):
                await stream.push(_event(n))
            direct.append(stream._delivered)  # 3: all three went out through the pump's own writes
            stream.cut()  # the connection drops; the stream goes on
            await first_done.wait()
            await stream.push(_event(4))
            stream.close()

        stream.feed(pump(), "test pump")
        return await _serve(request, stream)

    async def resume(request: web.Request) -> web.StreamResponse:
        stream = stream_box[0]
        return await _serve(request, stream, after=int(request.query["after"]))

    app = web_app(first)
    app.router.add_get("/resume", resume)
    client = await aiohttp_client(app)
    async with client.get("/") as resp:  # type: ignore[attr-defined]
        seen = await _ids(resp)
    assert [i.rpartition(":")[2] for i in seen] == ["1", "2", "3"] and direct == [3]
    first_done.set()
    async with client.get("/resume", params={"after": "1"}) as resp:  # type: ignore[attr-defined]
        resumed = await _ids(resp)
    assert [i.rpartition(":")[2] for i in resumed] == ["2", "3", "4"]


async def test_a_frame_past_the_write_room_goes_through_the_writer(aiohttp_client: Client) -> None:
    delivered: list[int] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        stream = RelayStream(kind="post")

        async def pump() -> None:
            await asyncio.sleep(0)
            await stream.push(_event(1))
            await stream.push(SseEvent("message", "x" * flow.ROOM_BYTES, None, None))  # no room for it
            delivered.append(stream._delivered)
            await asyncio.sleep(0.01)
            await stream.push(_event(3))
            delivered.append(stream._delivered)
            stream.close()

        stream.feed(pump(), "test pump")
        return await _serve(request, stream)

    client = await aiohttp_client(web_app(handler))
    async with client.get("/") as resp:  # type: ignore[attr-defined]
        ids = await _ids(resp)
    assert delivered == [1, 3]  # the big one went through the woken writer, the next directly again
    assert [i.rpartition(":")[2] for i in ids] == ["1", "2", "3"]


async def test_a_connection_taking_the_stream_over_gets_the_rest_and_the_old_one_nothing_more(
    aiohttp_client: Client,
) -> None:
    """A second connection takes the stream over (a client resuming while its first connection
    still waits, registered for direct writes): no event goes out on both."""
    box: list[RelayStream] = []
    second_waiting = asyncio.Event()
    first_read: asyncio.Future[list[str]] = asyncio.get_running_loop().create_future()

    async def first(request: web.Request) -> web.StreamResponse:
        stream = RelayStream(kind="post")
        box.append(stream)

        async def pump() -> None:
            await asyncio.sleep(0)
            for n in range(1, 6):
                await stream.push(_event(n))
            await second_waiting.wait()
            for n in range(6, 11):
                await stream.push(_event(n))
            stream.close()

        stream.feed(pump(), "test pump")
        return await _serve(request, stream)

    async def resume(request: web.Request) -> web.StreamResponse:
        stream = box[0]
        asyncio.get_running_loop().call_later(0.05, second_waiting.set)
        return await _serve(request, stream, after=int(request.query["after"]))

    app = web_app(first)
    app.router.add_get("/resume", resume)
    client = await aiohttp_client(app)
    async with client.get("/") as resp:  # type: ignore[attr-defined]
        first_ids: list[str] = []
        async for event in iter_events(resp.content.iter_any()):  # type: ignore[attr-defined]
            first_ids.append(event.id or "")
            if len(first_ids) == 5:
                async with client.get("/resume", params={"after": "3"}) as again:  # type: ignore[attr-defined]
                    second_ids = await _ids(again)
        first_read.set_result(first_ids)
    assert [i.rpartition(":")[2] for i in await first_read] == ["1", "2", "3", "4", "5"]
    assert [i.rpartition(":")[2] for i in second_ids] == [str(n) for n in range(4, 11)]


def web_app(handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.Application:
    app = web.Application()
    app.router.add_get("/", handler)
    return app
