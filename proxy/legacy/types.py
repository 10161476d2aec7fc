"""What the legacy endpoint asks of an upstream adapter (`relay.HttpRelay`, `child.StdioChild`):
the I/O that differs between an HTTP upstream and a stdio child, after the session machine mapped
the ids. Every method answers the client's HTTP request; JSON-RPC errors for requests go out in an
HTTP 200, as on the 2025-11-25 wire (protocol.md §1.4.4)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import structlog
from aiohttp import web

from proxy.legacy.replay import RelayStream
from proxy.legacy.session import LegacySession, Outbound, Question
from proxy.protocol import jsonrpc
from proxy.protocol.jsonrpc import JsonObject

# Rewrites the answer to one request before it reaches the client (v1 tasks: `initialize` and
# `tools/list` replies gain the proxy's task capability and each tool's task support).
Rewrite = Callable[[JsonObject], Awaitable[JsonObject]]

log = structlog.get_logger("proxy.legacy")

# Why a question is refused for a client whose `Accept` takes no SSE (it could never see it).
JSON_ONLY_REFUSAL = "the client accepts no text/event-stream, so it cannot receive this request"


def input_timed_out(timeout_s: float) -> str:
    """The error text an upstream gets for a question the client left unanswered `timeout_s` (s)."""
    return f"input timed out: the client did not answer within {timeout_s:g} s (input_timeout)"


def withdrawn(proxy_id: Any, reason: str) -> JsonObject:
    """The `notifications/cancelled` that withdraws question `proxy_id` from the client."""
    return jsonrpc.notification("notifications/cancelled", {"requestId": proxy_id, "reason": reason})


async def give_up_question(
    stream: RelayStream,
    proxy_id: Any,
    timeout_s: float,
    answer: Callable[[int, str], Awaitable[bool]],
    server: str,
) -> None:
    """After `timeout_s` (s, the call's `input_timeout`), a question `proxy_id` still open is
    answered upstream in the client's place with the timeout's -32603 (`answer(code, text)`: True
    when the question was still open) and withdrawn from the client (`notifications/cancelled` on
    its `stream`). Run as a task nobody awaits: what fails is logged, never left unretrieved."""
    await asyncio.sleep(timeout_s)
    text = input_timed_out(timeout_s)
    try:
        if await answer(jsonrpc.INTERNAL_ERROR, text):
            await stream.push_message(withdrawn(proxy_id, text))
    except Exception as exc:
        log.warning("legacy_question_timeout_failed", server=server, reason=repr(exc))


class LegacyUpstream(Protocol):
    """The I/O toward one kind of upstream for legacy sessions.

    `kind` is "http" or "stdio" (replicas adopt only an HTTP upstream's sessions); `sessionless`
    says whether requests without `Mcp-Session-Id` are relayed (an HTTP upstream may be
    session-less; a stdio child needs `initialize` first).
    """

    kind: str
    sessionless: bool

    async def initialize(
        self, request: web.Request, session: LegacySession, body: JsonObject, rewrite: Rewrite | None
    ) -> web.StreamResponse:
        """Open a session for an `initialize` request (`session` is the caller's session-less one)."""

    async def request(
        self, request: web.Request, session: LegacySession, body: JsonObject, rewrite: Rewrite | None
    ) -> web.StreamResponse:
        """Send a client request upstream under an id of the proxy's (`session.send`) and relay its
        reply, questions and notifications (through `session.to_client`)."""

    async def notify(
        self, request: web.Request, session: LegacySession, body: JsonObject
    ) -> web.StreamResponse:
        """Pass a client notification on."""

    async def cancel(
        self, request: web.Request, session: LegacySession, sent: Outbound, body: JsonObject
    ) -> web.StreamResponse:
        """Pass a client's `notifications/cancelled` on for `sent` (in flight), under its upstream id."""

    async def respond(
        self, request: web.Request, session: LegacySession, question: Question, body: JsonObject
    ) -> web.StreamResponse:
        """Deliver the client's answer to `question` under the upstream's own id."""

    async def open_get(self, request: web.Request, session: LegacySession, sid: str) -> web.StreamResponse:
        """The session's standalone GET stream."""

    async def reopen_get(
        self, request: web.Request, session: LegacySession, stream: RelayStream, sid: str
    ) -> None:
        """Feed the standalone GET `stream` again (a resumption found its pump over)."""

    async def delete(self, request: web.Request, session: LegacySession, sid: str) -> web.StreamResponse:
        """End session `sid`."""

    async def forget(self, session: LegacySession) -> None:
        """End the upstream's side of a session the proxy expired (idle): HTTP sends `DELETE` for its
        upstream session (bounded, failures logged); a stdio child has nothing to end."""


def error_reply(
    request_id: Any,
    code: int,
    message: str,
    *,
    status: int = 200,
    data: Any = None,
    headers: dict[str, str] | None = None,
) -> web.Response:
    """A JSON-RPC error response under `request_id` with HTTP `status` (`data`: the error's
    optional detail; `headers`: more HTTP headers, such as `Retry-After`)."""
    body = jsonrpc.error_response(request_id, jsonrpc.error_object(code, message, data))
    return web.json_response(body, status=status, headers=headers, dumps=jsonrpc.dumps_str)


def error_reply_for(request_id: Any, exc: jsonrpc.JsonRpcError) -> web.Response:
    """`exc` as the JSON-RPC error response under `request_id`, with its HTTP status, `data` and
    headers."""
    return error_reply(
        request_id, exc.code, exc.message, status=exc.http_status, data=exc.data, headers=exc.http_headers
    )
