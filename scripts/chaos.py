"""Chaos run: mixed calls and polls while proxy processes are SIGKILLed under them, then checks.

    python scripts/chaos.py [--calls 200] [--kills 4] [--seed N] [--rerun]     # one proxy process
    python scripts/chaos.py --replicas 3 [--calls 300] [--kills 6] [--seed N] [--rerun]
                                                  # N replicas, HAProxy, Redis

Upstream: the legacy fixture server through scripts/chaos_upstream.py, which records each call's
`label` as the call starts (every call of the load carries its own). `--rerun` configures
slow_compute `on_restart: rerun` (replicas: MCP_RERUN_POLICY, read by config/replicas.yaml).
Single process: the upstream and the proxy (a subprocess, durable store in a temp
folder). Replicas: scripts/cluster.py starts redis-server (appendonly yes, appendfsync always), N
replicas of one config on it, and HAProxy in front; every request goes through HAProxy.

Load: `--calls` mixed calls (fast sync, slow tasks, failing, erroring) from a 2026-07-28 client that
declares the tasks extension, `--concurrency` at a time, for the whole run; a poller reads every
task id ever handed out, over and over (`tasks/get`, through HAProxy in replica mode), until the end.

Kills: SIGKILL at random moments, each only while calls are outstanding (the kill cuts them); the
first only once `--min-seen` completed results have been seen, so the run proves a result survives
a kill. The killed process is restarted after a moment (replicas: a random replica each time; the
others keep serving). Replica mode also restarts redis-server once (SIGKILL, then again on the same
port and data dir: the AOF brings back what was committed).

Checks (exit status 1 on any violation):
- `unknown_ids`: a handed-out task id that a tasks/get ever answered with -32602 (unknown);
- `lost_results`: a task seen `completed` that later reads otherwise, or with a different result;
- `terminal_changed`: a task seen failed/cancelled that later reads otherwise;
- `not_terminal`: a handed-out task not terminal when the run ends (`--settle` s after the load);
- `unexplained_failures`: a task that ended failed or cancelled, or a synchronous JSON-RPC error, for
  a reason the run does not explain. Explained: the tool's own failure (`failed_expected`: the
  failing_job / instant_error texts) and the loss of a SIGKILLed process (`failed_replica_lost`):
  the error names the node (`(node X) was lost`; single process: "the proxy restarted ...") and
  the task was among that node's unfinished tasks in the store right after X was killed (each
  replica's node id comes from its log's `replica_started` line). Split by kind in `unexplained`
  (e.g. `lost_to_a_node_never_killed`, `lost_before_its_node_was_killed`);
- `double_runs`: extra upstream starts of a call label, beyond the re-runs the policy explains
  (`reruns`: with --rerun, a slow_compute task re-run at most once per kill it was running at);
  split in `double_runs_by` by the task the client was handed: no_task_handed (the call's answer
  never came), task_never_at_a_kill (e.g. a request HAProxy re-sent after a cut or a 503: the
  handed task is the second replica's), task_at_a_kill (ran again without a re-run policy);
- with --rerun: `lost_despite_rerun` (a slow_compute task failed as lost) and no re-run at all;
- no completed result seen before the first kill, or no kill landing with requests in flight.
Not violations: requests cut by a kill or refused while a process is down (`transport_errors`,
split by call/poll and cut / refused / no_backend (HAProxy's own 503: no replica up) / timeouts /
other), JSON-RPC answers with HTTP 503 while the store is down (`store_unavailable`), and tasks of
a killed process ending `failed` (or re-run). A request HAProxy (config/haproxy.cfg) re-sends to
another replica after it was cut by a kill (or answered 503) shows as no transport error at all,
but as a `double_runs` violation when the first replica had already started it upstream; a replica is
chosen among those HAProxy counts as serving requests (`scur`), and `requests_at_killed_replicas`
sums what they were serving when killed.

Prints one JSON line: calls, handed_out, seen_completed, seen_completed_before_kill (seen before
the last kill, so checked after at least one), seen_completed_before_first_kill, kills,
kills_with_requests_in_flight (single: the client's requests outstanding; replicas: HAProxy's count
at the killed replica), transport_errors, transport{call_cut, poll_refused, ...},
store_unavailable, unknown_ids, lost_results, terminal_changed, not_terminal, final{status: count},
tasks_running_at_kills, failed_replica_lost, failed_expected, unexplained_failures
(+ unexplained{kind: n} and samples), labels_started, double_runs (+ samples), reruns,
rerun_completed, lost_despite_rerun, violations[...]; in replica mode also
requests_at_killed_replicas, redis_restarts, seen_completed_before_redis_restart and
handed_out_before_redis_restart (the tasks whose survival across the Redis restart is checked).
Loopback only; every process it starts is stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import io
import json
import os
import queue
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
META = {
    "io.modelcontextprotocol/protocolVersion": "2026-07-28",
    "io.modelcontextprotocol/clientCapabilities": {"extensions": {"io.modelcontextprotocol/tasks": {}}},
}
TERMINAL = ("completed", "failed", "cancelled")
UNKNOWN_TASK = -32602


class Child:
    """A subprocess that prints `listening on URL` when ready (its own process group)."""

    def __init__(self, argv: list[str], log: Path | None = None, env: dict[str, str] | None = None) -> None:
        self.argv = argv
        err = open(log, "ab") if log else subprocess.DEVNULL
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=err, text=True, cwd=ROOT, start_new_session=True, env=env
        )
        self.url = ""
        assert self.proc.stdout is not None
        lines: queue.Queue[str] = queue.Queue()
        stdout = self.proc.stdout

        def read() -> None:  # also keeps draining stdout after the line came
            for line in stdout:
                lines.put(line)
            lines.put("")

        threading.Thread(target=read, daemon=True).start()
        deadline = time.monotonic() + 30
        while True:
            try:
                line = lines.get(timeout=max(0.001, deadline - time.monotonic()))
            except queue.Empty:
                break  # nothing printed in time
            if not line:
                break
            if line.startswith("listening on "):
                self.url = line.strip().removeprefix("listening on ")
                return
        self.stop()
        raise RuntimeError(f"{argv[:4]} did not start")

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@dataclass
class Killed:
    """One SIGKILL: `label` (e.g. `replica 2`), requests the killed process itself was serving
    (`at_process`, None when only the client's own count is known), its node id (the store's
    owner name for it) and the unfinished tasks it owned when it died (read from the store right
    after the kill, before any other node can take them over): task id -> the call's label, when
    the record keeps the call for a re-run (None otherwise)."""

    label: str
    at_process: int | None
    node: str
    owned: dict[str, str | None]


def counting_upstream(workdir: Path) -> tuple[Child, Path]:
    """The legacy fixture server, recording every call's `label` as it starts
    (scripts/chaos_upstream.py); returns it and the file of start lines."""
    starts = workdir / "starts.log"
    env = {**os.environ, "MCP_CHAOS_STARTS": str(starts)}
    return Child([sys.executable, "scripts/chaos_upstream.py", "--port", "0"], env=env), starts


def node_of(log: Path) -> str:
    """The node id the process writing `log` (JSON lines, appended across restarts) started as last."""
    node = ""
    for line in log.read_text(errors="replace").splitlines():
        if '"proxy_started"' in line or '"replica_started"' in line:
            try:
                node = json.loads(line).get("node") or node
            except ValueError:
                pass
    return node


def owned_by(store: Any, node: str) -> dict[str, str | None]:
    """The unfinished tasks `store` (a TaskStore, closed here) records as owned by `node`: task id ->
    the `label` argument of its call, read from the call kept for a re-run (`on_restart: rerun`),
    else None. A task whose handle never reached the client is known by its label only."""

    async def read() -> dict[str, str | None]:
        try:
            records = await asyncio.wait_for(store.live_tasks(), 10)
        finally:
            await store.close()
        return {r.task_id: _label_of(r.rerun) for r in records if r.owner == node}

    return asyncio.run(read())


def _label_of(rerun: dict[str, Any] | None) -> str | None:
    """The `label` argument of a call kept for a re-run (`{method, params, capabilities}`)."""
    params = (rerun or {}).get("params") or {}
    label = (params.get("arguments") or {}).get("label") if isinstance(params, dict) else None
    return label if isinstance(label, str) else None


class Target(Protocol):
    """What the chaos loop drives: one URL, and processes behind it to kill and bring back."""

    url: str
    starts: Path  # the upstream's start lines (one `label` per call start)

    def kill(self, rng: random.Random) -> Killed:
        """SIGKILL one serving process now (blocking; runs in a thread) and say what died."""

    def revive(self) -> None:
        """Start again what the last kill() stopped (blocking; runs in a thread)."""

    def extra_chaos(self) -> list[str]:
        """Labels of the other events this target can run (e.g. `redis`)."""

    def extra(self, name: str, down_s: float) -> None:
        """Run one extra event (blocking; runs in a thread), e.g. restart redis-server."""

    def stop(self) -> None:
        """Stop every process this target started."""


class SingleProxy:
    """The legacy fixture server and one proxy process on a durable disk store."""

    def __init__(self, workdir: Path, rerun: bool = False) -> None:
        self.upstream, self.starts = counting_upstream(workdir)
        self.store_path = workdir / "store"
        config = workdir / "proxy.json"
        config.write_text(
            json.dumps(
                {
                    "store": {"path": str(workdir / "store")},
                    "tasks": {"detach_after": "100ms", "ttl": "1h", "poll_interval": "100ms"},
                    "mcpServers": {
                        "fx": {
                            "url": self.upstream.url,
                            "tasks": {
                                "tools": {"slow_compute": {"on_restart": "rerun" if rerun else "fail"}}
                            },
                        }
                    },
                }
            )
        )
        self.argv = [sys.executable, "-m", "proxy", "--config", str(config), "--port", "0"]
        self.log = workdir / "proxy.log"
        try:
            self.proxy: Child | None = Child(self.argv, self.log)
        except BaseException:
            self.upstream.stop()  # no process outlives a failed start
            raise
        self.url = self.proxy.url
        self.port = self.url.split(":")[2].split("/")[0]

    def kill(self, rng: random.Random) -> Killed:
        from proxy.tasks.diskcache_store import DiskcacheStore

        assert self.proxy is not None
        self.proxy.kill()
        self.proxy = None
        node = node_of(self.log)
        # The client's outstanding requests are all at this process (at_process None).
        return Killed("proxy", None, node, owned_by(DiskcacheStore(self.store_path, exclusive=False), node))

    def revive(self) -> None:
        # The same port, so the client's URL stays valid (a restarted service keeps its address).
        argv = [*self.argv[:-1], self.port]
        for _ in range(50):
            try:
                self.proxy = Child(argv, self.log)
                return
            except RuntimeError:
                time.sleep(0.1)  # the port may linger for a moment
        raise RuntimeError("the proxy did not come back")

    def extra_chaos(self) -> list[str]:
        return []

    def extra(self, name: str, down_s: float) -> None:
        raise ValueError(name)

    def stop(self) -> None:
        if self.proxy is not None:
            self.proxy.stop()
        self.upstream.stop()


class Replicas:
    """N replicas of config/replicas.yaml behind HAProxy on an AOF Redis (scripts/cluster.py), the
    legacy fixture server as upstream `web`; every request goes through HAProxy."""

    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        from cluster import Cluster, _redis_server_class

        self.upstream, self.starts = counting_upstream(workdir)
        (workdir / "cluster").mkdir()  # Cluster writes its logs there but does not create a given dir
        self.cluster = Cluster(
            upstream_url=self.upstream.url,
            replicas=args.replicas,
            workdir=workdir / "cluster",
            check_inter="100ms",
            settings={
                "MCP_LEASE": args.lease,
                "MCP_DETACH_AFTER": "100ms",
                "MCP_POLL_INTERVAL": "100ms",
                "MCP_STDIO_DISABLED": "true",
                "MCP_DRAIN_TIMEOUT": "1s",
                "MCP_DRAIN_DETACHED": "1s",
                "MCP_RERUN_POLICY": "rerun" if args.rerun else "fail",
            },
        )
        # Persistence on: every write on disk (AOF, fsync per write) before Redis acknowledges it.
        self.redis = _redis_server_class()(workdir / "redis", appendonly=True, appendfsync="always")
        self.cluster.redis = self.redis
        try:
            self.cluster.start()
        except BaseException:
            self.upstream.stop()
            raise
        self.url = f"{self.cluster.url}/servers/web/mcp"
        self.killed = -1

    def sessions(self) -> dict[int, int]:
        """Requests each replica is serving now, per HAProxy (`scur` of its server line)."""
        from cluster import _get

        status, body = _get(f"http://127.0.0.1:{self.cluster.stats_port}/stats;csv")
        rows = csv.DictReader(io.StringIO(body.decode().lstrip("# "))) if status == 200 else []
        return {
            int(r["svname"][1:]): int(r["scur"] or 0)
            for r in rows
            if r.get("pxname") == "replicas"
            and r["svname"][1:].isdigit()
            and int(r["svname"][1:]) < self.cluster.n
        }

    def kill(self, rng: random.Random) -> Killed:
        from proxy.tasks.redis_store import RedisTaskStore

        # A random replica among those serving requests right now
        # (waiting up to 2 s for one; any replica when none is).
        deadline = time.monotonic() + 2
        while True:
            load = self.sessions()
            busy = [i for i, n in load.items() if n > 0]
            if busy or time.monotonic() > deadline:
                break
            time.sleep(0.005)
        self.killed = rng.choice(busy) if busy else rng.randrange(self.cluster.n)
        self.cluster.kill(self.killed)
        node = node_of(self.cluster.log_path(self.killed))
        # Read at once: the others take its tasks over only once its lease (--lease) has lapsed.
        owned = owned_by(RedisTaskStore(self.redis.url, timeout_s=2.0), node)
        return Killed(f"replica {self.killed}", load.get(self.killed, 0), node, owned)

    def revive(self) -> None:
        self.cluster.restart(self.killed)

    def extra_chaos(self) -> list[str]:
        return ["redis"]

    def extra(self, name: str, down_s: float) -> None:
        port = self.redis.port
        self.redis.kill()  # SIGKILL: what the AOF holds is all that comes back
        time.sleep(down_s)
        self.redis.start(port=port)  # same port and data dir; returns once it answers PING

    def stop(self) -> None:
        try:
            self.cluster.stop()
        finally:
            self.upstream.stop()


# tool -> its own error text
EXPECTED_FAILURE = {
    "failing_job": "job failed",
    "instant_error": "instant_error exploded",
}
LOST = re.compile(r"\(node ([0-9a-f]+)\) was lost|the proxy restarted while this call was running")


def mixed_call(i: int, rng: random.Random) -> tuple[str, dict]:
    """Call i of the mixed load: sync result, sync JSON-RPC error, a task failing, slow tasks. Every
    call carries its own `label` (the upstream records each start of it)."""
    kind = i % 6
    if kind == 0:
        return "greet", {"name": f"n{i}", "label": f"g{i}"}
    if kind == 1:
        return "failing_job", {"label": f"f{i}"}
    if kind == 2:
        return "instant_error", {"label": f"e{i}"}
    return "slow_compute", {"seconds": round(rng.uniform(0.15, 1.5), 2), "label": f"c{i}"}


@dataclass
class Run:
    """What the client saw: handed ids, terminal states seen, counts, violations."""

    handed: dict[str, float] = field(default_factory=dict)  # task id -> monotonic time handed
    call_of: dict[str, tuple[str, str]] = field(default_factory=dict)  # task id -> (tool, label)
    labels: dict[str, str] = field(default_factory=dict)  # label of every call sent -> tool
    killed: list[Killed] = field(default_factory=list)
    # (tool, error) of sync JSON-RPC errors
    sync_failures: list[tuple[str, dict]] = field(default_factory=list)
    completed: dict[str, Any] = field(default_factory=dict)  # task id -> result first seen
    completed_at: dict[str, float] = field(default_factory=dict)
    terminal: dict[str, tuple[str, Any]] = field(default_factory=dict)  # failed/cancelled first seen
    terminal_at: dict[str, float] = field(default_factory=dict)
    current: dict[str, str] = field(default_factory=dict)  # task id -> last status read
    unknown: set[str] = field(default_factory=set)
    lost: set[str] = field(default_factory=set)
    changed: set[str] = field(default_factory=set)
    kill_times: list[float] = field(default_factory=list)
    extra_times: dict[str, float] = field(default_factory=dict)  # e.g. redis -> when it was first killed
    inflight_calls: dict[int, float] = field(default_factory=dict)  # call number -> monotonic start
    inflight_polls: int = 0
    counts: dict[str, int] = field(
        default_factory=lambda: {
            "calls": 0,
            "sync_results": 0,
            "sync_errors": 0,
            "polls": 0,
            "store_unavailable": 0,
            "kills": 0,
            "kills_with_requests_in_flight": 0,
            "requests_at_killed_processes": 0,
            "calls_in_flight_at_kills": 0,
            "polls_in_flight_at_kills": 0,
            "redis_restarts": 0,
        }
    )
    transport: dict[str, int] = field(
        default_factory=lambda: {
            f"{what}_{kind}": 0
            for what in ("call", "poll")
            for kind in ("cut", "refused", "no_backend", "timeouts", "other")
        }
    )
    samples: list[str] = field(default_factory=list)

    def note(self, msg: str) -> None:
        if len(self.samples) < 8:
            self.samples.append(msg[:300])

    def forgotten(self, task_id: str, error: dict) -> None:
        """A handed-out id answered as unknown (-32602): itself a violation, and a lost result if one was
        seen."""
        if task_id not in self.unknown:
            self.note(f"unknown {task_id}: {json.dumps(error)[:120]}")
        self.unknown.add(task_id)
        if task_id in self.completed:
            self.lost.add(task_id)
        elif task_id in self.terminal:
            self.changed.add(task_id)

    def observe(self, task_id: str, task: dict) -> None:
        """Check one tasks/get answer against everything seen of this task before."""
        status = task.get("status", "?")
        self.current[task_id] = status
        if task_id in self.completed:
            if status != "completed" or task.get("result") != self.completed[task_id]:
                if task_id not in self.lost:
                    self.note(f"lost {task_id}: was completed, now {status} {json.dumps(task)[:150]}")
                self.lost.add(task_id)
        elif task_id in self.terminal:
            if (status, task.get("error")) != self.terminal[task_id]:
                if task_id not in self.changed:
                    self.note(f"terminal changed {task_id}: was {self.terminal[task_id][0]}, now {status}")
                self.changed.add(task_id)
        elif status == "completed":
            self.completed[task_id] = task.get("result")
            self.completed_at[task_id] = time.monotonic()
        elif status in TERMINAL:
            self.terminal[task_id] = (status, task.get("error"))
            self.terminal_at[task_id] = time.monotonic()


class Transport(Exception):
    """A request that got no JSON-RPC answer: `kind` is cut, refused, no_backend, timeouts or other."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind


async def rpc(
    http: aiohttp.ClientSession, url: str, method: str, params: dict, name: str, timeout_s: float
) -> dict:
    """One 2026-07-28 request; returns the JSON-RPC message (plus `_http` status). Raises Transport."""
    headers = {
        "Content-Type": "application/json",
        "Accept": "application/json, text/event-stream",
        "MCP-Protocol-Version": "2026-07-28",
        "Mcp-Method": method,
        "Mcp-Name": name,
    }
    body = {
        "jsonrpc": "2.0",
        "id": random.randrange(1 << 30),
        "method": method,
        "params": {**params, "_meta": META},
    }
    try:
        async with http.post(
            url, json=body, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as resp:
            status = resp.status
            text = await resp.text()
    except aiohttp.ClientConnectorError as exc:
        raise Transport("refused", str(exc)) from None
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError, aiohttp.ClientOSError) as exc:
        raise Transport("cut", f"{type(exc).__name__}: {exc}") from None
    except TimeoutError:
        raise Transport("timeouts", f"{method} timed out") from None
    except aiohttp.ClientError as exc:
        raise Transport("other", f"{type(exc).__name__}: {exc}") from None
    try:
        if text.startswith("event:") or "\ndata:" in text or text.startswith("data:"):
            datas = [
                json.loads(line[5:])
                for line in text.splitlines()
                if line.startswith("data:") and line[5:].strip()
            ]
            msg = datas[-1]
        else:
            msg = json.loads(text)
    except (ValueError, IndexError):
        # HAProxy's own page: 502/504 = the backend died under the request, 503 = no backend up.
        raise Transport(
            "cut" if status in (502, 504) else "no_backend" if status == 503 else "other",
            f"HTTP {status} {text[:120]!r}",
        ) from None
    if not isinstance(msg, dict):
        raise Transport("other", f"HTTP {status} {text[:120]!r}")
    msg["_http"] = status
    return msg


def transport_error(run: Run, exc: Transport, what: str) -> None:
    run.transport[f"{what}_{exc.kind}"] += 1
    if exc.kind == "other":
        run.note(f"{what}: {exc}")


async def chaos(target: Target, args: argparse.Namespace) -> dict:
    """Drive load, polls and kills against `target`; return the report (see the module docstring)."""
    rng = random.Random(args.seed)
    run = Run()
    stop_polling = asyncio.Event()
    kills_done = asyncio.Event()
    call_budget = asyncio.Semaphore(args.concurrency)
    # one connection per request: a kill cuts only what it cuts
    connector = aiohttp.TCPConnector(force_close=True, limit=0)
    async with aiohttp.ClientSession(connector=connector) as http:

        async def one_call(i: int) -> None:
            tool, arguments = mixed_call(i, rng)
            run.labels[arguments["label"]] = tool
            run.counts["calls"] += 1
            run.inflight_calls[i] = time.monotonic()
            try:
                reply = await rpc(
                    http,
                    target.url,
                    "tools/call",
                    {"name": tool, "arguments": arguments},
                    tool,
                    args.request_timeout,
                )
            except Transport as exc:
                transport_error(run, exc, "call")  # no handle was delivered: not a task of ours
                await asyncio.sleep(0.05)
                return
            finally:
                del run.inflight_calls[i]
            result = reply.get("result") or {}
            if result.get("resultType") == "task" and isinstance(result.get("taskId"), str):
                run.handed[result["taskId"]] = time.monotonic()
                run.call_of[result["taskId"]] = (tool, arguments["label"])
            elif "error" in reply:
                if reply["_http"] == 503:
                    run.counts["store_unavailable"] += 1
                else:
                    run.counts["sync_errors"] += 1
                    run.sync_failures.append((tool, reply["error"]))
            else:
                run.counts["sync_results"] += 1

        async def load() -> None:
            # At least --calls calls, and on until the last kill (so every kill has calls to cut).
            pending: set[asyncio.Task[None]] = set()

            def done(task: asyncio.Task[None]) -> None:
                pending.discard(task)
                call_budget.release()

            i = 0
            while i < args.calls or not kills_done.is_set():
                i += 1
                await call_budget.acquire()
                task = asyncio.create_task(one_call(i))
                pending.add(task)
                task.add_done_callback(done)
                await asyncio.sleep(rng.uniform(0, 2 * args.spacing))
            if pending:
                await asyncio.wait(pending, timeout=args.request_timeout + 5)

        async def poll(task_id: str) -> None:
            run.inflight_polls += 1
            try:
                reply = await rpc(
                    http, target.url, "tasks/get", {"taskId": task_id}, task_id, args.request_timeout
                )
            except Transport as exc:
                transport_error(run, exc, "poll")
                return
            finally:
                run.inflight_polls -= 1
            run.counts["polls"] += 1
            error = reply.get("error")
            if error is not None:
                if error.get("code") == UNKNOWN_TASK:
                    run.forgotten(task_id, error)
                elif reply["_http"] == 503:
                    run.counts["store_unavailable"] += 1
                else:
                    run.note(f"tasks/get {task_id}: {json.dumps(error)[:200]}")
                return
            run.observe(task_id, reply.get("result") or {})

        async def poller() -> None:
            # Every handed id, again and again (terminal ones too: a seen result must not change).
            gate = asyncio.Semaphore(args.poll_concurrency)

            def refusals() -> int:
                return run.transport["poll_refused"] + run.transport["poll_no_backend"]

            async def gated(task_id: str, refused: int) -> None:
                async with gate:
                    if refusals() == refused:  # the round ends at the first refusal (nothing serves)
                        await poll(task_id)

            while not stop_polling.is_set():
                ids = list(run.handed)
                refused = refusals()
                if ids:
                    await asyncio.gather(*(gated(t, refused) for t in ids))
                try:  # a longer pause while nothing answers
                    pause = args.poll_pause * (4 if refusals() > refused else 1)
                    await asyncio.wait_for(stop_polling.wait(), timeout=pause)
                except TimeoutError:
                    pass

        async def wait_for(cond, bound_s: float) -> bool:
            deadline = time.monotonic() + bound_s
            while not cond():
                if time.monotonic() > deadline:
                    return False
                await asyncio.sleep(0.005)
            return True

        def calls_reached_server() -> bool:
            # An outstanding call sent at least 20 ms ago: it is at the proxy (or its upstream).
            now = time.monotonic()
            return any(now - t > 0.02 for t in list(run.inflight_calls.values()))

        async def killer() -> None:
            try:
                await kills()
            finally:
                kills_done.set()

        async def kills() -> None:
            extras = target.extra_chaos()
            extra_after = rng.randrange(1, max(2, args.kills)) if extras else -1  # between two kills
            for k in range(args.kills):
                # Spread kills over the load; the first only once completed results were seen.
                share = (k + 1) / (args.kills + 1)
                await wait_for(
                    lambda share=share: run.counts["calls"] >= share * args.calls, args.request_timeout * 4
                )
                if k == 0:
                    await wait_for(lambda: len(run.completed) >= args.min_seen, 60)
                await asyncio.sleep(rng.uniform(0, 0.3))
                await wait_for(calls_reached_server, 10)  # land while calls are outstanding
                calls, polls = len(run.inflight_calls), run.inflight_polls
                killed = await asyncio.to_thread(target.kill, rng)
                label, at_process = killed.label, killed.at_process
                run.killed.append(killed)
                run.kill_times.append(time.monotonic())
                run.counts["kills"] += 1
                run.counts["calls_in_flight_at_kills"] += calls
                run.counts["polls_in_flight_at_kills"] += polls
                if (calls + polls if at_process is None else at_process) > 0:
                    run.counts["kills_with_requests_in_flight"] += 1
                if at_process is not None:
                    run.counts["requests_at_killed_processes"] += at_process
                print(
                    f"kill {k + 1}: {label} (node {killed.node}, {len(killed.owned)} tasks running) with "
                    f"{calls} calls and {polls} polls of the client in flight"
                    + ("" if at_process is None else f", {at_process} at the killed process (HAProxy)"),
                    file=sys.stderr,
                    flush=True,
                )
                await asyncio.sleep(rng.uniform(0.1, 0.5))
                await asyncio.to_thread(target.revive)
                if k + 1 == extra_after:
                    for name in extras:
                        await asyncio.sleep(rng.uniform(0.2, 0.8))
                        await wait_for(calls_reached_server, 10)
                        print(
                            f"{name} restart with {len(run.inflight_calls)} calls in flight",
                            file=sys.stderr,
                            flush=True,
                        )
                        run.extra_times.setdefault(name, time.monotonic())
                        await asyncio.to_thread(target.extra, name, rng.uniform(0.3, 1.0))
                        run.counts[f"{name}_restarts"] += 1

        polling = asyncio.create_task(poller())
        await asyncio.gather(load(), killer())
        # Settle: keep polling until every handed task reads terminal, bounded.
        deadline = time.monotonic() + args.settle
        while time.monotonic() < deadline and any(run.current.get(t) not in TERMINAL for t in run.handed):
            await asyncio.sleep(0.1)
        stop_polling.set()
        await polling
        # Final pass: every handed id once more, each retried while the transport fails (bounded).
        statuses: dict[str, int] = {}
        not_terminal: list[str] = []
        finals: dict[str, dict] = {}
        for task_id in sorted(run.handed):
            reply: dict | None = None
            for _ in range(50):
                try:
                    reply = await rpc(
                        http, target.url, "tasks/get", {"taskId": task_id}, task_id, args.request_timeout
                    )
                    if reply["_http"] != 503:
                        break
                except Transport:
                    pass
                await asyncio.sleep(0.1)
            if reply is None or "error" in reply:
                if reply is not None and reply["error"].get("code") == UNKNOWN_TASK:
                    run.forgotten(task_id, reply["error"])
                    statuses["unknown"] = statuses.get("unknown", 0) + 1
                else:  # never readable at the end: not shown terminal
                    statuses["unreadable"] = statuses.get("unreadable", 0) + 1
                    not_terminal.append(task_id)
                continue
            task = reply.get("result") or {}
            run.observe(task_id, task)
            finals[task_id] = task
            status = task.get("status", "?")
            statuses[status] = statuses.get(status, 0) + 1
            if status not in TERMINAL:
                not_terminal.append(task_id)

    first_kill = run.kill_times[0] if run.kill_times else float("inf")
    last_kill = run.kill_times[-1] if run.kill_times else float("-inf")
    starts = Counter(target.starts.read_text().split()) if target.starts.exists() else Counter()
    report: dict[str, Any] = {
        "mode": getattr(args, "mode", "single"),
        "seed": args.seed,
        "rerun": args.rerun,
        "calls": run.counts["calls"],
        "sync_results": run.counts["sync_results"],
        "sync_errors": run.counts["sync_errors"],
        "handed_out": len(run.handed),
        "polls": run.counts["polls"],
        "seen_completed": len(run.completed),
        "seen_completed_before_first_kill": sum(1 for t in run.completed_at.values() if t < first_kill),
        "seen_completed_before_kill": sum(1 for t in run.completed_at.values() if t < last_kill),
        "kills": run.counts["kills"],
        "kills_with_requests_in_flight": run.counts["kills_with_requests_in_flight"],
        "calls_in_flight_at_kills": run.counts["calls_in_flight_at_kills"],
        "polls_in_flight_at_kills": run.counts["polls_in_flight_at_kills"],
        **(
            {"requests_at_killed_replicas": run.counts["requests_at_killed_processes"]}
            if args.replicas
            else {}
        ),
        "transport_errors": sum(run.transport.values()),
        "transport": run.transport,
        "store_unavailable": run.counts["store_unavailable"],
        "unknown_ids": len(run.unknown),
        "lost_results": len(run.lost),
        "terminal_changed": len(run.changed),
        "not_terminal": len(not_terminal),
        "final": statuses,
        **explain(run, finals, starts, args.rerun),
    }
    if run.counts["redis_restarts"]:
        report["redis_restarts"] = run.counts["redis_restarts"]
        at = run.extra_times["redis"]
        report["seen_completed_before_redis_restart"] = sum(1 for t in run.completed_at.values() if t < at)
        report["handed_out_before_redis_restart"] = sum(1 for t in run.handed.values() if t < at)
    violations = [
        k
        for k in (
            "unknown_ids",
            "lost_results",
            "terminal_changed",
            "not_terminal",
            "unexplained_failures",
            "double_runs",
        )
        if report[k]
    ]
    if args.rerun and report["lost_despite_rerun"]:
        violations.append("lost_despite_rerun")
    if args.rerun and args.kills and report["reruns"] == 0:
        violations.append("--rerun, but no call was re-run")
    if report["labels_started"] == 0:
        violations.append("the upstream recorded no call start")
    if args.kills and report["seen_completed_before_first_kill"] == 0:
        violations.append("no completed result seen before the first kill")
    if args.kills and report["kills_with_requests_in_flight"] == 0:
        violations.append("no kill landed with requests in flight")
    if args.replicas and args.kills and not report.get("seen_completed_before_redis_restart"):
        violations.append("no completed result seen before the Redis restart")
    if report["kills"] < args.kills:
        violations.append("fewer kills than asked")
    report["violations"] = violations
    if run.samples:
        report["samples"] = run.samples
    return report


def explain(run: Run, finals: dict[str, dict], starts: Counter[str], rerun: bool) -> dict[str, Any]:
    """Why each task that did not complete ended so, and how often the upstream started each call.

    `finals`: task id -> its last tasks/get result; `starts`: label -> starts the upstream recorded;
    `rerun`: slow_compute runs `on_restart: rerun`. A `failed` task is explained when its error is
    its tool's own (`failed_expected`) or names the loss of a process that was SIGKILLed while the
    task was running there (`failed_replica_lost`: a `(node X) was lost` error with X killed and the
    task among X's unfinished tasks at that kill, or the single proxy's restart error for a task
    some killed process owned). Anything else (also `cancelled`, which nobody asked for, and sync
    JSON-RPC errors other than instant_error's) counts in `unexplained_failures`. A label started
    n > 1 times is n-1 `reruns` when its task was re-run by policy (at most once per kill it was
    running at, and once more when it was running across the Redis restart: a replica that cannot
    renew its lease stops such calls before the lease lapses, and they run again once the store is
    back), else `double_runs`.
    """
    owned_at: dict[str, list[str]] = {}  # task id -> the killed nodes it was running on when each died
    for killed in run.killed:
        for task_id in killed.owned:
            owned_at.setdefault(task_id, []).append(killed.node)
    killed_at = {k.node: t for k, t in zip(run.killed, run.kill_times, strict=False)}
    outage_at = run.extra_times.get("redis")
    across_outage = (
        {
            task_id
            for task_id, handed in run.handed.items()
            if handed < outage_at and run.terminal_at.get(task_id, float("inf")) > outage_at
        }
        if outage_at is not None
        else set()
    )
    kinds: Counter[str] = Counter()
    out: dict[str, Any] = {
        "tasks_running_at_kills": sum(len(k.owned) for k in run.killed),
        "failed_replica_lost": 0,
        "failed_expected": 0,
        "unexplained_failures": 0,
        "double_runs": 0,
        "reruns": 0,
        "rerun_completed": 0,
        "lost_despite_rerun": 0,
    }
    samples: list[str] = []

    def unexplained(kind: str, msg: str) -> None:
        kinds[kind] += 1
        out["unexplained_failures"] += 1
        if kinds[kind] <= 2:  # two of each kind
            samples.append(msg[:400])

    for task_id, task in finals.items():
        status = task.get("status")
        if status == "completed":
            continue
        tool, label = run.call_of.get(task_id, ("?", "?"))
        text = json.dumps(task)
        lost = LOST.search(text) if status == "failed" else None
        if lost:
            node = lost.group(1)
            if task_id in owned_at and (node is None or node in owned_at[task_id]):
                out["failed_replica_lost"] += 1
                if rerun and tool == "slow_compute":
                    out["lost_despite_rerun"] += 1
                continue
            if node and node not in killed_at:
                kind = "lost_to_a_node_never_killed"
            elif node and run.terminal_at.get(task_id, float("inf")) < killed_at[node]:
                kind = "lost_before_its_node_was_killed"
            else:
                kind = "lost_but_not_running_at_the_kill"
            unexplained(
                kind,
                f"{task_id} {tool} {label}: {kind} (killed nodes {sorted(killed_at)}, running at "
                f"{owned_at.get(task_id, [])}): {text[:200]}",
            )
        elif status == "failed" and tool in EXPECTED_FAILURE and EXPECTED_FAILURE[tool] in text:
            out["failed_expected"] += 1
        else:
            unexplained(f"{status}_{tool}", f"{task_id} {tool} {label} ended {status}: {text[:250]}")
    for tool, error in run.sync_failures:
        if tool not in EXPECTED_FAILURE or EXPECTED_FAILURE[tool] not in json.dumps(error):
            unexplained(f"sync_error_{tool}", f"sync {tool}: {json.dumps(error)[:250]}")
    task_of = {label: task_id for task_id, (_, label) in run.call_of.items()}
    for killed in run.killed:  # a task whose handle a kill cut off is known by the call it keeps
        for task_id, label in killed.owned.items():
            if label is not None:
                task_of.setdefault(label, task_id)
    doubles: list[str] = []
    double_kinds: Counter[str] = Counter()
    for label, n in sorted(starts.items()):
        if n < 2 or label not in run.labels:
            continue
        task_id = task_of.get(label, "")
        allowed = (
            len(owned_at.get(task_id, ())) + (task_id in across_outage)
            if rerun and run.labels[label] == "slow_compute"
            else 0
        )
        reruns = min(n - 1, allowed)
        out["reruns"] += reruns
        out["double_runs"] += n - 1 - reruns
        if reruns and finals.get(task_id, {}).get("status") == "completed":
            out["rerun_completed"] += 1
        if n - 1 > reruns:
            double_kinds[
                "no_task_handed"
                if not task_id
                else "task_at_a_kill"
                if task_id in owned_at
                else "task_never_at_a_kill"
            ] += n - 1 - reruns
        if n - 1 > reruns and len(doubles) < 6:
            doubles.append(
                f"{label} ({run.labels[label]}, task {task_id or 'none handed'}) started {n} times, "
                f"running at {len(owned_at.get(task_id, ()))} kills; final "
                f"{finals.get(task_id, {}).get('status')}"
            )
    out["labels_started"] = len(starts)
    if kinds:
        out["unexplained"] = dict(kinds)
    if samples:
        out["unexplained_samples"] = samples
    if doubles:
        out["double_run_samples"] = doubles
        out["double_runs_by"] = dict(double_kinds)
    return out


def make_target(args: argparse.Namespace, workdir: Path) -> Target:
    if not args.replicas:
        return SingleProxy(workdir, args.rerun)
    return Replicas(args, workdir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--replicas",
        type=int,
        default=0,
        help="0 = one proxy process; N = N replicas behind HAProxy on Redis",
    )
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--kills", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=8, help="calls outstanding at once")
    parser.add_argument("--spacing", type=float, default=0.03, help="mean seconds between two call starts")
    parser.add_argument(
        "--min-seen", type=int, default=3, help="completed results to see before the first kill"
    )
    parser.add_argument(
        "--settle", type=float, default=30.0, help="seconds after the load for every task to end"
    )
    parser.add_argument("--poll-concurrency", type=int, default=4)
    parser.add_argument("--poll-pause", type=float, default=0.05, help="seconds between two polling rounds")
    parser.add_argument("--request-timeout", type=float, default=20.0, help="seconds per request")
    parser.add_argument("--lease", default="500ms", help="store.lease of the replicas (replica mode)")
    parser.add_argument(
        "--rerun",
        action="store_true",
        help="slow_compute on_restart: rerun (a killed process's calls run again; replicas: "
        "MCP_RERUN_POLICY)",
    )
    parser.add_argument("--seed", type=int, default=int(time.time()))
    parser.add_argument("--keep", action="store_true", help="keep the work dir (logs)")
    args = parser.parse_args(argv)
    args.mode = f"replicas={args.replicas}" if args.replicas else "single"
    workdir = Path(tempfile.mkdtemp(prefix="mcp-tasks-proxy-chaos-"))

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)  # SIGTERM stops every process started, like Ctrl-C
    target = make_target(args, workdir)
    try:
        report = asyncio.run(chaos(target, args))
    finally:
        target.stop()
        if not args.keep:
            import shutil

            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print(f"work dir kept: {workdir}", file=sys.stderr)
    print(json.dumps(report, sort_keys=True), flush=True)
    return 1 if report["violations"] else 0


sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/cluster.py

if __name__ == "__main__":
    sys.exit(main())
