"""Client-facing Streamable HTTP: body parsing, era detection, modern validation, legacy pass-through.

Modern era (2026-07-28, transports §"Streamable HTTP"): POST only, per-request envelope and routing
headers, JSON reply or an SSE stream scoped to the request. Legacy era (2025-06-18 / 2025-11-25):
the relay to the upstream (legacy_relay.py: the upstream session mapped to a proxy session id, own
JSON-RPC ids and SSE event ids), or the proxy as the legacy server itself for stdio (legacy_bridge.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import structlog
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from proxy.calls.types import Reply
from proxy.front.auth import PRINCIPAL_KEY
from proxy.front.middleware import ARRIVED_KEY
from proxy.legacy.bridge import LegacyBridge
from proxy.legacy.relay import LegacyRelay
from proxy.legacy.sessions import LegacySessions, observe_legacy
from proxy.legacy.v1 import V1Front
from proxy.modern.dispatcher import ServerDispatcher
from proxy.protocol import jsonrpc
from proxy.protocol.era import check_headers, is_modern_request, legacy_method_refusal, parse_envelope
from proxy.protocol.jsonrpc import INTERNAL_ERROR, INVALID_REQUEST, PARSE_ERROR, JsonObject, JsonRpcError
from proxy.protocol.sse import KEEPALIVE, encode_message
from proxy.runtime import metrics
from proxy.tasks.model import ANONYMOUS
from proxy.upstream.types import Bounds

log = structlog.get_logger("proxy.transport")


def _json_error(request_id: Any, exc: JsonRpcError, status: int | None = None) -> web.Response:
    return web.json_response(
        jsonrpc.error_response(request_id, exc.to_error()), status=status or exc.http_status
    )


def prefers_sse(accept: str | None) -> bool:
    """True when an `Accept` header ranks `text/event-stream` above `application/json`.

    Higher q-value wins; on equal q the type listed first wins (RFC 9110 leaves ties to the
    server; the listing order is the client's stated preference). Both types must be acceptable.
    """
    ranks: dict[str, tuple[float, int]] = {}
    for index, item in enumerate((accept or "").split(",")):
        media, *params = [part.strip() for part in item.split(";")]
        q = 1.0
        for param in params:
            name, _, value = param.partition("=")
            if name.strip().lower() == "q":
                try:
                    q = float(value)
                except ValueError:
                    q = 0.0
        media = media.lower()
        if media in ("text/event-stream", "application/json") and media not in ranks:
            ranks[media] = (q, -index)
    sse, json_ = ranks.get("text/event-stream"), ranks.get("application/json")
    return sse is not None and json_ is not None and sse[0] > 0 and sse > json_


class ModernReply(Reply):
    """The response of one modern request: plain JSON unless something must be streamed first,
    or the client's `Accept` prefers an SSE stream (then a successful result is one SSE event)."""

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.headers = request.headers
        self.arrived: float | None = request.get(
            ARRIVED_KEY
        )  # event-loop time (s) the request reached the proxy
        self.stream: web.StreamResponse | None = None
        self.prefer_sse = prefers_sse(request.headers.get("Accept"))

    async def _start_sse(self) -> web.StreamResponse:
        if self.stream is None:
            stream = web.StreamResponse(
                status=200,
                headers={
                    "Content-Type": "text/event-stream",
                    "Cache-Control": "no-cache",
                    "X-Accel-Buffering": "no",
                },
            )
            await stream.prepare(self.request)
            self.stream = stream
        return self.stream

    async def notify(self, message: JsonObject) -> None:
        """Send a notification ahead of the response (switches to SSE)."""
        stream = await self._start_sse()
        await stream.write(encode_message(message))

    async def keepalive(self) -> None:
        """Send an SSE comment (switches to SSE) so idle-timeout intermediaries keep the connection."""
        stream = await self._start_sse()
        await stream.write(KEEPALIVE)

    async def finish(self, message: JsonObject, status: int = 200) -> web.StreamResponse:
        """Send the final JSON-RPC message, as JSON or as the last SSE event.

        An error with a non-200 status goes out as JSON unless the stream already started (the
        2026-07-28 transport's status codes must stay visible)."""
        if self.stream is None and self.prefer_sse and status == 200:
            await self._start_sse()
        if self.stream is None:
            return web.json_response(message, status=status, dumps=_dumps)
        await self.stream.write(encode_message(message))
        await self.stream.write_eof()
        return self.stream


def _dumps(obj: Any) -> str:
    return jsonrpc.dumps_str(obj)


class ServerEndpoint:
    """The MCP endpoint of one upstream server: modern dispatch plus legacy relay.

    `url` and `headers` address the upstream; `http` is the proxy's shared client session.
    """

    def __init__(
        self,
        *,
        name: str,
        url: str | None,
        headers: dict[str, str],
        http: aiohttp.ClientSession,
        dispatcher: ServerDispatcher,
        bridge: LegacyBridge | None = None,
    ) -> None:
        self.bridge = bridge
        # Replicas: decides first whether a request is served by another replica (or refused while draining).
        self.router: (
            Callable[[web.Request, Any, bytes | None, str], Awaitable[web.StreamResponse | None]] | None
        ) = None
        self.name = name
        self.url = url
        self.headers = headers
        self.http = http
        self.dispatcher = dispatcher
        self.legacy = LegacySessions()
        entry = dispatcher.config.mcpServers.get(name)
        self.bounds = Bounds.from_entry(entry) if entry is not None else Bounds()
        self.body_timeout = dispatcher.config.listen.body_timeout
        # v1 tasks (2025-11-25) for legacy clients, served by the proxy when the upstream has none.
        self.v1 = V1Front(
            server=name,
            config=dispatcher.config,
            pool=dispatcher.pool,
            tasks=dispatcher.tasks,
            keepalive_s=dispatcher.keepalive_s,
        )
        if bridge is not None:
            bridge.reply_hook = self.v1.rewrite_reply
            bridge.keepalive_s = dispatcher.config.listen.sse_keepalive
        listen = dispatcher.config.listen
        # An HTTP upstream: the legacy relay (own ids toward the upstream, own SSE event ids toward the client).
        self.relay = (
            LegacyRelay(
                name=name,
                url=url,
                headers=headers,
                http=http,
                bounds=self.bounds,
                v1=self.v1,
                sessions=self.legacy,
                keepalive_s=listen.sse_keepalive,
                replay_events=listen.replay_events,
                replay_bytes=listen.replay_bytes,
            )
            if url is not None
            else None
        )

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """aiohttp handler for POST, GET and DELETE on the endpoint."""
        structlog.contextvars.bind_contextvars(server=self.name)
        if request.method == "POST":
            return await self._post(request)
        if request.headers.get("Mcp-Session-Id"):
            routed = (
                await self.router(request, None, None, principal_of(request))
                if self.router is not None
                else None
            )
            return routed if routed is not None else await self._relay_legacy(request, body=None, raw=b"")
        # GET/DELETE without a session: modern clients have no GET stream (2026-07-28 §4.2).
        err = JsonRpcError(
            INVALID_REQUEST,
            f"{request.method} is not served here without an Mcp-Session-Id; send JSON-RPC with POST",
        )
        response = _json_error(None, err, status=405)
        response.headers["Allow"] = "POST"
        return response

    async def _post(self, request: web.Request) -> web.StreamResponse:
        too_large = JsonRpcError(
            INVALID_REQUEST, f"request body too large: the limit max_body is {request._client_max_size} bytes"
        )
        if (
            request.content_length or 0
        ) > request._client_max_size:  # declared too large: refused before a byte is read
            metrics.LIMIT_REJECTIONS.labels("max_body").inc()
            return _closing(_json_error(None, too_large, status=413))
        try:
            async with asyncio.timeout(self.body_timeout):
                raw = await request.read()
        except web.HTTPRequestEntityTooLarge as exc:
            metrics.LIMIT_REJECTIONS.labels("max_body").inc()
            return _closing(_json_error(None, too_large, status=exc.status))
        except TimeoutError:
            err = JsonRpcError(
                INVALID_REQUEST,
                f"the request body did not arrive within body_timeout ({self.body_timeout:g} s)",
            )
            metrics.LIMIT_REJECTIONS.labels("body_timeout").inc()
            return _closing(_json_error(None, err, status=408))
        except RequestPayloadError as exc:
            reason = str(exc).replace("\n", " ").strip() or exc.__class__.__name__
            request.content.feed_eof()  # nothing more can be read: aiohttp must not try to drain it (and log a traceback)
            return _closing(
                _json_error(None, JsonRpcError(PARSE_ERROR, f"the body cannot be read: {reason}"), status=400)
            )
        try:
            body = jsonrpc.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            return _json_error(None, JsonRpcError(PARSE_ERROR, f"the body is not valid JSON: {exc}"))
        except RecursionError:
            return _json_error(None, JsonRpcError(PARSE_ERROR, "the body nests JSON too deeply"))
        if isinstance(body, dict):
            bind_request(body)
        routed = (
            await self.router(request, body, raw, principal_of(request)) if self.router is not None else None
        )
        if routed is not None:
            return routed
        if is_modern_request(request.headers, body):
            return await self._modern(request, body)
        structlog.contextvars.bind_contextvars(era="legacy")
        return await self._relay_legacy(request, body=body, raw=raw)

    # -- modern ------------------------------------------------------------------------------

    async def _modern(self, request: web.Request, body: Any) -> web.StreamResponse:
        structlog.contextvars.bind_contextvars(era="modern")
        request_id = body.get("id") if isinstance(body, dict) else None
        if isinstance(request_id, bool) or not isinstance(request_id, (str, int)):
            request_id = None  # never echo an id of the wrong type
        reply = ModernReply(request)
        try:
            jsonrpc.validate_request(body)
            if "id" not in body:
                return web.Response(status=202)  # 2026-07-28 defines no client→server notifications on HTTP
            envelope = parse_envelope(body.get("params"))
            check_headers(request.headers, body, envelope)
            result = await self.dispatcher.dispatch(
                body, envelope, principal=principal_of(request), reply=reply
            )
        except JsonRpcError as exc:
            return await reply.finish(
                jsonrpc.error_response(request_id, exc.to_error()), status=exc.http_status
            )
        except Exception:
            log.exception(
                "request_failed",
                server=self.name,
                method=body.get("method") if isinstance(body, dict) else None,
            )
            err = JsonRpcError(INTERNAL_ERROR, "internal proxy error; see the proxy log")
            return await reply.finish(jsonrpc.error_response(request_id, err.to_error()), status=500)
        return await reply.finish(jsonrpc.response(request_id, result))

    # -- legacy relay ------------------------------------------------------------------------

    async def _relay_legacy(self, request: web.Request, *, body: Any, raw: bytes) -> web.StreamResponse:
        structlog.contextvars.bind_contextvars(era="legacy", server=self.name)
        request_id = body.get("id") if isinstance(body, dict) else None
        if isinstance(request_id, bool) or not isinstance(request_id, (str, int)):
            request_id = None
        if (refusal := legacy_method_refusal(request.headers, body)) is not None:  # outside the era's surface
            return _json_error(request_id, refusal)
        method = (
            body.get("method") if isinstance(body, dict) and isinstance(body.get("method"), str) else None
        )
        started = asyncio.get_running_loop().time()
        response: web.StreamResponse | None = None
        try:
            response = await self._relay_legacy_inner(request, body=body, raw=raw, request_id=request_id)
            return response
        finally:
            if method is not None and "id" in body:
                observe_legacy(self.name, method, body, response, asyncio.get_running_loop().time() - started)

    async def _relay_legacy_inner(
        self, request: web.Request, *, body: Any, raw: bytes, request_id: Any
    ) -> web.StreamResponse:
        if self.bridge is not None:  # a stdio upstream: the proxy is the legacy server itself
            if request.method == "POST":
                try:
                    jsonrpc.validate_request(body) if isinstance(
                        body, dict
                    ) and "method" in body else _validate_legacy_response(body)
                except JsonRpcError as exc:
                    return _json_error(request_id, exc)
            bridged = self.bridge.session_of(request, principal_of(request))
            version = request.headers.get("MCP-Protocol-Version") or (
                bridged.version if bridged is not None else None
            )
            if request.method == "POST" and await self.v1.intercepts(body, principal_of(request), version):
                if bridged is None:  # as the bridge answers: 404 for an unknown session, 400 for none
                    known = bool(request.headers.get("Mcp-Session-Id"))
                    message = (
                        "unknown or expired session; initialize a new one"
                        if known
                        else "missing Mcp-Session-Id: initialize first"
                    )
                    return _json_error(
                        request_id, JsonRpcError(INVALID_REQUEST, message), status=404 if known else 400
                    )
                return await self.v1.handle(
                    request,
                    self.v1.for_version(body, version),
                    principal=principal_of(request),
                    capabilities=bridged.capabilities,
                )
            if request.method == "GET" and not await self.v1.upstream_has_tasks():
                bridge, bridge_sid = self.bridge, request.headers.get("Mcp-Session-Id", "").strip()
                if (
                    bridge.session_of(request, principal_of(request)) is not None
                ):  # the v1 status stream (legacy_tasks)
                    return await self.v1.serve_get_stream(
                        request, lambda: bridge_sid in bridge.sessions, principal_of(request)
                    )
            return await self.bridge.handle(request, body, principal_of(request))
        if request.method == "POST":
            try:
                jsonrpc.validate_request(body) if isinstance(
                    body, dict
                ) and "method" in body else _validate_legacy_response(body)
            except JsonRpcError as exc:
                return _json_error(request_id, exc)
        assert self.relay is not None
        return await self.relay.handle(
            request, body=body, raw=raw, request_id=request_id, principal=principal_of(request)
        )


def _validate_legacy_response(body: Any) -> None:
    if not jsonrpc.is_response(body):
        jsonrpc.validate_request(body)
    elif isinstance(body["id"], bool) or not isinstance(body["id"], (str, int)):
        raise JsonRpcError(INVALID_REQUEST, "`id` must be a string or an integer")


def _closing(response: web.Response) -> web.Response:
    """`response`, sent with `Connection: close` (the rest of the request body is not read)."""
    response.force_close()
    return response


def bind_request(body: JsonObject) -> None:
    """Bind what identifies a request to the log context: its JSON-RPC method, tool (or prompt,
    resource) name and task id, when they are strings."""
    method = body.get("method")
    raw = body.get("params")
    params: JsonObject = raw if isinstance(raw, dict) else {}
    fields: dict[str, str] = {}
    if isinstance(method, str):
        fields["rpc_method"] = method[:128]
        name = params.get("uri") if method == "resources/read" else params.get("name")
        if method in ("tools/call", "prompts/get", "resources/read") and isinstance(name, str):
            fields["tool"] = name[:256]
    task_id = params.get("taskId")
    if isinstance(task_id, str):
        fields["task_id"] = task_id[:128]
    structlog.contextvars.bind_contextvars(**fields)


def principal_of(request: web.Request) -> str:
    """Who is calling (set by the auth middleware; `anonymous` without inbound auth)."""
    return request.get(PRINCIPAL_KEY, ANONYMOUS)
