"""The proxy's own `tasks/get`, `tasks/update` and `tasks/cancel` for v2 clients (ext-tasks SEP-2663,
protocol.md §1.5.3-1.5.5): capability gating, params, rate limit, then the task service, rendered
by `tasks.wire_v2`.

Capability gating comes before any lookup (-32021); unknown, expired, foreign-principal and
other-server ids all get the same -32602, so a task's existence never leaks.
"""

from __future__ import annotations

from proxy.modern.types import ModernRequest
from proxy.protocol.era import TASKS_EXTENSION, Envelope
from proxy.protocol.jsonrpc import (
    INTERNAL_ERROR,
    MISSING_REQUIRED_CLIENT_CAPABILITY,
    JsonObject,
    JsonRpcError,
)
from proxy.tasks.model import TaskRecord
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

    async def _record(self, request: ModernRequest) -> TaskRecord:
        require_tasks_extension(request.envelope, request.method)
        await self.tasks.check_rate(request.principal)
        task_id = request.params.get("taskId")
        return await self.tasks.lookup(task_id, principal=request.principal, server=self.server)

    async def get(self, request: ModernRequest) -> JsonObject:
        """`tasks/get` → DetailedTask with `resultType: "complete"` (ext-tasks "Task Polling").

        Raises JsonRpcError: -32021 without the extension, a limit error for `tasks_rate`, -32602 for
        an unknown, expired or foreign id, -32603 (HTTP 503) when the store cannot be read.
        """
        return detailed_task(await self._record(request))

    async def update(self, request: ModernRequest) -> JsonObject:
        """`tasks/update` → empty ack; answered keys leave `inputRequests` before the ack
        (ext-tasks "Task Update Requests"); unknown or already-answered keys are ignored.

        Raises JsonRpcError: -32021 without the extension, a limit error for `tasks_rate`, -32602 for
        an unknown id or malformed `inputResponses`.
        """
        record = await self._record(request)
        await self.tasks.answer(record, validate_input_responses(request.params.get("inputResponses")))
        return dict(ACK)

    async def cancel(self, request: ModernRequest) -> JsonObject:
        """`tasks/cancel` → empty ack (ext-tasks "Task Cancellation"). Sticky: a cancelled task stays
        cancelled; terminal tasks are untouched; the upstream gets `notifications/cancelled`.

        Raises JsonRpcError: -32021 without the extension, a limit error for `tasks_rate`, -32602 for
        an unknown id, -32603 (HTTP 503) naming the store when it cannot write.
        """
        record = await self._record(request)
        try:
            await self.tasks.cancel(record, by="client")
        except StoreUnavailableError as exc:
            raise JsonRpcError(
                INTERNAL_ERROR, str(exc), {"store": self.tasks.store.where}, status=503
            ) from None
        return dict(ACK)
