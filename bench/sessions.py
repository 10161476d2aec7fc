"""Abandoned legacy sessions: memory held while they live, and what their expiry gives back.

    python bench/sessions.py --sessions 2000 --idle 5s

Starts the SDK upstream (`bench/sdk_upstream.py`, on uvicorn) and the proxy (`listen.legacy_session_idle`
set to `--idle`), opens `--sessions` 2025-11-25 sessions through the proxy (initialize and
`notifications/initialized`, 32 at a time) and leaves them. Reports the RSS (MB) of the proxy and of
the upstream before, right after the sessions were opened, and once they expired (two idle periods
later, plus the expiry sweep's DELETEs), and how many of them the proxy still serves; `--rounds`
times. Python rarely hands freed memory back to the system, so the figure that shows the state
was freed is the next round's: RSS that stays flat from round to round was reused, RSS that grows
by the first round's amount again was held. JSON goes to
bench/results/sessions-<time>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run  # noqa: E402

INITIALIZE = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "initialize",
    "params": {
        "protocolVersion": "2025-11-25",
        "capabilities": {},
        "clientInfo": {"name": "b", "version": "0"},
    },
}
HEADERS = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}


async def open_sessions(url: str, count: int) -> list[str]:
    """Open `count` legacy sessions (32 at a time); return their ids."""
    gate = asyncio.Semaphore(32)
    async with aiohttp.ClientSession() as http:

        async def one() -> str:
            async with gate:
                async with http.post(url, json=INITIALIZE, headers=HEADERS) as resp:
                    sid = resp.headers["Mcp-Session-Id"]
                    await resp.read()
                note = {"jsonrpc": "2.0", "method": "notifications/initialized"}
                session_headers = {**HEADERS, "Mcp-Session-Id": sid, "MCP-Protocol-Version": "2025-11-25"}
                async with http.post(url, json=note, headers=session_headers) as resp:
                    await resp.read()
                return sid

        return await asyncio.gather(*(one() for _ in range(count)))


async def still_known(url: str, sids: list[str]) -> int:
    """How many of `sids` the proxy still serves (a `ping` that is not a 404)."""
    known = 0
    async with aiohttp.ClientSession() as http:
        for sid in sids:
            headers = {**HEADERS, "Mcp-Session-Id": sid, "MCP-Protocol-Version": "2025-11-25"}
            ping = {"jsonrpc": "2.0", "id": 2, "method": "ping"}
            async with http.post(url, json=ping, headers=headers) as resp:
                await resp.read()
                known += resp.status != 404
    return known


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=2000)
    ap.add_argument("--idle", default="5s", help="listen.legacy_session_idle")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    idle_s = float(args.idle.rstrip("s"))
    workdir = Path(tempfile.mkdtemp(prefix="mtp-sessions-"))
    try:
        upstream, up_url = run.start_sdk_upstream(workdir, None)
        config = workdir / "proxy.json"
        config.write_text(
            json.dumps(
                {
                    "listen": {"host": "127.0.0.1", "port": 0, "legacy_session_idle": args.idle},
                    "store": {"path": str(workdir / "store"), "durable": False},
                    "mcpServers": {run.SERVER: {"url": up_url}},
                }
            )
        )
        proxy, url, _ = run.start_proxy(workdir, "proxy", config, None)
        run.wait_ready(url.rsplit("/", 1)[0], proxy)
        rss = lambda proc: round(run.rss_bytes(proc.pid) / 2**20, 1)  # noqa: E731
        before = {"proxy": rss(proxy), "upstream": rss(upstream)}
        rounds = []
        for _ in range(args.rounds):
            started = time.monotonic()
            sids = asyncio.run(open_sessions(url, args.sessions))
            opened = {
                "proxy": rss(proxy),
                "upstream": rss(upstream),
                "seconds": round(time.monotonic() - started, 1),
            }
            time.sleep(2 * idle_s + 5)
            served = asyncio.run(still_known(url, sids[:200]))
            expired = {"proxy": rss(proxy), "upstream": rss(upstream), "of_200_still_served": served}
            rounds.append({"with_sessions": opened, "after_expiry": expired})
            print(json.dumps(rounds[-1]), flush=True)
    finally:
        run.Proc.stop_all()
    out = {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "sessions": args.sessions,
        "idle": args.idle,
        "rss_mb_before": before,
        "rounds_rss_mb": rounds,
    }
    path = run.BENCH / "results" / f"sessions-{dt.datetime.now().strftime('%Y%m%d-%H%M%S')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
