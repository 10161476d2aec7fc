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

import asyncio
from typing import Any

import mcp.types as types
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel import Server
from mcp.shared.exceptions import MCPError
from starlette.types import ASGIApp

from proxy.demo.serving import build_asgi_app, run_cli, tool_table

MCP_PATH = "/mcp"
SERVER_NAME = "demo-legacy-server"

_STEP_NAMES = ["fetching sources", "compiling", "running tests", "packaging", "uploading", "summarising"]


def _tool(
    name: str, description: str, properties: dict[str, Any], required: list[str] | None = None
) -> types.Tool:
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


def build_server() -> Server[Any]:
    """The low-level SDK server object (transport-agnostic)."""
    server: Server[Any] = Server(SERVER_NAME, version="1.0.0", **tool_table(TOOLS, _HANDLERS))
    return server


def build_app(**app_kwargs: Any) -> ASGIApp:
    """A fresh ASGI app serving the demo (options: `proxy.demo.serving.build_asgi_app`)."""
    return build_asgi_app(build_server, **app_kwargs)


def main(argv: list[str] | None = None) -> None:
    """`python -m proxy.demo.server [--host H] [--port P] [--stdio]`: serve the demo (default port 9001)."""
    run_cli(argv, build_server, description="Demo legacy (handshake-era) MCP server", default_port=9001)


if __name__ == "__main__":
    main()
