"""deploy/prometheus/rules.yml: valid for promtool, unit-tested by rules_test.yml (each alert fires on
a failing series and stays silent on healthy ones; each recording rule's value), written for an
operator (severity, summary, description, a runbook naming a README section), and reading only
metrics the proxy exports."""

from __future__ import annotations

import re
from typing import Any

import pytest
import yaml
from support.prometheus import (
    RULES,
    RULES_TEST,
    exported_metric_names,
    metric_names,
    promtool,
    recorded_names,
    rule_groups,
)
from support.servers import ROOT


def _rules(kind: str) -> list[dict[str, Any]]:
    """Every rule of rules.yml that has key `kind` (`alert` or `record`)."""
    return [rule for group in rule_groups() for rule in group["rules"] if kind in rule]


def _readme_anchors() -> set[str]:
    """GitHub's anchors of README.md's headings (lower case, punctuation dropped, spaces → dashes)."""
    headings = re.findall(r"^#+ (.+)$", (ROOT / "README.md").read_text(), flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}


@pytest.mark.prometheus
def test_promtool_accepts_the_rules() -> None:
    checked = promtool("check", "rules", str(RULES))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    count = len(_rules("alert")) + len(_rules("record"))
    assert f"SUCCESS: {count} rules found" in checked.stdout, checked.stdout


@pytest.mark.prometheus
def test_promtool_unit_tests_of_the_rules_pass() -> None:
    tested = promtool("test", "rules", str(RULES_TEST))
    assert tested.returncode == 0 and "SUCCESS" in tested.stdout, tested.stdout + tested.stderr


def test_every_alert_is_tested_firing_and_silent_and_every_recording_rule_by_value() -> None:
    tests = yaml.safe_load(RULES_TEST.read_text())["tests"]
    alert_tests = [case for test in tests for case in test.get("alert_rule_test", [])]
    expr_tests = {case["expr"] for test in tests for case in test.get("promql_expr_test", [])}
    for rule in _rules("alert"):
        name = rule["alert"]
        cases = [case for case in alert_tests if case["alertname"] == name]
        assert any(case["exp_alerts"] for case in cases), f"{name}: no test where it fires"
        assert any(not case["exp_alerts"] for case in cases), f"{name}: no test where it stays silent"
    for rule in _rules("record"):
        assert rule["record"] in expr_tests, f"{rule['record']}: no promql_expr_test checks its value"


def test_every_alert_says_how_bad_what_happened_and_where_to_read_more() -> None:
    anchors = _readme_anchors()
    alerts = _rules("alert")
    assert len({rule["alert"] for rule in alerts}) == len(alerts)
    for rule in alerts:
        name, annotations = rule["alert"], rule.get("annotations", {})
        assert rule.get("labels", {}).get("severity") in ("warning", "critical"), name
        assert annotations.get("summary") and len(annotations.get("description", "")) > 100, name
        runbook = annotations.get("runbook", "")
        assert runbook.startswith("README.md#") and runbook.split("#", 1)[1] in anchors, (name, runbook)


def test_the_rules_read_only_metrics_the_proxy_exports_and_rules_that_exist() -> None:
    exported = exported_metric_names()
    records = {rule["record"] for rule in _rules("record")}
    used: set[str] = set()
    for group in rule_groups():
        for rule in group["rules"]:
            name = rule.get("alert") or rule["record"]
            missing = metric_names(rule["expr"]) - exported
            assert not missing, f"{name} reads metrics the proxy does not export: {sorted(missing)}"
            unknown = recorded_names(rule["expr"]) - records
            assert not unknown, f"{name} reads recording rules rules.yml does not define: {sorted(unknown)}"
            used |= metric_names(rule["expr"])
    # the metrics added for these rules are read by them
    for name in (
        "mcp_tasks_proxy_store_writable",
        "mcp_tasks_proxy_store_errors_total",
        "mcp_tasks_proxy_lease_seconds",
        "mcp_tasks_proxy_lease_renewed_timestamp_seconds",
        "mcp_tasks_proxy_replicas",
        "mcp_tasks_proxy_upstream_errors_total",
        "mcp_tasks_proxy_tasks_orphaned_total",
    ):
        assert name in used, name
    # a recording rule's name follows level:metric:operations (Prometheus naming practice)
    for record in records:
        level, metric, operations = record.split(":")
        assert level and operations and metric.startswith("mcp_tasks_proxy_"), record
