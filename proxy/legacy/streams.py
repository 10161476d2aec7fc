"""The client side of legacy reply streams, the same for every upstream kind: serving a
`RelayStream` (keepalives, one connection at a time, lingering for resumption), the answer alone
for a client that takes no SSE, and a reply that stays plain JSON when its answer comes quickly."""

from __future__ import annotations

import asyncio
import functools

import aiohttp
import structlog
from aiohttp import web

from proxy.legacy.replay import DEFAULT_REPLAY_BYTES, DEFAULT_REPLAY_EVENTS, RelayStream
from proxy.legacy.session import LegacySession, LegacySessions
from proxy.protocol.jsonrpc import JsonObject
from proxy.protocol.sse import SSE_HEADERS, SseEvent, encode_message
from proxy.runtime import flow

log = structlog.get_logger("proxy.legacy")

PRIMING = SseEvent("message", "", None, None)  # an event with an id and empty data (SDKs skip it)
PRIMING_VERSION = "2025-11-25"  # the first revision whose clients expect priming events (SEP-1699)
LINGER_S = 60.0  # how long (s) a stream no client reads keeps its buffer (and a GET stream its pump)


class StreamServer:
    """Serves the reply streams of one server's legacy sessions (`sessions`) to their clients.

    `keepalive_s` (s) is the SSE comment interval on a silent stream; `replay_events` and
    `replay_bytes` bound each stream's replay buffer.
    """

    def __init__(
        self,
        *,
        sessions: LegacySessions,
        keepalive_s: float = 15.0,
        replay_events: int = DEFAULT_REPLAY_EVENTS,
        replay_bytes: int = DEFAULT_REPLAY_BYTES,
    ) -> None:
        self.sessions = sessions
        self.keepalive_s = keepalive_s
        self.replay_events = replay_events
        self.replay_bytes = replay_bytes
        self._sweeper: asyncio.TimerHandle | None = None  # the pending `_sweep`

    def open(self, session: LegacySession, kind: str, *, json_only: bool = False) -> RelayStream:
        """A new reply stream of `session` ("post" or "get"), remembered for resumption (the oldest
        ended ones go first past `session.MAX_STREAMS`; ended POST streams are forgotten once no
        client has read them for LINGER_S). A "get" stream replaces the session's standalone one."""
        stream = RelayStream(
            kind=kind,
            server=self.sessions.name,
            max_events=self.replay_events,
            max_bytes=self.replay_bytes,
            json_only=json_only,
        )
        if kind == "get":
            previous = session.get_stream
            if previous is not None and previous.pump is not None:
                previous.pump.cancel()  # a new standalone stream replaces the old one
            session.get_stream = stream
        session.add_stream(stream)
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().call_later(LINGER_S / 2, self._sweep)
        return stream

    def reopen(self, session: LegacySession, stream: RelayStream) -> None:
        """A standalone GET `stream` found without its pump goes on as the session's (a new pump feeds it)."""
        stream.reopen()
        session.get_stream = stream

    async def serve(
        self,
        request: web.Request,
        session: LegacySession,
        stream: RelayStream,
        after: int = 0,
        *,
        status: int = 200,
        headers: dict[str, str] | None = None,
        notice: JsonObject | None = None,
        cuts: int | None = None,
    ) -> web.StreamResponse:
        """Write `stream` to the client from event `after` on (keepalives included) until it ends,
        is cut, or the client leaves; the stream itself goes on either way. A POST reply of a
        2025-11-25 session starts with a priming event when nothing else came first. `notice` (a
        JSON-RPC notification) goes first, without an id: it is not part of the stream. `cuts`: the
        stream's cut count when its reply began (`RelayStream.frames`)."""
        response = web.StreamResponse(status=status, headers={**(headers or {}), **SSE_HEADERS})
        if stream.kind == "post" and stream.last_seq == 0 and session.version >= PRIMING_VERSION:
            # A priming event (SEP-1699): an id before anything else, so a reply that has said
            # nothing yet can be resumed with Last-Event-ID if the connection drops.
            stream.append(PRIMING)
        stream.attached += 1
        ticket = stream.take_over()  # a connection still writing this stream ends: no event on two
        try:
            await response.prepare(request)
            if notice is not None:
                await response.write(encode_message(notice))
            direct = functools.partial(flow.write_without_waiting, request, response)
            async for frame in stream.frames(after, self.keepalive_s, ticket, direct, cuts):
                await response.write(frame)
            await response.write_eof()
        except (ConnectionResetError, aiohttp.ClientConnectionError, OSError):
            pass  # the client left: not a cancel (2025-11-25 transports); it may resume with Last-Event-ID
        finally:
            stream.attached -= 1
            if stream.attached == 0:
                stream.idle_since = asyncio.get_running_loop().time()
                if stream.kind == "get":  # its pump stops LINGER_S after the last client left
                    asyncio.get_running_loop().call_later(LINGER_S, self._linger_over, session, stream)
        return response

    async def serve_json(self, stream: RelayStream, headers: dict[str, str]) -> web.Response:
        """The reply of a client whose Accept has no `text/event-stream`: the stream is read to its
        end (the pump goes on if the client leaves) and its last message, the answer or the proxy's
        JSON-RPC error, goes out as one JSON body. What else it carried (notifications) cannot
        reach such a client; it stays in the replay buffer."""
        if stream.pump is not None:
            # (never cancels the pump: an abandoned one wrote its error first)
            await asyncio.wait({stream.pump})
        out = {k: v for k, v in headers.items() if k.lower() != "content-type"}
        if stream.last_data is None:
            return web.Response(status=202, headers=out)
        return web.Response(status=200, text=stream.last_data, content_type="application/json", headers=out)

    async def reply(
        self,
        request: web.Request,
        session: LegacySession,
        stream: RelayStream,
        headers: dict[str, str] | None = None,
        *,
        wait_s: float | None = None,
    ) -> web.StreamResponse:
        """A request's reply fed by a pump: plain JSON when the answer alone arrives within
        `wait_s` (s, default `keepalive_s`), else an SSE stream from its first event (keepalives
        meanwhile), so idle-cutting intermediaries keep a silent call; the answer alone for a
        JSON-only client."""
        if stream.json_only:
            return await self.serve_json(stream, headers or {})
        cuts = stream.cuts  # (an SSE polling cut while this waited still ends the stream it serves)
        if stream.last_seq == 0:
            await stream.changed(max(0.0, self.keepalive_s if wait_s is None else wait_s))
        if stream.closed and stream.last_seq == 1 and stream.last_data is not None:
            plain = {k: v for k, v in (headers or {}).items() if k.lower() != "content-type"}
            return web.Response(text=stream.last_data, content_type="application/json", headers=plain)
        return await self.serve(request, session, stream, 0, headers=headers, cuts=cuts)

    def _sweep(self) -> None:
        """Every LINGER_S / 2 while any session keeps a POST stream: forget the ended ones that no
        client has read for LINGER_S, so one stays resumable for LINGER_S to 1.5 x LINGER_S (s).
        One timer per server, not one per stream (a timer per stream held each stream and its
        buffer for LINGER_S after its last byte: 90,000 timers at 1,500 calls/s)."""
        self._sweeper = None
        now = asyncio.get_running_loop().time()
        kept = False
        for session in self.sessions.all():
            stale = [
                token
                for token, s in session.streams.items()
                if s.kind == "post" and s.closed and not s.attached and now - s.idle_since >= LINGER_S
            ]
            for token in stale:
                del session.streams[token]
            kept = kept or any(s.kind == "post" for s in session.streams.values())
        if kept:
            self._sweeper = asyncio.get_running_loop().call_later(LINGER_S / 2, self._sweep)

    def _linger_over(self, session: LegacySession, stream: RelayStream) -> None:
        """LINGER_S after the last client left a standalone GET `stream`: stop its pump and forget
        it (POST streams are `_sweep`'s)."""
        if stream.attached or asyncio.get_running_loop().time() - stream.idle_since < LINGER_S - 0.01:
            return
        if stream.pump is not None:
            stream.pump.cancel()
        if session.streams.get(stream.token) is stream:
            del session.streams[stream.token]
        if session.get_stream is stream:
            session.get_stream = None
