"""`limits.max_tasks_per_principal` across replicas (issue 27, item 9): the live tasks of a principal
are counted in the shared Redis store, so two replicas together admit no more than the cap, and
two creates racing for the last allowed task on different replicas never both win."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from support.clients import ModernClient, Reply
from support.proxy import RunningProxy, Serve, make_config
from support.records import make_record
from support.redis_server import RedisServer

from proxy.config import Config
from proxy.tasks.model import ANONYMOUS, Change, TaskStatus, principal_key, proxy_error
from proxy.tasks.redis_store import RedisTaskStore
from proxy.tasks.store import LiveLimitError

pytestmark = pytest.mark.redis


def replica(
    legacy_url: str,
    tmp_path: Path,
    redis_server: RedisServer,
    prefix: str,
    cap: int,
    server: dict | None = None,
) -> Config:
    config = make_config(legacy_url, tmp_path, server=server)
    config.store = type(config.store).model_validate({"url": redis_server.url, "prefix": prefix})
    config.limits.max_tasks_per_principal = cap
    return config


def refused_by_cap(reply: Reply) -> bool:
    return (
        reply.status == 429
        and reply.error["code"] == -32603
        and reply.error["data"]["limit"] == "max_tasks_per_principal"
        and "max_tasks_per_principal" in reply.error["message"]
    )


@contextlib.asynccontextmanager
async def two_replicas(
    serve: Serve,
    legacy_url: str,
    tmp_path: Path,
    redis_server: RedisServer,
    prefix: str,
    cap: int,
    server: dict | None = None,
) -> AsyncIterator[tuple[RunningProxy, RunningProxy, ModernClient, ModernClient]]:
    """Two replicas on one Redis with `max_tasks_per_principal` = `cap`, and a tasks client on each."""
    a, b = [
        await serve(replica(legacy_url, tmp_path / name, redis_server, prefix, cap, server)) for name in "ab"
    ]
    through_a, through_b = ModernClient(a.url()), ModernClient(b.url())
    try:
        yield a, b, through_a, through_b
    finally:
        await through_a.close()
        await through_b.close()


async def live_ids(proxy: RunningProxy) -> set[str]:
    return {record.task_id for record in await proxy.store.live_tasks()}


async def principal_live_set(proxy: RunningProxy) -> set[str]:
    """The store's `live:p` set of the (unauthenticated) principal: what the cap counts."""
    store = proxy.store
    members = await store.redis.smembers(store.keys.live_of(principal_key(ANONYMOUS)))
    return {m.decode() for m in members}


async def test_the_cap_counts_the_principals_tasks_on_every_replica(
    legacy_url: str, tmp_path: Path, serve: Serve, redis_server: RedisServer, redis_prefix: str
) -> None:
    async with two_replicas(serve, legacy_url, tmp_path, redis_server, redis_prefix, 2) as (
        a,
        b,
        through_a,
        through_b,
    ):
        first, second = [
            (await through_a.call("slow_compute", {"seconds": 3, "label": label})).result["taskId"]
            for label in ("first", "second")
        ]
        # At the cap on B (A's two count): started upstream, the call cannot become a task, so it
        # stays attached and is answered synchronously (a 429 after it ran would invite a second run).
        third = await through_b.call("slow_compute", {"seconds": 0.5, "label": "third"})
        assert third.status == 200 and third.result["resultType"] == "complete", third
        assert await live_ids(b) == {first, second}  # no third task
        cancelled = await through_b.request("tasks/cancel", {"taskId": first})  # ends on B, ran on A
        assert cancelled.status == 200 and (await through_b.get(first)).result["status"] == "cancelled"
        admitted = await through_b.call("slow_compute", {"seconds": 0.2, "label": "admitted"})
        assert admitted.result["resultType"] == "task", admitted
        assert (await through_b.wait_terminal(admitted.result["taskId"]))["status"] == "completed"
        await through_a.request("tasks/cancel", {"taskId": second})
        assert await live_ids(a) == set() and await principal_live_set(a) == set()


async def test_two_replicas_racing_for_the_last_allowed_task_admit_one(
    legacy_url: str, tmp_path: Path, serve: Serve, redis_server: RedisServer, redis_prefix: str
) -> None:
    async with two_replicas(serve, legacy_url, tmp_path, redis_server, redis_prefix, 1) as (
        a,
        b,
        through_a,
        through_b,
    ):
        replies = await asyncio.gather(
            through_a.call("slow_compute", {"seconds": 1, "label": "race-a"}),
            through_b.call("slow_compute", {"seconds": 1, "label": "race-b"}),
        )
        tasks = [r.result["taskId"] for r in replies if r.status == 200 and "taskId" in r.result]
        attached = [r for r in replies if r.status == 200 and r.result.get("resultType") == "complete"]
        assert len(tasks) == 1 and len(attached) == 1, replies  # the other stayed attached
        assert await live_ids(a) <= set(tasks)
        winner = through_a if "taskId" in replies[0].result else through_b
        await winner.request("tasks/cancel", {"taskId": tasks[0]})
        assert await principal_live_set(b) == set()


async def test_the_stores_count_follows_every_way_out_of_live_and_never_drifts_up(
    redis_server: RedisServer, redis_prefix: str
) -> None:
    a = RedisTaskStore(redis_server.url, prefix=redis_prefix)
    b = RedisTaskStore(redis_server.url, prefix=redis_prefix)
    counted = a.keys.live_of(principal_key("p"))
    try:
        await a.create(make_record(task_id="one", ttl_ms=50), max_live=2)
        await b.create(make_record(task_id="two"), max_live=2)
        await a.create(make_record(task_id="done", status=TaskStatus.COMPLETED), max_live=2)  # not live
        await b.create(make_record(task_id="elsewhere", principal="q"), max_live=2)  # another principal
        with pytest.raises(LiveLimitError) as refused:
            await b.create(make_record(task_id="three"), max_live=2)
        assert (refused.value.live, refused.value.max_live) == (2, 2)
        assert await a.get("three") is None and await a.count() == 4  # nothing written
        await a.create(make_record(task_id="uncapped"))  # no cap given: admitted (and counted)
        await a.update("uncapped", Change(status=TaskStatus.CANCELLED))  # an operator's cancel
        # The orphan sweep ending a lost node's task frees its place.
        lost = "the proxy replica running this call was lost"
        await b.update(
            "one",
            Change(status=TaskStatus.FAILED, outcome=proxy_error(lost), expect_owner="ghost"),
        )
        assert await a.redis.smembers(counted) == {b"two"}
        await b.create(make_record(task_id="three"), max_live=2)
        # A record lost outside the scripts (evicted, deleted by hand) does not hold a place forever.
        await a.redis.delete(a.keys.task("two"))
        await a.create(make_record(task_id="four"), max_live=2)
        assert await a.redis.smembers(counted) == {b"three", b"four"}
        for task_id in ("three", "four"):
            await a.update(task_id, Change(status=TaskStatus.COMPLETED))
        await asyncio.sleep(0.1)  # "one" (ttl 50 ms) expires
        assert await a.purge_expired() >= 1
        assert await a.redis.exists(counted) == 0  # an empty set leaves no key behind
    finally:
        await a.close()
        await b.close()


async def test_a_burst_of_creates_on_two_store_objects_admits_exactly_the_cap(
    redis_server: RedisServer, redis_prefix: str
) -> None:
    stores = [RedisTaskStore(redis_server.url, prefix=redis_prefix) for _ in range(2)]
    try:
        outcomes = await asyncio.gather(
            *(stores[i % 2].create(make_record(task_id=f"t{i}"), max_live=3) for i in range(40)),
            return_exceptions=True,
        )
        assert sum(o is None for o in outcomes) == 3
        assert all(isinstance(o, LiveLimitError) for o in outcomes if o is not None), outcomes
        assert len(await stores[0].live_tasks()) == 3
    finally:
        for store in stores:
            await store.close()


async def test_a_required_tool_at_the_cap_on_another_replica_never_reaches_the_upstream(
    legacy_url: str, tmp_path: Path, serve: Serve, redis_server: RedisServer, redis_prefix: str
) -> None:
    """The early refusal of a `mode: required` tool reads the shared count: a principal holding the
    cap's task on replica A is refused on replica B before B starts the call upstream."""
    required = {"tasks": {"tools": {"slow_compute": {"mode": "required"}}}}
    label = f"early-{redis_prefix[-6:]}"
    async with two_replicas(serve, legacy_url, tmp_path, redis_server, redis_prefix, 1, required) as (
        _,
        _,
        through_a,
        through_b,
    ):
        held = (await through_a.call("slow_compute", {"seconds": 3, "label": "held"})).result["taskId"]
        refused = await through_b.call("slow_compute", {"seconds": 0.1, "label": label})
        assert refused_by_cap(refused), refused
        started = await through_b.call("started_log", {})
        assert label not in started.result["content"][0]["text"]  # never sent upstream
        await through_a.request("tasks/cancel", {"taskId": held})
