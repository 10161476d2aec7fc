"""The Redis task store beyond the contract suite (tests/test_store.py): config, persistence
warnings, secrets that never leak, Redis going away, state shared by two proxies on one Redis
(change events, MRTR single use, rate counters), and a detached call end to end. Every test runs
against a real redis-server on a loopback port (tests/redis_server.py)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
import yaml
from support.clients import TASKS_CAPS, ModernClient, envelope
from support.proxy import Serve
from support.records import make_record
from support.redis_server import RedisServer, free_port
from support.relay import relay_to
from support.servers import ROOT
from support.v1_client import V1Client

from proxy.cli.check_config import describe
from proxy.config import Config, ConfigError, config_from_data
from proxy.protocol.sse import iter_events
from proxy.tasks.model import Change, TaskStatus
from proxy.tasks.redis_store import RedisTaskStore
from proxy.tasks.store import LeaseLapsedError, StoreUnavailableError

pytestmark = pytest.mark.redis

ACCEPT = {"action": "accept", "content": {"confirm": True}}


def redis_config(legacy_url: str, url: str, prefix: str, **tasks: str) -> Config:
    """A one-server config on a Redis store with test-sized timings."""
    return config_from_data(
        {
            "store": {"url": url, "prefix": prefix, "timeout": "2s", "lease": "1s", "write_retry": "200ms"},
            "tasks": {"detach_after": "50ms", "ttl": "10m", "poll_interval": "100ms", **tasks},
            "mcpServers": {"legacy": {"url": legacy_url}},
        }
    )


async def readyz(base: str) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as http, http.get(f"{base}/readyz") as resp:
        return resp.status, await resp.json()


# -- config ---------------------------------------------------------------------------------------


def test_store_url_is_an_alternative_to_path(legacy_url: str) -> None:
    config = redis_config(legacy_url, "rediss://:pw@cache.example:6380/2", "p:")
    assert config.store.redis and config.store.where == "rediss://cache.example:6380/2"
    assert "pw" not in describe(config, "x.yaml")
    # diskcache stays the default
    assert not config_from_data({"mcpServers": {"s": {"url": "http://127.0.0.1:1/mcp"}}}).store.redis
    for store, problem in (
        ({"url": "redis://h:1/0", "path": "/tmp/x"}, "not both"),
        ({"url": "http://h:1/0"}, "redis://"),
        ({"url": "redis://h:1/zero"}, "database number"),
        ({"url": "redis://h:99999/0"}, "not a valid URL"),
    ):
        with pytest.raises(ConfigError) as caught:
            config_from_data({"store": store, "mcpServers": {"s": {"url": "http://127.0.0.1:1/mcp"}}})
        assert problem in str(caught.value), (store, caught.value)


# -- persistence ----------------------------------------------------------------------------------


async def test_persistence_off_is_warned_and_a_refused_config_get_is_said(
    tmp_path: Path, legacy_url: str, capsys: pytest.CaptureFixture[str], serve: Serve
) -> None:
    with RedisServer(tmp_path / "off", appendonly=False).start() as off:
        store = RedisTaskStore(off.url)
        try:
            level, text = await store.persistence_report()
            assert level == "warning" and "persistence is off" in text and "lost when Redis restarts" in text
        finally:
            await store.close()
        capsys.readouterr()
        _proxy = await serve(redis_config(legacy_url, off.url, "warn:"))
        await _proxy.stop()
        logs = capsys.readouterr()
        warned = [line for line in (logs.out + logs.err).splitlines() if "store_persistence" in line]
        assert len(warned) == 1 and "warning" in warned[0] and "persistence is off" in warned[0], logs
    with RedisServer(
        tmp_path / "always", appendfsync="always", extra=("--rename-command", "CONFIG", "")
    ).start() as hidden:
        store = RedisTaskStore(hidden.url)
        try:
            level, text = await store.persistence_report()
            assert level == "warning" and "could not check" in text
        finally:
            await store.close()
    with RedisServer(tmp_path / "fsync", appendfsync="always").start() as durable:
        store = RedisTaskStore(durable.url)
        try:
            assert await store.persistence_report() == (
                "info",
                f"task store {store.where}: Redis appendonly yes, appendfsync always: a Redis crash loses "
                f"nothing acknowledged",
            )
        finally:
            await store.close()


async def test_with_appendfsync_always_a_committed_task_survives_a_redis_crash(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "crash", appendfsync="always").start()
    try:
        store = RedisTaskStore(server.url, timeout_s=1)
        await store.create(make_record(task_id="kept"))
        await store.update("kept", Change(status=TaskStatus.COMPLETED, outcome={"result": {"n": 1}}))
        server.kill()
        with pytest.raises(StoreUnavailableError):
            await store.get("kept")
        server.start(port=server.port)
        record = await store.get("kept")
        assert (
            record is not None
            and record.status is TaskStatus.COMPLETED
            and record.outcome == {"result": {"n": 1}}
        )
        await store.close()
    finally:
        server.stop()


# -- secrets and failures -------------------------------------------------------------------------


async def test_a_password_from_the_environment_never_leaks_and_redis_down_is_503_with_readyz_saying_why(
    tmp_path: Path,
    legacy_url: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    serve: Serve,
) -> None:
    secret = "pw-" + "s3cr3t" * 4
    server = RedisServer(tmp_path / "auth", password=secret).start()
    monkeypatch.setenv("TEST_REDIS_PASSWORD", secret)
    try:
        config = config_from_data(
            {
                "store": {
                    "url": f"redis://:${{TEST_REDIS_PASSWORD}}@127.0.0.1:{server.port}/0",
                    "timeout": "1s",
                    "write_retry": "200ms",
                },
                "tasks": {"detach_after": "50ms", "poll_interval": "100ms"},
                "mcpServers": {"legacy": {"url": legacy_url}},
            }
        )
        assert config.store.url is not None and secret in config.store.url
        wrong = RedisTaskStore(f"redis://:wrong-{secret}@127.0.0.1:{server.port}/0", timeout_s=1)
        with pytest.raises(StoreUnavailableError) as refused:
            await wrong.count()
        assert secret not in str(refused.value) and f"127.0.0.1:{server.port}" in str(refused.value)
        await wrong.close()
        proxy = await serve(config)
        client = ModernClient(proxy.url())
        try:
            task_id = (await client.call("slow_compute", {"seconds": 0.2, "label": "r"})).result["taskId"]
            assert (await client.wait_terminal(task_id))["status"] == "completed"
            status, ready = await readyz(proxy.base)
            assert status == 200 and ready["checks"]["store"] == "ok"
            server.stop()
            reply = await client.get(task_id)
            assert reply.status == 503 and reply.error["code"] == -32603, reply.message
            assert f"127.0.0.1:{server.port}" in reply.error["message"] and secret not in json.dumps(
                reply.message
            )
            status, ready = await readyz(proxy.base)
            assert (
                status == 503
                and ready["checks"]["store"].startswith("failed")
                and "Connection" in ready["checks"]["store"]
            )
            assert secret not in json.dumps(ready)
            # The call started upstream, then could not become a task: it stays attached and is
            # answered synchronously (a 503 would make a load balancer run it again).
            attached = await client.call("slow_compute", {"seconds": 0.2, "label": "down"})
            assert (
                attached.status == 200 and attached.result["content"][0]["text"] == "computed down after 0.2s"
            ), attached.message
            assert secret not in json.dumps(attached.message)
            server.start(port=server.port)
            assert (await readyz(proxy.base))[0] == 200
            assert (await client.get(task_id)).result["status"] == "completed"  # AOF kept it
        finally:
            await client.close()
        await proxy.stop()
    finally:
        server.stop()
    logs = capsys.readouterr()
    assert secret not in logs.out + logs.err
    assert "store_persistence" in logs.out + logs.err


# -- two proxies, one Redis -----------------------------------------------------------------------


async def test_a_redis_that_hangs_gets_a_readyz_reason_naming_the_wait(
    legacy_url: str, redis_server: RedisServer, redis_prefix: str, serve: Serve
) -> None:
    """A Redis that accepts and then says nothing (here a paused relay; `kill -STOP` alike): /readyz
    is 503 naming the bound it waited for. It said `"failed: "`: the check's own timeout carries
    no text."""
    async with relay_to(redis_server) as (relay, relayed_url):
        proxy = await serve(redis_config(legacy_url, relayed_url, redis_prefix))  # store.timeout 2 s
        assert (await readyz(proxy.base))[0] == 200
        relay.pause()
        try:
            status, ready = await readyz(proxy.base)
        finally:
            relay.resume()
    assert status == 503 and ready["checks"]["store"] == "failed: no answer within 1.5 s", ready


async def test_changes_of_one_store_object_reach_the_others_listeners_and_waits(
    redis_server: RedisServer, redis_prefix: str
) -> None:
    a, b = (
        RedisTaskStore(redis_server.url, prefix=redis_prefix),
        RedisTaskStore(redis_server.url, prefix=redis_prefix),
    )
    local_a, local_b, remote_b = [], [], []
    a.add_listener(lambda before, r: local_a.append((before, r.version)))
    b.add_listener(lambda before, r: local_b.append((before, r.version)))
    b.add_remote_listener(lambda before, r: remote_b.append((before, r.task_id, r.version, r.status)))
    try:
        await asyncio.wait_for(b.feed.subscribed.wait(), 5)
        record = make_record(task_id="x")
        await a.create(record)
        waiter = asyncio.create_task(b.wait_for_change("x", 1, timeout_s=5))
        await asyncio.sleep(0.05)
        # too big to travel inline
        await a.update("x", Change(status=TaskStatus.COMPLETED, outcome={"result": {"big": "y" * 100_000}}))
        changed = await asyncio.wait_for(waiter, 2)
        assert changed.version == 2 and changed.status is TaskStatus.COMPLETED
        async with asyncio.timeout(2):
            while len(remote_b) < 2:
                await asyncio.sleep(0.01)
        assert remote_b == [
            (None, "x", 1, TaskStatus.WORKING),
            (TaskStatus.WORKING, "x", 2, TaskStatus.COMPLETED),
        ]
        # metrics count each change once
        assert local_a == [(None, 1), (TaskStatus.WORKING, 2)] and local_b == []
        await b.create(make_record(task_id="y"))
        assert remote_b[-1] == (None, "y", 1, TaskStatus.WORKING)  # its own commits at once
    finally:
        await a.close()
        await b.close()


async def test_a_task_owned_by_a_node_whose_lease_lapsed_is_never_committed(
    redis_server: RedisServer, redis_prefix: str
) -> None:
    """A leased create of a live record is refused while its owner's lease is absent (nothing
    written: other replicas would take it for an orphan at once), and committed once it is renewed;
    a terminal record and an unleased create need no lease."""
    store = RedisTaskStore(redis_server.url, prefix=redis_prefix)
    try:
        with pytest.raises(LeaseLapsedError, match="lease of node back-from-a-cut has lapsed"):
            await store.create(make_record(task_id="orphan-at-birth", owner="back-from-a-cut"), leased=True)
        assert await store.get("orphan-at-birth") is None
        assert await store.live_tasks() == []
        await store.renew_lease("back-from-a-cut", 5000)
        await store.create(make_record(task_id="leased", owner="back-from-a-cut"), leased=True)
        done = make_record(task_id="done", owner="gone", status=TaskStatus.COMPLETED, outcome={"result": {}})
        await store.create(done, leased=True)
        await store.create(make_record(task_id="unleased", owner="gone"))
        assert sorted(r.task_id for r in await store.live_tasks()) == ["leased", "unleased"]
    finally:
        await store.close()


async def test_another_principals_task_is_refused_inside_redis_without_reading_its_record(
    redis_server: RedisServer, redis_prefix: str
) -> None:
    """Redis compares the record's owner field with the asker's, so a foreign id costs what an
    unknown one does whatever the record's size: here the record itself is unreadable, and only its
    owner finds out. A record written before the owner field existed is still checked (read whole)."""
    store = RedisTaskStore(redis_server.url, prefix=redis_prefix)
    try:
        await store.create(make_record(task_id="theirs", principal="p", server="s"))
        await store.redis.hset(store.keys.task("theirs"), "d", "not json")
        assert await store.get_for("theirs", "someone-else", "s") == (None, True)
        assert await store.get_for("theirs", "p", "other-server") == (None, True)
        assert await store.get_for("unknown", "p", "s") == (None, False)
        with pytest.raises(ValueError):
            await store.get_for("theirs", "p", "s")
        await store.create(make_record(task_id="older", principal="p", server="s"))
        await store.redis.hdel(store.keys.task("older"), "o")  # as stored before the field existed
        assert await store.get_for("older", "someone-else", "s") == (None, True)
        found, foreign = await store.get_for("older", "p", "s")
        assert found is not None and found.task_id == "older" and not foreign
    finally:
        await store.close()


async def test_mrtr_state_used_on_one_replica_is_refused_on_the_other(
    legacy_url: str, redis_server: RedisServer, redis_prefix: str, serve: Serve
) -> None:
    a = await serve(redis_config(legacy_url, redis_server.url, redis_prefix))
    b = await serve(redis_config(legacy_url, redis_server.url, redis_prefix))
    on_a, on_b = (
        ModernClient(a.url(), capabilities={"elicitation": {}}),
        ModernClient(b.url(), capabilities={"elicitation": {}}),
    )
    try:
        args = {"filename": "replica.txt"}
        first = (await on_a.call("confirm_delete", args)).result
        key = next(iter(first["inputRequests"]))
        retry = {
            "name": "confirm_delete",
            "arguments": args,
            "inputResponses": {key: ACCEPT},
            "requestState": first["requestState"],
        }
        # both replicas share the signing key; the call is parked on A
        elsewhere = await on_b.request("tools/call", retry)
        assert elsewhere.error["code"] == -32602 and "does not belong" in elsewhere.error["message"]
        assert (await on_a.request("tools/call", retry)).result["content"][0]["text"] == "deleted replica.txt"
        for client in (on_b, on_a):
            replay = await client.request("tools/call", retry)
            assert replay.error["code"] == -32602 and "already used" in replay.error["message"], (
                replay.message
            )
    finally:
        await on_a.close()
        await on_b.close()


async def test_the_tasks_rate_is_counted_in_redis_across_two_proxies(
    legacy_url: str, redis_server: RedisServer, redis_prefix: str, serve: Serve
) -> None:
    configs = [redis_config(legacy_url, redis_server.url, redis_prefix) for _ in range(2)]
    for config in configs:
        config.limits.tasks_rate = "3/minute"
    a = await serve(configs[0])
    b = await serve(configs[1])
    on_a, on_b = ModernClient(a.url()), ModernClient(b.url())
    try:
        replies = [
            await on_a.get("whatever"),
            await on_b.get("whatever"),
            await on_a.get("whatever"),
            await on_b.get("whatever"),
        ]
        assert [r.status for r in replies] == [400, 400, 400, 429]
        assert replies[3].error["data"]["limit"] == "tasks_rate"
    finally:
        await on_a.close()
        await on_b.close()


async def test_a_detached_call_on_one_replica_is_read_listed_and_waited_on_from_the_other(
    legacy_url: str, redis_server: RedisServer, redis_prefix: str, tmp_path: Path, serve: Serve
) -> None:
    a = await serve(redis_config(legacy_url, redis_server.url, redis_prefix))
    b = await serve(redis_config(legacy_url, redis_server.url, redis_prefix))
    on_a, on_b = ModernClient(a.url()), ModernClient(b.url())
    try:
        created = (await on_a.call("slow_compute", {"seconds": 0.4, "label": "shared"})).result
        assert created["resultType"] == "task"
        task_id = created["taskId"]
        assert (await on_b.get(task_id)).result["status"] == "working"
        done = await on_b.wait_terminal(task_id)
        assert (
            done["status"] == "completed"
            and done["result"]["content"][0]["text"] == "computed shared after 0.4s"
        )
        assert a.store.where == f"redis://127.0.0.1:{redis_server.port}/0"
    finally:
        await on_a.close()
        await on_b.close()
    await b.stop()
    await a.stop()
    config_file = tmp_path / "proxy.yaml"
    config_file.write_text(
        yaml.safe_dump(
            {
                "store": {"url": redis_server.url, "prefix": redis_prefix},
                "mcpServers": {"legacy": {"url": legacy_url}},
            }
        )
    )
    listing = subprocess.run(
        [sys.executable, "-m", "proxy", "tasks", "--config", str(config_file), "list"],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=ROOT,
    )
    assert listing.returncode == 0 and task_id in listing.stdout and "completed" in listing.stdout, listing


async def test_a_v1_client_on_one_replica_is_pushed_the_end_of_a_task_running_on_the_other(
    legacy_url: str, redis_server: RedisServer, redis_prefix: str, serve: Serve
) -> None:
    a = await serve(redis_config(legacy_url, redis_server.url, redis_prefix))
    b = await serve(redis_config(legacy_url, redis_server.url, redis_prefix))
    on_a, on_b = V1Client(a.url()), V1Client(b.url())
    try:
        await on_a.initialize()
        await on_b.initialize()
        task = await on_a.call_as_task("slow_compute", {"seconds": 0.5, "label": "pushed"})
        status, message, notes = await on_b.request("tasks/result", {"taskId": task["taskId"]})
        assert status == 200 and message["result"]["content"][0]["text"] == "computed pushed after 0.5s", (
            message
        )
        assert [n["params"]["status"] for n in notes if n["method"] == "notifications/tasks/status"][-1:] == [
            "completed"
        ], notes
    finally:
        await on_a.close()
        await on_b.close()


async def test_a_listen_stream_on_one_replica_is_pushed_the_changes_of_a_task_running_on_the_other(
    legacy_url: str, redis_server: RedisServer, redis_prefix: str, serve: Serve
) -> None:
    a = await serve(redis_config(legacy_url, redis_server.url, redis_prefix))
    b = await serve(redis_config(legacy_url, redis_server.url, redis_prefix))
    on_a, on_b = ModernClient(a.url()), ModernClient(b.url())
    try:
        task_id = (await on_a.call("slow_compute", {"seconds": 0.5, "label": "listened"})).result["taskId"]
        params = {"notifications": {"taskIds": [task_id]}, "_meta": envelope(TASKS_CAPS)}
        body = json.dumps(
            {"jsonrpc": "2.0", "id": "listen-b", "method": "subscriptions/listen", "params": params}
        )
        statuses: list[str] = []
        async with on_b.http.post(
            on_b.url, data=body, headers=on_b.headers_for("subscriptions/listen", params)
        ) as resp:
            assert resp.status == 200
            async with asyncio.timeout(5):
                async for event in iter_events(resp.content.iter_any()):
                    frame = json.loads(event.data) if event.data else {}
                    if frame.get("method") == "notifications/tasks":
                        statuses.append(frame["params"]["status"])
                        if frame["params"]["status"] == "completed":
                            break
        assert statuses[-1] == "completed", statuses  # pushed by B from A's commit (nothing on B polls)
    finally:
        await on_a.close()
        await on_b.close()


def test_a_proxy_whose_redis_is_unreachable_exits_naming_the_store_without_its_password(
    legacy_url: str, tmp_path: Path
) -> None:
    port = free_port()  # nothing listens there
    config_file = tmp_path / "proxy.yaml"
    config_file.write_text(
        yaml.safe_dump(
            {
                "store": {"url": f"redis://:hunter2-secret@127.0.0.1:{port}/0", "timeout": "1s"},
                "mcpServers": {"legacy": {"url": legacy_url}},
            }
        )
    )
    started = subprocess.run(
        [sys.executable, "-m", "proxy", "--config", str(config_file), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert started.returncode == 1, started
    assert (
        f"task store redis://127.0.0.1:{port}/0" in started.stderr
        and "hunter2" not in started.stderr + started.stdout
    ), started.stderr
