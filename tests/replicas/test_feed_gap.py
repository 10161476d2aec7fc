"""Change feeds that survive a Redis outage (issue "Reliability round 2", item 2): messages published
while a replica's pub/sub connection was down are lost, so once it is back every stream built on
the feed resyncs: a console stream gets `resync` (the page reloads its list), a
`subscriptions/listen` stream re-sends the status of its tasks. A real redis-server of the test's
own is killed and restarted under open streams."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest
import redis.asyncio as aioredis
from support.console import CONSOLE_TOKEN, console_config
from support.proxy import Serve
from support.redis_server import RedisServer

pytestmark = pytest.mark.redis


async def _kill_and_restart(redis: RedisServer) -> None:
    port = redis.port
    redis.kill()
    await asyncio.sleep(1.5)  # the feed notices (its reads time out) and retries
    await asyncio.to_thread(redis.start, port=port)


async def _drop_subscribers(redis: RedisServer) -> None:
    client = aioredis.from_url(redis.url)
    try:
        assert await client.client_kill_filter(_type="pubsub") >= 1
    finally:
        await client.aclose()


@pytest.mark.parametrize(
    "outage",
    [_kill_and_restart, _drop_subscribers],
    ids=["redis-killed-and-restarted", "subscriber-dropped-and-back-at-once"],
)
async def test_a_console_stream_resyncs_after_the_change_feed_was_cut(
    legacy_url: str, tmp_path: Path, serve: Serve, outage: Callable[[RedisServer], Awaitable[None]]
) -> None:
    """Redis killed for 1.5 s and restarted; or Redis dropping the pub/sub connection (as it does a
    subscriber past its output buffer limit) while redis-py re-subscribes on its own at once. Either
    way messages in between are lost, so the console stream resyncs."""
    redis = RedisServer(tmp_path / "redis", appendonly=False).start()
    try:
        store = {"url": redis.url, "prefix": "gap:", "timeout": "500ms", "lease": "5s"}
        proxy = await serve(console_config(legacy_url, store, listen={"sse_keepalive": "200ms"}))
        headers = {"Authorization": f"Bearer {CONSOLE_TOKEN}"}
        async with aiohttp.ClientSession() as http:
            async with http.get(proxy.base + "/console/api/events", headers=headers) as stream:
                await stream.content.readuntil(b"event: ready")
                await outage(redis)
                async with asyncio.timeout(15):
                    await stream.content.readuntil(b"event: resync")
    finally:
        redis.stop()
