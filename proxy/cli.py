"""Command line: `mcp-tasks-proxy [--config FILE] [--host H] [--port P]`.

Without `--config` it starts the bundled demo server and fronts it, so the product can be tried
with one command.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator

from aiohttp import web

from . import __version__
from .app import build_app
from .config import Config, ConfigError, config_from_data, load_config
from .logs import configure_logging


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mcp-tasks-proxy",
        description="Reverse proxy that turns slow tools/call on legacy MCP servers into durable MCP tasks.",
    )
    parser.add_argument("--config", "-c", help="YAML or JSON config file; without it, the bundled demo runs")
    parser.add_argument("--host", help="listen host (overrides listen.host)")
    parser.add_argument("--port", type=int, help="listen port (overrides listen.port; 0 picks a free one)")
    parser.add_argument("--log-level", default=os.environ.get("MCP_TASKS_PROXY_LOG_LEVEL", "info"))
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    return parser


@contextlib.asynccontextmanager
async def _demo_upstream() -> AsyncIterator[str]:
    """Start the bundled demo server as a child process on a free loopback port; yield its URL."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "proxy.demo.server", "--host", "127.0.0.1", "--port", "0",
        stdout=subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), timeout=30)).decode().strip()
        if not line.startswith("listening on "):
            raise RuntimeError(f"the demo server did not start (it printed {line!r})")
        yield line.removeprefix("listening on ")
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), timeout=5)
            except TimeoutError:
                proc.kill()
                await proc.wait()


def demo_config(upstream_url: str, store_path: str) -> Config:
    """The config the no-argument command serves: the demo server, tasks after 1 s."""
    return config_from_data(
        {
            "listen": {"host": "127.0.0.1", "port": 8080},
            "store": {"path": store_path},
            "tasks": {"detach_after": "1s", "ttl": "1h", "poll_interval": "500ms"},
            "mcpServers": {"demo": {"url": upstream_url, "timeout": "10m"}},
        },
        source="<demo>",
    )


async def serve(config: Config, *, announce: bool = True, demo: bool = False) -> None:
    """Serve `config` until SIGINT/SIGTERM. Prints the listening URL(s) on stdout."""
    app = build_app(config)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, config.listen.host, config.listen.port)
    await site.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    host, port = runner.addresses[0][:2]
    base = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
    if announce:
        for name in config.servers:
            print(f"serving {name} at {base}/servers/{name}/mcp", flush=True)
        if len(config.servers) == 1:
            print(f"listening on {base}/mcp", flush=True)
        if demo:
            print(_demo_hint(base), flush=True)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def _demo_hint(base: str) -> str:
    return (
        "try it: curl -s "
        f"{base}/mcp -H 'Content-Type: application/json' -H 'Accept: application/json, text/event-stream' "
        "-H 'MCP-Protocol-Version: 2026-07-28' -H 'Mcp-Method: tools/call' -H 'Mcp-Name: slow_report' "
        "-d '{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"tools/call\",\"params\":{\"name\":\"slow_report\","
        "\"arguments\":{\"seconds\":5},\"_meta\":{\"io.modelcontextprotocol/protocolVersion\":\"2026-07-28\","
        "\"io.modelcontextprotocol/clientCapabilities\":{\"extensions\":{\"io.modelcontextprotocol/tasks\":{}}}}}}'"
    )


async def _run_demo(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="mcp-tasks-proxy-demo-") as store_path:
        async with _demo_upstream() as upstream_url:
            config = demo_config(upstream_url, store_path)
            _override(config, args)
            print(f"demo upstream (a legacy MCP server) at {upstream_url}", flush=True)
            await serve(config, demo=True)


def _override(config: Config, args: argparse.Namespace) -> None:
    if args.host is not None:
        config.listen.host = args.host
    if args.port is not None:
        config.listen.port = args.port


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `mcp-tasks-proxy` console script; returns the exit status."""
    args = _parser().parse_args(argv)
    configure_logging(args.log_level)
    try:
        if args.config is None:
            asyncio.run(_run_demo(args))
            return 0
        config = load_config(args.config)
        _override(config, args)
        asyncio.run(serve(config))
    except ConfigError as exc:
        print(f"mcp-tasks-proxy: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"mcp-tasks-proxy: cannot listen: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    return 0
