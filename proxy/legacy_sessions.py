"""Downstream legacy (handshake-era) sessions of the HTTP relay, and how their traffic is counted."""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any

import structlog
from aiohttp import web

from . import observability as obs
from .auth import ANONYMOUS, principal_hash
from .protocol import jsonrpc
from .protocol.jsonrpc import JsonObject, RequestId
from .upstream.sse import SseEvent, encode_event

log = structlog.get_logger("proxy.transport")


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


@dataclass
class LegacySession:
    """One downstream legacy session: the upstream's session id, the principal that opened it (only
    they may use it), and the server→client request ids the proxy rewrote (proxy id → upstream id),
    so two clients' ids never cross."""

    upstream_id: str | None
    principal: str = ANONYMOUS
    request_ids: dict[str, RequestId] = field(default_factory=dict)


class LegacySessions:
    """Downstream legacy sessions by the proxy's session id (in memory; lost on restart, then 404)."""

    def __init__(self) -> None:
        self._sessions: dict[str, LegacySession] = {}
        self.sessionless = LegacySession(upstream_id=None)

    def open(self, upstream_session_id: str, principal: str) -> str:
        """Mint a proxy session id (visible ASCII, 192 bits) for a new upstream session of `principal`."""
        sid = secrets.token_urlsafe(24)
        self._sessions[sid] = LegacySession(upstream_id=upstream_session_id, principal=principal)
        return sid

    def get(self, sid: str, principal: str) -> LegacySession | None:
        """The session behind `sid`, or None when unknown, ended, or opened by another principal
        (that attempt is logged as a security event)."""
        session = self._sessions.get(sid)
        if session is not None and session.principal != principal:
            log.warning("security_foreign_session_access", principal=principal_hash(principal))
            return None
        return session

    def end(self, sid: str) -> None:
        """Forget `sid` (DELETE, or the upstream expired it)."""
        self._sessions.pop(sid, None)


def rewrite_server_request(event: SseEvent, session: LegacySession) -> bytes:
    """Re-encode one upstream SSE event; a server→client request gets a proxy-minted id."""
    try:
        msg = json.loads(event.data) if event.data.strip() else None
    except ValueError:
        msg = None
    if jsonrpc.is_request(msg):
        proxy_id = "mtp-" + secrets.token_urlsafe(9)
        session.request_ids[proxy_id] = msg["id"]
        event = SseEvent(event.event, _dumps({**msg, "id": proxy_id}), event.id, event.retry)
    return encode_event(event)


def observe_legacy(server: str, method: str, body: JsonObject, response: web.StreamResponse | None, seconds: float) -> None:
    """Count one legacy-era request like a modern one: `calls_total` for tools/call (outcome `sync`
    or `error` by HTTP status; a JSON-RPC error inside a 200 reply is not read), upstream latency (s)."""
    obs.UPSTREAM_LATENCY.labels(server, method).observe(seconds)
    if method == "tools/call":
        params = body.get("params") if isinstance(body.get("params"), dict) else {}
        tool = params.get("name") if isinstance(params.get("name"), str) else ""
        ok = response is not None and response.status < 400
        obs.CALLS.labels(server, tool[:256], "sync" if ok else "error").inc()
