"""Shared test parts: real legacy upstreams in subprocesses, the proxy in-process, a raw HTTP client."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from redis_server import RedisServer

from proxy.app import POOLS_KEY, TASKS_KEY, build_app
from proxy.config import Config, config_from_data
from proxy.front import listener
from proxy.protocol.era import (
    META_CLIENT_CAPABILITIES,
    META_PROTOCOL_VERSION,
    MODERN_VERSION,
    TASKS_EXTENSION,
)
from proxy.protocol.sse import iter_events
from proxy.tasks.diskcache_store import DiskcacheStore
from proxy.tasks.model import TaskRecord, now_ms

ROOT = Path(__file__).resolve().parent.parent
TASKS_CAPS = {"extensions": {TASKS_EXTENSION: {}}}


class ServerProcess:
    """A child process that prints `listening on URL` on stdout once ready."""

    def __init__(
        self, argv: list[str], *, env: dict[str, str] | None = None, ready_prefix: str = "listening on "
    ) -> None:
        self.proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
            cwd=ROOT,
            text=True,
        )
        assert self.proc.stdout is not None
        self.lines: list[str] = []
        for _ in range(50):
            line = self.proc.stdout.readline()
            if not line:
                break
            self.lines.append(line.strip())
            if line.startswith(ready_prefix):
                self.url = line.strip().removeprefix(ready_prefix)
                return
        self.stop()
        raise RuntimeError(f"{argv} did not start: {self.lines!r}")

    def kill(self) -> None:
        """SIGKILL the child (no cleanup runs) and reap it."""
        self.proc.kill()
        self.proc.wait()
        if self.proc.stdout:
            self.proc.stdout.close()

    def stop(self) -> None:
        """Terminate (then kill) the child and reap it."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout:
            self.proc.stdout.close()


def npm_install(folder: Path, *packages: str, timeout_s: float = 300) -> None:
    """`npm install packages` into `folder` (an ignored folder of the checkout, with its own
    package.json), as the tests that need Node packages do on first run. Fails when npm is missing."""
    npm = shutil.which("npm")
    assert npm, f"npm must be on the PATH to install {', '.join(packages)} (README: Run all tests)"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "package.json").write_text('{"private": true}\n')
    subprocess.run(
        [npm, "install", "--silent", "--no-audit", "--no-fund", *packages],
        cwd=folder,
        check=True,
        timeout=timeout_s,
    )


def python_venv(folder: Path, requirement: str, *, timeout_s: float = 600) -> Path:
    """A virtual environment in `folder` (an ignored folder of the checkout) with `requirement`
    pip-installed, for tests that run an SDK other than the project's own (e.g. `mcp==1.26.0`).
    Built on first use and reused while its marker file names the same requirement; returns its
    `python`. Fails when the venv cannot be created or pip cannot install (network, index)."""
    python = folder / "bin" / "python"
    marker = folder / f".installed-{requirement}"
    if not marker.exists():
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(folder)], check=True, timeout=120)
        subprocess.run(
            [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", requirement],
            check=True,
            timeout=timeout_s,
        )
        marker.write_text("")
    return python


def make_record(**fields: Any) -> TaskRecord:
    """A task record with test defaults (principal `p`, server `s`, owner `ghost`); `fields` override."""
    defaults: dict[str, Any] = {
        "task_id": "task-1",
        "principal": "p",
        "server": "s",
        "tool": "t",
        "created_ms": now_ms(),
        "ttl_ms": 60_000,
        "poll_interval_ms": 500,
        "owner": "ghost",
    }
    record = TaskRecord(**{**defaults, **fields})
    if record.status.terminal and record.terminal_ms is None:
        record.terminal_ms = record.last_updated_ms
    return record


def seed_store(path: Path, *records: TaskRecord) -> None:
    """Write records into a diskcache store directory from synchronous test code."""

    async def seed() -> None:
        store = DiskcacheStore(path, durable=False)
        try:
            for record in records:
                await store.create(record)
        finally:
            await store.close()

    asyncio.run(seed())


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A real redis-server (appendonly yes, everysec) on a free loopback port with its own temp
    directory, one per test session; tests keep apart through key prefixes (`redis_prefix`)."""
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture
def redis_prefix() -> str:
    """A key prefix of this test's own on the shared `redis_server`."""
    return f"test-{os.urandom(6).hex()}:"


@pytest.fixture(scope="session")
def legacy_url() -> Iterator[str]:
    """URL of the legacy fixture server (official mcp SDK, handshake era only), one per test session."""
    server = ServerProcess([sys.executable, "tests/fixtures/legacy_server.py", "--port", "0"])
    yield server.url
    server.stop()


@dataclass
class RunningProxy:
    """The proxy running in-process on a free loopback port."""

    base: str
    config: Config
    app: web.Application
    runner: web.AppRunner

    def url(self, server: str | None = None) -> str:
        """The MCP endpoint: `/mcp`, or `/servers/<server>/mcp`."""
        return f"{self.base}/mcp" if server is None else f"{self.base}/servers/{server}/mcp"

    @property
    def store(self):
        """The live TaskStore of this proxy."""
        return self.app[TASKS_KEY].store

    async def stop(self) -> None:
        """Shut the proxy down (runs its cleanup: store closed, running tasks recorded)."""
        await self.runner.cleanup()


@asynccontextmanager
async def running_proxy(config: Config) -> AsyncIterator[RunningProxy]:
    """Serve `config` on 127.0.0.1 with a free port for the duration of the block."""
    config.listen.host, config.listen.port = "127.0.0.1", 0
    app = build_app(config)
    runner, _site = await listener.start(app, config)  # served the way the command line serves it
    host, port = runner.addresses[0][:2]
    proxy = RunningProxy(base=f"http://{host}:{port}", config=config, app=app, runner=runner)
    # Wait (briefly) until the upstream sessions are open, so test timings count calls only.
    await asyncio.gather(*(pool.check(timeout_s=5) for pool in app[POOLS_KEY].values()))
    try:
        yield proxy
    finally:
        await runner.cleanup()


@asynccontextmanager
async def served_app(app: web.Application) -> AsyncIterator[int]:
    """Serve a small aiohttp `app` on a free loopback port for the block; yields the port."""
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield runner.addresses[0][1]
    finally:
        await runner.cleanup()


def make_config(
    upstream_url: str,
    store_path: Path,
    *,
    tasks: dict | None = None,
    server: dict | None = None,
    name: str = "legacy",
) -> Config:
    """A one-server config with test-sized timings (detach after 50 ms)."""
    return config_from_data(
        {
            "store": {"path": str(store_path), "durable": False},
            "tasks": {"detach_after": "50ms", "ttl": "10m", "poll_interval": "100ms", **(tasks or {})},
            "mcpServers": {name: {"url": upstream_url, **(server or {})}},
        }
    )


@pytest.fixture
async def proxy(legacy_url: str, tmp_path: Path) -> AsyncIterator[RunningProxy]:
    """The proxy in front of the legacy fixture server with default test settings."""
    async with running_proxy(make_config(legacy_url, tmp_path / "store")) as running:
        yield running


def envelope(capabilities: dict | None = None, **extra: Any) -> dict:
    """A 2026-07-28 `_meta` envelope."""
    return {
        META_PROTOCOL_VERSION: MODERN_VERSION,
        META_CLIENT_CAPABILITIES: capabilities if capabilities is not None else {},
        **extra,
    }


@dataclass
class Reply:
    """One HTTP exchange: status, parsed final JSON-RPC message, notifications seen before it."""

    status: int
    message: dict
    notifications: list[dict]
    content_type: str

    @property
    def result(self) -> dict:
        assert "result" in self.message, self.message
        return self.message["result"]

    @property
    def error(self) -> dict:
        assert "error" in self.message, self.message
        return self.message["error"]


class ModernClient:
    """A raw 2026-07-28 client over aiohttp: builds the envelope and routing headers itself."""

    def __init__(self, url: str, *, capabilities: dict | None = None) -> None:
        self.url = url
        self.capabilities = TASKS_CAPS if capabilities is None else capabilities
        self.http = aiohttp.ClientSession()
        self._ids = 0

    async def close(self) -> None:
        await self.http.close()

    def headers_for(self, method: str, params: dict) -> dict[str, str]:
        headers = {
            "Content-Type": "application/json",
            "Accept": "application/json, text/event-stream",
            "MCP-Protocol-Version": MODERN_VERSION,
            "Mcp-Method": method,
        }
        if method in ("tools/call", "prompts/get"):
            headers["Mcp-Name"] = params.get("name", "")
        elif method == "resources/read":
            headers["Mcp-Name"] = params.get("uri", "")
        elif method.startswith("tasks/") and "taskId" in params:
            headers["Mcp-Name"] = str(params["taskId"])
        return headers

    async def request(
        self,
        method: str,
        params: dict | None = None,
        *,
        capabilities: dict | None = None,
        headers: dict | None = None,
        meta: dict | None = None,
    ) -> Reply:
        """Send one request; parse a JSON or SSE reply."""
        self._ids += 1
        params = dict(params or {})
        params["_meta"] = {
            **envelope(self.capabilities if capabilities is None else capabilities),
            **(meta or {}),
        }
        body = {"jsonrpc": "2.0", "id": self._ids, "method": method, "params": params}
        all_headers = {**self.headers_for(method, params), **(headers or {})}
        return await self.post_raw(json.dumps(body).encode(), all_headers)

    async def post_raw(self, data: bytes, headers: dict[str, str]) -> Reply:
        """POST raw bytes; parse the reply as JSON-RPC (JSON or SSE)."""
        async with self.http.post(self.url, data=data, headers=headers) as resp:
            ctype = resp.headers.get("Content-Type", "")
            notes: list[dict] = []
            if ctype.startswith("text/event-stream"):
                final: dict = {}
                async for event in iter_events(resp.content.iter_any()):
                    if not event.data:
                        continue
                    msg = json.loads(event.data)
                    if "id" in msg and "method" not in msg:
                        final = msg
                    else:
                        notes.append(msg)
                return Reply(resp.status, final, notes, ctype)
            text = await resp.text()
            return Reply(resp.status, json.loads(text) if text else {}, notes, ctype)

    async def call(self, tool: str, arguments: dict | None = None, **kwargs: Any) -> Reply:
        """`tools/call`."""
        return await self.request("tools/call", {"name": tool, "arguments": arguments or {}}, **kwargs)

    async def get(self, task_id: str, **kwargs: Any) -> Reply:
        """`tasks/get`."""
        return await self.request("tasks/get", {"taskId": task_id}, **kwargs)

    async def warm_up(self) -> None:
        """Open the upstream session for this client's capabilities with a `greet` call, and wait for
        it to end even when it became a task (the detach clock counts the session's start-up)."""
        reply = await self.call("greet", {"name": "warm-up"})
        if reply.result.get("resultType") == "task":
            await self.wait_terminal(reply.result["taskId"])

    async def wait_terminal(self, task_id: str, timeout: float = 10.0) -> dict:
        """Poll `tasks/get` until the task is terminal; return the DetailedTask."""
        return await self.wait_status(task_id, ("completed", "failed", "cancelled"), timeout)

    async def wait_status(self, task_id: str, statuses: tuple[str, ...], timeout: float = 10.0) -> dict:
        """Poll `tasks/get` (every 20 ms) until the status is one of `statuses`."""
        async with asyncio.timeout(timeout):
            while True:
                task = (await self.get(task_id)).result
                if task["status"] in statuses:
                    return task
                await asyncio.sleep(0.02)


FIXTURE_STDIO = {
    "command": sys.executable,
    "args": [str(ROOT / "tests" / "fixtures" / "legacy_server.py"), "--stdio"],
}


@pytest.fixture(params=["http", "stdio"])
async def flow_proxy(
    request: pytest.FixtureRequest, legacy_url: str, tmp_path: Path
) -> AsyncIterator[RunningProxy]:
    """The proxy in front of the legacy fixture server over Streamable HTTP and, as a second run,
    over stdio (the same server as a child process): the core flows must hold on both."""
    config = make_config(legacy_url, tmp_path / "store")
    if request.param == "stdio":
        config = config_from_data(
            {
                "store": {"path": str(tmp_path / "store"), "durable": False},
                "tasks": {"detach_after": "50ms", "ttl": "10m", "poll_interval": "100ms"},
                "mcpServers": {"legacy": FIXTURE_STDIO},
            }
        )
    async with running_proxy(config) as running:
        yield running


@pytest.fixture
async def flow_client(flow_proxy: RunningProxy) -> AsyncIterator[ModernClient]:
    """A raw modern client (tasks extension declared) for `flow_proxy`."""
    c = ModernClient(flow_proxy.url())
    yield c
    await c.close()


@pytest.fixture
async def client(proxy: RunningProxy) -> AsyncIterator[ModernClient]:
    """A raw modern client (tasks extension declared) pointed at the test proxy."""
    c = ModernClient(proxy.url())
    yield c
    await c.close()
