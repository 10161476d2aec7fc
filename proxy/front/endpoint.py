"""The MCP endpoint of one server as the client sees it: the body (bounded in size and time), the
era of each request, and its reply.

Modern era (2026-07-28, transports §"Streamable HTTP"): POST only, per-request envelope and routing
headers checked here, then the method table (`modern.dispatcher`); JSON reply or an SSE stream
scoped to the request. Legacy era (2025-06-18 / 2025-11-25): the legacy endpoint (`legacy.endpoint`:
one session machine, an I/O adapter per upstream kind).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import structlog
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from proxy.calls.types import Reply
from proxy.front.auth import PRINCIPAL_KEY
from proxy.front.middleware import ARRIVED_KEY
from proxy.front.scopes import ScopeCheck
from proxy.legacy.endpoint import LegacyEndpoint
from proxy.modern.dispatcher import ServerDispatcher
from proxy.protocol import jsonrpc
from proxy.protocol.era import check_headers, is_modern_request, parse_envelope
from proxy.protocol.jsonrpc import INTERNAL_ERROR, INVALID_REQUEST, PARSE_ERROR, JsonObject, JsonRpcError
from proxy.protocol.sse import KEEPALIVE, SSE_HEADERS, encode_message
from proxy.replicas.forward import FORWARDED_HEADER
from proxy.replicas.routing import STREAM_METHODS
from proxy.runtime import flow, metrics, tracing
from proxy.runtime.drain import Drain
from proxy.runtime.running import MAX_BOUND_METHOD, MAX_BOUND_NAME, bind
from proxy.tasks.model import ANONYMOUS, principal_hash

log = structlog.get_logger("proxy.front")

# Deeper bodies are refused as unparseable (-32700): they parse, but would fail on their way out
# (the JSON encoders stop near 255 or 1000 levels) as a 500. MCP messages nest a few dozen at most.
MAX_JSON_DEPTH = 128
TOO_DEEP = f"the body nests JSON more than {MAX_JSON_DEPTH} levels deep"


def _json_error(request_id: Any, exc: JsonRpcError, status: int | None = None) -> web.Response:
    return web.json_response(
        jsonrpc.error_response(request_id, exc.to_error()),
        status=status or exc.http_status,
        headers=exc.http_headers,
        dumps=jsonrpc.dumps_str,
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
        # event-loop time (s) the request reached the proxy
        self.arrived: float | None = request.get(ARRIVED_KEY)
        self.stream: web.StreamResponse | None = None
        self.prefer_sse = prefers_sse(request.headers.get("Accept"))

    async def _start_sse(self) -> web.StreamResponse:
        if self.stream is None:
            stream = web.StreamResponse(status=200, headers=SSE_HEADERS)
            await stream.prepare(self.request)
            self.stream = stream
        return self.stream

    async def notify(self, message: JsonObject) -> None:
        """Send a notification ahead of the response (switches to SSE)."""
        stream = await self._start_sse()
        await stream.write(encode_message(message))

    async def relay(self, message: JsonObject) -> bool:
        """`Reply.relay`: only into a started SSE stream, and only when the write cannot wait for
        the client (`flow.write_without_waiting`: not paused for it, room in its buffer)."""
        if self.stream is None:
            return False
        return await flow.write_without_waiting(self.request, self.stream, encode_message(message))

    async def keepalive(self) -> bool:
        """Send an SSE comment (switches to SSE) so idle-timeout intermediaries keep the connection;
        True (it always writes one)."""
        stream = await self._start_sse()
        await stream.write(KEEPALIVE)
        return True

    async def finish(
        self, message: JsonObject, status: int = 200, headers: dict[str, str] | None = None
    ) -> web.StreamResponse:
        """Send the final JSON-RPC message, as JSON or as the last SSE event.

        An error with a non-200 status goes out as JSON unless the stream already started (the
        2026-07-28 transport's status codes must stay visible), with `headers` (`Retry-After`)."""
        if self.stream is None and self.prefer_sse and status == 200:
            await self._start_sse()
        if self.stream is None:
            return web.json_response(message, status=status, headers=headers, dumps=_dumps)
        await self.stream.write(encode_message(message))
        await self.stream.write_eof()
        return self.stream


def _dumps(obj: Any) -> str:
    return jsonrpc.dumps_str(obj)


# Replicas: decides first whether a request is served by another replica (or refused while draining):
# a response when it is, None to serve it here. Called with the request, its parsed body (None for
# GET and DELETE), its raw bytes and the caller's principal.
Router = Callable[[web.Request, Any, bytes | None, str], Awaitable[web.StreamResponse | None]]


class ServerEndpoint:
    """The MCP endpoint of one upstream server (`name`): the 2026-07-28 era through `dispatcher`,
    the handshake era through `legacy`, each request first offered to `router` (replicas), after
    `scopes` (`auth.scopes`) had their say. `body_timeout` (s) bounds reading a request body; with
    `log_payloads` each body read whole is logged (`request_payload`, its first 64 KiB as text)."""

    def __init__(
        self,
        *,
        name: str,
        dispatcher: ServerDispatcher,
        legacy: LegacyEndpoint,
        body_timeout: float,
        router: Router | None = None,
        scopes: ScopeCheck | None = None,
        log_payloads: bool = False,
        drain: Drain | None = None,
    ) -> None:
        self.name = name
        self.dispatcher = dispatcher
        self.legacy = legacy
        self.body_timeout = body_timeout
        self.router = router
        self.scopes = scopes
        self.log_payloads = log_payloads
        self.drain = drain

    def _stream(self, request: web.Request, method: Any) -> None:
        """A lone proxy's stream that lasts as long as its client (a GET, `tasks/result`,
        `subscriptions/listen`) is cut as the drain starts (`Drain.close_streams`); with replicas,
        the router tracks it (cut at the end of the replica's drain)."""
        if self.drain is not None and self.router is None:
            if request.method == "GET" or (isinstance(method, str) and method in STREAM_METHODS):
                self.drain.track_stream()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """aiohttp handler for POST, GET and DELETE on the endpoint."""
        bind(server=self.name)
        if request.method == "POST":
            return await self._post(request)
        self._stream(request, None)
        if request.headers.get("Mcp-Session-Id"):
            bind(era="legacy")  # (on a relaying replica's line too)
            routed = (
                await self.router(request, None, None, principal_of(request))
                if self.router is not None
                else None
            )
            return routed if routed is not None else await self._legacy(request, None)
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
        # declared too large: refused before a byte is read
        if (request.content_length or 0) > request._client_max_size:
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
            # nothing more can be read: aiohttp must not try to drain it (and log a traceback)
            request.content.feed_eof()
            return _closing(
                _json_error(None, JsonRpcError(PARSE_ERROR, f"the body cannot be read: {reason}"), status=400)
            )
        if self.log_payloads:  # (after the body's own bounds; bytes that are not UTF-8 logged replaced)
            log.info("request_payload", body=raw[:65536].decode("utf-8", errors="replace"))
        try:
            body = jsonrpc.loads(raw)
        except jsonrpc.TooDeepError:
            return _json_error(None, JsonRpcError(PARSE_ERROR, TOO_DEEP))
        except (ValueError, UnicodeDecodeError) as exc:
            return _json_error(None, JsonRpcError(PARSE_ERROR, f"the body is not valid JSON: {exc}"))
        if jsonrpc.nests_deeper_than(raw, body, MAX_JSON_DEPTH):
            return _json_error(None, JsonRpcError(PARSE_ERROR, TOO_DEEP))
        if isinstance(body, dict):
            bind_request(body)
        if not tracing.enabled():
            return await self._serve(request, body, raw)
        attributes = {
            tracing.SERVER: self.name,
            tracing.ERA: "modern" if is_modern_request(request.headers, body) else "legacy",
            tracing.PRINCIPAL: principal_hash(principal_of(request)),
        }
        # a request relayed by another replica carries that replica's span in its headers
        relayed = FORWARDED_HEADER in request.headers
        with tracing.inbound_span(request.headers, body, attributes, prefer_headers=relayed) as span:
            response = await self._serve(request, body, raw)
            span.set_attribute(tracing.HTTP_STATUS, response.status)
            if response.status >= 400:
                span.set_attribute(tracing.OUTCOME, "error")
                span.set_status(tracing.Status(tracing.StatusCode.ERROR, f"HTTP {response.status}"))
            return response

    async def _serve(self, request: web.Request, body: Any, raw: bytes) -> web.StreamResponse:
        """Serve a parsed POST: the scope check, then another replica (the router) or this one."""
        modern = is_modern_request(request.headers, body)
        bind(era="modern" if modern else "legacy")
        self._stream(request, body.get("method") if isinstance(body, dict) else None)
        if self.scopes is not None and (refused := await self.scopes.refusal(request, body)) is not None:
            return refused
        routed = (
            await self.router(request, body, raw, principal_of(request)) if self.router is not None else None
        )
        if routed is not None:
            return routed
        if modern:
            return await self._modern(request, body)
        return await self._legacy(request, body)

    # -- modern ------------------------------------------------------------------------------

    async def _modern(self, request: web.Request, body: Any) -> web.StreamResponse:
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
                jsonrpc.error_response(request_id, exc.to_error()),
                status=exc.http_status,
                headers=exc.http_headers,
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

    # -- legacy ------------------------------------------------------------------------------

    async def _legacy(self, request: web.Request, body: Any) -> web.StreamResponse:
        return await self.legacy.handle(request, body=body, principal=principal_of(request))


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
        fields["rpc_method"] = method[:MAX_BOUND_METHOD]
        name = params.get("uri") if method == "resources/read" else params.get("name")
        if method in ("tools/call", "prompts/get", "resources/read") and isinstance(name, str):
            fields["tool"] = name[:MAX_BOUND_NAME]
    task_id = params.get("taskId")
    if isinstance(task_id, str):
        fields["task_id"] = task_id[:MAX_BOUND_METHOD]
    bind(**fields)


def principal_of(request: web.Request) -> str:
    """Who is calling (set by the auth middleware; `anonymous` without inbound auth)."""
    return request.get(PRINCIPAL_KEY, ANONYMOUS)
