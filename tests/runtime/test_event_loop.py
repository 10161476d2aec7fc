"""`listen.event_loop` (issue 16): the proxy serves on asyncio's loop by default, on uvloop when
told (`uvloop`, or `auto` where it is installed), and refuses to start, with one clear line, when
told uvloop on a machine without it. The start-up line and `check-config` name the loop."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.servers import ROOT

# Runs the CLI with the uvloop package hidden, as on a machine where it is not installed.
WITHOUT_UVLOOP = (
    "import sys; sys.modules['uvloop'] = None; from proxy.cli import main; raise "
    "SystemExit(main(sys.argv[1:]))"
)


def _config(tmp_path: Path, url: str, event_loop: str | None) -> Path:
    listen = {"event_loop": event_loop} if event_loop else {}
    path = tmp_path / "proxy.json"
    path.write_text(
        json.dumps(
            {
                "listen": listen,
                "store": {"path": str(tmp_path / "store")},
                "mcpServers": {"legacy": {"url": url}},
            }
        )
    )
    return path


def _start_line(args: list[str]) -> dict:
    """Start the proxy, read its `proxy_listening` log line, stop it."""
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert proc.stderr is not None
        for _ in range(200):
            line = proc.stderr.readline()
            if not line:
                break
            if '"proxy_listening"' in line:
                return json.loads(line)
        raise AssertionError("no proxy_listening line")
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


@pytest.mark.parametrize(
    ("setting", "expected"),
    [(None, "asyncio"), ("auto", "uvloop"), ("uvloop", "uvloop"), ("asyncio", "asyncio")],
)
def test_the_start_up_line_names_the_loop_the_setting_gives(
    legacy_url: str, tmp_path: Path, setting: str | None, expected: str
) -> None:
    line = _start_line(
        [
            sys.executable,
            "-m",
            "proxy",
            "--config",
            str(_config(tmp_path, legacy_url, setting)),
            "--port",
            "0",
        ]
    )
    assert line["event_loop"] == expected


def test_auto_falls_back_to_asyncio_where_uvloop_is_not_installed(legacy_url: str, tmp_path: Path) -> None:
    line = _start_line(
        [
            sys.executable,
            "-c",
            WITHOUT_UVLOOP,
            "--config",
            str(_config(tmp_path, legacy_url, "auto")),
            "--port",
            "0",
        ]
    )
    assert line["event_loop"] == "asyncio"


def test_uvloop_insisted_on_where_it_is_not_installed_stops_the_start_with_one_line(
    legacy_url: str, tmp_path: Path
) -> None:
    config = str(_config(tmp_path, legacy_url, "uvloop"))
    served = subprocess.run(
        [sys.executable, "-c", WITHOUT_UVLOOP, "--config", config, "--port", "0"],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=ROOT,
    )
    assert served.returncode == 2
    assert "uvloop package is not installed" in served.stderr and "Traceback" not in served.stderr
    assert "proxy_listening" not in served.stderr
    checked = subprocess.run(
        [sys.executable, "-c", WITHOUT_UVLOOP, "check-config", config],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=ROOT,
    )
    assert checked.returncode == 2 and "uvloop package is not installed" in checked.stderr
    fine = subprocess.run(
        [sys.executable, "-m", "proxy", "check-config", config],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=ROOT,
    )
    assert fine.returncode == 0, fine.stderr
    assert "event loop uvloop" in fine.stdout


def test_check_config_says_which_loop_auto_gives(legacy_url: str, tmp_path: Path) -> None:
    config = str(_config(tmp_path, legacy_url, "auto"))
    here = subprocess.run(
        [sys.executable, "-m", "proxy", "check-config", config],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=ROOT,
    )
    assert here.returncode == 0 and "event loop uvloop" in here.stdout
    without = subprocess.run(
        [sys.executable, "-c", WITHOUT_UVLOOP, "check-config", config],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=ROOT,
    )
    assert without.returncode == 0 and "event loop asyncio (auto: uvloop is not installed)" in without.stdout
