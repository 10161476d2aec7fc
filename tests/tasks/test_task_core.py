"""Task core acceptance: one serving process per store directory, retention that never drops a
running task, store failures that are never silent, and orphans found by the lease sweep."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
import yaml
from support.clients import ModernClient
from support.logs import json_log
from support.proxy import RunningProxy, Serve, make_config
from support.records import make_record
from support.servers import ROOT, ServerProcess

from proxy.app import RUNNING_KEY, TASKS_KEY
from proxy.protocol.jsonrpc import JsonRpcError
from proxy.tasks import diskcache_store
from proxy.tasks.diskcache_store import DiskcacheStore
from proxy.tasks.model import TaskStatus


def _config_file(tmp_path: Path, legacy_url: str) -> Path:
    path = tmp_path / "proxy.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "store": {"path": str(tmp_path / "store"), "durable": False},
                "tasks": {"detach_after": "50ms", "ttl": "10m", "poll_interval": "100ms"},
                "mcpServers": {"legacy": {"url": legacy_url}},
            }
        )
    )
    return path


async def test_a_second_proxy_on_a_held_store_exits_naming_it_and_a_sigkill_frees_it(
    legacy_url: str, tmp_path: Path
) -> None:
    config_file = _config_file(tmp_path, legacy_url)
    first = ServerProcess([sys.executable, "-m", "proxy", "--config", str(config_file), "--port", "0"])
    try:
        client = ModernClient(first.url)
        done_id = (await client.call("slow_compute", {"seconds": 0.1, "label": "kept"})).result["taskId"]
        await client.wait_terminal(done_id)
        running_id = (await client.call("slow_compute", {"seconds": 30, "label": "held"})).result["taskId"]
        await client.close()

        same_port = first.url.rsplit(":", 1)[1].split("/")[0]  # even on the same port, the store is named
        second = subprocess.run(
            [sys.executable, "-m", "proxy", "--config", str(config_file), "--port", same_port],
            capture_output=True,
            text=True,
            timeout=30,
            cwd=ROOT,
        )
        assert second.returncode != 0
        assert str(tmp_path / "store") in second.stderr and f"pid {first.proc.pid}" in second.stderr, (
            second.stderr
        )
        # The first proxy's running task is untouched by the refused second one.
        client = ModernClient(first.url)
        assert (await client.get(running_id)).result["status"] == "working"
        await client.close()
        # The operator CLI reads and cancels while the proxy runs.
        base = [sys.executable, "-m", "proxy", "tasks", "--store", str(tmp_path / "store")]
        listing = subprocess.run([*base, "list"], capture_output=True, text=True, timeout=30, cwd=ROOT)
        assert listing.returncode == 0 and running_id in listing.stdout and done_id in listing.stdout
    finally:
        first.kill()
    restarted = ServerProcess([sys.executable, "-m", "proxy", "--config", str(config_file), "--port", "0"])
    try:
        client = ModernClient(restarted.url)
        assert (await client.get(done_id)).result["result"]["content"][0][
            "text"
        ] == "computed kept after 0.1s"
        orphan = (await client.get(running_id)).result
        assert orphan["status"] == "failed" and "restarted" in orphan["error"]["message"]
        await client.close()
    finally:
        restarted.stop()


async def test_a_call_three_times_longer_than_ttl_completes_and_stays_readable(
    legacy_url: str, tmp_path: Path, serve: Serve
) -> None:
    ttl_s = 0.4
    config = make_config(
        legacy_url, tmp_path / "store", tasks={"detach_after": "50ms", "ttl": f"{int(ttl_s * 1000)}ms"}
    )
    proxy = await serve(config)
    client = ModernClient(proxy.url())
    try:
        created = (await client.call("quiet_compute", {"seconds": 3 * ttl_s})).result
        assert created["resultType"] == "task" and created["ttlMs"] == ttl_s * 1000
        reported = [created["ttlMs"]]
        while True:
            task = (await client.get(created["taskId"])).result
            if task["status"] != "working":
                break
            reported.append(task["ttlMs"])
            await asyncio.sleep(0.1)
        assert task["status"] == "completed" and "3*" not in str(task["result"])
        assert reported == sorted(reported) and reported[-1] > 2 * ttl_s * 1000  # grew while it ran
        ended = time.monotonic()
        await asyncio.sleep(ttl_s / 2)
        kept = (await client.get(created["taskId"])).result
        assert kept["status"] == "completed" and kept["ttlMs"] == task["ttlMs"]  # fixed once terminal
        await asyncio.sleep(max(0.0, ttl_s + 0.1 - (time.monotonic() - ended)))
        assert (await client.get(created["taskId"])).error["code"] == -32602  # retention over
    finally:
        await client.close()


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs the test can fill up (root only)."""
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    if (
        os.geteuid() != 0
        or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], capture_output=True
        ).returncode
    ):
        pytest.skip("needs root to mount a tmpfs")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def _fill(path: Path) -> Path:
    filler = path / "filler"
    with open(filler, "wb") as out:
        try:
            while True:
                out.write(b"\0" * 65536)
                out.flush()
        except OSError:
            pass
    return filler


async def test_an_unwritable_store_fails_tasks_naming_it_and_never_answers_500(
    legacy_url: str, small_tmpfs: Path, monkeypatch: pytest.MonkeyPatch, serve: Serve
) -> None:
    # No WAL checkpoint during the test: each commit then needs new space on the full disk (after a
    # checkpoint SQLite may reuse WAL pages it already has, and a write could still succeed).
    monkeypatch.setattr(diskcache_store, "CHECKPOINT_EVERY_S", 1e9)
    config = make_config(
        legacy_url,
        small_tmpfs / "store",
        tasks={"detach_after": "50ms"},
        server={"tasks": {"tools": {"slow_compute": {"mode": "required"}}}},
    )
    config.store.write_retry = 0.3
    config.limits.max_tasks_per_principal = 2
    proxy = await serve(config)
    client = ModernClient(proxy.url())
    try:
        ids = [(await client.call("quiet_compute", {"seconds": 0.6})).result["taskId"] for _ in range(2)]
        filler = _fill(small_tmpfs)
        # The calls end while the store cannot write: never shown terminal before they are stored,
        # they read `working`, naming the store, until their own outcome lands.
        async with asyncio.timeout(10):
            while proxy.app[TASKS_KEY].live:
                await asyncio.sleep(0.05)
        for task_id in ids:
            reading = (await client.get(task_id)).result
            assert reading["status"] == "working", reading
            assert "cannot record its outcome yet" in reading["statusMessage"]
            assert str(small_tmpfs / "store") in reading["statusMessage"]
        # Started upstream, it cannot become a task: it stays attached and is answered synchronously
        # (never a 503, which a load balancer would send again).
        attached = await client.call("quiet_compute", {"seconds": 0.3})
        assert (
            attached.status == 200 and attached.result["content"][0]["text"] == "quietly computed after 0.3s"
        ), attached
        assert proxy.app[TASKS_KEY].live == {}
        # A `mode: required` tool never answers synchronously: 507 (the task could not be
        # stored), neither a 500 nor a 503 that a balancer would send again.
        required = await client.call("slow_compute", {"seconds": 0.3})
        assert (
            required.status == 507
            and required.error["code"] == -32603
            and "store" in required.error["message"]
        ), required
        async with aiohttp.ClientSession() as http, http.get(f"{proxy.base}/readyz") as resp:
            ready = await resp.json()
        assert (
            resp.status == 503
            and ready["checks"]["store"].startswith("failed")
            and "full" in ready["checks"]["store"]
        )
        filler.unlink()  # space again: the outcomes held back land in the store, as they were
        async with asyncio.timeout(10):
            while [(await proxy.store.get(i)).status for i in ids] != [TaskStatus.COMPLETED] * 2:
                await asyncio.sleep(0.1)
        for task_id in ids:
            done = await client.wait_terminal(task_id, timeout=10)
            assert done["result"]["content"][0]["text"] == "quietly computed after 0.6s", done
        async with aiohttp.ClientSession() as http, http.get(f"{proxy.base}/readyz") as resp:
            assert resp.status == 200
    finally:
        await client.close()


async def test_a_keyed_answer_the_store_could_not_keep_is_kept_once_it_can(
    legacy_url: str, small_tmpfs: Path, monkeypatch: pytest.MonkeyPatch, serve: Serve
) -> None:
    """A keyed call answered while the store cannot write: the answer goes out, and is kept under
    its key as soon as the store takes writes again, so a retry gets it. Before, the slot kept naming
    the running call, and a retry waited on it until the call's `timeout` (30 min by default)."""
    monkeypatch.setattr(diskcache_store, "CHECKPOINT_EVERY_S", 1e9)
    config = make_config(
        legacy_url, small_tmpfs / "store", tasks={"detach_after": "20s"}, server={"timeout": "20s"}
    )
    config.store.write_retry = 0.3
    proxy = await serve(config)
    plain = ModernClient(proxy.url(), capabilities={})
    key = {"Idempotency-Key": "kept-once-it-can"}
    arguments = {"seconds": 0.8}
    try:
        first = asyncio.create_task(plain.call("quiet_compute", arguments, headers=key))
        async with asyncio.timeout(5):  # until it went upstream (so its key is claimed)
            while not any("upstreamRequestId" in view for view in proxy.app[RUNNING_KEY].snapshot()[0]):
                await asyncio.sleep(0.02)
        filler = _fill(small_tmpfs)
        answered = await first
        assert answered.result["content"][0]["text"] == "quietly computed after 0.8s", answered.message
        filler.unlink()
        retry = await asyncio.wait_for(plain.call("quiet_compute", arguments, headers=key), 10)
        assert retry.result == answered.result, retry.message
        assert proxy.app[TASKS_KEY].pending_writes() == 0
    finally:
        await plain.close()


async def test_a_task_reads_one_terminal_state_across_a_restart_while_the_store_cannot_write(
    legacy_url: str, small_tmpfs: Path, monkeypatch: pytest.MonkeyPatch, serve: Serve
) -> None:
    """A call that ends while the store cannot write is not shown terminal; the proxy stops before
    the write lands, so after the restart the task reads the restart's failure, the only terminal
    state it ever showed (it used to read "could not record" first, then "restarted")."""
    monkeypatch.setattr(diskcache_store, "CHECKPOINT_EVERY_S", 1e9)
    config = make_config(legacy_url, small_tmpfs / "store", tasks={"detach_after": "50ms"})
    config.store.write_retry = 0.2
    proxy = await serve(config)
    client = ModernClient(proxy.url())
    try:
        task_id = (await client.call("quiet_compute", {"seconds": 0.4})).result["taskId"]
        filler = _fill(small_tmpfs)
        async with asyncio.timeout(10):
            while proxy.app[TASKS_KEY].live:
                await asyncio.sleep(0.05)
        assert (await client.get(task_id)).result["status"] == "working"
        await proxy.close()  # the outcome held back goes with the process
        filler.unlink()
        proxy = await serve(config)
        client.url = proxy.url()
        done = await client.wait_terminal(task_id, timeout=10)
        assert done["status"] == "failed" and "restart" in done["statusMessage"], done
        assert (await client.get(task_id)).result == done
    finally:
        await client.close()


async def test_a_lapsed_lease_ends_the_orphan_within_twice_the_lease(
    legacy_url: str, tmp_path: Path, serve: Serve
) -> None:
    lease_s = 0.5
    config = make_config(legacy_url, tmp_path / "store")
    config.store.lease = lease_s
    proxy = await serve(config)
    other = DiskcacheStore(tmp_path / "store", durable=False)
    try:
        ghost = "ghost-" + uuid.uuid4().hex[:8]
        await other.renew_lease(ghost, int(lease_s * 1000))
        await other.create(make_record(task_id="orphan", owner=ghost, principal="anonymous", server="legacy"))
        await asyncio.sleep(lease_s / 2)
        assert (await other.get("orphan")).status is TaskStatus.WORKING  # a live lease is respected
        await other.renew_lease(ghost, int(lease_s * 1000))
        stopped = time.monotonic()  # the last heartbeat
        record = await other.get("orphan")
        async with asyncio.timeout(4 * lease_s):
            while record.status is TaskStatus.WORKING:
                record = await other.wait_for_change("orphan", record.version, timeout_s=0.05)
        elapsed = time.monotonic() - stopped
    finally:
        await other.close()
    assert record.status is TaskStatus.FAILED and ghost in record.outcome["error"]["message"]
    assert lease_s <= elapsed <= 2 * lease_s, elapsed
    assert proxy.app[TASKS_KEY].store_problem is None


async def test_an_orphan_a_poll_finds_is_taken_over_in_a_log_context_of_its_own(
    legacy_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], serve: Serve
) -> None:
    """A poll that finds an orphan (its owner's lease lapsed) of an `on_restart: rerun` tool: the
    take-over is logged (`task_taken_over`, naming the lost node), and the re-run call logs under
    its task, not under the request id and method of the poll that happened to find it."""
    config = make_config(
        legacy_url,
        tmp_path / "store",
        server={"tasks": {"tools": {"slow_compute": {"on_restart": "rerun"}}}},
    )
    proxy = await serve(config)
    params = {"name": "slow_compute", "arguments": {"seconds": 0.2, "label": "orphaned"}}
    orphan = make_record(
        task_id="orphan-" + uuid.uuid4().hex[:8],
        owner="ghost-" + uuid.uuid4().hex[:8],  # no lease at all: lapsed
        principal="anonymous",
        server="legacy",
        tool="slow_compute",
        rerun={"method": "tools/call", "params": params, "capabilities": {}},
    )
    await proxy.store.create(orphan)
    client = ModernClient(proxy.url())
    try:
        with json_log(capsys) as lines:
            first = (await client.get(orphan.task_id)).result
            done = await client.wait_terminal(orphan.task_id)
    finally:
        await client.close()
    assert first["status"] == "working" and "re-running" in first["statusMessage"], first
    assert done["status"] == "completed", done
    taken = [line for line in lines if line["event"] == "task_taken_over"]
    assert len(taken) == 1 and taken[0]["fate"] == "rerun" and taken[0]["lost_node"] == orphan.owner, taken
    poll_id = next(line["request_id"] for line in lines if line.get("rpc_method") == "tasks/get")
    ended = [line for line in lines if line["event"] == "task_ended" and line["task_id"] == orphan.task_id]
    assert len(ended) == 1 and ended[0].get("request_id") != poll_id, ended
    assert ended[0].get("rpc_method") != "tasks/get", ended


async def test_an_operator_cancel_from_the_cli_stops_the_upstream_call(
    legacy_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], serve: Serve
) -> None:
    config = make_config(legacy_url, tmp_path / "store", tasks={"detach_after": "50ms"})
    config.store.lease = 0.4  # the sweep that notices runs every half lease
    proxy = await serve(config)
    client = ModernClient(proxy.url())
    try:
        created = (await client.call("quiet_compute", {"seconds": 30})).result
        cancelled = await asyncio.to_thread(
            subprocess.run,
            [
                sys.executable,
                "-m",
                "proxy",
                "tasks",
                "--store",
                str(tmp_path / "store"),
                "cancel",
                created["taskId"],
            ],
            capture_output=True,
            text=True,
            timeout=30,
            cwd=ROOT,
        )
        assert cancelled.returncode == 0 and "cancelled" in cancelled.stdout
        async with asyncio.timeout(5):
            while created["taskId"] in proxy.app[TASKS_KEY].live:
                await asyncio.sleep(0.05)
        assert (await client.get(created["taskId"])).result["status"] == "cancelled"
    finally:
        await client.close()
    await proxy.stop()
    assert _logged("\n".join(capsys.readouterr()), "task_cancelled", by="operator")


async def test_the_audit_trail_names_each_step_and_never_a_payload(
    legacy_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], serve: Serve
) -> None:
    config = make_config(
        legacy_url, tmp_path / "store", tasks={"detach_after": "50ms"}, server={"timeout": "300ms"}
    )
    proxy = await serve(config)
    client = ModernClient(
        proxy.url(), capabilities={"elicitation": {}, "extensions": {"io.modelcontextprotocol/tasks": {}}}
    )
    try:
        await client.warm_up()
        asked = (await client.call("confirm_delete", {"filename": "secret-name.txt", "delay": 0.2})).result
        task = await client.wait_status(asked["taskId"], ("input_required",))
        key = next(iter(task["inputRequests"]))
        await client.request(
            "tasks/update",
            {
                "taskId": asked["taskId"],
                "inputResponses": {key: {"action": "accept", "content": {"confirm": True}}},
            },
        )
        await client.wait_terminal(asked["taskId"])
        await client.get(asked["taskId"])
        cancelled = (await client.call("quiet_compute", {"seconds": 5})).result
        await client.request("tasks/cancel", {"taskId": cancelled["taskId"]})
        timed_out = (await client.call("quiet_compute", {"seconds": 5})).result
        assert (await client.wait_terminal(timed_out["taskId"]))["status"] == "failed"
    finally:
        await client.close()
    await proxy.stop()
    text = "\n".join(capsys.readouterr())
    for event in (
        "task_created",
        "task_transition",
        "task_input_requested",
        "task_input_answered",
        "task_result_retrieved",
    ):
        assert _logged(text, event, principal=None), event
    assert _logged(text, "task_cancelled", by="client") and _logged(text, "task_ended", by="timeout")
    assert "secret-name.txt" not in text  # never a payload


def _logged(text: str, event: str, **fields: str | None) -> bool:
    """Whether a log line (console or JSON rendering) has `event` and each field (None: any value)."""
    for line in text.splitlines():
        if event not in line:
            continue
        if all(
            (f"{k}=" in line or f'"{k}":' in line)
            if v is None
            else (f"{k}={v}" in line or f'"{k}":"{v}"' in line)
            for k, v in fields.items()
        ):
            return True
    return False


async def test_task_ids_no_store_can_hold_are_unknown_not_errors(
    flow_proxy: RunningProxy, flow_client: ModernClient
) -> None:
    for bad in ("\ud800", "x" * 300, "tab\there"):
        for method in ("tasks/get", "tasks/cancel"):
            reply = await flow_client.request(method, {"taskId": bad})
            # -32020 when the Mcp-Name header cannot mirror the id; never a 500
            assert reply.status == 400 and reply.error["code"] in (-32602, -32020), (method, bad, reply)
        with pytest.raises(JsonRpcError) as refused:
            await flow_proxy.app[TASKS_KEY].lookup(bad, principal="anonymous", server="legacy")
        assert refused.value.code == -32602


async def test_a_completed_task_keeps_its_last_progress_text(flow_client: ModernClient) -> None:
    created = (await flow_client.call("slow_compute", {"seconds": 0.5, "label": "progress-kept"})).result
    done = await flow_client.wait_terminal(created["taskId"])
    assert done["status"] == "completed" and done.get("statusMessage"), done
