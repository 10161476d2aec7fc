"""Change feeds that survive a Redis outage (issue "Reliability round 2", item 2): messages published
while a replica's pub/sub connection was down are lost, so once it is back every stream built on
the feed resyncs: a console stream gets `resync` (the page reloads its list), a
`subscriptions/listen` stream re-sends the status of its tasks. A real redis-server of the test's
own is killed and restarted under open streams."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest
import redis.asyncio as aioredis
from support.clients import TASKS_CAPS, ModernClient, envelope
from support.console import CONSOLE_TOKEN, console_config
from support.proxy import Serve, make_config
from support.redis_server import RedisServer
from support.relay import relay_to

from proxy.protocol.sse import iter_events

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


async def test_a_listen_stream_gets_the_status_a_cut_feed_lost(
    legacy_url: str, tmp_path: Path, serve: Serve, redis_server: RedisServer, redis_prefix: str
) -> None:
    """A `subscriptions/listen` stream on replica B follows a task running on replica A. B's link to
    Redis is held while the task completes, then cut (the message of the completion is lost with
    it): once B's feed is back, the stream re-reads its task and sends `completed`."""
    async with relay_to(redis_server) as (relay, relayed_url):
        configs = []
        for name, url in (("a", redis_server.url), ("b", relayed_url)):
            config = make_config(legacy_url, tmp_path / name)
            data = {"url": url, "prefix": redis_prefix, "timeout": "500ms", "lease": "10s"}
            config.store = type(config.store).model_validate(data)
            configs.append(config)
        a, b = [await serve(config) for config in configs]
        on_a, on_b = ModernClient(a.url()), ModernClient(b.url())
        label = f"gap-{uuid.uuid4().hex[:8]}"
        try:
            task_id = (await on_a.call("slow_compute", {"seconds": 0.5, "label": label})).result["taskId"]
            params = {"notifications": {"taskIds": [task_id]}, "_meta": envelope(TASKS_CAPS)}
            request = {"jsonrpc": "2.0", "id": "listen", "method": "subscriptions/listen", "params": params}
            body = json.dumps(request)
            headers = on_b.headers_for("subscriptions/listen", params)
            async with on_b.http.post(on_b.url, data=body, headers=headers) as resp:
                events = iter_events(resp.content.iter_any())
                assert resp.status == 200 and await anext(events)  # the acknowledgement
                relay.pause()
                assert (await on_a.wait_terminal(task_id))["status"] == "completed"
                relay.cut()
                relay.resume()
                async with asyncio.timeout(15):
                    async for event in events:
                        frame = json.loads(event.data) if event.data else {}
                        if frame.get("method") == "notifications/tasks":
                            if frame["params"]["status"] == "completed":
                                break
        finally:
            await on_a.close()
            await on_b.close()


async def test_a_listen_stream_gets_the_status_that_ended_while_redis_was_killed(
    legacy_url: str, tmp_path: Path, serve: Serve
) -> None:
    """Two replicas on a redis-server of the test's own (append-only, fsync always); a
    `subscriptions/listen` stream on replica B follows a task running on replica A. Redis is
    SIGKILLed while the task runs and restarted after it ended upstream: A records the outcome once
    Redis is back, and B's stream, whose feed was cut, sends `completed`."""
    redis = RedisServer(tmp_path / "redis", appendfsync="always").start()
    try:
        configs = []
        for name in ("a", "b"):
            config = make_config(legacy_url, tmp_path / name)
            data = {"url": redis.url, "prefix": "kill:", "timeout": "500ms", "lease": "10s"}
            config.store = type(config.store).model_validate(data)
            configs.append(config)
        a, b = [await serve(config) for config in configs]
        on_a, on_b = ModernClient(a.url()), ModernClient(b.url())
        label = f"kill-{uuid.uuid4().hex[:8]}"
        try:
            created = await on_a.call("slow_compute", {"seconds": 1.0, "label": label})
            task_id = created.result["taskId"]
            params = {"notifications": {"taskIds": [task_id]}, "_meta": envelope(TASKS_CAPS)}
            request = {"jsonrpc": "2.0", "id": "listen", "method": "subscriptions/listen", "params": params}
            headers = on_b.headers_for("subscriptions/listen", params)
            async with on_b.http.post(on_b.url, data=json.dumps(request), headers=headers) as resp:
                events = iter_events(resp.content.iter_any())
                assert resp.status == 200 and await anext(events)  # the acknowledgement
                port = redis.port
                redis.kill()
                await asyncio.sleep(1.5)  # the call ends upstream meanwhile; its outcome waits for Redis
                await asyncio.to_thread(redis.start, port=port)
                async with asyncio.timeout(20):
                    async for event in events:
                        frame = json.loads(event.data) if event.data else {}
                        if (
                            frame.get("method") == "notifications/tasks"
                            and frame["params"]["status"] == "completed"
                        ):
                            break
            assert (await on_a.wait_terminal(task_id))["status"] == "completed"
        finally:
            await on_a.close()
            await on_b.close()
    finally:
        redis.stop()
