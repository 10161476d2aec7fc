"""The task record and its status machine, free of storage and I/O.

Spec: ext-tasks (SEP-2663) "Task Status" and the shared diagram in protocol.md §2.1:
working → input_required | completed | failed | cancelled; input_required → working | terminal;
terminal states never change.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any


class TaskStatus(StrEnum):
    """Status of a task (v2 wire values)."""

    WORKING = "working"  # the upstream call is running
    INPUT_REQUIRED = "input_required"  # the upstream asked for input; see `input_requests`
    COMPLETED = "completed"  # the upstream returned a result (also for `isError: true` results)
    FAILED = "failed"  # a JSON-RPC error, an upstream fault, a timeout or a proxy restart ended it
    CANCELLED = "cancelled"  # tasks/cancel was accepted before the call ended

    @property
    def terminal(self) -> bool:
        """True for completed, failed and cancelled."""
        return self in TERMINAL


TERMINAL = frozenset({TaskStatus.COMPLETED, TaskStatus.FAILED, TaskStatus.CANCELLED})

_ALLOWED = {
    TaskStatus.WORKING: {TaskStatus.WORKING, TaskStatus.INPUT_REQUIRED, *TERMINAL},
    TaskStatus.INPUT_REQUIRED: {TaskStatus.WORKING, TaskStatus.INPUT_REQUIRED, *TERMINAL},
}


class TerminalTaskError(Exception):
    """Raised when a change would alter a task that already reached a terminal status."""


def check_transition(current: TaskStatus, new: TaskStatus) -> None:
    """Raise TerminalTaskError unless `current → new` is allowed by the status machine."""
    if new not in _ALLOWED.get(current, set()):
        raise TerminalTaskError(f"task is {current.value}; it cannot become {new.value}")


def new_task_id() -> str:
    """A fresh task id: 256 bits from the OS CSPRNG, URL-safe base64 (43 characters)."""
    return secrets.token_urlsafe(32)


def now_ms() -> int:
    """Wall-clock time in integer milliseconds since the Unix epoch."""
    return int(time.time() * 1000)


def iso(ms: int) -> str:
    """RFC 3339 UTC timestamp with millisecond precision and a `Z`, from epoch milliseconds."""
    return datetime.fromtimestamp(ms / 1000, tz=UTC).strftime("%Y-%m-%dT%H:%M:%S.") + f"{ms % 1000:03d}Z"


@dataclass
class TaskRecord:
    """One task as stored. Times are epoch milliseconds; `ttl_ms` counts from `created_ms`.

    `principal` is who created it (only they may see it); `boot` the proxy boot id that ran the
    upstream call (a different boot means the call died with an earlier process); `result` the
    upstream `CallToolResult` when completed; `error` the JSON-RPC error object when failed;
    `input_requests` the outstanding upstream questions by key (`{method, params}` values);
    `rerun` what is needed to send the call again after a restart (`{method, params,
    capabilities}`), kept only for tools configured `on_restart: rerun` and dropped once terminal.
    """

    task_id: str
    principal: str
    server: str
    tool: str
    created_ms: int
    ttl_ms: int | None
    poll_interval_ms: int
    boot: str
    status: TaskStatus = TaskStatus.WORKING
    status_message: str | None = None
    last_updated_ms: int = 0
    result: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    input_requests: dict[str, Any] = field(default_factory=dict)
    rerun: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self.status = TaskStatus(self.status)
        if not self.last_updated_ms:
            self.last_updated_ms = self.created_ms

    @property
    def expires_ms(self) -> int | None:
        """When the store may forget this task (epoch ms), or None for unlimited retention."""
        return None if self.ttl_ms is None else self.created_ms + self.ttl_ms

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form for storage."""
        data = asdict(self)
        data["status"] = self.status.value
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TaskRecord:
        """Inverse of `to_dict`."""
        return cls(**data)

    def wire_task(self) -> dict[str, Any]:
        """The v2 `Task` fields: taskId, status, statusMessage?, createdAt, lastUpdatedAt, ttlMs, pollIntervalMs."""
        task: dict[str, Any] = {"taskId": self.task_id, "status": self.status.value}
        if self.status_message is not None:
            task["statusMessage"] = self.status_message
        task["createdAt"] = iso(self.created_ms)
        task["lastUpdatedAt"] = iso(self.last_updated_ms)
        task["ttlMs"] = self.ttl_ms
        task["pollIntervalMs"] = self.poll_interval_ms
        return task

    def create_task_result(self) -> dict[str, Any]:
        """The flat v2 `CreateTaskResult`: `resultType: "task"` plus the Task fields (ext-tasks §CreateTaskResult)."""
        return {"resultType": "task", **self.wire_task()}

    def detailed_task(self) -> dict[str, Any]:
        """The `tasks/get` result: `resultType: "complete"` plus DetailedTask (result / error / inputRequests by status)."""
        out: dict[str, Any] = {"resultType": "complete", **self.wire_task()}
        if self.status is TaskStatus.COMPLETED and self.result is not None:
            out["result"] = self.result
        elif self.status is TaskStatus.FAILED and self.error is not None:
            out["error"] = self.error
        elif self.status is TaskStatus.INPUT_REQUIRED:
            out["inputRequests"] = dict(self.input_requests)
        return out
