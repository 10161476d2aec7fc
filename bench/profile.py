"""Profile the proxy process under a bench load with py-spy; write the top of the profile as text.

    pip install py-spy                          # a dev tool, not a dependency of the proxy
    python bench/profile.py legacy              # (a) short tools/call, legacy relay, SDK upstream
    python bench/profile.py modern              # (a) short tools/call, 2026-07-28 path
    python bench/profile.py modern --fake       # same, in front of bench/fake_upstream.py
    python bench/profile.py modern --fake --progress 200   # its chatty tool: 200 notifications per call
    python bench/profile.py tasks_get --store-size 100000
    python bench/profile.py legacy --ref 0494dd5 --out bench/profiles/a-legacy-before.txt

The proxy runs pinned to CPU 1 (load generator and upstream on CPU 0), as in bench/run.py. py-spy
attaches to the running proxy for the measured seconds only (not start-up, not warm-up), sampling
on-CPU stacks (idle threads excluded). The text has the proxy's CPU ms per call (psutil), the
top functions by own time and by inclusive time (percent of samples), and the stack-frame count.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run  # noqa: E402  (bench/run.py: process lifecycle, configs, loadgen)


def _package(frame: str) -> str:
    """The package of a frame's file: aiohttp, asyncio, proxy/<module>, structlog, ... (for the by-package
    table)."""
    where = frame.rpartition("(")[2]
    for name in (
        "aiohttp",
        "aiohappyeyeballs",
        "multidict",
        "yarl",
        "structlog",
        "prometheus_client",
        "pydantic",
        "diskcache",
        "orjson",
    ):
        if f"/{name}/" in where or where.startswith(f"{name}/"):
            return name
    if "/proxy/" in where or where.startswith("proxy/"):
        return "proxy/" + where.split("proxy/", 1)[1].split(":")[0]
    if "asyncio/" in where or "selectors.py" in where:
        return "asyncio (event loop, sockets)"
    if "json/" in where:
        return "json (stdlib)"
    return "other (stdlib)"


def summarize(raw: Path, top: int) -> tuple[list[tuple[str, float]], list[tuple[str, float]], int]:
    """py-spy `--format raw` (collapsed stacks `frame;frame;... count`) -> (own %, inclusive %, samples)."""
    own: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = [
            f for f in stack.split(";") if f and not f.startswith("process ") and not f.startswith("thread ")
        ]
        if not frames:
            continue
        own[_short(frames[-1])] += n
        PACKAGES[_package(frames[-1])] += n
        for f in {_short(f) for f in frames}:
            incl[f] += n

    def pct(counts: collections.Counter[str]) -> list[tuple[str, float]]:
        return [(k, round(100 * v / max(1, total), 1)) for k, v in counts.most_common(top)]

    return pct(own), pct(incl), total


PACKAGES: collections.Counter[str] = collections.Counter()  # own samples by package, filled by summarize


def _short(frame: str) -> str:
    # "func (path/to/module.py:123)" -> "func (module/path.py:123)" with site-packages trimmed
    for marker in ("site-packages/", "lib/python3", "/w16-perf/", "/src/"):
        if marker in frame:
            head, _, tail = frame.partition("(")
            tail = tail.split(marker, 1)[-1]
            return f"{head}({tail}"
    return frame


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["legacy", "modern", "tasks_get"])
    ap.add_argument(
        "--fake", action="store_true", help="bench/fake_upstream.py instead of the SDK server (a)"
    )
    ap.add_argument(
        "--progress",
        type=int,
        default=0,
        help="with --fake: call its chatty tool, this many progress notifications 1 ms apart per call",
    )
    ap.add_argument("--store-size", type=int, default=100000, help="stored tasks for tasks_get")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--warmup", type=float, default=2.0)
    ap.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--ref", help="profile proxy/ at this git revision (as bench/run.py --ref)")
    ap.add_argument("--out", help="text file to write (default: stdout only)")
    args = ap.parse_args()
    if args.progress and (not args.fake or args.mode == "tasks_get"):
        raise SystemExit("--progress needs --fake and a tools/call mode (legacy or modern)")
    pyspy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
    if not pyspy:
        raise SystemExit("py-spy not found: pip install py-spy")
    workdir = Path(tempfile.mkdtemp(prefix="mtp-profile-"))
    label = "working tree"
    if args.ref:
        src = workdir / "src"
        src.mkdir()
        rev = subprocess.run(
            ["git", "rev-parse", "--short", args.ref],
            capture_output=True,
            text=True,
            cwd=run.ROOT,
            check=True,
        ).stdout.strip()
        archive = subprocess.run(
            ["git", "archive", rev, "proxy"], capture_output=True, cwd=run.ROOT, check=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
        run.PROXY_ENV["PYTHONPATH"] = str(src)
        sys.path.insert(0, str(src))
        label = rev
    else:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=run.ROOT
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "proxy"], capture_output=True, text=True, cwd=run.ROOT
        ).stdout.strip()
        label = head + (" + uncommitted proxy/ changes" if dirty else "")
    try:
        if args.mode == "tasks_get":
            import stores

            store = workdir / "store"
            ids = stores.seeded_store(store, args.store_size)[0]
            ids_file = workdir / "ids.json"
            ids_file.write_text(json.dumps(ids[:20000]))
            upstream, up_url = run.start_fake_upstream(workdir, "1")
            spec = {"mode": "tasks_get", "ids_file": str(ids_file)}
            px_cpu, lg_cpu = "0", "1"
        else:
            upstream, up_url = (run.start_fake_upstream if args.fake else run.start_sdk_upstream)(
                workdir, "0"
            )
            store = workdir / "store"
            spec = {
                "mode": args.mode,
                "tool": "greet",
                "arguments": {"name": "bench"},
                "expect": "Hello, bench!",
            }
            if args.progress:
                arguments = {"name": "bench", "count": args.progress, "interval_ms": 1}
                spec.update(tool="chatty", arguments=arguments, progress=True)
            px_cpu, lg_cpu = "1", "0"
        cfg = run.write_config(workdir, "proxy", {"url": up_url}, store, durable=True)
        proxy, url, _ = run.start_proxy(workdir, "proxy", cfg, px_cpu)
        run.wait_ready(url.rsplit("/", 1)[0], proxy)
        spec.update(url=url, concurrency=args.concurrency, duration=args.duration, warmup=0)
        run.loadgen({**spec, "duration": args.warmup}, lg_cpu)  # warm-up, not sampled
        raw = workdir / "profile.raw"
        spy = subprocess.Popen(
            [
                pyspy,
                "record",
                "--pid",
                str(proxy.pid),
                "--rate",
                str(args.rate),
                "--format",
                "raw",
                "--output",
                str(raw),
                "--duration",
                str(int(args.duration + 1)),
                "--nonblocking",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        time.sleep(0.5)
        cpu0 = run.cpu_seconds(proxy.pid, children=False)
        res = run.loadgen(spec, lg_cpu)
        cpu_ms = (run.cpu_seconds(proxy.pid, children=False) - cpu0) * 1000 / max(1, res["total_ok"])
        spy.wait(timeout=args.duration + 60)
        proxy.stop()
        upstream.stop()
        own, incl, total = summarize(raw, args.top)
    finally:
        run.Proc.stop_all()
    what = (
        f"{args.mode}{' (fake upstream)' if args.fake else ''}"
        + (f", {args.progress} progress notifications per call" if args.progress else "")
        + (f", {args.store_size} stored" if args.mode == "tasks_get" else "")
    )
    lines = [
        f"# py-spy profile of the proxy: {what}; proxy/ at {label}",
        f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load average {os.getloadavg()[0]:.2f}; "
        f"concurrency {args.concurrency}, "
        f"{args.duration:g} s, {res['total_ok']} calls ({res['rps']} req/s), proxy CPU {cpu_ms:.3f} ms/call; "
        f"{total} samples at {args.rate}/s",
        "",
        "## own time by package (% of samples)",
        *[f"{100 * v / max(1, total):6.1f}  {k}" for k, v in PACKAGES.most_common()],
        "",
        "## own time (% of samples)",
        *[f"{p:6.1f}  {k}" for k, p in own],
        "",
        "## inclusive time (% of samples)",
        *[f"{p:6.1f}  {k}" for k, p in incl],
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
