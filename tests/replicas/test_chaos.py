"""Small chaos runs (scripts/chaos.py): SIGKILLs under mixed load, then every seen task checked.

The script exits 1 on any violation; these tests also assert that the run proved something: kills
landed while requests were in flight, completed results were seen before the first kill (and so
were re-read after it), every handed-out task was known and terminal at the end, every failed task
failed for a reason the run explains (its tool's own error, or the loss of a process SIGKILLed while
the task ran there), and the upstream started no call twice except re-runs by `on_restart: rerun`.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from support.servers import ROOT


def chaos(*argv: str, timeout: float) -> dict:
    out = subprocess.run(
        [sys.executable, "scripts/chaos.py", *argv], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )
    assert out.returncode == 0, out.stdout + out.stderr[-4000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["violations"] == []
    return report


def assert_proved(report: dict, kills: int, *, rerun: bool = False) -> None:
    assert report["kills"] == kills
    assert report["kills_with_requests_in_flight"] > 0 and report["calls_in_flight_at_kills"] > 0
    assert report["seen_completed_before_first_kill"] > 0 and report["seen_completed_before_kill"] > 0
    assert report["handed_out"] > 0 and report["polls"] > report["handed_out"]
    assert report["unknown_ids"] == 0 and report["lost_results"] == 0 and report["terminal_changed"] == 0
    assert report["not_terminal"] == 0
    assert sum(report["final"].values()) == report["handed_out"]
    assert set(report["final"]) <= {"completed", "failed", "cancelled"}
    # Why: every failure is a killed process's (naming it, the task running there) or the tool's own.
    assert report["unexplained_failures"] == 0
    assert report["failed_replica_lost"] + report["failed_expected"] == report["final"].get("failed", 0)
    assert report["tasks_running_at_kills"] > 0
    # How often: the upstream saw every call, each at most once, beyond re-runs the policy asked for.
    assert report["labels_started"] > 0 and report["double_runs"] == 0
    if rerun:
        assert report["reruns"] > 0 and report["rerun_completed"] > 0 and report["lost_despite_rerun"] == 0
    else:
        assert report["reruns"] == 0


def test_small_chaos_run_single_process() -> None:
    report = chaos("--calls", "40", "--kills", "3", "--seed", "7", "--min-seen", "2", timeout=120)
    assert_proved(report, 3)
    # some kill cut a request mid-way (not just refused ones after it)
    assert report["transport"]["call_cut"] > 0


@pytest.mark.redis
@pytest.mark.haproxy
def test_small_chaos_run_three_replicas_and_a_redis_restart() -> None:
    report = chaos(
        "--replicas", "3", "--calls", "60", "--kills", "3", "--seed", "7", "--lease", "1s", timeout=180
    )
    assert_proved(report, 3)
    assert report["redis_restarts"] == 1 and report["seen_completed_before_redis_restart"] > 0


@pytest.mark.redis
@pytest.mark.haproxy
def test_small_chaos_run_three_replicas_rerun_policy() -> None:
    # config/replicas.yaml reads MCP_RERUN_POLICY for slow_compute: a killed replica's calls run again.
    report = chaos(
        "--replicas",
        "3",
        "--calls",
        "60",
        "--kills",
        "3",
        "--seed",
        "11",
        "--lease",
        "1s",
        "--rerun",
        timeout=180,
    )
    assert_proved(report, 3, rerun=True)
