"""The requests in flight (`runtime.running`): each request's entry gets what `bind` binds in its own
task and in the tasks it starts, never another request's fields, and leaves the list when it ends;
a task that outlives its request writes nothing more."""

from __future__ import annotations

import asyncio

import structlog

from proxy.runtime.running import RunningRequests, bind


async def test_each_request_has_its_own_entry_and_a_task_it_started_writes_there_only_while_it_runs() -> None:
    running = RunningRequests()
    gate = asyncio.Event()
    outlived = asyncio.Event()
    started: list[asyncio.Task[None]] = []
    entries = []

    async def call(request_id: str, tool: str) -> None:
        async def upstream() -> None:  # a task the request starts (a call, a relay pump)
            bind(upstream_request_id=f"up-{request_id}")
            await outlived.wait()
            bind(upstream_request_id="written-after-the-request-ended")

        structlog.contextvars.clear_contextvars()
        entry = running.begin("POST", {"request_id": request_id})
        entries.append(entry)
        try:
            bind(server="s", tool=tool)
            started.append(asyncio.get_running_loop().create_task(upstream()))
            await gate.wait()
        finally:
            running.end(entry)

    requests = [asyncio.create_task(call(f"r{i}", f"tool{i}")) for i in range(3)]
    async with asyncio.timeout(5):
        while len(running.snapshot()[0]) < 3 or any(
            "upstreamRequestId" not in view for view in running.snapshot()[0]
        ):
            await asyncio.sleep(0)
    views, total = running.snapshot()
    assert total == 3
    assert sorted((v["requestId"], v["tool"], v["upstreamRequestId"]) for v in views) == [
        ("r0", "tool0", "up-r0"),
        ("r1", "tool1", "up-r1"),
        ("r2", "tool2", "up-r2"),
    ]
    assert [v["requestId"] for v in running.snapshot(limit=2)[0]] == ["r0", "r1"]  # the oldest first
    gate.set()
    await asyncio.gather(*requests)
    assert running.snapshot() == ([], 0)
    outlived.set()
    await asyncio.gather(*started)
    assert running.snapshot() == ([], 0)
    assert all(entry.ended and entry.fields == {} for entry in entries)  # nothing written once ended


async def test_a_cancelled_request_leaves_the_list_and_one_without_a_server_is_never_listed() -> None:
    running = RunningRequests()
    bound = asyncio.Event()

    async def request(server: bool) -> None:
        entry = running.begin("GET", {"request_id": "x"})
        try:
            if server:
                bind(server="s")
            bound.set()
            await asyncio.Event().wait()
        finally:
            running.end(entry)

    unrouted = asyncio.create_task(request(server=False))  # not an MCP endpoint's (a metadata route)
    await bound.wait()
    assert running.snapshot() == ([], 0)
    bound.clear()
    cut = asyncio.create_task(request(server=True))
    await bound.wait()
    assert running.snapshot()[1] == 1
    for task in (cut, unrouted):
        task.cancel()
    await asyncio.gather(cut, unrouted, return_exceptions=True)
    assert running.snapshot() == ([], 0)
