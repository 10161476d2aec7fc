"""A/B of proxy CPU per call across git revisions, interleaved in one run (a shared machine's load
drifts between two separate runs; within one run every revision sees the same drift).

    python bench/ab.py 0494dd5 eb020f5 HEAD   # rows: a-legacy, a-modern (SDK, fake upstream), b 100k / 1M
    python bench/ab.py 0494dd5 HEAD --rounds 5 --duration 5 --rows a-modern-sdk,b-1000000
    python bench/ab.py HEAD HEAD+tracing --rows a-modern-fake,a-legacy-fake   # tracing off vs on
    python bench/ab.py floor floor+uvloop HEAD HEAD+uvloop   # asyncio's loop vs uvloop, floor beside
    python bench/ab.py floor floor+store HEAD --rows b-100000   # tasks/get: floor from memory, from the store

A row `a-<wire>-fake-pN` calls the fast upstream's `chatty` tool with a progress token: N
progress notifications 1 ms apart (each its own read at the proxy, as from an upstream that
reports as it works), relayed to the client; beside the same row without `-pN` it gives the CPU
per relayed notification (use N of 100 or more: per-call noise is divided by N).

`floor` in place of a revision is bench/floor.py, the smallest correct aiohttp server in the
proxy's place: for (a) rows a byte pass-through in front of the same upstream (on the legacy wire
for the `modern` rows too: a pass-through cannot translate), for (b) rows a minimal JSON handler
answering `tasks/get` from a dict (`floor+store`: from the seeded diskcache directory, one read per
request, as the proxy stores it). `python bench/ab.py floor HEAD` gives the proxy's CPU per call as
a ratio to the floor's.

A revision ending in `+tracing` runs that revision with OpenTelemetry tracing on (sample ratio 1.0,
`OTEL_EXPORTER_OTLP_ENDPOINT` pointed at a sink in this process that takes each OTLP export and
drops it): the proxy's CPU then includes building, batching and encoding every span (its exporter
thread is part of the process). A revision (or `floor`) ending in `+uvloop` runs on uvloop
(`listen.event_loop: uvloop`; the floor's `--uvloop`); without it, on asyncio's own loop.

Each round measures every row for every revision (the revision order alternates by round); a
revision's proxy/ comes from `git archive` on PYTHONPATH (as bench/run.py --ref). Layout as in
bench/run.py: (a) upstream + load generator on CPU 0, proxy on CPU 1; (b) proxy on CPU 0, load
generator on CPU 1. Reported per row and revision: the median over rounds of the proxy's CPU ms per
call (psutil user+system), of req/s and of the proxy's RSS right after the row's load, and each
revision's ratio (CPU) to the first one. JSON goes to
bench/results/ab-<time>.json, a markdown table to stdout.
"""

from __future__ import annotations

import argparse
import datetime as dt
import http.server
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run  # noqa: E402
import stores  # noqa: E402

ROWS = ["a-legacy-sdk", "a-modern-sdk", "a-legacy-fake", "a-modern-fake", "b-100000", "b-1000000"]
GREET = {"tool": "greet", "arguments": {"name": "bench"}, "expect": "Hello, bench!"}


TRACING = "+tracing"
UVLOOP = "+uvloop"
STORE = "+store"  # floor only: (b) rows read each record from the seeded diskcache directory
FLOOR = "floor"


class _OtlpSink(http.server.BaseHTTPRequestHandler):
    """Takes an OTLP/HTTP export, answers 200 with an empty ExportTraceServiceResponse, keeps nothing."""

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def start_sink() -> str:
    """Start the OTLP sink on a free loopback port (a daemon thread); return its base URL."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _OtlpSink)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}"


def extract(rev: str, workdir: Path) -> tuple[str, Path | None]:
    """(name, source folder) of `rev` (`+tracing` and `+uvloop` suffixes kept in the name, the
    source shared); `floor` has no source."""
    rev, *flags = rev.split("+")
    suffixes = "".join(f"+{flag}" for flag in flags)
    if not {f"+{flag}" for flag in flags} <= {UVLOOP, TRACING, STORE}:
        raise SystemExit(f"{rev}{suffixes}: the suffixes known are {UVLOOP}, {TRACING} and {STORE}")
    if STORE in suffixes and rev != FLOOR:
        raise SystemExit(f"{rev}{suffixes}: {STORE} is for the floor (the proxy always reads its store)")
    if rev == FLOOR:
        return FLOOR + suffixes, None
    short = subprocess.run(
        ["git", "rev-parse", "--short", rev], capture_output=True, text=True, cwd=run.ROOT, check=True
    ).stdout.strip()
    src = workdir / f"src-{short}"
    if not src.exists():
        src.mkdir()
        archive = subprocess.run(
            ["git", "archive", short, "proxy"], capture_output=True, cwd=run.ROOT, check=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
    return short + suffixes, src


def measure_row(
    row: str, name: str, src: Path | None, workdir: Path, args, ups: dict, store_ids: dict
) -> dict:
    run.PROXY_ENV["PYTHONPATH"] = str(src)
    run.PROXY_ENV.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
    if name.endswith(TRACING):
        run.PROXY_ENV["OTEL_EXPORTER_OTLP_ENDPOINT"] = ups["otlp"]
    kind, _, what = row.partition("-")
    floor, uv = name.split("+")[0] == FLOOR, UVLOOP in name
    event_loop = "uvloop" if uv else "asyncio"
    if kind == "a":
        mode, upstream, *chatty = what.split("-")
        up_url = ups[upstream]
        lg_cpu = "0"
        call = dict(GREET)
        if chatty:  # -pN: the fake upstream's chatty tool, N progress notifications relayed per call
            if upstream != "fake":
                raise SystemExit(f"{row}: only the fake upstream has the chatty tool (a-<wire>-fake-pN)")
            arguments = {"name": "bench", "count": int(chatty[0][1:]), "interval_ms": 1}
            call.update(tool="chatty", arguments=arguments, progress=True)
        if floor:  # a byte pass-through can only carry the wire its upstream speaks
            proxy, url = run.start_floor(workdir, "1", f"ab-{row}-{name}", upstream=up_url, uvloop=uv)
            spec = {"mode": "legacy", **call}
        else:
            store = workdir / f"ab-store-{row}-{name}"
            cfg = run.write_config(
                workdir, f"ab-{row}", {"url": up_url}, store, durable=True, event_loop=event_loop
            )
            proxy, url, _ = run.start_proxy(workdir, f"ab-{row}-{name}", cfg, "1")
            spec = {"mode": mode, **call}
    else:
        n = int(what)
        store, ids_file = store_ids[n]
        lg_cpu = "1"
        spec = {"mode": "tasks_get", "ids_file": str(ids_file)}
        if floor:
            on_disk = store if STORE in name else None
            proxy, url = run.start_floor(
                workdir, "0", f"ab-{row}-{name}", ids_file=ids_file, store=on_disk, uvloop=uv
            )
        else:
            cfg = run.write_config(
                workdir, f"ab-{row}", {"url": ups["fake"]}, store, durable=True, event_loop=event_loop
            )
            proxy, url, _ = run.start_proxy(workdir, f"ab-{row}-{name}", cfg, "0")
    try:
        if not floor:
            run.wait_ready(url.rsplit("/", 1)[0], proxy)
        cpu0 = run.cpu_seconds(proxy.pid, children=False)
        res = run.loadgen(
            {
                **spec,
                "url": url,
                "concurrency": args.concurrency,
                "duration": args.duration,
                "warmup": args.warmup,
            },
            lg_cpu,
        )
        cpu = (run.cpu_seconds(proxy.pid, children=False) - cpu0) * 1000 / max(1, res["total_ok"])
        rss_mb = run.rss_bytes(proxy.pid) / 2**20  # right after the load: what the row's calls left held
    finally:
        proxy.stop()
    return {
        "cpu_ms_per_call": round(cpu, 4),
        "rps": res["rps"],
        "p50_ms": res["p50_ms"],
        "errors": res["errors"],
        "rss_mb": round(rss_mb, 1),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("revs", nargs="+", help="git revisions; the first is the reference for ratios")
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", type=float, default=5.0)
    ap.add_argument("--warmup", type=float, default=1.0)
    ap.add_argument("--concurrency", type=int, default=16)
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    workdir = Path(tempfile.mkdtemp(prefix="mtp-ab-"))
    out: dict = {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "args": vars(args),
        "load_average": [os.getloadavg()[0]],
        "samples": {},
    }
    try:
        revs = [extract(r, workdir) for r in args.revs]
        ups: dict[str, str] = {}
        if any(r.endswith("-sdk") for r in rows):
            ups["sdk"] = run.start_sdk_upstream(workdir, "0", "ab-upstream-sdk")[1]
        ups["fake"] = run.start_fake_upstream(workdir, "0", "ab-upstream-fake")[1]
        if any(name.endswith(TRACING) for name, _ in revs):
            ups["otlp"] = start_sink()
        store_ids: dict[int, tuple[Path, Path]] = {}
        for row in rows:
            if row.startswith("b-"):
                n = int(row.split("-")[1])
                ids, secs, hit = stores.seeded_store(workdir / f"store-{n}", n)
                ids_file = workdir / f"ids-{n}.json"
                ids_file.write_text(json.dumps(ids[:20000]))
                store_ids[n] = (workdir / f"store-{n}", ids_file)
        for rnd in range(args.rounds):
            order = revs if rnd % 2 == 0 else list(reversed(revs))
            for row in rows:
                for short, src in order:
                    res = measure_row(row, short, src, workdir, args, ups, store_ids)
                    out["samples"].setdefault(row, {}).setdefault(short, []).append(res)
                    print(
                        f"round {rnd + 1} {row:<14} {short}: {res['cpu_ms_per_call']:.3f} ms CPU/call, "
                        f"{res['rps']} req/s, RSS {res['rss_mb']} MB, errors {res['errors']}",
                        flush=True,
                    )
            out["load_average"].append(os.getloadavg()[0])
    finally:
        run.Proc.stop_all()
        shutil.rmtree(workdir, ignore_errors=True)
    names = [s for s, _ in revs]
    lines = [
        f"A/B {out['date']}, {args.rounds} rounds x {args.duration:g} s, concurrency {args.concurrency}; "
        f"load average {out['load_average']}",
        "",
        "| row | "
        + " | ".join(f"{n} CPU ms/call" for n in names)
        + " | "
        + " | ".join(f"{n} / {names[0]}" for n in names[1:])
        + " | "
        + " | ".join(f"{n} req/s" for n in names)
        + " | "
        + " | ".join(f"{n} RSS MB" for n in names)
        + " |",
        "|---|" + "---:|" * (4 * len(names) - 1),
    ]
    summary: dict = {}
    for row in rows:
        med = {n: statistics.median(s["cpu_ms_per_call"] for s in out["samples"][row][n]) for n in names}
        rps = {n: statistics.median(s["rps"] for s in out["samples"][row][n]) for n in names}
        rss = {n: statistics.median(s["rss_mb"] for s in out["samples"][row][n]) for n in names}
        summary[row] = {"cpu_ms_per_call_median": med, "rps_median": rps, "rss_mb_median": rss}
        lines.append(
            f"| {row} | "
            + " | ".join(f"{med[n]:.3f}" for n in names)
            + " | "
            + " | ".join(f"{med[n] / med[names[0]]:.2f}" for n in names[1:])
            + " | "
            + " | ".join(f"{rps[n]:.0f}" for n in names)
            + " | "
            + " | ".join(f"{rss[n]:.1f}" for n in names)
            + " |"
        )
    # CPU per relayed progress notification: a row with -pN against the same row without it
    for row in rows:
        base_row, _, chatty = row.rpartition("-p")
        if base_row in summary and chatty.isdigit() and row.startswith("a-"):
            per = {
                n: (
                    summary[row]["cpu_ms_per_call_median"][n] - summary[base_row]["cpu_ms_per_call_median"][n]
                )
                * 1000
                / int(chatty)
                for n in names
            }
            summary[row]["cpu_us_per_notification"] = per
            lines.append(
                f"\nCPU per progress notification ({row} minus {base_row}, / {chatty}): "
                + ", ".join(f"{n} {per[n]:.1f} µs" for n in names)
            )
    out["summary"] = summary
    out["table"] = "\n".join(lines)
    path = run.BENCH / "results" / f"ab-{dt.datetime.now().strftime('%Y%m%d-%H%M%S')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    print("\n" + out["table"] + f"\n\nresults: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
