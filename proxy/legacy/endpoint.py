"""The legacy era (2025-06-18 / 2025-11-25) of one server's MCP endpoint, the same for every upstream
kind: validation, the method surface, the session and its principal, v1 task interception, id
mapping through the session machine (`session.py`), cancels, resumption, then the upstream adapter
(`relay.HttpRelay`, `child.StdioChild`) for the I/O. Each request is counted like a modern one.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable
from typing import Any

import structlog
from aiohttp import web

from proxy.calls.keys import call_key
from proxy.legacy.replay import parse_event_id
from proxy.legacy.session import LegacySession, LegacySessions, Outbound
from proxy.legacy.streams import StreamServer
from proxy.legacy.types import LegacyUpstream, Rewrite, error_reply, error_reply_for
from proxy.legacy.v1 import V1Front, legacy_status
from proxy.protocol import jsonrpc
from proxy.protocol.era import (
    LEGACY_METHODS,
    LEGACY_TASK_METHODS,
    LEGACY_VERSIONS,
    MODERN_VERSIONS,
    legacy_method_refusal,
)
from proxy.protocol.jsonrpc import (
    INTERNAL_ERROR,
    INVALID_REQUEST,
    REQUEST_CANCELLED,
    JsonObject,
    JsonRpcError,
    RequestId,
    object_of,
)
from proxy.protocol.sse import KEEPALIVE, SSE_HEADERS, encode_message
from proxy.runtime import metrics
from proxy.runtime.running import bind
from proxy.upstream.types import UpstreamTimeoutError

log = structlog.get_logger("proxy.legacy")

FORGET_AT_ONCE = 32  # upstream DELETEs of expired sessions in flight at once

CANCEL_GRACE_S = 1.0  # how long (s) the upstream may take to end a request its client cancelled
UNANSWERED = (
    "the first call with this idempotency key ended without an answer the proxy could keep (the "
    "upstream failed or its stream broke); whether it ran is unknown"
)


class JoinReply:
    """The response of a keyed legacy `tools/call` that waits for the call its key names (a
    `calls.types.Reply`): while it waits, keep-alive comments on an SSE stream when the client
    accepts `text/event-stream` (so an idle-timeout balancer does not cut it), then the answer as
    that stream's one event; plain JSON when nothing was streamed. Not resumable (no event ids)."""

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.headers = request.headers
        self.arrived: float | None = None
        self.stream: web.StreamResponse | None = None
        self.takes_sse = "text/event-stream" in request.headers.get("Accept", "")

    async def notify(self, message: JsonObject) -> None:
        """Not used: a joining request relays nothing of the first call's."""

    async def relay(self, message: JsonObject) -> bool:
        """Not used (see `notify`)."""
        return False

    async def keepalive(self) -> bool:
        """An SSE comment (the stream starts with the first one); nothing for a JSON-only client.
        True when it wrote one."""
        if not self.takes_sse:
            return False
        if self.stream is None:
            stream = web.StreamResponse(status=200, headers={**self._session_header(), **SSE_HEADERS})
            await stream.prepare(self.request)
            self.stream = stream
        await self.stream.write(KEEPALIVE)
        return True

    async def finish(
        self, message: JsonObject, status: int = 200, headers: dict[str, str] | None = None
    ) -> web.StreamResponse:
        """Send the JSON-RPC answer: the stream's last event, or JSON with HTTP `status` (and
        `headers`, such as `Retry-After`)."""
        if self.stream is None:
            return web.json_response(
                message,
                status=status,
                headers={**self._session_header(), **(headers or {})},
                dumps=jsonrpc.dumps_str,
            )
        await self.stream.write(encode_message(message))
        await self.stream.write_eof()
        return self.stream

    def _session_header(self) -> dict[str, str]:
        sid = (self.request.headers.get("Mcp-Session-Id") or "").strip()
        return {"Mcp-Session-Id": sid} if sid else {}


class LegacyEndpoint:
    """Answers the legacy-era HTTP requests (POST, GET and DELETE) of server `name` for its
    `sessions`, through `upstream` (the I/O adapter of its kind), replies served by `streams`, v1
    tasks by `v1`."""

    def __init__(
        self,
        *,
        name: str,
        sessions: LegacySessions,
        streams: StreamServer,
        upstream: LegacyUpstream,
        v1: V1Front,
        forget_shared: Callable[[str], Awaitable[None]] | None = None,
    ) -> None:
        self.name = name
        self.forget_shared = forget_shared  # removes a session id from the replicas' session map
        self.sessions = sessions
        self.streams = streams
        self.upstream = upstream
        self.v1 = v1

    async def expire_idle(self, idle_s: float) -> int:
        """Expire the sessions idle for `idle_s` (s) with nothing in flight and end their upstream side
        (`LegacyUpstream.forget`, FORGET_AT_ONCE at a time) and their entry in the replicas' session
        map (`forget_shared`: no other replica adopts them later); returns how many."""
        expired = self.sessions.expire_idle(idle_s)
        gate = asyncio.Semaphore(FORGET_AT_ONCE)

        async def forget(sid: str, session: LegacySession) -> None:
            async with gate:
                await self.upstream.forget(session)
                if self.forget_shared is not None:
                    await self.forget_shared(sid)

        await asyncio.gather(*(forget(sid, session) for sid, session in expired))
        if expired:
            log.info("legacy_sessions_expired", server=self.name, count=len(expired), idle_s=idle_s)
        return len(expired)

    async def handle(self, request: web.Request, *, body: Any, principal: str) -> web.StreamResponse:
        """Answer one legacy-era request of `principal` (`body`: the parsed POST body, None for GET
        and DELETE). A request outside the era's surface gets -32601 (HTTP 200); malformed JSON-RPC
        400; an unknown (or another principal's) session 404; a request without a session that
        needs one 400."""
        request_id = body.get("id") if isinstance(body, dict) else None
        if isinstance(request_id, bool) or not isinstance(request_id, (str, int)):
            request_id = None  # never echo an id of the wrong type
        if (refusal := legacy_method_refusal(request.headers, body)) is not None:
            return error_reply_for(request_id, refusal)
        method = (
            body.get("method") if isinstance(body, dict) and isinstance(body.get("method"), str) else None
        )
        started = asyncio.get_running_loop().time()
        response: web.StreamResponse | None = None
        try:
            response = await self._handle(request, body, request_id, principal)
            return response
        finally:
            if method is not None and "id" in body:
                observe(self.name, method, body, response, asyncio.get_running_loop().time() - started)

    async def _handle(
        self, request: web.Request, body: Any, request_id: Any, principal: str
    ) -> web.StreamResponse:
        if request.method not in ("POST", "GET", "DELETE"):
            message = f"{request.method} is not served on a legacy session; use POST, GET or DELETE"
            response = error_reply(request_id, INVALID_REQUEST, message, status=405)
            response.headers["Allow"] = "POST, GET, DELETE"
            return response
        if request.method == "POST":
            try:
                _validate(body)
            except JsonRpcError as exc:
                return error_reply_for(request_id, exc)
        opening = request.method == "POST" and body.get("method") == "initialize"
        if not opening and (problem := _header_problem(request)) is not None:
            return error_reply(request_id, INVALID_REQUEST, problem, status=400)
        sid = (request.headers.get("Mcp-Session-Id") or "").strip()
        found = self.sessions.get(sid, principal) if sid else None
        if sid and found is None:
            return error_reply(
                request_id, INVALID_REQUEST, "unknown or expired session; initialize a new one", status=404
            )
        version = (
            request.headers.get("MCP-Protocol-Version")
            or (found.version if found is not None else "")
            or None
        )
        if request.method == "POST" and await self.v1.intercepts(body, principal, version):
            if found is None:
                return error_reply(
                    request_id, INVALID_REQUEST, "missing Mcp-Session-Id: initialize first", status=400
                )
            v1_body = self.v1.for_version(body, version)
            return await self.v1.handle(
                request, v1_body, principal=principal, capabilities=found.capabilities
            )
        if request.method == "POST" and body.get("method") == "initialize":
            if found is not None and self.upstream.kind == "http":  # the relay keeps this session
                return await self._initialize(request, found, body, request_id, principal)
            if (refusal := self.sessions.over_cap(principal)) is not None:
                return error_reply_for(request_id, refusal)
            with self.sessions.opening(principal):
                return await self._initialize(request, found, body, request_id, principal)
        if found is None and not self.upstream.sessionless:
            return error_reply(
                request_id, INVALID_REQUEST, "missing Mcp-Session-Id: initialize first", status=400
            )
        session = found or self.sessions.sessionless(principal)
        if request.method == "GET":
            return await self._get(request, session, sid)
        if request.method == "DELETE":
            return await self.upstream.delete(request, session, sid)
        if jsonrpc.is_response(body):
            question = session.take_answer(body["id"])
            if question is None:  # unknown, or already answered: never reaches the upstream
                log.info(
                    "legacy_response_dropped",
                    server=self.name,
                    reason="no pending server request has this id",
                )
                return web.Response(status=202)
            return await self.upstream.respond(request, session, question, body)
        if "id" not in body:
            if body["method"] != "notifications/cancelled":
                return await self.upstream.notify(request, session, body)
            client_id = object_of(body.get("params")).get("requestId")
            sent = session.cancel(client_id)
            if sent is None:  # answered already (or never sent): the upstream must not see it
                log.info("legacy_cancel_dropped", server=self.name, reason="the request is not in flight")
                return web.Response(status=202)
            passed_on = await self.upstream.cancel(request, session, sent, body)
            asyncio.get_running_loop().call_later(
                CANCEL_GRACE_S, self._cancel_overdue, session, client_id, sent
            )
            return passed_on
        if body["method"] == "tools/call":
            return await self._call(request, session, body, principal)
        return await self.upstream.request(request, session, body, self._rewrite(body["method"]))

    async def _call(
        self, request: web.Request, session: LegacySession, body: JsonObject, principal: str
    ) -> web.StreamResponse:
        """Relay a `tools/call`. With an idempotency key (or a `dedupe` tool; see `calls.keys`), a
        call that repeats the one its slot names gets that call's answer instead of reaching the
        upstream, and the first call goes on if its client leaves (its answer fills the slot; an
        end without an answer fills it with an error saying so, since it may have run; a request
        that never left the proxy, with no connection to the upstream, lets the slot go)."""
        params = object_of(body.get("params"))
        tool, request_id = params.get("name"), body["id"]
        rewrite = self._rewrite("tools/call")
        if not isinstance(tool, str) or not tool:
            return await self.upstream.request(request, session, body, rewrite)
        keys, policy = self.v1.keys, self.v1.config.policy(self.name, tool)
        joining = JoinReply(request)
        try:
            keyed, answer = await keys.claim_or_join(
                principal=principal,
                server=self.name,
                tool=tool,
                arguments=params.get("arguments"),
                key=call_key(request.headers, params),
                policy=policy,
                as_task=False,
                reply=joining,
                keepalive_s=self.streams.keepalive_s,
                dialect="v1",
            )
            if answer is not None:
                return await joining.finish(jsonrpc.response(request_id, answer))
        except JsonRpcError as exc:
            error = jsonrpc.error_response(request_id, exc.to_error())
            return await joining.finish(error, status=legacy_status(exc), headers=exc.http_headers)
        if keyed is None:
            return await self.upstream.request(request, session, body, rewrite)
        settled = False

        def settle(outcome: JsonObject) -> None:
            nonlocal settled
            if not settled:
                settled = True
                keys.settle_later(keyed, outcome)

        def release() -> None:  # the call never left the proxy: its key lets go, a retry may run it
            nonlocal settled
            if not settled:
                settled = True
                keys.release_later(keyed)

        async def settling(message: JsonObject) -> JsonObject:
            if "result" in message or "error" in message:
                settle({"result": message["result"]} if "result" in message else {"error": message["error"]})
                await keys.kept(keyed)  # the answer goes out once its key keeps it
            return await rewrite(message) if rewrite is not None else message

        upstream_ids: list[RequestId] = []  # the upstream's id of the request, once it was answered

        def unanswered(sent: Outbound) -> None:
            upstream_ids.append(sent.upstream_id)
            if sent.unsent:
                release()
            settle({"error": {"code": INTERNAL_ERROR, "message": UNANSWERED}})

        def relayed(done: asyncio.Future[web.StreamResponse]) -> None:
            if not done.cancelled() and done.exception() is not None:
                log.info("legacy_keyed_call_relay_ended", server=self.name, reason=repr(done.exception()))
            if request_id not in session.pending and not settled:
                # never sent: it failed before it went upstream (no child, no session), so the answer
                # hook never ran
                session.after_answer.pop(request_id, None)
                release()

        session.after_answer[request_id] = unanswered
        relay = asyncio.ensure_future(self.upstream.request(request, session, body, settling))
        relay.add_done_callback(relayed)
        try:
            response = await asyncio.shield(relay)  # a client that leaves does not stop it
            await keys.kept(keyed)  # (a key let go as the relay ended is let go before the answer goes)
            return response
        finally:
            if upstream_ids:  # (the relay ran in a task of its own: its log context is not this one)
                bind(upstream_request_id=upstream_ids[0])

    async def _initialize(
        self,
        request: web.Request,
        found: LegacySession | None,
        body: JsonObject,
        request_id: Any,
        principal: str,
    ) -> web.StreamResponse:
        """Relay `initialize` (v1 task capabilities stripped when the proxy serves them); the
        upstream's new session becomes one of the proxy's."""
        opening = found or self.sessions.sessionless(principal)
        try:
            stripped = await self.v1.strip_initialize(body)
        # the proxy's own initialize timed out: one init_timeout in all, not a second for this one
        except UpstreamTimeoutError as exc:
            return error_reply(request_id, INTERNAL_ERROR, str(exc))
        return await self.upstream.initialize(request, opening, stripped, self._rewrite("initialize"))

    def _rewrite(self, method: str) -> Rewrite | None:
        """How the answer to `method` is rewritten for v1 tasks (`initialize`, `tools/list`), or None."""
        return self.v1.reply_rewriter(method)

    def _cancel_overdue(self, session: LegacySession, client_id: Any, sent: Outbound) -> None:
        """CANCEL_GRACE_S after a client's cancel: a reply the upstream has not ended by then ends
        with the proxy's -32800 (an upstream that ignores cancels must not hold its client), whether
        its stream is open or the upstream has not even sent its response headers yet."""
        if session.pending.get(client_id) is not sent:
            return
        text = (
            f"cancelled by the client; upstream {self.name} did not end the request within "
            f"{CANCEL_GRACE_S:g} s"
        )
        if sent.stream is None:
            sent.abandon(REQUEST_CANCELLED, text)
        elif not sent.stream.closed:
            sent.stream.abandon(REQUEST_CANCELLED, text)

    async def _get(self, request: web.Request, session: LegacySession, sid: str) -> web.StreamResponse:
        """A GET: with `Last-Event-ID`, the rest of that stream from the proxy's buffer, then live;
        else the session's standalone stream (the one still fed, or a new one from the adapter).
        406 when the client's `Accept` rules out an SSE stream (2025-06-18 transports: a GET lists
        `text/event-stream`); no `Accept` at all takes anything."""
        if not _takes_sse(request.headers.get("Accept")):
            message = "a GET opens an SSE stream: its Accept header must list text/event-stream"
            return error_reply(None, INVALID_REQUEST, message, status=406)
        if request.headers.get("Last-Event-ID") is not None:
            return await self._resume(request, session, sid)
        live = session.get_stream
        if live is not None and live.pump is not None and not live.pump.done():
            # Still fed (the last client left it lately): go on from now.
            return await self.streams.serve(request, session, live, live.last_seq)
        return await self.upstream.open_get(request, session, sid)

    async def _resume(self, request: web.Request, session: LegacySession, sid: str) -> web.StreamResponse:
        """GET with `Last-Event-ID`: replay that stream's later events from the proxy's buffer, then
        go on live (a standalone stream whose pump ended is fed again). 400 for an id that names no
        stream of this session, or a number not minted yet."""
        parsed = parse_event_id(request.headers.get("Last-Event-ID"))
        stream = session.streams.get(parsed[0]) if parsed is not None and sid else None
        if stream is None or parsed is None or parsed[1] > stream.last_seq:
            message = (
                "Last-Event-ID names no stream of this session (unknown, expired, or not minted by this "
                "proxy); "
                "open a new GET stream without it"
            )
            return error_reply(None, INVALID_REQUEST, message, status=400)
        start, gap = stream.replay_from(parsed[1])
        notice = None
        if gap:
            notice = stream.gap_notice(parsed[1], start - 1 - parsed[1], "before this resumption")
        if stream.kind == "get" and (stream.pump is None or stream.pump.done()):
            await self.upstream.reopen_get(request, session, stream, sid)
        return await self.streams.serve(request, session, stream, start - 1, notice=notice)


_REVISION = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}")  # an MCP revision's name: its date


def _takes_sse(accept: str | None) -> bool:
    """True when an `Accept` header (None: absent) admits `text/event-stream`: absent or empty, or
    naming it, `text/*` or `*/*` with a q-value above 0."""
    if accept is None or not accept.strip():
        return True
    for item in accept.split(","):
        media, *params = (part.strip().lower() for part in item.split(";"))
        refused = any(p.replace(" ", "") in ("q=0", "q=0.0", "q=0.00", "q=0.000") for p in params)
        if media in ("text/event-stream", "text/*", "*/*") and not refused:
            return True
    return False


def _header_problem(request: web.Request) -> str | None:
    """What is wrong with a legacy request's `MCP-Protocol-Version` or `Mcp-Session-Id` header, or
    None: a version that is no revision at all, or a 2026-07-28 one on a legacy session
    (2025-11-25 transports: an unsupported version is a 400), or either header twice (which one
    counts would depend on who reads it). Any other revision passes: the HTTP upstream negotiated
    the session's and judges it. `initialize` negotiates its version in its body and is not checked
    here."""
    versions = request.headers.getall("MCP-Protocol-Version", [])
    if len(versions) > 1:
        return f"{len(versions)} MCP-Protocol-Version headers: send one"
    version = versions[0].strip() if versions else None
    if version is not None and (not _REVISION.fullmatch(version) or version in MODERN_VERSIONS):
        return (
            f"unsupported MCP-Protocol-Version {versions[0][:40]!r} on a legacy session; legacy revisions "
            "are dates such as " + ", ".join(LEGACY_VERSIONS)
        )
    if len(sessions := request.headers.getall("Mcp-Session-Id", [])) > 1:
        return f"{len(sessions)} Mcp-Session-Id headers: send one"
    return None


def _validate(body: Any) -> None:
    """A legacy POST body is one JSON-RPC request, notification or response; `initialize` is a
    request (it opens a session only with an answer). Raises JsonRpcError (-32600)."""
    if isinstance(body, dict) and "method" in body:
        jsonrpc.validate_request(body)
        if body["method"] == "initialize" and "id" not in body:
            raise JsonRpcError(INVALID_REQUEST, "initialize is a request: it needs an `id`")
    elif not jsonrpc.is_response(body):
        if isinstance(body, dict) and "id" not in body and ("result" in body or "error" in body):
            raise JsonRpcError(INVALID_REQUEST, "a response needs the `id` of the request it answers")
        jsonrpc.validate_request(body)
    elif isinstance(body["id"], bool) or not isinstance(body["id"], (str, int)):
        raise JsonRpcError(INVALID_REQUEST, "`id` must be a string or an integer")


def observe(
    server: str, method: str, body: JsonObject, response: web.StreamResponse | None, seconds: float
) -> None:
    """Count one legacy-era request like a modern one: `calls_total` for tools/call (outcome `sync`,
    or `error`, also counted in `upstream_errors_total`, for an HTTP error status or a JSON-RPC
    error in a plain JSON reply; an SSE reply is
    not read, so its tool keeps the `other` label until a call of it is seen answered), upstream
    latency (s; a method outside the legacy surface counts as `other`)."""
    known = method in LEGACY_METHODS or method in LEGACY_TASK_METHODS  # a client may send any name
    metrics.UPSTREAM_LATENCY.labels(server, method if known else metrics.OTHER).observe(seconds)
    if method == "tools/call":
        name = object_of(body.get("params")).get("name")
        tool = name if isinstance(name, str) else ""
        ok = response is not None and response.status < 400
        answered = False  # known to have got a result that is not an error (an SSE reply is not read)
        reply = getattr(response, "body", None)
        if ok and isinstance(reply, bytes) and reply[:1] == b"{":
            try:
                message = jsonrpc.loads(reply)
            except ValueError:
                message = None
            if isinstance(message, dict):
                ok = "error" not in message
                answered = metrics.succeeded(message)
        metrics.count_call(server, tool, "sync" if ok else "error", answered=answered)
        if not ok:
            metrics.UPSTREAM_ERRORS.labels(server, "request").inc()
