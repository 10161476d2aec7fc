"""Section r of the benchmark: 1 vs N replicas behind HAProxy on one Redis store, CPU per call per tier.

    python bench/run.py --sections r                       # 1 and 3 replicas (--r-replicas 1,3)
    python bench/run.py --sections r --quick               # tiny, figures meaningless

For each replica count: redis-server (appendonly yes, appendfsync always, as the chaos run and the
README's replica set-up use), that many `mcp-tasks-proxy` processes of one config on it
(`store: {url: redis://...}`), HAProxy (one thread, round robin, health check on /healthz) in
front, and the SDK fixture upstream behind. The same closed-loop load as sections a/b
(bench/loadgen.py) goes through HAProxy:

- `call`: a short 2026-07-28 `tools/call` (`greet`) passed through to the upstream;
- `tasks_get`: `tasks/get` of tasks stored in Redis (filled through the proxy's own store class);
- `detached`: a `tools/call` of `slow_compute` (200 ms upstream) that detaches after 20 ms, so each
  call is a task: its record created in Redis, the CreateTaskResult sent, the outcome written.

Measured per point: requests/s, p50/p99, and the CPU seconds per call of each tier (psutil
user+system of haproxy, of the replicas summed, of redis-server, of the upstream; the load
generator's own from its rusage).

Projection for N replicas on N machines (one replica per machine, HAProxy and Redis on their own
machine, the upstream scaled apart): a replica is one Python process, one core at most, so

    calls/s(N) ~= min(N / cpu_replica, 1 / cpu_redis, threads_haproxy / cpu_haproxy)

with each `cpu_*` the seconds of CPU per call of that tier measured at 3 replicas (Redis is one
thread; HAProxy is measured with one). Redis and HAProxy set the ceiling; the N at which a replica
more stops helping is `cpu_replica / max(cpu_redis, cpu_haproxy)`. On this 2-core machine every
process shares the same two cores, so the measured req/s of 1 vs 3 replicas shows contention, not
scaling: the CPU per call is the figure that carries over.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import redis_bench

HAPROXY = shutil.which("haproxy") or "/usr/sbin/haproxy"
PROJECT_N = (1, 2, 3, 4, 8, 16, 32)
DETACH_MS = 20
HOLD_S = 0.2


def start_haproxy(h: ModuleType, workdir: Path, name: str, backends: list[int]) -> tuple[Any, str]:
    """HAProxy (one thread, round robin over `backends` ports, /healthz checks); returns (Proc, /mcp URL)."""
    port = h.free_port()
    servers = "\n".join(f"    server r{i} 127.0.0.1:{p} check inter 1s" for i, p in enumerate(backends))
    cfg = workdir / f"{name}.cfg"
    cfg.write_text(f"""global
    maxconn 4096
    nbthread 1
defaults
    mode http
    timeout connect 2s
    timeout client 60s
    timeout server 60s
frontend mcp
    bind 127.0.0.1:{port}
    default_backend replicas
backend replicas
    balance roundrobin
    option httpchk GET /healthz
{servers}
""")
    proc = h.Proc(name, [HAPROXY, "-f", str(cfg), "-db"], workdir)
    h._wait_port(port, proc)
    return proc, f"http://127.0.0.1:{port}/mcp"


def replica_config(workdir: Path, name: str, upstream_url: str, redis_url: str, prefix: str) -> Path:
    config = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "store": {"url": redis_url, "prefix": prefix, "lease": "5s"},
        "tasks": {"detach_after": "10s", "ttl": "1h", "poll_interval": "500ms"},
        # slow_compute detaches after 20 ms: each such call becomes a task (record, outcome) in Redis.
        "mcpServers": {
            "bench": {
                "url": upstream_url,
                "tasks": {"tools": {"slow_compute": {"detach_after": f"{DETACH_MS}ms"}}},
            }
        },
    }
    path = workdir / f"{name}.json"
    path.write_text(json.dumps(config, indent=2))
    return path


def projection(cpu: dict[str, float]) -> dict[str, Any]:
    """calls/s for N replicas on N machines from CPU ms per call of each tier (see the module docstring)."""
    rep, redis, hap = cpu.get("replicas", 0.0), cpu.get("redis", 0.0), cpu.get("haproxy", 0.0)
    ceiling = min(1000 / x for x in (redis, hap) if x > 0) if (redis > 0 or hap > 0) else None
    rows = {}
    for n in PROJECT_N:
        per = n * 1000 / rep if rep > 0 else None
        cands = [x for x in (per, ceiling) if x is not None]
        rows[str(n)] = round(min(cands)) if cands else None
    knee = round(rep / max(redis, hap), 1) if max(redis, hap) > 0 else None
    return {
        "calls_per_s_by_n": rows,
        "ceiling_calls_per_s": round(ceiling) if ceiling else None,
        "n_at_ceiling": knee,
        "bound_by": "redis" if redis >= hap else "haproxy",
    }


def section_r(args, workdir: Path, log, h: ModuleType) -> dict:
    """Run section r; `h` is bench/run.py (its Proc, loadgen, cpu_seconds, ... helpers)."""
    counts = [int(x) for x in str(args.r_replicas).split(",")]
    rows: list[dict] = []
    upstream, up_url = h.start_sdk_upstream(workdir, None, "r-upstream-sdk")
    try:
        for n in counts:
            # Redis as in sections b/c (bench/redis_bench.py,
            # tests/support/redis_server.py): AOF, fsync per write.
            redis = redis_bench.start_redis(workdir, f"r{n}-redis", appendfsync="always", cpus=None)
            replicas: list[Any] = []
            haproxy = None
            try:
                redis_url, prefix = redis.url, f"bench-r{n}:"
                ids, _ = redis_bench.fill_redis(redis_url, prefix, args.r_tasks, "bench")
                ids_file = workdir / f"r{n}-ids.json"
                ids_file.write_text(json.dumps(ids))
                ports = []
                for i in range(n):
                    cfg = replica_config(workdir, f"r{n}-replica{i}", up_url, redis_url, prefix)
                    proc, url, _ = h.start_proxy(workdir, f"r{n}-replica{i}", cfg, None)
                    h.wait_ready(url.rsplit("/", 1)[0], proc)
                    replicas.append(proc)
                    ports.append(int(url.split(":")[2].split("/")[0]))
                haproxy, front = start_haproxy(h, workdir, f"r{n}-haproxy", ports)
                time.sleep(1.5)  # first health checks pass
                assert redis.process is not None
                tiers = {
                    "haproxy": [haproxy.pid],
                    "replicas": [p.pid for p in replicas],
                    "redis": [redis.process.pid],
                    "upstream": [upstream.pid],
                }
                loads: dict[str, dict[str, Any]] = {
                    "call": {
                        "mode": "modern",
                        "tool": "greet",
                        "arguments": {"name": "bench"},
                        "expect": "Hello, bench!",
                    },
                    "tasks_get": {"mode": "tasks_get", "ids_file": str(ids_file)},
                    "detached": {
                        "mode": "detach",
                        "tool": "slow_compute",
                        "arguments": {"seconds": HOLD_S},
                        "expect": '"resultType":"task"',
                        "detach_after_s": DETACH_MS / 1000,
                    },
                }
                for load, spec in loads.items():
                    before = {
                        t: sum(h.cpu_seconds(pid, children=False) for pid in pids)
                        for t, pids in tiers.items()
                    }
                    res = h.loadgen(
                        {
                            **spec,
                            "url": front,
                            "concurrency": args.r_concurrency,
                            "duration": args.duration,
                            "warmup": args.warmup,
                        },
                        None,
                    )
                    if load == "detached":
                        # the last tasks' outcomes are written (and counted) before the CPU is read
                        time.sleep(HOLD_S + 0.5)
                    calls = max(1, res["total_ok"])
                    cpu = {
                        t: round(
                            (sum(h.cpu_seconds(pid, children=False) for pid in pids) - before[t])
                            * 1000
                            / calls,
                            3,
                        )
                        for t, pids in tiers.items()
                    }
                    cpu["loadgen"] = round(res["loadgen_cpu_s"] * 1000 / calls, 3)
                    row = {
                        "replicas": n,
                        "load": load,
                        "rps": res["rps"],
                        "p50_ms": res["p50_ms"],
                        "p99_ms": res["p99_ms"],
                        "errors": res["errors"],
                        "error_samples": res["error_samples"],
                        "total_ok": res["total_ok"],
                        "cpu_ms_per_call": cpu,
                        "concurrency": args.r_concurrency,
                    }
                    rows.append(row)
                    log(
                        f"  r: {n} replica(s), {load:<9} {res['rps']:>8} req/s  p50 {res['p50_ms']} ms  p99 "
                        f"{res['p99_ms']} ms  errors "
                        f"{res['errors']}  CPU ms/call {cpu}"
                    )
            finally:
                if haproxy is not None:
                    haproxy.stop()
                for proc in replicas:
                    proc.stop()
                redis.stop()
    finally:
        upstream.stop()
    top = max(counts)
    proj = {r["load"]: projection(r["cpu_ms_per_call"]) for r in rows if r["replicas"] == top}
    for load, p in proj.items():
        log(
            f"  r: projection ({load}, CPU per call at {top} replicas): calls/s by N replicas on N machines "
            f"{p['calls_per_s_by_n']}; "
            f"ceiling {p['ceiling_calls_per_s']} calls/s ({p['bound_by']}), reached at N ~ "
            f"{p['n_at_ceiling']}"
        )
    return {
        "rows": rows,
        "projection": proj,
        "projection_from_replicas": top,
        "table_md": table(rows, proj, top, args),
    }


def table(rows: list[dict], proj: dict, top: int, args) -> list[str]:
    lines = [
        f"### r. replicas behind HAProxy on one Redis (concurrency {args.r_concurrency}, {args.duration:g} s "
        f"per point, unpinned)",
        "",
        "| replicas | load | req/s | p50 ms | p99 ms | CPU ms/call: haproxy | replicas (sum) | redis | "
        "upstream | loadgen | errors |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        c = r["cpu_ms_per_call"]
        lines.append(
            f"| {r['replicas']} | {r['load']} | {r['rps']} | {r['p50_ms']} | {r['p99_ms']} | {c['haproxy']} "
            f"| {c['replicas']} | "
            f"{c['redis']} | {c['upstream']} | {c['loadgen']} | {r['errors']} |"
        )
    lines += [
        "",
        f"Projection, N replicas on N machines (CPU per call at {top} replicas; calls/s = min(N / replica, 1 "
        f"/ redis, 1 / haproxy)):",
        "",
        "| load | " + " | ".join(f"N={n}" for n in PROJECT_N) + " | ceiling | bound by | N at ceiling |",
        "|---|" + "---:|" * (len(PROJECT_N) + 3),
    ]
    for load, p in proj.items():
        lines.append(
            f"| {load} | "
            + " | ".join(str(p["calls_per_s_by_n"][str(n)]) for n in PROJECT_N)
            + f" | {p['ceiling_calls_per_s']} | {p['bound_by']} | {p['n_at_ceiling']} |"
        )
    return lines + [""]
