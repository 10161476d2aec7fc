"""A small chaos run (scripts/chaos.py): SIGKILL the proxy at random moments under mixed load."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import ROOT


def test_small_chaos_run_loses_no_task_and_no_result() -> None:
    out = subprocess.run(
        [sys.executable, "scripts/chaos.py", "--calls", "30", "--kills", "2", "--seed", "7"],
        capture_output=True, text=True, timeout=240, cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["kills"] == 2 and report["handed_out"] > 0
    assert report["unknown_ids"] == 0 and report["lost_results"] == 0
