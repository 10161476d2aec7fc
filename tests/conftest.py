"""Fixtures the whole suite shares: real legacy upstreams and a real redis-server in subprocesses,
the proxy in-process on pytest-aiohttp's `aiohttp_server`, raw clients; and the rule for a missing
external part (a test marked `redis`, `haproxy`, `node`, `browser` or `prometheus` fails under
`CI=true` and is skipped with the reason elsewhere). Helpers live in `tests/support/`."""

from __future__ import annotations

import functools
import os
import shutil
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import pytest
from support.clients import ModernClient
from support.proxy import RunningProxy, make_config, serve_with
from support.redis_server import RedisServer, redis_server_binary
from support.servers import FIXTURE_STDIO, ServerProcess

from proxy.config import Config, config_from_data


def _missing_redis() -> str | None:
    return None if redis_server_binary() else "redis-server is not installed (Debian: redis-server)"


def _missing_haproxy() -> str | None:
    found = shutil.which("haproxy") or os.path.exists("/usr/sbin/haproxy")
    return None if found else "haproxy is not installed (Debian: haproxy)"


def _missing_node() -> str | None:
    if shutil.which("npm") and shutil.which("node"):
        return None
    return "Node.js and npm are not installed (Debian: nodejs, npm; npm fetches Node 22 and the MCP tools)"


def _missing_browser() -> str | None:
    if not (shutil.which("chromium") or os.path.exists("/usr/bin/chromium")):
        return "Chromium is not installed (Debian: chromium)"
    try:
        import playwright  # noqa: F401
    except ImportError:
        return "the playwright package is not installed (the test extra)"
    return None


def _missing_prometheus() -> str | None:
    if shutil.which("promtool") and shutil.which("prometheus"):
        return None
    return "Prometheus is not installed (Debian: prometheus, which has promtool)"


# Marker → what is missing on this machine for it (None: everything is there).
EXTERNAL_PARTS: dict[str, Callable[[], str | None]] = {
    "redis": _missing_redis,
    "haproxy": _missing_haproxy,
    "node": _missing_node,
    "browser": _missing_browser,
    "prometheus": _missing_prometheus,
}


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A test that needs an external part the machine lacks fails under CI (`CI=true`: CI installs
    everything, so a missing part is a broken set-up) and is skipped with the reason elsewhere."""
    for marker in item.iter_markers():
        check = EXTERNAL_PARTS.get(marker.name)
        problem = check() if check is not None else None
        if problem is not None:
            fail_or_skip(problem)


def fail_or_skip(problem: str) -> None:
    """The one rule for a missing external part: fail under `CI=true`, skip with `problem` elsewhere."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"{problem}; CI=true needs every external part (scripts/test.sh installs them)")
    pytest.skip(problem)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A real redis-server (appendonly yes, everysec) on a free loopback port with its own temp
    directory, one per test session; tests keep apart through key prefixes (`redis_prefix`)."""
    problem = _missing_redis()
    if problem is not None:  # a fixture of a test marked `redis` (its setup has ruled already)
        fail_or_skip(problem)
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


@pytest.fixture
def serve(aiohttp_server: Callable[..., Awaitable[object]]) -> Callable[[Config], Awaitable[RunningProxy]]:
    """`await serve(config)`: the proxy for `config` in-process on pytest-aiohttp's `aiohttp_server`
    (stopped, with its cleanup, at the end of the test)."""
    return functools.partial(serve_with, aiohttp_server)  # type: ignore[arg-type]


@pytest.fixture
async def proxy(
    legacy_url: str, tmp_path: Path, serve: Callable[[Config], Awaitable[RunningProxy]]
) -> RunningProxy:
    """The proxy in front of the legacy fixture server with default test settings."""
    return await serve(make_config(legacy_url, tmp_path / "store"))


@pytest.fixture(params=["http", "stdio"])
async def flow_proxy(
    request: pytest.FixtureRequest,
    legacy_url: str,
    tmp_path: Path,
    serve: Callable[[Config], Awaitable[RunningProxy]],
) -> RunningProxy:
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
    return await serve(config)


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
