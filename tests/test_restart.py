"""The proxy killed with SIGKILL while tasks run: after a restart every task id still resolves."""

from __future__ import annotations

import sys
from pathlib import Path

import yaml
from conftest import ModernClient, ServerProcess


def _start(config_file: Path) -> ServerProcess:
    return ServerProcess([sys.executable, "-m", "proxy", "--config", str(config_file), "--port", "0"])


async def test_sigkill_then_restart_keeps_results_and_fails_orphans(legacy_url: str, tmp_path: Path) -> None:
    config_file = tmp_path / "proxy.yaml"
    config_file.write_text(yaml.safe_dump({
        "store": {"path": str(tmp_path / "store")},
        "tasks": {"detach_after": "50ms", "ttl": "10m", "poll_interval": "100ms"},
        "mcpServers": {"legacy": {"url": legacy_url}},
    }))
    proxy = _start(config_file)
    try:
        client = ModernClient(proxy.url)
        done_id = (await client.call("slow_compute", {"seconds": 0.1, "label": "kept"})).result["taskId"]
        await client.wait_terminal(done_id)
        orphan_id = (await client.call("slow_compute", {"seconds": 30, "label": "orphaned"})).result["taskId"]
        await client.close()
    finally:
        proxy.kill()
    proxy = _start(config_file)
    try:
        client = ModernClient(proxy.url)
        done = (await client.get(done_id)).result
        assert done["status"] == "completed"
        assert done["result"]["content"][0]["text"] == "computed kept after 0.1s"
        orphan = (await client.get(orphan_id)).result
        assert orphan["status"] == "failed"
        assert orphan["error"]["code"] == -32603
        assert "restarted" in orphan["error"]["message"]
        assert orphan == (await client.get(orphan_id)).result  # stable on later polls
        await client.close()
    finally:
        proxy.stop()
