"""What an operator sees and relies on: legacy-era traffic in metrics and request logs, task ids in
`tasks/get` lines, a sane request_state key file, an optional `/metrics` token, a start-up that
never claims to run before it could bind, and a proxy that survives running out of file descriptors
without flooding its log."""

from __future__ import annotations

import asyncio
import json
import resource
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import aiohttp
import psutil
import pytest
import structlog
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client
from multidict import CIMultiDict
from support.clients import ModernClient
from support.proxy import Serve, make_config
from support.servers import ROOT

from proxy.calls.mrtr import KEY_FILE, load_or_create_key
from proxy.config import ConfigError
from proxy.front.auth import hash_token
from proxy.runtime.logs import configure_logging


def metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def scrape(base: str, headers: Mapping[str, str] | None = None) -> tuple[int, str]:
    async with aiohttp.ClientSession() as http, http.get(f"{base}/metrics", headers=headers or {}) as resp:
        return resp.status, await resp.text()


async def test_legacy_era_calls_are_counted_and_logged_like_modern_ones(
    legacy_url: str, tmp_path: Path, capsys, serve: Serve
) -> None:
    configure_logging("info")
    try:
        proxy = await serve(make_config(legacy_url, tmp_path / "store"))
        _, before = await scrape(proxy.base)
        async with (
            streamable_http_client(proxy.url()) as (read, write),
            ClientSession(read, write) as session,
        ):
            await session.initialize()
            result = await session.call_tool("greet", {"name": "legacy"})
        assert result.content[0].text == "Hello, legacy!"
        # The relay counts a call once its handler returns, which may be just after the client
        # read the last SSE event: scrape until it shows (bounded, 2 s). Any tool label: an SSE
        # reply is not read, so `greet` is `other` until some earlier test saw it answered.
        calls = {"server": "legacy", "outcome": "sync"}
        async with asyncio.timeout(2):
            while True:
                _, after = await scrape(proxy.base)  # legacy traffic only so far
                if metric(after, "mcp_tasks_proxy_calls_total", **calls) > metric(
                    before, "mcp_tasks_proxy_calls_total", **calls
                ):
                    break
                await asyncio.sleep(0.01)
        modern = ModernClient(proxy.url())
        try:
            created = (await modern.call("slow_compute", {"seconds": 0.1, "label": "x"})).result
            await modern.wait_terminal(created["taskId"])
        finally:
            await modern.close()
        await proxy.stop()
        lines = [json.loads(line) for line in capsys.readouterr().err.splitlines() if line.startswith("{")]
    finally:
        structlog.reset_defaults()
    assert (
        metric(after, "mcp_tasks_proxy_calls_total", **calls)
        - metric(before, "mcp_tasks_proxy_calls_total", **calls)
        == 1
    )
    latency = {"server": "legacy", "method": "tools/call"}
    assert metric(after, "mcp_tasks_proxy_upstream_latency_seconds_count", **latency) > metric(
        before, "mcp_tasks_proxy_upstream_latency_seconds_count", **latency
    )
    requests = [line for line in lines if line["event"] == "request"]
    legacy_call = [
        line for line in requests if line.get("era") == "legacy" and line.get("rpc_method") == "tools/call"
    ]
    assert legacy_call and legacy_call[0]["tool"] == "greet" and legacy_call[0]["server"] == "legacy"
    # The SDK may hang up right after reading initialize's last SSE event: then its line is
    # client_disconnected.
    ends = [line for line in lines if line["event"] in ("request", "client_disconnected")]
    assert any(line.get("era") == "legacy" and line.get("rpc_method") == "initialize" for line in ends)
    gets = [line for line in requests if line.get("rpc_method") == "tasks/get"]
    assert gets and all(line["task_id"] == created["taskId"] and line["era"] == "modern" for line in gets)


def test_request_state_key_file_is_checked_and_written_safely(tmp_path: Path) -> None:
    store = tmp_path / "store"
    key = load_or_create_key(str(store), None)
    path = store / KEY_FILE
    assert len(key) == 32 and path.read_text() == key.hex()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_or_create_key(str(store), None) == key  # kept across restarts
    assert [p.name for p in store.iterdir()] == [KEY_FILE]  # no temporary file left behind
    for content, complaint in (
        ("", "is empty"),
        ("not hex at all\n", "does not hold hex digits"),
        ("abcd", "fewer than 32"),
    ):
        path.write_text(content)
        with pytest.raises(ConfigError, match=complaint) as caught:
            load_or_create_key(str(store), None)
        assert str(path) in str(caught.value) and "request_state.secret" in str(caught.value)


async def test_an_empty_key_file_stops_the_start_instead_of_every_mrtr_round(
    legacy_url: str, tmp_path: Path, serve: Serve
) -> None:
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / KEY_FILE).write_text("")
    with pytest.raises(ConfigError, match="is empty"):
        _proxy = await serve(make_config(legacy_url, tmp_path / "store"))
        await _proxy.stop()


async def test_metrics_token(legacy_url: str, tmp_path: Path, serve: Serve) -> None:
    config = make_config(legacy_url, tmp_path / "store")
    config.metrics.token = hash_token("scraper-secret")
    proxy = await serve(config)
    status, body = await scrape(proxy.base)
    assert status == 401 and json.loads(body)["error"]["code"] == -32600
    assert (await scrape(proxy.base, {"Authorization": "Bearer wrong"}))[0] == 401
    status, body = await scrape(proxy.base, {"Authorization": "Bearer scraper-secret"})
    assert status == 200 and "mcp_tasks_proxy_calls_total" in body
    for pair in (("Bearer scraper-secret", "Bearer wrong"), ("Bearer wrong", "Bearer scraper-secret")):
        assert (await scrape(proxy.base, CIMultiDict([("Authorization", value) for value in pair])))[0] == 401


def _write_config(tmp_path: Path, url: str, **listen: object) -> Path:
    path = tmp_path / "proxy.json"
    path.write_text(
        json.dumps(
            {
                "listen": listen,
                "store": {"path": str(tmp_path / "store")},
                "mcpServers": {"legacy": {"url": url}},
            }
        )
    )
    return path


def test_a_failed_bind_is_reported_before_anything_claims_to_have_started(
    legacy_url: str, tmp_path: Path
) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "proxy",
                "--config",
                str(_write_config(tmp_path, legacy_url)),
                "--port",
                str(port),
            ],
            capture_output=True,
            text=True,
            timeout=30,
            cwd=ROOT,
        )
    assert out.returncode == 1 and "cannot listen" in out.stderr
    assert "proxy_started" not in out.stderr and "Traceback" not in out.stderr


def _limit_fds() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))


@pytest.mark.parametrize("event_loop", ["asyncio", "uvloop"])
def test_running_out_of_file_descriptors_is_survived_quietly(
    legacy_url: str, tmp_path: Path, event_loop: str
) -> None:
    config = _write_config(tmp_path, legacy_url, header_timeout="1s", event_loop=event_loop)
    log = (tmp_path / "stderr.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy", "--config", str(config), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        cwd=ROOT,
        preexec_fn=_limit_fds,
    )
    try:
        assert proc.stdout is not None
        base = proc.stdout.readline().strip().split(" at ")[-1].removesuffix("/servers/legacy/mcp")
        port = int(base.rsplit(":", 1)[1])
        socks = []
        for _ in range(300):  # far more than the proxy may hold (128 descriptors, 64 connections)
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(b"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # a head that never ends
            socks.append(s)
        time.sleep(1.5)
        for s in socks:
            s.close()
        deadline = time.monotonic() + 10
        status = None
        while time.monotonic() < deadline:
            try:
                status = asyncio.run(_healthz(base))
                if status == 200:
                    break
            except (aiohttp.ClientError, OSError):
                pass
            time.sleep(0.1)
        assert status == 200
        assert proc.poll() is None
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        log.close()
    text = (tmp_path / "stderr.log").read_text()
    assert len(text) < 100_000, f"{len(text)} bytes of log"
    assert "Traceback" not in text


@pytest.mark.parametrize("event_loop", ["asyncio", "uvloop"])
def test_out_of_descriptors_past_the_spare_one_pauses_accepting_instead_of_spinning(
    legacy_url: str, tmp_path: Path, event_loop: str
) -> None:
    """The process's descriptor limit drops below what it has open (as when every descriptor is
    taken and libuv's spare one cannot help): each accept() fails with EMFILE. The proxy logs it,
    pauses accepting (ACCEPT_RETRY_S) instead of retrying on every loop iteration (uvloop's own
    accept loop burnt a whole CPU here: ~30,000 failed accept() calls a second), and serves again
    once descriptors are back."""
    config = _write_config(tmp_path, legacy_url, event_loop=event_loop)
    log = (tmp_path / "stderr.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy", "--config", str(config), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        cwd=ROOT,
    )
    socks: list[socket.socket] = []
    try:
        assert proc.stdout is not None
        base = proc.stdout.readline().strip().split(" at ")[-1].removesuffix("/servers/legacy/mcp")
        port = int(base.rsplit(":", 1)[1])
        assert asyncio.run(_healthz(base)) == 200
        limits = resource.prlimit(proc.pid, resource.RLIMIT_NOFILE)
        process = psutil.Process(proc.pid)
        # below every descriptor but stdin/out/err: whatever it closes, it cannot open another
        resource.prlimit(proc.pid, resource.RLIMIT_NOFILE, (3, limits[1]))
        try:
            before = process.cpu_times()
            for _ in range(4):
                socks.append(socket.create_connection(("127.0.0.1", port)))
            time.sleep(1.5)
            after = process.cpu_times()
        finally:
            resource.prlimit(proc.pid, resource.RLIMIT_NOFILE, limits)
        busy_s = (after.user + after.system) - (before.user + before.system)
        assert busy_s < 0.5, f"{busy_s:.2f} s of CPU in 1.5 s of failing accept()"
        deadline = time.monotonic() + 10
        status = None
        while time.monotonic() < deadline and status != 200:
            try:
                status = asyncio.run(_healthz(base))
            except (aiohttp.ClientError, OSError):
                time.sleep(0.1)
        assert status == 200
    finally:
        for s in socks:
            s.close()
        proc.terminate()
        proc.wait(timeout=10)
        log.close()
    text = (tmp_path / "stderr.log").read_text()
    assert '"accept_failed"' in text and "Too many open files" in text
    assert "Traceback" not in text


async def test_an_accept_retry_firing_after_shutdown_is_not_a_traceback(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """asyncio answers each EMFILE on accept with a retry 1 s later; when shutdown closed the listening
    socket in between, the retry fails on fd -1. The full-process test above hits this only when its
    stop lands inside that second, so the retry is scheduled here directly (asyncio's own method)."""
    from proxy.front import listener

    loop = asyncio.get_running_loop()
    seen: list[dict] = []
    loop.set_exception_handler(lambda _loop, context: seen.append(context))
    listener.quiet_accept_errors(loop)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    sock.setblocking(False)
    sock.close()
    done = asyncio.Event()
    loop.call_soon(loop._start_serving, asyncio.Protocol, sock, None, None, 100)  # type: ignore[attr-defined]
    loop.call_soon(done.set)
    await asyncio.wait_for(done.wait(), 1)
    assert seen == []
    assert "Traceback" not in capsys.readouterr().err


async def _healthz(base: str) -> int:
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"{base}/healthz", timeout=aiohttp.ClientTimeout(total=2)) as resp,
    ):
        return resp.status
