"""Task records rendered as the v2 tasks dialect (`io.modelcontextprotocol/tasks`, SEP-2663).

A record keeps what the upstream said (its raw JSON-RPC outcome); this module turns it into the
v2 wire shapes when it is read: the flat `CreateTaskResult` and the `tasks/get` DetailedTask
(protocol.md §1.5). No I/O.
"""

from __future__ import annotations

from typing import Any

from proxy.protocol.jsonrpc import INVALID_PARAMS, JsonObject, JsonRpcError
from proxy.protocol.translate import modern_error, modern_result
from proxy.tasks.model import TaskRecord, TaskStatus, iso, now_ms, reported_ttl_ms


def wire_task(record: TaskRecord, at_ms: int | None = None) -> JsonObject:
    """The v2 `Task` fields: taskId, status, statusMessage?, createdAt, lastUpdatedAt, ttlMs, pollIntervalMs.

    `ttlMs` (ms) makes `createdAt + ttlMs` the task's real expiry at `at_ms` (epoch ms, default now).
    """
    task: JsonObject = {"taskId": record.task_id, "status": record.status.value}
    if record.status_message is not None:
        task["statusMessage"] = record.status_message
    task["createdAt"] = iso(record.created_ms)
    task["lastUpdatedAt"] = iso(record.last_updated_ms)
    task["ttlMs"] = reported_ttl_ms(record, at_ms or now_ms())
    task["pollIntervalMs"] = record.poll_interval_ms
    return task


def create_task_result(record: TaskRecord) -> JsonObject:
    """The flat v2 `CreateTaskResult`: `resultType: "task"` plus the Task fields (ext-tasks
    §CreateTaskResult), as of the record's last update (so a fresh task shows `ttlMs` equal to its
    configured ttl)."""
    return {"resultType": "task", **wire_task(record, record.last_updated_ms)}


def detailed_task(record: TaskRecord) -> JsonObject:
    """The `tasks/get` result: `resultType: "complete"` plus DetailedTask (result / error / inputRequests by
    status)."""
    out: JsonObject = {"resultType": "complete", **wire_task(record)}
    outcome = record.outcome or {}
    if record.status is TaskStatus.COMPLETED and "result" in outcome:
        out["result"] = modern_result(record.method, outcome["result"])
    elif record.status is TaskStatus.FAILED and "error" in outcome:
        out["error"] = modern_error(outcome["error"])
    elif record.status is TaskStatus.INPUT_REQUIRED:
        out["inputRequests"] = dict(record.input_requests)
    return out


def validate_input_responses(responses: Any) -> JsonObject:
    """`inputResponses` must be an object of objects (ElicitResult, CreateMessageResult, ListRootsResult).
    Raises -32602."""
    if not isinstance(responses, dict):
        raise JsonRpcError(INVALID_PARAMS, "inputResponses must be an object keyed by input request key")
    for key, value in responses.items():
        if not isinstance(value, dict):
            raise JsonRpcError(INVALID_PARAMS, f"inputResponses[{key!r}] must be an object")
    return responses
