"""Downstream legacy (handshake-era) sessions of the HTTP relay, and how their traffic is counted."""

from __future__ import annotations

import asyncio
import functools
import itertools
import secrets
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import structlog
from aiohttp import web

from proxy.legacy.replay import RelayStream
from proxy.protocol import jsonrpc
from proxy.protocol.jsonrpc import INTERNAL_ERROR, INVALID_REQUEST, JsonObject, RequestId
from proxy.protocol.sse import EventTooLargeError
from proxy.runtime import metrics
from proxy.tasks.model import ANONYMOUS, principal_hash

log = structlog.get_logger("proxy.transport")


def _dumps(obj: Any) -> str:
    return jsonrpc.dumps_str(obj)


MAX_SESSIONLESS = 1024  # principals whose session-less id maps are kept while idle
MAX_STREAMS = (
    16  # relayed SSE streams remembered per session for Last-Event-ID (the oldest ended ones go first)
)


@dataclass
class LegacySession:
    """One downstream legacy session: the upstream's session id, the principal that opened it (only
    they may use it), and the ids the proxy owns toward both sides:

    - `request_ids`: server→client requests relayed to the client (proxy id → upstream id), each
      answered at most once, so two upstream sessions' ids never cross;
    - `pending`: the client's requests in flight (client id → the proxy's upstream id), for
      cancellation; an answered request leaves it at once;
    - `streams`: the SSE streams relayed to the client (token → RelayStream) for `Last-Event-ID`,
      `get_stream` the standalone GET stream.
    """

    upstream_id: str | None
    principal: str = ANONYMOUS
    request_ids: dict[str, RequestId] = field(default_factory=dict)
    capabilities: JsonObject = field(
        default_factory=dict
    )  # what its initialize declared (elicitation, sampling, roots)
    pending: dict[RequestId, int] = field(default_factory=dict)
    streams: dict[str, RelayStream] = field(default_factory=dict)
    get_stream: RelayStream | None = None
    version: str = (
        ""  # the protocol revision its initialize asked for (when a request has no MCP-Protocol-Version)
    )
    node: str = ""  # the replica holding it (named in the ids of the questions it relays)
    previous_owner: str | None = None  # the replica it was adopted from (may still serve its requests)
    _ids: Iterator[int] = field(default_factory=lambda: itertools.count(1))

    def mint(self) -> int:
        """A fresh JSON-RPC id toward the upstream for one client request."""
        return next(self._ids)

    def question_id(self) -> str:
        """A fresh proxy id for a server→client request relayed to the client: `mtp-<node>.<random>`
        (the node routes the client's answer back to this replica), `mtp-<random>` without replicas."""
        return (
            f"mtp-{self.node}.{secrets.token_urlsafe(9)}" if self.node else "mtp-" + secrets.token_urlsafe(9)
        )

    def add_stream(self, stream: RelayStream) -> None:
        """Remember `stream` for resumption; past MAX_STREAMS the oldest ended stream is forgotten."""
        self.streams[stream.token] = stream
        while len(self.streams) > MAX_STREAMS:
            victim = next((s for s in self.streams.values() if s.closed and s is not self.get_stream), None)
            if victim is None:
                break
            del self.streams[victim.token]

    def end(self, reason: str = "the session ended (DELETE, or the upstream expired it)") -> None:
        """Stop every pump of this session (it ended, or the proxy shuts down: `reason`): a POST
        stream still waiting for its answer gets a JSON-RPC error saying so from its pump, which
        then closes it."""
        for stream in self.streams.values():
            stream.ended_by = reason
            if stream.pump is not None and not stream.pump.done():
                stream.pump.add_done_callback(
                    functools.partial(_close_after_pump, stream)
                )  # whatever the pump did on its way out
                stream.pump.cancel()
            else:
                stream.close()


def _close_after_pump(stream: RelayStream, _task: asyncio.Future[None]) -> None:
    stream.close()


class LegacySessions:
    """Downstream legacy sessions by the proxy's session id (in memory; lost on restart, then 404)."""

    def __init__(self) -> None:
        self._sessions: dict[str, LegacySession] = {}
        self._sessionless: dict[str, LegacySession] = {}  # principal -> its session-less traffic
        self._sessionless_ids = itertools.count(1)  # shared: one upstream sees every principal's ids
        self.node: str = ""  # this replica's node id (set by replica routing)

    def sessionless(self, principal: str) -> LegacySession:
        """The id maps of `principal`'s traffic without a session (a session-less upstream): its
        pending requests and server→client requests are its own, so a cancel or an answer from
        another principal never reaches them; upstream ids come from one counter shared by every
        principal (the upstream sees them all on one endpoint). Idle entries are forgotten past MAX_SESSIONLESS."""
        session = self._sessionless.get(principal)
        if session is None:
            if len(self._sessionless) >= MAX_SESSIONLESS:
                for key, old in list(self._sessionless.items()):
                    if (
                        not old.pending
                        and not old.request_ids
                        and all(s.closed for s in old.streams.values())
                    ):
                        del self._sessionless[key]
            session = LegacySession(
                upstream_id=None, principal=principal, _ids=self._sessionless_ids, node=self.node
            )
            self._sessionless[principal] = session
        return session

    def open(self, upstream_session_id: str, principal: str, capabilities: JsonObject | None = None) -> str:
        """Mint a proxy session id (visible ASCII, 192 bits) for a new upstream session of `principal`
        whose client declared `capabilities` (legacy ClientCapabilities) in its initialize."""
        sid = secrets.token_urlsafe(24)
        self._sessions[sid] = LegacySession(
            upstream_id=upstream_session_id,
            principal=principal,
            capabilities=dict(capabilities or {}),
            node=self.node,
        )
        return sid

    def get(self, sid: str, principal: str) -> LegacySession | None:
        """The session behind `sid`, or None when unknown, ended, or opened by another principal
        (that attempt is logged as a security event)."""
        session = self._sessions.get(sid)
        if session is not None and session.principal != principal:
            log.warning("security_foreign_session_access", principal=principal_hash(principal))
            return None
        return session

    def peek(self, sid: str) -> LegacySession | None:
        """The session behind `sid` whoever opened it (for replica routing), or None."""
        return self._sessions.get(sid)

    def adopt(
        self,
        sid: str,
        upstream_session_id: str,
        principal: str,
        capabilities: JsonObject | None = None,
        previous_owner: str | None = None,
    ) -> None:
        """Hold under its own id a session another replica opened (replica routing; the upstream
        session is the same). Its upstream request ids start at a random base (< 2**53), so they
        never meet the ones `previous_owner` still has in flight on that upstream session."""
        self._sessions[sid] = LegacySession(
            upstream_id=upstream_session_id,
            principal=principal,
            capabilities=dict(capabilities or {}),
            node=self.node,
            previous_owner=previous_owner,
            _ids=itertools.count(1 + secrets.randbelow(1 << 40) * 4096),
        )

    def end(self, sid: str) -> None:
        """Forget `sid` (DELETE, or the upstream expired it) and stop its streams' pumps."""
        session = self._sessions.pop(sid, None)
        if session is not None:
            session.end()

    def all(self) -> list[LegacySession]:
        """Every open session, and each principal's session-less one."""
        return [*self._sessions.values(), *self._sessionless.values()]

    def drained(self, drain_timeout_s: float) -> None:
        """At the drain deadline (SIGTERM + drain_timeout, s): each request still relayed gets its
        JSON-RPC error naming the shutdown (`Drain.at_deadline`)."""
        self.close(f"the proxy shut down (drain_timeout, {drain_timeout_s:g} s, passed)")

    def close(self, reason: str = "the proxy shut down") -> None:
        """Stop every session's pumps (proxy shutdown; `reason` goes into each unanswered
        request's JSON-RPC error: "<reason> before upstream X answered")."""
        for session in self.all():
            session.end(reason)


def observe_legacy(
    server: str, method: str, body: JsonObject, response: web.StreamResponse | None, seconds: float
) -> None:
    """Count one legacy-era request like a modern one: `calls_total` for tools/call (outcome `sync`,
    or `error` for an HTTP error status or a JSON-RPC error in a plain JSON reply; an SSE reply is
    not read), upstream latency (s)."""
    metrics.UPSTREAM_LATENCY.labels(server, method).observe(seconds)
    if method == "tools/call":
        raw = body.get("params")
        params: JsonObject = raw if isinstance(raw, dict) else {}
        name = params.get("name")
        tool = name if isinstance(name, str) else ""
        ok = response is not None and response.status < 400
        reply = getattr(response, "body", None)
        if ok and isinstance(reply, bytes) and reply[:1] == b"{":
            try:
                ok = "error" not in jsonrpc.loads(reply)
            except (ValueError, RecursionError):
                pass
        metrics.CALLS.labels(server, tool[:256], "sync" if ok else "error").inc()


async def read_limited(upstream: aiohttp.ClientResponse, limit: int) -> bytes:
    """The whole body of an upstream reply; EventTooLargeError once it passes `limit` bytes."""
    data = bytearray()
    async for chunk in upstream.content.iter_chunked(1 << 16):
        data += chunk
        if len(data) > limit:
            raise EventTooLargeError(f"a reply larger than max_response_bytes ({limit} bytes)")
    return bytes(data)


def as_jsonrpc_reply(server: str, status: int, data: bytes, request_id: Any) -> tuple[int, bytes]:
    """An upstream's plain (non-SSE) reply as the client gets it: a JSON-RPC message passes as is;
    an empty body passes for a success status (202 to a notification); anything else (an HTML
    error page, plain text) becomes a JSON-RPC error naming the upstream's status. An upstream 5xx
    answering a request (`request_id` not None) goes out as HTTP 200, the JSON-RPC error inside
    (protocol.md §1.4.4: an `mcp` 1.x client raises on any other status and its whole transport
    dies); answering a notification or response, as 502. An upstream 4xx passes (404: session gone)."""
    failed = 200 if request_id is not None else 502
    if not data.strip():
        if status < 400:
            return status, data
    else:
        try:
            message = jsonrpc.loads(data)
        except (ValueError, UnicodeDecodeError, RecursionError):
            message = None
        if isinstance(message, dict) and message.get("jsonrpc") == "2.0":
            return (status if status < 500 else failed), data
    code = INVALID_REQUEST if status < 500 else INTERNAL_ERROR
    text = data[:200].decode("utf-8", errors="replace").strip()
    error = {
        "code": code,
        "message": f"upstream {server} answered HTTP {status}" + (f": {text}" if text else ""),
    }
    return (status if 400 <= status < 500 else failed), _dumps(
        jsonrpc.error_response(request_id, error)
    ).encode()
