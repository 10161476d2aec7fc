"""The front's own middlewares: JSON-RPC errors for whatever fails outside a handler, and the
access log (structlog with contextvars: one line per request with its request id, JSON-RPC method,
server, tool, principal hash, status and duration in ms; payloads and secrets never: with
`logging.log_payloads: true` the MCP endpoint logs the bodies it has read within its bounds)."""

from __future__ import annotations

import asyncio
import secrets
import time

import structlog
from aiohttp import web

from proxy.protocol import jsonrpc
from proxy.replicas.internal import PREFIX as REPLICA_PREFIX
from proxy.runtime import metrics
from proxy.runtime.drain import Drain
from proxy.runtime.running import RunningRequests

log = structlog.get_logger("proxy.access")
ARRIVED_KEY = web.RequestKey("arrived", float)  # event-loop time (s) the request reached the proxy
REQUEST_ID_KEY = web.RequestKey("request_id", str)  # the proxy's id of the request, in its log lines
MAX_CLIENT_REQUEST_ID = 128  # longest client `X-Request-Id` logged (characters)

# probes, scrapes and the console's poll of each peer replica: no access line, no request metrics
UNLOGGED_PATHS = frozenset({"/healthz", "/readyz", "/metrics", f"{REPLICA_PREFIX}/running"})
CLIENT_CLOSED = 499  # the status recorded (never sent) when the client went away before the answer


def json_errors():
    """Middleware: whatever goes wrong outside a JSON-RPC handler (unknown path, wrong HTTP method,
    an unexpected exception) still answers with a JSON-RPC error body, never a plain-text page."""

    @web.middleware
    async def middleware(request: web.Request, handler):
        try:
            return await handler(request)
        except (ConnectionResetError, asyncio.CancelledError):
            raise  # the client went away: nothing to answer, and not a fault of the proxy
        except web.HTTPException as exc:
            if exc.status < 400 or exc.content_type == "application/json":
                raise
            code = -32601 if exc.status == 404 else -32600
            body = {
                "jsonrpc": "2.0",
                "id": None,
                "error": {
                    "code": code,
                    "message": f"{exc.status} {exc.reason}: {request.method} {request.path}",
                },
            }
            headers = {k: v for k, v in exc.headers.items() if k.lower() in ("allow", "www-authenticate")}
            return web.json_response(body, status=exc.status, headers=headers, dumps=jsonrpc.dumps_str)
        except Exception:
            log.exception("unhandled_error", path=request.path)
            body = {
                "jsonrpc": "2.0",
                "id": None,
                "error": {"code": -32603, "message": "internal proxy error; see the proxy log"},
            }
            return web.json_response(body, status=500, dumps=jsonrpc.dumps_str)

    return middleware


def access_log(drain: Drain | None = None, running: RunningRequests | None = None):
    """Middleware: bind a request id (and, once known, era, JSON-RPC method, server, tool, task id
    and the upstream's request id) to the log context and write one line per request with its
    status and duration in ms. While the request is answered it is listed in `running` (the
    console's "Running now"), with the same identifiers. The request id goes back to the client
    as `X-Request-Id` (`request_id_header`); a client's own `X-Request-Id` (printable ASCII, at
    most MAX_CLIENT_REQUEST_ID characters) is logged beside it as `client_request_id`, never used
    as ours. `mcp_tasks_proxy_http_requests_in_flight{kind}` counts the requests being answered.

    A client that goes away before its answer is logged as `client_disconnected` and counted with
    status 499 (never 500); a request the proxy itself cut at the end of `drain` (`Drain.cutting`:
    a stream, or a call stuck past it) is logged as `request_cut_at_shutdown`, counted the same way."""

    for kind in ("mcp", "console"):  # each series exists from the start, at 0
        metrics.requests_in_flight(kind)

    @web.middleware
    async def middleware(request: web.Request, handler):
        if request.path in UNLOGGED_PATHS:
            return await handler(request)
        structlog.contextvars.clear_contextvars()
        request_id = secrets.token_hex(8)
        request[REQUEST_ID_KEY] = request_id
        fields = {"request_id": request_id}
        theirs = request.headers.get("X-Request-Id")
        if theirs and len(theirs) <= MAX_CLIENT_REQUEST_ID and theirs.isascii() and theirs.isprintable():
            fields["client_request_id"] = theirs
        structlog.contextvars.bind_contextvars(**fields)
        kind = "console" if request.path.startswith("/console") else "mcp"
        in_flight = metrics.requests_in_flight(kind)
        in_flight.inc()
        started = time.perf_counter()
        request[ARRIVED_KEY] = asyncio.get_running_loop().time()  # a call's detach clock starts here
        status = 500
        event = "request"
        entry = running.begin(request.method, fields) if running is not None and kind == "mcp" else None
        try:
            response = await handler(request)
            status = response.status
            return response
        except web.HTTPException as exc:
            status = exc.status
            raise
        except (asyncio.CancelledError, ConnectionResetError):
            cut = drain is not None and drain.cut_at_shutdown(asyncio.current_task())
            status, event = CLIENT_CLOSED, "request_cut_at_shutdown" if cut else "client_disconnected"
            raise
        finally:
            if entry is not None and running is not None:
                running.end(entry)
            in_flight.dec()
            metrics.request_counter(kind, status).inc()
            log.info(
                event,
                http_method=request.method,
                path=request.path,
                status=status,
                duration_ms=round((time.perf_counter() - started) * 1000, 2),
            )
            structlog.contextvars.clear_contextvars()

    return middleware


async def request_id_header(request: web.Request, response: web.StreamResponse) -> None:
    """`on_response_prepare` hook: the proxy's request id (`access_log`'s) as `X-Request-Id` on
    the response, JSON or SSE alike, so a client can name the request to an operator."""
    request_id = request.get(REQUEST_ID_KEY)
    if request_id is not None:
        response.headers["X-Request-Id"] = request_id
