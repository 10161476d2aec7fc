"""A real Prometheus server and `promtool` (Debian's `prometheus` package, 2.x) for the tests of
deploy/prometheus and deploy/grafana, and the metric names those files may use.

API:

- `PrometheusServer(workdir, targets, *, rule_files=(), interval_s=1.0)`: a server that scrapes
  `/metrics` of each `host:port` in `targets` every `interval_s` seconds (and evaluates
  `rule_files` as often), with its config and TSDB in `workdir`.
- `await server.start(timeout_s=20.0)`: runs `prometheus --web.listen-address=127.0.0.1:<free port>
  --storage.tsdb.path=<workdir>/data ...` and waits (bounded by `timeout_s`, s) until `/-/ready`
  answers 200; raises RuntimeError with the log's tail when it does not (the process is stopped then).
  Async, so that a proxy served on the same event loop goes on answering scrapes meanwhile.
- `await server.query(expr, at=None)`: the `result` list of `/api/v1/query` (`at`: Unix time, s;
  default now); raises AssertionError naming `expr` when Prometheus answers an error.
- `await server.wait_for(expr, predicate, timeout_s)`: polls `query(expr)` until
  `predicate(result)` holds; returns that result; raises TimeoutError naming `expr` after `timeout_s`.
- `await server.rules()`: the rule groups of `/api/v1/rules`.
- `server.stop(timeout_s=10.0)`: SIGTERM, SIGKILL after `timeout_s`; idempotent. `async with` stops it.
- `promtool(*args)`: runs `promtool args...` (60 s bound); returns the CompletedProcess.
- `exported_metric_names()`: every sample name the proxy's registry can expose (`…_total` for
  counters, `…_bucket` / `…_count` / `…_sum` for histograms).
- `metric_names(expr)` / `recorded_names(expr)`: the `mcp_tasks_proxy_…` metric names, and the
  recording-rule names (`level:metric:operations`), a PromQL expression reads.
"""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from types import TracebackType
from typing import Any

import aiohttp
import yaml
from prometheus_client import REGISTRY

from support.servers import ROOT, free_port

RULES = ROOT / "deploy" / "prometheus" / "rules.yml"
RULES_TEST = ROOT / "deploy" / "prometheus" / "rules_test.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "mcp-tasks-proxy.json"
PREFIX = "mcp_tasks_proxy_"

_SAMPLE_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}
# a string literal (skipped: label values) or an identifier (metric, recording rule, label, function)
_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`|[a-zA-Z_:][a-zA-Z0-9_:]*')


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    """`promtool args...` from the checkout's root (at most 60 s); output in `.stdout` / `.stderr`."""
    return subprocess.run(["promtool", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)


def exported_metric_names() -> set[str]:
    """Every `mcp_tasks_proxy_…` sample name the process-wide registry can expose (whether or not
    a labelled metric has a child yet)."""
    import proxy.runtime.metrics  # noqa: F401  (registers every metric)

    names: set[str] = set()
    for family in REGISTRY.collect():
        if family.name.startswith(PREFIX):
            names.update(family.name + suffix for suffix in _SAMPLE_SUFFIXES[family.type])
    return names


def _identifiers(expr: str) -> list[str]:
    return [token for token in _TOKEN.findall(expr) if token[0] not in "\"'`"]


def metric_names(expr: str) -> set[str]:
    """The `mcp_tasks_proxy_…` metric names `expr` reads (not recording rules, not label values)."""
    return {name for name in _identifiers(expr) if name.startswith(PREFIX) and ":" not in name}


def recorded_names(expr: str) -> set[str]:
    """The recording-rule names (`level:metric:operations`) `expr` reads."""
    return {name for name in _identifiers(expr) if name.count(":") == 2}


def rule_groups() -> list[dict[str, Any]]:
    """The groups of deploy/prometheus/rules.yml."""
    return yaml.safe_load(RULES.read_text())["groups"]


class PrometheusServer:
    """One `prometheus` process on loopback; see the module docstring."""

    def __init__(
        self,
        workdir: Path,
        targets: Iterable[str],
        *,
        rule_files: Iterable[Path] = (),
        interval_s: float = 1.0,
    ) -> None:
        self.workdir = workdir
        self.targets = list(targets)
        self.rule_files = [str(path) for path in rule_files]
        self.interval_s = interval_s
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """`http://127.0.0.1:<port>`."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.workdir / "prometheus.log"

    def _write_config(self) -> Path:
        interval = f"{int(self.interval_s * 1000)}ms"
        config = {
            "global": {
                "scrape_interval": interval,
                "evaluation_interval": interval,
                "scrape_timeout": interval,
            },
            "rule_files": self.rule_files,
            "scrape_configs": [
                {
                    "job_name": "mcp-tasks-proxy",
                    "metrics_path": "/metrics",
                    "static_configs": [{"targets": self.targets}],
                }
            ],
        }
        path = self.workdir / "prometheus.yml"
        path.write_text(yaml.safe_dump(config))
        return path

    async def start(self, timeout_s: float = 20.0) -> PrometheusServer:
        """Start Prometheus and wait until it is ready (at most `timeout_s` s). Raises RuntimeError."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = self._write_config()
        self.port = free_port()
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                [
                    "prometheus",
                    f"--config.file={config}",
                    f"--storage.tsdb.path={self.workdir / 'data'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--storage.tsdb.retention.time=1h",
                    "--log.level=warn",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.workdir,
            )
        deadline = time.monotonic() + timeout_s
        async with aiohttp.ClientSession() as http:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    break
                try:
                    async with http.get(
                        f"{self.url}/-/ready", timeout=aiohttp.ClientTimeout(total=1)
                    ) as resp:
                        if resp.status == 200:
                            return self
                except (aiohttp.ClientError, TimeoutError):
                    pass
                await asyncio.sleep(0.1)
        tail = self.log_path.read_text(errors="replace")[-2000:]
        self.stop()
        raise RuntimeError(f"prometheus did not get ready within {timeout_s:g} s:\n{tail}")

    async def _api(self, path: str, params: dict[str, str] | None = None) -> Any:
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"{self.url}{path}", params=params, timeout=aiohttp.ClientTimeout(total=10)) as resp,
        ):
            body = await resp.json()
        assert body.get("status") == "success", f"{path} {params}: {body}"
        return body["data"]

    async def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """The result of an instant query of `expr` (at Unix time `at`, s; default now)."""
        params = {"query": expr} if at is None else {"query": expr, "time": f"{at:.3f}"}
        data = await self._api("/api/v1/query", params)
        return list(data["result"])

    async def wait_for(
        self, expr: str, predicate: Callable[[list[dict[str, Any]]], bool], timeout_s: float = 15.0
    ) -> list[dict[str, Any]]:
        """Poll `expr` every 0.2 s until `predicate(result)` holds; return that result. Raises
        TimeoutError naming `expr` after `timeout_s` s."""
        deadline = time.monotonic() + timeout_s
        result: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            result = await self.query(expr)
            if predicate(result):
                return result
            await asyncio.sleep(0.2)
        raise TimeoutError(f"{expr!r} did not get there within {timeout_s:g} s; last result: {result}")

    async def rules(self) -> list[dict[str, Any]]:
        """The rule groups Prometheus loaded, with each rule's `health` and `lastError`."""
        return list((await self._api("/api/v1/rules"))["groups"])

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the server (SIGTERM, then SIGKILL after `timeout_s` s) and reap it; idempotent."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    async def __aenter__(self) -> PrometheusServer:
        return await self.start()

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
