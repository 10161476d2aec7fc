"""What the calls layer shares with the layers above it: how a running handler talks back to its
client (`Reply`), and the slot an idempotency key gives a call (`KeyedCall`). (Where a detached
call reports is the task service's `tasks.types.TaskSink`.)"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol

from proxy.protocol.jsonrpc import JsonObject


class Reply(Protocol):
    """How a handler talks back on one request's HTTP response while it is still running.

    `arrived` is the event-loop time (s) the request reached the proxy (None when unknown: the
    handler then counts from now); `headers` are the request's HTTP headers, a case-insensitive
    multi-dict (the `Mcp-Param-*` checks read them).
    """

    arrived: float | None
    headers: Any

    async def notify(self, message: JsonObject) -> None:
        """Send a JSON-RPC notification (switching the response to SSE)."""

    async def keepalive(self) -> bool:
        """Send an SSE comment so idle-timeout intermediaries keep the connection; True when it
        wrote one (a client that takes no SSE gets nothing)."""

    async def relay(self, message: JsonObject) -> bool:
        """Write a notification at once from any task, when that cannot wait for the client: the
        response is an SSE stream already and its connection takes the bytes without blocking.
        False when not (the caller hands it to the handler's `notify`, which may wait)."""
        return False


@dataclass(frozen=True)
class KeyedCall:
    """A call that holds its slot (an idempotency key's, or `dedupe`'s): `slot` the store key,
    `task_id` the id minted for it (its task's, should it become one), `digest` the canonical hash
    of its tool and arguments, `owner` the node running it, `window_s` (s) how long the slot holds
    after the call ended, `hold_s` (s) how long it holds while the call may still run."""

    slot: str
    task_id: str
    digest: str
    owner: str
    window_s: float
    hold_s: float

    def entry(self, outcome: JsonObject | None = None, round_: JsonObject | None = None) -> bytes:
        """The slot's stored value (JSON): digest, task id, owner and, once known, the outcome, or
        the MRTR round (InputRequiredResult) the call waits on."""
        value: JsonObject = {"digest": self.digest, "taskId": self.task_id, "owner": self.owner}
        if outcome is not None:
            value["outcome"] = outcome
        if round_ is not None:
            value["round"] = round_
        return json.dumps(value, separators=(",", ":")).encode()
