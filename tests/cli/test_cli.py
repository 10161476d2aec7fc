"""The command line, as real subprocesses on loopback: config errors, --version, the no-config demo.

Every process started here is stopped in a `finally`, even when an assertion fails.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.clients import ModernClient
from support.records import make_record, seed_store
from support.servers import run_cli

from proxy import __version__
from proxy.protocol.era import (
    META_CLIENT_CAPABILITIES,
    META_PROTOCOL_VERSION,
    MODERN_VERSION,
    TASKS_EXTENSION,
)
from proxy.tasks.model import now_ms

ROOT = Path(__file__).resolve().parents[2]


# --- config errors ------------------------------------------------------------------------------


def test_invalid_config_exits_2_naming_the_key(tmp_path: Path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "mcpServers:\n"
        "  build:\n"
        "    url: http://127.0.0.1:1/mcp\n"
        "    tasks:\n"
        "      tools:\n"
        "        deploy: {mode: required, foo: 1}\n"
    )
    proc = run_cli("--config", str(bad), "--port", "0")
    assert proc.returncode == 2, proc.stderr
    assert "mcpServers.build.tasks.tools.deploy.foo" in proc.stderr
    assert "unknown key" in proc.stderr
    assert str(bad) in proc.stderr
    assert "Traceback" not in proc.stderr


def test_bad_duration_exits_2(tmp_path: Path):
    bad = tmp_path / "bad.json"
    bad.write_text(
        json.dumps({"tasks": {"detach_after": 5}, "mcpServers": {"a": {"url": "http://127.0.0.1:1/mcp"}}})
    )
    proc = run_cli("-c", str(bad))
    assert proc.returncode == 2
    assert "tasks.detach_after" in proc.stderr and "unit" in proc.stderr


def test_missing_env_var_exits_2(tmp_path: Path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "mcpServers:\n  a:\n    url: http://127.0.0.1:1/mcp\n    headers: {Authorization: 'Bearer "
        "${CLI_TEST_UNSET_TOKEN}'}\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "CLI_TEST_UNSET_TOKEN"}
    proc = subprocess.run(
        [sys.executable, "-m", "proxy", "--config", str(cfg)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
    )
    assert proc.returncode == 2
    assert (
        "mcpServers.a.headers.Authorization: environment variable CLI_TEST_UNSET_TOKEN is not set"
        in proc.stderr
    )


def test_missing_config_file(tmp_path: Path):
    missing = tmp_path / "nope.yaml"
    proc = run_cli("--config", str(missing))
    assert proc.returncode != 0
    assert "cannot read" in proc.stderr and str(missing) in proc.stderr
    assert "Traceback" not in proc.stderr


def test_unreadable_config_file(tmp_path: Path):
    if os.geteuid() == 0:
        # root reads anything; a directory stands in for an unreadable file.
        target = tmp_path / "dir.yaml"
        target.mkdir()
    else:
        target = tmp_path / "secret.yaml"
        target.write_text("mcpServers: {a: {url: 'http://127.0.0.1:1/mcp'}}\n")
        target.chmod(0)
    proc = run_cli("--config", str(target))
    assert proc.returncode != 0
    assert "cannot read" in proc.stderr and str(target) in proc.stderr
    assert "Traceback" not in proc.stderr


def test_malformed_yaml(tmp_path: Path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("mcpServers: [\n")
    proc = run_cli("--config", str(bad))
    assert proc.returncode == 2
    assert "not valid YAML" in proc.stderr


def test_version():
    proc = run_cli("--version")
    assert proc.returncode == 0
    assert proc.stdout.strip() == f"mcp-tasks-proxy {__version__}"


def test_help():
    proc = run_cli("--help")
    assert proc.returncode == 0
    assert "--config" in proc.stdout and "--port" in proc.stdout


# --- the no-config demo -------------------------------------------------------------------------


def _children(pid: int) -> list[int]:
    """Pids whose parent is `pid` (from /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # field 4 (ppid) follows the ")" that closes the command name
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[1]) == pid:
            out.append(int(entry))
    return out


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


class DemoProxy:
    """`python -m proxy --port 0` in its own session, with its stdout read by a thread."""

    def __init__(self, tmp_path: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "proxy", "--port", "0"],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=(tmp_path / "proxy.stderr").open("w"),
            text=True,
            start_new_session=True,
            env={**os.environ, "TMPDIR": str(tmp_path)},
        )
        self.stderr_path = tmp_path / "proxy.stderr"
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        self.child_pids: list[int] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def wait_for_line(self, prefix: str, timeout: float = 30) -> str:
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(
                    f"no line starting with {prefix!r}; saw {self.seen}; stderr: "
                    f"{self.stderr_path.read_text()}"
                )
            try:
                line = self.lines.get(timeout=remaining)
            except queue.Empty:
                continue
            if line is None:
                raise AssertionError(
                    f"the proxy exited ({self.proc.poll()}); saw {self.seen}; stderr: "
                    f"{self.stderr_path.read_text()}"
                )
            self.seen.append(line)
            if line.startswith(prefix):
                return line

    def stop(self) -> None:
        """SIGINT, then SIGKILL the proxy and any child it left behind (by pid)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for pid in self.child_pids:
            if _alive(pid) and "proxy.demo.server" in _cmdline(pid):
                os.kill(pid, signal.SIGKILL)
        if self.proc.stdout:
            self.proc.stdout.close()


@pytest.fixture
def demo_proxy(tmp_path: Path) -> Iterator[DemoProxy]:
    proxy = DemoProxy(tmp_path)
    try:
        yield proxy
    finally:
        proxy.stop()


def _modern_headers(method: str, name: str | None) -> dict[str, str]:
    headers = {
        "Content-Type": "application/json",
        "Accept": "application/json, text/event-stream",
        "MCP-Protocol-Version": MODERN_VERSION,
        "Mcp-Method": method,
    }
    if name is not None:
        headers["Mcp-Name"] = name
    return headers


def _modern_body(request_id: int, method: str, params: dict, *, tasks: bool) -> bytes:
    caps = {"extensions": {TASKS_EXTENSION: {}}} if tasks else {}
    meta = {META_PROTOCOL_VERSION: MODERN_VERSION, META_CLIENT_CAPABILITIES: caps}
    return json.dumps(
        {"jsonrpc": "2.0", "id": request_id, "method": method, "params": {**params, "_meta": meta}}
    ).encode()


async def _exercise_demo(url: str) -> None:
    client = ModernClient(url)
    try:
        # A fast call: the demo's echo tool answers synchronously.
        reply = await client.post_raw(
            _modern_body(
                1,
                "tools/call",
                {"name": "echo", "arguments": {"text": "hello from the cli test"}},
                tasks=False,
            ),
            _modern_headers("tools/call", "echo"),
        )
        assert reply.status == 200, reply
        result = reply.result
        assert result["resultType"] == "complete"
        assert result["content"][0]["text"] == "hello from the cli test"

        # A slow call with the tasks extension declared: detached after 1 s into a task.
        started = time.monotonic()
        reply = await client.post_raw(
            _modern_body(
                2, "tools/call", {"name": "slow_report", "arguments": {"seconds": 2, "steps": 2}}, tasks=True
            ),
            _modern_headers("tools/call", "slow_report"),
        )
        assert reply.status == 200, reply
        created = reply.result
        assert created["resultType"] == "task", created
        assert created["status"] in ("working", "input_required")
        assert time.monotonic() - started < 2.0, "the task handle must come before the call ends"
        task_id = created["taskId"]

        # Poll tasks/get until completed.
        async with asyncio.timeout(15):
            n = 10
            while True:
                n += 1
                got = await client.post_raw(
                    _modern_body(n, "tasks/get", {"taskId": task_id}, tasks=True),
                    _modern_headers("tasks/get", task_id),
                )
                assert got.status == 200, got
                task = got.result
                assert task["taskId"] == task_id
                if task["status"] in ("completed", "failed", "cancelled"):
                    break
                await asyncio.sleep(0.05)
        assert task["status"] == "completed", task
        assert task["result"]["content"][0]["text"] == "report ready after 2 s"
    finally:
        await client.close()


def test_demo_serves_and_stops_cleanly(demo_proxy: DemoProxy):
    line = demo_proxy.wait_for_line("listening on ")
    url = line.removeprefix("listening on ")
    assert url.startswith("http://127.0.0.1:") and url.endswith("/mcp")
    assert int(url.removeprefix("http://127.0.0.1:").removesuffix("/mcp")) > 0
    assert any(
        s.startswith("demo upstream (a legacy MCP server) at http://127.0.0.1:") for s in demo_proxy.seen
    )

    demo_children = [pid for pid in _children(demo_proxy.proc.pid) if "proxy.demo.server" in _cmdline(pid)]
    demo_proxy.child_pids = demo_children
    assert len(demo_children) == 1, [(_cmdline(p), p) for p in _children(demo_proxy.proc.pid)]

    asyncio.run(_exercise_demo(url))

    demo_proxy.proc.send_signal(signal.SIGINT)
    try:
        rc = demo_proxy.proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pytest.fail("the proxy did not exit within 10 s of SIGINT")
    stderr = demo_proxy.stderr_path.read_text()
    assert rc == 0, stderr
    assert '"proxy_draining"' in stderr and '"drain_timeout_s":30.0' in stderr, stderr
    deadline = time.monotonic() + 5
    while _alive(demo_children[0]) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not _alive(demo_children[0]), "the demo child outlived the proxy"


def test_sigterm_while_the_demo_starts_leaves_nothing_behind(demo_proxy: DemoProxy, tmp_path: Path):
    """SIGTERM as soon as the demo's upstream is up, which is before the proxy's event loop has its
    signal handlers in most runs: the proxy exits 0 and leaves neither its child nor its temporary
    store (before, the default action killed it with 143 and the store stayed)."""
    demo_proxy.wait_for_line("demo upstream (a legacy MCP server) at ")
    children = [pid for pid in _children(demo_proxy.proc.pid) if "proxy.demo.server" in _cmdline(pid)]
    demo_proxy.child_pids = children
    demo_proxy.proc.send_signal(signal.SIGTERM)
    rc = demo_proxy.proc.wait(timeout=10)
    assert rc == 0, demo_proxy.stderr_path.read_text()
    assert not list(tmp_path.glob("mcp-tasks-proxy-demo-*"))
    deadline = time.monotonic() + 5
    while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not any(_alive(pid) for pid in children), "the demo child outlived the proxy"


def test_shipped_json_schema_is_generated_from_the_models():
    from proxy.config import SCHEMA_FILE, config_json_schema

    assert json.loads(SCHEMA_FILE.read_text()) == config_json_schema(), (
        "run: mcp-tasks-proxy schema > proxy/config/config.schema.json"
    )


def test_schema_command_prints_the_schema():
    out = subprocess.run(
        [sys.executable, "-m", "proxy", "schema"], capture_output=True, text=True, timeout=30, cwd=ROOT
    )
    assert out.returncode == 0
    schema = json.loads(out.stdout)
    assert schema["title"] == "mcp-tasks-proxy config" and "mcpServers" in schema["properties"]


def test_check_config_prints_what_it_will_serve(tmp_path):
    # where mcp-server-time is
    venv_path = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    out = subprocess.run(
        [sys.executable, "-m", "proxy", "check-config", "config/claude_desktop.json"],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=ROOT,
        env=venv_path,
    )
    assert out.returncode == 0, out.stderr
    assert "config/claude_desktop.json: valid" in out.stdout
    assert "- time: stdio: mcp-server-time" in out.stdout and "/servers/demo/mcp" in out.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text("mcpServers:\n  a:\n    url: http://x/mcp\n    tasks: {tools: {t: {mode: sometimes}}}\n")
    out = run_cli("check-config", str(bad))
    assert out.returncode == 2 and "mcpServers.a.tasks.tools.t.mode" in out.stderr
    # `--config FILE`, as the main command takes it, names the file too; naming none or two is refused
    out = run_cli("check-config", "--config", str(bad))
    assert out.returncode == 2 and "mcpServers.a.tasks.tools.t.mode" in out.stderr
    out = run_cli("check-config", "--config", str(ROOT / "config" / "minimal.json"))
    assert out.returncode == 0 and "minimal.json: valid" in out.stdout, out.stdout
    for argv in ((), (str(bad), "--config", str(bad))):
        out = run_cli("check-config", *argv)
        assert out.returncode == 2 and "name the config file once" in out.stderr, out.stderr


def checked(tmp_path: Path, text: str) -> tuple[list[str], list[str]]:
    """`check-config` on a file holding `text`, which must pass: (its lines, its warning lines)."""
    config = tmp_path / "c.yaml"
    config.write_text(text)
    out = run_cli("check-config", str(config))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    return lines, [line for line in lines if line.startswith("warning:")]


def test_check_config_shows_the_capped_ttl_and_warns_of_a_detach_that_cannot_happen(tmp_path):
    """`limits.max_ttl` caps the defaults' ttl on the line that shows it (it showed the ttl given),
    and an optional tool whose `detach_after` is not below its server's `timeout` is named: its
    calls can never become tasks. A required tool (a task at once) is not, nor a tool that only
    inherits the server's settings (`kept`: the server's warning covers it)."""
    lines, warnings = checked(
        tmp_path,
        "limits: {max_ttl: 2m}\ntasks: {detach_after: 1h}\nmcpServers:\n  a:\n    url: http://127.0.0.1:1/mcp\n"
        "    timeout: 10s\n    tasks:\n      ttl: 1h\n"
        "      tools: {quick: {detach_after: 1s}, sure: {mode: required}, kept: {ttl: 1m}}\n",
    )
    text = "\n".join(lines)
    assert "ttl 120s (limits.max_ttl; 3600s given)" in text and "    tasks: ttl 120s" in text
    assert warnings == [
        "warning: mcpServers.a: detach_after (3600s) is not below timeout (10s): its calls end before they "
        "could become tasks"
    ], lines


def test_check_config_warns_of_task_settings_a_forbidden_tool_ignores(tmp_path):
    """`on_restart: rerun` on a `mode: forbidden` tool was dropped from the printed policy unsaid."""
    lines, warnings = checked(
        tmp_path,
        "mcpServers:\n  a:\n    url: http://127.0.0.1:1/mcp\n    tasks:\n      tools:\n"
        "        never: {mode: forbidden, on_restart: rerun, ttl: 1m, input_timeout: 5s}\n",
    )
    assert warnings == [
        "warning: mcpServers.a tool never: mode forbidden (never a task) ignores on_restart, ttl"
    ], lines


def test_check_config_prints_the_limits(tmp_path):
    """The `limits` section was not shown: an operator could not see how `2 per minute` was read.
    Durations print as whole seconds (`:g` wrote 30 days as `2.592e+06s`)."""
    lines, _ = checked(
        tmp_path,
        "limits: {tasks_rate: 2 per minute, max_tasks_per_principal: 5, max_ttl: 30d}\n"
        "mcpServers:\n  a:\n    url: http://127.0.0.1:1/mcp\n",
    )
    assert (
        "limits: tasks_rate 2 per 1 minute per principal, failed_auth 20 per 1 minute per client address, "
        "max_tasks_per_principal 5, max_sessions_per_principal none, max_ttl 2592000s, "
        "max_result_bytes 16777216"
    ) in lines, lines


def test_check_config_refuses_a_stdio_command_not_on_the_path(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(
        "mcpServers:\n  gone:\n    command: no-such-mcp-server-xyz\n  rel:\n    command: ./missing.sh\n"
    )
    out = run_cli("check-config", str(config))
    assert out.returncode == 2
    assert "mcpServers.gone.command: 'no-such-mcp-server-xyz' is not on the PATH" in out.stderr
    assert "mcpServers.rel.command: './missing.sh' is not an executable file" in out.stderr


def test_operator_tasks_command_lists_shows_and_cancels(tmp_path):
    seed_store(
        tmp_path / "store",
        *(
            make_record(
                task_id=f"task-{i}",
                tool=f"tool{i}",
                created_ms=now_ms() + i,
                status=status,
                outcome={"result": {"content": [], "isError": False}} if status == "completed" else None,
            )
            for i, status in enumerate(("working", "completed"))
        ),
    )

    def run(*args: str) -> subprocess.CompletedProcess:
        return run_cli("tasks", "--store", str(tmp_path / "store"), *args)

    listing = run("list")
    assert (
        listing.returncode == 0
        and "task-0" in listing.stdout
        and "task-1" in listing.stdout
        and "2 task(s)" in listing.stdout
    )
    assert "task-1" not in run("list", "--status", "working").stdout
    shown = json.loads(run("show", "task-1").stdout)
    assert (
        shown["status"] == "completed"
        and shown["tool"] == "tool1"
        and shown["result"] == {"content": [], "isError": False, "resultType": "complete"}
    )
    assert "cancelled" in run("cancel", "task-0").stdout
    assert json.loads(run("show", "task-0").stdout)["status"] == "cancelled"
    assert "already completed" in run("cancel", "task-1").stdout
    assert run("show", "nope").returncode == 1


def test_task_ids_that_look_like_options_and_hash_token_edge_cases(tmp_path):
    seed_store(tmp_path / "store", make_record(task_id="-vNAuJ4MJ9dash"))
    base = [sys.executable, "-m", "proxy", "tasks", "--store", str(tmp_path / "store")]
    shown = subprocess.run(
        [*base, "show", "-vNAuJ4MJ9dash"], capture_output=True, text=True, timeout=30, cwd=ROOT
    )
    assert shown.returncode == 0 and json.loads(shown.stdout)["taskId"] == "-vNAuJ4MJ9dash"
    cancelled = subprocess.run(
        [*base, "cancel", "-vNAuJ4MJ9dash"], capture_output=True, text=True, timeout=30, cwd=ROOT
    )
    assert cancelled.returncode == 0 and "cancelled" in cancelled.stdout
    helped = run_cli("hash-token", "--help")
    assert helped.returncode == 0 and helped.stdout.startswith("usage:")
    empty = run_cli("hash-token", input="")
    assert empty.returncode == 2
    short = run_cli("hash-token", "s3cret")
    assert short.returncode == 2 and "at least 16 characters" in short.stderr and not short.stdout
    hashed = run_cli("hash-token", "s3cret-s3cret-s3cret")
    assert hashed.stdout.strip() == "sha256:" + hashlib.sha256(b"s3cret-s3cret-s3cret").hexdigest()
    padded = run_cli("hash-token", input=" s3cret-s3cret-s3cret\n")  # a client's header loses the space
    assert padded.returncode == 2 and "whitespace" in padded.stderr and not padded.stdout


def test_a_replica_on_a_wildcard_host_without_advertise_is_refused_cleanly(tmp_path):
    """check-config and serve both refuse it with exit 2 and one line (no traceback); with
    `advertise` check-config prints the address filled in."""
    secret = "s" * 40
    config = tmp_path / "r.yaml"
    config.write_text(
        "listen: {host: 0.0.0.0, port: 0}\nstore: {url: redis://127.0.0.1:1/0}\n"
        f"replicas: {{secret: {secret}}}\nmcpServers:\n  a: {{url: http://127.0.0.1:1/mcp}}\n"
    )
    checked = run_cli("check-config", str(config))
    assert checked.returncode == 2 and "replicas.advertise is needed" in checked.stderr, checked
    served = run_cli("--config", str(config))
    assert (
        served.returncode == 2
        and "replicas.advertise is needed" in served.stderr
        and "Traceback" not in served.stderr
    ), served
    config.write_text(config.read_text().replace("secret:", "advertise: 'http://10.0.0.5:{port}', secret:"))
    checked = run_cli("check-config", str(config))
    assert checked.returncode == 0 and "advertised as http://10.0.0.5:0" in checked.stdout, checked
    # The shipped template `http://{host}:{port}` on a wildcard host is no address either.
    config.write_text(config.read_text().replace("http://10.0.0.5:{port}", "http://{host}:{port}"))
    checked = run_cli("check-config", str(config))
    assert checked.returncode == 2 and "a wildcard address other replicas cannot reach" in checked.stderr, (
        checked
    )


def test_check_config_never_prints_a_password_in_an_upstream_url(tmp_path):
    """A user and password in an upstream url are accepted (alone), never printed."""
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"mcpServers": {"a": {"url": "http://user:PW-SECRET@127.0.0.1:9/mcp"}}}))
    checked = run_cli("check-config", str(config))
    assert checked.returncode == 0, checked.stderr
    assert "http://127.0.0.1:9/mcp" in checked.stdout and "PW-SECRET" not in checked.stdout + checked.stderr


def test_check_config_says_when_a_drain_grace_is_cut_to_drain_detached(tmp_path):
    config = tmp_path / "r.yaml"
    config.write_text(
        "listen: {port: 0, drain_detached: 10s, drain_grace: 30s}\nstore: {url: redis://127.0.0.1:1/0}\n"
        f"replicas: {{secret: {'s' * 40}}}\nmcpServers:\n  a: {{url: http://127.0.0.1:1/mcp}}\n"
    )
    checked = run_cli("check-config", str(config))
    assert checked.returncode == 0, checked
    assert "drain_detached 10s, drain_grace 30s (cut to drain_detached)" in checked.stdout
    config.write_text(config.read_text().replace("drain_grace: 30s", "drain_grace: 2s"))
    checked = run_cli("check-config", str(config))
    assert "drain_grace 2s" in checked.stdout and "cut to" not in checked.stdout, checked


def test_check_config_shows_each_tools_policy_and_ignored_replica_settings(tmp_path):
    config = tmp_path / "t.yaml"
    config.write_text(
        "listen: {port: 0, drain_grace: 30s}\nmcpServers:\n  a:\n    url: http://127.0.0.1:1/mcp\n"
        "    timeout: 2h\n"
        "    tasks: {tools: {build: {mode: required, on_restart: rerun, input_timeout: 1m}}}\n"
    )
    checked = run_cli("check-config", str(config))
    assert checked.returncode == 0, checked
    assert "note: listen.drain_grace applies to replicas only" in checked.stdout, checked.stdout
    tool = next(line for line in checked.stdout.splitlines() if line.strip().startswith("tool build:"))
    for shown in ("mode required", "on_restart rerun", "timeout 7200s", "input_timeout 60s", "ttl 3600s"):
        assert shown in tool, tool
    config.write_text(config.read_text().replace("mode: required", "mode: forbidden"))
    checked = run_cli("check-config", str(config))
    tool = next(line for line in checked.stdout.splitlines() if line.strip().startswith("tool build:"))
    assert "mode forbidden (never a task" in tool and "detach_after" not in tool, tool
    assert "(durable: yes)" in checked.stdout, checked.stdout


def test_check_config_into_a_closed_pipe_exits_quietly(tmp_path):
    """`check-config FILE | head`: a reader that stops early gets no BrokenPipeError traceback."""
    config = tmp_path / "c.yaml"
    config.write_text("mcpServers:\n  a: {url: http://127.0.0.1:1/mcp}\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy", "check-config", str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # gone before the command writes a line
    try:
        stderr = proc.stderr.read().decode()
        assert proc.wait(timeout=30) == 0, stderr
    finally:
        proc.stderr.close()
    assert "Traceback" not in stderr and "BrokenPipeError" not in stderr, stderr
