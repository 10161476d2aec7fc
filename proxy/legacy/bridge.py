"""Legacy-era clients (2025-06-18 / 2025-11-25) in front of a stdio upstream.

With an HTTP upstream the proxy relays legacy sessions byte for byte; a stdio child has no URL,
so here the proxy is itself the legacy Streamable HTTP server (2025-11-25 basic/transports): it
answers `initialize` from the child's own InitializeResult, mints session ids, forwards requests
over the pooled child with ids and progress tokens of its own, and relays the child's
notifications and server→client requests on the request's SSE stream (requests get proxy ids).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import ClientConnectionError, web

from proxy.protocol import jsonrpc
from proxy.protocol.era import LEGACY_VERSIONS, upstream_capabilities
from proxy.protocol.jsonrpc import (
    INTERNAL_ERROR,
    INVALID_REQUEST,
    JsonObject,
    JsonRpcError,
    RequestId,
    object_of,
)
from proxy.runtime.drain import Drain
from proxy.upstream.types import UpstreamError

REQUEST_CANCELLED = -32800  # what the MCP SDKs use for an abandoned request
from proxy.protocol.sse import KEEPALIVE, encode_message
from proxy.upstream.stdio import StdioSession
from proxy.upstream.stdio_pool import StdioPool


@dataclass
class BridgeSession:
    """One downstream legacy session: its capabilities, principal, negotiated version, and the
    server→client requests relayed to it (proxy id → child and the child's own id)."""

    capabilities: JsonObject
    principal: str
    version: str
    questions: dict[str, tuple[StdioSession, RequestId]] = field(default_factory=dict)
    calls: dict[RequestId, tuple[StdioSession, RequestId, asyncio.Future[JsonObject]]] = field(
        default_factory=dict
    )


def _error(request_id: Any, code: int, message: str, status: int) -> web.Response:
    return web.json_response(
        jsonrpc.error_response(request_id, jsonrpc.error_object(code, message)), status=status
    )


class LegacyBridge:
    """Serves legacy-era sessions for one stdio server (`pool`)."""

    def __init__(self, name: str, pool: StdioPool, drain: Drain) -> None:
        self.name = name
        self.pool = pool
        self.drain = drain  # on SIGTERM, a request still unanswered at the drain deadline gets its error then
        self.sessions: dict[str, BridgeSession] = {}
        self.keepalive_s = 15.0  # SSE comment interval (s) on a silent call (listen.sse_keepalive)
        # Rewrites replies by method before they go out (v1 tasks: initialize and tools/list).
        self.reply_hook: Callable[[str, JsonObject], Awaitable[JsonObject]] | None = None

    def session_of(self, request: web.Request, principal: str) -> BridgeSession | None:
        """The session named by the request's `Mcp-Session-Id`, when it exists and is `principal`'s."""
        session = self.sessions.get((request.headers.get("Mcp-Session-Id") or "").strip())
        return session if session is not None and session.principal == principal else None

    async def handle(self, request: web.Request, body: Any, principal: str) -> web.StreamResponse:
        """Answer one legacy-era HTTP request (POST, GET or DELETE)."""
        sid = (request.headers.get("Mcp-Session-Id") or "").strip()
        session = self.sessions.get(sid) if sid else None
        if session is not None and session.principal != principal:
            session = None  # another principal's session does not exist for this caller
        if sid and session is None:
            return _error(
                body.get("id") if isinstance(body, dict) else None,
                INVALID_REQUEST,
                "unknown or expired session; initialize a new one",
                404,
            )
        if request.method == "DELETE":
            self.sessions.pop(sid, None)
            return web.Response(status=200 if sid else 400)
        if request.method == "GET":
            response = _error(None, INVALID_REQUEST, "this server offers no standalone GET stream", 405)
            response.headers["Allow"] = "POST, DELETE"
            return response
        if jsonrpc.is_response(body):
            return await self._answer_question(session, body)
        if not isinstance(body, dict) or "method" not in body:
            return _error(None, INVALID_REQUEST, "expected a JSON-RPC request, notification or response", 400)
        if body["method"] == "initialize":
            return await self._initialize(body, principal)
        if session is None:
            return _error(body.get("id"), INVALID_REQUEST, "missing Mcp-Session-Id: initialize first", 400)
        if "id" not in body:
            await self._notification(session, body)
            return web.Response(status=202)
        if body["method"] == "ping":
            return web.json_response(jsonrpc.response(body["id"], {}))
        return await self._request(request, session, body)

    async def _initialize(self, body: JsonObject, principal: str) -> web.StreamResponse:
        params = object_of(body.get("params"))
        caps = upstream_capabilities(object_of(params.get("capabilities")))
        try:
            child = await self.pool.session(caps, principal)
        except UpstreamError as exc:
            return _error(
                body.get("id"), INTERNAL_ERROR, str(exc), 200
            )  # §1.4.4: errors for requests in a 200
        wanted = params.get("protocolVersion")
        version = wanted if wanted in LEGACY_VERSIONS else child.protocol_version
        sid = secrets.token_urlsafe(24)
        self.sessions[sid] = BridgeSession(capabilities=caps, principal=principal, version=version)
        result = {**child.initialize_result, "protocolVersion": version}
        reply = jsonrpc.response(body.get("id"), result)
        if self.reply_hook is not None:
            reply = await self.reply_hook("initialize", reply)
        return web.json_response(reply, headers={"Mcp-Session-Id": sid})

    async def _notification(self, session: BridgeSession, body: JsonObject) -> None:
        if body["method"] == "notifications/initialized":
            return
        params = object_of(body.get("params"))
        if body["method"] == "notifications/cancelled":
            request_id = params.get("requestId")
            target = session.calls.get(request_id) if isinstance(request_id, (str, int)) else None
            if target is not None:  # an answered (or unknown) request: the child never hears of it
                child, upstream_id, waiting = target
                if not child.sent(upstream_id):  # still queued for a slot: it is never sent
                    waiting.cancel()
                    return
                await _quiet(child.notify("notifications/cancelled", {**params, "requestId": upstream_id}))
            return
        try:
            child = await self.pool.session(session.capabilities, session.principal)
            await child.notify(body["method"], params or None)
        except UpstreamError:
            pass

    async def _answer_question(self, session: BridgeSession | None, body: JsonObject) -> web.Response:
        target = session.questions.pop(body["id"], None) if session is not None else None
        if target is None:
            return _error(body.get("id"), INVALID_REQUEST, "no pending request has this id", 400)
        child, upstream_id = target
        await _quiet(child.respond(upstream_id, result=body.get("result"), error=body.get("error")))
        return web.Response(status=202)

    async def _answered(self, waiting: asyncio.Future[Any]) -> bool:
        """Wait for `waiting` for keepalive_s (s) at most, less when a drain begins meanwhile or its
        deadline comes first; True once it is done (never raises what it raised)."""
        remaining = self.drain.remaining()
        if remaining != 0.0:
            with contextlib.suppress(TimeoutError):
                await self.drain.wait_for(
                    asyncio.wait({waiting}),
                    self.keepalive_s if remaining is None else min(self.keepalive_s, remaining),
                )
        return waiting.done()

    async def _request(
        self, request: web.Request, session: BridgeSession, body: JsonObject
    ) -> web.StreamResponse:
        try:
            child = await self.pool.session(session.capabilities, session.principal)
        except UpstreamError as exc:
            return _error(body["id"], INTERNAL_ERROR, str(exc), 200)
        params = dict(body.get("params") or {})
        meta = dict(params.get("_meta") or {}) if isinstance(params.get("_meta"), dict) else {}
        client_token = meta.get("progressToken")
        if client_token is not None:
            meta["progressToken"] = "mtp-" + secrets.token_urlsafe(9)
            params["_meta"] = meta
        upstream_id = child.next_id()
        stream: web.StreamResponse | None = None

        async def open_stream() -> web.StreamResponse:
            nonlocal stream
            if stream is None:
                stream = web.StreamResponse(
                    headers={
                        "Content-Type": "text/event-stream",
                        "Cache-Control": "no-cache",
                        "X-Accel-Buffering": "no",
                    }
                )
                await stream.prepare(request)
            return stream

        async def relay(msg: JsonObject) -> None:
            stream = await open_stream()
            if jsonrpc.is_request(msg):
                proxy_id = "mtp-" + secrets.token_urlsafe(9)
                session.questions[proxy_id] = (child, msg["id"])
                msg = {**msg, "id": proxy_id}
            elif msg.get("method") == "notifications/progress" and client_token is not None:
                msg = {**msg, "params": {**msg.get("params", {}), "progressToken": client_token}}
            await stream.write(encode_message(msg))

        waiting = asyncio.ensure_future(
            child.request(body["method"], params or None, handler=relay, request_id=upstream_id)
        )
        session.calls[body["id"]] = (child, upstream_id, waiting)
        try:
            try:
                while not await self._answered(waiting):
                    if self.drain.remaining() == 0.0:  # SIGTERM, and drain_timeout passed
                        waiting.cancel()
                        raise UpstreamError(
                            f"proxy shutdown: the call did not finish within drain_timeout ({self.drain.timeout_s:g} s) and was abandoned"
                        )
                    # A silent call: an SSE comment every keepalive_s (s) keeps idle-cutting intermediaries off.
                    with contextlib.suppress(ConnectionResetError, ClientConnectionError):
                        await (await open_stream()).write(KEEPALIVE)
                reply = await waiting
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if not waiting.cancelled() or (current is not None and current.cancelling()):
                    waiting.cancel()
                    raise
                # The client cancelled it while it waited for a slot: nothing reached the child.
                reply = jsonrpc.error_response(
                    body["id"],
                    jsonrpc.error_object(REQUEST_CANCELLED, "cancelled by the client before it was sent"),
                )
            out = {**reply, "id": body["id"]}
            if self.reply_hook is not None:
                out = await self.reply_hook(body["method"], out)
        except UpstreamError as exc:
            out = jsonrpc.error_response(body["id"], jsonrpc.error_object(INTERNAL_ERROR, str(exc)))
        finally:
            session.calls.pop(body["id"], None)
        if stream is None:
            return web.json_response(out, dumps=jsonrpc.dumps_str)
        with contextlib.suppress(ConnectionResetError, ClientConnectionError):
            await stream.write(encode_message(out))
            await stream.write_eof()
        return stream


async def _quiet(coro: Any) -> None:
    try:
        await coro
    except (UpstreamError, JsonRpcError):
        pass
