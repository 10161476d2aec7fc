"""The proxy's Prometheus metrics (prometheus-client, the process-wide default registry).

Served at `/metrics` by the app. Names start with `mcp_tasks_proxy_`; durations are in seconds
(Prometheus convention), sizes in bytes. Every layer counts what it sees here; nothing here does I/O.
"""

from __future__ import annotations

import functools
from typing import Any

from prometheus_client import Counter, Gauge, Histogram

from proxy.runtime import tracing

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1800)

CALLS = Counter(
    "mcp_tasks_proxy_calls_total",
    "tools/call by outcome: sync (answered on the request), detached (became a task), error, joined "
    "(a retry that joined the call its idempotency key or dedupe names)",
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
REPLICA_HOP_SECONDS = Histogram(
    "mcp_tasks_proxy_replica_hop_seconds",
    "Replica-to-replica requests (internal operations), seconds",
    ["op"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
)
UPSTREAM_RESENT = Counter(
    "mcp_tasks_proxy_upstream_resent_total",
    "POSTs safe to send twice sent once more on a fresh connection after a reused one was found closed",
    ["server"],
)
LEGACY_REPLAY_GAPS = Counter(
    "mcp_tasks_proxy_legacy_replay_gaps_total",
    "legacy reply streams that skipped events gone from the replay buffer (a resumption with "
    "Last-Event-ID after them, or a connected client reading too slowly)",
    ["server"],
)
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
REQUESTS_IN_FLIGHT = Gauge(
    "mcp_tasks_proxy_http_requests_in_flight",
    "HTTP requests being answered now, by route kind (a synchronous call, a stream, a poll)",
    ["kind"],
)
UPSTREAM_ERRORS = Counter(
    "mcp_tasks_proxy_upstream_errors_total",
    "tools/call whose upstream answered with a JSON-RPC error or gave no answer (unreachable, broken "
    "session, hard timeout), by server and by how the client learns it: via=request (answered on the "
    "request; a legacy-era call relayed as is counts an HTTP error status too), via=task (a detached "
    "call's outcome); isError results, cancels and unanswered questions are not counted",
    ["server", "via"],
)
STORE_WRITABLE = Gauge(
    "mcp_tasks_proxy_store_writable",
    "1 while the task store takes writes (the last lease renewal or /readyz write probe succeeded), 0 "
    "from a failed store operation until the next write succeeds",
)
STORE_ERRORS = Counter(
    "mcp_tasks_proxy_store_errors_total",
    "task store operations of the task service (lease renewals, sweeps, task writes) that failed: the "
    "store could not be reached, refused a write, or gave no answer within store.timeout",
)
LEASE_SECONDS = Gauge(
    "mcp_tasks_proxy_lease_seconds",
    "how long this node's lease lasts without renewal (store.lease); it is renewed every sixth of it",
)
LEASE_RENEWED = Gauge(
    "mcp_tasks_proxy_lease_renewed_timestamp_seconds",
    "Unix time when this node last renewed its lease in the task store",
)
LEASE_RENEWAL_FAILURES = Counter(
    "mcp_tasks_proxy_lease_renewal_failures_total",
    "renewals of this node's lease that the task store refused or did not answer in time",
)
FENCES = Counter(
    "mcp_tasks_proxy_fences_total",
    "times this replica fenced (the replica_fenced log line): its lease went unrenewed for 2/3 of "
    "store.lease while it ran detached calls of tools configured on_restart: rerun, which it stopped "
    "before another replica re-runs them",
)
FENCED_CALLS = Counter(
    "mcp_tasks_proxy_fenced_calls_total",
    "calls of tasks (detached, or whose task was being created) the fence stopped: cancelled upstream, "
    "nothing recorded, another replica re-runs them",
)
REPLICAS = Gauge(
    "mcp_tasks_proxy_replicas",
    "live replicas on the shared store as this replica sees them at the scrape: itself and every peer "
    "whose registry record has not expired (only with a `replicas` section); `store`: the Redis URL "
    "without credentials and the key prefix",
    ["store"],
)


MAX_TOOL_LABELS = 500  # distinct tool label values per server; more count as `other`
OTHER = "other"
_TOOL_LABELS: dict[str, set[str]] = {}  # server -> tool names that earned a label of their own


def label_value(text: str, limit: int = 256) -> str:
    """`text` fit for a label value: at most `limit` characters, and text that encodes as UTF-8
    (a lone surrogate would make every later scrape fail)."""
    return text[:limit].encode("utf-8", "replace").decode("utf-8")


def tool_label(server: str, tool: str, *, ok: bool) -> str:
    """The `tool` label of a call on `server`: the tool's name once the upstream listed it
    (`listed_tools`) or a call of it got a result that is not an error (`ok`: no JSON-RPC error and
    no `isError`, which is how most SDKs answer a tool they do not have), else `other`, so that
    names a client makes up add no series; at most `MAX_TOOL_LABELS` names per server."""
    known = _TOOL_LABELS.setdefault(server, set())
    name = label_value(tool)
    if name in known:
        return name
    if ok and len(known) < MAX_TOOL_LABELS:
        known.add(name)
        return name
    return OTHER


def listed_tools(server: str, tools: object) -> None:
    """The upstream of `server` listed `tools` (a `tools/list` result's list): their names get labels
    of their own (up to `MAX_TOOL_LABELS`)."""
    known = _TOOL_LABELS.setdefault(server, set())
    for tool in tools if isinstance(tools, list) else []:
        name = tool.get("name") if isinstance(tool, dict) else None
        if isinstance(name, str) and len(known) < MAX_TOOL_LABELS:
            known.add(label_value(name))


def count_call(server: str, tool: str, outcome: str, *, answered: bool = False) -> None:
    """Count one `tools/call` of `tool` on `server` by `outcome` (`sync`, `detached`, `error`, `joined`).
    `answered`: whether the call is known to have got a result that is not an error (`succeeded`);
    only such a call, or the upstream's listing, gives its tool a label of its own."""
    CALLS.labels(server, tool_label(server, tool, ok=answered), outcome).inc()
    tracing.set_outcome(outcome)


def succeeded(reply: object) -> bool:
    """True for a JSON-RPC answer (or a `{"result": …}` outcome) whose result is not an error:
    neither a JSON-RPC error nor a result with `isError: true`."""
    if not isinstance(reply, dict) or "error" in reply:
        return False
    result = reply.get("result")
    return isinstance(result, dict) and result.get("isError") is not True


@functools.lru_cache(maxsize=8)
def requests_in_flight(kind: str) -> Any:
    """The `REQUESTS_IN_FLIGHT` child for `kind`, looked up once (see `request_counter`)."""
    return REQUESTS_IN_FLIGHT.labels(kind)


@functools.lru_cache(maxsize=512)
def request_counter(kind: str, status: int) -> Any:
    """The `REQUESTS` child for (kind, status), looked up once (a label lookup costs ~3 µs a request)."""
    return REQUESTS.labels(kind, str(status))
