"""Idle legacy sessions expire on replicas too (issue "Reliability round 2", item 5): the replica
that held one also removes it from the replicas' session map, so no other replica adopts it later
(whatever the upstream did with its DELETE)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from support.proxy import Serve, make_config
from support.redis_server import RedisServer
from support.v1_client import V1Client

from proxy.config import ReplicasConfig

pytestmark = pytest.mark.redis


async def test_an_expired_session_leaves_the_replicas_session_map(
    legacy_url: str, tmp_path: Path, serve: Serve, redis_server: RedisServer, redis_prefix: str
) -> None:
    config = make_config(legacy_url, tmp_path)
    config.store = type(config.store).model_validate({"url": redis_server.url, "prefix": redis_prefix})
    config.replicas = ReplicasConfig(secret="s" * 32, advertise="http://127.0.0.1:{port}")
    config.listen.legacy_session_idle = 0.3
    proxy = await serve(config)
    client = V1Client(proxy.url())
    try:
        await client.initialize()
        key = f"session:legacy:{client.sid}"
        assert await proxy.store.session_get(key) is not None  # recorded for the other replicas
        async with asyncio.timeout(5):
            while await proxy.store.session_get(key) is not None:
                await asyncio.sleep(0.05)
        status, _, _ = await client.request("tools/list")
        assert status == 404
    finally:
        await client.close()
