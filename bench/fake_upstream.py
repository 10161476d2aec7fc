"""A tiny legacy-era (2025-11-25) MCP upstream on aiohttp, for the benchmarks that need many cheap
concurrent calls (the official SDK server spends ~a task group and several memory streams per call).

Speaks just enough Streamable HTTP for the proxy: `initialize` (JSON reply + `Mcp-Session-Id`),
notifications and client responses (202), `tools/call` answered over SSE:
- `greet {name}`: at once;
- `hold {seconds}`: SSE headers at once, then the result after `seconds` or when `POST /release` is called,
  whichever comes first (no progress notifications, so a detached call costs the proxy nothing but memory);
- `chatty {count, name, interval_ms}`: `count` `notifications/progress` events (each its own write,
  `interval_ms` apart, default 0, with the request's `progressToken`), then the result of `greet`:
  the progress-heavy upstream in one call.
`GET /stats` returns `{"inflight": n, "calls": total}`.

    python bench/fake_upstream.py --port 0     # prints `listening on http://127.0.0.1:PORT/mcp`
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import socket

from aiohttp import web

STATE = {"inflight": 0, "calls": 0}
RELEASE = asyncio.Event()


def _result(rid, text: str) -> bytes:
    msg = {
        "jsonrpc": "2.0",
        "id": rid,
        "result": {"content": [{"type": "text", "text": text}], "isError": False},
    }
    return b"event: message\r\ndata: " + json.dumps(msg, separators=(",", ":")).encode() + b"\r\n\r\n"


def _progress(token, progress: int, total: int) -> bytes:
    params = {"progressToken": token, "progress": progress, "total": total, "message": f"step {progress}"}
    msg = {"jsonrpc": "2.0", "method": "notifications/progress", "params": params}
    return b"event: message\r\ndata: " + json.dumps(msg, separators=(",", ":")).encode() + b"\r\n\r\n"


async def mcp(request: web.Request) -> web.StreamResponse:
    if request.method == "DELETE":
        return web.Response(status=200)
    if request.method != "POST":
        return web.Response(status=405)
    body = await request.json()
    if "id" not in body or "method" not in body:
        return web.Response(status=202)
    rid, method, params = body["id"], body["method"], body.get("params") or {}
    if method == "initialize":
        result = {
            "protocolVersion": params.get("protocolVersion", "2025-11-25"),
            "capabilities": {"tools": {"listChanged": False}},
            "serverInfo": {"name": "bench-fake-upstream", "version": "1.0.0"},
        }
        return web.json_response(
            {"jsonrpc": "2.0", "id": rid, "result": result}, headers={"Mcp-Session-Id": secrets.token_hex(16)}
        )
    if method == "tools/list":
        tools = [{"name": n, "inputSchema": {"type": "object"}} for n in ("greet", "hold", "chatty")]
        return web.json_response({"jsonrpc": "2.0", "id": rid, "result": {"tools": tools}})
    if method != "tools/call":
        return web.json_response({"jsonrpc": "2.0", "id": rid, "error": {"code": -32601, "message": method}})
    name, args = params.get("name"), params.get("arguments") or {}
    STATE["calls"] += 1
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    if name == "hold":
        STATE["inflight"] += 1
        try:
            try:
                await asyncio.wait_for(RELEASE.wait(), timeout=float(args.get("seconds", 60)))
            except TimeoutError:
                pass
            await resp.write(_result(rid, "held"))
        finally:
            STATE["inflight"] -= 1
    else:
        if name == "chatty":
            token = (params.get("_meta") or {}).get("progressToken")
            count = int(args.get("count", 10))
            pause = float(args.get("interval_ms", 0)) / 1000
            for i in range(count):
                await resp.write(_progress(token, i + 1, count))
                if pause:
                    await asyncio.sleep(pause)
        await resp.write(_result(rid, f"Hello, {args.get('name', 'world')}!"))
    await resp.write_eof()
    return resp


async def stats(request: web.Request) -> web.Response:
    return web.json_response(STATE)


async def release(request: web.Request) -> web.Response:
    RELEASE.set()
    return web.json_response(STATE)


async def serve(app: web.Application, host: str, port: int) -> None:
    """Serve `app` on `host`:`port` (0: a free port) until cancelled, printing `listening on URL`."""
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    # proto=IPPROTO_TCP so asyncio sets TCP_NODELAY on accepted connections (a proto-0 socket gets
    # Nagle, and an SSE reply written in two pieces then waits ~40 ms for the client's delayed ACK).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    site = web.SockSite(runner, sock, backlog=4096)
    await site.start()
    print(f"listening on http://{host}:{sock.getsockname()[1]}/mcp", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


async def main(host: str, port: int) -> None:
    app = web.Application()
    app.router.add_route("*", "/mcp", mcp)
    app.router.add_get("/stats", stats)
    app.router.add_post("/release", release)
    await serve(app, host, port)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    a = parser.parse_args()
    try:
        asyncio.run(main(a.host, a.port))
    except KeyboardInterrupt:
        pass
