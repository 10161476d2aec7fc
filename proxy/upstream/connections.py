"""One HTTP upstream's connections: never hand out one the upstream has already closed.

Most Python MCP servers run on uvicorn, which closes a keep-alive connection after 5 s idle. A pool
that keeps idle connections longer reuses ones the server has closed or is closing: the request
then fails with `ServerDisconnectedError` or a reset although the upstream never saw it, and the
client gets "upstream unreachable" for a call that never ran. Two guards:

1. Idle connections expire after the server's `keepalive_timeout` (s, default 4 s: below uvicorn's
   5 s). aiohttp checks a connection's idle time when it hands it out, and our idle clock starts
   after the server's (when the answer was read), so a connection is never older on our side than
   on the server's.
2. A POST whose message is safe to send twice (`jsonrpc.safe_to_resend`: a request that only
   reads, such as `tools/list` or `resources/read`, a notification, or an answer to one of the
   server's questions) that fails on a *reused*
   connection with a disconnect or a reset, within RESEND_WITHIN_S of being sent and before any
   byte of an answer, is sent once more on a fresh connection (a second pool that never keeps
   connections). A `tools/call` is never resent: a server that read it and then closed the
   connection (it crashed, or one of its workers did) cannot be told from one that closed an idle
   connection unread, and a call must never run twice. For it, guard 1 is the guard. GET and
   DELETE are idempotent, and aiohttp resends those itself (RFC 9112 §9.3.1.1).
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import aiohttp
import structlog

from proxy.runtime import metrics, tracing
from proxy.upstream.types import StaleConnectionError

log = structlog.get_logger("proxy.upstream")

RESEND_WITHIN_S = 1.0  # a failure later than this (s) after sending may mean the server ran the request


class _Attempt:
    """Trace context of one request: whether aiohttp gave it a pooled (reused) connection."""

    __slots__ = ("reused",)

    def __init__(self) -> None:
        self.reused = False


async def _on_reuse(_session: aiohttp.ClientSession, context: SimpleNamespace, _params: Any) -> None:
    attempt = context.trace_request_ctx
    if isinstance(attempt, _Attempt):
        attempt.reused = True


def shed_traces(resp: aiohttp.ClientResponse) -> None:
    """Let go of a reply's aiohttp `Trace` objects (with their trace contexts and `_Attempt`) once
    the reply has arrived, when the only trace config on its session is the reuse one above (a
    detached call holds its reply for hours, and they are ~0.3 KB of it). That
    config listens to `on_connection_reuseconn` alone, which aiohttp sends before the request
    goes out, so nothing it would still hear is lost. aiohttp keeps them in the reply's private
    `_traces` list (the same list as its request's; checked in aiohttp 3.14), emptied here in place;
    nothing is done when it is not a list."""
    traces = getattr(resp, "_traces", None)
    if type(traces) is list:
        traces.clear()


class UpstreamHttp:
    """The HTTP client of one upstream server (`server` names it in logs): a pooled aiohttp
    `ClientSession` whose idle connections live `keepalive_s` (s) at most, and a resend of a POST
    that a stale pooled connection lost (see the module docstring). `get`, `delete` and `request`
    take aiohttp's arguments and return what aiohttp returns; `close` closes both pools."""

    def __init__(self, *, server: str, keepalive_s: float) -> None:
        self.server = server
        trace = aiohttp.TraceConfig()
        trace.on_connection_reuseconn.append(_on_reuse)
        others = tracing.client_trace_configs()
        # With no other trace config, a reply's traces are ours alone, and spent once it arrived.
        self._shed_traces = not others
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=keepalive_s),
            auto_decompress=True,
            trace_configs=[trace, *others],
        )
        self._fresh = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, force_close=True),
            auto_decompress=True,
            trace_configs=tracing.client_trace_configs(),
        )

    async def request(
        self, method: str, url: str, *, resend: bool = False, fresh: bool = False, **kwargs: Any
    ) -> aiohttp.ClientResponse:
        """`method` on `url` (aiohttp's keyword arguments); with `resend` (the POSTed message is safe
        to send twice: `jsonrpc.safe_to_resend`), a POST lost on a stale pooled connection is sent
        once more on a fresh one; without it, that loss raises StaleConnectionError (an UpstreamError
        saying the request was not sent again). With `fresh`, on a new connection from the start
        (a request sent again after the server refused it with a 401, which a server may follow by
        closing the connection). Raises what aiohttp raises."""
        if fresh:
            return await self._fresh.request(method, url, **kwargs)
        if method != "POST":
            return await self.session.request(method, url, **kwargs)
        attempt = _Attempt()
        sent = time.monotonic()
        try:
            resp = await self.session.request(method, url, trace_request_ctx=attempt, **kwargs)
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            if not attempt.reused or time.monotonic() - sent > RESEND_WITHIN_S:
                raise
            if not resend:
                log.warning("upstream_not_resent", server=self.server, reason=exc.__class__.__name__)
                raise StaleConnectionError(
                    f"upstream {self.server} dropped a reused connection as the request arrived "
                    f"({exc.__class__.__name__}); it may act, so it was not sent again: whether it ran "
                    f"is unknown (keepalive_timeout should be below the server's keep-alive)"
                ) from exc
            log.info("upstream_resent", server=self.server, reason=exc.__class__.__name__)
            metrics.UPSTREAM_RESENT.labels(self.server).inc()
            return await self._fresh.request(method, url, **kwargs)
        if self._shed_traces:
            shed_traces(resp)
        return resp

    async def post(
        self, url: str, *, resend: bool = False, fresh: bool = False, **kwargs: Any
    ) -> aiohttp.ClientResponse:
        """`request("POST", url, resend=resend, fresh=fresh, ...)`."""
        return await self.request("POST", url, resend=resend, fresh=fresh, **kwargs)

    def get(self, url: str, **kwargs: Any) -> Any:
        """aiohttp's `get` on the pool (awaitable, or an async context manager)."""
        return self.session.get(url, **kwargs)

    def delete(self, url: str, **kwargs: Any) -> Any:
        """aiohttp's `delete` on the pool (awaitable, or an async context manager)."""
        return self.session.delete(url, **kwargs)

    async def close(self) -> None:
        """Close both pools."""
        await self.session.close()
        await self._fresh.close()
