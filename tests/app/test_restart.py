"""The proxy killed with SIGKILL while tasks run: after a restart every task id still resolves."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest
import yaml
from support.clients import LEGACY_HEADERS, LEGACY_INITIALIZE, ModernClient, envelope
from support.proxy import Serve, make_config
from support.servers import ROOT, ServerProcess
from support.v1_client import V1Client

from proxy.app import DRAIN_KEY, TASKS_KEY
from proxy.tasks.store import ListFilter


def _start(config_file: Path) -> ServerProcess:
    return ServerProcess([sys.executable, "-m", "proxy", "--config", str(config_file), "--port", "0"])


async def test_sigkill_then_restart_keeps_results_and_fails_orphans(legacy_url: str, tmp_path: Path) -> None:
    config_file = tmp_path / "proxy.yaml"
    config_file.write_text(
        yaml.safe_dump(
            {
                "store": {"path": str(tmp_path / "store")},
                "tasks": {"detach_after": "50ms", "ttl": "10m", "poll_interval": "100ms"},
                "mcpServers": {"legacy": {"url": legacy_url}},
            }
        )
    )
    proxy = _start(config_file)
    try:
        client = ModernClient(proxy.url)
        done_id = (await client.call("slow_compute", {"seconds": 0.1, "label": "kept"})).result["taskId"]
        await client.wait_terminal(done_id)
        orphan_id = (await client.call("slow_compute", {"seconds": 30, "label": "orphaned"})).result["taskId"]
        # a 2025-11-25 task: its request leaves after its task is made (the ref is written then)
        v1 = V1Client(proxy.url)
        await v1.initialize()
        await v1.call_as_task("slow_compute", {"seconds": 30, "label": "orphaned-v1"})
        async with asyncio.timeout(5):  # until it runs upstream
            while "orphaned-v1" not in (await client.call("started_log")).result["content"][0]["text"]:
                await asyncio.sleep(0.05)
        await v1.close()
        await client.close()
    finally:
        proxy.kill()
    proxy = _start(config_file)
    try:
        client = ModernClient(proxy.url)
        done = (await client.get(done_id)).result
        assert done["status"] == "completed"
        assert done["result"]["content"][0]["text"] == "computed kept after 0.1s"
        orphan = (await client.get(orphan_id)).result
        assert orphan["status"] == "failed"
        assert orphan["error"]["code"] == -32603
        assert "restarted" in orphan["error"]["message"]
        # (a 30 s call the SIGKILL cut off may run on upstream: it is not said to be lost there)
        assert "whether the upstream finished it is unknown" in orphan["error"]["message"], orphan
        # and the new process sent the upstream a cancel for it, on the dead one's upstream session
        async with asyncio.timeout(10):
            while True:
                log = json.loads((await client.call("cancelled_log")).result["content"][0]["text"])
                cancelled = {e["label"] for e in log if e["reason"] == "notifications/cancelled"}
                if {"orphaned", "orphaned-v1"} <= cancelled:
                    break
                await asyncio.sleep(0.05)
        assert orphan == (await client.get(orphan_id)).result  # stable on later polls
        await client.close()
    finally:
        proxy.stop()


def _write_config(tmp_path: Path, legacy_url: str, **extra) -> Path:
    config_file = tmp_path / "proxy.yaml"
    config_file.write_text(
        yaml.safe_dump(
            {
                "store": {"path": str(tmp_path / "store")},
                "tasks": {"detach_after": "50ms", "ttl": "10m", "poll_interval": "100ms"},
                "mcpServers": {
                    "legacy": {
                        "url": legacy_url,
                        "tasks": {"tools": {"slow_compute": {"on_restart": "rerun"}}},
                    }
                },
                **extra,
            }
        )
    )
    return config_file


async def test_idempotent_tool_marked_rerun_is_run_again_after_sigkill(
    legacy_url: str, tmp_path: Path
) -> None:
    """A re-run task's "re-running: ..." message gives way when it completes: to the last progress
    text (exactly the last: it lands with the outcome), or to none for a tool that reports none (it
    stayed, as if still re-running)."""
    config_file = _write_config(tmp_path, legacy_url)
    config = yaml.safe_load(config_file.read_text())
    config["mcpServers"]["legacy"]["tasks"]["tools"]["quiet_compute"] = {"on_restart": "rerun"}
    config_file.write_text(yaml.safe_dump(config))
    proxy = _start(config_file)
    try:
        client = ModernClient(proxy.url)
        rerun_id = (await client.call("slow_compute", {"seconds": 1.0, "label": "rerun-me"})).result["taskId"]
        quiet_id = (await client.call("quiet_compute", {"seconds": 0.5})).result["taskId"]
        failed_id = (await client.call("confirm_delete", {"filename": "f.txt", "delay": 5})).result["taskId"]
        await client.close()
    finally:
        proxy.kill()
    proxy = _start(config_file)
    try:
        client = ModernClient(proxy.url)
        first = (await client.get(rerun_id)).result
        assert first["status"] == "working" and "re-running" in first["statusMessage"]
        done = await client.wait_terminal(rerun_id)
        assert (
            done["status"] == "completed"
            and done["result"]["content"][0]["text"] == "computed rerun-me after 1s"
        )
        assert done["statusMessage"] == "10/10: tick 10", done
        quiet = await client.wait_terminal(quiet_id)
        assert quiet["status"] == "completed" and "statusMessage" not in quiet, quiet
        assert (await client.get(failed_id)).result["status"] == "failed"
        await client.close()
    finally:
        proxy.stop()


async def test_sigterm_drains_synchronous_calls_and_records_detached_ones(
    legacy_url: str, tmp_path: Path
) -> None:
    config_file = _write_config(tmp_path, legacy_url, listen={"drain_timeout": "5s"})
    proxy = _start(config_file)
    try:
        client = ModernClient(proxy.url)
        plain = ModernClient(proxy.url, capabilities={})
        detached_id = (await client.call("confirm_delete", {"filename": "d.txt", "delay": 30})).result[
            "taskId"
        ]
        sync_call = asyncio.create_task(plain.call("slow_compute", {"seconds": 1.0, "label": "drained"}))
        await asyncio.sleep(0.3)
        proxy.proc.send_signal(signal.SIGTERM)
        reply = await sync_call
        assert reply.result["content"][0]["text"] == "computed drained after 1s"
        assert await asyncio.to_thread(proxy.proc.wait, 15) == 0
        await client.close()
        await plain.close()
    finally:
        proxy.stop()
    proxy = _start(config_file)
    try:
        client = ModernClient(proxy.url)
        task = (await client.get(detached_id)).result
        assert task["status"] == "failed" and "shut down" in task["error"]["message"]
        await client.close()
    finally:
        proxy.stop()


POLLER = """
import asyncio, json, sys
sys.path.insert(0, "tests")
from support.clients import ModernClient
async def main():
    client = ModernClient(sys.argv[1])
    print(json.dumps(await client.wait_terminal(sys.argv[2])))
    await client.close()
asyncio.run(main())
"""


async def test_a_new_process_resumes_polling_after_the_client_dropped(
    legacy_url: str, tmp_path: Path
) -> None:
    proxy = _start(_write_config(tmp_path, legacy_url))
    try:
        client = ModernClient(proxy.url)
        task_id = (await client.call("slow_compute", {"seconds": 0.5, "label": "handoff"})).result["taskId"]
        await client.close()  # the first client is gone
        out = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-c", POLLER, proxy.url, task_id],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
        )
        assert out.returncode == 0, out.stderr
        final = json.loads(out.stdout)
        assert (
            final["status"] == "completed"
            and final["result"]["content"][0]["text"] == "computed handoff after 0.5s"
        )
    finally:
        proxy.stop()


async def test_sigterm_stops_accepting_and_answers_calls_that_outlive_the_drain(
    legacy_url: str, tmp_path: Path
) -> None:
    import aiohttp

    config_file = _write_config(tmp_path, legacy_url, listen={"drain_timeout": "1s"})
    proxy = _start(config_file)
    plain = ModernClient(proxy.url, capabilities={})
    try:
        long_call = asyncio.create_task(plain.call("slow_compute", {"seconds": 20, "label": "too-long"}))
        await asyncio.sleep(0.3)
        started = time.monotonic()
        proxy.proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.3)
        with pytest.raises(aiohttp.ClientConnectionError):  # no longer accepting
            async with (
                aiohttp.ClientSession() as http,
                http.get(proxy.url.replace("/mcp", "/healthz")) as resp,
            ):
                await resp.read()
        reply = await long_call
        assert reply.error["code"] == -32603 and "drain_timeout" in reply.error["message"]
        assert await asyncio.to_thread(proxy.proc.wait, 15) == 0
        assert time.monotonic() - started < 6  # the drain (1 s) plus clean-up, not a multiple of it
    finally:
        await plain.close()
        proxy.stop()


async def test_a_keyed_call_the_drain_abandoned_gives_its_retry_the_same_error(
    legacy_url: str, tmp_path: Path
) -> None:
    """A keyed synchronous call (shared as a task once `detach_after` passed) outlives the drain:
    its client gets the drain's -32603, and a retry with the key on the next process gets that same
    error (it got "-32800 the call was cancelled: the proxy is shutting down", which its first
    request never saw)."""
    config_file = _write_config(tmp_path, legacy_url, listen={"drain_timeout": "1s"})
    key = {"Idempotency-Key": "abandoned-by-the-drain"}
    arguments = {"seconds": 20, "label": "abandoned"}
    proxy = _start(config_file)
    plain = ModernClient(proxy.url, capabilities={})
    try:
        first = asyncio.create_task(plain.call("quiet_compute", arguments, headers=key))
        await asyncio.sleep(0.5)
        proxy.proc.send_signal(signal.SIGTERM)
        abandoned = (await first).error
        assert abandoned["code"] == -32603 and "drain_timeout" in abandoned["message"], abandoned
        assert await asyncio.to_thread(proxy.proc.wait, 15) == 0
    finally:
        await plain.close()
        proxy.stop()
    again = _start(config_file)
    plain = ModernClient(again.url, capabilities={})
    try:
        retry = await plain.call("quiet_compute", arguments, headers=key)
        assert retry.error == abandoned, retry.message
    finally:
        await plain.close()
        again.stop()


async def test_a_keyed_call_lost_with_its_process_before_it_became_a_task_says_so_to_its_retry(
    legacy_url: str, tmp_path: Path
) -> None:
    """SIGKILL while a keyed call still runs attached (its `detach_after` is far off): a retry with
    the key on the next process is not run again; once the dead process's lease lapses it gets
    -32603 saying that process was lost and that whether the call ran is unknown (it said "lost
    with its replica", which reads wrong without replicas)."""
    config_file = tmp_path / "proxy.yaml"
    config_file.write_text(
        yaml.safe_dump(
            {
                "store": {"path": str(tmp_path / "store"), "lease": "500ms"},
                "tasks": {"ttl": "10m", "poll_interval": "100ms"},
                "mcpServers": {
                    "legacy": {
                        "url": legacy_url,
                        "tasks": {"tools": {"slow_compute": {"detach_after": "60s"}}},
                    }
                },
            }
        )
    )
    key = {"Idempotency-Key": "lost-with-its-process"}
    arguments = {"seconds": 20, "label": "lost"}
    proxy = _start(config_file)
    plain = ModernClient(proxy.url, capabilities={})
    try:
        first = asyncio.create_task(plain.call("slow_compute", arguments, headers=key))
        async with asyncio.timeout(10):  # until the upstream runs it (so its key is claimed)
            while json.loads((await plain.call("started_log")).result["content"][0]["text"]).get("lost") != 1:
                await asyncio.sleep(0.05)
        proxy.kill()
        with pytest.raises(aiohttp.ClientError):  # its connection drops
            await first
    finally:
        await plain.close()
        proxy.stop()
    again = _start(config_file)
    plain = ModernClient(again.url, capabilities={})
    try:
        retry = await asyncio.wait_for(plain.call("slow_compute", arguments, headers=key), 10)
        error = retry.error
        assert error is not None and error["code"] == -32603, retry.message
        assert "lost with the proxy process running it" in error["message"], error
        assert "whether it ran is unknown" in error["message"], error
    finally:
        await plain.close()
        again.stop()


async def test_a_keyed_task_the_shutdown_failed_gives_its_retry_the_task_s_error(
    legacy_url: str, tmp_path: Path
) -> None:
    """A keyed call that became a task is still running at SIGTERM: the task reads `failed` with the
    shutdown's -32603, and a retry with the key on the next process gets that same error, from either
    kind of client (it got "-32800 the call was cancelled: proxy shutdown", which reads as a cancel
    the client asked for)."""
    config_file = _write_config(tmp_path, legacy_url)
    key = {"Idempotency-Key": "failed-by-the-shutdown"}
    arguments = {"seconds": 30, "label": "shut-down"}
    proxy = _start(config_file)
    client = ModernClient(proxy.url)
    try:
        task_id = (await client.call("quiet_compute", arguments, headers=key)).result["taskId"]
        proxy.proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proxy.proc.wait, 15) == 0
    finally:
        await client.close()
        proxy.stop()
    again = _start(config_file)
    client, plain = ModernClient(again.url), ModernClient(again.url, capabilities={})
    try:
        task = (await client.get(task_id)).result
        assert task["status"] == "failed" and "shut down while this call" in task["error"]["message"], task
        for retrying in (plain, client):
            retry = await retrying.call("quiet_compute", arguments, headers=key)
            assert retry.error == task["error"], retry.message
    finally:
        await client.close()
        await plain.close()
        again.stop()


async def test_outcomes_reported_after_the_task_service_stopped_are_discarded(
    legacy_url: str, tmp_path: Path, serve: Serve
) -> None:
    """A call the shutdown stopped reports its end later, when the store may be closed: the service
    discards it (`late_outcome_discarded`) instead of writing to a closed store (a `RuntimeError` in a
    task nobody awaited, logged after `proxy_stopped`)."""
    proxy = await serve(make_config(legacy_url, tmp_path / "store"))
    service = proxy.app[TASKS_KEY]
    client = ModernClient(proxy.url())
    try:
        task_id = (await client.call("quiet_compute", {"seconds": 30, "label": "late"})).result["taskId"]
    finally:
        await client.close()
    await proxy.stop()  # the app's cleanup: the service stops, then the store closes
    await service.finish(task_id, {"result": {"content": []}}, None)  # raised before: the store is closed
    assert not await service.progress(task_id, "late progress")
    assert not await service.set_inputs(task_id, {})


@pytest.mark.parametrize("upstream", ["http", "stdio"])
async def test_sigterm_answers_legacy_calls_that_outlive_the_drain(
    legacy_url: str, tmp_path: Path, upstream: str
) -> None:
    """A legacy (2025-11-25) call, relayed on an HTTP upstream's stream or bridged to a stdio child,
    gets drain_timeout like a modern one: a JSON-RPC error naming the shutdown, and the proxy exits
    soon after (the relay waited for the call's own end and its client saw the stream end with no
    answer; the bridge's client saw its stream cut at drain_timeout + 1 s)."""
    from mcp import ClientSession
    from mcp.client.streamable_http import streamable_http_client
    from mcp.shared.exceptions import MCPError
    from support.servers import FIXTURE_STDIO

    config_file = _write_config(tmp_path, legacy_url, listen={"drain_timeout": "1s"})
    if upstream == "stdio":
        config = yaml.safe_load(config_file.read_text())
        config["mcpServers"]["legacy"] = dict(FIXTURE_STDIO)
        config_file.write_text(yaml.safe_dump(config))
    proxy = _start(config_file)
    try:
        async with streamable_http_client(proxy.url) as (read, write), ClientSession(read, write) as session:
            await session.initialize()
            call = asyncio.create_task(
                session.call_tool("slow_compute", {"seconds": 20, "label": "legacy-too-long"})
            )
            # (the call is on its way; its relay keeps it whatever the SIGTERM finds)
            await asyncio.sleep(0.5)
            started = time.monotonic()
            proxy.proc.send_signal(signal.SIGTERM)
            with pytest.raises(MCPError) as raised:
                await asyncio.wait_for(call, 10)
        assert raised.value.error.code == -32603
        assert "drain_timeout" in raised.value.error.message and "1 s" in raised.value.error.message
        assert await asyncio.to_thread(proxy.proc.wait, 15) == 0
        assert time.monotonic() - started < 10  # the drain (1 s) plus clean-up, not the call's 20 s
    finally:
        proxy.stop()


async def test_a_second_signal_cuts_the_drain_short(legacy_url: str, tmp_path: Path) -> None:
    """SIGTERM starts a 30 s drain; a SIGINT after it ends the drain at once: the synchronous calls
    still running (a 2026-07-28 one and a legacy one relayed on the upstream's stream) get the
    shutdown's JSON-RPC error naming the second signal, a client that stopped sending its body and
    one that stopped reading a 40 MB reply have their connections closed a second later, and the
    proxy exits within seconds, not at drain_timeout."""
    from mcp import ClientSession
    from mcp.client.streamable_http import streamable_http_client
    from mcp.shared.exceptions import MCPError

    proxy = _start(_big_replies(_write_config(tmp_path, legacy_url, listen={"drain_timeout": "30s"})))
    plain = ModernClient(proxy.url, capabilities={})
    try:
        host, port = proxy.url.removeprefix("http://").split("/")[0].rsplit(":", 1)
        not_reading = await _not_reading_a_big_reply(proxy, plain)
        async with streamable_http_client(proxy.url) as (read, write), ClientSession(read, write) as session:
            await session.initialize()
            legacy_call = asyncio.create_task(
                session.call_tool("slow_compute", {"seconds": 40, "label": "legacy-cut"})
            )
            modern_call = asyncio.create_task(plain.call("slow_compute", {"seconds": 40, "label": "cut"}))
            stalled_reader, stalled = await asyncio.open_connection(host, int(port))
            stalled.write(
                b"POST /mcp HTTP/1.1\r\nHost: " + host.encode() + b"\r\nContent-Type: application/json\r\n"
                b'Content-Length: 1000\r\n\r\n{"jsonrpc": '  # and then nothing more (body_timeout: 30 s)
            )
            await stalled.drain()
            await asyncio.sleep(0.5)  # both calls on their way upstream
            proxy.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.5)
            assert proxy.proc.poll() is None and not modern_call.done()  # draining: 30 s for them
            started = time.monotonic()
            proxy.proc.send_signal(signal.SIGINT)
            reply = await asyncio.wait_for(modern_call, 10)
            with pytest.raises(MCPError) as raised:
                await asyncio.wait_for(legacy_call, 10)
        assert reply.error["code"] == -32603 and "second SIGTERM or SIGINT" in reply.error["message"], reply
        assert raised.value.error.code == -32603
        assert "second SIGTERM or SIGINT" in raised.value.error.message, raised.value.error.message
        assert await asyncio.to_thread(proxy.proc.wait, 15) == 0
        assert time.monotonic() - started < 10  # not the 30 s drain_timeout
        assert await asyncio.wait_for(stalled_reader.read(), 5) == b""  # closed, unanswered
        stalled.close()
        not_reading.close()
    finally:
        await plain.close()
        proxy.stop()


async def test_a_lone_proxy_cuts_its_open_streams_as_it_starts_draining(
    legacy_url: str, tmp_path: Path
) -> None:
    """An idle legacy GET stream (open as long as its client) held a lone proxy's SIGTERM for the
    whole `drain_timeout` (about 31 s): nothing it carries outlives the process, so it is cut as the
    drain starts, and the proxy exits at once when no call is running."""
    proxy = _start(_write_config(tmp_path, legacy_url, listen={"drain_timeout": "20s"}))
    headers = dict(LEGACY_HEADERS)
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(proxy.url, json=LEGACY_INITIALIZE, headers=headers) as resp:
                assert resp.status == 200, await resp.text()
                headers["Mcp-Session-Id"] = resp.headers["Mcp-Session-Id"]
                await resp.read()
            initialized = {"jsonrpc": "2.0", "method": "notifications/initialized"}
            async with http.post(proxy.url, json=initialized, headers=headers) as resp:
                assert resp.status == 202
            async with http.get(proxy.url, headers={**headers, "Accept": "text/event-stream"}) as stream:
                assert stream.status == 200
                started = time.monotonic()
                proxy.proc.send_signal(signal.SIGTERM)
                assert await asyncio.to_thread(proxy.proc.wait, 15) == 0
                took = time.monotonic() - started
                with contextlib.suppress(aiohttp.ClientError):
                    await asyncio.wait_for(stream.read(), 5)  # ended, not left hanging
        assert took < 8, took  # not the 20 s drain_timeout
    finally:
        proxy.stop()


async def test_a_client_that_stopped_reading_holds_the_exit_no_longer_than_the_drain(
    legacy_url: str, tmp_path: Path
) -> None:
    """One SIGTERM, a 5 s drain, and a client that stopped reading a 40 MB reply: its connection is
    aborted a second after the drain's deadline and the proxy exits then (aiohttp's own shutdown
    would wait for the stuck write twice as long as the drain)."""
    proxy = _start(_big_replies(_write_config(tmp_path, legacy_url, listen={"drain_timeout": "5s"})))
    plain = ModernClient(proxy.url, capabilities={})
    try:
        not_reading = await _not_reading_a_big_reply(proxy, plain)
        started = time.monotonic()
        proxy.proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proxy.proc.wait, 20) == 0
        assert time.monotonic() - started < 9  # the drain (5 s), the grace (1 s), the clean-up: not 12 s
        not_reading.close()
    finally:
        await plain.close()
        proxy.stop()


def _big_replies(config_file: Path) -> Path:
    """The config file, its `legacy` upstream allowed replies up to 64 MB."""
    config = yaml.safe_load(config_file.read_text())
    config["mcpServers"]["legacy"]["max_response_bytes"] = 64 * 1024 * 1024
    config_file.write_text(yaml.safe_dump(config))
    return config_file


async def _not_reading_a_big_reply(proxy: ServerProcess, plain: ModernClient) -> asyncio.StreamWriter:
    """A raw connection that asks for a 40 MB result, reads the first bytes of the reply (so the
    proxy is writing it) and then no more; returns its writer, for the test to close."""
    host, port = proxy.url.removeprefix("http://").split("/")[0].rsplit(":", 1)
    big = {"name": "big_result", "arguments": {"kb": 40_000}, "_meta": envelope({})}
    body = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": big}).encode()
    head = {**plain.headers_for("tools/call", big), "Accept": "application/json"}
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        f"POST /mcp HTTP/1.1\r\nHost: {host}\r\nContent-Length: {len(body)}\r\n".encode()
        + b"".join(f"{k}: {v}\r\n".encode() for k, v in head.items())
        + b"\r\n"
        + body
    )
    await writer.drain()
    async with asyncio.timeout(30):  # its reply has begun; this client reads no more of it
        assert (await reader.readexactly(12)) == b"HTTP/1.1 200"
    return writer


async def test_without_replicas_a_call_reaching_its_detach_deadline_while_draining_stays_attached(
    legacy_url: str, tmp_path: Path, serve: Serve
) -> None:
    """A proxy without replicas starts its drain while a call (with the tasks extension, 1 s long,
    detach_after 300 ms) runs: the call does not become a task that the shutdown would fail, it
    stays attached and its client gets the result within drain_timeout."""
    proxy = await serve(make_config(legacy_url, tmp_path / "store", tasks={"detach_after": "300ms"}))
    client = ModernClient(proxy.url())
    try:
        await client.warm_up()
        call = asyncio.create_task(client.call("slow_compute", {"seconds": 1.0, "label": "drained"}))
        await asyncio.sleep(0.1)
        proxy.app[DRAIN_KEY].start(30.0)
        reply = await asyncio.wait_for(call, 10)
        assert reply.result.get("resultType") != "task", reply.message
        assert reply.result["content"][0]["text"] == "computed drained after 1s", reply.message
        records, _ = await proxy.store.list_tasks(ListFilter())
        assert not [r for r in records if r.tool == "slow_compute"], records
    finally:
        await client.close()
