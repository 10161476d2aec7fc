"""Chaos run: mixed calls and polls while proxy processes are SIGKILLed under them, then checks.

    python scripts/chaos.py [--calls 200] [--kills 4] [--seed N] [--rerun]     # one proxy process
    python scripts/chaos.py --replicas 3 [--calls 300] [--kills 6] [--seed N] [--rerun]
                                                  # N replicas, HAProxy, Redis
    ... [--keepalive 0.5]            # either mode: an upstream closing idle connections (below)
    ... --replicas 3 --partition     # a replica cut off from Redis past its lease (below)
    ... --damage                     # one process: a damaged store must be refused at start (below)

Upstream: the legacy fixture server through scripts/chaos_upstream.py, which records each call's
`label` as each run of it starts and ends (every call of the load carries its own). `--rerun`
configures slow_compute `on_restart: rerun` (replicas: MCP_RERUN_POLICY, read by config/replicas.yaml).
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

Cases (flags; each adds its checks and report fields, the checks below hold as well):
- `--keepalive S` (s, e.g. 0.5): the upstream closes connections idle S (uvicorn's keep-alive), and
  the proxy reaches it through a relay (tests/support/relay.py) that closes a reused connection
  idle KEEPALIVE_RELAY_IDLE * S as a request arrives on it, unforwarded: the race of a pool handing
  out a connection the server is closing, made certain (the proxy's pool keeps idle connections
  `keepalive_timeout`, 4 s by default: longer than S). The load comes in bursts of --concurrency
  calls, each burst followed (once answered) by an idle gap of 0.9-1.1 S. Checked: no call failed
  with "upstream ... unreachable", connections were closed as requests arrived, and requests were
  lost on them: a request safe to send twice is re-sent on a fresh connection (the proxy's
  `upstream_resent` log lines, counted across restarts); a `tools/call` is not (it may have run),
  and fails saying so (`failed_stale_connection`); no call ran twice.
- `--partition` (replica mode): replica CUT_OFF reaches Redis through a relay in this process, and
  slow_compute calls last up to 3 leases (`--lease`); just before the Redis restart, once that
  replica runs a call with at least a lease left (waiting up to 15 s), the relay holds every byte
  both ways for `--partition-s` (default PARTITION_LEASES leases) and then lets them on. The
  replica keeps serving HTTP meanwhile. It must stop its calls that
  another replica may re-run (on_restart: rerun) before its lease lapses: the upstream's start and
  end times of each run show whether two runs of one call ever overlapped (`overlapping_runs`, in
  every mode). Its tasks at the cut (read from Redis directly), and those whose call it ran while
  cut off and could record only once back (its log's task_created, see cut_off_created), may end
  lost (explained: `failed_partition_lost`) or be re-run once.
- `--damage` (single process): after each kill, with the proxy down, the store is copied aside
  and damaged (DAMAGE_KINDS in turn, see damage_store: cache.db emptied, deleted, or pages garbled);
  a proxy started on it (on a port of its own) must exit non-zero naming cache.db instead of
  serving; if it comes up, the ids seen completed are asked of it (`damaged_served_unknown_ids`).
  The copy then goes back and the proxy restarts on it, so the other checks cover the restored store.

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
  replica's node id comes from its log's `replica_started` line), or of a replica cut off from
  Redis (`failed_partition_lost`: X the cut-off node, the task running there across the
  partition, see --partition), and a call the fence stopped while it was becoming a task as its
  replica lost the store (`sync_fenced`: a synchronous -32800 naming the lease). Split by kind in
  `unexplained` (e.g. `lost_to_a_node_never_killed`, `lost_before_its_node_was_killed`);
- `double_runs`: extra upstream starts of a call label, beyond the re-runs the policy explains
  (`reruns`: with --rerun, a slow_compute task re-run at most once per kill or partition it was
  running at, and once for the task a fenced -32800 named: its create may have landed, and then
  another replica re-runs it; `fenced_reruns` counts those);
  split in `double_runs_by` by the task the client was handed: no_task_handed (the call's answer
  never came), task_never_at_a_kill (e.g. a request HAProxy re-sent after a cut or a 503: the
  handed task is the second replica's), task_at_a_kill (ran again without a re-run policy),
  task_at_a_partition (run by the cut-off replica across a partition, and more than once again);
- with --rerun: `lost_despite_rerun` (a slow_compute task failed as lost) and no re-run at all;
- `overlapping_runs`: a call two of whose upstream runs overlapped in time (running twice at once),
  unless its task was running at a kill (a SIGKILLed process cannot stop its upstream call);
- `upstream_unreachable`: a call or task that failed because the upstream was "unreachable" (also
  counted in unexplained_failures: the chaos run never stops the upstream);
- --keepalive: no connection closed as a request arrived, or no request lost on one (neither re-sent
  nor failed as not sent again: the race never ran);
- --partition: no partition, one not longer than the lease, no call at the cut-off replica
  outlasting the lease at the cut, or (with --rerun) no call fenced by the cut-off replica;
- --damage: `damaged_starts_served` (a proxy came up on a damaged store), `damaged_starts_unclear`
  (it exited 0 or without naming cache.db, or hung), or no damaged start tried;
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
fenced_reruns, rerun_completed, lost_despite_rerun, violations[...]; in replica mode also
requests_at_killed_replicas, redis_restarts, seen_completed_before_redis_restart and
handed_out_before_redis_restart (the tasks whose survival across the Redis restart is checked);
always failed_partition_lost, overlapping_runs (+ samples, overlapping_runs_by{task_at_a_partition,
other}), upstream_unreachable. With --keepalive: keepalive_s (s), idle_gaps,
upstream_closed_on_request (the relay's closes), upstream_resent (the proxy's resends, from its
logs). With --partition: lease_s (s), partitions, partition_s (s,
measured), tasks_running_at_partition (the cut-off node's unfinished tasks at the cut),
tasks_past_lease_at_partition (those with a lease or more of their call left),
tasks_created_after_partition, fenced_calls (calls the cut-off replica's `replica_fenced` log lines
stopped during the partition). With --damage: damaged_starts, damaged_starts_refused (exit non-zero,
stderr naming cache.db), damaged_starts_served, damaged_starts_unclear, damaged_served_unknown_ids,
damage_kinds_refused, damage_samples (what each start printed last).
Loopback only; every process it starts is stopped (relays run on a thread of this process).
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import io
import json
import math
import os
import queue
import random
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
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


class RelayLoop:
    """tests/support/relay.py's TcpRelays on an event loop of their own (a daemon thread), so that the
    blocking Target methods (run in threads) can pause and resume them and read their counts."""

    def __init__(self) -> None:
        from support.relay import TcpRelay

        self._relay_class = TcpRelay
        self.loop = asyncio.new_event_loop()
        # A relayed connection whose target refuses it (redis-server down for its restart) is closed
        # by asyncio after it reports the error: expected here, not worth a traceback.
        self.loop.set_exception_handler(lambda loop, context: None)
        self.relays: list[Any] = []
        self._thread = threading.Thread(target=self.loop.run_forever, name="chaos-relays", daemon=True)
        self._thread.start()

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=10)

    def relay(self, host: str, port: int, *, close_idle_s: float | None = None) -> tuple[Any, int]:
        """A new TcpRelay to `host:port` (`close_idle_s`, s: see TcpRelay) and its loopback port."""

        async def start() -> tuple[Any, int]:
            relay = self._relay_class(host, port, close_idle_s=close_idle_s)
            return relay, await relay.start()

        relay, relay_port = self._run(start())
        self.relays.append(relay)
        return relay, relay_port

    def pause(self, relay: Any) -> None:
        """Hold every byte through `relay` from now on (returns once that holds)."""

        async def pause() -> None:
            relay.pause()

        self._run(pause())

    def resume(self, relay: Any) -> None:
        async def resume() -> None:
            relay.resume()

        self._run(resume())

    def stop(self) -> None:
        """Close every relay and end the thread."""

        async def close() -> None:
            for relay in self.relays:
                relay.resume()
                await relay.close()

        try:
            self._run(close())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)
            self.loop.close()


def relayed_url(url: str, relay_port: int) -> str:
    """`url` (http://host:port/... or redis://host:port/...) with its port replaced by `relay_port`."""
    scheme, rest = url.split("://", 1)
    address, _, path = rest.partition("/")
    return f"{scheme}://{address.rsplit(':', 1)[0]}:{relay_port}/{path}"


def host_port(url: str) -> tuple[str, int]:
    """(host, port) of `url` (scheme://host:port/...)."""
    host, port = url.split("://", 1)[1].split("/")[0].rsplit(":", 1)
    return host, int(port)


def seconds_of(duration: str) -> float:
    """`500ms`, `1s`, `1.5s` or `2` (s) in seconds."""
    text = duration.strip()
    if text.endswith("ms"):
        return float(text[:-2]) / 1000
    return float(text.removesuffix("s"))


@dataclass
class UpstreamRuns:
    """What the upstream recorded (scripts/chaos_upstream.py): label -> the (start, end) wall-clock
    times (s) of each run of that call, end `math.inf` for a run that never ended."""

    runs: dict[str, list[tuple[float, float]]] = field(default_factory=dict)

    @classmethod
    def read(cls, path: Path) -> UpstreamRuns:
        starts: dict[tuple[str, str], float] = {}
        ends: dict[tuple[str, str], float] = {}
        text = path.read_text(errors="replace") if path.exists() else ""
        for line in text.splitlines():
            parts = line.split()
            if len(parts) == 4 and parts[2] in ("start", "end"):
                (starts if parts[2] == "start" else ends)[(parts[0], parts[1])] = float(parts[3])
        out = cls()
        for (label, run), start in sorted(starts.items(), key=lambda item: item[1]):
            out.runs.setdefault(label, []).append((start, ends.get((label, run), math.inf)))
        return out

    def starts(self) -> Counter[str]:
        """label -> how often the upstream started it."""
        return Counter({label: len(runs) for label, runs in self.runs.items()})

    def overlapping(self, label: str) -> bool:
        """True when two runs of `label` were running at the same moment."""
        latest_end = -math.inf
        for start, end in self.runs.get(label, ()):  # sorted by start
            if start < latest_end:
                return True
            latest_end = max(latest_end, end)
        return False


def log_events(logs: list[Path], event: str, window: tuple[float, float] | None = None) -> list[dict]:
    """The entries of the JSON-lines `logs` whose event is `event`; with `window` (wall-clock start,
    end, s) only those logged then."""
    found: list[dict] = []
    for log in logs:
        text = log.read_text(errors="replace") if log.exists() else ""
        for line in text.splitlines():
            if f'"{event}"' not in line:
                continue
            try:
                entry = json.loads(line)
                at = datetime.fromisoformat(entry["timestamp"]).timestamp() if window else 0.0
            except (ValueError, KeyError, TypeError):
                continue
            if entry.get("event") == event and (window is None or window[0] <= at <= window[1]):
                found.append(entry)
    return found


@dataclass
class Killed:
    """One SIGKILL: `label` (e.g. `replica 2`), requests the killed process itself was serving
    (`at_process`, None when only the client's own count is known), its node id (the store's
    owner name for it) and the unfinished tasks it owned when it died (read from the store right
    after the kill, before any other node can take them over; replicas: also just before it):
    task id -> the call's label, when the record keeps the call for a re-run (None otherwise)."""

    label: str
    at_process: int | None
    node: str
    owned: dict[str, str | None]


def counting_upstream(workdir: Path, keep_alive_s: float | None = None) -> tuple[Child, Path]:
    """The legacy fixture server, recording every call's `label` as it starts and ends
    (scripts/chaos_upstream.py; `keep_alive_s`: uvicorn closes a connection idle that long, s);
    returns it and the file of start and end lines."""
    starts = workdir / "starts.log"
    env = {**os.environ, "MCP_CHAOS_STARTS": str(starts)}
    argv = [sys.executable, "scripts/chaos_upstream.py", "--port", "0"]
    if keep_alive_s is not None:
        argv += ["--keep-alive", str(keep_alive_s)]
    return Child(argv, env=env), starts


class UpstreamRelay:
    """With --keepalive: the upstream on a short keep-alive, reached through a relay that closes a
    reused connection idle for KEEPALIVE_RELAY_IDLE of that keep-alive as a request arrives on it
    (the request is never forwarded): the race of a pool handing out a connection the server is
    closing, made certain. `url` is what the proxy is given; `closed_on_request` counts those closes."""

    def __init__(self, upstream: Child, keep_alive_s: float) -> None:
        self.relays = RelayLoop()
        try:
            host, port = host_port(upstream.url)
            idle_s = KEEPALIVE_RELAY_IDLE * keep_alive_s
            self.relay, relay_port = self.relays.relay(host, port, close_idle_s=idle_s)
        except BaseException:
            self.relays.stop()
            raise
        self.url = relayed_url(upstream.url, relay_port)

    @property
    def closed_on_request(self) -> int:
        return int(self.relay.closed_idle)

    def stop(self) -> None:
        self.relays.stop()


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


@dataclass
class Partition:
    """One partition (--partition): replica `label`'s link to Redis held from `paused_at` to
    `resumed_at` (monotonic, s; `wall`: the same two moments in wall-clock time, s), its node id, and
    the unfinished tasks that node owned when the link was cut (read from Redis directly: task id ->
    the call's label when the record keeps the call for a re-run, like Killed.owned)."""

    label: str
    node: str
    owned: dict[str, str | None]
    paused_at: float
    resumed_at: float
    wall: tuple[float, float]
    # Tasks whose call the cut-off replica was running while cut off but could record only once
    # back (see cut_off_created): task id -> label.
    created_after: dict[str, str | None] = field(default_factory=dict)

    @property
    def held(self) -> dict[str, str | None]:
        """Every task the cut-off node ran across the partition: `owned` and `created_after`."""
        return {**self.created_after, **self.owned}


def cut_off_created(run: Run, partition: Partition, log: Path) -> dict[str, str | None]:
    """Tasks the cut-off replica created (`task_created` in its `log`) from the cut until 10 s after
    the resume (s; its Redis calls give up after store.timeout, 5 s), whose call the client sent before
    the resume and was handed after the cut: calls that replica ran while cut off and could record
    only once back. Another replica may re-run such a task once (the fence stops the first run
    before) or end it as lost. Task id -> the call's label."""
    window = (partition.wall[0], partition.wall[1] + 10.0)
    created = {entry.get("task_id") for entry in log_events([log], "task_created", window)}
    return {
        task_id: run.call_of[task_id][1]
        for task_id in created
        if isinstance(task_id, str)
        and task_id in run.handed
        and run.sent[task_id] < partition.resumed_at
        and run.handed[task_id] > partition.paused_at
    }


class Target(Protocol):
    """What the chaos loop drives: one URL, and processes behind it to kill and bring back."""

    url: str
    starts: Path  # the upstream's start and end lines (scripts/chaos_upstream.py)
    upstream_relay: UpstreamRelay | None  # --keepalive: the relay in front of the upstream

    def kill(self, rng: random.Random) -> Killed:
        """SIGKILL one serving process now (blocking; runs in a thread) and say what died."""

    def revive(self) -> None:
        """Start again what the last kill() stopped (blocking; runs in a thread)."""

    def extra_chaos(self) -> list[str]:
        """Labels of the other events this target can run (e.g. `redis`, `partition`)."""

    def extra(self, name: str, down_s: float) -> Partition | None:
        """Run one extra event for `down_s` s (blocking; runs in a thread), e.g. restart redis-server;
        a partition says what it cut off."""

    def logs(self) -> list[Path]:
        """The proxy processes' logs (JSON lines, appended across restarts)."""

    def stop(self) -> None:
        """Stop every process this target started."""


def damage_store(store: Path, kind: str) -> None:
    """Damage the diskcache store directory `store` (no process has it open), as a failing disk or a
    slip of the hand would. `emptied`: cache.db truncated to 0 bytes, its -wal and -shm removed;
    `deleted`: cache.db, -wal and -shm removed; `garbled`: the WAL checkpointed into cache.db (as a
    clean shutdown leaves it), then every page from the middle of cache.db to its end overwritten with
    0xff. (Not here: garbled bytes in cache.db-wal, which the proxy refuses at start too when
    committed transactions follow the bad frame (tests/tasks/test_store_damage.py): by this step the
    run's own store read has checkpointed the log, so there is nothing left in it to garble.)"""
    database = store / "cache.db"
    if kind in ("emptied", "deleted"):
        for name in ("cache.db-wal", "cache.db-shm"):
            (store / name).unlink(missing_ok=True)
        if kind == "emptied":
            database.write_bytes(b"")
        else:
            database.unlink()
    elif kind == "garbled":
        con = sqlite3.connect(database)
        try:  # closed before the garbling: nothing of SQLite's writes after it
            page = int(con.execute("PRAGMA page_size").fetchone()[0])
            con.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
        finally:
            con.close()
        size = database.stat().st_size
        start = max(page, (size // 2) // page * page)  # page 1 (the header) stays: a database, damaged
        with open(database, "r+b") as file:
            file.seek(start)
            file.write(b"\xff" * (size - start))
    else:
        raise ValueError(kind)


def attempt_start(argv: list[str], log: Path, timeout_s: float) -> tuple[subprocess.Popen[str], str, bool]:
    """Start `argv` (a proxy that should refuse to start), stderr to `log`, and wait until it exits or
    prints `listening on URL` (bounded: `timeout_s` s, then it is killed). Returns the process, the
    URL it listens on ("" when it did not come up; it is then reaped) and whether it was killed for
    doing neither in time. A process that came up is left running: the caller stops it."""
    with open(log, "wb") as err:
        proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=err, text=True, cwd=ROOT, start_new_session=True
        )
    assert proc.stdout is not None
    lines: queue.Queue[str] = queue.Queue()
    stdout = proc.stdout

    def read() -> None:
        for line in stdout:
            lines.put(line)
        lines.put("")

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            line = lines.get(timeout=max(0.001, deadline - time.monotonic()))
        except queue.Empty:
            proc.kill()  # neither refused nor serving in time
            proc.wait(timeout=10)
            return proc, "", True
        if not line:
            break
        if line.startswith("listening on "):
            return proc, line.strip().removeprefix("listening on "), False
    proc.wait(timeout=10)
    return proc, "", False


class SingleProxy:
    """The legacy fixture server and one proxy process on a durable disk store."""

    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        keep_alive = args.keepalive or None
        self.upstream, self.starts = counting_upstream(workdir, keep_alive)
        self.upstream_relay: UpstreamRelay | None = None
        self.store_path = workdir / "store"
        self.workdir = workdir
        try:
            if keep_alive:
                self.upstream_relay = UpstreamRelay(self.upstream, keep_alive)
            config = workdir / "proxy.json"
            config.write_text(
                json.dumps(
                    {
                        "store": {"path": str(workdir / "store")},
                        "tasks": {"detach_after": "100ms", "ttl": "1h", "poll_interval": "100ms"},
                        "mcpServers": {
                            "fx": {
                                "url": self.upstream_relay.url if self.upstream_relay else self.upstream.url,
                                "tasks": {
                                    "tools": {
                                        "slow_compute": {"on_restart": "rerun" if args.rerun else "fail"}
                                    }
                                },
                            }
                        },
                    }
                )
            )
            self.argv = [sys.executable, "-m", "proxy", "--config", str(config), "--port", "0"]
            self.log = workdir / "proxy.log"
            self.proxy: Child | None = Child(self.argv, self.log)
        except BaseException:
            if self.upstream_relay is not None:
                self.upstream_relay.stop()
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

    def damaged_start(self, kind: str, task_ids: list[str], timeout_s: float) -> dict[str, Any]:
        """With the proxy down (after kill()): copy the store aside, damage it (`kind`, see
        damage_store), start a proxy on it on a port of its own (no client request reaches it) and see
        whether it refuses, then put the copy back. Returns {kind, exit (None: it came up), timed_out
        (it neither came up nor exited within `timeout_s` s: killed), names_file (its stderr names
        cache.db), message (its last stderr line), refused (it exited non-zero in time naming cache.db),
        served (it came up: then `unknown_ids`, how many of `task_ids`, each seen completed before, it
        answered unknown or not completed)}."""
        backup = self.workdir / "store-before-damage"
        shutil.copytree(self.store_path, backup, symlinks=True)
        database = os.path.join(os.path.realpath(self.store_path), "cache.db")
        log = self.workdir / f"damaged-start-{kind}.log"
        out: dict[str, Any] = {"kind": kind, "served": False, "unknown_ids": 0}
        proc: subprocess.Popen[str] | None = None
        try:
            damage_store(self.store_path, kind)
            proc, url, timed_out = attempt_start([*self.argv[:-1], "0"], log, timeout_s)
            text = log.read_text(errors="replace")
            lines = [line for line in text.splitlines() if line.strip()]
            out["exit"] = None if url else proc.returncode
            out["timed_out"] = timed_out
            out["names_file"] = database in text
            out["message"] = (lines[-1] if lines else "")[:400]
            out["refused"] = not url and not timed_out and proc.returncode != 0 and out["names_file"]
            if url:
                out["served"] = True
                out["unknown_ids"] = asyncio.run(_unknown_on(url, task_ids[:50]))
        finally:
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            shutil.rmtree(self.store_path)
            backup.rename(self.store_path)
        return out

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

    def extra(self, name: str, down_s: float) -> Partition | None:
        raise ValueError(name)

    def logs(self) -> list[Path]:
        return [self.log]

    def stop(self) -> None:
        try:
            if self.proxy is not None:
                self.proxy.stop()
        finally:
            if self.upstream_relay is not None:
                self.upstream_relay.stop()
            self.upstream.stop()


async def _unknown_on(url: str, task_ids: list[str]) -> int:
    """How many of `task_ids` (each seen completed) the proxy at `url` answers unknown or not completed."""
    unknown = 0
    async with aiohttp.ClientSession() as http:
        for task_id in task_ids:
            try:
                reply = await rpc(http, url, "tasks/get", {"taskId": task_id}, task_id, 10)
            except Transport:
                continue
            if (reply.get("result") or {}).get("status") != "completed":
                unknown += 1
    return unknown


def partitionable_cluster(relays: RelayLoop, cut_off: int, **kwargs: Any) -> Any:
    """A scripts/cluster.py Cluster (`kwargs`) whose replica `cut_off` reaches Redis through a pausable
    relay on `relays` (made once redis-server runs; its port stays the same across the Redis
    restart): `.redis_relay`."""
    from cluster import Cluster

    class PartitionableCluster(Cluster):
        redis_relay: Any = None
        redis_relay_url = ""

        def _spawn(self, i: int) -> None:
            if i != cut_off:
                super()._spawn(i)
                return
            if self.redis_relay is None:
                host, port = host_port(self.redis.url)
                self.redis_relay, relay_port = relays.relay(host, port)
                self.redis_relay_url = relayed_url(self.redis.url, relay_port)
            env, self.env = self.env, {**self.env, "MCP_REDIS_URL": self.redis_relay_url}
            try:
                super()._spawn(i)
            finally:
                self.env = env

    return PartitionableCluster(**kwargs)


class Replicas:
    """N replicas of config/replicas.yaml behind HAProxy on an AOF Redis (scripts/cluster.py), the
    legacy fixture server as upstream `web`; every request goes through HAProxy. With --partition,
    replica CUT_OFF reaches Redis through a relay that `extra("partition")` pauses."""

    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        from cluster import _redis_server_class

        keep_alive = args.keepalive or None
        self.upstream, self.starts = counting_upstream(workdir, keep_alive)
        self.upstream_relay: UpstreamRelay | None = None
        self.relays: RelayLoop | None = None
        self.cut_off = CUT_OFF if args.partition else -1
        try:
            if keep_alive:
                self.upstream_relay = UpstreamRelay(self.upstream, keep_alive)
            if args.partition:
                self.relays = RelayLoop()
            (workdir / "cluster").mkdir()  # Cluster writes its logs there but does not create a given dir
            options: dict[str, Any] = {
                "upstream_url": self.upstream_relay.url if self.upstream_relay else self.upstream.url,
                "replicas": args.replicas,
                "workdir": workdir / "cluster",
                "check_inter": "100ms",
                "settings": {
                    "MCP_LEASE": args.lease,
                    "MCP_DETACH_AFTER": "100ms",
                    "MCP_POLL_INTERVAL": "100ms",
                    "MCP_STDIO_DISABLED": "true",
                    "MCP_DRAIN_TIMEOUT": "1s",
                    "MCP_DRAIN_DETACHED": "1s",
                    "MCP_RERUN_POLICY": "rerun" if args.rerun else "fail",
                },
            }
            if self.relays is not None:
                self.cluster = partitionable_cluster(self.relays, self.cut_off, **options)
            else:
                from cluster import Cluster

                self.cluster = Cluster(**options)
            # Persistence on: every write on disk (AOF, fsync per write) before Redis acknowledges it.
            self.redis = _redis_server_class()(workdir / "redis", appendonly=True, appendfsync="always")
            self.cluster.redis = self.redis
            self.cluster.start()
        except BaseException:
            self._stop_helpers()
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
        node = node_of(self.cluster.log_path(self.killed))
        # Read just before and at once after: the others take its tasks over once its lease (--lease)
        # has lapsed, and on a loaded machine the read after the kill may come that late.
        before = self.owned(node)
        self.cluster.kill(self.killed)
        owned = {**before, **self.owned(node)}
        return Killed(f"replica {self.killed}", load.get(self.killed, 0), node, owned)

    def owned(self, node: str) -> dict[str, str | None]:
        """The unfinished tasks Redis records as owned by `node` (read directly, never through a relay)."""
        from proxy.tasks.redis_store import RedisTaskStore

        return owned_by(RedisTaskStore(self.redis.url, timeout_s=2.0), node)

    def cut_off_owned(self) -> tuple[str, dict[str, str | None]]:
        """--partition: the node id the cut-off replica runs as now, and its unfinished tasks."""
        node = node_of(self.cluster.log_path(self.cut_off))
        return node, self.owned(node)

    def revive(self) -> None:
        self.cluster.restart(self.killed)

    def extra_chaos(self) -> list[str]:
        # The partition first: after the Redis restart the other replicas judge leases again only
        # once they renewed their own for a lease (LeaseJudge), which would delay the takeover.
        return ["partition", "redis"] if self.cut_off >= 0 else ["redis"]

    def extra(self, name: str, down_s: float) -> Partition | None:
        if name == "redis":
            port = self.redis.port
            self.redis.kill()  # SIGKILL: what the AOF holds is all that comes back
            time.sleep(down_s)
            self.redis.start(port=port)  # same port and data dir; returns once it answers PING
            return None
        if name != "partition" or self.relays is None:
            raise ValueError(name)
        # The cut-off replica keeps serving HTTP (and its upstream calls) but reaches Redis no more:
        # nothing it sends arrives, nothing is refused, until resume.
        relay = self.cluster.redis_relay
        node = node_of(self.cluster.log_path(self.cut_off))
        self.relays.pause(relay)
        paused_at, wall_from = time.monotonic(), time.time()
        try:
            owned = self.owned(node)
            time.sleep(max(0.0, down_s - (time.monotonic() - paused_at)))
        finally:
            self.relays.resume(relay)
        resumed_at, wall_to = time.monotonic(), time.time()
        return Partition(f"replica {self.cut_off}", node, owned, paused_at, resumed_at, (wall_from, wall_to))

    def logs(self) -> list[Path]:
        return [self.cluster.log_path(i) for i in range(self.cluster.n)]

    def _stop_helpers(self) -> None:
        try:
            for helper in (self.relays, self.upstream_relay):
                if helper is not None:
                    helper.stop()
        finally:
            self.upstream.stop()

    def stop(self) -> None:
        try:
            self.cluster.stop()
        finally:
            self._stop_helpers()


# tool -> its own error text
FENCED = "could not renew its lease"  # the -32800 of a call the fence stopped (TaskService._fence_call)
# ... naming the task its create may have committed (another replica then re-runs that task once)
FENCED_TASK = re.compile(r"\(task (\S+), if the store took it")
EXPECTED_FAILURE = {
    "failing_job": "job failed",
    "instant_error": "instant_error exploded",
}
LOST = re.compile(r"\(node ([0-9a-f]+)\) was lost|the proxy restarted while this call was running")
STALE = re.compile(r"dropped a reused connection as the request arrived")  # a tools/call not resent
UNREACHABLE = re.compile(r"upstream \S+ unreachable")  # the proxy's error when the upstream request failed
CUT_OFF = 0  # --partition: the replica whose link to Redis is cut
KEEPALIVE_RELAY_IDLE = 0.4  # --keepalive: the relay closes a connection idle this share of the keep-alive
DAMAGE_KINDS = ("emptied", "deleted", "garbled")  # --damage: one per kill, in turn (see damage_store)
PARTITION_LEASES = 2.5  # --partition: how long the link is cut, in leases (unless --partition-s)


def mixed_call(i: int, rng: random.Random, slow_max_s: float = 1.5) -> tuple[str, dict]:
    """Call i of the mixed load: sync result, sync JSON-RPC error, a task failing, slow tasks (0.15 s
    to `slow_max_s` s). Every call carries its own `label` (the upstream records each run of it)."""
    kind = i % 6
    if kind == 0:
        return "greet", {"name": f"n{i}", "label": f"g{i}"}
    if kind == 1:
        return "failing_job", {"label": f"f{i}"}
    if kind == 2:
        return "instant_error", {"label": f"e{i}"}
    return "slow_compute", {"seconds": round(rng.uniform(0.15, slow_max_s), 2), "label": f"c{i}"}


@dataclass
class Run:
    """What the client saw: handed ids, terminal states seen, counts, violations."""

    handed: dict[str, float] = field(default_factory=dict)  # task id -> monotonic time handed
    call_of: dict[str, tuple[str, str]] = field(default_factory=dict)  # task id -> (tool, label)
    labels: dict[str, str] = field(default_factory=dict)  # label of every call sent -> tool
    killed: list[Killed] = field(default_factory=list)
    partitions: list[Partition] = field(default_factory=list)
    damaged_starts: list[dict[str, Any]] = field(default_factory=list)  # SingleProxy.damaged_start's
    seconds: dict[str, float] = field(default_factory=dict)  # slow_compute label -> its `seconds`
    sent: dict[str, float] = field(default_factory=dict)  # task id -> monotonic time its call was sent
    # (tool, error) of sync JSON-RPC errors
    sync_failures: list[tuple[str, dict]] = field(default_factory=list)
    # task id -> label: tasks a fenced -32800 named (their create may have landed, and be re-run)
    fenced: dict[str, str] = field(default_factory=dict)
    answers: dict[str, str] = field(default_factory=dict)  # label -> what the call got (for samples)
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
    extra_ends: dict[str, float] = field(default_factory=dict)  # e.g. redis -> when it first served again
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
            "idle_gaps": 0,
            "tasks_past_lease_at_partition": 0,
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
    lease_s = seconds_of(args.lease)
    # --partition: slow calls up to 3 leases long, so some outlast the lease at the cut-off replica
    slow_max_s = max(1.5, 3 * lease_s) if args.partition else 1.5
    stop_polling = asyncio.Event()
    kills_done = asyncio.Event()
    call_budget = asyncio.Semaphore(args.concurrency)
    # one connection per request: a kill cuts only what it cuts
    connector = aiohttp.TCPConnector(force_close=True, limit=0)
    async with aiohttp.ClientSession(connector=connector) as http:

        async def one_call(i: int) -> None:
            tool, arguments = mixed_call(i, rng, slow_max_s)
            run.labels[arguments["label"]] = tool
            if "seconds" in arguments:
                run.seconds[arguments["label"]] = arguments["seconds"]
            run.counts["calls"] += 1
            run.inflight_calls[i] = sent = time.monotonic()
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
                run.answers[arguments["label"]] = f"transport error ({exc.kind})"
                await asyncio.sleep(0.05)
                return
            finally:
                del run.inflight_calls[i]
            result = reply.get("result") or {}
            run.answers[arguments["label"]] = (
                f"HTTP {reply['_http']}: {json.dumps(reply.get('error', result))[:160]}"
            )
            if result.get("resultType") == "task" and isinstance(result.get("taskId"), str):
                run.handed[result["taskId"]] = time.monotonic()
                run.sent[result["taskId"]] = sent
                run.call_of[result["taskId"]] = (tool, arguments["label"])
            elif "error" in reply:
                if reply["_http"] == 503:
                    run.counts["store_unavailable"] += 1
                else:
                    run.counts["sync_errors"] += 1
                    run.sync_failures.append((tool, reply["error"]))
                    if fenced := FENCED_TASK.search(str(reply["error"].get("message"))):
                        run.fenced[fenced.group(1)] = arguments["label"]
            else:
                run.counts["sync_results"] += 1

        async def bursts() -> None:
            # --keepalive: --concurrency calls at once, then (once they answered) a pause of 0.9 to 1.1
            # times the upstream's keep-alive, so the proxy's pooled connections sit idle about as long
            # as the upstream keeps them; at least --calls calls, and on until the last kill.
            i = 0
            while i < args.calls or not kills_done.is_set():
                burst = [asyncio.create_task(one_call(i + n + 1)) for n in range(args.concurrency)]
                i += args.concurrency
                await asyncio.wait(burst, timeout=args.request_timeout + 5)
                run.counts["idle_gaps"] += 1
                await asyncio.sleep(rng.uniform(0.9, 1.1) * args.keepalive)

        async def load() -> None:
            # At least --calls calls, and on until the last kill (so every kill has calls to cut).
            if args.keepalive:
                await bursts()
                return
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

        async def past_lease_at_cut_off() -> int:
            # --partition: tasks the cut-off replica runs now whose call has a lease (s) or more left,
            # by its `seconds` (it started upstream about detach_after, 100 ms, before it was handed).
            assert isinstance(target, Replicas)
            _, owned = await asyncio.to_thread(target.cut_off_owned)
            now = time.monotonic()
            return sum(
                1
                for task_id in owned
                if run.call_of.get(task_id, ("", ""))[0] == "slow_compute"
                and task_id in run.handed
                and run.handed[task_id] - 0.1 + run.seconds.get(run.call_of[task_id][1], 0.0) - now >= lease_s
            )

        async def partition() -> None:
            # Only once the cut-off replica runs a call that outlasts the lease (waiting up to 15 s):
            # the fence must come while it runs.
            deadline = time.monotonic() + 15
            while not (past := await past_lease_at_cut_off()) and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            run.counts["tasks_past_lease_at_partition"] = past
            down_s = args.partition_s or PARTITION_LEASES * lease_s
            print(
                f"partition of replica {CUT_OFF} from Redis for {down_s:g} s with {past} of its calls "
                f"outlasting the lease ({len(run.inflight_calls)} calls of the client in flight)",
                file=sys.stderr,
                flush=True,
            )
            cut = await asyncio.to_thread(target.extra, "partition", down_s)
            assert cut is not None
            run.partitions.append(cut)

        async def damaged_start(k: int) -> None:
            # --damage: the store damaged while the proxy is down; its start must be refused.
            assert isinstance(target, SingleProxy)
            kind = args.damage_kinds[k % len(args.damage_kinds)]
            result = await asyncio.to_thread(target.damaged_start, kind, sorted(run.completed), 30.0)
            run.damaged_starts.append(result)
            print(
                f"damaged store ({kind}): "
                + (
                    f"the proxy came up on it, {result['unknown_ids']} seen-completed tasks unknown there"
                    if result["served"]
                    else f"start refused, exit {result['exit']}: {result['message'][:160]}"
                ),
                file=sys.stderr,
                flush=True,
            )

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
                if args.damage:
                    await damaged_start(k)
                await asyncio.sleep(rng.uniform(0.1, 0.5))
                await asyncio.to_thread(target.revive)
                if k + 1 == extra_after:
                    for name in extras:
                        await asyncio.sleep(rng.uniform(0.2, 0.8))
                        await wait_for(calls_reached_server, 10)
                        if name == "partition":
                            await partition()
                            continue
                        print(
                            f"{name} restart with {len(run.inflight_calls)} calls in flight",
                            file=sys.stderr,
                            flush=True,
                        )
                        run.extra_times.setdefault(name, time.monotonic())
                        await asyncio.to_thread(target.extra, name, rng.uniform(0.3, 1.0))
                        run.extra_ends.setdefault(name, time.monotonic())
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

    for p in run.partitions:
        p.created_after = cut_off_created(run, p, target.logs()[CUT_OFF])
    first_kill = run.kill_times[0] if run.kill_times else float("inf")
    last_kill = run.kill_times[-1] if run.kill_times else float("-inf")
    upstream_runs = UpstreamRuns.read(target.starts)
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
        **explain(run, finals, upstream_runs, args.rerun, stale=bool(args.keepalive)),
    }
    if args.keepalive:
        assert target.upstream_relay is not None
        report["keepalive_s"] = args.keepalive
        report["idle_gaps"] = run.counts["idle_gaps"]
        report["upstream_closed_on_request"] = target.upstream_relay.closed_on_request
        report["upstream_resent"] = len(log_events(target.logs(), "upstream_resent"))
    if args.partition:
        report["lease_s"] = lease_s
        report["partitions"] = len(run.partitions)
        report["partition_s"] = round(sum(p.resumed_at - p.paused_at for p in run.partitions), 3)
        report["tasks_running_at_partition"] = sum(len(p.owned) for p in run.partitions)
        report["tasks_past_lease_at_partition"] = run.counts["tasks_past_lease_at_partition"]
        cut_off_log = target.logs()[CUT_OFF : CUT_OFF + 1]
        report["tasks_created_after_partition"] = sum(len(p.created_after) for p in run.partitions)
        report["fenced_calls"] = sum(
            int(entry.get("calls", 0))
            for p in run.partitions
            for entry in log_events(cut_off_log, "replica_fenced", p.wall)
        )
    if args.damage:
        tried = run.damaged_starts
        report["damaged_starts"] = len(tried)
        report["damaged_starts_refused"] = sum(1 for d in tried if d["refused"])
        report["damaged_starts_served"] = sum(1 for d in tried if d["served"])
        report["damaged_starts_unclear"] = (
            len(tried) - report["damaged_starts_refused"] - report["damaged_starts_served"]
        )
        report["damaged_served_unknown_ids"] = sum(d["unknown_ids"] for d in tried)
        report["damage_kinds_refused"] = sorted({d["kind"] for d in tried if d["refused"]})
        report["damage_samples"] = [f"{d['kind']}: {d['message'][:300]}" for d in tried[:4]]
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
            "overlapping_runs",
            "upstream_unreachable",
        )
        if report[k]
    ]
    if args.keepalive and not report["upstream_closed_on_request"]:
        violations.append("--keepalive, but no upstream connection was closed as a request arrived")
    if args.keepalive and not (report["upstream_resent"] or report["failed_stale_connection"]):
        violations.append("--keepalive, but no upstream request was lost on a reused connection")
    if args.partition and not report["partitions"]:
        violations.append("--partition, but no partition happened")
    if report.get("partitions") and report["partition_s"] <= lease_s:
        violations.append("the partition did not outlast the lease")
    if report.get("partitions") and not report["tasks_past_lease_at_partition"]:
        violations.append("no call at the cut-off replica outlasted the lease when the partition began")
    if report.get("partitions") and args.rerun and not report["fenced_calls"]:
        violations.append("--partition --rerun, but the cut-off replica fenced no call")
    if args.damage and not report["damaged_starts"]:
        violations.append("--damage, but no damaged start was tried")
    if args.damage and report["damaged_starts_served"]:
        violations.append("damaged_starts_served")
    if args.damage and report["damaged_starts_unclear"]:
        violations.append("damaged_starts_unclear")
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


def explain(
    run: Run, finals: dict[str, dict], runs: UpstreamRuns, rerun: bool, *, stale: bool = False
) -> dict[str, Any]:
    """Why each task that did not complete ended so, and how often and when the upstream ran each call.

    `finals`: task id -> its last tasks/get result; `runs`: what the upstream recorded of each call;
    `rerun`: slow_compute runs `on_restart: rerun`; `stale` (--keepalive): a call failed because the
    upstream dropped a reused connection as it arrived (the proxy never sends a `tools/call` twice)
    is explained (`failed_stale_connection`). A `failed` task is explained when its error is
    its tool's own (`failed_expected`) or names the loss of a process that was SIGKILLed while the
    task was running there (`failed_replica_lost`: a `(node X) was lost` error with X killed and the
    task among X's unfinished tasks at that kill, or the single proxy's restart error for a task
    some killed process owned), or of a replica cut off from Redis past its lease while the task was
    running there (`failed_partition_lost`: X the cut-off node, the task among its unfinished tasks
    when the link was cut, or one whose call it ran while cut off: Partition.created_after). A
    synchronous -32800 naming the lease, in a run with a partition or a Redis outage, is explained
    too (`sync_fenced`: the call was becoming a task as its replica lost the store, and the create
    may have landed, so the fence stopped it). Anything else (also `cancelled`, which nobody asked
    for, and sync JSON-RPC errors other than instant_error's) counts in `unexplained_failures`;
    those whose error says the upstream was unreachable also count in `upstream_unreachable`. A
    label started n > 1 times is n-1 `reruns` when its task was re-run by policy (at most once per
    kill or partition it was running at, and once more when it was running at some moment of the
    Redis outage: a replica that cannot renew its lease stops such calls before the lease lapses,
    and they run again once the store is back; and once when a fenced -32800 named its task, whose
    create may have landed: `fenced_reruns`), else `double_runs`. A label two of whose runs
    overlapped in time counts in `overlapping_runs` (one call running twice at once), unless its
    task was running at a kill: a SIGKILLed process cannot stop its upstream call, which may go on
    while another re-runs it. Both are split by the task the client was handed (`double_runs_by`,
    `overlapping_runs_by`), a task the cut-off replica ran across a partition
    (`task_at_a_partition`) apart.
    """
    holds = [(k.node, k.owned) for k in run.killed] + [(p.node, p.held) for p in run.partitions]
    owned_at: dict[str, list[str]] = {}  # task id -> the nodes it was running on at each kill/partition
    for node, held in holds:
        for task_id in held:
            owned_at.setdefault(task_id, []).append(node)
    at_kills = {task_id for killed in run.killed for task_id in killed.owned}
    at_partitions = {(task_id, p.node) for p in run.partitions for task_id in p.held}
    partitioned = {task_id for task_id, _ in at_partitions} - at_kills
    killed_at = {k.node: t for k, t in zip(run.killed, run.kill_times, strict=False)}
    for p in run.partitions:
        killed_at.setdefault(p.node, p.paused_at)
    outage_at = run.extra_times.get("redis")
    outage_end = run.extra_ends.get("redis", float("inf"))
    across_outage = (  # running at some moment of the outage (a handle may arrive as Redis is killed)
        {
            task_id
            for task_id, handed in run.handed.items()
            if handed < outage_end and run.terminal_at.get(task_id, float("inf")) > outage_at
        }
        if outage_at is not None
        else set()
    )
    kinds: Counter[str] = Counter()
    out: dict[str, Any] = {
        "tasks_running_at_kills": sum(len(k.owned) for k in run.killed),
        "failed_replica_lost": 0,
        "failed_partition_lost": 0,
        "failed_expected": 0,
        "sync_fenced": 0,
        "failed_stale_connection": 0,
        "unexplained_failures": 0,
        "upstream_unreachable": 0,
        "double_runs": 0,
        "reruns": 0,
        "fenced_reruns": 0,
        "rerun_completed": 0,
        "lost_despite_rerun": 0,
        "overlapping_runs": 0,
    }
    samples: list[str] = []

    def unexplained(kind: str, msg: str) -> None:
        kinds[kind] += 1
        out["unexplained_failures"] += 1
        if UNREACHABLE.search(msg):
            out["upstream_unreachable"] += 1
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
                if node is not None and (task_id, node) in at_partitions:
                    out["failed_partition_lost"] += 1
                else:
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
                f"{task_id} {tool} {label}: {kind} (killed or cut-off nodes {sorted(killed_at)}, running "
                f"at {owned_at.get(task_id, [])}): {text[:200]}",
            )
        elif status == "failed" and tool in EXPECTED_FAILURE and EXPECTED_FAILURE[tool] in text:
            out["failed_expected"] += 1
        elif status == "failed" and stale and STALE.search(text):
            out["failed_stale_connection"] += 1
        else:
            unexplained(f"{status}_{tool}", f"{task_id} {tool} {label} ended {status}: {text[:250]}")
    for tool, error in run.sync_failures:
        cut_off = run.partitions or outage_at is not None  # a replica that could not renew its lease
        if cut_off and error.get("code") == -32800 and FENCED in str(error.get("message")):
            out["sync_fenced"] += 1
        elif stale and STALE.search(str(error.get("message"))):
            out["failed_stale_connection"] += 1
        elif tool not in EXPECTED_FAILURE or EXPECTED_FAILURE[tool] not in json.dumps(error):
            unexplained(f"sync_error_{tool}", f"sync {tool}: {json.dumps(error)[:250]}")
    task_of = {label: task_id for task_id, (_, label) in run.call_of.items()}
    for _, held in holds:  # a task whose handle was cut off is known by the call it keeps
        for task_id, label in held.items():
            if label is not None:
                task_of.setdefault(label, task_id)
    for task_id, label in run.fenced.items():  # ... and one a fenced -32800 named
        task_of.setdefault(label, task_id)
    doubles: list[str] = []
    double_kinds: Counter[str] = Counter()
    overlaps: list[str] = []
    overlap_kinds: Counter[str] = Counter()
    starts = runs.starts()
    for label, n in sorted(starts.items()):
        if n < 2 or label not in run.labels:
            continue
        task_id = task_of.get(label, "")
        allowed = (
            len(owned_at.get(task_id, ())) + (task_id in across_outage) + (task_id in run.fenced)
            if rerun and run.labels[label] == "slow_compute"
            else 0
        )
        reruns = min(n - 1, allowed)
        out["reruns"] += reruns
        if reruns and task_id in run.fenced:
            out["fenced_reruns"] += 1
        out["double_runs"] += n - 1 - reruns
        if reruns and finals.get(task_id, {}).get("status") == "completed":
            out["rerun_completed"] += 1
        if n - 1 > reruns:
            double_kinds[
                "no_task_handed"
                if not task_id
                else "task_at_a_partition"
                if task_id in partitioned
                else "task_at_a_kill"
                if task_id in owned_at
                else "task_never_at_a_kill"
            ] += n - 1 - reruns
        if n - 1 > reruns and len(doubles) < 6:
            doubles.append(
                f"{label} ({run.labels[label]}, task {task_id or 'none handed'}) started {n} times, "
                f"running at {len(owned_at.get(task_id, ()))} kills or partitions; final "
                f"{finals.get(task_id, {}).get('status')}; the call got {run.answers.get(label, 'nothing')}"
            )
        if task_id not in at_kills and runs.overlapping(label):
            out["overlapping_runs"] += 1
            overlap_kinds["task_at_a_partition" if task_id in partitioned else "other"] += 1
            if len(overlaps) < 6:
                spans = ", ".join(f"{start:.3f}-{end:.3f}" for start, end in runs.runs[label])
                overlaps.append(f"{label} ({run.labels[label]}, task {task_id or 'none handed'}) ran {spans}")
    out["labels_started"] = len(starts)
    if kinds:
        out["unexplained"] = dict(kinds)
    if samples:
        out["unexplained_samples"] = samples
    if doubles:
        out["double_run_samples"] = doubles
        out["double_runs_by"] = dict(double_kinds)
    if overlaps:
        out["overlapping_run_samples"] = overlaps
        out["overlapping_runs_by"] = dict(overlap_kinds)
    return out


def make_target(args: argparse.Namespace, workdir: Path) -> Target:
    if not args.replicas:
        return SingleProxy(args, workdir)
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
    parser.add_argument(
        "--keepalive",
        type=float,
        default=0.0,
        metavar="S",
        help="the upstream closes connections idle S seconds (e.g. 0.5), reached through a relay that "
        f"closes one idle {KEEPALIVE_RELAY_IDLE:g} S as a request arrives; the load comes in bursts "
        "with idle gaps of 0.9-1.1 S (0 = off)",
    )
    parser.add_argument(
        "--partition",
        action="store_true",
        help=f"replica mode: cut replica {CUT_OFF} off from Redis (a paused relay) for longer than the "
        "lease once, while it runs calls",
    )
    parser.add_argument(
        "--partition-s",
        type=float,
        default=None,
        help=f"seconds the partition lasts (default {PARTITION_LEASES:g} leases)",
    )
    parser.add_argument(
        "--damage",
        action="store_true",
        help="single process: after each kill, damage the store and check that the proxy refuses to "
        "start on it, then put the store back",
    )
    parser.add_argument(
        "--damage-kinds",
        default=",".join(DAMAGE_KINDS),
        help="comma-separated, one per kill in turn: emptied, deleted, garbled (see damage_store)",
    )
    parser.add_argument("--seed", type=int, default=int(time.time()))
    parser.add_argument("--keep", action="store_true", help="keep the work dir (logs)")
    args = parser.parse_args(argv)
    args.mode = f"replicas={args.replicas}" if args.replicas else "single"
    args.damage_kinds = [kind.strip() for kind in args.damage_kinds.split(",") if kind.strip()]
    if args.partition and not args.replicas:
        parser.error("--partition needs --replicas (a replica cut off from the shared Redis)")
    if (args.partition or args.damage) and args.kills < 1:
        parser.error("--partition and --damage need --kills 1 or more (they come after a kill)")
    if args.damage and args.replicas:
        parser.error("--damage is for the single process (its disk store)")
    if not args.damage_kinds or set(args.damage_kinds) - set(DAMAGE_KINDS):
        parser.error("--damage-kinds: emptied, deleted or garbled")
    if args.keepalive < 0:
        parser.error("--keepalive must be 0 (off) or a number of seconds")
    workdir = Path(tempfile.mkdtemp(prefix="mcp-tasks-proxy-chaos-"))

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)  # SIGTERM stops every process started, like Ctrl-C
    target: Target | None = None
    try:
        target = make_target(args, workdir)
        report = asyncio.run(chaos(target, args))
    finally:
        if target is not None:
            target.stop()
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print(f"work dir kept: {workdir}", file=sys.stderr)
    print(json.dumps(report, sort_keys=True), flush=True)
    return 1 if report["violations"] else 0


sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/cluster.py
sys.path.insert(0, str(ROOT / "tests"))  # tests/support/relay.py

if __name__ == "__main__":
    sys.exit(main())
