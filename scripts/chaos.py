"""Chaos run: many mixed calls while the proxy is SIGKILLed at random moments and restarted.

    python scripts/chaos.py [--calls 200] [--kills 4] [--seed N]

It starts the legacy fixture server and the proxy (a subprocess, durable store in a temp folder),
fires N mixed calls (fast sync, slow tasks, failing, erroring) from a 2026-07-28 client that
declares the tasks extension, kills the proxy with SIGKILL at random moments `--kills` times
(restarting it each time), then polls every task id it was ever handed until each is terminal.
It checks that no handed-out task id is unknown, that every task seen `completed` before a kill is
still `completed` with the same result afterwards, and prints the counts. Exit status 1 on any
violation. Loopback only; every process it starts is stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
META = {
    "io.modelcontextprotocol/protocolVersion": "2026-07-28",
    "io.modelcontextprotocol/clientCapabilities": {"extensions": {"io.modelcontextprotocol/tasks": {}}},
}


class Child:
    """A subprocess that prints `listening on URL` when ready."""

    def __init__(self, argv: list[str]) -> None:
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT)
        self.url = ""
        assert self.proc.stdout is not None
        for _ in range(50):
            line = self.proc.stdout.readline()
            if not line:
                break
            if line.startswith("listening on "):
                self.url = line.strip().removeprefix("listening on ")
                return
        self.stop()
        raise RuntimeError(f"{argv[:3]} did not start")

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


async def rpc(http: aiohttp.ClientSession, url: str, method: str, params: dict, name: str | None = None) -> dict:
    headers = {
        "Content-Type": "application/json",
        "Accept": "application/json, text/event-stream",
        "MCP-Protocol-Version": "2026-07-28",
        "Mcp-Method": method,
    }
    if name is not None:
        headers["Mcp-Name"] = name
    body = {"jsonrpc": "2.0", "id": random.randrange(1 << 30), "method": method, "params": {**params, "_meta": META}}
    async with http.post(url, json=body, headers=headers, timeout=aiohttp.ClientTimeout(total=20)) as resp:
        text = await resp.text()
    if text.startswith("event:") or "\ndata:" in text:
        datas = [json.loads(line[5:]) for line in text.splitlines() if line.startswith("data:") and line[5:].strip()]
        return datas[-1]
    return json.loads(text)


def mixed_call(i: int) -> tuple[str, dict]:
    kind = i % 5
    if kind == 0:
        return "greet", {"name": f"n{i}"}
    if kind == 1:
        return "failing_job", {}
    if kind == 2:
        return "instant_error", {}
    return "slow_compute", {"seconds": round(random.uniform(0.1, 2.0), 2), "label": f"c{i}"}


async def run(calls: int, kills: int, seed: int) -> int:
    random.seed(seed)
    workdir = Path(tempfile.mkdtemp(prefix="mcp-tasks-proxy-chaos-"))
    upstream = Child([sys.executable, "tests/fixtures/legacy_server.py", "--port", "0"])
    config = workdir / "proxy.json"
    config.write_text(json.dumps({
        "store": {"path": str(workdir / "store")},
        "tasks": {"detach_after": "50ms", "ttl": "1h", "poll_interval": "100ms"},
        "mcpServers": {"fx": {"url": upstream.url}},
    }))
    argv = [sys.executable, "-m", "proxy", "--config", str(config), "--port", "0"]
    proxy = Child(argv)
    handed: set[str] = set()
    completed: dict[str, dict] = {}
    counts = {"calls": 0, "sync_results": 0, "sync_errors": 0, "transport_errors": 0, "tasks": 0, "kills": 0}
    try:
        async with aiohttp.ClientSession() as http:

            async def one(i: int) -> None:
                tool, args = mixed_call(i)
                counts["calls"] += 1
                try:
                    reply = await rpc(http, proxy.url, "tools/call", {"name": tool, "arguments": args}, name=tool)
                except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                    counts["transport_errors"] += 1  # the proxy died under this request: no handle was given
                    return
                result = reply.get("result") or {}
                if result.get("resultType") == "task":
                    handed.add(result["taskId"])
                    counts["tasks"] += 1
                elif "error" in reply:
                    counts["sync_errors"] += 1
                else:
                    counts["sync_results"] += 1

            async def poll_some() -> None:
                for task_id in random.sample(sorted(handed), min(len(handed), 10)):
                    try:
                        reply = await rpc(http, proxy.url, "tasks/get", {"taskId": task_id}, name=task_id)
                    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                        continue
                    task = reply.get("result") or {}
                    if task.get("status") == "completed":
                        completed.setdefault(task_id, task["result"])

            pending = []
            kill_points = sorted(random.sample(range(1, calls), min(kills, calls - 1)))
            for i in range(calls):
                pending.append(asyncio.create_task(one(i)))
                await asyncio.sleep(random.uniform(0, 0.02))
                if kill_points and i == kill_points[0]:
                    kill_points.pop(0)
                    await asyncio.sleep(random.uniform(0.05, 0.5))
                    await poll_some()
                    proxy.kill()
                    counts["kills"] += 1
                    await asyncio.gather(*pending)
                    pending.clear()
                    proxy = Child(argv)
            await asyncio.gather(*pending)
            await poll_some()
            unknown, lost, statuses = [], [], {}
            deadline = time.monotonic() + 60
            for task_id in sorted(handed):
                while True:
                    reply = await rpc(http, proxy.url, "tasks/get", {"taskId": task_id}, name=task_id)
                    if "error" in reply:
                        unknown.append(task_id)
                        break
                    task = reply["result"]
                    if task["status"] in ("completed", "failed", "cancelled") or time.monotonic() > deadline:
                        statuses[task["status"]] = statuses.get(task["status"], 0) + 1
                        if task_id in completed and (task["status"] != "completed" or task.get("result") != completed[task_id]):
                            lost.append(task_id)
                        break
                    await asyncio.sleep(0.1)
    finally:
        proxy.stop()
        upstream.stop()
    report = {**counts, "handed_out": len(handed), "seen_completed_before_end": len(completed), "final": statuses,
              "unknown_ids": len(unknown), "lost_results": len(lost)}
    print(json.dumps(report, sort_keys=True))
    return 1 if unknown or lost else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--kills", type=int, default=4)
    parser.add_argument("--seed", type=int, default=int(time.time()))
    args = parser.parse_args()
    sys.exit(asyncio.run(run(args.calls, args.kills, args.seed)))


if __name__ == "__main__":
    main()
