"""The proxy's own `tasks/get`, `tasks/update` and `tasks/cancel` (ext-tasks SEP-2663, protocol.md §1.5.3-1.5.5).

Capability gating comes before any lookup (-32021); unknown, expired, foreign-principal and
other-server ids all get the same -32602, so a task's existence never leaks.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Any

import limits as limits_lib
from limits.storage import MemoryStorage
from limits.strategies import MovingWindowRateLimiter

import structlog

from ..calls import Call
from ..mrtr import validate_input_responses
from ..protocol.era import TASKS_EXTENSION, Envelope
from ..protocol.jsonrpc import (
    INTERNAL_ERROR,
    INVALID_PARAMS,
    MISSING_REQUIRED_CLIENT_CAPABILITY,
    JsonObject,
    JsonRpcError,
)
from .. import observability as obs
from ..auth import principal_hash
from ..config import LimitsConfig
from ..protocol.jsonrpc import limit_error
from .model import TaskRecord, TaskStatus, TerminalTaskError, new_task_id, now_ms
from .store import TaskNotFoundError, TaskStore

log = structlog.get_logger("proxy.tasks")

ACK: JsonObject = {"resultType": "complete"}
RESTART_MESSAGE = "the proxy restarted while this call was running; the upstream call was lost"
SHUTDOWN_MESSAGE = "the proxy shut down while this call was running; the upstream call was abandoned"


def require_tasks_extension(envelope: Envelope, what: str) -> None:
    """Raise -32021 (with `data.requiredCapabilities`) unless the request declared the tasks extension."""
    if not envelope.declares_tasks:
        raise JsonRpcError(
            MISSING_REQUIRED_CLIENT_CAPABILITY,
            f"{what} needs the {TASKS_EXTENSION} extension declared in this request's client capabilities",
            {"requiredCapabilities": {"extensions": {TASKS_EXTENSION: {}}}},
        )


class TaskService:
    """Owns the store and the live detached calls of this proxy process.

    `boot` identifies this process: a non-terminal task written by another boot lost its upstream
    call with that process and is reported `failed` when next read.
    """

    def __init__(self, store: TaskStore, limits: LimitsConfig | None = None) -> None:
        self.store = store
        self.boot = secrets.token_hex(8)
        self.live: dict[str, Call] = {}
        self.limits = limits or LimitsConfig()
        self._rate = limits_lib.parse(self.limits.tasks_rate) if self.limits.tasks_rate else None
        self._limiter = MovingWindowRateLimiter(MemoryStorage()) if self._rate else None

    # -- creation ----------------------------------------------------------------------------

    def check_capacity(self, principal: str) -> None:
        """Raise a limit error (HTTP 429) when `principal` already has `max_tasks_per_principal` live tasks."""
        cap = self.limits.max_tasks_per_principal
        if cap is not None and sum(1 for c in self.live.values() if c.principal == principal) >= cap:
            log.warning("limit_refused", limit="max_tasks_per_principal", principal=principal_hash(principal))
            obs.LIMIT_REJECTIONS.labels("max_tasks_per_principal").inc()
            raise limit_error("max_tasks_per_principal", f"this principal already has {cap} running tasks", max=cap)

    def detach(
        self, call: Call, *, principal: str, ttl_s: float, poll_interval_s: float, status_message: str, rerun: bool = False
    ) -> TaskRecord:
        """Commit a task for a running call, hand the call over to it, and return the record.

        The record is on disk before this returns (the caller then sends the CreateTaskResult).
        With `rerun`, what is needed to send the call again after a restart is stored with it.
        Raises a limit error when the principal has too many live tasks (the caller cancels the call).
        """
        self.check_capacity(principal)
        record = TaskRecord(
            task_id=new_task_id(),
            principal=principal,
            server=call.server,
            tool=call.tool,
            created_ms=now_ms(),
            ttl_ms=int(ttl_s * 1000),
            poll_interval_ms=max(1, int(poll_interval_s * 1000)),
            boot=self.boot,
            status_message=status_message,
            rerun={"method": call.method, "params": call.params, "capabilities": call.capabilities} if rerun else None,
        )
        self.store.create(record)
        self.live[record.task_id] = call
        call.add_done_callback(lambda c: self.live.pop(record.task_id, None))
        call.detach(record.task_id)
        log.info("task_created", task_id=record.task_id, server=call.server, tool=call.tool)
        return record

    # -- lookups -----------------------------------------------------------------------------

    def _lookup(self, params: Any, *, principal: str, server: str) -> TaskRecord:
        task_id = params.get("taskId") if isinstance(params, dict) else None
        if not isinstance(task_id, str) or not task_id:
            raise JsonRpcError(INVALID_PARAMS, "params.taskId must be a non-empty string")
        record = self.store.get(task_id)
        if record is None or record.principal != principal or record.server != server:
            if record is not None:
                log.warning("security_foreign_task_access", task_id=task_id, server=server, principal=principal_hash(principal))
            raise JsonRpcError(INVALID_PARAMS, f"unknown or expired task: {task_id}")
        if not record.status.terminal and record.boot != self.boot and task_id not in self.live:
            record = self._fail_orphan(record)
        return record

    def _fail_orphan(self, record: TaskRecord) -> TaskRecord:
        obs.ORPHANED.labels("failed").inc()
        try:
            return self.store.update(
                record.task_id,
                status=TaskStatus.FAILED,
                status_message=RESTART_MESSAGE,
                error={"code": INTERNAL_ERROR, "message": RESTART_MESSAGE},
                input_requests={},
            )
        except (TerminalTaskError, TaskNotFoundError):
            return self.store.get(record.task_id) or record

    # -- methods -----------------------------------------------------------------------------

    def _check_rate(self, principal: str) -> None:
        if self._limiter is not None and self._rate is not None and not self._limiter.hit(self._rate, principal):
            log.warning("limit_refused", limit="tasks_rate", principal=principal_hash(principal))
            obs.LIMIT_REJECTIONS.labels("tasks_rate").inc()
            raise limit_error("tasks_rate", f"more than {self.limits.tasks_rate} tasks/* calls", rate=self.limits.tasks_rate)

    def get(self, params: Any, envelope: Envelope, *, principal: str, server: str) -> JsonObject:
        """`tasks/get` → DetailedTask with `resultType: "complete"` (ext-tasks "Task Polling").

        Raises JsonRpcError: -32021 without the extension, a limit error for `tasks_rate`, -32602 for
        an unknown, expired or foreign id.
        """
        require_tasks_extension(envelope, "tasks/get")
        self._check_rate(principal)
        return self._lookup(params, principal=principal, server=server).detailed_task()

    def update(self, params: Any, envelope: Envelope, *, principal: str, server: str) -> JsonObject:
        """`tasks/update` → empty ack; answered keys leave `inputRequests` before the ack
        (ext-tasks "Task Update Requests"); unknown or already-answered keys are ignored.

        Raises JsonRpcError: -32021 without the extension, a limit error for `tasks_rate`, -32602 for
        an unknown id or malformed `inputResponses`.
        """
        require_tasks_extension(envelope, "tasks/update")
        self._check_rate(principal)
        record = self._lookup(params, principal=principal, server=server)
        responses = validate_input_responses(params.get("inputResponses"))
        call = self.live.get(record.task_id)
        if call is not None and not record.status.terminal:
            call.answer(responses)
        return dict(ACK)

    def cancel(self, params: Any, envelope: Envelope, *, principal: str, server: str) -> JsonObject:
        """`tasks/cancel` → empty ack (ext-tasks "Task Cancellation"). Sticky: a cancelled task stays
        cancelled; terminal tasks are untouched; the upstream gets `notifications/cancelled`.

        Raises JsonRpcError: -32021 without the extension, a limit error for `tasks_rate`, -32602 for
        an unknown id.
        """
        require_tasks_extension(envelope, "tasks/cancel")
        self._check_rate(principal)
        record = self._lookup(params, principal=principal, server=server)
        if record.status.terminal:
            return dict(ACK)
        try:
            self.store.update(
                record.task_id, status=TaskStatus.CANCELLED, status_message="cancelled by client request", input_requests={}
            )
        except (TerminalTaskError, TaskNotFoundError):
            return dict(ACK)
        call = self.live.pop(record.task_id, None)
        if call is not None:
            call.cancel("task cancelled by client request")
        log.info("task_cancelled", task_id=record.task_id)
        return dict(ACK)

    def recover(self, rerun: Callable[[TaskRecord], Call | None]) -> tuple[int, int]:
        """After a restart: every task an earlier process left running is either re-run (tools
        configured `on_restart: rerun`; `rerun(record)` starts the call) or failed, naming the restart.

        Reads only the side index of live tasks. Returns (re-run, failed) counts.
        """
        rerun_count = failed = 0
        for task_id in self.store.live_ids():
            record = self.store.get(task_id)
            if record is None or record.status.terminal:
                self.store.forget_live(task_id)
                continue
            if record.boot == self.boot:
                continue
            call = rerun(record) if record.rerun else None
            if call is None:
                self._fail_orphan(record)
                failed += 1
                continue
            try:
                self.store.update(
                    task_id, status=TaskStatus.WORKING, status_message="re-running after a proxy restart", input_requests={}, boot=self.boot
                )
            except (TerminalTaskError, TaskNotFoundError):
                call.cancel("the task ended meanwhile")
                continue
            self._adopt(record, call)
            obs.ORPHANED.labels("rerun").inc()
            rerun_count += 1
        if rerun_count or failed:
            log.info("tasks_recovered", rerun=rerun_count, failed=failed)
        return rerun_count, failed

    def _adopt(self, record: TaskRecord, call: Call) -> None:
        self.live[record.task_id] = call
        call.add_done_callback(lambda c: self.live.pop(record.task_id, None))
        call.detach(record.task_id)

    def abandon_all(self) -> None:
        """On shutdown: record a `failed` outcome for every detached call still running, then cancel it."""
        for task_id, call in list(self.live.items()):
            try:
                self.store.update(
                    task_id,
                    status=TaskStatus.FAILED,
                    status_message=SHUTDOWN_MESSAGE,
                    error={"code": INTERNAL_ERROR, "message": SHUTDOWN_MESSAGE},
                    input_requests={},
                )
            except (TerminalTaskError, TaskNotFoundError):
                pass
            call.cancel("proxy shutdown")
        self.live.clear()
