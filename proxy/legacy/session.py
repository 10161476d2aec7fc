"""The legacy session machine: what the proxy owns between a handshake-era client and its upstream,
whichever kind the upstream is (uvicorn's h11 protocol is the model: state changed by the events it
is fed, no I/O here; the I/O adapters in `relay.py` and `child.py` do the sending and reading).

A legacy session (2025-11-25 basic/transports, "Session Management") is bound to the principal that
opened it (for anyone else it does not exist) and holds the ids the proxy owns toward both sides:

- its own JSON-RPC ids toward the upstream for the client's requests (`send`: minted here for an
  HTTP upstream session, by the child for a stdio child that several sessions share), mapped back
  to the client's id on the answer; a `notifications/cancelled` reaches the upstream only for a
  request still in flight (`cancel`), never for one answered or unknown;
- its own ids toward the client for the upstream's questions (elicitation, sampling, roots:
  `mtp-<node>.<random>`, so replicas route the answer back), each answered upstream at most once
  (`take_answer`), and withdrawn under the id the client knows when the upstream cancels it;
- its own progress tokens toward a shared stdio child, mapped back to the client's;
- its own SSE event ids toward the client: every reply stream is a `replay.RelayStream`, kept
  for `Last-Event-ID` resumption (`streams`, the standalone GET stream in `get_stream`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import secrets
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import structlog

from proxy.legacy.replay import RelayStream
from proxy.protocol import jsonrpc
from proxy.protocol.jsonrpc import JsonObject, JsonRpcError, RequestId, limit_error, object_of
from proxy.runtime import metrics
from proxy.tasks.model import ANONYMOUS, principal_hash

log = structlog.get_logger("proxy.legacy")

MAX_SESSIONLESS = 1024  # principals whose session-less id maps are kept while idle
MAX_STREAMS = 16  # reply streams remembered per session for Last-Event-ID (the oldest ended go first)
MAX_OPEN_QUESTIONS = 1024  # upstream questions per session awaiting the client's answer, at most


@dataclass(slots=True)
class Outbound:
    """A client request in flight upstream: the proxy's `upstream_id` for it, the stdio child it
    went to (`target`; None for the session's HTTP upstream), the reply stream that carries its
    answer, and the progress token the proxy sent in place of the client's (stdio). `unsent`: the
    upstream never ran it (no connection could be made, a stdio child never had it, or the upstream
    answered 404: it knows no such session)."""

    upstream_id: RequestId
    target: Any = None
    stream: RelayStream | None = None
    client_token: Any = None
    upstream_token: str | None = None
    unsent: bool = False
    opening: asyncio.Future[Any] | None = None  # (HTTP) the exchange, until its reply stream exists
    ended: tuple[int, str] | None = None  # why `abandon` gave it up: (JSON-RPC code, message)
    input_timeout_s: float | None = None  # how long (s) a question it brings waits for the client

    def abandon(self, code: int, message: str) -> bool:
        """Give up a request whose upstream has not sent its response headers yet (no reply stream,
        so `RelayStream.abandon` cannot end it): its exchange is cancelled, and the handler waiting
        for it answers the client with `code` and `message`. False when it is not waiting so."""
        if self.stream is not None or self.opening is None or self.opening.done():
            return False
        self.ended = (code, message)
        self.opening.cancel()
        return True


@dataclass(slots=True)
class Question:
    """An upstream question relayed to the client: the upstream's own id for it, and the stdio
    child that asked it (`target`; None for the session's HTTP upstream)."""

    upstream_id: RequestId
    target: Any = None


# The client capability each server→client request needs (2025-11-25 "Client Features").
NEEDED_CAPABILITY = {
    "elicitation/create": "elicitation",
    "sampling/createMessage": "sampling",
    "roots/list": "roots",
}


def same_id(a: Any, b: Any) -> bool:
    """JSON-RPC ids are equal when their values and types are (1 is not "1", nor True)."""
    return type(a) is type(b) and a == b


@dataclass
class LegacySession:
    """One downstream legacy session (see the module docstring). `upstream_id` is the upstream's
    own `Mcp-Session-Id` (None toward a stdio child or a session-less upstream), `capabilities`
    what its `initialize` declared (elicitation, sampling, roots), `version` the revision it asked
    for (when a request carries no `MCP-Protocol-Version`), `node` the replica holding it, and
    `previous_owner` the replica it was adopted from (which may still serve its requests)."""

    upstream_id: str | None
    principal: str = ANONYMOUS
    capabilities: JsonObject = field(default_factory=dict)
    version: str = ""
    node: str = ""
    previous_owner: str | None = None
    declared: bool = True  # False for session-less traffic: no `initialize` declared its capabilities
    pending: dict[RequestId, Outbound] = field(default_factory=dict)  # client id → its request in flight
    questions: dict[str, Question] = field(default_factory=dict)  # proxy id → an upstream question
    streams: dict[str, RelayStream] = field(default_factory=dict)  # token → a reply stream
    get_stream: RelayStream | None = None
    # client id → hook, called with the request's Outbound once it is answered or failed
    after_answer: dict[RequestId, Callable[[Outbound], None]] = field(default_factory=dict)
    last_used: float = field(default_factory=time.monotonic)  # time.monotonic() (s) of its last request
    _ids: Iterator[int] = field(default_factory=lambda: itertools.count(1))

    # -- the client's requests -----------------------------------------------------------------

    def mint(self) -> int:
        """A fresh JSON-RPC id toward this session's upstream."""
        return next(self._ids)

    def send(self, client_id: RequestId, upstream_id: RequestId, **outbound: Any) -> Outbound:
        """The client's request `client_id` goes upstream as `upstream_id` (`outbound`: the
        `Outbound` fields target, stream, client_token, upstream_token)."""
        sent = Outbound(upstream_id, **outbound)
        self.pending[client_id] = sent
        return sent

    def own_progress_token(self, params: JsonObject) -> tuple[JsonObject, Any, str | None]:
        """For an upstream several sessions share (a stdio child): `params` with the client's
        `_meta.progressToken` replaced by a fresh proxy token (`mtp-<random>`), the client's token,
        and the proxy's (both None when the request asks for no progress). `to_client` maps the
        upstream's progress back under the client's token."""
        meta = dict(object_of(params.get("_meta")))
        client_token = meta.get("progressToken")
        if client_token is None:
            return params, None, None
        upstream_token = meta["progressToken"] = "mtp-" + secrets.token_urlsafe(9)
        return {**params, "_meta": meta}, client_token, upstream_token

    def answered(self, client_id: RequestId | None, sent: Outbound) -> None:
        """`sent` needs no cancel any more (answered, or failed): a later cancel for it is dropped;
        the hook `after_answer` holds for it, if any, runs now."""
        if client_id is not None and self.pending.get(client_id) is sent:
            del self.pending[client_id]
            hook = self.after_answer.pop(client_id, None)
            if hook is not None:
                hook(sent)

    def cancel(self, client_id: Any) -> Outbound | None:
        """The request a client's `notifications/cancelled` names, when it is still in flight here
        (None: answered, unknown, or another principal's; such a cancel never reaches the upstream)."""
        if isinstance(client_id, bool) or not isinstance(client_id, (str, int)):
            return None
        return self.pending.get(client_id)

    def takes_over(self, client_id: RequestId, sent: Outbound, previous: LegacySession) -> None:
        """`sent` (an `initialize` sent without a session) belongs to this new session from now on,
        and the session's own ids go on after its id: MCP basic protocol, a requestor never uses an
        id twice within a session."""
        previous.answered(client_id, sent)
        self.pending[client_id] = sent
        if isinstance(sent.upstream_id, int):
            self._ids = itertools.count(sent.upstream_id + 1)

    # -- the upstream's questions -------------------------------------------------------------

    def question_id(self) -> str:
        """A fresh proxy id for an upstream question: `mtp-<node>.<random>` (the node routes the
        client's answer back to this replica), `mtp-<random>` without replicas."""
        return (
            f"mtp-{self.node}.{secrets.token_urlsafe(9)}" if self.node else "mtp-" + secrets.token_urlsafe(9)
        )

    def ask(self, upstream_id: RequestId, target: Any = None) -> str:
        """The proxy id the client sees an upstream question under (the oldest unanswered are
        forgotten past MAX_OPEN_QUESTIONS)."""
        proxy_id = self.question_id()
        self.questions[proxy_id] = Question(upstream_id, target)
        while len(self.questions) > MAX_OPEN_QUESTIONS:
            del self.questions[next(iter(self.questions))]
        return proxy_id

    def undeclared(self, message: JsonObject) -> str | None:
        """Why the client cannot be asked `message` (an upstream request), or None when it can: its
        `initialize` did not declare the capability the method needs (NEEDED_CAPABILITY; session-less
        traffic declared nothing and is asked anything)."""
        needed = NEEDED_CAPABILITY.get(str(message.get("method")))
        if needed is None or not self.declared or needed in self.capabilities:
            return None
        return f"the client did not declare the {needed} capability, so it cannot be sent {message['method']}"

    def take_answer(self, proxy_id: Any) -> Question | None:
        """The question a client's JSON-RPC response answers, at most once (None: unknown, already
        answered or withdrawn; such a response never reaches the upstream)."""
        return self.questions.pop(proxy_id, None) if isinstance(proxy_id, str) else None

    def withdraw(self, upstream_id: Any, target: Any = None) -> str | None:
        """The upstream cancelled its own question: the proxy id the client knows it by (the
        question is forgotten), or None when the client has no such question open."""
        for proxy_id, question in reversed(self.questions.items()):
            if question.target is target and same_id(question.upstream_id, upstream_id):
                del self.questions[proxy_id]
                return proxy_id
        return None

    # -- what the upstream sends toward the client -----------------------------------------------

    def to_client(
        self, message: JsonObject, sent: Outbound | None, client_id: Any, target: Any = None
    ) -> tuple[JsonObject | None, bool]:
        """One upstream message as the client gets it, and whether it answers the client's request:
        the answer to `sent` gets `client_id` back, a question a proxy id, a withdrawn question the
        proxy id the client knows, progress the client's own token; a response for any other id is
        dropped (None: never shown to the wrong request). `target` is the stdio child it came from.
        An answer unfit for an MCP client (`jsonrpc.response_problem`: a null result, both result and
        error, ...) becomes a -32603 error under `client_id`; what is no JSON-RPC message at all
        (`{"jsonrpc": "2.0"}`) is dropped. Returns `message` itself when nothing in it changes."""
        if jsonrpc.is_request(message):
            return {**message, "id": self.ask(message["id"], target)}, False
        if jsonrpc.is_response(message):
            if sent is not None and same_id(message.get("id"), sent.upstream_id):
                problem = jsonrpc.response_problem(message)
                if problem is None:
                    return {**message, "id": client_id}, True
                log.warning("legacy_bad_answer_replaced", reason=problem)
                error = jsonrpc.unfit_answer_error("the upstream", problem, message)
                return jsonrpc.error_response(client_id, error), True
            log.warning(
                "legacy_foreign_response_dropped", reason="a response for an id this stream does not carry"
            )
            return None, False
        if not jsonrpc.is_notification(message):
            log.warning("legacy_upstream_garbage_dropped", reason="an object that is no JSON-RPC message")
            return None, False
        params = object_of(message.get("params"))
        if message.get("method") == "notifications/cancelled":
            proxy_id = self.withdraw(params.get("requestId"), target)
            if proxy_id is None:
                log.info(
                    "legacy_cancel_dropped", reason="the upstream cancelled no question the client has open"
                )
                return None, False
            return {**message, "params": {**params, "requestId": proxy_id}}, False
        token = params.get("progressToken")
        if sent is not None and sent.upstream_token is not None and token == sent.upstream_token:
            return {**message, "params": {**params, "progressToken": sent.client_token}}, False
        return message, False

    # -- reply streams --------------------------------------------------------------------------

    def add_stream(self, stream: RelayStream) -> None:
        """Remember `stream` for resumption; past MAX_STREAMS the oldest ended stream is forgotten."""
        self.streams[stream.token] = stream
        while len(self.streams) > MAX_STREAMS:
            victim = next((s for s in self.streams.values() if s.closed and s is not self.get_stream), None)
            if victim is None:
                break
            del self.streams[victim.token]

    def idle(self) -> bool:
        """True when nothing of this session is in flight (no request, question or open stream)."""
        return not self.pending and not self.questions and all(s.closed for s in self.streams.values())

    def end(self, message: str) -> None:
        """Stop every stream of this session (it ended, or the proxy shuts down), and every request
        still waiting for its upstream's response headers; a reply still waiting for its answer
        gets a -32603 JSON-RPC error with `message`."""
        for stream in self.streams.values():
            stream.abandon(jsonrpc.INTERNAL_ERROR, message)
        for sent in list(self.pending.values()):
            sent.abandon(jsonrpc.INTERNAL_ERROR, message)


class LegacySessions:
    """Downstream legacy sessions of server `name` by the proxy's session id (in memory; lost on
    restart, then 404), and each principal's session-less traffic. `node` is this replica's id
    (named in the ids of the questions sessions relay; "" without replicas). `max_per_principal`
    (`limits.max_sessions_per_principal`, None: no cap) bounds the sessions one principal holds
    here at once, its initializes still in flight included (`opening`)."""

    def __init__(self, name: str, *, node: str = "", max_per_principal: int | None = None) -> None:
        self.name = name
        self.node = node
        self.max_per_principal = max_per_principal
        self._sessions: dict[str, LegacySession] = {}
        self._held: Counter[str] = Counter()  # principal → its sessions in `_sessions`
        self._opening: Counter[str] = Counter()  # principal → its initializes in flight, none opened yet
        self._opened: Counter[str] = Counter()  # principal → of those, the ones that have opened theirs
        self._sessionless: dict[str, LegacySession] = {}  # principal → its session-less traffic
        self._sessionless_ids = itertools.count(1)  # shared: one upstream sees every principal's ids

    def over_cap(self, principal: str) -> JsonRpcError | None:
        """The `max_sessions_per_principal` limit error (HTTP 429, -32603 with `data.limit`), logged
        (`limit_refused`) and counted, when `principal`'s sessions here and initializes in flight
        already reach the cap; else None. Asked before an `initialize` reaches the upstream."""
        cap = self.max_per_principal
        held, opening = self.counts(principal)
        if cap is None or held + opening < cap:
            return None
        log.warning("limit_refused", limit="max_sessions_per_principal", principal=principal_hash(principal))
        metrics.LIMIT_REJECTIONS.labels("max_sessions_per_principal").inc()
        return limit_error(
            "max_sessions_per_principal",
            f"this principal holds {held} sessions on server {self.name} and opens {opening} more; end "
            "one (DELETE) or let one expire",
            max=cap,
        )

    @contextlib.contextmanager
    def opening(self, principal: str) -> Iterator[None]:
        """Count one `initialize` of `principal` in flight (for `over_cap`) while it is relayed; once
        it has opened its session (`open`), that session counts instead. The counts are per
        principal, not per request: which of its initializes opened one does not matter."""
        self._opening[principal] += 1
        try:
            yield
        finally:
            if self._opened[principal]:
                _take_one(self._opened, principal)
            else:
                _take_one(self._opening, principal)

    def open(self, upstream_id: str | None, principal: str, capabilities: JsonObject, version: str) -> str:
        """Mint a proxy session id (visible ASCII, 192 bits) for a new session of `principal`
        (toward upstream session `upstream_id`, None for a stdio child) whose client declared
        `capabilities` and asked for revision `version` in its initialize."""
        sid = secrets.token_urlsafe(24)
        if self._opening[principal]:  # the initialize in flight that opens it no longer counts
            _take_one(self._opening, principal)
            self._opened[principal] += 1
        self._hold(sid, upstream_id, principal, capabilities, version=version)
        return sid

    def _hold(
        self, sid: str, upstream_id: str | None, principal: str, capabilities: JsonObject, **fields: Any
    ) -> None:
        """Keep a new session of `principal` under `sid` on this replica, counted for its principal
        (`fields`: the other `LegacySession` fields)."""
        self._sessions[sid] = LegacySession(
            upstream_id=upstream_id,
            principal=principal,
            capabilities=dict(capabilities),
            node=self.node,
            **fields,
        )
        self._held[principal] += 1

    def _drop(self, sid: str) -> LegacySession | None:
        """Forget the session under `sid` (None when unknown), uncounted for its principal."""
        session = self._sessions.pop(sid, None)
        if session is not None:
            _take_one(self._held, session.principal)
        return session

    def counts(self, principal: str) -> tuple[int, int]:
        """(sessions held, initializes in flight that have opened none yet) of `principal` here."""
        return self._held[principal], self._opening[principal]

    def get(self, sid: str, principal: str) -> LegacySession | None:
        """The session behind `sid`, or None when unknown, ended, or opened by another principal
        (that attempt is logged as a security event)."""
        session = self._sessions.get(sid)
        if session is not None and session.principal != principal:
            log.warning("security_foreign_session_access", principal=principal_hash(principal))
            return None
        if session is not None:
            session.last_used = time.monotonic()
        return session

    def expire_idle(self, idle_s: float) -> list[tuple[str, LegacySession]]:
        """Forget the sessions nobody used for `idle_s` (s) and that have nothing in flight (no
        request, question or open stream), and return them with their ids (the caller ends their
        upstream side). A later request with one of their ids gets the era's 404."""
        deadline = time.monotonic() - idle_s
        expired = [
            sid for sid, session in self._sessions.items() if session.last_used <= deadline and session.idle()
        ]
        sessions = [(sid, session) for sid in expired if (session := self._drop(sid)) is not None]
        for _, session in sessions:
            session.end(self._ended("the session expired (listen.legacy_session_idle)"))
        return sessions

    def sessionless(self, principal: str) -> LegacySession:
        """The id maps of `principal`'s traffic without a session (a session-less HTTP upstream):
        its requests and questions are its own, so a cancel or an answer from another principal
        never reaches them; upstream ids come from one counter shared by every principal (the
        upstream sees them all on one endpoint). Idle entries are forgotten past MAX_SESSIONLESS."""
        session = self._sessionless.get(principal)
        if session is None:
            if len(self._sessionless) >= MAX_SESSIONLESS:
                for key, old in list(self._sessionless.items()):
                    if old.idle():
                        del self._sessionless[key]
            session = LegacySession(
                upstream_id=None,
                principal=principal,
                _ids=self._sessionless_ids,
                node=self.node,
                declared=False,
            )
            self._sessionless[principal] = session
        return session

    def end(self, sid: str) -> None:
        """Forget `sid` (DELETE, or the upstream expired it) and stop its streams: a reply still
        waiting gets a JSON-RPC error saying the session ended."""
        session = self._drop(sid)
        if session is not None:
            session.end(self._ended("the session ended (DELETE, or the upstream expired it)"))

    def _ended(self, reason: str) -> str:
        return f"{reason} before upstream {self.name} answered"

    def all(self) -> list[LegacySession]:
        """Every open session, and each principal's session-less one."""
        return [*self._sessions.values(), *self._sessionless.values()]

    def drained(self, reason: str) -> None:
        """At the drain deadline (SIGTERM + drain_timeout, s, or a second signal): each request
        still waiting gets its JSON-RPC error naming the shutdown and `reason` (`Drain.at_deadline`)."""
        self.close(f"the proxy shut down ({reason})")

    def close(self, reason: str = "the proxy shut down") -> None:
        """Stop every session's streams (proxy shutdown; `reason` goes into each unanswered
        request's JSON-RPC error: "<reason> before upstream X answered")."""
        for session in self.all():
            session.end(self._ended(reason))

    # -- as replica routing sees them -----------------------------------------------------------

    def knows(self, sid: str) -> bool:
        """True when session `sid` is held here."""
        return sid in self._sessions

    def describe(self, sid: str) -> tuple[str | None, str, JsonObject]:
        """(upstream session id, principal, capabilities) of a session held here."""
        session = self._sessions[sid]
        return session.upstream_id, session.principal, session.capabilities

    def adopt(
        self, sid: str, upstream_id: str, principal: str, capabilities: JsonObject, previous_owner: str | None
    ) -> None:
        """Hold under its own id a session another replica opened on an HTTP upstream (the
        upstream session is the same). Its upstream request ids start at a random base (< 2**53),
        so they never meet the ones `previous_owner` still has in flight on that upstream session."""
        self._drop(sid)  # adopted twice (two requests racing): counted once
        self._hold(
            sid,
            upstream_id,
            principal,
            capabilities,
            previous_owner=previous_owner,
            _ids=itertools.count(1 + secrets.randbelow(1 << 40) * 4096),
        )

    def cancel_elsewhere(self, sid: str, body: Any) -> str | None:
        """The previous owner of adopted session `sid` when `body` is a `notifications/cancelled`
        for a request not sent from here (the previous owner sent it), else None."""
        session = self._sessions.get(sid)
        if session is None or session.previous_owner is None or not isinstance(body, dict):
            return None
        if body.get("method") != "notifications/cancelled":
            return None
        request_id = object_of(body.get("params")).get("requestId")
        if isinstance(request_id, (str, int)) and request_id not in session.pending:
            return session.previous_owner
        return None


def _take_one(counts: Counter[str], principal: str) -> None:
    """One less for `principal` in `counts`; a count that reaches 0 leaves (no empty entries kept)."""
    counts[principal] -= 1
    if counts[principal] <= 0:
        del counts[principal]
