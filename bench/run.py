"""mcp-tasks-proxy benchmark: one command, every section, one machine, one run.

    python bench/run.py                 # full run (~6-8 min on 2 cores), README table figures
    python bench/run.py --quick         # tiny sizes, seconds; what tests/app/test_bench_smoke.py runs
    python bench/run.py --sections a,c  # a subset; see --help for sizes and durations

Sections (bench/README.md has the method and the latest figures):
 a. pass-through of a short tools/call: direct, this proxy (legacy relay and 2026-07-28 path),
    PyPI mcp-proxy, FastMCP 4.x create_proxy; requests/s and p50/p99 at fixed concurrency;
 b. tasks/get throughput and p99 with N stored tasks (1,000, 100,000 and 1,000,000), diskcache and
    Redis;
 c. delay between detach_after expiring and the CreateTaskResult arriving (p50/p99), diskcache
    durable or not and Redis with `appendfsync always` or `everysec` (--stores picks the stores);
 d. proxy RSS per detached in-flight call with 10,000 concurrent detached calls;
 e. start-up time (process start -> /healthz 200) with 1,000,000 tasks in the store;
 r. (only when asked: --sections r) 1 vs 3 replicas behind HAProxy on Redis, CPU per call per tier
 (bench/replicas.py).

Every server is a child process on 127.0.0.1, stopped in a `finally` (SIGTERM, then SIGKILL), also
on Ctrl-C / SIGTERM. Load comes from bench/loadgen.py in its own process, bounded in time and count.
Results: a markdown table on stdout and JSON in bench/results/ (ignored by git).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
PY = sys.executable
sys.path.insert(0, str(BENCH))
import redis_bench  # noqa: E402  (bench/redis_bench.py)

PEERS_VENV = BENCH / ".venv-peers"
MCP_PROXY_VERSION = "0.13.0"
SERVER = "bench"  # server name in every proxy config (tasks/get needs records for this name)
FLOOR_STORE = "floor: aiohttp JSON handler, no store"  # section b's floor row
PROXY_ENV: dict[str, str] = {}  # extra environment of the proxy processes (--ref sets PYTHONPATH)

# --------------------------------------------------------------------------- processes


class Proc:
    """A child process we started; its output goes to a log file in the run's work dir."""

    registry: list[Proc] = []

    def __init__(
        self, name: str, argv: list[str], workdir: Path, *, cpus: str | None = None, env: dict | None = None
    ) -> None:
        self.name = name
        self.log_path = workdir / f"{name}.log"
        self.log = open(self.log_path, "wb")
        if cpus is not None:
            argv = [PY, str(BENCH / "pinned.py"), cpus, *argv]
        self.argv = argv
        self.started = time.perf_counter()
        self.p = subprocess.Popen(
            argv,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=ROOT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
        Proc.registry.append(self)

    @property
    def pid(self) -> int:
        return self.p.pid

    def wait_line(self, prefix: str, timeout: float = 30) -> str:
        """Wait until the log has a line starting with `prefix`; return the rest of it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.log_path.read_text(errors="replace").splitlines():
                if line.startswith(prefix):
                    return line[len(prefix) :].strip()
            if self.p.poll() is not None:
                break
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"{self.name} did not print {prefix!r}; log tail:\n{self.tail()}")

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.p.poll() is None:
            # The whole process group: a peer's stdio children go with it. SIGTERM, not SIGINT: a
            # child started from a background shell job inherits SIGINT ignored (so do CI runners),
            # and the Python servers here leave it so; every one of them stops on SIGTERM.
            for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
                try:
                    os.killpg(self.p.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.p.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        else:
            try:  # children of a process that already exited
                os.killpg(self.p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.log.close()
        if self in Proc.registry:
            Proc.registry.remove(self)

    @classmethod
    def stop_all(cls) -> None:
        for proc in list(reversed(cls.registry)):
            try:
                proc.stop()
            except Exception as exc:  # keep stopping the others
                print(f"warning: stopping {proc.name}: {exc}", file=sys.stderr)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 2) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, b""


def wait_http(url: str, proc: Proc, timeout: float = 30, interval: float = 0.005) -> float:
    """Poll `url` until 200; return seconds since `proc` was started."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if http_get(url, timeout=1)[0] == 200:
                return time.perf_counter() - proc.started
        except (OSError, ValueError):
            pass
        if proc.p.poll() is not None:
            break
        time.sleep(interval)
    raise RuntimeError(f"{proc.name}: {url} not ready; log tail:\n{proc.tail()}")


def loadgen(spec: dict, cpus: str | None, timeout_extra: float = 90) -> dict:
    argv = [PY, str(BENCH / "loadgen.py"), "--spec", json.dumps(spec)]
    if cpus is not None:
        argv = [PY, str(BENCH / "pinned.py"), cpus, *argv]
    budget = float(spec.get("warmup", 0)) + float(spec.get("duration", 10)) + timeout_extra
    out = subprocess.run(argv, capture_output=True, text=True, timeout=budget, cwd=ROOT)
    if out.returncode != 0:
        raise RuntimeError(f"loadgen failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def cpu_seconds(pid: int, *, children: bool | None = None) -> float:
    """User+system CPU (psutil) of a process (`children=False`), of its descendants only
    (`children=True`), or of both (None)."""
    import psutil

    try:
        p = psutil.Process(pid)
        kids = p.children(recursive=True)
        procs = [p] if children is False else kids if children else [p, *kids]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for q in procs:
        try:
            t = q.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def rss_bytes(pid: int) -> int:
    import psutil

    return psutil.Process(pid).memory_info().rss


# --------------------------------------------------------------------------- servers


def start_sdk_upstream(workdir: Path, cpus: str | None, name: str = "upstream-sdk") -> tuple[Proc, str]:
    proc = Proc(name, [PY, str(BENCH / "sdk_upstream.py"), "--port", "0"], workdir, cpus=cpus)
    return proc, proc.wait_line("listening on ")


def start_fake_upstream(workdir: Path, cpus: str | None, name: str = "upstream-fake") -> tuple[Proc, str]:
    proc = Proc(name, [PY, str(BENCH / "fake_upstream.py"), "--port", "0"], workdir, cpus=cpus)
    return proc, proc.wait_line("listening on ")


def start_floor(
    workdir: Path,
    cpus: str | None,
    name: str,
    *,
    upstream: str | None = None,
    ids_file: Path | None = None,
    store: Path | None = None,
    uvloop: bool = False,
) -> tuple[Proc, str]:
    """bench/floor.py: the aiohttp pass-through in front of `upstream`, or (with `ids_file`) the minimal
    JSON handler answering tasks/get from memory (from the diskcache directory `store` when given);
    on uvloop when `uvloop`. Returns (proc, /mcp URL)."""
    argv = [PY, str(BENCH / "floor.py"), "--port", "0"]
    argv += ["--json", "--ids-file", str(ids_file)] if ids_file is not None else ["--upstream", str(upstream)]
    argv += ["--store", str(store)] if store is not None else []
    argv += ["--uvloop"] if uvloop else []
    proc = Proc(name, argv, workdir, cpus=cpus)
    return proc, proc.wait_line("listening on ")


def write_config(
    workdir: Path,
    name: str,
    server: dict,
    store: Path | dict,
    *,
    durable: bool,
    detach_after: str = "10s",
    event_loop: str = "asyncio",
) -> Path:
    """A proxy config file; `store` is a diskcache directory or a whole `store` section (Redis)."""
    config = {
        "listen": {"host": "127.0.0.1", "port": 0, "event_loop": event_loop},
        "store": store if isinstance(store, dict) else {"path": str(store), "durable": durable},
        "tasks": {"detach_after": detach_after, "ttl": "1h", "poll_interval": "500ms"},
        "mcpServers": {SERVER: server},
    }
    path = workdir / f"{name}.json"
    path.write_text(json.dumps(config, indent=2))
    return path


def start_proxy(workdir: Path, name: str, config: Path, cpus: str | None) -> tuple[Proc, str, float]:
    """The real CLI (`mcp-tasks-proxy --config`), as a user runs it; returns (proc, /mcp URL, seconds to
    /healthz)."""
    port = free_port()
    exe = shutil.which("mcp-tasks-proxy", path=str(Path(PY).parent)) or "mcp-tasks-proxy"
    proc = Proc(name, [exe, "--config", str(config), "--port", str(port)], workdir, cpus=cpus, env=PROXY_ENV)
    ready = wait_http(f"http://127.0.0.1:{port}/healthz", proc)
    return proc, f"http://127.0.0.1:{port}/mcp", ready


def wait_ready(base: str, proc: Proc, timeout: float = 15) -> None:
    """Wait for /readyz (upstream session open) so the first measured calls don't pay for initialize."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if http_get(base + "/readyz", timeout=3)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{proc.name} not ready; log tail:\n{proc.tail()}")


def ensure_peers(log) -> Path | None:
    """Install PyPI mcp-proxy (it pins mcp<2) into bench/.venv-peers; return its executable."""
    exe = PEERS_VENV / "bin" / "mcp-proxy"
    if exe.exists():
        return exe
    log(f"installing mcp-proxy=={MCP_PROXY_VERSION} into {PEERS_VENV} (own venv: it pins mcp<2) ...")
    try:
        subprocess.run([PY, "-m", "venv", str(PEERS_VENV)], check=True, timeout=120)
        subprocess.run(
            [str(PEERS_VENV / "bin" / "pip"), "install", "-q", f"mcp-proxy=={MCP_PROXY_VERSION}"],
            check=True,
            timeout=600,
            stdout=subprocess.DEVNULL,
        )
    except (subprocess.SubprocessError, OSError) as exc:
        log(f"warning: could not install mcp-proxy ({exc}); its rows are skipped")
        return None
    return exe if exe.exists() else None


# --------------------------------------------------------------------------- sections


def section_a(args, workdir: Path, log) -> dict:
    """Pass-through overhead of a short tools/call. CPU layout: upstream + load generator on CPU 0 in
    every row (including direct), the middle tier (proxy or peer) alone on CPU 1."""
    up_cpu, mid_cpu, lg_cpu = ("0", "1", "0") if args.pin else (None, None, None)
    rows: list[dict] = []
    greet = {"tool": "greet", "arguments": {"name": "bench"}, "expect": "Hello, bench!"}
    base_spec = {"concurrency": args.concurrency, "duration": args.duration, "warmup": args.warmup, **greet}

    def measure(label: str, url: str, mode: str, procs: list[Proc], **extra) -> None:
        # Own CPU of each process; a stdio child (the upstream) is counted apart from its parent.
        keys = [(p, False) for p in procs] + [(p, True) for p in procs if extra.get("upstream") == "stdio"]
        before = {(p.name, kids): cpu_seconds(p.pid, children=kids) for p, kids in keys}
        res = loadgen({**base_spec, "mode": mode, "url": url}, lg_cpu)
        res["cpu_ms_per_call"] = {
            ("upstream (stdio child)" if kids else p.name): round(
                (cpu_seconds(p.pid, children=kids) - before[(p.name, kids)]) * 1000 / max(1, res["total_ok"]),
                3,
            )
            for p, kids in keys
        }
        res.update(label=label, **extra)
        rows.append(res)
        log(
            f"  a: {label:<58} {res['rps']:>8} req/s  p50 {res['p50_ms']} ms  p99 {res['p99_ms']} ms  errors "
            f"{res['errors']}"
        )

    upstream, up_url = start_sdk_upstream(workdir, up_cpu, "a-upstream-sdk")
    try:
        measure(
            "direct to upstream (legacy client)",
            up_url,
            "legacy",
            [upstream],
            role="baseline",
            wire="2025-11-25",
        )
        # The floor: the smallest correct aiohttp pass-through (bench/floor.py) in the proxy's place.
        floor, floor_url = start_floor(workdir, mid_cpu, "a-floor", upstream=up_url)
        try:
            measure(
                "floor: aiohttp pass-through (bench/floor.py), legacy client",
                floor_url,
                "legacy",
                [upstream, floor],
                role="floor",
                wire="2025-11-25",
                mid="a-floor",
            )
        finally:
            floor.stop()
        # This proxy, HTTP upstream.
        cfg = write_config(workdir, "a-proxy", {"url": up_url}, workdir / "a-store", durable=True)
        proxy, url, _ = start_proxy(workdir, "a-proxy", cfg, mid_cpu)
        wait_ready(url.rsplit("/", 1)[0], proxy)
        try:
            measure(
                "mcp-tasks-proxy, legacy client (relay)",
                url,
                "legacy",
                [upstream, proxy],
                role="proxy",
                wire="2025-11-25",
                mid="a-proxy",
            )
            measure(
                "mcp-tasks-proxy, 2026-07-28 client + tasks ext",
                url,
                "modern",
                [upstream, proxy],
                role="proxy",
                wire="2026-07-28",
                mid="a-proxy",
            )
        finally:
            proxy.stop()
        # FastMCP create_proxy: default (fresh backend session per request), and with one reused session.
        if not args.no_peers:
            for reuse in (False, True):
                port = free_port()
                name = "a-fastmcp-reuse" if reuse else "a-fastmcp"
                argv = [PY, str(BENCH / "fastmcp_proxy.py"), up_url, "--port", str(port)] + (
                    ["--reuse-session"] if reuse else []
                )
                fm = Proc(name, argv, workdir, cpus=mid_cpu)
                try:
                    fm.wait_line("listening on ")
                    _wait_port(port, fm)
                    how = (
                        "connected Client (one shared backend session)"
                        if reuse
                        else "default: fresh backend session per request"
                    )
                    fm_url = f"http://127.0.0.1:{port}/mcp"
                    measure(
                        f"FastMCP 4.1.4 create_proxy, {how}, legacy client",
                        fm_url,
                        "legacy",
                        [upstream, fm],
                        role="peer",
                        wire="2025-11-25",
                    )
                    measure(
                        f"FastMCP 4.1.4 create_proxy, {how}, 2026-07-28 client",
                        fm_url,
                        "modern",
                        [upstream, fm],
                        role="peer",
                        wire="2026-07-28",
                    )
                except Exception as exc:
                    log(f"  a: FastMCP ({name}) failed: {exc}")
                    rows.append({"label": f"FastMCP ({name})", "role": "peer", "failed": str(exc)[:500]})
                finally:
                    fm.stop()
    finally:
        upstream.stop()

    # stdio upstream (the same server code, `--stdio`): mcp-proxy can only front stdio servers over HTTP.
    if not args.no_peers:
        stdio_cmd = (
            [PY, str(BENCH / "pinned.py"), up_cpu, PY, "tests/fixtures/legacy_server.py", "--stdio"]
            if up_cpu
            else [PY, "tests/fixtures/legacy_server.py", "--stdio"]
        )
        exe = ensure_peers(log)
        if exe is not None:
            port = free_port()
            mp = Proc(
                "a-mcp-proxy",
                [
                    str(exe),
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    "--log-level",
                    "WARNING",
                    "--",
                    *stdio_cmd,
                ],
                workdir,
                cpus=mid_cpu,
            )
            try:
                _wait_port(port, mp)
                measure(
                    f"mcp-proxy {MCP_PROXY_VERSION} (PyPI) -> stdio child, legacy client",
                    f"http://127.0.0.1:{port}/mcp",
                    "legacy",
                    [mp],
                    role="peer",
                    wire="2025-11-25",
                    upstream="stdio",
                )
            except Exception as exc:
                log(f"  a: mcp-proxy failed: {exc}")
                rows.append({"label": "mcp-proxy", "role": "peer", "failed": str(exc)[:500]})
            finally:
                mp.stop()
        # This proxy in front of the same stdio child: the like-for-like comparison with mcp-proxy.
        cfg = write_config(
            workdir,
            "a-proxy-stdio",
            {"command": stdio_cmd[0], "args": stdio_cmd[1:], "env": {"PYTHONPATH": ""}},
            workdir / "a-store-stdio",
            durable=True,
        )
        try:
            proxy, url, _ = start_proxy(workdir, "a-proxy-stdio", cfg, mid_cpu)
            try:
                wait_ready(url.rsplit("/", 1)[0], proxy)
                measure(
                    "mcp-tasks-proxy -> stdio child, legacy client",
                    url,
                    "legacy",
                    [proxy],
                    role="proxy",
                    wire="2025-11-25",
                    upstream="stdio",
                )
                measure(
                    "mcp-tasks-proxy -> stdio child, 2026-07-28 client + tasks ext",
                    url,
                    "modern",
                    [proxy],
                    role="proxy",
                    wire="2026-07-28",
                    upstream="stdio",
                )
            finally:
                proxy.stop()
        except Exception as exc:
            log(f"  a: mcp-tasks-proxy stdio failed: {exc}")
            rows.append(
                {"label": "mcp-tasks-proxy -> stdio child", "role": "proxy", "failed": str(exc)[:500]}
            )
    base = next(r for r in rows if r.get("role") == "baseline")
    for r in rows:
        if "rps" in r and base["rps"]:
            r["ratio_vs_direct"] = round(r["rps"] / base["rps"], 3)
    cpu_vs_floor(rows)
    if args.a_more:  # issue "Performance": fast upstream rows and an even layout (bench/section_a_more.py)
        import section_a_more

        rows += section_a_more.rows(args, workdir, log, sys.modules[__name__])
    return {
        "rows": rows,
        "layout": "upstream + loadgen on CPU 0, middle tier on CPU 1" if args.pin else "unpinned",
    }


def cpu_vs_floor(rows: list[dict]) -> None:
    """Set `cpu_ratio_vs_floor` on each proxy row: its middle tier's CPU per call over the floor row's
    (rows of one group: same upstream, same layout; a row names its middle tier in `mid`)."""
    floors = [r for r in rows if r.get("role") == "floor" and "cpu_ms_per_call" in r]
    for r in rows:
        floor = next((f for f in floors if f.get("group") == r.get("group")), None)
        if floor is None or r.get("role") != "proxy" or "mid" not in r or "cpu_ms_per_call" not in r:
            continue
        mine, its = r["cpu_ms_per_call"].get(r["mid"]), floor["cpu_ms_per_call"].get(floor["mid"])
        if mine is not None and its:
            r["cpu_ratio_vs_floor"] = round(mine / its, 3)


def _wait_port(port: int, proc: Proc, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        if proc.p.poll() is not None:
            break
        time.sleep(0.05)
    raise RuntimeError(f"{proc.name} did not listen on {port}; log tail:\n{proc.tail()}")


def fill_store(path: Path, n: int) -> tuple[list[str], float]:
    """N completed tasks of principal `anonymous` on server `bench`, in one transaction."""
    import logging

    import structlog

    # no log line per record
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    from proxy.tasks.diskcache_store import DiskcacheStore
    from proxy.tasks.model import TaskRecord, TaskStatus, new_task_id, now_ms

    if path.exists():
        shutil.rmtree(path)
    ids = []
    now = now_ms()
    outcome = {"result": {"content": [{"type": "text", "text": "report ready"}], "isError": False}}

    async def fill() -> None:
        store = DiskcacheStore(path, durable=False)
        try:
            for start in range(0, n, 5000):  # group commit: each chunk is one batch, one transaction
                records = [
                    TaskRecord(
                        task_id=new_task_id(),
                        principal="anonymous",
                        server=SERVER,
                        tool="slow_report",
                        created_ms=now,
                        ttl_ms=24 * 3600 * 1000,
                        poll_interval_ms=500,
                        owner="bench-fill",
                        status=TaskStatus.COMPLETED,
                        status_message="done",
                        terminal_ms=now,
                        outcome=outcome,
                    )
                    for _ in range(start, min(n, start + 5000))
                ]
                await asyncio.gather(*(store.create(r) for r in records))
                ids.extend(r.task_id for r in records)
        finally:
            await store.close()

    t0 = time.perf_counter()
    asyncio.run(fill())
    return ids, time.perf_counter() - t0


def section_b(args, workdir: Path, log, stores: dict[int, tuple[Path, list[str]]]) -> dict:
    """tasks/get with N stored tasks, per store (diskcache, Redis); proxy (and redis-server) on CPU 0, load
    generator on CPU 1."""
    px_cpu, lg_cpu = ("0", "1") if args.pin else (None, None)
    rows = []

    def measure_points(server: Proc, url: str, ids_file: Path, n: int, store: str) -> None:
        """One row per concurrency of tasks/get against `server` (the proxy or the floor)."""
        for conc in args.b_concurrency:
            cpu0 = cpu_seconds(server.pid, children=False)
            spec = {"mode": "tasks_get", "url": url, "ids_file": str(ids_file), "concurrency": conc}
            res = loadgen({**spec, "duration": args.duration, "warmup": args.warmup}, lg_cpu)
            res["proxy_cpu_ms_per_call"] = round(
                (cpu_seconds(server.pid, children=False) - cpu0) * 1000 / max(1, res["total_ok"]), 3
            )
            res.update(stored_tasks=n, store=store)
            rows.append(res)
            log(
                f"  b: {store[:9]:9} {n:>7} tasks, concurrency {conc:>3}: {res['rps']:>8} tasks/get/s  "
                f"p50 {res['p50_ms']} ms  p99 {res['p99_ms']} ms"
                f"  errors {res['errors']}  CPU {res['proxy_cpu_ms_per_call']} ms/call"
            )

    targets: list[tuple[str, int, Path | dict, list[str]]] = [
        ("diskcache", n, store, ids) for n, (store, ids) in sorted(stores.items())
    ]
    redis = None
    upstream, up_url = start_fake_upstream(workdir, lg_cpu, "b-upstream-fake")
    try:
        if "redis" in args.stores:
            redis = redis_bench.start_redis(workdir, "b-redis", appendfsync="everysec", cpus=px_cpu)
            for n in sorted(stores):
                ids, secs = redis_bench.fill_redis(redis.url, f"b{n}:", n, SERVER)
                targets.append(("redis", n, redis_bench.redis_store(redis.url, f"b{n}:"), ids))
                log(f"  filled Redis with {n} tasks in {secs:.1f} s")
        for kind, n, store, ids in targets:
            ids_file = workdir / f"ids-{kind}-{n}.json"
            ids_file.write_text(json.dumps(ids[: min(len(ids), 20000)]))
            cfg = write_config(workdir, f"b-proxy-{kind}-{n}", {"url": up_url}, store, durable=True)
            proxy, url, _ = start_proxy(workdir, f"b-proxy-{kind}-{n}", cfg, px_cpu)
            try:
                measure_points(proxy, url, ids_file, n, kind)
            finally:
                proxy.stop()
        # The floor: a minimal aiohttp JSON handler answering tasks/get from a dict of the largest id set.
        n = max(stores)
        ids_file = workdir / f"ids-diskcache-{n}.json"
        floor, url = start_floor(workdir, px_cpu, "b-floor", ids_file=ids_file)
        try:
            measure_points(floor, url, ids_file, n, FLOOR_STORE)
        finally:
            floor.stop()
    finally:
        upstream.stop()
        if redis is not None:
            redis.stop()
    smallest = min(r["stored_tasks"] for r in rows)
    for r in rows:
        if r["store"] == FLOOR_STORE:
            r["ratio_vs_smallest_store"] = None
            continue
        ref = next(
            x
            for x in rows
            if x["stored_tasks"] == smallest
            and x["concurrency"] == r["concurrency"]
            and x["store"] == r["store"]
        )
        r["ratio_vs_smallest_store"] = round(r["rps"] / ref["rps"], 3) if ref["rps"] else None
        floor_row = next(
            x for x in rows if x["store"] == FLOOR_STORE and x["concurrency"] == r["concurrency"]
        )
        if floor_row["proxy_cpu_ms_per_call"]:
            r["cpu_ratio_vs_floor"] = round(
                r["proxy_cpu_ms_per_call"] / floor_row["proxy_cpu_ms_per_call"], 3
            )
    layout = "proxy (and redis-server) on CPU 0, loadgen on CPU 1" if args.pin else "unpinned"
    return {"rows": rows, "layout": layout}


# Section c's two loads on the SDK upstream: the same wait, with progress and without
C_UPSTREAMS = {
    "slow_compute": "SDK slow_compute (progress every 100 ms)",
    "quiet_compute": "SDK quiet_compute (no progress)",
}


def section_c(args, workdir: Path, log) -> dict:
    """detach_after (50 ms) -> CreateTaskResult arrival; slow_compute on the SDK upstream (progress
    every 0.1 s), and beside it in each round, on the same proxy, store and upstream, its
    quiet_compute (the same wait, no progress: the baseline of the issue's 1.3x ratio). Store
    settings: diskcache durable (fsync) and not; Redis (with --stores redis) `appendfsync always`
    and `everysec`."""
    up_cpu, px_cpu, lg_cpu = ("0", "1", "0") if args.pin else (None, None, None)
    rows = []
    detach_ms = 50
    settings: list[tuple[str, bool]] = [("diskcache", True), ("diskcache", False)]
    if "redis" in args.stores:
        settings += [("redis", True), ("redis", False)]  # appendfsync always / everysec
    upstream, up_url = start_sdk_upstream(workdir, up_cpu, "c-upstream-sdk")
    try:
        # Rounds alternate which store setting goes first; the summary is the median p99 over rounds
        # (single runs of this load swing 2-5x at the tail either way on a shared 2-core machine).
        for rnd in range(args.c_rounds):
            for kind, durable in settings if rnd % 2 == 0 else settings[::-1]:
                label = f"{kind}-{'durable' if durable else 'normal'}"
                redis = None
                if kind == "redis":
                    redis = redis_bench.start_redis(
                        workdir,
                        f"c-redis-{label}-{rnd}",
                        appendfsync="always" if durable else "everysec",
                        cpus=px_cpu,
                    )
                    store: Path | dict = redis_bench.redis_store(redis.url, "c:")
                else:
                    store = workdir / f"c-store-{durable}-{rnd}"
                cfg = write_config(
                    workdir,
                    f"c-proxy-{label}-{rnd}",
                    {"url": up_url},
                    store,
                    durable=durable,
                    detach_after=f"{detach_ms}ms",
                )
                proxy = None
                try:
                    proxy, url, _ = start_proxy(workdir, f"c-proxy-{label}-{rnd}", cfg, px_cpu)
                    wait_ready(url.rsplit("/", 1)[0], proxy)
                    # Unmeasured warm-up at concurrency 16 (the SDK upstream's own warm-up otherwise
                    # lands on whichever setting is measured first).
                    loadgen(
                        {
                            "mode": "detach",
                            "url": url,
                            "tool": "slow_compute",
                            "arguments": {"seconds": args.c_hold},
                            "expect": '"resultType":"task"',
                            "detach_after_s": detach_ms / 1000,
                            "concurrency": 16,
                            "max_requests": 64,
                            "duration": 60,
                            "warmup": 0,
                        },
                        lg_cpu,
                    )
                    measured = (
                        ("slow_compute", 1, args.c_requests // 4),
                        ("slow_compute", 16, args.c_requests),
                        ("quiet_compute", 16, args.c_requests),
                    )
                    for tool, conc, n in measured:
                        # the previous load's (or the warm-up's) detached calls end before this one
                        time.sleep(args.c_hold + 0.5)
                        res = loadgen(
                            {
                                "mode": "detach",
                                "url": url,
                                "tool": tool,
                                "arguments": {"seconds": args.c_hold},
                                "expect": '"resultType":"task"',
                                "detach_after_s": detach_ms / 1000,
                                "concurrency": conc,
                                "max_requests": max(conc, n),
                                "duration": 120,
                                "warmup": 0,
                            },
                            lg_cpu,
                        )
                        res.update(
                            durable=durable,
                            store=kind,
                            detach_after_ms=detach_ms,
                            round=rnd + 1,
                            upstream=C_UPSTREAMS[tool],
                            progress=tool == "slow_compute",
                        )
                        rows.append(res)
                        log(
                            f"  c: round {rnd + 1} {kind:9} durable={durable!s:<5} {tool:13} "
                            f"concurrency {conc:>2}: "
                            f"{res['requests']} handles, late p50 {res['late_p50_ms']} ms"
                            f"  p99 {res['late_p99_ms']} ms  max {res['late_max_ms']} ms  errors "
                            f"{res['errors']}"
                        )
                finally:
                    if proxy is not None:
                        proxy.stop()
                    if redis is not None:
                        redis.stop()
    finally:
        upstream.stop()
    summary: dict = {}
    for kind, durable in settings:
        name = ("" if kind == "diskcache" else "redis_") + ("durable" if durable else "normal")
        for progress, conc, suffix in ((True, 1, "c1"), (True, 16, "c16"), (False, 16, "c16_quiet")):
            p99s = sorted(
                r["late_p99_ms"]
                for r in rows
                if r["store"] == kind
                and r["durable"] == durable
                and r["concurrency"] == conc
                and r["progress"] == progress
            )
            summary[f"{name}_{suffix}_median_p99_ms"] = p99s[len(p99s) // 2] if p99s else None
        with_progress, quiet = (
            summary[f"{name}_c16_median_p99_ms"],
            summary[f"{name}_c16_quiet_median_p99_ms"],
        )
        # The ratio: p99 with progress over the same load without (target at most 1.3)
        summary[f"{name}_c16_progress_over_quiet"] = (
            round(with_progress / quiet, 2) if with_progress and quiet else None
        )
    if summary.get("normal_c16_median_p99_ms"):
        summary["c16_durable_over_normal"] = round(
            summary["durable_c16_median_p99_ms"] / summary["normal_c16_median_p99_ms"], 2
        )
    log(f"  c: median p99 over {args.c_rounds} round(s): {summary}")
    return {
        "rows": rows,
        "summary": summary,
        "layout": "upstream + loadgen on CPU 0, proxy on CPU 1" if args.pin else "unpinned",
    }


def section_d(args, workdir: Path, log) -> dict:
    """RSS per detached in-flight call: N calls to a fake upstream that holds them open."""
    px_cpu, other_cpu = ("1", "0") if args.pin else (None, None)
    n = args.mem_calls
    upstream, up_url = start_fake_upstream(workdir, other_cpu, "d-upstream-fake")
    up_base = up_url.rsplit("/", 1)[0]
    out: dict[str, Any] = {"calls": n, "store_durable": args.d_durable}
    try:
        cfg = write_config(
            workdir,
            "d-proxy",
            {"url": up_url},
            workdir / "d-store",
            durable=args.d_durable,
            detach_after="20ms",
        )
        proxy, url, _ = start_proxy(workdir, "d-proxy", cfg, px_cpu)
        try:
            wait_ready(url.rsplit("/", 1)[0], proxy)
            hold = {
                "mode": "detach",
                "url": url,
                "tool": "hold",
                "expect": '"resultType":"task"',
                "detach_after_s": 0.02,
                "concurrency": 64,
                "duration": 600,
                "warmup": 0,
            }
            # Warm-up: 200 detached calls that finish (allocator, code paths), then the baseline.
            loadgen({**hold, "arguments": {"seconds": 0.2}, "max_requests": 200}, other_cpu)
            time.sleep(1.0)
            rss0 = rss_bytes(proxy.pid)
            t0 = time.perf_counter()
            res = loadgen(
                {
                    **hold,
                    "arguments": {"seconds": 3600},
                    "max_requests": n,
                    "concurrency": args.d_concurrency,
                },
                other_cpu,
            )
            out["detach_phase_s"] = round(time.perf_counter() - t0, 2)
            time.sleep(1.0)
            stats = json.loads(http_get(up_base + "/stats")[1])
            rss1 = rss_bytes(proxy.pid)
            out.update(
                rss_before_mb=round(rss0 / 2**20, 1),
                rss_after_mb=round(rss1 / 2**20, 1),
                handles=res["total_ok"],
                errors=res["errors"],
                error_samples=res["error_samples"],
                upstream_inflight=stats["inflight"],
                kb_per_call=round((rss1 - rss0) / 1024 / max(1, stats["inflight"]), 2),
            )
            # Release them; completion is written to the store; RSS after they are gone.
            urllib.request.urlopen(
                urllib.request.Request(up_base + "/release", method="POST"), timeout=30
            ).read()
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and json.loads(http_get(up_base + "/stats")[1])["inflight"] > 0:
                time.sleep(0.2)
            time.sleep(2.0)
            out["rss_after_release_mb"] = round(rss_bytes(proxy.pid) / 2**20, 1)
            log(
                f"  d: {stats['inflight']} detached in flight: RSS {out['rss_before_mb']} -> "
                f"{out['rss_after_mb']} MB = "
                f"{out['kb_per_call']} KB/call (after release {out['rss_after_release_mb']} MB); detach "
                f"phase {out['detach_phase_s']} s"
            )
        finally:
            proxy.stop()
    finally:
        upstream.stop()
    return out


def section_e(args, workdir: Path, log, stores: dict[int, tuple[Path, list[str]]]) -> dict:
    """Process start -> /healthz 200, with an empty store and with the largest store; median of repeats."""
    cpu = "1" if args.pin else None
    rows = []
    upstream, up_url = start_fake_upstream(workdir, "0" if args.pin else None, "e-upstream-fake")
    try:
        cases = [(0, workdir / "e-empty-store")] + [
            (n, p) for n, (p, _) in sorted(stores.items()) if n == max(stores)
        ]
        for n, store in cases:
            times = []
            for i in range(args.e_repeats):
                cfg = write_config(workdir, f"e-proxy-{n}", {"url": up_url}, store, durable=True)
                proxy, _, ready = start_proxy(workdir, f"e-proxy-{n}-{i}", cfg, cpu)
                proxy.stop()
                times.append(ready)
            times.sort()
            rows.append(
                {
                    "stored_tasks": n,
                    "median_s": round(times[len(times) // 2], 3),
                    "max_s": round(times[-1], 3),
                    "all_s": [round(t, 3) for t in times],
                }
            )
            log(
                f"  e: {n:>7} tasks: start -> /healthz median {rows[-1]['median_s']} s (max "
                f"{rows[-1]['max_s']} s, {len(times)} runs)"
            )
    finally:
        upstream.stop()
    # Python + imports alone, for scale.
    t0 = time.perf_counter()
    subprocess.run([PY, "-c", "import proxy.cli"], check=True, cwd=ROOT, timeout=60)
    import_s = time.perf_counter() - t0
    return {
        "rows": rows,
        "import_only_s": round(import_s, 3),
        "ratio_largest_vs_empty": round(rows[-1]["median_s"] / rows[0]["median_s"], 3)
        if rows[0]["median_s"]
        else None,
    }


# --------------------------------------------------------------------------- report


def machine() -> dict:
    model = ""
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout.splitlines():
            if line.startswith("Model name"):
                model = line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    mem = ""
    try:
        kb = int(next(line for line in open("/proc/meminfo") if line.startswith("MemTotal")).split()[1])
        mem = f"{kb / 2**20:.1f} GiB"
    except (OSError, StopIteration):
        pass
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "proxy"],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=10,
        ).stdout.strip()
        head += " (+ uncommitted changes in proxy/)" if dirty else ""
    except (OSError, subprocess.SubprocessError):
        head = "?"
    return {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "nproc": os.cpu_count(),
        "cpu_model": model,
        "memory": mem,
        "python": platform.python_version(),
        "kernel": platform.release(),
        "commit": head,
    }


def _c_store_label(row: dict) -> str:
    if row.get("store") == "redis":
        return "Redis appendfsync always" if row["durable"] else "Redis appendfsync everysec"
    return "durable (fsync)" if row["durable"] else "durable: false"


def report(results: dict, args) -> str:
    lines = [
        f"machine: {results['machine']}",
        f"1-min load average at start/end of each section: {results.get('load_average', {})}",
        "",
    ]
    if "a" in results:
        a = results["a"]
        lines += [
            f"### a. short tools/call pass-through (concurrency {args.concurrency}, {args.duration:g} s; "
            f"{a['layout']})",
            "",
            "| path | wire | req/s | vs direct | p50 ms | p99 ms | middle-tier CPU ms/call | CPU vs floor | "
            "errors |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in a["rows"]:
            if "failed" in r:
                lines.append(f"| {r['label']} | — | failed | | | | | | {r['failed'][:80]} |")
                continue
            mid = {k: v for k, v in r["cpu_ms_per_call"].items() if "upstream" not in k}
            lines.append(
                f"| {r['label']} | {r['wire']} | {r['rps']} | {r.get('ratio_vs_direct')} | {r['p50_ms']} | "
                f"{r['p99_ms']} | "
                f"{', '.join(str(v) for v in mid.values()) or '—'} | {r.get('cpu_ratio_vs_floor', '')} | "
                f"{r['errors']} |"
            )
        lines.append("")
    if "b" in results:
        lines += [
            f"### b. tasks/get ({results['b']['layout']}, {args.duration:g} s per point)",
            "",
            "| store | stored tasks | concurrency | tasks/get/s | vs smallest store | p50 ms | p99 ms | "
            "proxy CPU ms/call | CPU vs floor | errors |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in results["b"]["rows"]:
            lines.append(
                f"| {r.get('store', 'diskcache')} | {r['stored_tasks']} | {r['concurrency']} | {r['rps']} | "
                f"{r['ratio_vs_smallest_store']} | {r['p50_ms']} | {r['p99_ms']} | "
                f"{r['proxy_cpu_ms_per_call']} | {r.get('cpu_ratio_vs_floor', '')} | {r['errors']} |"
            )
        lines.append("")
    if "c" in results:
        lines += [
            "### c. detach_after (50 ms) expiry -> CreateTaskResult at the client",
            "",
            "| upstream | round | store | concurrency | handles | late p50 ms | late p99 ms | late max ms | "
            "errors |",
            "|---|---:|---|---:|---:|---:|---:|---:|---:|",
        ]
        for r in results["c"]["rows"]:
            lines.append(
                f"| {r['upstream']} | {r.get('round', '')} | {_c_store_label(r)} | {r['concurrency']} | "
                f"{r['requests']} | {r['late_p50_ms']} | "
                f"{r['late_p99_ms']} | {r['late_max_ms']} | {r['errors']} |"
            )
        lines += ["", f"Median late p99 over rounds: {results['c'].get('summary')}", ""]
    if "d" in results:
        d = results["d"]
        lines += [
            "### d. memory per detached in-flight call",
            "",
            "| calls in flight | RSS before MB | RSS with calls MB | KB per call | RSS after release MB | "
            "errors |",
            "|---:|---:|---:|---:|---:|---:|",
            f"| {d['upstream_inflight']} | {d['rss_before_mb']} | {d['rss_after_mb']} | {d['kb_per_call']} | "
            f"{d['rss_after_release_mb']} | {d['errors']} |",
            "",
        ]
    if "e" in results:
        e = results["e"]
        lines += [
            "### e. start-up (process start -> /healthz 200)",
            "",
            "| stored tasks | median s | max s | vs empty |",
            "|---:|---:|---:|---:|",
        ]
        for r in e["rows"]:
            lines.append(
                f"| {r['stored_tasks']} | {r['median_s']} | {r['max_s']} | "
                f"{round(r['median_s'] / e['rows'][0]['median_s'], 3)} |"
            )
        lines += [f"(`python -c 'import proxy.cli'` alone: {e['import_only_s']} s)", ""]
    lines += results.get("r", {}).get("table_md", [])
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--quick", action="store_true", help="tiny sizes and durations (smoke run, no meaningful figures)"
    )
    ap.add_argument("--sections", default="a,b,c,d,e")
    ap.add_argument("--duration", type=float, default=10.0, help="measured seconds per load point (a, b)")
    ap.add_argument("--warmup", type=float, default=2.0, help="unmeasured seconds before each load point")
    ap.add_argument("--concurrency", type=int, default=16, help="closed-loop workers for (a)")
    ap.add_argument("--b-concurrency", default="1,16", help="comma list of workers for (b)")
    ap.add_argument(
        "--store-sizes",
        default="1000,100000,1000000",
        help="stored tasks for (b); the largest is used for (e) "
        "(seeded stores are cached in bench/.cache: the 1,000,000 one takes ~3 min and 1.2 GB once)",
    )
    ap.add_argument(
        "--c-requests",
        type=int,
        default=400,
        help="detached calls at concurrency 16 for (c) (a quarter at concurrency 1)",
    )
    ap.add_argument(
        "--c-rounds",
        type=int,
        default=3,
        help="rounds of (c), alternating which store setting goes first; medians reported",
    )
    ap.add_argument(
        "--stores",
        default="diskcache,redis",
        help="task stores measured in (b) and (c): diskcache and/or redis "
        "(a redis-server of the bench's own; skipped with a warning when redis-server is not installed)",
    )
    ap.add_argument(
        "--c-hold", type=float, default=1.0, help="seconds each slow_compute call runs upstream in (c)"
    )
    ap.add_argument("--mem-calls", type=int, default=10000, help="concurrent detached calls for (d)")
    ap.add_argument(
        "--d-concurrency", type=int, default=64, help="client workers creating the detached calls in (d)"
    )
    ap.add_argument(
        "--d-durable",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="fsync store in (d) (default off: RSS is the figure)",
    )
    ap.add_argument("--e-repeats", type=int, default=5)
    ap.add_argument(
        "--r-replicas",
        default="1,3",
        help="replica counts for (r); --r-concurrency workers, --r-tasks stored tasks",
    )
    ap.add_argument("--r-concurrency", type=int, default=16)
    ap.add_argument("--r-tasks", type=int, default=1000)
    ap.add_argument("--no-peers", action="store_true", help="skip mcp-proxy and FastMCP rows in (a)")
    ap.add_argument(
        "--a-more",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="(a) rows in front of the fast fake upstream, and direct vs proxy with nothing pinned "
        "(bench/section_a_more.py)",
    )
    ap.add_argument(
        "--pin",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="pin processes to CPUs (needs 2+ CPUs)",
    )
    ap.add_argument("--out", help="JSON results file (default bench/results/<timestamp>.json)")
    ap.add_argument(
        "--wait-idle",
        type=float,
        default=0,
        help="before each section, wait up to this many seconds for the 1-min load "
        "average to fall below 1.0 (a shared machine)",
    )
    ap.add_argument(
        "--ref",
        help="measure proxy/ as of this git revision (extracted with `git archive` and put first on "
        "PYTHONPATH) "
        "instead of the working tree; the README table uses it so its figures name a commit",
    )
    args = ap.parse_args(argv)
    if args.quick:
        args.duration, args.warmup, args.concurrency = 0.5, 0.2, 4
        args.b_concurrency, args.store_sizes, args.c_requests, args.c_hold = "4", "200,1000", 12, 0.2
        args.mem_calls, args.e_repeats, args.c_rounds = 200, 1, 1
    args.b_concurrency = [int(x) for x in str(args.b_concurrency).split(",")]
    sizes = [int(x) for x in args.store_sizes.split(",")]
    if args.pin and (os.cpu_count() or 1) < 2:
        args.pin = False
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    args.stores = [s.strip() for s in args.stores.split(",") if s.strip()]
    if "redis" in args.stores and not redis_bench.redis_available():
        print("warning: redis-server is not installed; the Redis rows of (b) and (c) are skipped", flush=True)
        args.stores.remove("redis")

    def log(msg: str) -> None:
        print(msg, flush=True)

    def on_term(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    results: dict[str, Any] = {"machine": machine(), "args": {k: v for k, v in vars(args).items()}}
    log(f"bench: {results['machine']}")
    workdir = Path(tempfile.mkdtemp(prefix="mtp-bench-"))
    rc = 0
    if args.ref:
        src = workdir / "src"
        src.mkdir()
        rev = subprocess.run(
            ["git", "rev-parse", "--short", args.ref], capture_output=True, text=True, cwd=ROOT, check=True
        ).stdout.strip()
        archive = subprocess.run(
            ["git", "archive", rev, "proxy"], capture_output=True, cwd=ROOT, check=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
        # Only the proxy processes get it (start_proxy); upstream fixtures and peers keep the working tree.
        PROXY_ENV["PYTHONPATH"] = os.pathsep.join([str(src), *filter(None, [os.environ.get("PYTHONPATH")])])
        sys.path.insert(0, str(src))
        results["machine"]["commit"] = f"{rev} (--ref {args.ref}: proxy/ from git, not the working tree)"
        log(f"measuring proxy/ at {rev} from {src}")
    try:
        stores: dict[int, tuple[Path, list[str]]] = {}
        if "b" in sections or "e" in sections:
            import stores as seeded  # bench/stores.py: one-transaction fill, cached in bench/.cache

            for n in sizes:
                ids, secs, hit = seeded.seeded_store(workdir / f"store-{n}", n, log)
                stores[n] = (workdir / f"store-{n}", ids)
                log(f"  {'copied the cached' if hit else 'filled a'} store with {n} tasks in {secs:.1f} s")
        for name in sections:
            waited = 0.0
            while args.wait_idle and waited < args.wait_idle and os.getloadavg()[0] > 1.0:
                if waited == 0:
                    log(
                        f"  waiting up to {args.wait_idle:g} s for the 1-min load average "
                        f"({os.getloadavg()[0]:.2f}) to fall below 1.0 ..."
                    )
                time.sleep(5)
                waited += 5
            t0 = time.perf_counter()
            load0 = os.getloadavg()[0]
            log(f"section {name} ... (1-min load average {load0:.2f} on {os.cpu_count()} CPUs)")
            if load0 > 0.5:
                log(
                    "  warning: the machine is busy with other work; figures will be lower and noisier than "
                    "on an idle machine"
                )
            try:
                if name == "a":
                    results["a"] = section_a(args, workdir, log)
                elif name == "b":
                    results["b"] = section_b(args, workdir, log, stores)
                elif name == "c":
                    results["c"] = section_c(args, workdir, log)
                elif name == "d":
                    results["d"] = section_d(args, workdir, log)
                elif name == "e":
                    results["e"] = section_e(args, workdir, log, stores)
                elif name == "r":
                    results["r"] = __import__("replicas").section_r(args, workdir, log, sys.modules[__name__])
                else:
                    raise ValueError(f"unknown section {name!r}")
            except Exception as exc:
                rc = 1
                results[name] = {"failed": f"{type(exc).__name__}: {exc}"}
                log(f"section {name} FAILED: {type(exc).__name__}: {exc}")
            finally:
                Proc.stop_all()
            load1 = os.getloadavg()[0]
            results.setdefault("load_average", {})[name] = {"start": round(load0, 2), "end": round(load1, 2)}
            log(
                f"section {name} took {time.perf_counter() - t0:.0f} s (load average {load0:.2f} -> "
                f"{load1:.2f})"
            )
    except KeyboardInterrupt:
        rc = 130
        log("interrupted; stopping every process")
    finally:
        Proc.stop_all()
        shutil.rmtree(workdir, ignore_errors=True) if rc == 0 else log(f"work dir (logs) kept: {workdir}")
    table = report({k: v for k, v in results.items() if not (isinstance(v, dict) and "failed" in v)}, args)
    out = (
        Path(args.out)
        if args.out
        else BENCH
        / "results"
        / f"{dt.datetime.now().strftime('%Y%m%d-%H%M%S')}{'-quick' if args.quick else ''}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    results["table"] = table
    out.write_text(json.dumps(results, indent=2))
    log("\n" + table)
    log(f"results: {out}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
