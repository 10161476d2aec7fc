"""Serving a legacy (handshake-era) MCP server built with the official `mcp` SDK.

Shared by the bundled demo server and the test fixture servers: Streamable HTTP at `/mcp` with
stateful sessions (uvicorn), requests naming a non-handshake `MCP-Protocol-Version` refused with
400 (the SDK would otherwise serve 2026-07-28 itself), or stdio. When ready over HTTP, exactly one
line `listening on http://HOST:PORT/mcp` is printed on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import sys
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import Any

import uvicorn
from mcp.server.lowlevel import Server
from mcp.server.transport_security import TransportSecuritySettings
from mcp.types.version import HANDSHAKE_PROTOCOL_VERSIONS
from starlette.types import ASGIApp, Receive, Scope, Send

MCP_PATH = "/mcp"
ServerFactory = Callable[[], Server[Any]]


ToolHandler = Callable[[Any, dict[str, Any]], Awaitable[Any]]


def tool_table(tools: list[Any], handlers: Mapping[str, ToolHandler]) -> dict[str, Any]:
    """`on_list_tools` / `on_call_tool` keyword arguments for an SDK `Server` that lists `tools` and
    runs `handlers[name](ctx, arguments)`; an unknown tool is a JSON-RPC -32602 error."""
    import mcp.types as types
    from mcp.shared.exceptions import MCPError

    async def on_list_tools(ctx: Any, params: Any) -> Any:
        return types.ListToolsResult(tools=tools)

    async def on_call_tool(ctx: Any, params: Any) -> Any:
        handler = handlers.get(params.name)
        if handler is None:
            raise MCPError(code=types.INVALID_PARAMS, message=f"Unknown tool: {params.name}")
        return await handler(ctx, dict(params.arguments or {}))

    return {"on_list_tools": on_list_tools, "on_call_tool": on_call_tool}


class HandshakeOnly:
    """ASGI wrapper: HTTP 400 (JSON-RPC -32600) for any non-handshake `MCP-Protocol-Version`."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            version = next(
                (v.decode("latin-1") for k, v in scope["headers"] if k == b"mcp-protocol-version"), None
            )
            if version is not None and version not in HANDSHAKE_PROTOCOL_VERSIONS:
                error = {"code": -32600, "message": f"Bad Request: Unsupported protocol version: {version}"}
                body = json.dumps({"jsonrpc": "2.0", "id": None, "error": error}).encode()
                headers = [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ]
                await send({"type": "http.response.start", "status": 400, "headers": headers})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


def build_asgi_app(
    server_factory: ServerFactory,
    *,
    handshake_only: bool = True,
    json_response: bool = False,
    event_store: Any = None,
    retry_interval: int | None = None,
) -> ASGIApp:
    """A fresh ASGI app for the server `server_factory()` builds (its lifespan must run).

    `event_store` (an SDK `EventStore`) and `retry_interval` (ms) turn on SSE priming events,
    `retry:` and `Last-Event-ID` resumption. Host/Origin checks are off (a proxy forwards its own).
    """
    app = server_factory().streamable_http_app(
        streamable_http_path=MCP_PATH,
        json_response=json_response,
        stateless_http=False,
        event_store=event_store,
        retry_interval=retry_interval,
        transport_security=TransportSecuritySettings(enable_dns_rebinding_protection=False),
    )
    return HandshakeOnly(app) if handshake_only else app


class _Uvicorn(uvicorn.Server):
    """uvicorn server that installs no signal handlers of its own."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def serve_http(
    server_factory: ServerFactory,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    keep_alive_s: float = 5.0,
    **app_kwargs: Any,
) -> None:
    """Serve over Streamable HTTP until cancelled; print `listening on URL` once accepting (`port` 0: any free
    one). `keep_alive_s` (s): how long an idle connection stays open (uvicorn's default, 5 s)."""
    # IPPROTO_TCP explicitly: asyncio then sets TCP_NODELAY (else
    # each SSE reply waits ~40 ms for a delayed ACK).
    sock = socket.socket(
        socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP
    )
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    sock.setblocking(False)
    config = uvicorn.Config(
        build_asgi_app(server_factory, **app_kwargs),
        log_level="warning",
        access_log=False,
        lifespan="on",
        timeout_keep_alive=keep_alive_s,  # type: ignore[arg-type]  # uvicorn takes fractions too
    )
    server = _Uvicorn(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            if task.done():
                task.result()
                raise RuntimeError("the server exited during startup")
            await asyncio.sleep(0.01)
        shown = f"[{host}]" if ":" in host else host
        print(f"listening on http://{shown}:{sock.getsockname()[1]}{MCP_PATH}", flush=True)
        await task
    finally:
        server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, timeout=5)
        sock.close()


async def serve_stdio(server_factory: ServerFactory) -> None:
    """Serve over stdin/stdout (newline-delimited JSON-RPC)."""
    from mcp.server.stdio import stdio_server

    server = server_factory()
    if os.environ.get("FIXTURE_STDOUT_GARBAGE"):
        # Test hook: a badly behaved server writes lines that are not JSON-RPC before any protocol traffic.
        os.write(1, b'this line is not JSON-RPC\n{"jsonrpc": "1.0"}\n[1, 2, 3]\n')
    async with stdio_server() as (read_stream, write_stream):
        await server.run(read_stream, write_stream, server.create_initialization_options())


def run_cli(
    argv: list[str] | None,
    server_factory: ServerFactory,
    *,
    description: str,
    default_port: int = 0,
    app_kwargs: dict[str, Any] | None = None,
) -> None:
    """Command line of a legacy server: `--host`, `--port` (0: a free one), `--stdio`, `--json-response`,
    `--keep-alive` (s)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=default_port, help="0 = pick a free port (printed)")
    parser.add_argument("--stdio", action="store_true", help="serve over stdin/stdout instead of HTTP")
    parser.add_argument(
        "--json-response",
        action="store_true",
        help="answer POSTs with JSON instead of SSE (no progress or elicitation)",
    )
    parser.add_argument(
        "--keep-alive",
        type=float,
        default=5.0,
        help="seconds an idle HTTP connection stays open (uvicorn: 5)",
    )
    args = parser.parse_args(argv)
    try:
        if args.stdio:
            asyncio.run(serve_stdio(server_factory))
        else:
            asyncio.run(
                serve_http(
                    server_factory,
                    args.host,
                    args.port,
                    json_response=args.json_response,
                    keep_alive_s=args.keep_alive,
                    **(app_kwargs or {}),
                )
            )
    except KeyboardInterrupt:
        pass
    except OSError as exc:
        print(f"{description}: {exc}", file=sys.stderr)
        raise SystemExit(1) from exc
