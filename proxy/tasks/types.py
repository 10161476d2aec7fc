"""What the task service shares with the layers above it: the calls it runs (`LiveCall`) and where
they report (`TaskSink`), the replicas that run other calls (`RemoteOwner`), how a call is sent
again after its owner died (`Rerun`), and the changes it publishes (`TaskChange`, `TaskMessage`)
on its fan-out."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from typing import Any, Protocol

from proxy.protocol.jsonrpc import JsonObject
from proxy.tasks.model import TaskRecord, TaskStatus


class LiveCall(Protocol):
    """What the service needs of a running call: who started it, how to answer and stop it, and
    what ended it (`ended_by`, passed on to `TaskSink.finish`: upstream, timeout, input_timeout, or
    fence, whose outcome is never recorded)."""

    principal: str
    ended_by: str
    outcome: asyncio.Future[JsonObject]  # the JSON-RPC answer (`{"result"}` / `{"error"}`) once known

    def add_done_callback(self, fn: Callable[[Any], None]) -> None:
        """Call `fn(call)` once, when the outcome is known."""

    def answer(self, responses: JsonObject) -> list[str]:
        """Deliver input responses by key; returns the keys used."""

    def cancel(self, reason: str) -> None:
        """Abandon the call (the upstream gets notifications/cancelled)."""

    def shut_down(self, outcome: JsonObject) -> None:
        """Abandon the call as the proxy shuts down, `outcome` (`{"error"}`, the failure its task
        records) becoming its own unless it has one already."""

    def input_requests(self) -> JsonObject:
        """The questions still unanswered, as an `inputRequests` map."""

    @property
    def upstream_ref(self) -> JsonObject | None:
        """Where its upstream request went, for another process to cancel it once this one is gone
        (`{"session", "requestId", "protocolVersion"}` on an HTTP upstream), or None."""


class TaskSink(Protocol):
    """Where a detached call reports (the task service implements it). Each returns once written;
    `set_inputs`, `progress` and `sent_upstream` (where the call's request went, once it left after
    the task was made: `LiveCall.upstream_ref`) return False when the task already ended elsewhere."""

    async def set_inputs(self, task_id: str, input_requests: JsonObject) -> bool: ...

    async def progress(self, task_id: str, text: str) -> bool: ...

    async def sent_upstream(self, task_id: str, ref: JsonObject) -> bool: ...

    async def finish(
        self, task_id: str, outcome: JsonObject, status_message: str | None, *, by: str = "upstream"
    ) -> None: ...


# Starts the call of a task configured `on_restart: rerun` again, reporting to the given sink; None
# when it cannot (its server is gone from the config).
Rerun = Callable[[TaskRecord, TaskSink], LiveCall | None]
# Cancels upstream the request of a task whose owner died (its `upstream_ref`), giving the reason;
# True when the upstream took the cancel (`Pool.cancel_elsewhere`)
CancelOrphan = Callable[[TaskRecord, str], Awaitable[bool]]


class RemoteOwner(Protocol):
    """Reaches the live call of a task another node (replica) runs (`proxy.replicas`)."""

    async def answer(self, record: TaskRecord, responses: JsonObject) -> list[str]:
        """Deliver input responses (by key) there; the keys used."""

    async def cancel(self, record: TaskRecord, reason: str) -> None:
        """Stop the call there (the store already says `cancelled`)."""


@dataclass(frozen=True, slots=True)
class TaskChange:
    """A change a store committed (in this process, or with Redis in any replica): the status
    before it (None for a new task) and the record after it."""

    before: TaskStatus | None
    record: TaskRecord

    @property
    def task_id(self) -> str:
        """The task it changed."""
        return self.record.task_id


@dataclass(frozen=True, slots=True)
class TaskMessage:
    """A JSON-RPC notification that belongs to a task (a v1 client's progress), for its streams."""

    principal: str
    server: str
    task_id: str
    message: JsonObject


TaskEvent = TaskChange | TaskMessage


def about(
    principal: str, server: str, task_ids: Collection[str] | None = None
) -> Callable[[TaskEvent], bool]:
    """A fan-out filter: the events of `principal`'s tasks on `server` (only `task_ids`, when given).
    Another principal's task never reaches a subscriber through it."""

    def accept(event: TaskEvent) -> bool:
        owner, where = (
            (event.record.principal, event.record.server)
            if isinstance(event, TaskChange)
            else (event.principal, event.server)
        )
        return owner == principal and where == server and (task_ids is None or event.task_id in task_ids)

    return accept
