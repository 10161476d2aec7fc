"""A replica's SIGTERM drain and the writes its store has not taken yet: an outcome written while
Redis was out of reach is still in the replica's memory, and the drain waits for it to land (up to
`listen.drain_detached`) instead of exiting with it, which lost a finished call's result (and
re-ran an `on_restart: rerun` tool that had already run). The outage is a TCP relay between the
replica and a real redis-server that the test pauses."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest
from support.clients import ModernClient
from support.proxy import Serve, make_config
from support.redis_server import RedisServer
from support.relay import relay_to

from proxy.app import TASKS_KEY, drain
from proxy.config import ReplicasConfig

pytestmark = pytest.mark.redis


async def test_the_drain_waits_for_an_outcome_the_store_has_not_taken(
    legacy_url: str, tmp_path: Path, serve: Serve, redis_server: RedisServer, redis_prefix: str
) -> None:
    label = f"unwritten-{uuid.uuid4().hex[:8]}"
    async with relay_to(redis_server) as (relay, relayed_url):
        config = make_config(legacy_url, tmp_path, tasks={"detach_after": "50ms"})
        store = {"url": relayed_url, "prefix": redis_prefix, "timeout": "300ms", "lease": "6s"}
        config.store = type(config.store).model_validate(store)
        config.store.write_retry = 0.3
        config.replicas = ReplicasConfig(secret="s" * 32)
        config.listen.drain_detached = 20.0
        config.listen.drain_grace = 0.1
        proxy = await serve(config)
        tasks = proxy.app[TASKS_KEY]
        client = ModernClient(proxy.url())
        try:
            task_id = (await client.call("slow_compute", {"seconds": 0.5, "label": label})).result["taskId"]
            relay.pause()  # Redis out of reach: the call ends, and its outcome cannot be written
            async with asyncio.timeout(10):
                while tasks.pending_writes() == 0:
                    await asyncio.sleep(0.05)
            draining = asyncio.ensure_future(drain(proxy.app, asyncio.Event()))
            await asyncio.sleep(1.0)
            assert not draining.done()  # it drained at once before: nothing was live
            relay.resume()
            await asyncio.wait_for(draining, 15)
            assert tasks.pending_writes() == 0
            record = await tasks.store.get(task_id)
            assert record is not None and record.status.value == "completed", record
        finally:
            await client.close()
