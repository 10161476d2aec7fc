"""The floor of our stack: the smallest correct aiohttp server a proxy like ours could be.

Two modes, each one process on aiohttp both ways, as the proxy is:

- `pass` (default): a pass-through in front of one Streamable HTTP upstream. Each request's body is
  read and forwarded with one pooled `ClientSession` (the headers MCP needs on the way up:
  `Content-Type`, `Accept`, `Mcp-Session-Id`, `MCP-Protocol-Version`, `Last-Event-ID`,
  `Authorization`; on the way back: `Content-Type`, `Mcp-Session-Id`, `Cache-Control`), and the
  reply is streamed back chunk by chunk as it arrives, SSE included. No JSON is parsed, nothing is
  stored. It is what the proxy's relay costs at the least, whatever it does beyond.
- `json`: a minimal JSON-RPC handler: parse the body with `json`, look the `params.taskId` up in a
  dict loaded from `--ids-file` (the ids the bench stored), answer a `tasks/get`-shaped result with
  `web.json_response`. The floor for `tasks/get`: what answering a small JSON request from memory
  costs on aiohttp, with no store behind it.
- `json` with `--store DIR`: the same handler, the record read from the proxy's own diskcache
  directory instead (one `Cache.get` of `task:<id>`, opened as the proxy opens it: its `DataDisk`
  codec, `eviction_policy="none"`), its `taskId`, `status` and `ttl` answered. What a `tasks/get`
  costs on aiohttp once it reads a durable store, and nothing else (no principal, no envelope, no
  log line, no metrics).

    python bench/floor.py --upstream http://127.0.0.1:PORT/mcp --port 0   # prints `listening on URL`
    python bench/floor.py --json --ids-file ids.json --port 0
    python bench/floor.py --json --ids-file ids.json --store STORE_DIR --port 0
"""

from __future__ import annotations

import argparse
import asyncio
import json

import aiohttp
import diskcache
import uvloop
from aiohttp import web
from fake_upstream import serve  # the same listener as the fast upstream (TCP_NODELAY)

from proxy.tasks.datadisk import DataDisk  # the store's codec: records are JSON, read by orjson

UP_HEADERS = (
    "Content-Type",
    "Accept",
    "Mcp-Session-Id",
    "MCP-Protocol-Version",
    "Last-Event-ID",
    "Authorization",
)
DOWN_HEADERS = ("Content-Type", "Mcp-Session-Id", "Cache-Control")
SESSION = web.AppKey("session", aiohttp.ClientSession)


def pass_through_app(upstream: str) -> web.Application:
    """The pass-through: every method on `/mcp` forwarded to `upstream`, the reply streamed back."""

    async def forward(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers = {name: value for name in UP_HEADERS if (value := request.headers.get(name)) is not None}
        async with request.app[SESSION].request(request.method, upstream, data=body, headers=headers) as up:
            reply = web.StreamResponse(
                status=up.status,
                headers={name: value for name in DOWN_HEADERS if (value := up.headers.get(name)) is not None},
            )
            await reply.prepare(request)
            async for chunk in up.content.iter_any():
                await reply.write(chunk)
            await reply.write_eof()
            return reply

    async def session(app: web.Application):
        app[SESSION] = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
        )
        yield
        await app[SESSION].close()

    app = web.Application()
    app.cleanup_ctx.append(session)
    app.router.add_route("*", "/mcp", forward)
    return app


def json_app(ids: list[str]) -> web.Application:
    """The JSON handler: `tasks/get` answered from a dict of `ids`."""
    tasks = {task_id: {"taskId": task_id, "status": "completed", "ttl": 3600000} for task_id in ids}

    async def answer(request: web.Request) -> web.Response:
        message = json.loads(await request.read())
        task = tasks.get((message.get("params") or {}).get("taskId"))
        if task is None:
            error = {"code": -32602, "message": "unknown task"}
            return web.json_response({"jsonrpc": "2.0", "id": message.get("id"), "error": error})
        return web.json_response({"jsonrpc": "2.0", "id": message.get("id"), "result": task})

    app = web.Application()
    app.router.add_post("/mcp", answer)
    return app


def store_app(store: str) -> web.Application:
    """The JSON handler reading each record from the proxy's diskcache directory `store`."""
    cache = diskcache.Cache(store, disk=DataDisk, eviction_policy="none", timeout=10)

    async def answer(request: web.Request) -> web.Response:
        message = json.loads(await request.read())
        task_id = (message.get("params") or {}).get("taskId")
        record = cache.get(f"task:{task_id}")
        if record is None:
            error = {"code": -32602, "message": "unknown task"}
            return web.json_response({"jsonrpc": "2.0", "id": message.get("id"), "error": error})
        result = {"taskId": task_id, "status": record.get("status"), "ttl": record.get("ttl_ms")}
        return web.json_response({"jsonrpc": "2.0", "id": message.get("id"), "result": result})

    app = web.Application()
    app.router.add_post("/mcp", answer)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--upstream", help="the upstream's Streamable HTTP URL (pass mode)")
    parser.add_argument("--json", action="store_true", help="the minimal JSON handler instead")
    parser.add_argument("--ids-file", help="JSON list of task ids (json mode)")
    parser.add_argument("--store", help="json mode: read each record from this diskcache directory")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--uvloop", action="store_true", help="run on uvloop instead of asyncio's loop")
    args = parser.parse_args()
    if args.json and args.store:
        app = store_app(args.store)
    elif args.json:
        with open(args.ids_file) as f:
            app = json_app(json.load(f))
    else:
        app = pass_through_app(args.upstream)
    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop if args.uvloop else None) as runner:
            runner.run(serve(app, "127.0.0.1", args.port))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
