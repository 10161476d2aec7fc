"""What the HTTP and stdio connectors share, and all the rest of the proxy knows of them: the
`Pool` and `Session` protocols, their error types, the one rule for a session the upstream forgot
(`with_session`), the bounds of one server's waits, the capability-set key, and the readiness probe.

A pool holds the sessions of one configured server, one per client-capability set (legacy servers
decide what they offer from the `initialize` capabilities, protocol.md §3.4): Streamable HTTP
sessions (`http_pool.UpstreamPool`) or child processes (`stdio_pool.StdioPool`).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import aiohttp

from proxy.config.base import redact_url, url_password
from proxy.protocol.jsonrpc import JsonObject, RequestId

# Called with every message that arrives on a request's stream before its response:
# notifications and server→client requests. Returns nothing; answers go through `respond`.
MessageHandler = Callable[[JsonObject], Awaitable[None]]


class UpstreamError(Exception):
    """The upstream could not be reached or broke the transport; the message names the cause."""


class UpstreamUndeliveredError(UpstreamError):
    """The request never reached the upstream: no connection to it could be made."""


class StaleConnectionError(UpstreamError):
    """A request that may act (a `tools/call`) was lost on a reused connection the server dropped as
    it arrived: it is not sent again, since the server may have read it (see
    `upstream.connections`), so whether it ran is unknown."""


class UpstreamTimeoutError(UpstreamError):
    """The upstream did not answer `initialize` within `init_timeout` (a hung upstream, not a refusal)."""


class RecentFailure:
    """The last failed attempt to open a session (start a child, initialize), which answers the
    callers that come within as long again as it took with its error at once (`check`), so callers
    never wait for one attempt after another. Times are `time.monotonic()` seconds."""

    def __init__(self) -> None:
        self._until = 0.0
        self._why = ""
        self._timed_out = False

    def check(self) -> None:
        """Raise UpstreamError (the failure's message; UpstreamTimeoutError for a timeout) while the
        last failure still answers."""
        if time.monotonic() < self._until:
            raise (UpstreamTimeoutError if self._timed_out else UpstreamError)(self._why)

    def failed(self, started: float, why: str, *, timed_out: bool = False) -> None:
        """An attempt begun at `started` (monotonic s) failed just now with message `why`
        (`timed_out`: it ran out of `init_timeout`)."""
        now = time.monotonic()
        self._until, self._why, self._timed_out = now + (now - started), why, timed_out

    def clear(self) -> None:
        """A session opened: an earlier failure answers nobody any more."""
        self._until = 0.0


class SessionExpiredError(UpstreamError):
    """The upstream answered 404 for our session id: it must be initialized again."""


class SessionBrokenError(SessionExpiredError):
    """A request went onto a session that had already broken and got nothing back: it was never
    delivered, so it may be sent again on a new session (retried like an expired session)."""


class Session(Protocol):
    """One initialized upstream session (Streamable HTTP: an `Mcp-Session-Id`; stdio: one child),
    multiplexing concurrent requests. `capabilities` are the client capabilities its `initialize`
    declared, `initialize_result` what the upstream answered, `protocol_version` the revision agreed."""

    server: str
    capabilities: JsonObject
    initialize_result: JsonObject
    protocol_version: str
    session_id: str | None  # the upstream's `Mcp-Session-Id` (None for a stdio child)
    origin: str  # which upstream URL the session is on, as a short hash (`url_origin`; "" for stdio)

    def next_id(self) -> int:
        """A fresh JSON-RPC request id toward the upstream on this session."""

    async def request(
        self,
        method: str,
        params: JsonObject | None,
        /,
        *,
        handler: MessageHandler | None,
        request_id: RequestId | None = None,
        on_sent: Callable[[], None] | None = None,
    ) -> JsonObject:
        """Send one request; its JSON-RPC response message (`result` or `error`). Messages that
        belong to it arrive at `handler` first; `on_sent()` runs as it leaves. Bounded by
        `Bounds.for_method` (s). Raises UpstreamError (SessionExpiredError: the upstream forgot the
        session)."""

    async def notify(self, method: str, params: JsonObject | None = None) -> None:
        """Send a notification. Raises UpstreamError."""

    async def respond(
        self, request_id: RequestId, *, result: JsonObject | None = None, error: JsonObject | None = None
    ) -> None:
        """Answer a server→client request under the upstream's own id, at most once. Raises UpstreamError."""


class Pool(Protocol):
    """The sessions of one configured server (`server`), one per client-capability set (and per
    principal where the server isolates principals)."""

    server: str

    async def session(self, capabilities: JsonObject, principal: str | None = None) -> Session:
        """The open session for `capabilities`, opening it if needed. Raises UpstreamError."""

    def discard(self, session: Session) -> None:
        """Forget a session the upstream expired or that broke: the next use opens a new one."""

    async def check(self, timeout_s: float = 5.0) -> str | None:
        """None when a session without optional capabilities is ready within `timeout_s` (s),
        else a sentence saying why not (for /readyz)."""

    async def cancel_elsewhere(self, ref: JsonObject, reason: str) -> bool:
        """Send `notifications/cancelled` for a request another proxy process sent on its own
        upstream session, `ref` (`{"session", "requestId", "protocolVersion", "origin"}`, as
        `Call.upstream_ref` gives it): that process died, and an upstream may run a request on
        after its client's connection closed. True when the upstream took it (HTTP 2xx); False
        when it cannot be sent (stdio: the child died with that process), was recorded on another
        URL (`origin`), names a session of this process, or was refused. Bounded by
        `request_timeout`; raises nothing."""

    async def close(self) -> None:
        """End every session."""


T = TypeVar("T")


async def with_session(
    pool: Pool, capabilities: JsonObject, principal: str | None, exchange: Callable[[Session], Awaitable[T]]
) -> T:
    """`exchange(session)` on `pool`'s session for (`capabilities`, `principal`). When the upstream
    forgot that session (SessionExpiredError: a 404, so it ran nothing) the session leaves the
    pool and the exchange runs once more on a new one; the second SessionExpiredError is raised.
    The one retry rule for every request the proxy sends (2025-11-25 transports, "Session Management")."""
    session = await pool.session(capabilities, principal)
    try:
        return await exchange(session)
    except SessionExpiredError:
        pool.discard(session)
    return await exchange(await pool.session(capabilities, principal))


class OpenQuestions:
    """The server→client request ids an upstream session asked that the proxy has not answered.

    `claim(id)` is True exactly once per asked id, so whatever races (an answer, a cancel, an input
    timeout, a shutdown) the upstream gets one response per id. At most `limit` ids are kept (the
    oldest unanswered are forgotten first).
    """

    def __init__(self, limit: int = 4096) -> None:
        self.limit = limit
        self._ids: dict[tuple[str, Any], None] = {}

    @staticmethod
    def _key(request_id: Any) -> tuple[str, Any]:
        return type(request_id).__name__, request_id

    def asked(self, request_id: Any) -> None:
        """The upstream sent a request with this id."""
        self._ids[self._key(request_id)] = None
        while len(self._ids) > self.limit:
            del self._ids[next(iter(self._ids))]

    def claim(self, request_id: Any) -> bool:
        """True when `request_id` was asked and not answered yet (it is answered from now on)."""
        key = self._key(request_id)
        if key not in self._ids:
            return False
        del self._ids[key]
        return True


# SSE polling (SEP-1699): an upstream that closes a stream with an event id and `retry` is resumed.
MAX_RESUME_ATTEMPTS = 2  # resumptions in a row that bring no event before the request fails
MAX_RETRY_WAIT_S = 5.0  # the most (s) an upstream's `retry` hint makes the proxy wait before resuming

# Requests that run as proxy-owned calls, bounded by the server's hard `timeout`; any other
# request is bounded by `request_timeout`, and `initialize` by `init_timeout`.
# bounded by the hard `timeout`
CALL_METHODS = frozenset({"tools/call", "prompts/get", "resources/read", "tasks/result"})


@dataclass(frozen=True)
class Bounds:
    """The waits and sizes of one upstream server, from its config entry (seconds, bytes).

    `call_timeout` bounds a call method, `request_timeout` any other request, `init_timeout` the
    `initialize` handshake, `connect_timeout` a TCP connect; `max_response_bytes` one reply.
    """

    call_timeout: float = 1800.0
    request_timeout: float = 30.0
    init_timeout: float = 30.0
    connect_timeout: float = 10.0
    max_response_bytes: int = 16 * 1024 * 1024

    @classmethod
    def from_entry(cls, entry: Any) -> Bounds:
        """The bounds configured on a `ServerEntry`."""
        return cls(
            entry.timeout,
            entry.request_timeout,
            entry.init_timeout,
            entry.connect_timeout,
            entry.max_response_bytes,
        )

    def for_method(self, method: str) -> tuple[float, str]:
        """The bound (s) of one request and the config key that sets it."""
        if method == "initialize":
            return self.init_timeout, "init_timeout"
        if method in CALL_METHODS:
            return self.call_timeout, "timeout"
        return self.request_timeout, "request_timeout"


async def probe(pool: Pool, timeout_s: float) -> str | None:
    """Get `pool`'s session for no optional capabilities (opening it if needed) and, when the
    upstream offers tools, list them, all within `timeout_s` seconds; None when that works, else a
    sentence saying why not (for /readyz: an upstream that hangs on either is not ready)."""
    try:
        async with asyncio.timeout(timeout_s):
            session = await pool.session({})
            if "tools" in (session.initialize_result.get("capabilities") or {}):
                await session.request("tools/list", None, handler=None)
    except TimeoutError:
        return f"upstream {pool.server} did not get ready (initialize and tools/list) within {timeout_s:g} s"
    except UpstreamError as exc:
        return str(exc)
    return None


def caps_key(capabilities: JsonObject) -> str:
    """A stable key for a capability set (sorted JSON)."""
    return json.dumps(capabilities, sort_keys=True, separators=(",", ":"))


async def read_body(resp: aiohttp.ClientResponse, limit: int, server: str) -> bytes:
    """The whole body of an upstream reply, refused (UpstreamError)
    once larger than `limit` bytes or when the connection breaks mid-body."""
    too_large = f"upstream {server} sent a reply larger than max_response_bytes ({limit} bytes)"
    if (resp.content_length or 0) > limit:
        raise UpstreamError(too_large)
    body = bytearray()
    try:
        async for chunk in resp.content.iter_chunked(1 << 16):
            body += chunk
            if len(body) > limit:
                raise UpstreamError(too_large)
    except (aiohttp.ClientError, OSError) as exc:
        raise UpstreamError(f"upstream {server} broke the reply: {exc.__class__.__name__}: {exc}") from exc
    return bytes(body)


def url_origin(url: str) -> str:
    """A short hash (16 hex) naming the upstream URL a session is on, without the URL itself (which
    may carry credentials): a cancel recorded on one URL is never sent to another."""
    return hashlib.sha256(url.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def failure_text(server: str, exc: BaseException, url: str) -> str:
    """What a client is told of an upstream exchange that failed with `exc` before the response: an
    upstream that could not be reached (the request never left: safe to send again) apart from one
    that was reached and dropped the connection before it answered (it may have run the request)."""
    if isinstance(exc, (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)):
        return f"upstream {server} unreachable: {error_text(exc, url)}"
    return (
        f"upstream {server} dropped the connection before it answered ({error_text(exc, url)}); the "
        "request may have run there"
    )


def error_text(exc: BaseException, url: str) -> str:
    """`Class: message` of a connection error toward `url`, with the URL's user and password taken
    out (aiohttp quotes the whole URL in some errors, e.g. an invalid one)."""
    text = f"{exc.__class__.__name__}: {exc}"
    text = text.replace(url, redact_url(url))
    password = url_password(url)
    return text.replace(password, "***") if password else text
