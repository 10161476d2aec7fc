"""Command line: `mcp-tasks-proxy [--config FILE] [--host H] [--port P]`.

Without `--config` it starts the bundled demo server and fronts it, so the product can be tried
with one command.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator

import structlog

from proxy import __version__
from proxy.app import build_app, drain
from proxy.config import Config, ConfigError, StoreConfig, config_from_data, config_json_schema, load_config
from proxy.front import listener
from proxy.front.auth import hash_token
from proxy.replicas import advertised_url
from proxy.runtime import event_loop
from proxy.runtime.logs import configure_logging
from proxy.tasks.dirlock import lock_directory, unlock_directory
from proxy.tasks.model import Change, TaskStatus, TerminalTaskError, iso
from proxy.tasks.open_store import open_store
from proxy.tasks.store import ListFilter, StoreLockedError, StoreUnavailableError, TaskNotFoundError
from proxy.tasks.wire_v2 import detailed_task


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mcp-tasks-proxy",
        description="Reverse proxy that turns slow tools/call on legacy MCP servers into durable MCP tasks.",
        epilog="Other commands: `mcp-tasks-proxy check-config FILE` validates a config and prints what it will serve; "
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


@contextlib.asynccontextmanager
async def _demo_upstream() -> AsyncIterator[str]:
    """Start the bundled demo server as a child process on a free loopback port; yield its URL."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "proxy.demo.server",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
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
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    host, port = runner.addresses[0][:2]
    base = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
    structlog.get_logger("proxy.cli").info(
        "proxy_listening", address=f"{host}:{port}", event_loop=event_loop.running()
    )
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
        again = asyncio.Event()  # a second SIGTERM or SIGINT ends a replica's wait for its detached calls
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, again.set)
        await drain(app, again)
        await runner.cleanup()


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


def replica_problems(config: Config) -> list[str]:
    """What stops `config` (after --host/--port) from serving as a replica: a wildcard listen host
    without `replicas.advertise`. Empty when fine or when it is no replica."""
    if config.replicas is None:
        return []
    try:
        advertised_url(config)
    except ValueError as exc:
        return [str(exc)]
    return []


def describe(config: Config, source: str) -> str:
    """What a config will serve, as text: listen address, store, and per server its upstream,
    routes and task policy (durations in seconds)."""
    base = f"http://{config.listen.host}:{config.listen.port}"
    durability = "Redis persistence" if config.store.redis else config.store.durable
    lines = [
        f"{source}: valid",
        f"listen {base}  store {config.store.where}  (durable: {durability})  event loop {event_loop.describe(config.listen.event_loop)}",
    ]
    if config.replicas is not None:
        lines.append(
            f"replica of a shared store: advertised as {advertised_url(config)}, hop_timeout {config.replicas.hop_timeout:g}s, "
            f"drain_detached {config.listen.drain_detached:g}s"
        )
    d = config.tasks
    lines.append(
        f"defaults: detach_after {d.detach_after:g}s, ttl {d.ttl:g}s, poll_interval {d.poll_interval:g}s, input_timeout {d.input_timeout:g}s"
    )
    for name, entry in config.mcpServers.items():
        if not entry.active:
            lines.append(f"- {name}: disabled")
            continue
        upstream = entry.url if entry.url else "stdio: " + " ".join([entry.command or "", *entry.args])
        routes = f"{base}/servers/{name}/mcp" + (f" and {base}/mcp" if len(config.servers) == 1 else "")
        lines.append(f"- {name}: {upstream}")
        lines.append(f"    served at {routes}; hard timeout {entry.timeout:g}s")
        tasks = entry.tasks
        overrides = {
            k: getattr(tasks, k)
            for k in ("detach_after", "ttl", "poll_interval", "input_timeout")
            if getattr(tasks, k) is not None
        }
        if overrides:
            lines.append("    tasks: " + ", ".join(f"{k} {v:g}s" for k, v in overrides.items()))
        for tool in tasks.tools:
            policy = config.policy(name, tool)
            lines.append(
                f"    tool {tool}: mode {policy.mode.value}, detach_after {policy.detach_after:g}s, ttl {policy.ttl:g}s"
            )
    return "\n".join(lines)


def missing_commands(config: Config) -> list[str]:
    """One sentence per enabled stdio server whose `command` cannot be found or run (looked up on
    the PATH its child would get, relative to its `cwd`); empty when all are runnable."""
    problems = []
    for name, entry in config.servers.items():
        if not entry.command:
            continue
        path = entry.env.get("PATH", os.environ.get("PATH", os.defpath))
        command = entry.command
        if os.sep in command and entry.cwd and not os.path.isabs(command):
            command = os.path.join(entry.cwd, command)
        if shutil.which(command, path=path) is None:
            where = "is not an executable file" if os.sep in command else "is not on the PATH"
            problems.append(f"mcpServers.{name}.command: {entry.command!r} {where}")
    return problems


def _check_config(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="mcp-tasks-proxy check-config", description="Validate a config file and say what it will serve."
    )
    parser.add_argument("file")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.file)
    except ConfigError as exc:
        print(f"mcp-tasks-proxy: {exc}", file=sys.stderr)
        return 2
    problems = (
        missing_commands(config) + replica_problems(config) + event_loop.problems(config.listen.event_loop)
    )
    if problems:
        print(f"mcp-tasks-proxy: {args.file}: invalid config\n" + "\n".join(problems), file=sys.stderr)
        return 2
    print(describe(config, args.file))
    return 0


def _tasks_command(argv: list[str]) -> int:
    """`mcp-tasks-proxy tasks [--store DIR | --config FILE] list|show ID|cancel ID` on a store directory."""
    parser = argparse.ArgumentParser(
        prog="mcp-tasks-proxy tasks", description="Inspect or cancel tasks in a store directory."
    )
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--store", help="the store directory (store.path)")
    where.add_argument("--config", help="a config file; its store (store.path or store.url) is used")
    sub = parser.add_subparsers(dest="action", required=True)
    listing = sub.add_parser("list", help="one line per task, newest first")
    listing.add_argument("--status", choices=[s.value for s in TaskStatus])
    listing.add_argument("--limit", type=int, default=100)
    sub.add_parser("show", help="one task as JSON").add_argument("task_id")
    sub.add_parser("cancel", help="mark a task cancelled (sticky)").add_argument("task_id")
    # Task ids are base64url and may start with "-": never let argparse read them as options.
    for i, word in enumerate(argv[:-1]):
        if (
            word in ("show", "cancel")
            and argv[i + 1].startswith("-")
            and argv[i + 1] not in ("-h", "--help", "--")
        ):
            argv = [*argv[: i + 1], "--", *argv[i + 1 :]]
            break
    args = parser.parse_args(argv)
    try:
        store_cfg = StoreConfig(path=args.store) if args.store else load_config(args.config).store
    except ConfigError as exc:
        print(f"mcp-tasks-proxy: {exc}", file=sys.stderr)
        return 2
    if not store_cfg.redis and not os.path.isdir(store_cfg.path):
        print(f"mcp-tasks-proxy: no store at {store_cfg.path}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(_tasks_action(args, store_cfg))
    except StoreUnavailableError as exc:
        print(f"mcp-tasks-proxy: {exc}", file=sys.stderr)
        return 1


async def _tasks_action(args: argparse.Namespace, store_cfg: StoreConfig) -> int:
    """The `tasks` subcommand's work on an open (shared, unlocked) store; returns the exit status."""
    try:
        store = open_store(
            store_cfg.model_copy(update={"durable": True}), max_result_bytes=16 * 1024 * 1024, exclusive=False
        )
    except StoreUnavailableError as exc:
        print(f"mcp-tasks-proxy: {exc}", file=sys.stderr)
        return 1
    try:
        if args.action == "list":
            records, more = await store.list_tasks(ListFilter(status=args.status), limit=args.limit)
            print(f"{'TASK ID':44} {'STATUS':15} {'SERVER':12} {'TOOL':24} CREATED")
            for r in records:
                print(
                    f"{r.task_id:44} {r.status.value:15} {r.server[:12]:12} {r.tool[:24]:24} {iso(r.created_ms)}"
                )
            print(
                f"{len(records)} task(s)"
                + (f" shown; more exist beyond --limit {args.limit}" if more else "")
            )
            return 0
        record = await store.get(args.task_id)
        if record is None:
            print(f"mcp-tasks-proxy: unknown or expired task {args.task_id}", file=sys.stderr)
            return 1
        if args.action == "show":
            out = {
                "server": record.server,
                "tool": record.tool,
                "principal": record.principal,
                "owner": record.owner,
                **detailed_task(record),
            }
            out.pop("resultType", None)
            print(json.dumps(out, indent=2))
            return 0
        if record.status.terminal:
            print(f"task {record.task_id} is already {record.status.value}")
            return 0
        try:
            await store.update(
                record.task_id,
                Change(
                    status=TaskStatus.CANCELLED, status_message="cancelled by an operator", input_requests={}
                ),
            )
        except (TerminalTaskError, TaskNotFoundError):
            print(f"task {record.task_id} ended meanwhile")
            return 0
        print(
            f"task {record.task_id} cancelled (a running proxy stops the upstream call at its next progress update "
            "or sweep, within half of store.lease, and discards any later result)"
        )
        return 0
    finally:
        await store.close()


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `mcp-tasks-proxy` console script; returns the exit status.

    Subcommands: `check-config FILE`, `schema` (print the config's JSON Schema), `hash-token
    [TOKEN]` (the `sha256:…` form for `auth.tokens`; reads stdin without an argument); otherwise serve.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["check-config"]:
        return _check_config(argv[1:])
    if argv[:1] == ["tasks"]:
        return _tasks_command(argv[1:])
    if argv[:1] == ["hash-token"]:
        if argv[1:2] in (["-h"], ["--help"]):
            print(
                "usage: mcp-tasks-proxy hash-token [TOKEN]\n\nPrint sha256:<hex> for auth.tokens (reads the token from stdin without an argument)."
            )
            return 0
        token = argv[1] if len(argv) > 1 else sys.stdin.readline().strip()
        if not token:
            print("mcp-tasks-proxy: hash-token needs a non-empty token (argument or stdin)", file=sys.stderr)
            return 2
        print(hash_token(token))
        return 0
    if argv[:1] == ["schema"]:
        print(json.dumps(config_json_schema(), indent=2, sort_keys=True))
        return 0
    args = _parser().parse_args(argv)
    configure_logging(args.log_level or "info")
    try:
        if args.config is None:
            event_loop.run(_run_demo(args), "asyncio")
            return 0
        config = load_config(args.config)
        _override(config, args)
        if problems := replica_problems(config):
            raise ConfigError(f"{args.config}: invalid config: " + "; ".join(problems))
        if args.log_level is None:
            configure_logging(config.logging.level)
        for problem in missing_commands(config):
            structlog.get_logger("proxy.cli").error("upstream_command_missing", problem=problem)
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
    except KeyboardInterrupt:
        pass
    return 0
