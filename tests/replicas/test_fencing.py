"""Fencing (issue "Reliability round 2", item 3): a replica cut off from Redis past its lease stops
its detached calls before its lease lapses, so when another replica re-runs them (`on_restart:
rerun`) the call never runs on two replicas at once. The partition is a TCP relay between one
replica and a real redis-server that the test pauses; the upstream counts its starts and cancels."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from pathlib import Path

import pytest
import redis.asyncio
from prometheus_client import REGISTRY
from support.clients import ModernClient
from support.proxy import Serve, make_config
from support.redis_server import RedisServer
from support.relay import TcpRelay, relay_to

from proxy.app import TASKS_KEY
from proxy.config import Config

pytestmark = pytest.mark.redis

LEASE = "1s"


def replica(
    legacy_url: str,
    tmp_path: Path,
    url: str,
    prefix: str,
    lease: str = LEASE,
    timeout: str = "500ms",
    on_restart: str = "rerun",
) -> Config:
    config = make_config(
        legacy_url, tmp_path, server={"tasks": {"tools": {"slow_compute": {"on_restart": on_restart}}}}
    )
    data = {"url": url, "prefix": prefix, "timeout": timeout, "lease": lease}
    config.store = type(config.store).model_validate(data)
    return config


async def _log(client: ModernClient, tool: str, **arguments: object) -> object:
    return json.loads((await client.call(tool, arguments)).result["content"][0]["text"])


async def _cancels(client: ModernClient, label: str) -> list[dict]:
    """The upstream's record of the cancels it received for the calls labelled `label`."""
    return [c for c in await _log(client, "cancelled_log") if c["label"] == label]  # type: ignore[union-attr]


def _fence_counts() -> tuple[float | None, float | None]:
    """(`…_fences_total`, `…_fenced_calls_total`) of this process, where `serve` runs the proxies
    (read from the registry: `/metrics` also reads the store, which a cut holds)."""
    return (
        REGISTRY.get_sample_value("mcp_tasks_proxy_fences_total"),
        REGISTRY.get_sample_value("mcp_tasks_proxy_fenced_calls_total"),
    )


async def _cancelled_before_the_rerun(plain: ModernClient, relay: TcpRelay, label: str) -> list[dict]:
    """Wait (10 s at most) for the second upstream run of `label` (another replica's re-run), heal
    the cut, and check that the upstream had the first run's one cancel before that re-run started;
    returns the cancels."""
    async with asyncio.timeout(10):
        while (await _log(plain, "started_log")).get(label, 0) < 2:  # type: ignore[union-attr]
            await asyncio.sleep(0.05)
    starts = (await _log(plain, "started_log", times=True))[label]  # type: ignore[index]
    cancels = await _cancels(plain, label)
    relay.resume()
    assert len(cancels) == 1 and cancels[0]["at"] < starts[1], (cancels, starts)
    return cancels


async def test_a_replica_cut_off_from_redis_stops_its_calls_before_another_reruns_them(
    legacy_url: str, tmp_path: Path, serve: Serve, redis_server: RedisServer, redis_prefix: str
) -> None:
    label = f"fence-{uuid.uuid4().hex[:8]}"
    async with relay_to(redis_server) as (relay, relayed_url):
        cut_off = await serve(replica(legacy_url, tmp_path / "a", relayed_url, redis_prefix))
        survivor = await serve(replica(legacy_url, tmp_path / "b", redis_server.url, redis_prefix))
        client = ModernClient(cut_off.url())
        plain = ModernClient(survivor.url(), capabilities={})
        try:
            task_id = (await client.call("slow_compute", {"seconds": 3, "label": label})).result["taskId"]
            relay.pause()  # the partition: the first replica can no longer renew its lease
            started = time.monotonic()
            through_cut_off = await client.get(task_id)
            waited = time.monotonic() - started
            assert through_cut_off.status == 503 and waited < 0.8, waited  # store.timeout 500 ms, in all
            # the last renewal that reached Redis (its value: the wall clock, ms), read past the cut
            lease_key = f"{redis_prefix}node:{cut_off.app[TASKS_KEY].node}"
            async with redis.asyncio.from_url(redis_server.url) as direct:
                renewed_ms = int(await direct.get(lease_key))
            lapses_at = renewed_ms / 1000 + 1.0  # LEASE
            cancels = await _cancelled_before_the_rerun(plain, relay, label)
            # the fence came with room to spare: a quarter of the lease before it lapsed, less the
            # cancel's way to the upstream (a fence a sixth before, less a twelfth, fails this)
            assert lapses_at - cancels[0]["at"] > 0.15, (lapses_at, cancels)
            client.url = survivor.url()
            done = await client.wait_terminal(task_id, timeout=10)
            assert (
                done["status"] == "completed" and f"computed {label}" in done["result"]["content"][0]["text"]
            )
        finally:
            await client.close()
            await plain.close()


async def test_a_replica_back_from_a_lapsed_lease_renews_it_before_committing_a_new_task(
    legacy_url: str, tmp_path: Path, serve: Serve, redis_server: RedisServer, redis_prefix: str
) -> None:
    """A replica whose lease lapsed (cut off from Redis past it; here its lease key is deleted, and
    its next renewal is a second away with a 6 s lease) renews the lease before it commits a task
    it owns: committed without, the task would be an orphan at birth, which another replica's sweep
    re-runs while this one runs it too."""
    back = await serve(replica(legacy_url, tmp_path, redis_server.url, redis_prefix, lease="6s"))
    client = ModernClient(back.url())
    lease_key = f"{redis_prefix}node:{back.app[TASKS_KEY].node}"
    try:
        async with redis.asyncio.from_url(redis_server.url) as direct:
            for _ in range(3):
                assert await direct.delete(lease_key) == 1
                label = f"back-{uuid.uuid4().hex[:8]}"
                created = await client.call("slow_compute", {"seconds": 0.3, "label": label})
                assert "taskId" in created.result, created.result
                assert await direct.exists(lease_key) == 1  # renewed before the commit
    finally:
        await client.close()


async def test_a_call_whose_task_is_being_created_when_the_fence_comes_is_stopped_too(
    legacy_url: str, tmp_path: Path, serve: Serve, redis_server: RedisServer, redis_prefix: str
) -> None:
    """A call detaching while its replica is cut off from Redis: its create waits on the store
    (timeout 3 s) while the fence comes (3/4 of the 1 s lease). The create may still land (here the
    relay holds it and delivers it once the cut heals: the record then exists, owned by the cut-off
    replica, and is re-run as an orphan), so the fence stops this call as it stops a task's: the
    client gets -32800 naming the lease, and the upstream never runs the call twice at once."""
    label = f"creating-{uuid.uuid4().hex[:8]}"
    async with relay_to(redis_server) as (relay, relayed_url):
        config = replica(legacy_url, tmp_path / "a", relayed_url, redis_prefix, timeout="3s")
        cut_off = await serve(config)
        other = await serve(replica(legacy_url, tmp_path / "b", redis_server.url, redis_prefix))
        plain = ModernClient(other.url(), capabilities={})
        client = ModernClient(cut_off.url())
        try:
            relay.pause()
            answer = await client.call("slow_compute", {"seconds": 5, "label": label})
            relay.resume()
            assert answer.error["code"] == -32800 and "renew its lease" in answer.error["message"], answer
            cancels = await _cancels(plain, label)
            assert len(cancels) == 1, cancels
            await asyncio.sleep(2.5)  # room for the landed create's re-run to start
            starts = (await _log(plain, "started_log", times=True))[label]  # type: ignore[index]
            assert all(start > cancels[0]["at"] for start in starts[1:]), (starts, cancels)
        finally:
            await client.close()
            await plain.close()


async def test_a_call_whose_create_landed_but_whose_reply_the_cut_holds_is_stopped_at_the_fence(
    legacy_url: str, tmp_path: Path, serve: Serve, redis_server: RedisServer, redis_prefix: str
) -> None:
    """The cut falls between a task's create and its reply: Redis has committed the record (owned by
    the cut-off replica), and the replica still waits for the reply (store.timeout 3 s). Its lease
    lapses a second after the last renewal that landed, and another replica re-runs the task then;
    so the fence stops the call at once, not when the create gives up: the upstream gets the cancel
    before the re-run starts. (A chaos run once saw the two runs overlap by 0.55 s.)"""
    label = f"landed-{uuid.uuid4().hex[:8]}"
    async with relay_to(redis_server) as (relay, relayed_url):
        cut_off = await serve(replica(legacy_url, tmp_path / "a", relayed_url, redis_prefix, timeout="3s"))
        other = await serve(replica(legacy_url, tmp_path / "b", redis_server.url, redis_prefix))
        plain = ModernClient(other.url(), capabilities={})
        client = ModernClient(cut_off.url())
        try:
            # a first task loads the store's scripts: the held reply must be the create's own
            warm = await client.call(
                "slow_compute", {"seconds": 0.1, "label": f"warm-{uuid.uuid4().hex[:8]}"}
            )
            assert "taskId" in warm.result, warm.result
            assert (await client.wait_terminal(warm.result["taskId"], timeout=5))["status"] == "completed"
            async with redis.asyncio.from_url(redis_server.url) as direct:
                before = set(await direct.keys(f"{redis_prefix}task:*"))
                relay.pause_after(label.encode())  # the create carries the call's arguments (to re-run it)
                call = asyncio.ensure_future(client.call("slow_compute", {"seconds": 5, "label": label}))
                async with asyncio.timeout(5):  # the create landed; its reply, and all after it, is held
                    while not set(await direct.keys(f"{redis_prefix}task:*")) - before:
                        await asyncio.sleep(0.01)
            await _cancelled_before_the_rerun(plain, relay, label)
            answer = await asyncio.wait_for(call, timeout=10)
            # the create's reply, once through, hands the task out; or it gave up and the call is fenced
            assert "taskId" in (answer.result or {}) or (
                answer.error["code"] == -32800 and "renew its lease" in answer.error["message"]
            ), answer
        finally:
            await client.close()
            await plain.close()


async def test_a_call_that_ended_while_its_task_was_being_created_keeps_its_outcome_past_the_fence(
    legacy_url: str, tmp_path: Path, serve: Serve, redis_server: RedisServer, redis_prefix: str
) -> None:
    """The cut holds a task's create (store.timeout 5 s) and the call ends upstream meanwhile; the
    fence comes (3 s lease) and stops nothing (`…_fenced_calls_total` stays); the cut heals before
    the lease lapses and the create lands: the task reads the call's result, and nobody runs the
    call again."""
    label = f"ended-{uuid.uuid4().hex[:8]}"
    async with relay_to(redis_server) as (relay, relayed_url):
        config = replica(legacy_url, tmp_path, relayed_url, redis_prefix, lease="3s", timeout="5s")
        cut_off = await serve(config)
        client = ModernClient(cut_off.url())
        plain = ModernClient(cut_off.url(), capabilities={})  # reaches the upstream, not the store
        try:
            fences, fenced_calls = _fence_counts()
            relay.pause()
            call = asyncio.ensure_future(client.call("slow_compute", {"seconds": 0.3, "label": label}))
            async with asyncio.timeout(5):
                while _fence_counts()[0] == fences:
                    await asyncio.sleep(0.05)
            relay.resume()
            assert await _cancels(plain, label) == []
            assert _fence_counts()[1] == fenced_calls  # it stopped no call
            answer = await asyncio.wait_for(call, timeout=10)
            done = await client.wait_terminal(answer.result["taskId"], timeout=10)
            assert done["status"] == "completed", done
            assert done["result"]["content"][0]["text"] == f"computed {label} after 0.3s", done
            assert (await _log(plain, "started_log"))[label] == 1  # type: ignore[index]
        finally:
            await client.close()
            await plain.close()


async def test_a_call_declared_lost_during_a_cut_is_cancelled_by_the_replica_that_took_its_task(
    legacy_url: str, tmp_path: Path, serve: Serve, redis_server: RedisServer, redis_prefix: str
) -> None:
    """A call of a tool with the `fail` policy is not fenced (a whole-Redis outage must not end every
    call): it runs on while its replica is cut off, until another replica declares its task lost
    and sends the upstream its cancel, on the cut-off replica's upstream session (the task failed:
    its call is of no use). Before, it ran on until its replica was back and cancelled it at its
    first lease renewal, and an upstream whose caller died for good ran it to its end."""
    label = f"healed-{uuid.uuid4().hex[:8]}"
    async with relay_to(redis_server) as (relay, relayed_url):
        cut_off = await serve(
            replica(legacy_url, tmp_path / "a", relayed_url, redis_prefix, on_restart="fail")
        )
        other = await serve(
            replica(legacy_url, tmp_path / "b", redis_server.url, redis_prefix, on_restart="fail")
        )
        client = ModernClient(cut_off.url())
        plain = ModernClient(other.url(), capabilities={})
        try:
            task_id = (await client.call("slow_compute", {"seconds": 8, "label": label})).result["taskId"]
            relay.pause()
            client.url = other.url()
            lost = await client.wait_terminal(task_id, timeout=10)
            declared = time.time()
            assert lost["status"] == "failed" and "lost" in json.dumps(lost), lost
            async with asyncio.timeout(5):
                while not (cancels := await _cancels(plain, label)):
                    await asyncio.sleep(0.05)
            assert cancels[0]["reason"] == "notifications/cancelled", cancels
            assert cancels[0]["at"] - declared < 1.0, (declared, cancels)  # its own replica is still cut off
            relay.resume()
        finally:
            await client.close()
            await plain.close()
