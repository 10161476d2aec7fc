"""What this process is answering right now, for operators: one entry per request in flight, holding
the same identifiers as the request's access-log line (README "Console", "Running now").

The access-log middleware opens an entry per request (`RunningRequests.begin`) and closes it when
the answer is done; everything the proxy binds to a request's log context through `bind` lands in
the entry too, so the console shows a call still waiting for its upstream with its request id,
server, tool, principal hash, upstream request id and trace id, before its log line exists.
"""

from __future__ import annotations

import heapq
import time
from contextvars import ContextVar
from typing import Any

import structlog

MAX_LISTED = 500  # entries one snapshot returns at most (the oldest): bounds a console answer
MAX_BOUND_METHOD = 128  # characters bound of a client-chosen JSON-RPC method or task id
MAX_BOUND_NAME = 256  # characters bound of a client-chosen tool (prompt, resource) name

# The log-context fields a snapshot shows, under the console's names (camelCase, like its task rows).
_SHOWN = {
    "request_id": "requestId",
    "client_request_id": "clientRequestId",
    "relayed_request_id": "relayedRequestId",
    "principal": "principalHash",
    "server": "server",
    "era": "era",
    "rpc_method": "rpcMethod",
    "tool": "tool",
    "task_id": "taskId",
    "upstream_request_id": "upstreamRequestId",
    "upstream_progress_token": "upstreamProgressToken",
    "trace_id": "traceId",
}
VIEW_NAMES = ("httpMethod", "startedMs", "ageMs", *_SHOWN.values())  # every key a view may have


class RunningRequest:
    """One request in flight: its log-context `fields` (as bound), when it arrived (`started_ms`,
    epoch ms) and its HTTP method."""

    __slots__ = ("ended", "fields", "http_method", "since", "started_ms")

    def __init__(self, http_method: str) -> None:
        self.ended = False
        self.fields: dict[str, Any] = {}
        self.http_method = http_method
        self.started_ms = int(time.time() * 1000)
        self.since = time.monotonic()  # (s, the monotonic clock)

    def age_ms(self) -> int:
        """Milliseconds since the request arrived."""
        return int((time.monotonic() - self.since) * 1000)

    def shown(self) -> dict[str, Any]:
        """The console's view: `{httpMethod, startedMs, ageMs, requestId, server, era, rpcMethod, tool,
        principalHash, ...}`, with only the identifiers bound so far."""
        view: dict[str, Any] = {
            "httpMethod": self.http_method,
            "startedMs": self.started_ms,
            "ageMs": self.age_ms(),
        }
        for field, name in _SHOWN.items():
            value = self.fields.get(field)
            if value is not None:
                view[name] = value if isinstance(value, (str, int, float, bool)) else str(value)
        return view


_CURRENT: ContextVar[RunningRequest | None] = ContextVar("running_request", default=None)


def bind(**fields: Any) -> None:
    """Bind `fields` to the request's log context (structlog contextvars) and to its running entry,
    if the request has one. Use it wherever a request's identifiers become known."""
    structlog.contextvars.bind_contextvars(**fields)
    entry = _CURRENT.get()
    if entry is not None and not entry.ended:  # (a task the request started may outlive it)
        entry.fields.update(fields)


class RunningRequests:
    """The requests of one application in flight (`begin` .. `end`). `snapshot` lists those served by
    an MCP endpoint (they have a `server`): not the console's own, not the internal replica hops."""

    def __init__(self) -> None:
        self._entries: set[RunningRequest] = set()

    def begin(self, http_method: str, fields: dict[str, Any]) -> RunningRequest:
        """Open the entry of the request being handled in the current context, with the log-context
        `fields` bound so far (call it in the request's task, right before the handler, and `end` it
        in a `finally`); `bind` fills it from then on."""
        entry = RunningRequest(http_method)
        entry.fields.update(fields)
        self._entries.add(entry)
        _CURRENT.set(entry)
        return entry

    def end(self, entry: RunningRequest) -> None:
        """Close `entry`: its request is answered, or cut. Its fields are dropped: a task the request
        started (a detached call) still refers to it, for as long as it runs."""
        self._entries.discard(entry)
        entry.ended = True
        entry.fields = {}
        if _CURRENT.get() is entry:
            _CURRENT.set(None)

    def relayed(self) -> int:
        """How many of the requests `snapshot` counts came relayed from another replica (that replica
        counts them too)."""
        return sum(
            1 for entry in self._entries if "relayed_request_id" in entry.fields and "server" in entry.fields
        )

    def snapshot(self, limit: int = MAX_LISTED) -> tuple[list[dict[str, Any]], int]:
        """`(views, total)`: the views (`RunningRequest.shown`) of the `limit` oldest requests served by an
        MCP endpoint, oldest first, and how many such requests there are in all."""
        served = [entry for entry in self._entries if "server" in entry.fields]
        oldest = heapq.nsmallest(limit, served, key=lambda entry: entry.since)
        return [entry.shown() for entry in oldest], len(served)
