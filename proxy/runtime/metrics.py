"""The proxy's Prometheus metrics (prometheus-client, the process-wide default registry).

Served at `/metrics` by the app. Names start with `mcp_tasks_proxy_`; durations are in seconds
(Prometheus convention), sizes in bytes. Every layer counts what it sees here; nothing here does I/O.
"""

from __future__ import annotations

import functools
from typing import Any

from prometheus_client import Counter, Gauge, Histogram

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
def request_counter(kind: str, status: int) -> Any:
    """The `REQUESTS` child for (kind, status), looked up once (a label lookup costs ~3 µs a request)."""
    return REQUESTS.labels(kind, str(status))
