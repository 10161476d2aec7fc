"""The proxy under test, in-process: configs with test-sized timings, served the way the command
line serves it (`running_proxy`) or through pytest-aiohttp's `aiohttp_server` (`serve_with`)."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from aiohttp import web
from aiohttp.test_utils import TestServer

from proxy.app import POOLS_KEY, TASKS_KEY, build_app
from proxy.config import Config, config_from_data
from proxy.front import listener
from support.servers import ROOT


@dataclass
class RunningProxy:
    """The proxy running in-process on a free loopback port (`base` is its URL); `close` shuts it
    down (the app's cleanup runs: the store closed, running tasks recorded)."""

    base: str
    config: Config
    app: web.Application
    close: Callable[[], Awaitable[None]]

    def url(self, server: str | None = None) -> str:
        """The MCP endpoint: `/mcp`, or `/servers/<server>/mcp`."""
        return f"{self.base}/mcp" if server is None else f"{self.base}/servers/{server}/mcp"

    @property
    def store(self):
        """The live TaskStore of this proxy."""
        return self.app[TASKS_KEY].store

    async def stop(self) -> None:
        """Shut the proxy down now (also done at the end of its block or test)."""
        await self.close()


async def _ready(app: web.Application) -> None:
    """Wait (briefly) until the upstream sessions are open, so test timings count calls only."""
    await asyncio.gather(*(pool.check(timeout_s=5) for pool in app[POOLS_KEY].values()))


@asynccontextmanager
async def running_proxy(config: Config) -> AsyncIterator[RunningProxy]:
    """Serve `config` on 127.0.0.1 with a free port for the duration of the block, the way the
    command line serves it (`front.listener`: header timeouts, the connection cap, malformed HTTP
    answered as JSON-RPC), for the tests of those parts; every other test uses `serve`."""
    config.listen.host, config.listen.port = "127.0.0.1", 0
    app = build_app(config)
    runner, _site = await listener.start(app, config)
    host, port = runner.addresses[0][:2]
    proxy = RunningProxy(base=f"http://{host}:{port}", config=config, app=app, close=runner.cleanup)
    await _ready(app)
    try:
        yield proxy
    finally:
        await runner.cleanup()


ServerFactory = Callable[..., Awaitable[TestServer]]
Serve = Callable[..., Awaitable[RunningProxy]]  # the `serve` fixture: serve(config, at_listen_port=False)


async def serve_with(
    aiohttp_server: ServerFactory, config: Config, *, at_listen_port: bool = False
) -> RunningProxy:
    """Serve `config` through pytest-aiohttp's `aiohttp_server` fixture (which stops it at the end
    of the test): the in-process way most tests use. With `at_listen_port`, at `listen.port` (give
    it a free one): the address a replica advertises to its peers."""
    app = build_app(config)
    # A config with a public URL is served at its port (its OAuth resource URIs name it).
    public = urlsplit(config.listen.public_url) if config.listen.public_url else None
    port = {"port": public.port} if public is not None and public.port else {}
    if at_listen_port:
        port = {"port": config.listen.port}
    # aiohttp waits for handlers at shutdown as long as the command line does (drain_timeout + 1 s).
    server = await aiohttp_server(app, shutdown_timeout=config.listen.drain_timeout + 1.0, **port)
    proxy = RunningProxy(
        base=str(server.make_url("")).rstrip("/"), config=config, app=app, close=server.close
    )
    await _ready(app)
    return proxy


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


FIXTURE = [sys.executable, str(ROOT / "tests" / "fixtures" / "legacy_server.py"), "--stdio"]


def stdio_config(
    tmp_path: Path, server: dict | None = None, tasks: dict | None = None, extra_servers: dict | None = None
) -> Config:
    """A config with the fixture server as stdio server `fx` (detach after 100 ms); `server` adds keys
    to its entry, `extra_servers` more servers."""
    return config_from_data(
        {
            "store": {"path": str(tmp_path / "store"), "durable": False},
            "tasks": {"detach_after": "100ms", "ttl": "10m", "poll_interval": "100ms", **(tasks or {})},
            "mcpServers": {
                "fx": {"command": FIXTURE[0], "args": FIXTURE[1:], **(server or {})},
                **(extra_servers or {}),
            },
        }
    )


def with_auth(url: str, tmp_path: Path, auth: dict, **extra: object) -> Config:
    """A one-server config in front of `url` with the `auth` section given (and `extra` sections)."""
    return config_from_data(
        {
            "store": {"path": str(tmp_path / "store"), "durable": False},
            "tasks": {"detach_after": "50ms", "poll_interval": "100ms"},
            "auth": auth,
            "mcpServers": {"legacy": {"url": url}},
            **extra,
        }
    )
