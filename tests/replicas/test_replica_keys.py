"""Idempotency keys across replicas (issue "A retried call never runs twice"): the key's slot is in
the shared Redis store, so two replicas receiving the same key at the same instant start one call,
and a retry that lands on another replica joins the call where it runs."""

from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from pathlib import Path

import pytest
from support.clients import ModernClient, envelope
from support.proxy import Serve, make_config
from support.redis_server import RedisServer
from support.servers import ROOT

from proxy.config import Config

sys.path.insert(0, str(ROOT))
from scripts.cluster import Cluster  # noqa: E402

pytestmark = pytest.mark.redis

KEY = "Idempotency-Key"


def replica(legacy_url: str, tmp_path: Path, redis_server: RedisServer, prefix: str) -> Config:
    config = make_config(legacy_url, tmp_path)
    config.store = type(config.store).model_validate({"url": redis_server.url, "prefix": prefix})
    return config


async def test_one_key_on_two_replicas_at_once_starts_one_call(
    legacy_url: str, tmp_path: Path, serve: Serve, redis_server: RedisServer, redis_prefix: str
) -> None:
    a, b = [await serve(replica(legacy_url, tmp_path / name, redis_server, redis_prefix)) for name in "ab"]
    through_a, through_b = ModernClient(a.url()), ModernClient(b.url())
    plain_b = ModernClient(b.url(), capabilities={})
    try:
        for round_ in range(5):
            label, key = f"race-{round_}-{uuid.uuid4().hex[:6]}", uuid.uuid4().hex
            arguments = {"seconds": 0.3, "label": label}
            replies = await asyncio.gather(
                through_a.call("slow_compute", arguments, headers={KEY: key}),
                through_b.call("slow_compute", arguments, headers={KEY: key}),
            )
            task_ids = {reply.result["taskId"] for reply in replies}
            assert len(task_ids) == 1, [reply.message for reply in replies]
            (task_id,) = task_ids
            waited = await plain_b.call("slow_compute", arguments, headers={KEY: key})  # while it runs
            assert waited.result["content"][0]["text"] == f"computed {label} after 0.3s"
            assert (await through_b.wait_terminal(task_id))["status"] == "completed"
            started = json.loads((await plain_b.call("started_log", {})).result["content"][0]["text"])
            assert started[label] == 1
    finally:
        for client in (through_a, through_b, plain_b):
            await client.close()


@pytest.mark.haproxy
async def test_a_call_haproxy_cut_is_retried_with_its_key_and_runs_once(legacy_url: str) -> None:
    """Real HAProxy in front of two replicas, cutting a request that waits 1 s for a byte
    (`timeout server 1s`): a plain keyed call that runs 4 s gets HAProxy's 504; the client retries
    with the same key on the other replica while the call still runs there, joins it and gets its
    result when it ends; the upstream ran it once."""
    label, key = f"cut-{uuid.uuid4().hex[:6]}", uuid.uuid4().hex
    settings = {"MCP_LEASE": "2s", "MCP_STDIO_DISABLED": "true", "MCP_DETACH_AFTER": "50ms"}
    with Cluster(upstream_url=legacy_url, replicas=2, settings=settings, timeout_server="1s") as cluster:
        client = ModernClient(cluster.url + "/servers/web/mcp", capabilities={})
        try:
            arguments = {"seconds": 4, "label": label}
            params = {"name": "slow_compute", "arguments": arguments, "_meta": envelope({})}
            body = {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": params}
            headers = {**client.headers_for("tools/call", params), KEY: key}
            sent = time.monotonic()
            async with client.http.post(client.url, json=body, headers=headers) as cut:
                assert cut.status == 504, await cut.text()  # HAProxy's own page
            async with asyncio.timeout(2):  # the replica notices its client went (HAProxy closed it)
                while not (
                    ran_on := [i for i in range(2) if '"status":499' in cluster.log_path(i).read_text()]
                ):
                    await asyncio.sleep(0.05)
            assert len(ran_on) == 1, ran_on  # the replica whose client HAProxy cut
            other = 1 - ran_on[0]
            client.url = cluster.replica_urls[other] + "/servers/web/mcp"
            retried_at = time.monotonic()
            assert retried_at - sent < 3.5  # the call still runs upstream
            retried = await client.call("slow_compute", arguments, headers={KEY: key})
            assert retried.result["content"][0]["text"] == f"computed {label} after 4s", retried.message
            assert time.monotonic() - retried_at > 0.3  # it waited for the running call
            assert "call_joined" in cluster.log_path(other).read_text()
            started = json.loads((await client.call("started_log", {})).result["content"][0]["text"])
            assert started[label] == 1
        finally:
            await client.close()
