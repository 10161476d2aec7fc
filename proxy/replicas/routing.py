"""Which replica serves a client request: the hook each MCP endpoint calls before handling one.

- A legacy session (`Mcp-Session-Id`) lives on the replica that opened it (the shared session
  map names it): its requests are relayed there whole while it is up. When it is gone, a session
  of an HTTP upstream is adopted here (same upstream session; so are the new requests of one whose
  replica is draining), and one of a stdio upstream ends: 404, and the client initializes again
  (2025-11-25 transports §"Session Management").
- An MRTR retry (`requestState`) goes to the replica where its call is parked (the state names it).
- While draining, this replica refuses new calls and new sessions with HTTP 503 and a JSON-RPC
  error, so a load balancer retries them on another replica.
"""

from __future__ import annotations

from typing import Any

import structlog
from aiohttp import web

from proxy.calls.mrtr import ParkedCalls
from proxy.protocol import jsonrpc
from proxy.protocol.era import is_modern_request
from proxy.protocol.jsonrpc import INTERNAL_ERROR, INVALID_PARAMS, JsonRpcError
from proxy.replicas.forward import (
    FORWARDED_HEADER,
    MISDIRECTED_HEADER,
    RELAYED_REQUEST_ID_HEADER,
    TARGET_HEADER,
)
from proxy.replicas.node import Replicas
from proxy.runtime.running import bind
from proxy.tasks.model import principal_hash
from proxy.tasks.store import StoreUnavailableError

log = structlog.get_logger("proxy.replicas")

MRTR_METHODS = frozenset({"tools/call", "prompts/get", "resources/read"})
# POSTs answered by a stream of open-ended length
STREAM_METHODS = frozenset({"subscriptions/listen", "tasks/result"})
SESSION_TTL_MS = 24 * 3600 * 1000  # a legacy session's map entry outlives any sane session


def drain_refusal(request_id: Any, what: str) -> web.Response:
    """HTTP 503 with a JSON-RPC -32603 saying this replica is shutting down (retry elsewhere)."""
    err = JsonRpcError(
        INTERNAL_ERROR,
        f"this proxy replica is shutting down and takes no {what}; send it again (another replica takes it)",
    )
    response = web.json_response(jsonrpc.error_response(request_id, err.to_error()), status=503)
    response.headers["Retry-After"] = "0"
    return response


def store_refusal(request_id: Any, exc: StoreUnavailableError) -> web.Response:
    """HTTP 503 with a JSON-RPC -32603 naming the store: a legacy session cannot be opened or found
    while the shared session map is unreadable (nothing was started; the client may retry)."""
    err = JsonRpcError(
        INTERNAL_ERROR, f"legacy sessions are shared through the task store, which is unavailable: {exc}"
    )
    response = web.json_response(jsonrpc.error_response(request_id, err.to_error()), status=503)
    response.headers["Retry-After"] = "1"
    return response


def _question_node(body: Any) -> str | None:
    """The replica named in the id of a client's JSON-RPC response (`mtp-<node>.<random>`), or None."""
    if not isinstance(body, dict) or "method" in body or not ("result" in body or "error" in body):
        return None
    rid = body.get("id")
    if not isinstance(rid, str) or not rid.startswith("mtp-") or "." not in rid:
        return None
    return rid[4:].split(".", 1)[0] or None


class EndpointRouter:
    """Routing for the endpoint of server `server`. `sessions` answers whether a legacy session id
    is held here (`knows`), and adopts one (`adopt`); `kind` is `http` or `stdio`."""

    def __init__(
        self, replicas: Replicas, *, server: str, kind: str, sessions: Any, parked: ParkedCalls
    ) -> None:
        self.replicas = replicas
        self.server = server
        self.kind = kind
        self.sessions = sessions
        self.parked = parked

    def _key(self, sid: str) -> str:
        return f"session:{self.server}:{sid}"

    async def route(
        self, request: web.Request, body: Any, raw: bytes | None, principal: str
    ) -> web.StreamResponse | None:
        """A response when the request is served elsewhere or refused; None to serve it here."""
        request[ROUTER_KEY] = self
        named = body.get("method") if isinstance(body, dict) else None
        method = named if isinstance(named, str) else None  # an array or object is refused here as ever
        if request.method == "GET" or method in STREAM_METHODS:
            self.replicas.track(stream=True)  # open until the client leaves: cut when this replica exits
        elif request.method == "POST":
            self.replicas.track(stream=False)  # a request that ends by itself (bounded): waited for on drain
        sid = (request.headers.get("Mcp-Session-Id") or "").strip()
        if not sid.isascii():
            return None  # no id of ours: this replica answers it (404), as one process would
        if self.replicas.forwarded(request):
            target = request.headers.get(TARGET_HEADER, self.replicas.node)
            if target != self.replicas.node:  # meant for a node that held this address before a restart
                return web.json_response(
                    {"error": f"replica {target[:64]} is not at this address: node {self.replicas.node} is"},
                    status=421,
                    headers={MISDIRECTED_HEADER: self.replicas.node},
                )
            relayed_id = request.headers.get(RELAYED_REQUEST_ID_HEADER, "")
            if relayed_id.isascii() and relayed_id.isalnum() and len(relayed_id) <= 32:
                bind(relayed_request_id=relayed_id)
            # Served here, except a cancel relayed by a third replica (the map names this replica
            # since it adopted the session) for a request the previous owner sent: one more hop, at most.
            previous = self.sessions.cancel_elsewhere(sid, body) if sid and request.method == "POST" else None
            if (
                previous is not None
                and previous != request.headers.get(FORWARDED_HEADER)
                and await self._holds(sid)
            ):
                # Only the map's owner does this: no cycle.
                return await self._relay_to(request, previous, raw, principal, body)
            return None
        if sid:
            return await self._session(request, sid, body, raw, principal)
        if body is None or not isinstance(body, dict):
            return None
        if is_modern_request(request.headers, body):
            params = body.get("params")
            if method in MRTR_METHODS and isinstance(params, dict) and "requestState" in params:
                return await self._mrtr(request, body, params["requestState"], raw, principal)
            if self.replicas.draining and method in MRTR_METHODS:
                return drain_refusal(jsonrpc.request_id_of(body), "new calls")
            return None
        if self.replicas.draining and method == "initialize":
            return drain_refusal(jsonrpc.request_id_of(body), "new sessions")
        if method == "initialize":
            try:  # a session nobody else could find is worse than none: the store must answer first
                await self.replicas.shared.session_get(self._key("-"))
            except StoreUnavailableError as exc:
                return store_refusal(jsonrpc.request_id_of(body), exc)
        return None

    async def _mrtr(
        self, request: web.Request, body: Any, state: Any, raw: bytes | None, principal: str
    ) -> web.StreamResponse | None:
        owner = self.parked.owner_of(state)
        if owner is None or owner == self.replicas.node:
            return None  # parked here (or not a valid state: refused here as usual)
        peer = await self.replicas.peer(owner)
        if peer is not None:
            relayed = await self.replicas.forwarder.relay(request, peer, raw, principal, body)
            if relayed is not None:
                return relayed
        err = JsonRpcError(
            INVALID_PARAMS,
            "requestState belongs to a call on a proxy replica that is gone; send the request again without "
            "it",
        )
        return web.json_response(
            jsonrpc.error_response(jsonrpc.request_id_of(body), err.to_error()), status=err.http_status
        )

    async def _holds(self, sid: str) -> bool:
        """True when the session map names this replica as the owner of `sid`."""
        try:
            entry = await self.replicas.shared.session_get(self._key(sid))
        except StoreUnavailableError:
            return False
        return isinstance(entry, dict) and entry.get("owner") == self.replicas.node

    async def _relay_to(
        self, request: web.Request, node: Any, raw: bytes | None, principal: str, body: Any
    ) -> web.StreamResponse | None:
        peer = await self.replicas.peer(node)
        return (
            None if peer is None else await self.replicas.forwarder.relay(request, peer, raw, principal, body)
        )

    async def _session(
        self, request: web.Request, sid: str, body: Any, raw: bytes | None, principal: str
    ) -> web.StreamResponse | None:
        new_call = request.method == "POST" and isinstance(body, dict) and body.get("method") == "tools/call"
        # The client's answer to a question goes to the replica that relayed the question (its id
        # names it: `mtp-<node>.<random>`), which may be a draining previous owner of the session.
        asker = _question_node(body) if request.method == "POST" else None
        if asker is not None and asker != self.replicas.node:
            relayed = await self._relay_to(request, asker, raw, principal, body)
            if relayed is not None:
                return relayed
        # A cancel of a request this replica did not send goes to the replica the session came from.
        previous = self.sessions.cancel_elsewhere(sid, body) if request.method == "POST" else None
        if previous is not None:
            relayed = await self._relay_to(request, previous, raw, principal, body)
            if relayed is not None:
                return relayed
        if self.sessions.knows(sid):
            if self.replicas.draining and new_call and self.kind == "http":
                # retried elsewhere, which adopts the session
                return drain_refusal(jsonrpc.request_id_of(body), "new calls")
            return None
        try:
            entry = await self.replicas.shared.session_get(self._key(sid))
        except StoreUnavailableError as exc:
            return store_refusal(jsonrpc.request_id_of(body), exc)  # not a 404: the session may well exist
        if not isinstance(entry, dict):
            return None  # unknown anywhere: 404 here
        peer = await self.replicas.peer(entry.get("owner"))
        # A draining owner still gets what belongs to running exchanges (answers to its questions,
        # notifications, streams); new requests of an HTTP upstream's session move here.
        is_request = request.method == "POST" and isinstance(body, dict) and "method" in body and "id" in body
        if peer is not None and not (peer.draining and self.kind == "http" and is_request):
            relayed = await self.replicas.forwarder.relay(request, peer, raw, principal, body)
            if relayed is not None:
                return relayed
        if (
            self.kind == "http"
            and entry.get("principal") == principal_hash(principal)
            and isinstance(entry.get("upstream"), str)
        ):
            capabilities = entry.get("capabilities")
            owner = entry.get("owner")
            caps = capabilities if isinstance(capabilities, dict) else {}
            self.sessions.adopt(
                sid, entry["upstream"], principal, caps, owner if isinstance(owner, str) else None
            )
            await self.record(sid, upstream=entry["upstream"], principal=principal, capabilities=capabilities)
            log.info("legacy_session_adopted", server=self.server, previous_owner=entry.get("owner"))
        return None  # adopted, or a stdio session whose replica is gone: 404 here

    async def record(self, sid: str, *, upstream: str | None, principal: str, capabilities: Any) -> None:
        """Write the session map entry of a session this replica holds (owner: this replica)."""
        value = {
            "owner": self.replicas.node,
            "kind": self.kind,
            "upstream": upstream,
            "principal": principal_hash(principal),
            "capabilities": capabilities if isinstance(capabilities, dict) else {},
        }
        try:
            await self.replicas.shared.session_put(self._key(sid), value, SESSION_TTL_MS)
        except StoreUnavailableError as exc:
            log.warning("session_map_write_failed", reason=str(exc))

    async def forget(self, sid: str) -> None:
        """Remove the session map entry of a session that ended here."""
        try:
            await self.replicas.shared.session_delete(self._key(sid))
        except StoreUnavailableError as exc:
            log.warning("session_map_write_failed", reason=str(exc))


ROUTER_KEY = web.RequestKey("replica_router", EndpointRouter)  # the router that saw the request


async def on_response_prepare(request: web.Request, response: web.StreamResponse) -> None:
    """aiohttp signal, before a response's head goes out: a legacy session this replica just opened
    is written to the session map first (so the client's next request, wherever it lands, finds
    it), and one it ended (DELETE) is removed."""
    router = request.get(ROUTER_KEY)
    if router is None or response.status >= 300:
        return
    asked = (request.headers.get("Mcp-Session-Id") or "").strip()
    if asked:
        if request.method == "DELETE" and router.sessions.knows(asked) is False:
            await router.forget(asked)
        return
    sid = (response.headers.get("Mcp-Session-Id") or "").strip()
    if sid and router.sessions.knows(sid):
        upstream, principal, capabilities = router.sessions.describe(sid)
        await router.record(sid, upstream=upstream, principal=principal, capabilities=capabilities)
