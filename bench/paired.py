"""Paired A/B of two proxy revisions: both run at once, on the same CPU, each under its own load
generator, and each round reads both processes' CPU over the same seconds. What this host's
neighbours take (steal time, cache pressure) then falls on both alike, so the per-round ratio of
their CPU per call holds within about 1 %, where two separate runs (`bench/ab.py`, interleaved
rounds of 5 s) drift by 10-30 % on a noisy host. Two copies of one revision read 1.00 (0.999-1.004
over 3 rounds on 2026-12-07).

    python bench/paired.py 9ed9dfc HEAD                          # (a) legacy relay, fast upstream
    python bench/paired.py 9ed9dfc HEAD --row a-modern-sdk --rounds 7
    python bench/paired.py HEAD HEAD --row a-legacy-fake         # the method's own noise

Rows as in bench/ab.py: `a-<legacy|modern>-<fake|sdk>` and `a-<wire>-fake-pN` (the chatty tool,
N progress notifications per call). Layout: the upstream and both load generators on CPU 0, both
proxies on CPU 1, each load generator at half of `--concurrency`. The figures are CPU per call of a
proxy sharing its core with another, higher than a proxy alone (bench/ab.py): read the ratio, not
the milliseconds. `floor` is not offered here: a byte pass-through and the proxy would share the
core unevenly. Prints one line per round and the medians; JSON goes to
bench/results/paired-<time>.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shutil
import statistics
import sys
import tempfile
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ab  # noqa: E402
import run  # noqa: E402


def call_of(row: str) -> tuple[str, str, dict]:
    """(wire mode, upstream kind, load generator call fields) of an (a) row."""
    kind, mode, upstream, *chatty = row.split("-")
    if kind != "a" or mode not in ("legacy", "modern") or upstream not in ("fake", "sdk"):
        raise SystemExit(f"{row}: rows are a-<legacy|modern>-<fake|sdk>[-pN]")
    call = dict(ab.GREET)
    if chatty:
        if upstream != "fake":
            raise SystemExit(f"{row}: only the fake upstream has the chatty tool")
        arguments = {"name": "bench", "count": int(chatty[0][1:]), "interval_ms": 1}
        call.update(tool="chatty", arguments=arguments, progress=True)
    return mode, upstream, call


def _load(results: list[dict], i: int, spec: dict) -> None:
    """Run one load generator (on CPU 0) and keep its result at `results[i]`."""
    results[i] = run.loadgen(spec, "0")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("revs", nargs=2, help="two git revisions; ratios are the second's over the first's")
    ap.add_argument("--row", default="a-legacy-fake")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--duration", type=float, default=8.0, help="seconds measured per round")
    ap.add_argument("--concurrency", type=int, default=16, help="both load generators together")
    args = ap.parse_args()
    mode, upstream, call = call_of(args.row)
    workdir = Path(tempfile.mkdtemp(prefix="bench-paired-"))
    started = dt.datetime.now(dt.UTC)
    try:
        sources = [ab.extract(rev, workdir) for rev in args.revs]
        names = [
            name if i == 0 or name != sources[0][0] else f"{name} (again)"
            for i, (name, _) in enumerate(sources)
        ]
        up, up_url = (run.start_fake_upstream if upstream == "fake" else run.start_sdk_upstream)(workdir, "0")
        proxies = []
        for i, (_, src) in enumerate(sources):
            if src is None:
                raise SystemExit("floor is not offered here (see the docstring)")
            run.PROXY_ENV["PYTHONPATH"] = str(src)
            config = run.write_config(
                workdir, f"paired-{i}", {"url": up_url}, workdir / f"store-{i}", durable=True
            )
            proc, url, _ = run.start_proxy(workdir, f"paired-{i}", config, "1")
            run.wait_ready(url.rsplit("/", 1)[0], proc)
            proxies.append((proc, url))
        spec = {"mode": mode, **call, "concurrency": max(1, args.concurrency // 2), "warmup": 1.0}
        rounds: list[dict] = []
        for number in range(1, args.rounds + 1):
            before = [run.cpu_seconds(proc.pid, children=False) for proc, _ in proxies]
            results: list[dict] = [{}, {}]
            threads = [
                threading.Thread(
                    target=_load, args=(results, i, {**spec, "url": proxies[i][1], "duration": args.duration})
                )
                for i in range(2)
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            # (the warm-up second is in the CPU read too, and in neither count: alike for both)
            ms = [
                (run.cpu_seconds(proc.pid, children=False) - before[i])
                * 1000
                / max(1, results[i]["total_ok"])
                for i, (proc, _) in enumerate(proxies)
            ]
            errors = [r.get("errors", 0) for r in results]
            rounds.append({"cpu_ms": ms, "calls": [r["total_ok"] for r in results], "errors": errors})
            print(
                f"round {number}: {names[0]} {ms[0]:.3f} ms/call, {names[1]} {ms[1]:.3f} ms/call, "
                f"ratio {ms[1] / ms[0]:.3f} (calls {results[0]['total_ok']} / {results[1]['total_ok']}, "
                f"errors {errors[0]} / {errors[1]})",
                flush=True,
            )
    finally:
        run.Proc.stop_all()
        shutil.rmtree(workdir, ignore_errors=True)
    ratios = [r["cpu_ms"][1] / r["cpu_ms"][0] for r in rounds]
    summary = {
        "row": args.row,
        "revs": names,
        "median_cpu_ms": [statistics.median(r["cpu_ms"][i] for r in rounds) for i in range(2)],
        "median_ratio": statistics.median(ratios),
        "ratio_range": [min(ratios), max(ratios)],
        "rounds": rounds,
        "started": started.isoformat(timespec="seconds"),
        "duration_s": args.duration,
        "concurrency": args.concurrency,
    }
    print(
        f"\n{args.row}, {len(rounds)} paired rounds of {args.duration:g} s: {names[1]} / {names[0]} = "
        f"{summary['median_ratio']:.3f} (median; rounds {min(ratios):.3f}-{max(ratios):.3f})"
    )
    out = run.ROOT / "bench" / "results" / f"paired-{started:%Y%m%d-%H%M%S}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2))
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
