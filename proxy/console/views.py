"""Task records as the console shows them (JSON), and the proxy's own metrics for its charts. No I/O.

Principals are shown only as their hash (`principalHash`, 16 hex characters); the raw principal
and the re-run arguments never leave the proxy. Times are epoch milliseconds (`…Ms`).
"""

from __future__ import annotations

import json
from typing import Any

from proxy.runtime import metrics
from proxy.runtime.tracing import trace_id_of
from proxy.tasks.model import TaskRecord, principal_hash

PREVIEW_CHARS = 4000  # characters of a result or error shown in the detail view


def row(record: TaskRecord) -> dict[str, Any]:
    """One list row: taskId, status, statusMessage, server, tool, principalHash, createdMs, lastUpdatedMs,
    version."""
    return {
        "taskId": record.task_id,
        "status": record.status.value,
        "statusMessage": record.status_message,
        "server": record.server,
        "tool": record.tool,
        "principalHash": principal_hash(record.principal),
        "createdMs": record.created_ms,
        "lastUpdatedMs": record.last_updated_ms,
        "version": record.version,
    }


def detail(record: TaskRecord, *, live_here: bool, owner_alive: bool, requests: int = 1) -> dict[str, Any]:
    """The detail view: the row plus method, owner, its liveness, retention, `history`
    (`[{status, atMs}]`), pending `inputRequests`, an `outcome` preview (`{kind: result|error,
    sizeBytes, preview, truncated}`, None while running), `requests`, how many requests the
    task served (1, plus the retries an idempotency key or `dedupe` joined to it), `traceId`,
    the 32-hex OpenTelemetry trace id of the task (None when tracing was off at its detach), and
    `upstreamRequestId`, the JSON-RPC id its request had upstream (the `upstream_request_id` of
    the proxy's log lines and the upstream's own; None on a stdio child or before it was sent)."""
    return {
        **row(record),
        "method": record.method,
        "owner": record.owner,
        "runningHere": live_here,
        "ownerAlive": owner_alive,
        "requests": requests,
        "traceId": trace_id_of(record.trace),
        "upstreamRequestId": (record.upstream_ref or {}).get("requestId"),
        "ttlMs": record.ttl_ms,
        "terminalMs": record.terminal_ms,
        "expiresMs": record.expires_ms,
        "pollIntervalMs": record.poll_interval_ms,
        "history": [{"status": entry.get("status"), "atMs": entry.get("at_ms")} for entry in record.history],
        "inputRequests": dict(record.input_requests),
        "outcome": outcome_preview(record.outcome),
    }


def outcome_preview(outcome: dict[str, Any] | None) -> dict[str, Any] | None:
    """`{kind, sizeBytes, preview, truncated}` of a stored outcome (`{"result": …}` or `{"error": …}`):
    the size is that of its compact JSON in bytes, the preview its first PREVIEW_CHARS characters,
    indented."""
    if not outcome:
        return None
    kind = "result" if "result" in outcome else "error"
    value = outcome.get(kind)
    size = len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode())
    text = json.dumps(value, indent=2, ensure_ascii=False)
    return {
        "kind": kind,
        "sizeBytes": size,
        "preview": text[:PREVIEW_CHARS],
        "truncated": len(text) > PREVIEW_CHARS,
    }


def metrics_snapshot() -> dict[str, Any]:
    """From this process's metrics: `tasksByStatus` (tasks that reached each status, a counter)
    and `detachDelay` (`buckets: [{le (s), count}]` non-cumulative, `count`, `sumS`)."""
    by_status: dict[str, float] = {}
    for family in metrics.TASKS.collect():
        for sample in family.samples:
            if sample.name.endswith("_total"):
                by_status[sample.labels["status"]] = sample.value
    buckets: list[dict[str, Any]] = []
    count = total = previous = 0.0
    for family in metrics.DETACH_LATENCY.collect():
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                buckets.append({"le": sample.labels["le"], "count": sample.value - previous})
                previous = sample.value
            elif sample.name.endswith("_count"):
                count = sample.value
            elif sample.name.endswith("_sum"):
                total = sample.value
    return {"tasksByStatus": by_status, "detachDelay": {"buckets": buckets, "count": count, "sumS": total}}
