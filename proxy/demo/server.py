"""Bundled demo *legacy* MCP server (handshake era only).

Speaks Streamable HTTP at ``/mcp`` with ``initialize`` + ``Mcp-Session-Id``
(stateful sessions, SSE responses), built on the official ``mcp`` SDK's
low-level :class:`mcp.server.lowlevel.Server`.  It deliberately refuses the
2026-07-28 per-request wire (``MCP-Protocol-Version: 2026-07-28`` gets a 400),
so it behaves like a server written before that revision.

Tools:
    slow_report(seconds=5, steps=5)   long-running, emits notifications/progress
    flaky_job()                        fails with a JSON-RPC error after ~0.5 s
    approve_deploy(service)            asks the client via elicitation/create
    echo(text)                         returns text at once

Run:  python -m proxy.demo.server --host 127.0.0.1 --port 9001
Prints exactly one line on stdout once accepting connections:
    listening on http://127.0.0.1:9001/mcp
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
import sys
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import mcp.types as types
import uvicorn
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel import Server
from mcp.server.transport_security import TransportSecuritySettings
from mcp.shared.exceptions import MCPError
from mcp.types.version import HANDSHAKE_PROTOCOL_VERSIONS
from starlette.types import ASGIApp, Receive, Scope, Send

MCP_PATH = "/mcp"
SERVER_NAME = "demo-legacy-server"

_STEP_NAMES = ["fetching sources", "compiling", "running tests", "packaging", "uploading", "summarising"]


def _tool(name: str, description: str, properties: dict[str, Any], required: list[str] | None = None) -> types.Tool:
    schema: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        schema["required"] = required
    return types.Tool(name=name, description=description, input_schema=schema)


TOOLS: list[types.Tool] = [
    _tool(
        "slow_report",
        "Builds a report slowly, reporting progress for each step.",
        {
            "seconds": {"type": "number", "default": 5, "description": "total run time in seconds"},
            "steps": {"type": "integer", "default": 5, "description": "number of progress steps"},
        },
    ),
    _tool("flaky_job", "Always fails after ~0.5 s with a JSON-RPC error.", {}),
    _tool(
        "approve_deploy",
        "Asks the user (elicitation) whether to deploy a service to production.",
        {"service": {"type": "string", "description": "service to deploy"}},
        ["service"],
    ),
    _tool("echo", "Returns the given text.", {"text": {"type": "string"}}, ["text"]),
]


def _text(text: str, *, is_error: bool = False) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(type="text", text=text)], is_error=is_error)


def _num(args: dict[str, Any], key: str, default: float) -> float:
    value = args.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise MCPError(code=types.INVALID_PARAMS, message=f"argument {key!r} must be a number")
    return float(value)


async def _slow_report(ctx: ServerRequestContext[Any], args: dict[str, Any]) -> types.CallToolResult:
    seconds = max(0.0, _num(args, "seconds", 5))
    steps = max(1, int(_num(args, "steps", 5)))
    for i in range(1, steps + 1):
        await asyncio.sleep(seconds / steps)
        name = _STEP_NAMES[(i - 1) % len(_STEP_NAMES)]
        # No-op unless the request carried _meta.progressToken.
        await ctx.session.report_progress(i, steps, f"step {i}/{steps}: {name}")
    return _text(f"report ready after {seconds:g} s")


async def _flaky_job(ctx: ServerRequestContext[Any], args: dict[str, Any]) -> types.CallToolResult:
    await asyncio.sleep(0.5)
    # Raising MCPError makes the SDK answer with a JSON-RPC *error* response
    # (not a CallToolResult with isError). Any other exception would be sent
    # as a JSON-RPC error with code 0.
    raise MCPError(code=types.INTERNAL_ERROR, message="flaky_job: the build farm is on fire")


async def _approve_deploy(ctx: ServerRequestContext[Any], args: dict[str, Any]) -> types.CallToolResult:
    service = args.get("service")
    if not isinstance(service, str):
        raise MCPError(code=types.INVALID_PARAMS, message="argument 'service' (string) is required")
    answer = await ctx.session.elicit_form(
        f"Deploy {service} to production?",
        {
            "type": "object",
            "properties": {"confirm": {"type": "boolean", "title": "Confirm", "description": "Deploy now?"}},
            "required": ["confirm"],
        },
        # Route the elicitation/create onto this tools/call's SSE response stream.
        related_request_id=ctx.request_id,
    )
    if answer.action == "accept" and (answer.content or {}).get("confirm") is True:
        return _text(f"deploy of {service} approved")
    return _text(f"deploy of {service} declined ({answer.action})")


async def _echo(ctx: ServerRequestContext[Any], args: dict[str, Any]) -> types.CallToolResult:
    text = args.get("text")
    if not isinstance(text, str):
        raise MCPError(code=types.INVALID_PARAMS, message="argument 'text' (string) is required")
    return _text(text)


_HANDLERS = {
    "slow_report": _slow_report,
    "flaky_job": _flaky_job,
    "approve_deploy": _approve_deploy,
    "echo": _echo,
}


async def _list_tools(ctx: ServerRequestContext[Any], params: types.PaginatedRequestParams | None) -> types.ListToolsResult:
    return types.ListToolsResult(tools=TOOLS)


async def _call_tool(ctx: ServerRequestContext[Any], params: types.CallToolRequestParams) -> types.CallToolResult:
    handler = _HANDLERS.get(params.name)
    if handler is None:
        raise MCPError(code=types.INVALID_PARAMS, message=f"Unknown tool: {params.name}")
    return await handler(ctx, dict(params.arguments or {}))


def build_server() -> Server[Any]:
    """The low-level SDK server object (transport-agnostic)."""
    server: Server[Any] = Server(SERVER_NAME, version="1.0.0", on_list_tools=_list_tools, on_call_tool=_call_tool)
    return server


class HandshakeOnly:
    """ASGI wrapper refusing the 2026-07-28 wire.

    The SDK's session manager routes any request whose ``MCP-Protocol-Version``
    header is not a handshake-era version to its modern single-exchange entry.
    A real pre-2026 server answers such requests with 400 (spec 2025-06-18,
    "Protocol Version Header"), which this wrapper reproduces.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            pv = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"mcp-protocol-version"), None)
            if pv is not None and pv not in HANDSHAKE_PROTOCOL_VERSIONS:
                body = (
                    b'{"jsonrpc":"2.0","id":null,"error":{"code":-32600,'
                    b'"message":"Bad Request: Unsupported protocol version: ' + pv.encode("latin-1", "replace") + b'"}}'
                )
                await send(
                    {
                        "type": "http.response.start",
                        "status": 400,
                        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
                    }
                )
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


def build_app(*, handshake_only: bool = True, json_response: bool = False) -> ASGIApp:
    """A fresh Starlette ASGI app serving the demo at ``/mcp`` (stateful, SSE).

    Each call builds a new SDK session manager (they are single-use). The app's
    lifespan must run (uvicorn does this), otherwise requests fail.
    """
    app = build_server().streamable_http_app(
        streamable_http_path=MCP_PATH,
        json_response=json_response,
        stateless_http=False,
        # Proxies forward arbitrary Host/Origin headers; don't apply the SDK's
        # localhost DNS-rebinding allow-list.
        transport_security=TransportSecuritySettings(enable_dns_rebinding_protection=False),
    )
    return HandshakeOnly(app) if handshake_only else app


# --------------------------------------------------------------------------- serving


class _Uvicorn(uvicorn.Server):
    """uvicorn server that never installs signal handlers (safe in-process / in threads)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    sock.setblocking(False)
    return sock


def _url(host: str, port: int) -> str:
    h = f"[{host}]" if ":" in host else host
    return f"http://{h}:{port}{MCP_PATH}"


@contextlib.asynccontextmanager
async def running(host: str = "127.0.0.1", port: int = 0, **app_kwargs: Any) -> AsyncIterator[str]:
    """Run the demo server inside the current event loop; yields its ``/mcp`` URL.

    ``port=0`` picks a free port. The server is accepting when the URL is yielded.
    """
    sock = _bind(host, port)
    actual_port = sock.getsockname()[1]
    config = uvicorn.Config(build_app(**app_kwargs), log_level="warning", access_log=False, lifespan="on")
    server = _Uvicorn(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            if task.done():
                task.result()  # re-raise startup failure
                raise RuntimeError("demo server exited during startup")
            await asyncio.sleep(0.01)
        yield _url(host, actual_port)
    finally:
        server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, timeout=5)
        sock.close()


def start_in_thread(host: str = "127.0.0.1", port: int = 0, **app_kwargs: Any) -> tuple[str, Callable[[], None]]:
    """Start the demo server on a background thread; returns ``(url, stop)``."""
    ready = threading.Event()
    stop_evt: dict[str, Any] = {}
    url_box: list[str] = []
    errors: list[BaseException] = []

    async def main() -> None:
        stop_evt["loop"] = asyncio.get_running_loop()
        stop_evt["event"] = asyncio.Event()
        async with running(host, port, **app_kwargs) as url:
            url_box.append(url)
            ready.set()
            await stop_evt["event"].wait()

    def runner() -> None:
        try:
            asyncio.run(main())
        except BaseException as exc:  # pragma: no cover - surfaced to caller
            errors.append(exc)
        finally:
            ready.set()

    thread = threading.Thread(target=runner, name="demo-legacy-mcp", daemon=True)
    thread.start()
    ready.wait(timeout=10)
    if errors or not url_box:
        raise RuntimeError(f"demo server failed to start: {errors!r}")

    def stop() -> None:
        loop = stop_evt.get("loop")
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(stop_evt["event"].set)
        thread.join(timeout=10)

    return url_box[0], stop


async def serve_async(host: str = "127.0.0.1", port: int = 9001, **app_kwargs: Any) -> None:
    """Serve forever in the current loop; prints one ``listening on URL`` line."""
    async with running(host, port, **app_kwargs) as url:
        print(f"listening on {url}", flush=True)
        await asyncio.Event().wait()


def serve(host: str = "127.0.0.1", port: int = 9001, **app_kwargs: Any) -> None:
    """Blocking entry point (used by ``python -m proxy.demo.server``)."""
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve_async(host, port, **app_kwargs))


async def serve_stdio() -> None:
    """Serve the demo over stdin/stdout (newline-delimited JSON-RPC)."""
    from mcp.server.stdio import stdio_server

    server = build_server()
    async with stdio_server() as (read_stream, write_stream):
        await server.run(read_stream, write_stream, server.create_initialization_options())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Demo legacy (handshake-era) MCP server")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9001, help="0 = pick a free port (printed)")
    parser.add_argument("--json-response", action="store_true", help="answer POSTs with JSON instead of SSE")
    parser.add_argument("--stdio", action="store_true", help="serve over stdin/stdout instead of HTTP")
    args = parser.parse_args(argv)
    if args.stdio:
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(serve_stdio())
        return
    try:
        serve(args.host, args.port, json_response=args.json_response)
    except OSError as exc:
        print(f"demo server: {exc}", file=sys.stderr)
        raise SystemExit(1) from exc


if __name__ == "__main__":
    main()
