"""The HTTP legacy relay: a legacy (2025-06-18 / 2025-11-25) client session relayed onto an upstream
session of its own, with the proxy owning the protocol state in between (issue 13).

Like the stdio bridge, the relay speaks for itself toward both sides:

- its own JSON-RPC ids toward the upstream (`LegacySession.mint`), mapped back per client session;
  server→client requests get proxy ids toward the client, answered upstream at most once;
- its own SSE event ids toward the client (`replay.RelayStream`), with `Last-Event-ID` resumption
  from its own bounded buffer; the upstream's event ids are used only to resume the upstream
  stream when the upstream asks for polling (SEP-1699: an event id and `retry`, then a close);
- an SSE comment every `listen.sse_keepalive` on every relayed stream, POST and GET;
- a JSON-RPC error for a request whose upstream stream dies, closes before answering, or outlives
  its bound; a `notifications/cancelled` for a request already answered is not forwarded.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import structlog
from aiohttp import web

from proxy.legacy.replay import RelayStream
from proxy.legacy.sessions import LegacySession, as_jsonrpc_reply, read_limited
from proxy.legacy.streams import RelayStreams
from proxy.legacy.streams import decode as _decode
from proxy.legacy.streams import dumps as _dumps
from proxy.legacy.streams import json_error as _json_error
from proxy.legacy.v1 import client_capabilities
from proxy.protocol import jsonrpc
from proxy.protocol.jsonrpc import INTERNAL_ERROR, INVALID_REQUEST, JsonRpcError
from proxy.protocol.sse import (
    MAX_RESUME_ATTEMPTS,
    MAX_RETRY_WAIT_S,
    EventTooLargeError,
    ReaderEvents,
    SseEvent,
)

log = structlog.get_logger("proxy.transport")

FORWARD_REQUEST_HEADERS = ("MCP-Protocol-Version",)
# What the upstream is asked for, whatever the client sent (README "Transport leniency": a body that
# parses as JSON is served without `Content-Type: application/json`, and without the full Accept).
UPSTREAM_ACCEPT = {"POST": "application/json, text/event-stream", "GET": "text/event-stream"}
FORWARD_RESPONSE_HEADERS = ("Content-Type", "Cache-Control", "MCP-Protocol-Version")


def _upstream_error(request_id: Any, exc: JsonRpcError, status: int) -> web.Response:
    """An upstream failure as the legacy client gets it: for a request, its JSON-RPC error in an
    HTTP 200 (protocol.md §1.4.4: an `mcp` 1.x client raises on any other status and its whole
    transport dies); for a notification, response or GET (no id to answer), `status` (502/504)."""
    return _json_error(request_id, exc, status=200 if request_id is not None else status)


class LegacyRelay(RelayStreams):
    """Relays legacy sessions of one HTTP upstream: ids, POST exchanges and their streams (the
    stream half, GET and resumption, is `RelayStreams`)."""

    # -- entry ---------------------------------------------------------------------------------

    async def handle(
        self, request: web.Request, *, body: Any, raw: bytes, request_id: Any, principal: str
    ) -> web.StreamResponse:
        """Relay one legacy-era HTTP request (POST, GET or DELETE, already validated) to the upstream."""
        headers = {**self.headers}
        for name in FORWARD_REQUEST_HEADERS:
            if name in request.headers:
                headers[name] = request.headers[name]
        if request.method in UPSTREAM_ACCEPT:
            headers["Accept"] = UPSTREAM_ACCEPT[request.method]
        if request.method == "POST":
            headers["Content-Type"] = "application/json"
        for name, value in request.headers.items():
            if name.lower().startswith("mcp-") and name.lower() not in (
                "mcp-session-id",
                "mcp-protocol-version",
            ):
                headers[name] = value
        sid = (request.headers.get("Mcp-Session-Id") or "").strip()
        session = self.legacy.sessionless(principal)  # session-less traffic: scoped to its principal
        if sid:
            found = self.legacy.get(sid, principal)
            if found is None:
                return _json_error(
                    request_id,
                    JsonRpcError(INVALID_REQUEST, "unknown or expired session; initialize a new one"),
                    status=404,
                )
            session = found
            if found.upstream_id:
                headers["Mcp-Session-Id"] = found.upstream_id
        version = request.headers.get("MCP-Protocol-Version") or session.version or None
        if request.method == "POST" and await self.v1.intercepts(body, principal, version):
            if not sid:
                return _json_error(
                    request_id,
                    JsonRpcError(INVALID_REQUEST, "missing Mcp-Session-Id: initialize first"),
                    status=400,
                )
            return await self.v1.handle(
                request,
                self.v1.for_version(body, version),
                principal=principal,
                capabilities=session.capabilities,
            )
        if request.method == "GET" and request.headers.get("Last-Event-ID") is not None:
            return await self._resume(request, session, sid, headers)
        live = session.get_stream
        if request.method == "GET" and live is not None and live.pump is not None and not live.pump.done():
            # The upstream GET stream is still read (the last client left it lately): go on from now.
            return await self._serve(request, session, live, live.last_seq)
        upstream_rid: int | None = None
        if request.method == "POST" and isinstance(body, dict):
            if body.get("method") == "initialize":
                body = await self.v1.strip_initialize(body)
            if jsonrpc.is_response(body):
                target = session.request_ids.pop(body["id"], None)
                if target is None:  # unknown, or already answered: never reaches the upstream
                    log.info(
                        "legacy_response_dropped",
                        server=self.name,
                        reason="no pending server request has this id",
                    )
                    return web.Response(status=202)
                body = {**body, "id": target}
            elif "id" not in body and body.get("method") == "notifications/cancelled":
                params = body.get("params") if isinstance(body.get("params"), dict) else {}
                cancelled = params.get("requestId")
                target_rid = session.pending.get(cancelled) if isinstance(cancelled, (str, int)) else None
                if target_rid is None:  # answered already (or never sent): the upstream must not see it
                    log.info("legacy_cancel_dropped", server=self.name, reason="the request is not in flight")
                    return web.Response(status=202)
                body = {**body, "params": {**params, "requestId": target_rid}}
            elif "id" in body:
                upstream_rid = session.mint()
                session.pending[body["id"]] = upstream_rid
                body = {**body, "id": upstream_rid}
            raw = _dumps(body).encode()
        try:
            return await self._forward(
                request,
                session,
                sid,
                headers,
                body=body,
                raw=raw,
                request_id=request_id,
                upstream_rid=upstream_rid,
                principal=principal,
            )
        finally:
            if (
                upstream_rid is not None and session.pending.get(request_id) == upstream_rid
            ):  # (an answered one left already)
                if not any(s.upstream_rid == upstream_rid and not s.closed for s in session.streams.values()):
                    session.pending.pop(request_id, None)

    # -- one exchange with the upstream ---------------------------------------------------------

    async def _forward(
        self,
        request: web.Request,
        session: LegacySession,
        sid: str,
        headers: dict[str, str],
        *,
        body: Any,
        raw: bytes,
        request_id: Any,
        upstream_rid: int | None,
        principal: str,
    ) -> web.StreamResponse:
        method = body.get("method") if request.method == "POST" and isinstance(body, dict) else None
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
        opening = asyncio.ensure_future(
            self._send(request.method, raw, headers, bound, headers_only=request.method == "GET")
        )
        # A request whose answer may come on SSE (not initialize: its reply carries the session id)
        # switches to SSE with keepalives when the upstream has not answered within keepalive_s.
        may_switch = (
            request_id is not None
            and method not in (None, "initialize")
            and "text/event-stream" in request.headers.get("Accept", "")
        )
        if request.method == "GET" or may_switch:
            try:
                done, _ = await asyncio.wait({opening}, timeout=self.keepalive_s)
            except asyncio.CancelledError:
                opening.cancel()
                raise
            if (
                not done and request.method == "GET"
            ):  # a slow upstream: the client's stream starts now, with keepalives
                return await self._late_get(request, session, sid, opening)
            if not done:
                return await self._late_post(
                    request, session, sid, headers, opening, str(method), request_id, upstream_rid, bound, key
                )
        try:
            upstream = await opening
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            reason = (
                f"no answer within {bound:g} s ({key})"
                if isinstance(exc, asyncio.TimeoutError)
                else f"{exc.__class__.__name__}: {exc}"
            )
            err = JsonRpcError(INTERNAL_ERROR, f"upstream {self.name} unreachable: {reason}")
            return _upstream_error(request_id, err, 504 if isinstance(exc, asyncio.TimeoutError) else 502)
        if 300 <= upstream.status < 400:
            upstream.release()
            err = JsonRpcError(
                INTERNAL_ERROR,
                f"upstream {self.name} answered HTTP {upstream.status} (a redirect); redirects are not followed",
            )
            return _upstream_error(request_id, err, 502)
        limit = self.bounds.max_response_bytes
        is_sse = (
            upstream.headers.get("Content-Type", "").startswith("text/event-stream") and upstream.status < 300
        )
        if not is_sse and (upstream.content_length or 0) > limit:  # refused before a byte is relayed
            upstream.release()
            err = JsonRpcError(
                INTERNAL_ERROR,
                f"upstream {self.name} sent a reply larger than max_response_bytes ({limit} bytes)",
            )
            return _upstream_error(request_id, err, 502)
        out_headers = {n: upstream.headers[n] for n in FORWARD_RESPONSE_HEADERS if n in upstream.headers}
        upstream_new_sid = upstream.headers.get("Mcp-Session-Id")
        if sid:
            if upstream.status == 404 or (request.method == "DELETE" and upstream.status < 300):
                self.legacy.end(sid)
            out_headers["Mcp-Session-Id"] = sid
        elif upstream_new_sid:
            out_headers["Mcp-Session-Id"] = self.legacy.open(
                upstream_new_sid, principal, capabilities=client_capabilities(body)
            )
            new = self.legacy.get(out_headers["Mcp-Session-Id"], principal)
            asked: Any = body.get("params") if isinstance(body, dict) else None
            if new is not None and isinstance(asked, dict):
                new.version = str(asked.get("protocolVersion") or "")
            if (
                new is not None and upstream_rid is not None
            ):  # the initialize request now belongs to the new session
                session.pending.pop(request_id, None)
                new.pending[request_id] = upstream_rid
                session = new
        if not is_sse:
            try:
                async with upstream:
                    return await self._plain(upstream, out_headers, method, request_id, upstream_rid)
            finally:
                if upstream_rid is not None and session.pending.get(request_id) == upstream_rid:
                    session.pending.pop(request_id, None)  # answered: a later cancel for it is not forwarded
        stream = RelayStream(
            kind="get" if request.method == "GET" else "post",
            max_events=self.replay_events,
            max_bytes=self.replay_bytes,
        )
        stream.upstream_rid = upstream_rid
        self._remember(session, stream)
        loop = asyncio.get_running_loop()
        if request.method == "GET":
            if session.get_stream is not None and session.get_stream.pump is not None:
                session.get_stream.pump.cancel()  # a new standalone stream replaces the old one
            session.get_stream = stream
            stream.pump = loop.create_task(
                self._pump_get(session, stream, upstream, sid), name=f"legacy GET relay {self.name}"
            )
        else:
            stream.json_only = "text/event-stream" not in request.headers.get(
                "Accept", ""
            )  # a client that takes no SSE
            stream.pump = loop.create_task(
                self._pump_post(
                    session, stream, upstream, headers, method or "", request_id, upstream_rid, bound, key
                ),
                name=f"legacy POST relay {self.name}",
            )
        if stream.json_only:
            return await self._serve_json(stream, out_headers)
        return await self._serve(request, session, stream, 0, status=upstream.status, headers=out_headers)

    async def _late_post(
        self,
        request: web.Request,
        session: LegacySession,
        sid: str,
        headers: dict[str, str],
        opening: asyncio.Future[aiohttp.ClientResponse],
        method: str,
        request_id: Any,
        upstream_rid: int | None,
        bound: float,
        key: str,
    ) -> web.StreamResponse:
        """A request the upstream has not answered within `keepalive_s` (a slow JSON-mode upstream,
        or one slow to start its stream): the client's reply becomes an SSE stream at once, with
        keepalives (as the stdio bridge does); the upstream's JSON reply, its SSE events, or a
        JSON-RPC error naming the failure follow on it."""
        stream = RelayStream(kind="post", max_events=self.replay_events, max_bytes=self.replay_bytes)
        stream.upstream_rid = upstream_rid
        self._remember(session, stream)

        async def pump() -> None:
            try:
                upstream = await opening
            except asyncio.CancelledError:
                if stream.ended_by:  # the session ended while the upstream was awaited
                    stream.append(
                        SseEvent(
                            "message",
                            _dumps(
                                jsonrpc.error_response(
                                    request_id, {"code": INTERNAL_ERROR, "message": self._ended(stream)}
                                )
                            ),
                            None,
                            None,
                        )
                    )
                stream.close()
                raise
            except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                reason = (
                    f"no answer within {bound:g} s ({key})"
                    if isinstance(exc, asyncio.TimeoutError)
                    else f"{exc.__class__.__name__}: {exc}"
                )
                reply = jsonrpc.error_response(
                    request_id,
                    {"code": INTERNAL_ERROR, "message": f"upstream {self.name} unreachable: {reason}"},
                )
                stream.append(SseEvent("message", _dumps(reply), None, None))
                stream.close()
                if session.pending.get(request_id) == upstream_rid:  # answered (with the error)
                    session.pending.pop(request_id, None)
                return
            finally:
                opening.cancel()  # this task was cancelled while waiting: so is the exchange
            if upstream.status == 404 and sid:
                self.legacy.end(sid)
            if (
                upstream.headers.get("Content-Type", "").startswith("text/event-stream")
                and upstream.status < 300
            ):
                await self._pump_post(
                    session, stream, upstream, headers, method, request_id, upstream_rid, bound, key
                )
                return
            plain: Any = b""
            try:
                if (
                    300 <= upstream.status < 400
                    or (upstream.content_length or 0) > self.bounds.max_response_bytes
                ):
                    upstream.release()
                    why = (
                        "a redirect, not followed"
                        if upstream.status < 400
                        else f"a reply larger than max_response_bytes ({self.bounds.max_response_bytes} bytes)"
                    )
                    plain = _dumps(
                        jsonrpc.error_response(
                            request_id,
                            {"code": INTERNAL_ERROR, "message": f"upstream {self.name} answered with {why}"},
                        )
                    ).encode()
                else:
                    async with upstream:
                        plain = (await self._plain(upstream, {}, method, request_id, upstream_rid)).body
                body = plain if isinstance(plain, bytes) else b""
                if body:
                    stream.append(SseEvent("message", body.decode("utf-8", errors="replace"), None, None))
            finally:
                stream.close()
                if session.pending.get(request_id) == upstream_rid:
                    session.pending.pop(request_id, None)

        stream.pump = asyncio.get_running_loop().create_task(pump(), name=f"legacy POST relay {self.name}")
        return await self._serve(
            request, session, stream, 0, headers={"Mcp-Session-Id": sid} if sid else None
        )

    async def _plain(
        self,
        upstream: aiohttp.ClientResponse,
        out_headers: dict[str, str],
        method: Any,
        request_id: Any,
        upstream_rid: int | None,
    ) -> web.Response:
        """A plain (non-SSE) reply, read whole (it is bounded): what goes out is always JSON-RPC, under the client's id."""
        try:
            data = await read_limited(upstream, self.bounds.max_response_bytes)
        except (TimeoutError, aiohttp.ClientError, OSError, EventTooLargeError) as exc:
            reason = str(exc) or exc.__class__.__name__
            return _upstream_error(
                request_id,
                JsonRpcError(INTERNAL_ERROR, f"upstream {self.name} broke its reply: {reason}"),
                502,
            )
        status, data = as_jsonrpc_reply(self.name, upstream.status, data, request_id)
        message = _decode(data.decode("utf-8", errors="replace")) if data else None
        if isinstance(message, dict) and jsonrpc.is_response(message):
            if upstream_rid is not None and message.get("id") == upstream_rid:
                data = _dumps({**message, "id": request_id}).encode()
            elif message.get("id") is not None and message.get("id") != request_id:
                log.warning(
                    "legacy_foreign_response_dropped",
                    server=self.name,
                    reason="a reply for another request id",
                )
                err = JsonRpcError(
                    INTERNAL_ERROR, f"upstream {self.name} answered with a response for another request id"
                )
                return _upstream_error(request_id, err, 502)
        data = await self.v1.rewrite_plain(method, data)
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
        request_id: Any,
        upstream_rid: int | None,
        bound: float | None,
        key: str,
    ) -> None:
        """Read a POST's upstream stream into `stream` until the answer; resume the upstream (GET +
        its `Last-Event-ID`) when it asked for polling; else end with a JSON-RPC error."""
        rewriter = self.v1.event_rewriter(method, request_id)
        answered = request_id is None
        reason = "closed the stream before answering"
        last_upstream_id: str | None = None
        resp: aiohttp.ClientResponse | None = upstream
        fruitless = 0
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
                                out, answers = self._from_upstream(session, event, upstream_rid, request_id)
                                if out is None or (
                                    stream.json_only
                                    and not answers
                                    and await self._refuse_question(session, out, headers)
                                ):
                                    continue
                                if answers and rewriter is not None:
                                    out = await rewriter(out)
                                stream.append(out)
                                if answers:
                                    answered = True
                                    return
                    except (TimeoutError, aiohttp.ClientError, OSError, EventTooLargeError) as exc:
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
            if not answered:
                text = self._ended(stream) if stream.ended_by else f"upstream {self.name} {reason}"
                log.warning("legacy_relay_broken", server=self.name, reason=stream.ended_by or reason)
                error = jsonrpc.error_response(request_id, {"code": INTERNAL_ERROR, "message": text})
                stream.append(SseEvent("message", _dumps(error), None, None))
            stream.close()  # nobody reading it: kept LINGER_S for a resumption, then forgotten (`_sweep`)
            if request_id is not None and session.pending.get(request_id) == upstream_rid:
                session.pending.pop(request_id, None)
