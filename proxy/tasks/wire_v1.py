"""Task records rendered as the v1 tasks dialect (2025-11-25 `basic/utilities/tasks`, protocol.md §1.4).

The same record `wire_v2` renders for SEP-2663 clients, shown to a handshake-era client
that declared `capabilities.tasks`: the Task is nested under `task` in `CreateTaskResult`, fields
are `ttl` / `pollInterval` (integers, ms), and a tool result with `isError: true` reads `failed`
(v1 schema comment) where v2 says `completed` (protocol.md §5 item 4). No I/O.
"""

from __future__ import annotations

from typing import Any

from proxy.protocol.era import META_RELATED_TASK
from proxy.protocol.jsonrpc import INTERNAL_ERROR, JsonObject, RequestId, notification, request
from proxy.tasks.model import TaskRecord, TaskStatus
from proxy.tasks.wire_v2 import wire_task

STATUS_NOTIFICATION = "notifications/tasks/status"

# What the proxy declares in its `initialize` result for v1 clients (2025-11-25 ServerCapabilities.tasks).
SERVER_TASKS_CAPABILITY: JsonObject = {"list": {}, "cancel": {}, "requests": {"tools": {"call": {}}}}


def v1_status(record: TaskRecord) -> str:
    """The v1 status of a record: as stored, except a completed `isError: true` tool result is `failed`."""
    outcome = record.outcome or {}
    result = outcome.get("result")
    if record.status is TaskStatus.COMPLETED and isinstance(result, dict) and result.get("isError") is True:
        return TaskStatus.FAILED.value
    return record.status.value


def v1_task(record: TaskRecord, at_ms: int | None = None) -> JsonObject:
    """The v1 `Task`: taskId, status, statusMessage?, createdAt, lastUpdatedAt, ttl (ms or null), pollInterval
    (ms).

    `ttl` makes `createdAt + ttl` the task's real end of retention at `at_ms` (epoch ms, default now).
    """
    task = wire_task(record, at_ms)  # the v2 fields, renamed where v1 names them otherwise
    task["status"] = v1_status(record)
    task["ttl"] = task.pop("ttlMs")
    task["pollInterval"] = task.pop("pollIntervalMs")
    return task


def create_task_result_v1(record: TaskRecord) -> JsonObject:
    """The v1 `CreateTaskResult`: `{task: Task}` as of the record's last update."""
    return {"task": v1_task(record, record.last_updated_ms)}


def related_task_meta(task_id: str) -> JsonObject:
    """The value of `_meta["io.modelcontextprotocol/related-task"]` for `task_id`."""
    return {"taskId": task_id}


def with_related_task(message: JsonObject, task_id: str) -> JsonObject:
    """A copy of a JSON-RPC request or notification with the related-task key in `params._meta`."""
    params = dict(message.get("params") or {})
    params["_meta"] = {**(params.get("_meta") or {}), META_RELATED_TASK: related_task_meta(task_id)}
    return {**message, "params": params}


def question_request(proxy_id: RequestId, key: str, question: JsonObject, task_id: str) -> JsonObject:
    """A task's stored question (`{method, params}`, the 2026-07-28 `inputRequests` value under
    `key`) as the v1 client gets it: a JSON-RPC request under the proxy's `proxy_id`, with the
    related-task key in `params._meta`. A URL-mode elicitation carries `elicitationId` (2025-11-25
    client/elicitation requires it; the stored value has none), which is the input `key`."""
    params = dict(question.get("params") or {})
    if question["method"] == "elicitation/create" and params.get("mode") == "url":
        params.setdefault("elicitationId", key)
    return with_related_task(request(proxy_id, question["method"], params), task_id)


def task_outcome_v1(record: TaskRecord) -> tuple[JsonObject | None, JsonObject | None]:
    """What `tasks/result` answers for a terminal record: `(result, None)` or `(None, error)`.

    A result is the upstream's `CallToolResult` exactly as it came, plus the related-task key in its
    `_meta`; an error is the upstream's JSON-RPC error object exactly as it came (or the proxy's
    own -32603 naming why, e.g. a restart). A cancelled task answers -32603 "task was cancelled"
    (protocol.md §6 leaves it open; -32603 has precedent).
    """
    outcome = record.outcome or {}
    if record.status is TaskStatus.CANCELLED:
        return None, {"code": INTERNAL_ERROR, "message": f"task {record.task_id} was cancelled"}
    if "result" in outcome and isinstance(outcome["result"], dict):
        result = dict(outcome["result"])
        meta = result.get("_meta")
        result["_meta"] = {
            **(meta if isinstance(meta, dict) else {}),
            META_RELATED_TASK: related_task_meta(record.task_id),
        }
        return result, None
    error: Any = outcome.get("error")
    if not isinstance(error, dict):
        error = {
            "code": INTERNAL_ERROR,
            "message": record.status_message or f"task {record.task_id} ended without a result",
        }
    return None, error


def status_notification(record: TaskRecord) -> JsonObject:
    """`notifications/tasks/status` with the full v1 Task as params (no related-task key, per spec)."""
    return notification(STATUS_NOTIFICATION, v1_task(record))


def tool_with_task_support(tool: Any, mode: str) -> Any:
    """A copy of a listed tool with `execution.taskSupport` set from the proxy's `mode`
    (`required`, `forbidden`, else `optional`); other `execution` keys are kept."""
    if not isinstance(tool, dict):
        return tool
    support = mode if mode in ("required", "forbidden") else "optional"
    execution = tool.get("execution")
    return {
        **tool,
        "execution": {**(execution if isinstance(execution, dict) else {}), "taskSupport": support},
    }
