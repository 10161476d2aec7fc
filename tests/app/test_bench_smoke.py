"""Smoke run of the benchmark harness (bench/run.py --quick): every section produces its figures.

Tiny sizes and no timing assertions: this checks the harness works (servers start and stop, the
load generator talks to each endpoint, every section reports), not how fast anything is. The peers
(PyPI mcp-proxy, FastMCP's proxy) are left out here: mcp-proxy needs its own venv installed from
PyPI, which the full `python bench/run.py` does.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.redis  # sections b and c put the Redis store beside diskcache
def test_bench_quick_run_reports_every_section(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "bench/run.py", "--quick", "--no-peers", "--out", str(out)],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,  # ~60 s on the 2-core CI host
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())
    for section in "abcde":
        assert section in results and "failed" not in results[section], (section, results.get(section))

    rows_a = results["a"]["rows"]
    labels = [r["label"] for r in rows_a]
    assert any(r.get("role") == "baseline" for r in rows_a), labels
    assert {r["wire"] for r in rows_a if r.get("role") == "proxy"} == {"2025-11-25", "2026-07-28"}, labels
    assert any(r.get("role") == "floor" for r in rows_a), labels  # bench/floor.py beside the proxy
    assert all(r.get("cpu_ratio_vs_floor") for r in rows_a if r.get("role") == "proxy"), rows_a
    for r in rows_a:
        assert (
            r["requests"] > 0 and r["errors"] == 0 and r["p99_ms"] is not None and "ratio_vs_direct" in r
        ), r

    assert {r["stored_tasks"] for r in results["b"]["rows"]} == {200, 1000}
    stores_b = {r["store"] for r in results["b"]["rows"]}
    assert stores_b == {"diskcache", "redis", "floor: aiohttp JSON handler, no store"}  # side by side
    assert all(
        r.get("cpu_ratio_vs_floor") for r in results["b"]["rows"] if not r["store"].startswith("floor")
    )
    assert {(r["store"], r["durable"]) for r in results["c"]["rows"]} >= {
        ("redis", True),
        ("redis", False),
        ("diskcache", True),
    }
    for r in results["b"]["rows"]:
        assert r["requests"] > 0 and r["errors"] == 0 and r["p99_ms"] is not None, r

    for r in results["c"]["rows"]:
        assert r["requests"] > 0 and r["errors"] == 0 and r["late_p99_ms"] is not None, r

    d = results["d"]
    assert (
        d["upstream_inflight"] == d["calls"] == 200 and d["errors"] == 0 and d["kb_per_call"] is not None
    ), d

    e = results["e"]
    assert [r["stored_tasks"] for r in e["rows"]] == [0, 1000] and all(
        r["median_s"] > 0 for r in e["rows"]
    ), e

    for heading in ("### a.", "### b.", "### c.", "### d.", "### e."):
        assert heading in results["table"], heading


def test_bench_paired_run_reads_both_revisions() -> None:
    """bench/paired.py on two copies of HEAD: one short round, both proxies measured, no errors."""
    proc = subprocess.run(
        [sys.executable, "bench/paired.py", "HEAD", "HEAD", "--rounds", "1", "--duration", "1"],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(Path(proc.stdout.rsplit("results: ", 1)[1].strip()).read_text())
    (round_,) = results["rounds"]
    assert all(n > 0 for n in round_["calls"]) and round_["errors"] == [0, 0], round_
    assert results["median_ratio"] > 0
