"""deploy/grafana/mcp-tasks-proxy.json: an importable Grafana dashboard (schema 39, a Prometheus
`datasource` variable, `server` and `instance` variables) whose every panel query reads metrics the
proxy exports, and returns data from a real Prometheus scraping a real proxy (Redis store, one
replica) in front of the legacy fixture upstream under a little load."""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client import REGISTRY
from support.clients import ModernClient
from support.prometheus import (
    DASHBOARD,
    RULES,
    PrometheusServer,
    exported_metric_names,
    metric_names,
    recorded_names,
    rule_groups,
)
from support.proxy import Serve
from support.redis_server import RedisServer

from proxy.config import config_from_data

ELICIT_CAPS: dict[str, Any] = {"elicitation": {}, "extensions": {"io.modelcontextprotocol/tasks": {}}}
RATE_INTERVAL = "15s"  # what $__rate_interval stands for in the queries sent to Prometheus (≥ 4 scrapes)
# Counters and histograms the load moves; Prometheus has scraped a round once its sums reach ours.
MOVED_BY_LOAD = (
    "mcp_tasks_proxy_calls_total",
    "mcp_tasks_proxy_upstream_errors_total",
    "mcp_tasks_proxy_detach_latency_seconds_count",
    "mcp_tasks_proxy_upstream_latency_seconds_count",
    "mcp_tasks_proxy_task_age_seconds_count",
    "mcp_tasks_proxy_input_wait_seconds_count",
    "mcp_tasks_proxy_tasks_total",
)


def _dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def _panels() -> list[dict[str, Any]]:
    """The dashboard's panels other than rows."""
    return [panel for panel in _dashboard()["panels"] if panel["type"] != "row"]


def _substitute(expr: str, variables: dict[str, str]) -> str:
    """`expr` as Grafana sends it: `$__rate_interval` and each `$name` / `${name}` replaced."""
    expr = expr.replace("$__rate_interval", RATE_INTERVAL)
    for name, value in variables.items():
        expr = expr.replace("${" + name + "}", value).replace("$" + name, value)
    assert "$" not in expr, f"a variable is left in {expr!r}"
    return expr


def _local_sum(name: str) -> float:
    """The sum of every sample called `name` in this process's registry (what the proxy exposes)."""
    return sum(
        sample.value for family in REGISTRY.collect() for sample in family.samples if sample.name == name
    )


def test_the_dashboard_is_an_importable_grafana_model() -> None:
    dashboard = _dashboard()
    assert 36 <= dashboard["schemaVersion"] <= 41 and dashboard["uid"] and dashboard["title"]
    assert dashboard["id"] is None  # imported as a new dashboard
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert (
        variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    )
    assert variables["server"]["query"] == "label_values(mcp_tasks_proxy_calls_total, server)"
    for name in ("server", "instance"):
        assert variables[name]["type"] == "query" and variables[name]["allValue"] == ".*"
        assert variables[name]["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        mine = {
            (x, y)
            for x in range(grid["x"], grid["x"] + grid["w"])
            for y in range(grid["y"], grid["y"] + grid["h"])
        }
        assert not mine & cells, f"{panel['title']} overlaps another panel"
        cells |= mine
    titles = {panel["title"] for panel in _panels()}
    for wanted in (
        "Calls by outcome",
        "Detach latency",
        "Live tasks",
        "Task age at its end",
        "Input waits",
        "Upstream latency by server",
        "Store records",
        "Store size",
        "Replicas",
    ):
        assert wanted in titles, wanted
    for panel in _panels():
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["description"] and panel["targets"], panel["title"]
        refs = [target["refId"] for target in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            windows = re.findall(r"\[([^\]]*)\]", target["expr"])
            assert all(w == "$__rate_interval" for w in windows), (panel["title"], target["expr"])


def test_the_dashboard_reads_only_metrics_the_proxy_exports() -> None:
    exported = exported_metric_names()
    records = {rule["record"] for group in rule_groups() for rule in group["rules"] if "record" in rule}
    for panel in _panels():
        for target in panel["targets"]:
            missing = metric_names(target["expr"]) - exported
            assert not missing, f"panel {panel['title']!r} reads metrics the proxy lacks: {sorted(missing)}"
            unknown = recorded_names(target["expr"]) - records
            assert not unknown, f"panel {panel['title']!r} reads unknown recording rules: {sorted(unknown)}"
    for variable in _dashboard()["templating"]["list"]:
        if variable["type"] == "query":
            missing = metric_names(variable["query"]) - exported
            assert not missing, f"variable {variable['name']} reads {sorted(missing)}"


async def _load_round(url: str) -> None:
    """Calls that give every panel data: sync calls (one a JSON-RPC error from the upstream), a
    detached call that completes, one the upstream fails, and one that asks a question (elicitation)
    which is answered; returns once every task is terminal."""
    plain = ModernClient(url)
    asking = ModernClient(url, capabilities=ELICIT_CAPS)
    try:
        await asyncio.gather(plain.warm_up(), asking.warm_up())  # their upstream sessions are open

        async def synchronous() -> None:
            assert "content" in (await plain.call("greet", {"name": "dashboard"})).result
            assert (await plain.call("instant_error")).error["code"] == -32603

        async def task(tool: str, arguments: dict[str, Any]) -> str:
            created = (await plain.call(tool, arguments)).result
            return (await plain.wait_terminal(created["taskId"]))["status"]

        async def answered() -> str:
            # asks after it became a task (delay > detach_after)
            created = (await asking.call("confirm_delete", {"filename": "d.txt", "delay": 0.7})).result
            asked = await asking.wait_status(created["taskId"], ("input_required",))
            key = next(iter(asked["inputRequests"]))
            answer = {key: {"action": "accept", "content": {"confirm": True}}}
            await asking.request("tasks/update", {"taskId": created["taskId"], "inputResponses": answer})
            return (await asking.wait_terminal(created["taskId"]))["status"]

        _, computed, failed, confirmed = await asyncio.gather(
            synchronous(),
            task("slow_compute", {"seconds": 0.8, "label": "dashboard"}),
            task("protocol_error_job", {}),
            answered(),
        )
        assert (computed, failed, confirmed) == ("completed", "failed", "completed")
    finally:
        await plain.close()
        await asking.close()


async def _wait_scraped(prometheus: PrometheusServer) -> None:
    """Wait (bounded) until Prometheus has scraped what the load so far counted here."""
    for name in MOVED_BY_LOAD:
        expected = _local_sum(name)

        def reached(result: list[dict[str, Any]], expected: float = expected) -> bool:
            return bool(result) and float(result[0]["value"][1]) >= expected

        await prometheus.wait_for(f'sum({name}{{job="mcp-tasks-proxy"}})', reached)


def _finite(result: list[dict[str, Any]]) -> bool:
    return any(math.isfinite(float(series["value"][1])) for series in result)


@pytest.mark.prometheus
@pytest.mark.redis
async def test_every_panel_shows_data_from_prometheus_scraping_a_proxy_under_load(
    legacy_url: str, tmp_path: Path, serve: Serve, redis_server: RedisServer, redis_prefix: str
) -> None:
    config = config_from_data(
        {
            "store": {"url": redis_server.url, "prefix": redis_prefix},
            # detach_after well above a quick call's time on a loaded machine
            "tasks": {"detach_after": "400ms", "ttl": "10m", "poll_interval": "50ms"},
            "replicas": {"secret": "dashboard-test-secret-" + "s" * 16},
            "mcpServers": {"legacy": {"url": legacy_url}},
        }
    )
    proxy = await serve(config)
    target = proxy.base.removeprefix("http://")
    prometheus = PrometheusServer(tmp_path / "prometheus", [target], rule_files=[RULES], interval_s=1.0)
    await prometheus.start()
    try:
        # Round one makes every series; round two moves them while Prometheus watches, so that the
        # rates over $__rate_interval are not zero and the quantiles are numbers.
        await _load_round(proxy.url())
        await _wait_scraped(prometheus)
        await _load_round(proxy.url())
        await _wait_scraped(prometheus)
        at = time.time()

        async with aiohttp.ClientSession() as http:
            for label, metric in (
                ("server", "mcp_tasks_proxy_calls_total"),
                ("instance", "mcp_tasks_proxy_lease_seconds"),
            ):
                params = {"match[]": metric}
                async with http.get(f"{prometheus.url}/api/v1/label/{label}/values", params=params) as resp:
                    values = (await resp.json())["data"]
                assert ("legacy" if label == "server" else target) in values, (label, values)
        variables = {"server": "legacy", "instance": target, "datasource": "prometheus"}
        empty = []
        for panel in _panels():
            for query in panel["targets"]:
                expr = _substitute(query["expr"], variables)
                result = await prometheus.query(expr, at=at)
                if not _finite(result):
                    empty.append(f"panel {panel['title']!r} ({query['refId']}): {expr} -> {result}")
        assert not empty, "panels without data:\n" + "\n".join(empty)

        # The rules load and evaluate against the real metrics: every rule healthy, every recording
        # rule with a value.
        records = [rule["record"] for group in rule_groups() for rule in group["rules"] if "record" in rule]
        for record in records:
            await prometheus.wait_for(record, _finite, timeout_s=10)
        loaded = await prometheus.rules()
        assert {group["name"] for group in loaded} == {group["name"] for group in rule_groups()}
        unhealthy = [
            (rule["name"], rule.get("lastError"))
            for group in loaded
            for rule in group["rules"]
            if rule["health"] != "ok"
        ]
        assert not unhealthy, unhealthy
    finally:
        prometheus.stop()
