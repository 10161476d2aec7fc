"""`mcp-tasks-proxy [--config FILE] [--host H] [--port P]`: serve a config until SIGINT/SIGTERM.

Without `--config` it starts the bundled demo server and fronts it, so the product can be tried
with one command.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator

import structlog
from aiohttp import web

from proxy import __version__
from proxy.app import DRAIN_KEY, build_app, drain
from proxy.cli.check_config import missing_commands, replica_problems
from proxy.config import Config, ConfigError, TracingConfig, config_from_data, load_config
from proxy.front import listener
from proxy.runtime import event_loop, tracing
from proxy.runtime.logs import configure_logging
from proxy.tasks.dirlock import lock_directory, unlock_directory
from proxy.tasks.store import StoreLockedError, StoreUnavailableError
from proxy.upstream.stdio import die_with_parent

# After the drain ends (its deadline, or a second signal), how long (s) open connections get before
# they are aborted: a client that stopped reading or sending must not hold the exit.
CLOSE_GRACE_S = 1.0

log = structlog.get_logger("proxy.cli")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mcp-tasks-proxy",
        description="Reverse proxy that turns slow tools/call on legacy MCP servers into durable MCP tasks.",
        epilog="Other commands: `mcp-tasks-proxy check-config FILE` validates a config and prints what it "
        "will serve; "
        "`mcp-tasks-proxy schema` prints the config file's JSON Schema; "
        "`mcp-tasks-proxy hash-token` prints the hash to put in auth.tokens; "
        "`mcp-tasks-proxy tasks --store DIR list|show ID|cancel ID` inspects a task store.",
    )
    parser.add_argument("--config", "-c", help="YAML or JSON config file; without it, the bundled demo runs")
    parser.add_argument("--host", help="listen host (overrides listen.host)")
    parser.add_argument("--port", type=int, help="listen port (overrides listen.port; 0 picks a free one)")
    parser.add_argument(
        "--log-level",
        default=os.environ.get("MCP_TASKS_PROXY_LOG_LEVEL"),
        help="debug, info, warning or error (overrides logging.level)",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    return parser


def run(argv: list[str]) -> int:
    """Serve the config `argv` names (or the demo without `--config`); the exit status: 0 after
    SIGINT/SIGTERM, 2 for a config that cannot be used, 1 for a store in use or unusable, or an
    address that cannot be bound."""
    args = _parser().parse_args(argv)
    # Until the event loop's own handlers are set, SIGTERM acts as Ctrl-C: what has started (the
    # demo's child and temporary store) is cleaned up, not left behind by the default action.
    previous = signal.signal(signal.SIGTERM, _as_interrupt)
    try:
        return _run(args)
    except KeyboardInterrupt:
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run(args: argparse.Namespace) -> int:
    """`run` once its arguments are parsed and SIGTERM acts as Ctrl-C; the same exit statuses."""
    configure_logging(args.log_level or "info")
    try:
        if args.config is None:
            if problems := tracing.problems(TracingConfig()):  # the OTEL_* variables
                raise ConfigError("; ".join(problems))
            event_loop.run(_run_demo(args), "asyncio")
            return 0
        config = load_config(args.config)
        _override(config, args)
        if problems := replica_problems(config) + tracing.problems(config.tracing):
            raise ConfigError(f"{args.config}: invalid config: " + "; ".join(problems))
        if args.log_level is None:
            configure_logging(config.logging.level)
        for problem in missing_commands(config):
            log.error("upstream_command_missing", problem=problem)
        event_loop.run(serve(config), config.listen.event_loop)
    except (ConfigError, event_loop.EventLoopUnavailableError) as exc:
        print(f"mcp-tasks-proxy: {exc}", file=sys.stderr)
        return 2
    except (StoreLockedError, StoreUnavailableError) as exc:
        print(f"mcp-tasks-proxy: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"mcp-tasks-proxy: cannot listen: {exc}", file=sys.stderr)
        return 1
    return 0


def _as_interrupt(signum: int, frame: object) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM during the clean-up ends it
    raise KeyboardInterrupt  # (not a re-sent SIGINT: a process started in the background ignores it)


@contextlib.asynccontextmanager
async def _demo_upstream() -> AsyncIterator[str]:
    """Start the bundled demo server as a child process on a free loopback port; yield its URL.

    The child runs in a session of its own, so a terminal's Ctrl-C reaches the proxy alone (which
    drains, then stops the child with SIGTERM), and it dies with the proxy even on SIGKILL."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "proxy.demo.server",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        stdout=subprocess.PIPE,
        start_new_session=True,
        preexec_fn=die_with_parent,
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
    """Serve `config` until SIGINT/SIGTERM. Prints the listening URL(s) on stdout.

    The store directory's serving lock is taken first (StoreLockedError names the holder), then the
    address is bound: when that fails (OSError) nothing has started or been logged as started.
    A Redis store (`store.url`) has no lock: any number of replicas serve from it.
    """
    if config.store.redis:
        await _serve_locked(config, announce=announce, demo=demo)
        return
    try:
        lock_directory(config.store.path)
    except OSError as exc:
        raise StoreUnavailableError(f"task store {config.store.path}: {exc}") from exc
    try:
        await _serve_locked(config, announce=announce, demo=demo)
    finally:
        unlock_directory(config.store.path)


async def _serve_locked(config: Config, *, announce: bool, demo: bool) -> None:
    sock = listener.bind(config.listen.host, config.listen.port)
    config.listen.port = sock.getsockname()[1]  # the bound port (0 picked one): replicas advertise it
    loop = asyncio.get_running_loop()
    listener.quiet_accept_errors(loop)
    app = build_app(config)
    # aiohttp waits a little longer than the drain, so handlers end with their own shutdown error.
    runner, _site = await listener.start(app, config, sock)
    # What exists by now (modules, the config, the app) lives as long as the process: the cyclic
    # garbage collector need not walk it again on every full collection.
    gc.freeze()
    stop = asyncio.Event()
    # A second SIGTERM or SIGINT cuts the drain short: a replica stops waiting for its detached
    # calls, and synchronous calls are abandoned now (their clients get the shutdown's error), not
    # at drain_timeout. A connection still open CLOSE_GRACE_S later (a client that stopped reading or
    # sending) is aborted, so nothing holds the exit to drain_timeout.
    again = asyncio.Event()

    def on_signal() -> None:
        if not stop.is_set():
            stop.set()
            return
        if not again.is_set():
            log.warning("proxy_drain_cut", why="a second SIGTERM or SIGINT")
            loop.call_later(CLOSE_GRACE_S, _close_connections, runner, "a second SIGTERM or SIGINT")
        again.set()
        app[DRAIN_KEY].cut()  # (before the drain starts: it starts cut)

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    host, port = runner.addresses[0][:2]
    base = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
    log.info("proxy_listening", address=f"{host}:{port}", event_loop=event_loop.running())
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
        server = runner.server
        log.info(
            "proxy_draining",
            drain_timeout_s=config.listen.drain_timeout,
            connections=len(server.connections) if server is not None else 0,
        )
        await drain(app, again)
        # (drain_timeout is the bound: aiohttp's own shutdown would wait it out twice for a handler
        # stuck writing to a client that stopped reading)
        ends_in = app[DRAIN_KEY].remaining() or 0.0
        closing = loop.call_later(ends_in + CLOSE_GRACE_S, _close_connections, runner, "the drain ended")
        try:
            await runner.cleanup()
        finally:
            closing.cancel()


def _close_connections(runner: web.AppRunner, why: str) -> None:
    runner.app[DRAIN_KEY].cutting = True
    closed = listener.close_connections(runner)
    if closed:
        log.warning("connections_aborted", connections=closed, why=why)


def _demo_hint(base: str) -> str:
    return (
        "try it: curl -s "
        f"{base}/mcp -H 'Content-Type: application/json' -H 'Accept: application/json, text/event-stream' "
        "-H 'MCP-Protocol-Version: 2026-07-28' -H 'Mcp-Method: tools/call' -H 'Mcp-Name: slow_report' "
        '-d \'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"slow_report",'
        '"arguments":{"seconds":5},"_meta":{"io.modelcontextprotocol/protocolVersion":"2026-07-28",'
        '"io.modelcontextprotocol/clientCapabilities":{"extensions":{"io.modelcontextprotocol/tasks":{}}}}}}\''
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
