"""The replica-to-replica hop: small authenticated JSON requests to a peer's internal endpoints,
and whole client HTTP requests relayed to the replica that holds their live state (the response,
SSE included, streams back as it comes).

Every hop is bounded (`hop_timeout` for connecting and for a JSON answer), never follows a
redirect, and reports an unreachable peer as None so the caller can fall back to the store.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import structlog
from aiohttp import web
from multidict import CIMultiDict

from proxy.protocol import jsonrpc
from proxy.protocol.jsonrpc import INTERNAL_ERROR, JsonObject
from proxy.protocol.sse import SseParser, encode_message
from proxy.replicas.registry import Peer
from proxy.runtime import metrics, tracing

log = structlog.get_logger("proxy.replicas")

SECRET_HEADER = "X-Mcp-Replica-Secret"  # the shared replicas.secret (compared in constant time)
FORWARDED_HEADER = "X-Mcp-Replica-Forwarded"  # set on a relayed client request: the node that relayed it
# on a relayed request: whom the relaying replica authenticated
RELAYED_PRINCIPAL_HEADER = "X-Mcp-Replica-Principal"
# on a relayed request: the relaying replica's request id (the one its client got as X-Request-Id)
RELAYED_REQUEST_ID_HEADER = "X-Mcp-Replica-Request-Id"
# on a relayed request: the node it is meant for. A process at that node's address that is another
# node (the address was taken by a restart while the dead node's registry record lives on) answers
# HTTP 421 with MISDIRECTED_HEADER naming itself: the node sought is gone, and nothing was served.
TARGET_HEADER = "X-Mcp-Replica-Target"
MISDIRECTED_HEADER = "X-Mcp-Replica-Misdirected"
MAX_HOP_ANSWER_BYTES = 4 * 1024 * 1024  # largest JSON answer read from a peer's internal endpoint
_HOP_BY_HOP = frozenset(
    h.lower()
    for h in (
        "Host",
        "Connection",
        "Keep-Alive",
        "Transfer-Encoding",
        "Content-Length",
        "TE",
        "Trailer",
        "Upgrade",
        "Proxy-Connection",
        "Proxy-Authorization",
        SECRET_HEADER,
        FORWARDED_HEADER,
        RELAYED_PRINCIPAL_HEADER,
        TARGET_HEADER,
    )
)


class HopError(Exception):
    """A hop to a peer failed; the message says why, `status` is the peer's HTTP status if it answered."""

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class Forwarder:
    """Talks to peers with the shared `secret`; `node` is this replica's id, `timeout_s` (s) the hop bound.

    A relayed request waits for the peer's response head and each read of a plain body at most
    `read_timeout_s` (s: the longest call timeout plus the hop), and at most `stream_idle_s` (s: a
    few `listen.sse_keepalive` intervals, since the peer sends keepalive comments) between two
    chunks of an SSE stream. Idle pooled connections to peers live `keepalive_s` (s) at most: below
    the peers' own idle close (`listen.header_timeout`), so a request is never sent on a connection
    the peer is closing unread, which would read as lost after it may have run.
    `registered_at(node, url)` says whether `node` is the replica registered at `url` (it confirms
    a peer's HTTP 421 before the peer sought is taken as gone).
    """

    def __init__(
        self,
        *,
        node: str,
        secret: str,
        timeout_s: float,
        read_timeout_s: float = 1800.0,
        stream_idle_s: float = 60.0,
        keepalive_s: float = 4.0,
        registered_at: Callable[[str, str], Awaitable[bool]] | None = None,
    ) -> None:
        self.node = node
        self.registered_at = registered_at
        self.keepalive_s = keepalive_s
        self.secret = secret
        self.timeout_s = timeout_s
        self.read_timeout_s = read_timeout_s
        self.stream_idle_s = stream_idle_s
        self._http: aiohttp.ClientSession | None = None

    def _session(self) -> aiohttp.ClientSession:
        if self._http is None or self._http.closed:
            # No decompression: a relayed body passes byte for byte, with its Content-Encoding.
            self._http = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=self.keepalive_s),
                auto_decompress=False,
                trace_configs=tracing.client_trace_configs(),  # none while tracing is off
            )
        return self._http

    async def close(self) -> None:
        """Close the hop's connections."""
        if self._http is not None:
            await self._http.close()

    async def call(self, peer: Peer, op: str, payload: JsonObject) -> JsonObject | None:
        """POST `payload` to the peer's `/_replica/<op>`; its JSON answer, or None when the peer cannot
        be reached, refuses, or answers nonsense within `timeout_s` (s)."""
        try:
            return await self.ask(peer, op, payload)
        except HopError:
            return None

    async def ask(self, peer: Peer, op: str, payload: JsonObject) -> JsonObject:
        """Like `call`, but raises HopError saying why (unreachable, timeout, a refusal's HTTP status
        such as 403 for a different secret, an answer over MAX_HOP_ANSWER_BYTES, not JSON or not an
        object) instead of returning None."""
        started = time.perf_counter()
        try:
            async with self._session().post(
                f"{peer.url}/_replica/{op}",
                json=payload,
                headers={SECRET_HEADER: self.secret},
                allow_redirects=False,
                timeout=aiohttp.ClientTimeout(total=self.timeout_s),
            ) as resp:
                if resp.status != 200:
                    log.warning("replica_hop_refused", peer=peer.node, op=op, status=resp.status)
                    raise HopError(
                        f"replica {peer.node} at {peer.url} refused the hop (HTTP {resp.status}"
                        + (": a different replicas.secret)" if resp.status == 403 else ")"),
                        status=resp.status,
                    )
                raw = bytearray()
                async for chunk in resp.content.iter_chunked(64 * 1024):
                    raw += chunk
                    if len(raw) > MAX_HOP_ANSWER_BYTES:
                        too_long = f"answered more than {MAX_HOP_ANSWER_BYTES} bytes"
                        raise HopError(f"replica {peer.node} at {peer.url} {too_long}")
                answer = jsonrpc.loads(raw)
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as exc:
            reason = str(exc) or exc.__class__.__name__
            log.warning("replica_unreachable", peer=peer.node, op=op, reason=reason)
            raise HopError(
                f"replica {peer.node} at {peer.url} could not be reached ({reason}; the hop's bound is "
                f"{self.timeout_s:g} s)"
            ) from None
        finally:
            metrics.REPLICA_HOP_SECONDS.labels(op).observe(time.perf_counter() - started)
        if not isinstance(answer, dict):
            raise HopError(f"replica {peer.node} at {peer.url} answered something other than a JSON object")
        return answer

    async def relay(
        self, request: web.Request, peer: Peer, raw: bytes | None, principal: str, body: Any = None
    ) -> web.StreamResponse | None:
        """Send the client's request (method, path, headers, `raw` body, `body` its parsed JSON or
        None) to `peer`, with the `principal` this replica authenticated (the peer takes it as is)
        and this request's id, or the first replica's when this one was itself relayed (the peer
        logs it as `relayed_request_id`), and stream its response back.

        None when the peer cannot be reached (nothing was sent to the client then), is no longer at
        its address (another replica process answered there: HTTP 421 with `MISDIRECTED_HEADER`),
        or was lost before its response began with a request that is safe to send again
        (`jsonrpc.safe_to_resend`): this replica may then serve it. One that may have acted (a
        `tools/call`) gets a -32603 saying it may have run (in an HTTP 200, as the legacy wire
        answers a request's failure), never a second run here.

        Connecting is bounded by `timeout_s`, the response head and a plain body's reads by
        `read_timeout_s`, the gap between two SSE chunks by `stream_idle_s`; a client that goes
        away closes the hop. When the hop breaks in the middle of an SSE reply to a JSON-RPC
        request (the peer died), the client's stream ends with a -32603 error response under the
        request's id, unless its answer already went through (`_AnswerWatch`); any other broken
        reply is cut, as the peer's own would be.
        """
        # The body was already decoded by this replica: it goes on without its Content-Encoding. A
        # header the client repeated goes on repeated, so the peer judges what the client sent.
        headers = CIMultiDict(
            (k, v)
            for k, v in request.headers.items()
            if k.lower() not in _HOP_BY_HOP and k.lower() != "content-encoding"
        )
        if tracing.enabled():  # the hop carries this replica's span (the instrumentation writes it)
            tracing.without_context(headers)
        headers[SECRET_HEADER] = self.secret
        headers[FORWARDED_HEADER] = self.node
        headers[TARGET_HEADER] = peer.node
        # authenticated here (front.auth.Authenticator.principal)
        headers[RELAYED_PRINCIPAL_HEADER] = principal
        bound = structlog.contextvars.get_contextvars()
        # the first replica's id when this request was relayed here (a second hop): the client's
        request_id = bound.get("relayed_request_id") or bound.get("request_id")
        if isinstance(request_id, str):  # the peer logs it beside its own: one call, two lines, one id
            headers[RELAYED_REQUEST_ID_HEADER] = request_id
        try:
            upstream = await self._session().request(
                request.method,
                f"{peer.url}{request.path_qs}",
                data=raw if raw else None,
                headers=headers,
                allow_redirects=False,
                timeout=aiohttp.ClientTimeout(
                    total=None,
                    sock_connect=self.timeout_s,
                    connect=self.timeout_s,
                    sock_read=self.read_timeout_s,
                ),
            )
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
            log.warning(
                "replica_unreachable", peer=peer.node, op="relay", reason=str(exc) or exc.__class__.__name__
            )
            return None  # never connected: the peer saw nothing
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            reason = str(exc) or exc.__class__.__name__
            if body is None or jsonrpc.safe_to_resend(body):
                log.warning("replica_unreachable", peer=peer.node, op="relay", reason=reason)
                return None
            log.warning("replica_lost_mid_request", peer=peer.node, reason=reason)
            return _failed(body, _lost(peer, reason))
        if upstream.status == 421 and MISDIRECTED_HEADER in upstream.headers:
            upstream.release()
            there = upstream.headers[MISDIRECTED_HEADER][:64]
            if self.registered_at is None or await self.registered_at(there, peer.url):
                log.warning(
                    "replica_gone_from_its_address",
                    peer=peer.node,
                    now=there,
                    reason="another replica process serves its address",
                )
                return None  # the peer sought is gone; the process there served nothing
            # Not registered there: two replicas advertise one address (a misconfiguration), or the
            # one that answered is no replica of this store. Nothing ran; say so, adopt nothing.
            log.warning("replica_address_shared", peer=peer.node, answered=there, url=peer.url)
            return _failed(
                body,
                f"proxy replica {peer.node} is advertised at {peer.url}, where node {there} answers, "
                "which is not registered there: check each replica's replicas.advertise",
            )
        async with upstream:
            out = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            for name, value in upstream.headers.items():
                if name.lower() not in _HOP_BY_HOP:
                    out.headers.add(name, value)
            if upstream.content_length is not None:
                out.content_length = upstream.content_length
            await out.prepare(request)
            streaming = upstream.headers.get("Content-Type", "").startswith("text/event-stream")
            watch = _AnswerWatch.of(body) if streaming and request.method == "POST" else None
            try:
                while chunk := await (
                    asyncio.wait_for(upstream.content.readany(), self.stream_idle_s)
                    if streaming
                    else upstream.content.readany()
                ):
                    await out.write(chunk)
                    if watch is not None:
                        watch.feed(chunk)
            except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                reason = str(exc) or exc.__class__.__name__
                log.warning("replica_relay_broken", peer=peer.node, reason=reason)
                if watch is not None and not watch.answered:
                    error = jsonrpc.error_response(
                        watch.request_id, {"code": INTERNAL_ERROR, "message": _lost(peer, reason)}
                    )
                    # (a blank line first ends an event the peer left half-sent: a client drops it)
                    ending = b"\n\n" if watch.mid_event else b""
                    with contextlib.suppress(ConnectionError, OSError):
                        await out.write(ending + encode_message(error))
                        await out.write_eof()
                        return out
                if request.transport is not None:
                    request.transport.close()  # the client sees the stream cut, as it would from the peer
                return out
            with contextlib.suppress(aiohttp.ClientError, OSError, ConnectionError):
                await out.write_eof()
            return out


class _AnswerWatch:
    """Watches a relayed SSE reply for the answer to the JSON-RPC request `request_id`: `answered`
    once an event carrying a response (`result` or `error`) under that id went through."""

    __slots__ = ("request_id", "answered", "_parser")

    def __init__(self, request_id: jsonrpc.RequestId) -> None:
        self.request_id = request_id
        self.answered = False
        self._parser = SseParser()

    @classmethod
    def of(cls, body: Any) -> _AnswerWatch | None:
        """A watch for the request `body` (parsed JSON); None when it is no JSON-RPC request (a
        notification, a response, a batch, or no JSON)."""
        request_id = jsonrpc.request_id_of(body) if jsonrpc.is_request(body) else None
        return None if request_id is None else cls(request_id)

    @property
    def mid_event(self) -> bool:
        """True when the relayed bytes stop inside an SSE event (`SseParser.mid_event`)."""
        return self._parser.mid_event

    def feed(self, chunk: bytes) -> None:
        """Read the events `chunk` completes (nothing once the answer was seen)."""
        if self.answered:
            return
        events, _ = self._parser.feed(chunk)
        for event in events:
            try:
                message = jsonrpc.loads(event.data) if event.data else None
            except ValueError:
                continue
            if (
                isinstance(message, dict)
                and message.get("id") == self.request_id
                and ("result" in message or "error" in message)
            ):
                self.answered = True
                return


def _failed(body: Any, message: str) -> web.Response:
    """The -32603 `message` for a relayed request (`body`, parsed) that failed on the hop: in an
    HTTP 200, as every upstream failure on the legacy wire (an `mcp` 1.x client drops its transport
    on any other status); 502 when it has no id to answer."""
    request_id = jsonrpc.request_id_of(body)
    return web.json_response(
        jsonrpc.error_response(request_id, {"code": INTERNAL_ERROR, "message": message}),
        status=200 if request_id is not None else 502,
        dumps=jsonrpc.dumps_str,
    )


def _lost(peer: Peer, reason: str) -> str:
    """The -32603 message for a request whose peer was lost before it answered."""
    return (
        f"proxy replica {peer.node} serving this session was lost before it answered ({reason}); the "
        "request may have run there: check before sending it again"
    )
