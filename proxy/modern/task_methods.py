"""The proxy's own `tasks/get`, `tasks/update` and `tasks/cancel` for v2 clients (ext-tasks SEP-2663,
protocol.md §1.5.3-1.5.5): capability gating, params, rate limit, then the task service, rendered
by `protocol.tasks_v2`.

Capability gating comes before any lookup (-32021); unknown, expired, foreign-principal and
other-server ids all get the same -32602, so a task's existence never leaks.
"""

from __future__ import annotations

from typing import Any

from proxy.protocol.era import TASKS_EXTENSION, Envelope
from proxy.protocol.jsonrpc import MISSING_REQUIRED_CLIENT_CAPABILITY, JsonObject, JsonRpcError
from proxy.tasks.service import TaskService
from proxy.tasks.store import StoreUnavailableError
from proxy.tasks.wire_v2 import detailed_task, validate_input_responses

ACK: JsonObject = {"resultType": "complete"}


def require_tasks_extension(envelope: Envelope, what: str) -> None:
    """Raise -32021 (with `data.requiredCapabilities`) unless the request declared the tasks extension."""
    if not envelope.declares_tasks:
        raise JsonRpcError(
            MISSING_REQUIRED_CLIENT_CAPABILITY,
            f"{what} needs the {TASKS_EXTENSION} extension declared in this request's client capabilities",
            {"requiredCapabilities": {"extensions": {TASKS_EXTENSION: {}}}},
        )


class TaskMethods:
    """v2 `tasks/*` handlers for one server over the shared TaskService."""

    def __init__(self, tasks: TaskService, server: str) -> None:
        self.tasks = tasks
        self.server = server

    async def _record(self, method: str, params: Any, envelope: Envelope, principal: str):
        require_tasks_extension(envelope, method)
        await self.tasks.check_rate(principal)
        task_id = params.get("taskId") if isinstance(params, dict) else None
        return await self.tasks.lookup(task_id, principal=principal, server=self.server)

    async def get(self, params: Any, envelope: Envelope, principal: str) -> JsonObject:
        """`tasks/get` → DetailedTask with `resultType: "complete"` (ext-tasks "Task Polling").

        Raises JsonRpcError: -32021 without the extension, a limit error for `tasks_rate`, -32602 for
        an unknown, expired or foreign id, -32603 (HTTP 503) when the store cannot be read.
        """
        return detailed_task(await self._record("tasks/get", params, envelope, principal))

    async def update(self, params: Any, envelope: Envelope, principal: str) -> JsonObject:
        """`tasks/update` → empty ack; answered keys leave `inputRequests` before the ack
        (ext-tasks "Task Update Requests"); unknown or already-answered keys are ignored.

        Raises JsonRpcError: -32021 without the extension, a limit error for `tasks_rate`, -32602 for
        an unknown id or malformed `inputResponses`.
        """
        record = await self._record("tasks/update", params, envelope, principal)
        await self.tasks.answer(record, validate_input_responses(params.get("inputResponses")))
        return dict(ACK)

    async def cancel(self, params: Any, envelope: Envelope, principal: str) -> JsonObject:
        """`tasks/cancel` → empty ack (ext-tasks "Task Cancellation"). Sticky: a cancelled task stays
        cancelled; terminal tasks are untouched; the upstream gets `notifications/cancelled`.

        Raises JsonRpcError: -32021 without the extension, a limit error for `tasks_rate`, -32602 for
        an unknown id, -32603 (HTTP 503) naming the store when it cannot write.
        """
        record = await self._record("tasks/cancel", params, envelope, principal)
        try:
            await self.tasks.cancel(record, by="client")
        except StoreUnavailableError as exc:
            raise JsonRpcError(-32603, str(exc), {"store": self.tasks.store.where}, status=503) from None
        return dict(ACK)
