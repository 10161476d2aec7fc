"""The HTTP adapter of the legacy session machine: a legacy client session relayed onto an upstream
session of its own (issue 13), with the proxy owning the protocol state in between (`session.py`).

Toward the upstream it sends each message as its own HTTP exchange (redirects never followed:
configured credentials stay here), under the proxy's ids; what comes back (a JSON reply, or SSE
events read by a pump that does not depend on the client's connection) reaches the client through
the session machine, on reply streams of the proxy's own (`replay.RelayStream`). The upstream's
event ids are used only to resume the upstream's stream when it asks for polling (SEP-1699: an
event id and `retry`, then a close). A request whose upstream stream dies, closes before answering,
or outlives its bound gets a JSON-RPC error.

One piece (about 830 lines) because every path here is the same exchange with the upstream, with
one set of bounds and one id mapping: a reply plain or streamed, late or resumed, the standalone
GET stream, and the upstream errors each can meet.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from typing import Any

import aiohttp
import structlog
from aiohttp import web

from proxy.legacy.replay import RelayStream
from proxy.legacy.session import LegacySession, LegacySessions, Outbound, Question, same_id
from proxy.legacy.streams import StreamServer
from proxy.legacy.types import JSON_ONLY_REFUSAL, Rewrite, error_reply, give_up_question
from proxy.legacy.v1 import V1_TASKS_VERSION, V1Front, client_capabilities
from proxy.protocol import jsonrpc
from proxy.protocol.jsonrpc import INTERNAL_ERROR, INVALID_REQUEST, METHOD_NOT_FOUND, JsonObject, RequestId
from proxy.protocol.sse import EventTooLargeError, ReaderEvents, SseEvent
from proxy.runtime import tracing
from proxy.runtime.running import bind
from proxy.upstream.connections import UpstreamHttp
from proxy.upstream.credentials import ClientCredentials
from proxy.upstream.types import (
    MAX_RESUME_ATTEMPTS,
    MAX_RETRY_WAIT_S,
    Bounds,
    StaleConnectionError,
    UpstreamError,
    failure_text,
    read_body,
)

log = structlog.get_logger("proxy.legacy")

# What the upstream is asked for, whatever the client sent (README "Transport leniency": a body that
# parses as JSON is served without `Content-Type: application/json`, and without the full Accept).
UPSTREAM_ACCEPT = {"POST": "application/json, text/event-stream", "GET": "text/event-stream"}
FORWARD_RESPONSE_HEADERS = ("Content-Type", "Cache-Control", "MCP-Protocol-Version")
_UPSTREAM_ERRORS = (aiohttp.ClientError, OSError, TimeoutError, UpstreamError)
# No connection within connect_timeout, or none at all: the request never left the proxy.
_NEVER_SENT = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)


def _never_ran(exc: BaseException) -> bool:
    """Whether an exchange that failed with `exc` before the response headers never reached the
    upstream, or was refused before it ran: no connection, or the proxy's own token refused (a
    fresh one too) or not obtained. A request lost on a stale pooled connection may have been read."""
    if isinstance(exc, StaleConnectionError):
        return False
    return isinstance(exc, (*_NEVER_SENT, UpstreamError))


# HTTP refusals that come before a server runs anything: a redirect that asks for the same request
# elsewhere (307, 308), and a sign-in refusal. (A 303 may follow a request the server ran.)
REFUSED_UNRUN = frozenset({307, 308, 401, 403})
# How long (s) a relayed POST whose upstream answered on SSE waits for its answer alone, to send it
# as plain JSON, before its SSE stream opens (`_exchange`)
QUICK_ANSWER_S = 0.05


def _upstream_error(request_id: Any, message: str, status: int) -> web.Response:
    """An upstream failure as the legacy client gets it: for a request, its JSON-RPC error in an
    HTTP 200 (protocol.md §1.4.4: an `mcp` 1.x client raises on any other status and its whole
    transport dies); for a notification, response or GET (no id to answer), `status` (502/504)."""
    return error_reply(request_id, INTERNAL_ERROR, message, status=200 if request_id is not None else status)


def _text(body: Any) -> str:
    """A response body (bytes, or anything else aiohttp may hold: a payload) as text; "" when it is
    not bytes."""
    return body.decode("utf-8", errors="replace") if isinstance(body, bytes) else ""


def _decode(data: str) -> Any:
    """A JSON value from SSE data; None when empty or not JSON."""
    try:
        return jsonrpc.loads(data) if data.strip() else None
    except ValueError:
        return None


class HttpRelay:
    """Relays legacy sessions of server `name` to its HTTP upstream at `url` (config `headers`,
    the proxy's own token when the server has `oauth` (`credentials`), the shared `http` client,
    the server's `bounds`), serving replies through `streams`. The client's own `Authorization`
    never goes upstream."""

    kind = "http"
    sessionless = True  # an upstream may serve requests without a session

    def __init__(
        self,
        *,
        name: str,
        url: str,
        headers: dict[str, str],
        http: UpstreamHttp,
        bounds: Bounds,
        sessions: LegacySessions,
        streams: StreamServer,
        v1: V1Front,
        credentials: ClientCredentials | None = None,
    ) -> None:
        self.name = name
        self.url = url
        self.headers = headers
        self.credentials = credentials
        self.http = http
        self.bounds = bounds
        self.sessions = sessions
        self.streams = streams
        self.v1 = v1

    # -- what the endpoint asks of an adapter ---------------------------------------------------

    async def initialize(
        self, request: web.Request, session: LegacySession, body: JsonObject, rewrite: Rewrite | None
    ) -> web.StreamResponse:
        """Relay `initialize`; the upstream's new session becomes a proxy session (its own id)."""
        return await self.request(request, session, body, rewrite)

    async def request(
        self, request: web.Request, session: LegacySession, body: JsonObject, rewrite: Rewrite | None
    ) -> web.StreamResponse:
        """Relay a request under a fresh id of the session's own."""
        sent = session.send(body["id"], session.mint())
        sent.input_timeout_s = self.v1.input_timeout_s(body)
        bind(upstream_request_id=sent.upstream_id)
        return await self._forward(
            request, session, {**body, "id": sent.upstream_id}, body["id"], sent, rewrite
        )

    async def notify(
        self, request: web.Request, session: LegacySession, body: JsonObject
    ) -> web.StreamResponse:
        """Relay a notification (the upstream's status comes back)."""
        return await self._forward(request, session, body, None, None, None)

    async def cancel(
        self, request: web.Request, session: LegacySession, sent: Outbound, body: JsonObject
    ) -> web.StreamResponse:
        """Relay a cancel under the upstream id of the request it names."""
        params = {**jsonrpc.object_of(body.get("params")), "requestId": sent.upstream_id}
        return await self._forward(request, session, {**body, "params": params}, None, None, None)

    async def respond(
        self, request: web.Request, session: LegacySession, question: Question, body: JsonObject
    ) -> web.StreamResponse:
        """Relay the client's answer under the upstream's own question id."""
        return await self._forward(request, session, {**body, "id": question.upstream_id}, None, None, None)

    async def open_get(self, request: web.Request, session: LegacySession, sid: str) -> web.StreamResponse:
        """Relay the session's standalone GET stream (v1 status notifications join it)."""
        return await self._forward(request, session, None, None, None, None)

    async def reopen_get(
        self, request: web.Request, session: LegacySession, stream: RelayStream, sid: str
    ) -> None:
        """A new upstream GET feeds the standalone `stream` again; when the upstream refuses one, the
        v1 status notifications alone do (`_status_only`), or nothing."""
        upstream = await self._open_get(self._upstream_headers(request, session, "GET"))
        if upstream is not None:
            self.streams.reopen(session, stream)
            stream.feed(self._pump_get(session, stream, upstream, sid), f"legacy GET relay {self.name}")
            return
        if await self._status_only(session, sid):
            self.streams.reopen(session, stream)
            self._feed_status(session, stream, sid)

    async def _status_only(self, session: LegacySession, sid: str) -> bool:
        """Whether the proxy serves the standalone stream of a session whose upstream offers none
        (405) with the v1 status notifications alone: a 2025-11-25 session, in front of an upstream
        without tasks of its own."""
        return bool(sid) and session.version >= V1_TASKS_VERSION and not await self.v1.upstream_has_tasks()

    def _feed_status(self, session: LegacySession, stream: RelayStream, sid: str) -> None:
        """The v1 status notifications (and questions) of the session's principal feed `stream`."""
        feeding = self.v1.status_feed(stream, session.principal, sid)
        if feeding is not None:
            stream.feed(feeding, f"v1 status push {self.name}")

    async def delete(self, request: web.Request, session: LegacySession, sid: str) -> web.StreamResponse:
        """Relay DELETE; the proxy session ends when the upstream agrees."""
        return await self._forward(request, session, None, None, None, None)

    async def forget(self, session: LegacySession) -> None:
        """`DELETE` the upstream session of an expired proxy session (bounded by `request_timeout`;
        a failure is logged: the upstream then expires it on its own, if it does)."""
        if not session.upstream_id:
            return
        headers = {**self.headers, "Mcp-Session-Id": session.upstream_id}
        try:
            resp = await self._send("DELETE", b"", headers, self.bounds.request_timeout)
            resp.release()
        except _UPSTREAM_ERRORS as exc:
            log.info(
                "legacy_expired_delete_failed", server=self.name, reason=str(exc) or exc.__class__.__name__
            )

    # -- one exchange with the upstream ---------------------------------------------------------

    def _upstream_headers(self, request: web.Request, session: LegacySession, method: str) -> dict[str, str]:
        """The headers toward the upstream: the config's, the client's `MCP-Protocol-Version` and
        other `Mcp-*` headers, what the upstream is asked to accept, and its own session id."""
        headers = {**self.headers}
        for name, value in request.headers.items():
            lower = name.lower()
            if lower == "mcp-protocol-version" or (lower.startswith("mcp-") and lower != "mcp-session-id"):
                headers[name] = value
        if method in UPSTREAM_ACCEPT:
            headers["Accept"] = UPSTREAM_ACCEPT[method]
        if method == "POST":
            headers["Content-Type"] = "application/json"
        if session.upstream_id:
            headers["Mcp-Session-Id"] = session.upstream_id
        return headers

    async def _forward(
        self,
        request: web.Request,
        session: LegacySession,
        body: Any,
        request_id: RequestId | None,
        sent: Outbound | None,
        rewrite: Rewrite | None,
    ) -> web.StreamResponse:
        """One HTTP exchange with the upstream for the client's `request` (its `body` already under
        the upstream's ids; `request_id` the client's id of a request, `sent` its mapping, which
        leaves the session once answered: a later cancel for it is dropped)."""
        owner = [session]  # the session the request belongs to (a new one once an initialize opened it)
        try:
            method = body.get("method") if isinstance(body, dict) else None
            if not tracing.enabled() or not isinstance(method, str):
                return await self._exchange(request, owner, body, request_id, sent, rewrite)
            with tracing.upstream_span(self.name, method, body.get("params")) as params:
                if params is not None:
                    body = {**body, "params": params}
                return await self._exchange(request, owner, body, request_id, sent, rewrite)
        finally:
            if sent is not None and request_id is not None and (sent.stream is None or sent.stream.closed):
                owner[0].answered(request_id, sent)

    async def _exchange(
        self,
        request: web.Request,
        owner: list[LegacySession],
        body: Any,
        request_id: RequestId | None,
        sent: Outbound | None,
        rewrite: Rewrite | None,
    ) -> web.StreamResponse:
        session = owner[0]
        sid = (request.headers.get("Mcp-Session-Id") or "").strip()
        headers = self._upstream_headers(request, session, request.method)
        raw = jsonrpc.dumps(body) if body is not None else b""
        method = body.get("method") if isinstance(body, dict) else None
        # A POSTed request is bounded like the proxy's own (its hard timeout for calls), a DELETE by
        # request_timeout; a GET stream lasts as long as the client keeps it open, but the wait for
        # its response headers is bounded (connect_timeout + request_timeout), with keepalives.
        if isinstance(method, str):
            bound, key = self.bounds.for_method(method)
        elif request.method == "DELETE":
            bound, key = self.bounds.request_timeout, "request_timeout"
        else:
            bound, key = (
                self.bounds.connect_timeout + self.bounds.request_timeout,
                "connect_timeout + request_timeout",
            )
        started = asyncio.get_running_loop().time()
        opening = asyncio.ensure_future(
            self._send(
                request.method,
                raw,
                headers,
                bound,
                headers_only=request.method == "GET",
                resend=jsonrpc.safe_to_resend(body),
            )
        )
        if sent is not None:
            sent.opening = opening  # a cancel or the session's end may give it up (`Outbound.abandon`)
        # A request whose answer may come on SSE (not initialize: its reply carries the session id)
        # switches to SSE with keepalives when the upstream has not answered within keepalive_s.
        accept = request.headers.get("Accept", "")
        accepts_sse = "text/event-stream" in accept
        may_switch = request_id is not None and method != "initialize" and accepts_sse
        if request.method == "GET" or may_switch:
            try:
                done, _ = await asyncio.wait({opening}, timeout=self.streams.keepalive_s)
            except asyncio.CancelledError:
                opening.cancel()
                raise
            if not done and request.method == "GET":  # a slow upstream: the client's stream starts now
                return await self._late_get(request, session, sid, opening)
            if not done:
                assert sent is not None and isinstance(method, str)
                late = (opening, method, bound, key)
                return await self._late_post(request, session, sid, headers, late, request_id, sent, rewrite)
        try:
            upstream = await opening
            if sent is not None:
                sent.opening = None  # (its headers came: a stream, or a plain reply, carries it on)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if sent is None or sent.ended is None or (task is not None and task.cancelling()):
                raise  # this handler itself is cancelled
            code, message = sent.ended  # given up before the upstream's headers came (`Outbound.abandon`)
            return error_reply(request_id, code, message)
        except _UPSTREAM_ERRORS as exc:
            if sent is not None and _never_ran(exc):
                sent.unsent = True  # the request never left, or was refused before it ran
            message = self._failure_text(exc, bound, key)
            return _upstream_error(request_id, message, 504 if isinstance(exc, TimeoutError) else 502)
        if request.method == "GET" and upstream.status == 405 and await self._status_only(session, sid):
            upstream.release()  # no GET stream upstream: the proxy's carries the v1 status alone
            stream = self.streams.open(session, "get")
            self._feed_status(session, stream, sid)
            return await self.streams.serve(request, session, stream, headers={"Mcp-Session-Id": sid})
        if sent is not None and upstream.status in REFUSED_UNRUN:
            sent.unsent = True  # refused before it ran: a keyed call's key lets go, a retry may run it
        if (refusal := self._refusal(upstream.status)) is not None:
            upstream.release()
            return _upstream_error(request_id, refusal, 502)
        if method == "initialize" and not sid and upstream.status in (404, 405):  # no session: a wrong URL
            upstream.release()
            message = (
                f"upstream {self.name} answered initialize with HTTP {upstream.status}: no MCP endpoint "
                f"there; check mcpServers.{self.name}.url"
            )
            return _upstream_error(request_id, message, 502)
        limit = self.bounds.max_response_bytes
        is_sse = (
            upstream.headers.get("Content-Type", "").startswith("text/event-stream") and upstream.status < 300
        )
        if not is_sse and (upstream.content_length or 0) > limit:  # refused before a byte is relayed
            upstream.release()
            message = f"upstream {self.name} sent a reply larger than max_response_bytes ({limit} bytes)"
            return await self._unrelayable(request_id, message, sent, rewrite)
        out_headers = {n: upstream.headers[n] for n in FORWARD_RESPONSE_HEADERS if n in upstream.headers}
        new_upstream_sid = upstream.headers.get("Mcp-Session-Id")
        opened: tuple[str, LegacySession] | None = None  # a session this initialize opened
        if sid:
            if upstream.status == 404 or (request.method == "DELETE" and upstream.status < 300):
                self.sessions.end(sid)
            if upstream.status == 404 and sent is not None:
                sent.unsent = True  # the upstream knows no such session: it ran nothing
            out_headers["Mcp-Session-Id"] = sid
        elif new_upstream_sid and upstream.status < 400:  # (an initialize the upstream refused opens none)
            asked = jsonrpc.object_of(body.get("params") if isinstance(body, dict) else None)
            new_sid = self.sessions.open(
                new_upstream_sid,
                session.principal,
                client_capabilities(body),
                str(asked.get("protocolVersion") or ""),
            )
            out_headers["Mcp-Session-Id"] = new_sid
            new = self.sessions.get(new_sid, session.principal)
            if new is not None:
                opened = new_sid, new
                if sent is not None and request_id is not None:
                    # the initialize request now belongs to the new session
                    new.takes_over(request_id, sent, session)
                    session = owner[0] = new
        if not is_sse:
            async with upstream:
                reply = await self._plain(upstream, out_headers, request_id, sent, rewrite)
            if opened is not None and (
                "Mcp-Session-Id" not in reply.headers
                or "error" in jsonrpc.object_of(_decode(_text(reply.body)))
            ):  # an initialize that failed, or whose answer was no answer: the client gets no session
                reply.headers.pop("Mcp-Session-Id", None)
                await self._unannounced(*opened)
            return reply
        if request.method == "GET":
            stream = self.streams.open(session, "get")
            stream.feed(self._pump_get(session, stream, upstream, sid), f"legacy GET relay {self.name}")
            return await self.streams.serve(
                request, session, stream, status=upstream.status, headers=out_headers
            )
        stream = self.streams.open(session, "post", json_only=not accepts_sse)  # a client that takes no SSE
        if sent is not None:
            sent.stream = stream
        pump = self._pump_post(
            session, stream, upstream, headers, method or "", request_id, sent, bound, key, rewrite
        )
        stream.feed(pump, f"legacy POST relay {self.name}")
        if stream.json_only:
            return await self.streams.serve_json(stream, out_headers)
        if upstream.status == 200 and may_switch and ("application/json" in accept or "*/*" in accept):
            # An answer that comes alone within QUICK_ANSWER_S goes out as one plain JSON reply
            # (either form may answer a request; the client's Accept takes both): one write, where
            # an SSE reply of one event takes four (headers, priming, event, end). A slower call's
            # stream opens then, with its priming event, so it can be resumed from the start.
            left_s = self.streams.keepalive_s - (asyncio.get_running_loop().time() - started)
            wait_s = min(QUICK_ANSWER_S, left_s)
            return await self.streams.reply(request, session, stream, out_headers, wait_s=wait_s)
        return await self.streams.serve(request, session, stream, status=upstream.status, headers=out_headers)

    async def _unrelayable(
        self, request_id: RequestId | None, message: str, sent: Outbound | None, rewrite: Rewrite | None
    ) -> web.Response:
        """The proxy's -32603 `message` for a reply the upstream sent but the proxy cannot relay (too
        large): `rewrite` sees it as the answer, so a keyed call's key keeps what its client got (the
        call ran), not "ended without an answer"."""
        if rewrite is not None and sent is not None and request_id is not None:
            await rewrite(jsonrpc.error_response(request_id, {"code": INTERNAL_ERROR, "message": message}))
        return _upstream_error(request_id, message, 502)

    async def _refused(
        self,
        session: LegacySession,
        request_id: RequestId | None,
        sent: Outbound,
        rewrite: Rewrite | None,
        error: JsonObject,
    ) -> JsonObject:
        """The JSON-RPC `error` response for a request whose reply already is an SSE stream. When
        the upstream never ran it (`sent.unsent`), its idempotency key (the keyed call's `rewrite`)
        lets go first, and the error goes out once that is written: a retry sent at once runs."""
        message = jsonrpc.error_response(request_id, error)
        if not sent.unsent or rewrite is None:
            return message
        session.answered(request_id, sent)  # (its key lets go now)
        return await rewrite(message)

    def _refusal(self, status: int) -> str | None:
        """What a client is told of an upstream HTTP answer that is a refusal, not a reply (None for
        any other status): a redirect (never followed: configured credentials stay here), or the
        upstream's own sign-in (not the client's to answer)."""
        if 300 <= status < 400:
            return f"upstream {self.name} answered HTTP {status} (a redirect); redirects are not followed"
        if status in (401, 403):
            return (
                f"upstream {self.name} refused the proxy (HTTP {status}): it wants credentials; configure "
                f"mcpServers.{self.name}.oauth or headers"
            )
        return None

    def _failure_text(self, exc: BaseException, bound: float, key: str) -> str:
        """What a client is told of an exchange that failed before the upstream's response headers:
        `bound` (s) passed (the config `key` that sets it), a stale pooled connection, the proxy's
        own upstream token refused or not obtained, or no connection at all (unreachable)."""
        if isinstance(exc, UpstreamError):  # stale connection, or the proxy's own token: their own words
            return str(exc)
        if isinstance(exc, TimeoutError) and not isinstance(exc, aiohttp.ConnectionTimeoutError):
            return f"upstream {self.name} did not answer within {bound:g} s ({key})"
        return failure_text(self.name, exc, self.url)

    async def _unannounced(self, new_sid: str, session: LegacySession) -> None:
        """End session `new_sid`, just opened by an initialize whose reply failed on its way (an
        unreadable or foreign answer: the client gets an error without the session's id, so it could
        never use nor end it), and its upstream side (`forget`, bounded by `request_timeout`)."""
        self.sessions.end(new_sid)
        await self.forget(session)

    async def _late_post(
        self,
        request: web.Request,
        session: LegacySession,
        sid: str,
        headers: dict[str, str],
        late: tuple[asyncio.Future[aiohttp.ClientResponse], str, float, str],
        request_id: RequestId | None,
        sent: Outbound,
        rewrite: Rewrite | None,
    ) -> web.StreamResponse:
        """A request the upstream has not answered within `keepalive_s` (a slow JSON-mode upstream,
        or one slow to start its stream): the client's reply becomes an SSE stream at once, with
        keepalives (as in front of a stdio child); the upstream's JSON reply, its SSE events, or a
        JSON-RPC error naming the failure follow on it. `late` is the exchange still opening, the
        request's method, and its bound (s) with the config key that sets it."""
        opening, method, bound, key = late
        stream = self.streams.open(session, "post")
        sent.stream = stream

        async def pump() -> None:
            try:
                upstream = await opening
            except asyncio.CancelledError:
                if stream.ended is not None:  # the session ended, or the client cancelled, meanwhile
                    code, message = stream.ended
                    stream.append_message(
                        jsonrpc.error_response(request_id, {"code": code, "message": message})
                    )
                stream.close()
                session.answered(request_id, sent)  # no answer will come: its key and the session move on
                raise
            except _UPSTREAM_ERRORS as exc:
                sent.unsent = _never_ran(exc)
                error = {"code": INTERNAL_ERROR, "message": self._failure_text(exc, bound, key)}
                stream.append_message(await self._refused(session, request_id, sent, rewrite, error))
                stream.close()
                session.answered(request_id, sent)  # (answered, with the error)
                return
            finally:
                opening.cancel()  # this task was cancelled while waiting: so is the exchange
            if upstream.status == 404 and sid:
                self.sessions.end(sid)
                sent.unsent = True  # the upstream knows no such session: it ran nothing
            if upstream.status in REFUSED_UNRUN:
                sent.unsent = True  # refused before it ran
            if (
                upstream.headers.get("Content-Type", "").startswith("text/event-stream")
                and upstream.status < 300
            ):
                await self._pump_post(
                    session, stream, upstream, headers, method, request_id, sent, bound, key, rewrite
                )
                return
            try:
                limit = self.bounds.max_response_bytes
                refusal = self._refusal(upstream.status)
                if refusal is not None or (upstream.content_length or 0) > limit:
                    upstream.release()
                    text = (
                        refusal
                        or f"upstream {self.name} sent a reply larger than max_response_bytes ({limit} bytes)"
                    )
                    error = {"code": INTERNAL_ERROR, "message": text}
                    stream.append_message(await self._refused(session, request_id, sent, rewrite, error))
                else:
                    async with upstream:
                        plain = await self._plain(upstream, {}, request_id, sent, rewrite)
                    data = plain.body if isinstance(plain.body, bytes) else b""
                    if data:
                        stream.append(SseEvent("message", data.decode("utf-8", errors="replace"), None, None))
            finally:
                stream.close()
                session.answered(request_id, sent)

        stream.feed(pump(), f"legacy POST relay {self.name}")
        return await self.streams.serve(
            request, session, stream, headers={"Mcp-Session-Id": sid} if sid else None
        )

    async def _plain(
        self,
        upstream: aiohttp.ClientResponse,
        out_headers: dict[str, str],
        request_id: RequestId | None,
        sent: Outbound | None,
        rewrite: Rewrite | None,
    ) -> web.Response:
        """A plain (non-SSE) reply, read whole (it is bounded): what goes out is always JSON-RPC,
        under the client's id. `rewrite` sees the answer whoever wrote it (the upstream, or the
        proxy for a reply that was not JSON-RPC, such as an HTML error page), so that a keyed
        call's key keeps the error its client got; not for a request the upstream never ran (404)."""
        try:
            data = await read_body(upstream, self.bounds.max_response_bytes, self.name)
        except UpstreamError as exc:
            return await self._unrelayable(request_id, str(exc), sent, rewrite)
        status, data = as_jsonrpc_reply(
            self.name,
            upstream.status,
            data,
            request_id,
            upstream.headers.get("Retry-After"),
            in_session="Mcp-Session-Id" in out_headers,
        )
        message = _decode(data.decode("utf-8", errors="replace")) if data else None
        if isinstance(message, dict) and jsonrpc.is_response(message):
            answer = message
            if sent is not None and same_id(message.get("id"), sent.upstream_id):
                answer = {**message, "id": request_id}
            elif "error" in message and upstream.status >= 400 and message.get("id") != request_id:
                # An HTTP refusal whose error carries a null or made-up id ("server-error", the SDK's
                # "Missing session ID"): it answers this request, so the client gets it under its id
                # and with the upstream's status, not a 200 it cannot match.
                log.info("legacy_upstream_refused", server=self.name, status=upstream.status)
                answer = {**message, "id": request_id}
            elif message.get("id") is not None and message.get("id") != request_id:
                log.warning(
                    "legacy_foreign_response_dropped",
                    server=self.name,
                    reason="a reply for another request id",
                )
                message_text = f"upstream {self.name} answered with a response for another request id"
                return _upstream_error(request_id, message_text, 502)
            if rewrite is not None and sent is not None and not sent.unsent:
                answer = await rewrite(answer)
            if answer is not message:
                data = jsonrpc.dumps(answer)
        if (
            data
            and status != upstream.status
            or not out_headers.get("Content-Type", "").startswith("application/json")
        ):
            out_headers["Content-Type"] = (
                "application/json" if data else out_headers.get("Content-Type", "application/json")
            )
        return web.Response(status=status, body=data, headers=out_headers)

    async def _pump_post(
        self,
        session: LegacySession,
        stream: RelayStream,
        upstream: aiohttp.ClientResponse,
        headers: dict[str, str],
        method: str,
        request_id: RequestId | None,
        sent: Outbound | None,
        bound: float | None,
        key: str,
        rewrite: Rewrite | None,
    ) -> None:
        """Read a POST's upstream stream into `stream` until the answer; resume the upstream (GET +
        its `Last-Event-ID`) when it asked for polling; else end with a JSON-RPC error."""
        answered = request_id is None
        reason = "closed the stream before answering"
        last_upstream_id: str | None = None
        resp: aiohttp.ClientResponse | None = upstream
        fruitless = 0
        overdue: list[asyncio.Task[None]] = []  # one per question relayed: its `input_timeout`
        try:
            async with asyncio.timeout(bound):
                while resp is not None:
                    retry_ms: int | None = None
                    got = 0
                    try:
                        async with resp:
                            async for event in ReaderEvents(
                                resp.content, max_event_bytes=self.bounds.max_response_bytes
                            ):
                                got += 1
                                last_upstream_id = event.id if event.id is not None else last_upstream_id
                                retry_ms = event.retry if event.retry is not None else retry_ms
                                out, answers, question = self._from_upstream(session, event, sent, request_id)
                                if out is None:
                                    continue
                                if question is not None:
                                    refusal = (
                                        JSON_ONLY_REFUSAL
                                        if stream.json_only
                                        else session.undeclared(question)
                                    )
                                    if refusal is not None:
                                        await self._answer_question(
                                            session, question["id"], headers, METHOD_NOT_FOUND, refusal
                                        )
                                        continue
                                if answers and rewrite is not None:
                                    rewritten = await rewrite(jsonrpc.loads(out.data))
                                    out = SseEvent(out.event, jsonrpc.dumps_str(rewritten), None, out.retry)
                                await stream.push(out)
                                if question is not None and sent is not None and sent.input_timeout_s:
                                    overdue.append(
                                        asyncio.ensure_future(
                                            give_up_question(
                                                stream,
                                                question["id"],
                                                sent.input_timeout_s,
                                                functools.partial(
                                                    self._answer_question, session, question["id"], headers
                                                ),
                                                self.name,
                                            )
                                        )
                                    )
                                if answers:
                                    answered = True
                                    return
                    except (*_UPSTREAM_ERRORS, EventTooLargeError) as exc:
                        reason = f"broke its stream: {str(exc) or exc.__class__.__name__}"
                        retry_ms = None
                    fruitless = 0 if got else fruitless + 1
                    if (
                        answered
                        or retry_ms is None
                        or last_upstream_id is None
                        or fruitless >= MAX_RESUME_ATTEMPTS
                    ):
                        break
                    # SSE polling (SEP-1699): the upstream closed on purpose; the client gets the same.
                    stream.cut()
                    await asyncio.sleep(min(retry_ms / 1000, MAX_RETRY_WAIT_S))
                    get_headers = {k: v for k, v in headers.items() if k.lower() != "content-type"}
                    get_headers["Accept"] = "text/event-stream"
                    resp = await self._open_get(get_headers, last_upstream_id)
                    if resp is None:
                        reason = "closed the stream before answering and refused to resume it"
        except TimeoutError:
            reason = f"did not answer {method} within {bound:g} s ({key})" if bound else "timed out"
        finally:
            for waiting in overdue:
                waiting.cancel()
            if not answered:
                code, text = stream.ended or (INTERNAL_ERROR, f"upstream {self.name} {reason}")
                log.warning("legacy_relay_broken", server=self.name, reason=text)
                stream.append_message(jsonrpc.error_response(request_id, {"code": code, "message": text}))
            stream.close()  # nobody reading it: kept LINGER_S for a resumption, then forgotten
            if sent is not None and request_id is not None:
                session.answered(request_id, sent)

    def _from_upstream(
        self, session: LegacySession, event: SseEvent, sent: Outbound | None, request_id: RequestId | None
    ) -> tuple[SseEvent | None, bool, JsonObject | None]:
        """One upstream event as the client gets it (the session machine maps its ids), whether it
        answers the client's request, and the question it asks (a server→client request, under its
        proxy id), if any. A priming event (no data) passes; garbage does not."""
        message = _decode(event.data)
        if not isinstance(message, dict):
            return (event if not event.data.strip() else None), False, None
        out, answers = session.to_client(message, sent, request_id)
        if out is None:
            return None, False, None
        data = event.data if out is message else jsonrpc.dumps_str(out)  # unchanged: byte for byte
        question = out if not answers and jsonrpc.is_request(out) else None
        return SseEvent(event.event, data, None, event.retry), answers, question

    async def _answer_question(
        self, session: LegacySession, proxy_id: Any, headers: dict[str, str], code: int, text: str
    ) -> bool:
        """Answer the upstream's question `proxy_id` in the client's place with error `code` and
        `text` (a client that cannot be asked, or one that did not answer within `input_timeout`),
        so the upstream does not wait for it until its call's timeout. False when the question is no
        longer open (answered, withdrawn). `headers` are the call's upstream headers."""
        question = session.take_answer(proxy_id)
        if question is None:
            return False
        reply = jsonrpc.error_response(question.upstream_id, {"code": code, "message": text})
        log.info("legacy_question_refused", server=self.name, reason=text)
        try:
            resp = await self._send("POST", jsonrpc.dumps(reply), headers, self.bounds.request_timeout)
            resp.release()
        except _UPSTREAM_ERRORS as exc:
            log.info(
                "legacy_question_refusal_failed", server=self.name, reason=str(exc) or exc.__class__.__name__
            )
        return True

    async def _send(
        self,
        method: str,
        raw: bytes,
        headers: dict[str, str],
        bound: float,
        *,
        headers_only: bool = False,
        resend: bool = False,
    ) -> aiohttp.ClientResponse:
        """One upstream HTTP exchange (redirects never followed: configured credentials stay here).
        Bounded by `bound` (s): the whole exchange, or with `headers_only` (a GET stream, which
        lasts as long as the client keeps it) only the wait for the response headers. With
        `credentials`, the proxy's token goes along, fetched again once on a 401. Raises
        aiohttp.ClientError, OSError, TimeoutError or UpstreamError (no token). With `resend` (the
        body is safe to send twice), one lost on a stale pooled connection goes again on a fresh one."""
        if self.credentials is None:
            return await self._send_once(method, raw, headers, bound, headers_only, resend)
        headers = {**headers, **await self.credentials.ensure()}
        resp = await self._send_once(method, raw, headers, bound, headers_only, resend)
        if resp.status == 401:
            resp.release()
            headers = {**headers, **await self.credentials.refused(headers)}
            # on a fresh connection: a server may close the one it answered 401 on
            resp = await self._send_once(method, raw, headers, bound, headers_only, resend, fresh=True)
            if resp.status == 401:
                resp.release()
                raise UpstreamError(
                    f"upstream {self.name} refused the proxy's token (HTTP 401), a fresh one too: check "
                    f"mcpServers.{self.name}.oauth"
                )
        return resp

    async def _send_once(
        self,
        method: str,
        raw: bytes,
        headers: dict[str, str],
        bound: float,
        headers_only: bool,
        resend: bool,
        *,
        fresh: bool = False,
    ) -> aiohttp.ClientResponse:
        # No sock_read: `total` already bounds every read of the body (and a read timer, rescheduled
        # at each chunk, costs a timer per relayed event).
        timeout = aiohttp.ClientTimeout(
            total=None if headers_only else bound, sock_connect=self.bounds.connect_timeout
        )
        async with asyncio.timeout(bound if headers_only else None):
            return await self.http.request(
                method,
                self.url,
                resend=resend,
                fresh=fresh,
                data=raw if method == "POST" else None,
                headers=headers,
                allow_redirects=False,
                timeout=timeout,
            )

    # -- the standalone GET stream ------------------------------------------------------------

    async def _late_get(
        self,
        request: web.Request,
        session: LegacySession,
        sid: str,
        opening: asyncio.Future[aiohttp.ClientResponse],
    ) -> web.StreamResponse:
        """A standalone GET whose upstream has not answered within `keepalive_s`: the client's SSE
        stream starts at once (keepalives while the upstream's headers are awaited, within their
        bound); a refusal, an error or the bound ends the stream, an upstream SSE stream feeds it."""
        stream = self.streams.open(session, "get")

        async def pump() -> None:
            try:
                upstream = await opening
            except _UPSTREAM_ERRORS as exc:
                log.info(
                    "legacy_upstream_get_failed", server=self.name, reason=str(exc) or exc.__class__.__name__
                )
                stream.close()
                return
            finally:
                opening.cancel()  # this task was cancelled while waiting: so is the exchange
            if upstream.status == 404 and sid:
                self.sessions.end(sid)
            if upstream.status != 200 or not upstream.headers.get("Content-Type", "").startswith(
                "text/event-stream"
            ):
                upstream.release()
                stream.close()
                return
            await self._pump_get(session, stream, upstream, sid)

        stream.feed(pump(), f"legacy GET relay {self.name}")
        return await self.streams.serve(
            request, session, stream, headers={"Mcp-Session-Id": sid} if sid else None
        )

    async def _open_get(
        self, headers: dict[str, str], last_event_id: str | None = None
    ) -> aiohttp.ClientResponse | None:
        """An upstream GET stream (resuming after `last_event_id`), or None when the upstream
        refuses one or sends no headers within connect_timeout + request_timeout."""
        if last_event_id is not None:
            headers = {**headers, "Last-Event-ID": last_event_id}
        bound = self.bounds.connect_timeout + self.bounds.request_timeout
        try:
            resp = await self._send("GET", b"", headers, bound, headers_only=True)
        except _UPSTREAM_ERRORS as exc:
            log.info(
                "legacy_upstream_get_failed", server=self.name, reason=str(exc) or exc.__class__.__name__
            )
            return None
        if resp.status != 200 or not resp.headers.get("Content-Type", "").startswith("text/event-stream"):
            resp.release()
            return None
        return resp

    async def _pump_get(
        self, session: LegacySession, stream: RelayStream, upstream: aiohttp.ClientResponse, sid: str
    ) -> None:
        """Read the upstream's standalone GET stream into `stream` (with the v1 status notifications
        of the session's principal) until the upstream ends it or no client reads it any more."""
        feeding = self.v1.status_feed(stream, session.principal, sid) if sid else None
        status = (
            asyncio.get_running_loop().create_task(feeding, name=f"v1 status push {self.name}")
            if feeding
            else None
        )
        try:
            async with upstream:
                async for event in ReaderEvents(
                    upstream.content, max_event_bytes=self.bounds.max_response_bytes
                ):
                    out, _, _ = self._from_upstream(session, event, None, None)
                    if out is not None:
                        await stream.push(out)
        except (*_UPSTREAM_ERRORS, EventTooLargeError) as exc:
            log.info("legacy_get_stream_ended", server=self.name, reason=str(exc) or exc.__class__.__name__)
        finally:
            if status is not None:
                status.cancel()
            stream.close()
            with contextlib.suppress(Exception):
                upstream.release()


def as_jsonrpc_reply(
    server: str,
    status: int,
    data: bytes,
    request_id: Any,
    retry_after: str | None = None,
    *,
    in_session: bool = False,
) -> tuple[int, bytes]:
    """An upstream's plain (non-SSE) reply as the client gets it, as (HTTP status, body).

    Answering a notification or a response (`request_id` None), a JSON-RPC message or an empty body
    (202) passes as is. What answers a request must be its answer: a response fit for an MCP
    client (`jsonrpc.response_problem`), or for an HTTP error status a well-formed JSON-RPC error
    (placed under the request's id even when it carries none; a 4xx keeps its status, except for a
    request of an open session (`in_session`), which the proxy checked before it went on: the
    upstream's refusal of it goes out in an HTTP 200). An empty
    body, a null or non-object result, both result and error, a malformed error, JSON that is no
    JSON-RPC answer, or no JSON at all (an HTML error page, plain text) becomes a -32603 error (a
    client waits for an answer that never comes, or fails to parse it) naming what came, with the
    upstream's status and `Retry-After` (s, for a 429 or 503) for a body that is not JSON-RPC.
    A 404 passes with its status whatever its body (the session is gone: the client initializes
    again). Every other failure answering a request goes out as HTTP 200, the JSON-RPC error
    inside (protocol.md §1.4.4: an `mcp` 1.x client raises on any other status and its whole
    transport dies); answering a notification or response, a 5xx goes out as 502, a 4xx as it
    came, as -32600 (the upstream refused what the client sent)."""
    failed = 200 if request_id is not None else 502
    message: Any = None
    if data.strip():
        try:
            message = jsonrpc.loads(data)
        except (ValueError, UnicodeDecodeError):
            message = None
        if isinstance(message, dict) and message.get("jsonrpc") == "2.0":
            if request_id is None or status == 404:
                return (status if status < 500 else failed), data
            if status >= 400 and "error" in message and "result" not in message and "method" not in message:
                # a refusal: its error answers this request, whatever id it carries (`_plain`)
                problem = jsonrpc.response_problem(message) or ""
                if not problem and "id" not in message:
                    data = jsonrpc.dumps({**message, "id": None})  # (so that `_plain` places it)
            elif status >= 400:
                problem = "something that is not a JSON-RPC error"
            else:
                problem = "something that is not a JSON-RPC response"
                if jsonrpc.is_response(message):
                    problem = jsonrpc.response_problem(message) or ""
            if not problem:
                return (status if status < 500 and not in_session else failed), data
            error = jsonrpc.unfit_answer_error(f"upstream {server}", problem, message)
            return failed, jsonrpc.dumps(jsonrpc.error_response(request_id, error))
    elif status < 400:
        if request_id is None:
            return status, data
        text = f"upstream {server} answered the request with HTTP {status} and no body, not its response"
        return failed, jsonrpc.dumps(
            jsonrpc.error_response(request_id, jsonrpc.error_object(INTERNAL_ERROR, text))
        )
    refused = 400 <= status < 500 and (request_id is None or status == 404)
    text = data[:200].decode("utf-8", errors="replace").strip()
    what = "" if status >= 400 else " with a body that is not JSON-RPC"
    later = (
        f" (retry after {retry_after.strip()} s)"
        if status in (429, 503) and retry_after and retry_after.strip().isdigit()
        else ""
    )
    error = {
        "code": INVALID_REQUEST if refused else INTERNAL_ERROR,
        "message": f"upstream {server} answered HTTP {status}{what}{later}" + (f": {text}" if text else ""),
    }
    return (status if refused else failed), jsonrpc.dumps(jsonrpc.error_response(request_id, error))
