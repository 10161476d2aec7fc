"""A local replica cluster: redis-server, N proxy replicas of one config file, HAProxy in front.

Used by tests/test_replicas.py, scripts/chaos.py and the replica bench; also runnable by hand:

    python scripts/cluster.py --upstream http://127.0.0.1:9000/mcp     # prints the URLs, Ctrl-C stops all

    from scripts.cluster import Cluster
    with Cluster(upstream_url=url, settings={"MCP_LEASE": "600ms"}) as cluster:
        cluster.url              # HAProxy's base URL (http://127.0.0.1:P); MCP at /servers/web/mcp
        cluster.replica_urls     # each replica's base URL
        cluster.kill(0)          # SIGKILL replica 0 (no cleanup runs)
        cluster.terminate(1)     # SIGTERM replica 1 and wait for it to drain and exit
        cluster.restart(1)       # start it again on the same port; returns once HAProxy sees it up
        cluster.rolling_restart()  # terminate + restart each replica in turn

Everything runs on loopback, each on a free port, redis in its own directory (no persistence).
Every wait is bounded (seconds, see the arguments); `stop()` ends every process it started, also
when `start()` failed half-way. Replica logs (JSON lines) go to `<workdir>/replica-<i>.log`.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import importlib.util
import io
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytimeparse2

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "config" / "replicas.yaml"
HAPROXY_CFG = ROOT / "config" / "haproxy.cfg"
HAPROXY_SLOTS = 3  # servers named in config/haproxy.cfg (unused slots point at a closed port and stay down)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _haproxy_seconds(value: str) -> float:
    """An HAProxy time (`100ms`, `1s`; a bare number is milliseconds, as HAProxy reads it) in seconds."""
    return float(value) / 1000 if value.strip().isdigit() else float(pytimeparse2.parse(value) or 0)


def _get(url: str, timeout: float = 1.0) -> tuple[int, bytes]:
    """(status, body) of a GET; status 0 when nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except (OSError, urllib.error.URLError):
        return 0, b""


def _wait(predicate: Any, timeout: float, what: str, interval: float = 0.02) -> None:
    """Poll `predicate()` until true; TimeoutError naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"cluster: {what} not within {timeout:g} s")
        time.sleep(interval)


def _end(proc: subprocess.Popen[Any] | None, sig: int = signal.SIGTERM, timeout: float = 10.0) -> None:
    """Send `sig`, wait up to `timeout` s, then SIGKILL; always reaps."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(sig)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


def _redis_server_class() -> Any:
    """`RedisServer` of tests/support/redis_server.py (the test suite's launcher: free port, own
    directory)."""
    spec = importlib.util.spec_from_file_location(
        "mcp_tasks_proxy_redis_server", ROOT / "tests" / "support" / "redis_server.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.RedisServer


class Cluster:
    """redis-server + `replicas` proxy replicas of `config` + HAProxy (`haproxy_cfg`).

    `upstream_url` is the Streamable HTTP upstream (server `web`); `settings` are environment
    variables for the replicas' config (`MCP_LEASE`, `MCP_DETACH_AFTER`, `MCP_DRAIN_DETACHED`, ...,
    see config/replicas.yaml). `check_inter` is HAProxy's health-check interval, `timeout_server`
    how long it lets a request wait for a replica's next byte before it cuts it. `ready_timeout_s`
    bounds each start, `drain_timeout_s` each SIGTERM until the replica exits.
    """

    def __init__(
        self,
        *,
        upstream_url: str,
        replicas: int = 3,
        settings: dict[str, str] | None = None,
        config: Path = CONFIG,
        haproxy_cfg: Path = HAPROXY_CFG,
        workdir: Path | None = None,
        check_inter: str = "100ms",
        timeout_server: str = "10m",
        ready_timeout_s: float = 30.0,
        drain_timeout_s: float = 60.0,
    ) -> None:
        if not 1 <= replicas <= HAPROXY_SLOTS:
            raise ValueError(
                f"config/haproxy.cfg names {HAPROXY_SLOTS} servers; replicas must be 1..{HAPROXY_SLOTS}"
            )
        self._own_workdir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="mcp-cluster-"))
        self.n = replicas
        self.config = config
        self.haproxy_cfg = haproxy_cfg
        self.check_inter = check_inter
        self.timeout_server = timeout_server
        self.ready_timeout_s = ready_timeout_s
        self.drain_timeout_s = drain_timeout_s
        self.secret = secrets.token_urlsafe(32)
        self.redis = _redis_server_class()(self.workdir / "redis", appendonly=False)
        self.ports = [free_port() for _ in range(replicas)]
        self.lb_port = free_port()
        self.stats_port = free_port()
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * replicas
        self.haproxy: subprocess.Popen[bytes] | None = None
        self.env = {
            **os.environ,
            "MCP_UPSTREAM_URL": upstream_url,
            "MCP_REPLICA_SECRET": self.secret,
            "MCP_STDIO_COMMAND": sys.executable,
            "MCP_STDIO_SCRIPT": str(ROOT / "tests" / "fixtures" / "legacy_server.py"),
            # HAProxy takes a draining replica out after two failed checks (fall 2): about 2-3 x check_inter
            "MCP_DRAIN_GRACE": f"{5 * _haproxy_seconds(check_inter):g}s",
            **(settings or {}),
        }

    # -- addresses ---------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """HAProxy's base URL; the MCP endpoints are `<url>/servers/<name>/mcp`."""
        return f"http://127.0.0.1:{self.lb_port}"

    @property
    def replica_urls(self) -> list[str]:
        """Each replica's own base URL (index = replica number)."""
        return [f"http://127.0.0.1:{port}" for port in self.ports]

    @property
    def redis_url(self) -> str:
        """The shared store's URL."""
        return self.redis.url

    def log_path(self, i: int) -> Path:
        """Where replica `i` writes its log (appended across restarts)."""
        return self.workdir / f"replica-{i}.log"

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> Cluster:
        """Start redis, every replica (in parallel), then HAProxy; return once HAProxy routes to
        every replica. Stops what it started when anything fails."""
        try:
            self.redis.start()
            self.env["MCP_REDIS_URL"] = self.redis.url
            for i in range(self.n):
                self._spawn(i)
            for i in range(self.n):
                self._wait_ready(i)
            self._start_haproxy()
            for i in range(self.n):
                self.wait_routed(i)
        except BaseException:
            self.stop()
            raise
        return self

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _spawn(self, i: int) -> None:
        log = open(self.log_path(i), "ab")  # noqa: SIM115 (the child keeps it; closed by the child's exit)
        try:
            self.procs[i] = subprocess.Popen(
                [sys.executable, "-m", "proxy", "--config", str(self.config), "--port", str(self.ports[i])],
                cwd=ROOT,
                env=self.env,
                stdout=subprocess.DEVNULL,
                stderr=log,
            )
        finally:
            log.close()

    def _wait_ready(self, i: int) -> None:
        url = f"{self.replica_urls[i]}/readyz"

        def ready() -> bool:
            proc = self.procs[i]
            if proc is None or proc.poll() is not None:
                tail = self.log_path(i).read_text(errors="replace")[-2000:]
                raise RuntimeError(f"replica {i} exited ({proc.returncode if proc else '?'}):\n{tail}")
            return _get(url, timeout=1.0)[0] == 200

        _wait(ready, self.ready_timeout_s, f"replica {i} ready on {url}", interval=0.05)

    def _start_haproxy(self) -> None:
        binary = shutil.which("haproxy") or "/usr/sbin/haproxy"
        addresses = [f"127.0.0.1:{port}" for port in self.ports] + ["127.0.0.1:1"] * (HAPROXY_SLOTS - self.n)
        env = {
            **os.environ,
            "HAPROXY_BIND": f"127.0.0.1:{self.lb_port}",
            "HAPROXY_STATS": f"127.0.0.1:{self.stats_port}",
            "HAPROXY_CHECK_INTER": self.check_inter,
            "HAPROXY_TIMEOUT_SERVER": self.timeout_server,
            **{f"REPLICA_{k}": address for k, address in enumerate(addresses)},
        }
        with open(self.workdir / "haproxy.log", "ab") as log:
            self.haproxy = subprocess.Popen(
                [binary, "-db", "-f", str(self.haproxy_cfg)], env=env, stdout=log, stderr=log
            )

        def up() -> bool:
            assert self.haproxy is not None
            if self.haproxy.poll() is not None:
                raise RuntimeError(
                    f"haproxy exited: {(self.workdir / 'haproxy.log').read_text(errors='replace')[-2000:]}"
                )
            return _get(f"http://127.0.0.1:{self.stats_port}/stats;csv")[0] == 200

        _wait(up, self.ready_timeout_s, "haproxy listening")

    def server_states(self) -> dict[str, str]:
        """HAProxy's view of each replica slot (`r0`... → `UP`, `DOWN`, `MAINT`, ...)."""
        status, body = _get(f"http://127.0.0.1:{self.stats_port}/stats;csv")
        if status != 200:
            return {}
        rows = csv.DictReader(io.StringIO(body.decode().lstrip("# ")))
        return {
            row["svname"]: row["status"]
            for row in rows
            if row.get("pxname") == "replicas" and row["svname"].startswith("r")
        }

    def wait_routed(self, i: int) -> None:
        """Wait until HAProxy counts replica `i` UP (bounded by `ready_timeout_s`)."""
        _wait(
            lambda: self.server_states().get(f"r{i}", "").startswith("UP"),
            self.ready_timeout_s,
            f"haproxy routing to replica {i}",
        )

    def alive(self, i: int) -> bool:
        """True while replica `i`'s process runs."""
        proc = self.procs[i]
        return proc is not None and proc.poll() is None

    def kill(self, i: int) -> None:
        """SIGKILL replica `i` (no drain, no cleanup: its lease lapses) and reap it."""
        proc = self.procs[i]
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)

    def terminate(self, i: int, timeout: float | None = None) -> int:
        """SIGTERM replica `i` and wait (at most `timeout` s, default `drain_timeout_s`) until it has
        drained and exited; returns its exit status. Raises TimeoutError (and SIGKILLs it) after that."""
        proc = self.procs[i]
        if proc is None or proc.poll() is not None:
            return proc.returncode if proc is not None else 0
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout=timeout or self.drain_timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
            raise TimeoutError(
                f"cluster: replica {i} did not exit within {timeout or self.drain_timeout_s:g} s of SIGTERM"
            ) from None

    def restart(self, i: int) -> None:
        """Start replica `i` again (after `kill` or `terminate`) on its port; returns once it is ready
        and HAProxy routes to it."""
        if self.alive(i):
            raise RuntimeError(f"replica {i} is still running")
        self._spawn(i)
        self._wait_ready(i)
        if self.haproxy is not None:
            self.wait_routed(i)

    def rolling_restart(self) -> None:
        """Restart every replica in turn: SIGTERM (it drains while the others serve), wait for its
        exit, start it again, wait until HAProxy routes to it, then the next one."""
        for i in range(self.n):
            self.terminate(i)
            self.restart(i)

    def stop(self) -> None:
        """Stop HAProxy, every replica (SIGTERM, bounded; SIGKILL after) and redis; remove the work
        directory if this cluster made it. Safe to call twice."""
        _end(self.haproxy, timeout=5)
        for i, proc in enumerate(self.procs):
            _end(proc, timeout=self.drain_timeout_s)
            self.procs[i] = None
        self.redis.stop()
        if self._own_workdir and not os.environ.get("MCP_CLUSTER_KEEP"):
            shutil.rmtree(self.workdir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    """Run a cluster in the foreground until Ctrl-C."""
    parser = argparse.ArgumentParser(
        description="redis + N replicas of config/replicas.yaml + HAProxy, on loopback"
    )
    parser.add_argument("--upstream", required=True, help="Streamable HTTP upstream URL (server `web`)")
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument(
        "--set", action="append", default=[], metavar="VAR=VALUE", help="a config variable, e.g. MCP_LEASE=2s"
    )
    args = parser.parse_args(argv)
    settings = dict(item.split("=", 1) for item in args.set)
    with Cluster(upstream_url=args.upstream, replicas=args.replicas, settings=settings) as cluster:
        print(
            f"haproxy: {cluster.url}/servers/web/mcp (stats http://127.0.0.1:{cluster.stats_port}/stats)",
            flush=True,
        )
        for i, url in enumerate(cluster.replica_urls):
            print(f"replica {i}: {url}  log {cluster.log_path(i)}", flush=True)
        print(f"redis: {cluster.redis_url}", flush=True)
        signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM stops the cluster like Ctrl-C
        with contextlib.suppress(KeyboardInterrupt):
            while True:
                time.sleep(3600)
    return 0


if __name__ == "__main__":
    sys.exit(main())
