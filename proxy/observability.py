"""Metrics (prometheus-client) and request logging (structlog with contextvars).

Metrics are process-wide (the default registry) and served at `/metrics`. Names start with
`mcp_tasks_proxy_`; durations are in seconds (Prometheus convention), sizes in bytes.
Logs: one line per HTTP request (request id, JSON-RPC method, server, tool, principal hash,
status, duration in ms) and one per task transition (see `TaskService._observe`). Payloads and
secrets are never logged unless `logging.log_payloads: true`.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
import secrets
import time
from typing import Any

import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, Counter, Gauge, Histogram, generate_latest

log = structlog.get_logger("proxy.access")
ARRIVED_KEY = web.RequestKey("arrived", float)  # event-loop time (s) the request reached the proxy

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1800)

CALLS = Counter(
    "mcp_tasks_proxy_calls_total",
    "tools/call by outcome: sync (answered on the request), detached (became a task), error",
    ["server", "tool", "outcome"],
)
DETACH_LATENCY = Histogram(
    "mcp_tasks_proxy_detach_latency_seconds",
    "from detach_after expiring to the CreateTaskResult being handed to the transport",
    buckets=_LATENCY_BUCKETS,
)
UPSTREAM_LATENCY = Histogram(
    "mcp_tasks_proxy_upstream_latency_seconds",
    "upstream request duration until its response",
    ["server", "method"],
    buckets=_LATENCY_BUCKETS,
)
TASKS = Counter("mcp_tasks_proxy_tasks_total", "tasks reaching each status (created = working)", ["status"])
LIVE_TASKS = Gauge("mcp_tasks_proxy_live_tasks", "detached calls running in this process")
TASK_AGE = Histogram(
    "mcp_tasks_proxy_task_age_seconds",
    "task age when it reached a terminal status",
    ["status"],
    buckets=_LATENCY_BUCKETS,
)
INPUT_WAIT = Histogram(
    "mcp_tasks_proxy_input_wait_seconds",
    "time an upstream question waited for its answer",
    buckets=_LATENCY_BUCKETS,
)
ORPHANED = Counter(
    "mcp_tasks_proxy_tasks_orphaned_total",
    "tasks whose upstream call died with an earlier proxy process, by fate",
    ["fate"],
)
STORE_TASKS = Gauge(
    "mcp_tasks_proxy_store_tasks", "task records in the store (expired ones count until purged)"
)
STORE_BYTES = Gauge("mcp_tasks_proxy_store_bytes", "size of the task store on disk")
LIMIT_REJECTIONS = Counter(
    "mcp_tasks_proxy_limit_rejections_total", "requests refused by a configured limit", ["limit"]
)
UPSTREAM_PROCESSES = Counter(
    "mcp_tasks_proxy_upstream_processes_total",
    "stdio upstream child processes by event: started, start_failed, exited, crash_loop",
    ["server", "event"],
)
REQUESTS = Counter(
    "mcp_tasks_proxy_http_requests_total", "HTTP requests by route kind and status", ["kind", "status"]
)


@functools.lru_cache(maxsize=512)
def _request_counter(kind: str, status: int) -> Any:
    """The `REQUESTS` child for (kind, status), looked up once (a label lookup costs ~3 µs a request)."""
    return REQUESTS.labels(kind, str(status))


CLIENT_CLOSED = 499  # the status recorded (never sent) when the client went away before the answer


async def metrics_handler(request: web.Request) -> web.Response:
    """`/metrics` in the Prometheus text format; with `metrics.token` configured only for
    `Authorization: Bearer <token>` (401 with a JSON-RPC error otherwise)."""
    from .app import CONFIG_KEY, TASKS_KEY  # the app module imports this one

    expected = request.app[CONFIG_KEY].metrics.token
    if expected is not None:
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        digest = hashlib.sha256(token.strip().encode()).hexdigest()
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            digest, expected.removeprefix("sha256:").lower()
        ):
            log.warning(
                "security_auth_failed",
                reason="metrics token missing or wrong",
                remote=request.remote,
                path=request.path,
            )
            body = {
                "jsonrpc": "2.0",
                "id": None,
                "error": {
                    "code": -32600,
                    "message": "authentication required: /metrics needs its bearer token",
                },
            }
            return web.json_response(
                body, status=401, headers={"WWW-Authenticate": 'Bearer realm="mcp-tasks-proxy metrics"'}
            )
    tasks = request.app[TASKS_KEY]
    try:
        STORE_TASKS.set(await tasks.store.count())
        STORE_BYTES.set(await tasks.store.volume())
    except Exception:  # a store fault must not hide the other metrics
        log.warning("store_metrics_unavailable")
    LIVE_TASKS.set(len(tasks.live))
    return web.Response(body=generate_latest(REGISTRY), headers={"Content-Type": CONTENT_TYPE_LATEST})


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
            return web.json_response(body, status=exc.status, headers=headers)
        except Exception:
            log.exception("unhandled_error", path=request.path)
            body = {
                "jsonrpc": "2.0",
                "id": None,
                "error": {"code": -32603, "message": "internal proxy error; see the proxy log"},
            }
            return web.json_response(body, status=500)

    return middleware


def access_log(*, payloads: bool):
    """Middleware: bind a request id (and, once known, era, JSON-RPC method, server, tool and task
    id) to the log context and write one line per request with its status and duration in ms.

    A client that goes away before its answer is logged as `client_disconnected` and counted with
    status 499 (never 500)."""

    @web.middleware
    async def middleware(request: web.Request, handler):
        if request.path in ("/healthz", "/readyz", "/metrics"):
            return await handler(request)
        structlog.contextvars.clear_contextvars()
        structlog.contextvars.bind_contextvars(request_id=secrets.token_hex(8))
        started = time.perf_counter()
        request[ARRIVED_KEY] = asyncio.get_running_loop().time()  # a call's detach clock starts here
        status = 500
        event = "request"
        try:
            if payloads and request.can_read_body:
                log.info("request_payload", body=(await request.text())[:65536])
            response = await handler(request)
            status = response.status
            return response
        except web.HTTPException as exc:
            status = exc.status
            raise
        except (asyncio.CancelledError, ConnectionResetError):
            status, event = CLIENT_CLOSED, "client_disconnected"
            raise
        finally:
            _request_counter("console" if request.path.startswith("/console") else "mcp", status).inc()
            log.info(
                event,
                http_method=request.method,
                path=request.path,
                status=status,
                duration_ms=round((time.perf_counter() - started) * 1000, 2),
            )
            structlog.contextvars.clear_contextvars()

    return middleware
