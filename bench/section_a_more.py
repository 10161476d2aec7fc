"""Extra rows of section (a) (issue "Performance"): the proxy in front of a fast upstream, and an
even CPU layout for the direct baseline. Called by bench/run.py's section_a after its own rows.

1. **Fast upstream** (`bench/fake_upstream.py`, an aiohttp server answering `greet` over SSE, far
   cheaper per call than the SDK server): direct vs this proxy on both wires, in the layout of the
   other rows (upstream + load generator on CPU 0, proxy alone on CPU 1). Here the proxy's own cost
   shows: the upstream no longer hides it.
2. **Even layout** (`even` rows): in the pinned rows the direct baseline leaves CPU 1 idle while
   every proxy row gets CPU 1 to itself. These rows pin nothing: load generator, upstream and (for
   the proxy rows) the proxy share both cores, for the direct run as well, so direct and proxy get
   the same CPU. Each row's ratio is against the direct row of its own group.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

# bench/run.py as running (its __main__ module: Proc registry, PROXY_ENV for --ref), set by rows()
run: Any = None

GREET = {"tool": "greet", "arguments": {"name": "bench"}, "expect": "Hello, bench!"}


def _measure(args, label: str, url: str, mode: str, procs: list, lg_cpu: str | None, log, **extra) -> dict:
    before = {p.name: run.cpu_seconds(p.pid, children=False) for p in procs}
    res = run.loadgen(
        {
            "concurrency": args.concurrency,
            "duration": args.duration,
            "warmup": args.warmup,
            **GREET,
            "mode": mode,
            "url": url,
        },
        lg_cpu,
    )
    res["cpu_ms_per_call"] = {
        p.name: round(
            (run.cpu_seconds(p.pid, children=False) - before[p.name]) * 1000 / max(1, res["total_ok"]), 3
        )
        for p in procs
    }
    res.update(label=label, **extra)
    log(
        f"  a: {label:<58} {res['rps']:>8} req/s  p50 {res['p50_ms']} ms  p99 {res['p99_ms']} ms  errors "
        f"{res['errors']}"
    )
    return res


def _group(args, workdir: Path, log, *, upstream: str, pinned: bool, modern: bool) -> list[dict]:
    up_cpu, mid_cpu, lg_cpu = ("0", "1", "0") if pinned and args.pin else (None, None, None)
    layout = "pinned" if pinned and args.pin else "even: nothing pinned, all processes share both cores"
    tag = (
        f"{'fake upstream' if upstream == 'fake' else 'SDK upstream'}, "
        f"{'pinned' if pinned and args.pin else 'even layout'}"
    )
    start = run.start_fake_upstream if upstream == "fake" else run.start_sdk_upstream
    name = f"a-upstream-{upstream}-{'pinned' if pinned else 'even'}"
    rows: list[dict] = []
    up, up_url = start(workdir, up_cpu, name)
    try:
        base = _measure(
            args,
            f"direct to upstream ({tag})",
            up_url,
            "legacy",
            [up],
            lg_cpu,
            log,
            role="baseline-extra",
            wire="2025-11-25",
            group=tag,
            layout=layout,
        )
        rows.append(base)
        floor, floor_url = run.start_floor(
            workdir, mid_cpu, f"a-floor-{upstream}-{'pinned' if pinned else 'even'}", upstream=up_url
        )
        try:
            rows.append(
                _measure(
                    args,
                    f"floor: aiohttp pass-through ({tag})",
                    floor_url,
                    "legacy",
                    [up, floor],
                    lg_cpu,
                    log,
                    role="floor",
                    wire="2025-11-25",
                    group=tag,
                    layout=layout,
                    mid=floor.name,
                )
            )
        finally:
            floor.stop()
        cfg = run.write_config(
            workdir,
            f"a-proxy-{upstream}-{pinned}",
            {"url": up_url},
            workdir / f"a-store-{upstream}-{pinned}",
            durable=True,
        )
        proxy, url, _ = run.start_proxy(
            workdir, f"a-proxy-{upstream}-{'pinned' if pinned else 'even'}", cfg, mid_cpu
        )
        try:
            run.wait_ready(url.rsplit("/", 1)[0], proxy)
            rows.append(
                _measure(
                    args,
                    f"mcp-tasks-proxy, legacy client (relay) ({tag})",
                    url,
                    "legacy",
                    [up, proxy],
                    lg_cpu,
                    log,
                    role="proxy",
                    wire="2025-11-25",
                    group=tag,
                    layout=layout,
                    mid=proxy.name,
                )
            )
            if modern:
                rows.append(
                    _measure(
                        args,
                        f"mcp-tasks-proxy, 2026-07-28 client + tasks ext ({tag})",
                        url,
                        "modern",
                        [up, proxy],
                        lg_cpu,
                        log,
                        role="proxy",
                        wire="2026-07-28",
                        group=tag,
                        layout=layout,
                        mid=proxy.name,
                    )
                )
        finally:
            proxy.stop()
    finally:
        up.stop()
    for r in rows:
        r["ratio_vs_direct"] = round(r["rps"] / base["rps"], 3) if base["rps"] else None
    run.cpu_vs_floor(rows)
    return rows


def rows(args, workdir: Path, log, runner: ModuleType) -> list[dict]:
    """The extra rows: fast upstream pinned (both wires), fast upstream even, SDK upstream even
    (legacy wire). `runner` is bench/run.py's module as it runs."""
    global run
    run = runner
    out: list[dict] = []
    for upstream, pinned, modern in (("fake", True, True), ("fake", False, True), ("sdk", False, False)):
        try:
            out += _group(args, workdir, log, upstream=upstream, pinned=pinned, modern=modern)
        except Exception as exc:  # one group failing keeps the others
            log(f"  a: extra rows ({upstream}, pinned={pinned}) failed: {exc}")
            out.append(
                {
                    "label": f"extra rows ({upstream}, pinned={pinned})",
                    "role": "proxy",
                    "failed": str(exc)[:500],
                }
            )
        finally:
            run.Proc.stop_all()
    return out
