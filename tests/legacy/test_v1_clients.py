"""Acceptance: real v1 (2025-11-25 tasks) clients through the proxy in front of the legacy fixture
server: the TypeScript SDK 1.x client's experimental tasks API (npm) and the `mcp` 1.x Python
line's experimental task client (in its own virtual environment). Each drives a slow call as a
task, `tasks/list`, an input request answered through `tasks/result`, a cancel, a result fetched
from a new session and an `isError` result.

Both are installed on first run into ignored folders (`.node/ts-sdk/`, `.venv-mcp1/`)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
from support.proxy import RunningProxy, Serve, make_config, stdio_config
from support.servers import ROOT, npm_install, python_venv

TS_SDK = "@modelcontextprotocol/sdk@1.32.2"
EXT_TASKS = ("@modelcontextprotocol/ext-tasks@0.2.2", "@modelcontextprotocol/client@2.4.0")
EXT_TASKS_DIR = ROOT / ".node" / "ext-tasks"
MCP1 = "mcp==1.30.0"
TS_DIR = ROOT / ".node" / "ts-sdk"
MCP1_VENV = ROOT / ".venv-mcp1"
FIXTURES = ROOT / "tests" / "fixtures"


def _ts_sdk() -> Path:
    sdk = TS_DIR / "node_modules" / "@modelcontextprotocol" / "sdk"
    if not (sdk / "dist" / "esm" / "experimental" / "tasks").exists():
        npm_install(TS_DIR, TS_SDK)
    return sdk


def _ext_tasks() -> Path:
    """The ext-tasks client's folder (installed on first use) with tests/fixtures/ext_tasks_client.mjs
    copied in, so its bare imports resolve there."""
    if not (EXT_TASKS_DIR / "node_modules" / "@modelcontextprotocol" / "ext-tasks").exists():
        npm_install(EXT_TASKS_DIR, *EXT_TASKS)
    # (the folder is shared by every checkout on this machine: the copy lands whole, under a name of
    # its own, so two runs never read each other's half-written file)
    source = FIXTURES / "ext_tasks_client.mjs"
    script = EXT_TASKS_DIR / f"ext_tasks_client-{hashlib.sha256(source.read_bytes()).hexdigest()[:12]}.mjs"
    if not script.exists():
        partial = script.with_suffix(f".{os.getpid()}.tmp")
        shutil.copy(source, partial)
        os.replace(partial, script)
    return script


def _mcp1_python() -> Path:
    return python_venv(MCP1_VENV, MCP1)


async def _run(argv: list[str]) -> dict:
    """Run a client script (the proxy serves on this event loop: never block it) and parse its JSON line."""
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=ROOT
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout=120)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, err.decode()[-3000:]
    return json.loads(out.decode().strip().splitlines()[-1])


def _check(out: dict) -> None:
    assert out["capabilities"]["list"] == {} and out["capabilities"]["cancel"] == {}
    assert out["capabilities"]["requests"]["tools"]["call"] == {}
    assert out["taskSupport"]["slow_compute"] == "optional"
    assert out["cancel"]["status"] == "cancelled" and out["cancel"]["after"] == "cancelled"
    assert out["cancel"]["again"] == -32602  # a JSON-RPC error the SDK can read (HTTP 200 on this wire)
    assert out["newSession"] == "computed later after 0.3s"


@pytest.mark.node
@pytest.mark.timeout(900)  # first run installs its tools (npm, a venv): longer than the suite's 300 s
async def test_typescript_sdk_1x_experimental_tasks_through_the_proxy(proxy: RunningProxy) -> None:
    node = shutil.which("node")
    assert node, "node is needed for this test"
    out = await _run([node, str(FIXTURES / "ts_v1_client.mjs"), str(_ts_sdk()), proxy.url()])
    _check(out)
    assert (
        out["slow"]["result"]["content"][0]["text"] == "computed ts after 0.6s"
        and out["slow"]["error"] is None
    )
    assert out["slow"]["taskId"] in out["listed"]
    # This client holds a GET stream and also opens tasks/result: a question the GET stream carried
    # first is asked again on tasks/result (README: its reader may be gone; the first answer wins).
    assert out["input"]["result"]["content"][0]["text"] == "deleted ts.txt"
    assert set(out["asked"]) == {"Delete ts.txt?"} and len(out["asked"]) <= 2, out["asked"]
    # The SDK reports a `failed` task as an error message (v1: `isError: true` ends `failed`).
    assert out["isError"]["statuses"][-1] == "failed"
    assert out["isError"]["error"] is not None or (out["isError"]["result"] or {}).get("isError") is True


@pytest.mark.timeout(900)  # first run installs its tools (npm, a venv): longer than the suite's 300 s
async def test_mcp_1x_python_experimental_task_client_through_the_proxy(proxy: RunningProxy) -> None:
    out = await _run([str(_mcp1_python()), str(FIXTURES / "mcp1_v1_client.py"), proxy.url()])
    _check(out)
    assert out["slow"]["created"] == "working" and out["slow"]["statuses"][-1] == "completed"
    assert out["slow"]["result"] == "computed py after 0.6s"
    assert len(out["listed"]) == 1
    # The question reaches this client on its GET stream too, so it may be answered before a poll
    # sees `input_required`; either way it is asked once and the task completes.
    assert out["input"]["statuses"][-1] in ("input_required", "completed")
    assert out["input"]["result"] == "deleted py.txt" and out["input"]["asked"] == ["Delete py.txt?"]
    assert out["isError"]["statuses"][-1] == "failed" and out["isError"]["isError"] is True


@pytest.mark.node
@pytest.mark.timeout(900)  # first run installs the packages
@pytest.mark.parametrize("upstream", ["http", "stdio"])
async def test_ext_tasks_client_gets_a_v1_tasks_question_on_its_get_stream(
    legacy_url: str, tmp_path: Path, serve: Serve, upstream: str
) -> None:
    """The ext-tasks client (0.2.x) polls `tasks/get` on an `input_required` v1 task and calls
    `tasks/result` only at the end: the question reaches it on the session's GET stream (with the
    related-task `_meta`, routed to the task), it answers, and the task completes long before
    `input_timeout` (30 s here)."""
    node = shutil.which("node")
    assert node, "node is needed for this test"
    server = {"tasks": {"input_timeout": "30s", "tools": {"confirm_delete": {"mode": "required"}}}}
    config = (
        make_config(legacy_url, tmp_path / "store", server=server)
        if upstream == "http"
        else stdio_config(tmp_path, server=server)
    )
    proxy = await serve(config)
    started = asyncio.get_running_loop().time()
    out = await _run([node, str(_ext_tasks()), proxy.url(), "confirm_delete", '{"filename": "ext.txt"}'])
    took = asyncio.get_running_loop().time() - started
    assert "error" not in out, out
    [asked] = out["asked"]
    assert asked["message"] == "Delete ext.txt?" and asked["scope"] == "task" and asked["taskId"], asked
    assert out["result"]["content"][0]["text"] == "deleted ext.txt"
    assert took < 20, took
