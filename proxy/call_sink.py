"""Where a detached call reports (`TaskSink`, the task service implements it), and the event queue
that stands in once nobody is attached (split out of call.py)."""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from .protocol.jsonrpc import JsonObject


class TaskSink(Protocol):
    """Where a detached call reports (the task service implements it). Each returns once written;
    `set_inputs` and `progress` return False when the task already ended elsewhere."""

    async def set_inputs(self, task_id: str, input_requests: JsonObject) -> bool: ...

    async def progress(self, task_id: str, text: str) -> bool: ...

    async def finish(
        self, task_id: str, outcome: JsonObject, status_message: str | None, *, by: str = "upstream"
    ) -> None: ...


class _Discard(asyncio.Queue[tuple[str, Any]]):
    """Stands in for the event queue of a detached call: events for an attached client go nowhere."""

    def put_nowait(self, item: tuple[str, Any]) -> None:
        pass


DISCARD = _Discard()  # the one shared stand-in queue
