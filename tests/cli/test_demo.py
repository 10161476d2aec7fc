"""The bundled demo server behind the proxy: every demo tool, and the curl line the demo prints."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.clients import ModernClient
from support.proxy import Serve
from support.servers import ROOT, ServerProcess

from proxy.cli.serve import demo_config

ASK = {"elicitation": {}, "extensions": {"io.modelcontextprotocol/tasks": {}}}


@pytest.fixture(scope="module")
def demo_url() -> Iterator[str]:
    server = ServerProcess([sys.executable, "-m", "proxy.demo.server", "--port", "0"])
    yield server.url
    server.stop()


async def test_every_demo_tool_through_the_proxy(demo_url: str, tmp_path: Path, serve: Serve) -> None:
    proxy = await serve(demo_config(demo_url, str(tmp_path / "store")))
    client = ModernClient(proxy.url(), capabilities=ASK)
    try:
        assert (await client.call("echo", {"text": "hi"})).result["content"][0]["text"] == "hi"
        report = (await client.call("slow_report", {"seconds": 1.5, "steps": 3})).result
        assert report["resultType"] == "task"
        done = await client.wait_terminal(report["taskId"])
        assert done["status"] == "completed" and "report ready" in done["result"]["content"][0]["text"]
        flaky = await client.call("flaky_job")
        # fails before 1 s: no task
        assert flaky.error["code"] == -32603 and "build farm is on fire" in flaky.error["message"]
        asked = (await client.call("approve_deploy", {"service": "billing"})).result
        assert asked["resultType"] == "input_required"
        ((key, question),) = asked["inputRequests"].items()
        assert question["params"]["message"] == "Deploy billing to production?"
        retry = {
            "name": "approve_deploy",
            "arguments": {"service": "billing"},
            "inputResponses": {key: {"action": "accept", "content": {"confirm": True}}},
            "requestState": asked["requestState"],
        }
        assert "approved" in (await client.request("tools/call", retry)).result["content"][0]["text"]
    finally:
        await client.close()


def test_the_printed_curl_line_turns_a_slow_call_into_a_task() -> None:
    proxy = ServerProcess([sys.executable, "-m", "proxy", "--port", "0"], ready_prefix="try it: ")
    try:
        command = proxy.url  # ServerProcess keeps what follows the prefix: the whole curl command
        out = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert out.returncode == 0, out.stderr
        reply = json.loads(out.stdout)
        assert reply["result"]["resultType"] == "task" and reply["result"]["taskId"]
    finally:
        proxy.stop()
