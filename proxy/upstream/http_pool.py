"""The pool of HTTP upstream sessions of one server (one per client-capability set)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import structlog

from proxy.protocol.jsonrpc import JsonObject
from proxy.upstream.connections import UpstreamHttp
from proxy.upstream.credentials import ClientCredentials
from proxy.upstream.http import UpstreamSession
from proxy.upstream.types import (
    Bounds,
    RecentFailure,
    Session,
    UpstreamError,
    UpstreamTimeoutError,
    caps_key,
    probe,
    url_origin,
)

log = structlog.get_logger("proxy.upstream")


class UpstreamPool:
    """The upstream sessions of one server, one per distinct client-capability set.

    Legacy servers decide what they offer from the `initialize` capabilities (protocol.md §3.4),
    so each capability set gets its own session, opened on first use. `on_notification` receives
    the server-wide notifications (list changes) of every session's standalone GET stream;
    `credentials` is the proxy's own token for the upstream (`mcpServers.NAME.oauth`), if any.
    """

    def __init__(
        self,
        http: UpstreamHttp,
        server: str,
        url: str,
        headers: dict[str, str],
        *,
        bounds: Bounds | None = None,
        on_notification: Callable[[JsonObject], None] | None = None,
        credentials: ClientCredentials | None = None,
    ) -> None:
        self.http = http
        self.credentials = credentials
        self.server = server
        self.url = url
        self.headers = headers
        self.bounds = bounds or Bounds()
        self._sessions: dict[str, UpstreamSession] = {}
        self._opening: dict[str, asyncio.Task[UpstreamSession]] = {}  # the attempt callers share, by key
        self._started: dict[str, float] = {}  # when (monotonic s) the attempt of a key began
        self._failed: dict[str, RecentFailure] = {}  # key → its last failed attempt
        self.on_notification = on_notification

    async def session(self, capabilities: JsonObject, principal: str | None = None) -> UpstreamSession:
        """The open session for `capabilities`, initializing it if needed (`principal` is not used:
        HTTP sessions are shared). Concurrent callers share one attempt, and each waits at most
        `init_timeout` (s) from its own call, so a hung `initialize` never makes callers queue behind
        each other's attempts. A failed attempt answers the callers that come within as long again
        as it took (its error, at once), so one request that needs the session twice (a lookup,
        then the call) waits for one attempt, not two. Raises UpstreamError."""
        key = caps_key(capabilities)
        existing = self._sessions.get(key)
        if existing is not None and not existing.closed and existing.broken is None:
            return existing
        failed = self._failed.setdefault(key, RecentFailure())
        failed.check()
        opening = self._opening.get(key)
        if opening is None:
            opening = asyncio.get_running_loop().create_task(self._open(key, capabilities))
            self._opening[key], self._started[key] = opening, time.monotonic()
            opening.add_done_callback(lambda done: self._opened(key, done))
        try:
            async with asyncio.timeout(self.bounds.init_timeout):
                return await asyncio.shield(opening)
        except TimeoutError:
            why = (
                f"upstream {self.server} did not answer initialize within {self.bounds.init_timeout:g} s "
                "(init_timeout)"
            )
            timed_out = True
        except UpstreamError as exc:
            why, timed_out = str(exc), isinstance(exc, UpstreamTimeoutError)
        failed.failed(self._started[key], why, timed_out=timed_out)
        raise (UpstreamTimeoutError if timed_out else UpstreamError)(why)

    async def _open(self, key: str, capabilities: JsonObject) -> UpstreamSession:
        """The one attempt to open the session of `key` that concurrent callers share (bounded by
        `init_timeout` inside `UpstreamSession.open`). Raises UpstreamError."""
        existing = self._sessions.get(key)
        if existing is not None and existing.broken is not None:  # out of the pool before another call
            log.warning("upstream_session_broken", server=self.server, reason=existing.broken)
            self.discard(existing)
        session = UpstreamSession(
            self.http,
            self.url,
            server=self.server,
            headers=self.headers,
            capabilities=capabilities,
            bounds=self.bounds,
            on_notification=self.on_notification,
            credentials=self.credentials,
        )
        await session.open()
        self._sessions[key] = session
        return session

    def _opened(self, key: str, done: asyncio.Task[UpstreamSession]) -> None:
        """An attempt ended: the next caller after a failure starts a new one; a failure nobody
        waited for any more is retrieved (never "exception was never retrieved")."""
        if self._opening.get(key) is done:
            del self._opening[key]
        if not done.cancelled() and done.exception() is None:
            self._failed.setdefault(key, RecentFailure()).clear()  # opened: an earlier failure answers nobody

    async def check(self, timeout_s: float = 5.0) -> str | None:
        """Open (or reuse) the session without optional capabilities; None when ready, else why not."""
        return await probe(self, timeout_s)

    async def cancel_elsewhere(self, ref: JsonObject, reason: str) -> bool:
        """See `Pool.cancel_elsewhere`: the notification goes on the other process's upstream
        session (its `Mcp-Session-Id`), which this process neither opened nor keeps."""
        sid, request_id = ref.get("session"), ref.get("requestId")
        if not isinstance(sid, str) or not sid or not isinstance(request_id, (str, int)):
            return False
        if ref.get("origin") != url_origin(self.url):
            return False  # recorded on another URL (the config changed since): never sent elsewhere
        if any(mine.session_id == sid for mine in self._sessions.values()):
            return False  # a session of this process (an upstream that gives one id to all): not theirs
        theirs = UpstreamSession(
            self.http,
            self.url,
            server=self.server,
            headers=self.headers,
            bounds=self.bounds,
            credentials=self.credentials,
        )
        theirs.session_id = sid
        version = ref.get("protocolVersion")
        theirs.protocol_version = version if isinstance(version, str) and version else theirs.protocol_version
        try:
            await theirs.notify("notifications/cancelled", {"requestId": request_id, "reason": reason})
        except Exception as exc:  # (raises nothing: a cancel that fails changes no task; a closing pool)
            # the class only: an expired session's error names the session id
            log.info("upstream_cancel_not_delivered", server=self.server, reason=exc.__class__.__name__)
            return False
        return True

    def discard(self, session: Session) -> None:
        """Forget a session the upstream expired (or that broke), so the next use initializes a new
        one; a broken session is ended (DELETE) once its requests in flight are over."""
        key = caps_key(session.capabilities)
        mine = self._sessions.get(key)
        if mine is session:
            del self._sessions[key]
            mine.retire()

    async def close(self) -> None:
        """Close every session (and stop the attempts still opening one)."""
        for opening in list(self._opening.values()):
            opening.cancel()
        sessions, self._sessions = list(self._sessions.values()), {}
        await asyncio.gather(*(s.close() for s in sessions), return_exceptions=True)
