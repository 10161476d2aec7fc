"""A task whose create is cut short never stays `working` with nothing behind it: not when its
client goes away meanwhile (its request cut between the detach deadline and the handle: the listener
cancels the handler on a close), and not when the store's reply is lost (the client is told the
task could not be created, and the store may hold it all the same). The creates are held by a TCP
relay between the proxy and a real redis-server."""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path

import pytest
import redis.asyncio
from support.clients import ModernClient
from support.proxy import make_config, running_proxy
from support.redis_server import RedisServer
from support.relay import relay_to
from support.v1_client import V1Client

from proxy.app import TASKS_KEY

pytestmark = pytest.mark.redis


async def test_a_call_whose_client_goes_away_while_its_task_is_created_still_ends_that_task(
    legacy_url: str, tmp_path: Path, redis_server: RedisServer, redis_prefix: str
) -> None:
    """Three calls detach while Redis is cut off (their creates held), and their clients go away:
    a plain 2026-07-28 call is cancelled upstream and its task, once committed, ends `failed`
    saying so; a call with an idempotency key goes on as its task and completes (a retry with the
    key gets its result); a v1 task request (started upstream only once its task exists) runs as
    its task. None stays `working`, none runs twice, and the proxy holds none of them after."""
    plain_label, keyed_label, v1_label = (
        f"{kind}-{uuid.uuid4().hex[:8]}" for kind in ("plain", "keyed", "v1")
    )
    key = f"key-{uuid.uuid4().hex[:8]}"
    async with relay_to(redis_server) as (relay, relayed_url):
        config = make_config(legacy_url, tmp_path, tasks={"detach_after": "2s"})
        store = {"url": relayed_url, "prefix": redis_prefix, "timeout": "5s", "lease": "20s"}
        config.store = type(config.store).model_validate(store)
        async with running_proxy(config) as proxy:
            tasks = proxy.app[TASKS_KEY]
            client = ModernClient(proxy.url())
            untasked = ModernClient(proxy.url(), capabilities={})
            v1 = V1Client(proxy.url())
            try:
                await client.warm_up()  # the upstream session, and the store's scripts loaded
                await v1.initialize()
                arguments = {"seconds": 3.5}
                keyed = {"headers": {"Idempotency-Key": key}}
                cut = [
                    asyncio.ensure_future(client.call("slow_compute", {**arguments, "label": plain_label})),
                    asyncio.ensure_future(
                        client.call("slow_compute", {**arguments, "label": keyed_label}, **keyed)
                    ),
                ]
                async with asyncio.timeout(5):  # both started upstream (the key claimed), not yet detached
                    while not {plain_label, keyed_label} <= set(await _log(untasked, "started_log")):
                        await asyncio.sleep(0.01)
                relay.pause()  # the cut: before their detach deadline, and before the v1 call's create
                cut.append(
                    asyncio.ensure_future(v1.call_as_task("slow_compute", {**arguments, "label": v1_label}))
                )
                async with asyncio.timeout(5):  # all three detaching, their creates held by the cut
                    while len(tasks.live) < 3:
                        await asyncio.sleep(0.01)
                labels = {task_id: call.params["arguments"]["label"] for task_id, call in tasks.live.items()}
                task_ids = list(labels)
                for request in cut:
                    request.cancel()  # the clients go away
                await asyncio.gather(*cut, return_exceptions=True)
                async with asyncio.timeout(5):  # the plain call's handler is gone: its cancel is upstream
                    while plain_label not in await _log(untasked, "cancelled_log"):
                        await asyncio.sleep(0.02)
                relay.resume()  # the creates land

                by_label = {label: await _ended(client, task_id) for task_id, label in labels.items()}
                assert by_label[plain_label]["status"] == "failed", by_label[plain_label]
                assert "closed the request stream" in json.dumps(by_label[plain_label]), by_label[plain_label]
                for label in (keyed_label, v1_label):
                    assert by_label[label]["status"] == "completed", by_label[label]
                retried = await client.call("slow_compute", {**arguments, "label": keyed_label}, **keyed)
                assert retried.result["content"][0]["text"] == f"computed {keyed_label} after 3.5s", (
                    retried.message
                )
                starts = await _log(untasked, "started_log")
                assert [starts[label] for label in (plain_label, keyed_label, v1_label)] == [1, 1, 1], starts
                assert not set(task_ids) & set(tasks.live), tasks.live
            finally:
                relay.resume()
                await client.close()
                await untasked.close()
                await v1.close()


async def _log(client: ModernClient, tool: str) -> dict:
    """The upstream's `started_log` (label -> starts) or the labels of its `cancelled_log`."""
    logged = json.loads((await client.call(tool, {})).result["content"][0]["text"])
    return {c["label"]: c for c in logged} if isinstance(logged, list) else logged


async def _ended(client: ModernClient, task_id: str) -> dict:
    """`tasks/get` of `task_id` once terminal (10 s at most); an unknown task is asked again while
    its create, just let through, may still be on its way to Redis."""
    async with asyncio.timeout(10):
        while True:
            reply = await client.get(task_id)
            if reply.message.get("result", {}).get("status") in ("completed", "failed", "cancelled"):
                return reply.result
            await asyncio.sleep(0.02)


async def test_a_v1_task_whose_create_reply_is_lost_ends_failed_and_never_runs(
    legacy_url: str, tmp_path: Path, redis_server: RedisServer, redis_prefix: str
) -> None:
    """A v1 task request (its call starts only once its task exists) of an `on_restart: rerun`
    tool: Redis commits the create, but its reply is held past `store.timeout` (500 ms), so the
    client gets the store's refusal and the call never starts. The record the store holds ends
    `failed` naming the refusal once the store answers again; nothing reaches the upstream, and
    the proxy holds nothing for it."""
    label = f"v1lost-{uuid.uuid4().hex[:8]}"
    async with relay_to(redis_server) as (relay, relayed_url):
        config = make_config(
            legacy_url, tmp_path, server={"tasks": {"tools": {"slow_compute": {"on_restart": "rerun"}}}}
        )
        store = {"url": relayed_url, "prefix": redis_prefix, "timeout": "500ms", "lease": "20s"}
        config.store = type(config.store).model_validate(store)
        async with running_proxy(config) as proxy, redis.asyncio.from_url(redis_server.url) as direct:
            tasks = proxy.app[TASKS_KEY]
            v1 = V1Client(proxy.url())
            untasked = ModernClient(proxy.url(), capabilities={})
            try:
                await v1.initialize()
                # scripts loaded (a warm-up label without `label` in it: its writes, the record's
                # `upstream_ref` among them, must not be what the relay pauses after)
                await v1.call_as_task(
                    "slow_compute", {"seconds": 0.1, "label": f"warm-{uuid.uuid4().hex[:8]}"}
                )
                before = set(await direct.keys(f"{redis_prefix}task:*"))
                relay.pause_after(label.encode())  # the create carries the call's arguments (to re-run it)
                params = {"name": "slow_compute", "arguments": {"seconds": 0.1, "label": label}, "task": {}}
                status, refused, _ = await v1.request("tools/call", params)
                assert status == 503 and "could not become a task" in refused["error"]["message"], refused
                (key,) = set(await direct.keys(f"{redis_prefix}task:*")) - before  # it landed all the same
                task_id = key.decode().rsplit(":", 1)[1]
                relay.resume()
                async with asyncio.timeout(10):
                    while True:
                        _, got, _ = await v1.request("tasks/get", {"taskId": task_id})
                        if got["result"]["status"] != "working":
                            break
                        await asyncio.sleep(0.05)
                assert got["result"]["status"] == "failed", got
                assert "could not become a task" in got["result"].get("statusMessage", ""), got
                assert label not in await _log(untasked, "started_log")
                assert task_id not in tasks.live
            finally:
                relay.resume()
                await v1.close()
                await untasked.close()
