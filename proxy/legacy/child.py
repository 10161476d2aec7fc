"""The stdio adapter of the legacy session machine: legacy-era clients in front of a stdio child.

A child has no URL, so here the proxy is itself the legacy Streamable HTTP server (2025-11-25
basic/transports): it answers `initialize` from the child's own InitializeResult and mints the
session id; each request goes over a pooled child (shared by every session with the same
capabilities) under the child's next id and a progress token of the proxy's, and a pump reads
what the child says about it into the request's reply stream, through the session machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Awaitable
from typing import Any

import structlog
from aiohttp import web

from proxy.legacy.replay import RelayStream
from proxy.legacy.session import LegacySession, LegacySessions, Outbound, Question
from proxy.legacy.streams import StreamServer
from proxy.legacy.types import JSON_ONLY_REFUSAL, Rewrite, error_reply, give_up_question
from proxy.legacy.v1 import V1Front
from proxy.protocol import jsonrpc
from proxy.protocol.era import LEGACY_VERSIONS, upstream_capabilities
from proxy.protocol.jsonrpc import (
    INTERNAL_ERROR,
    INVALID_REQUEST,
    METHOD_NOT_FOUND,
    REQUEST_CANCELLED,
    JsonObject,
    RequestId,
    object_of,
)
from proxy.runtime.running import bind
from proxy.upstream.stdio import StdioSession
from proxy.upstream.stdio_pool import StdioPool
from proxy.upstream.types import UpstreamError

log = structlog.get_logger("proxy.legacy")


class StdioChild:
    """Serves legacy sessions of stdio server `name` over its child processes (`pool`), replies
    through `streams`, v1 status notifications on GET streams from `v1`."""

    kind = "stdio"
    sessionless = False  # a child is reached through a session only: `initialize` first

    def __init__(
        self, *, name: str, pool: StdioPool, sessions: LegacySessions, streams: StreamServer, v1: V1Front
    ) -> None:
        self.name = name
        self.pool = pool
        self.sessions = sessions
        self.streams = streams
        self.v1 = v1

    async def initialize(
        self, request: web.Request, session: LegacySession, body: JsonObject, rewrite: Rewrite | None
    ) -> web.StreamResponse:
        """Answer `initialize` from a child for the client's capabilities, in the revision the client
        asked for when the proxy serves it (else the child's), under a new proxy session id."""
        params = object_of(body.get("params"))
        capabilities = upstream_capabilities(object_of(params.get("capabilities")))
        try:
            child = await self.pool.session(capabilities, session.principal)
        except UpstreamError as exc:
            return error_reply(body.get("id"), INTERNAL_ERROR, str(exc))
        wanted = params.get("protocolVersion")
        version = wanted if wanted in LEGACY_VERSIONS else child.protocol_version
        sid = self.sessions.open(None, session.principal, capabilities, version)
        reply = jsonrpc.response(body.get("id"), {**child.initialize_result, "protocolVersion": version})
        if rewrite is not None:
            reply = await rewrite(reply)
        return web.json_response(reply, headers={"Mcp-Session-Id": sid}, dumps=jsonrpc.dumps_str)

    async def request(
        self, request: web.Request, session: LegacySession, body: JsonObject, rewrite: Rewrite | None
    ) -> web.StreamResponse:
        """Send a request to a child under its next id (the client's progress token swapped for one
        of the proxy's); the reply is plain JSON when the answer alone comes within `keepalive_s`,
        else an SSE stream with what the child says meanwhile. `ping` is answered here."""
        client_id = body["id"]
        if body["method"] == "ping":
            return web.json_response(jsonrpc.response(client_id, {}))
        try:
            child = await self.pool.session(session.capabilities, session.principal)
        except UpstreamError as exc:
            return error_reply(client_id, INTERNAL_ERROR, str(exc))
        params, client_token, upstream_token = session.own_progress_token(object_of(body.get("params")))
        stream = self.streams.open(
            session, "post", json_only="text/event-stream" not in request.headers.get("Accept", "")
        )
        sent = session.send(
            client_id,
            child.next_id(),
            target=child,
            stream=stream,
            client_token=client_token,
            upstream_token=upstream_token,
        )
        sent.input_timeout_s = self.v1.input_timeout_s(body)
        bind(upstream_request_id=sent.upstream_id)
        pump = self._pump(session, stream, child, body["method"], params or None, client_id, sent, rewrite)
        stream.feed(pump, f"legacy stdio request {self.name}")
        return await self.streams.reply(request, session, stream)

    async def _pump(
        self,
        session: LegacySession,
        stream: RelayStream,
        child: StdioSession,
        method: str,
        params: JsonObject | None,
        client_id: RequestId,
        sent: Outbound,
        rewrite: Rewrite | None,
    ) -> None:
        """Run one request on `child` into `stream`: its questions and notifications (ids mapped by
        the session machine), then its answer; a JSON-RPC error when the child fails, or when the
        stream is abandoned first (the session ended, the drain passed, the client cancelled)."""

        overdue: list[asyncio.Task[None]] = []  # one per question relayed: its `input_timeout`

        async def on_message(message: JsonObject) -> None:
            out, _ = session.to_client(message, sent, client_id, child)
            if out is None:
                return
            if jsonrpc.is_request(out):
                refusal = JSON_ONLY_REFUSAL if stream.json_only else session.undeclared(out)
                if refusal is not None:
                    await self._answer_question(session, out["id"], METHOD_NOT_FOUND, refusal)
                    return
                if sent.input_timeout_s:
                    answer = functools.partial(self._answer_question, session, out["id"])
                    overdue.append(
                        asyncio.ensure_future(
                            give_up_question(stream, out["id"], sent.input_timeout_s, answer, self.name)
                        )
                    )
            await stream.push_message(out)

        answered = False
        try:
            reply = await child.request(method, params, handler=on_message, request_id=sent.upstream_id)
            answer = {**reply, "id": client_id}
            stream.append_message(await rewrite(answer) if rewrite is not None else answer)
            answered = True
        except UpstreamError as exc:
            stream.append_message(
                jsonrpc.error_response(client_id, {"code": INTERNAL_ERROR, "message": str(exc)})
            )
            answered = True
        finally:
            for waiting in overdue:
                waiting.cancel()
            if not answered:
                code, message = stream.ended or (
                    INTERNAL_ERROR,
                    f"upstream {self.name} stopped before answering",
                )
                stream.append_message(jsonrpc.error_response(client_id, {"code": code, "message": message}))
            stream.close()
            session.answered(client_id, sent)

    async def _answer_question(self, session: LegacySession, proxy_id: Any, code: int, text: str) -> bool:
        """Answer the child's question `proxy_id` in the client's place with error `code` and `text`
        (a client that cannot be asked, or one that did not answer within `input_timeout`), so the
        child does not wait for it until its call's timeout. False when it is no longer open."""
        question = session.take_answer(proxy_id)
        if question is None:
            return False
        log.info("legacy_question_refused", server=self.name, reason=text)
        await _quiet(question.target.respond(question.upstream_id, error={"code": code, "message": text}))
        return True

    async def notify(
        self, request: web.Request, session: LegacySession, body: JsonObject
    ) -> web.StreamResponse:
        """Pass a notification to the session's child (`notifications/initialized` stays here)."""
        if body["method"] != "notifications/initialized":
            with contextlib.suppress(UpstreamError):
                child = await self.pool.session(session.capabilities, session.principal)
                await child.notify(body["method"], object_of(body.get("params")) or None)
        return web.Response(status=202)

    async def cancel(
        self, request: web.Request, session: LegacySession, sent: Outbound, body: JsonObject
    ) -> web.StreamResponse:
        """A request still waiting for a `max_concurrency` slot is never sent (its reply is the
        proxy's -32800 now); one the child has gets `notifications/cancelled` under its own id."""
        child: StdioSession = sent.target
        if not child.sent(sent.upstream_id):
            sent.unsent = True  # (its idempotency key, if any, lets go: a retry may run it)
            if sent.stream is not None:
                sent.stream.abandon(REQUEST_CANCELLED, "cancelled by the client before it was sent")
            return web.Response(status=202)
        params = {**object_of(body.get("params")), "requestId": sent.upstream_id}
        await _quiet(child.notify("notifications/cancelled", params))
        return web.Response(status=202)

    async def respond(
        self, request: web.Request, session: LegacySession, question: Question, body: JsonObject
    ) -> web.StreamResponse:
        """Deliver the client's answer to the child that asked, under its own id."""
        child: StdioSession = question.target
        await _quiet(child.respond(question.upstream_id, result=body.get("result"), error=body.get("error")))
        return web.Response(status=202)

    async def open_get(self, request: web.Request, session: LegacySession, sid: str) -> web.StreamResponse:
        """The session's standalone GET stream: v1 `notifications/tasks/status` and progress for the
        principal's tasks (keepalives between), resumable like any reply stream. A child with tasks
        of its own gets no stream from the proxy (405)."""
        if await self.v1.upstream_has_tasks():
            response = error_reply(
                None, INVALID_REQUEST, "this server offers no standalone GET stream", status=405
            )
            response.headers["Allow"] = "POST, DELETE"
            return response
        stream = self.streams.open(session, "get")
        self._feed_status(session, stream, sid)
        return await self.streams.serve(request, session, stream, headers={"Mcp-Session-Id": sid})

    async def reopen_get(
        self, request: web.Request, session: LegacySession, stream: RelayStream, sid: str
    ) -> None:
        """A resumed standalone GET stream gets its status notifications again."""
        self.streams.reopen(session, stream)
        self._feed_status(session, stream, sid)

    def _feed_status(self, session: LegacySession, stream: RelayStream, sid: str) -> None:
        """The v1 status notifications of the session's principal feed its standalone `stream`."""
        feeding = self.v1.status_feed(stream, session.principal, sid)
        if feeding is not None:
            stream.feed(feeding, f"v1 status push {self.name}")

    async def delete(self, request: web.Request, session: LegacySession, sid: str) -> web.StreamResponse:
        """End the session here (its children stay pooled for other sessions)."""
        self.sessions.end(sid)
        return web.Response(status=200)

    async def forget(self, session: LegacySession) -> None:
        """Nothing upstream to end: the children are pooled for every session."""


async def _quiet(send: Awaitable[None]) -> None:
    """Await a send to a child; one that fails (the child is gone) changes nothing for the client."""
    with contextlib.suppress(UpstreamError):
        await send
