"""The client side of the HTTP legacy relay's SSE streams (issue 13): serving a `RelayStream` to
the client (keepalives, lingering), `Last-Event-ID` resumption, and the standalone GET stream read
from the upstream. `LegacyRelay` (legacy_relay.py) builds on `RelayStreams`."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import aiohttp
import structlog
from aiohttp import web

from proxy.legacy.replay import DEFAULT_REPLAY_BYTES, DEFAULT_REPLAY_EVENTS, RelayStream, parse_event_id
from proxy.legacy.sessions import LegacySession, LegacySessions
from proxy.legacy.v1 import V1Front
from proxy.protocol import jsonrpc
from proxy.protocol.jsonrpc import INVALID_REQUEST, METHOD_NOT_FOUND, JsonRpcError
from proxy.protocol.sse import EventTooLargeError, ReaderEvents, SseEvent
from proxy.upstream.types import Bounds

log = structlog.get_logger("proxy.transport")

LINGER_S = (
    60.0  # how long (s) a stream no client reads keeps its buffer (and a GET stream its upstream reader)
)
MAX_OPEN_QUESTIONS = 1024  # server→client requests per session awaiting the client's answer, at most
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def dumps(obj: Any) -> str:
    """Compact JSON text."""
    return jsonrpc.dumps_str(obj)


def json_error(request_id: Any, exc: JsonRpcError, status: int | None = None) -> web.Response:
    """`exc` as a JSON-RPC error response under `request_id`, with `status` (else its own)."""
    return web.json_response(
        jsonrpc.error_response(request_id, exc.to_error()), status=status or exc.http_status
    )


def decode(data: str) -> Any:
    """A JSON value from SSE data; None when empty or not JSON."""
    try:
        return jsonrpc.loads(data) if data.strip() else None
    except (ValueError, RecursionError):
        return None


class RelayStreams:
    """Relays legacy sessions of one HTTP upstream (`url`, config `headers`, shared `http` client):
    the stream half (see the module docstring).

    `bounds` are the server's waits and sizes, `keepalive_s` (s) the SSE comment interval,
    `replay_events` / `replay_bytes` bound each stream's replay buffer.
    """

    def __init__(
        self,
        *,
        name: str,
        url: str,
        headers: dict[str, str],
        http: aiohttp.ClientSession,
        bounds: Bounds,
        v1: V1Front,
        sessions: LegacySessions,
        keepalive_s: float = 15.0,
        replay_events: int = DEFAULT_REPLAY_EVENTS,
        replay_bytes: int = DEFAULT_REPLAY_BYTES,
    ) -> None:
        self.name, self.url, self.headers, self.http, self.bounds, self.v1 = (
            name,
            url,
            headers,
            http,
            bounds,
            v1,
        )
        self.legacy = sessions
        self.keepalive_s = keepalive_s
        self.replay_events, self.replay_bytes = replay_events, replay_bytes
        self._sweeper: asyncio.TimerHandle | None = None  # the pending `_sweep`

    # -- client side of a stream ------------------------------------------------------------------

    async def _serve(
        self,
        request: web.Request,
        session: LegacySession,
        stream: RelayStream,
        after: int,
        *,
        status: int = 200,
        headers: dict[str, str] | None = None,
    ) -> web.StreamResponse:
        """Write `stream` to the client from event `after` on (keepalives included) until it ends,
        is cut, or the client leaves; the stream itself goes on either way."""
        response = web.StreamResponse(status=status, headers={**(headers or {}), **SSE_HEADERS})
        stream.attached += 1
        ticket = stream.take_over()  # a connection still writing this stream ends: no event on two
        try:
            await response.prepare(request)
            async for frame in stream.frames(after, self.keepalive_s, ticket):
                await response.write(frame)
            await response.write_eof()
        except (ConnectionResetError, aiohttp.ClientConnectionError, OSError):
            pass  # the client left: not a cancel (2025-11-25 transports); it may resume with Last-Event-ID
        finally:
            stream.attached -= 1
            if stream.attached == 0:
                stream.idle_since = asyncio.get_running_loop().time()
                if stream.kind == "get":  # its upstream reader stops LINGER_S after the last client left
                    asyncio.get_running_loop().call_later(LINGER_S, self._linger_over, session, stream)
        return response

    async def _serve_json(self, stream: RelayStream, headers: dict[str, str]) -> web.Response:
        """A POST reply for a client whose Accept has no `text/event-stream`: the upstream's SSE
        reply is read to its end (the pump goes on if the client leaves) and its last message, the
        answer or the proxy's JSON-RPC error, goes out as one JSON body. What else the stream
        carried (notifications, questions) cannot reach such a client; it stays in the replay buffer."""
        if stream.pump is not None:
            await asyncio.wait(
                {stream.pump}
            )  # (never cancels the pump; a pump cancelled by a session's end wrote its error first)
        out = {k: v for k, v in headers.items() if k.lower() != "content-type"}
        if stream.last_data is None:
            return web.Response(status=202, headers=out)
        return web.Response(status=200, text=stream.last_data, content_type="application/json", headers=out)

    def _remember(self, session: LegacySession, stream: RelayStream) -> None:
        """Keep `stream` in `session` for resumption (at most MAX_STREAMS per session); ended POST
        streams are forgotten by `_sweep` once no client has read them for LINGER_S."""
        session.add_stream(stream)
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().call_later(LINGER_S / 2, self._sweep)

    def _sweep(self) -> None:
        """Every LINGER_S / 2 while any session keeps a POST stream: forget the ended ones that no
        client has read for LINGER_S, so one stays resumable for LINGER_S to 1.5 x LINGER_S (s).
        One timer per relay, not one per stream (a timer per stream held each stream and its
        buffer for LINGER_S after its last byte: 90,000 timers at 1,500 calls/s)."""
        self._sweeper = None
        now = asyncio.get_running_loop().time()
        kept = False
        for session in self.legacy.all():
            stale = [
                t
                for t, s in session.streams.items()
                if s.kind == "post" and s.closed and not s.attached and now - s.idle_since >= LINGER_S
            ]
            for token in stale:
                del session.streams[token]
            kept = kept or any(s.kind == "post" for s in session.streams.values())
        if kept:
            self._sweeper = asyncio.get_running_loop().call_later(LINGER_S / 2, self._sweep)

    def _linger_over(self, session: LegacySession, stream: RelayStream) -> None:
        """LINGER_S after the last client left a standalone GET `stream`: stop reading it from the
        upstream and forget it (POST streams are `_sweep`'s)."""
        if stream.attached or asyncio.get_running_loop().time() - stream.idle_since < LINGER_S - 0.01:
            return
        if stream.pump is not None:
            stream.pump.cancel()
        if session.streams.get(stream.token) is stream:
            del session.streams[stream.token]
        if session.get_stream is stream:
            session.get_stream = None

    def _ended(self, stream: RelayStream) -> str:
        """The error text for a request whose session ended before its answer (`stream.ended_by` set)."""
        return f"{stream.ended_by} before upstream {self.name} answered"

    async def _resume(
        self, request: web.Request, session: LegacySession, sid: str, headers: dict[str, str]
    ) -> web.StreamResponse:
        """GET with `Last-Event-ID`: replay that stream's later events from the proxy's buffer, then go on live."""
        parsed = parse_event_id(request.headers.get("Last-Event-ID"))
        stream = session.streams.get(parsed[0]) if parsed is not None and sid else None
        if (
            stream is None or parsed is None or parsed[1] > stream.last_seq
        ):  # (a number not minted yet is not ours either)
            err = JsonRpcError(
                INVALID_REQUEST,
                "Last-Event-ID names no stream of this session (unknown, expired, or not minted by this proxy); open a new GET stream without it",
            )
            return json_error(None, err, status=400)
        start, gap = stream.replay_from(parsed[1])
        if gap:
            log.warning(
                "legacy_replay_gap",
                server=self.name,
                reason="events after Last-Event-ID were dropped from the replay buffer",
            )
        if stream.kind == "get" and (stream.pump is None or stream.pump.done()):
            get_headers = {k: v for k, v in headers.items() if k.lower() != "content-type"}
            get_headers["Accept"] = "text/event-stream"
            upstream = await self._open_get(get_headers)
            if upstream is not None:
                stream.reopen()
                session.get_stream = stream
                stream.pump = asyncio.get_running_loop().create_task(
                    self._pump_get(session, stream, upstream, sid), name=f"legacy GET relay {self.name}"
                )
        return await self._serve(request, session, stream, start - 1)

    async def _send(
        self, method: str, raw: bytes, headers: dict[str, str], bound: float, *, headers_only: bool = False
    ) -> aiohttp.ClientResponse:
        """One upstream HTTP exchange (redirects never followed: configured credentials stay here).
        Bounded by `bound` (s): the whole exchange, or with `headers_only` (a GET stream, which
        lasts as long as the client keeps it) only the wait for the response headers. Raises
        aiohttp.ClientError, OSError or TimeoutError."""
        async with asyncio.timeout(bound if headers_only else None):
            return await self.http.request(
                method,
                self.url,
                data=raw if method == "POST" else None,
                headers=headers,
                allow_redirects=False,
                timeout=aiohttp.ClientTimeout(
                    total=None if headers_only else bound,
                    sock_connect=self.bounds.connect_timeout,
                    sock_read=None if headers_only else bound,
                ),
            )

    async def _late_get(
        self,
        request: web.Request,
        session: LegacySession,
        sid: str,
        opening: asyncio.Future[aiohttp.ClientResponse],
    ) -> web.StreamResponse:
        """A standalone GET whose upstream has not answered within `keepalive_s`: the client's SSE
        stream starts at once (keepalives while the upstream's headers are awaited, within their
        bound); a refusal, an error or the bound ends the stream, an upstream SSE stream feeds it."""
        stream = RelayStream(kind="get", max_events=self.replay_events, max_bytes=self.replay_bytes)
        self._remember(session, stream)
        if session.get_stream is not None and session.get_stream.pump is not None:
            session.get_stream.pump.cancel()  # a new standalone stream replaces the old one
        session.get_stream = stream

        async def pump() -> None:
            try:
                upstream = await opening
            except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                log.info(
                    "legacy_upstream_get_failed", server=self.name, reason=str(exc) or exc.__class__.__name__
                )
                stream.close()
                return
            finally:
                opening.cancel()  # this task was cancelled while waiting: so is the exchange
            if upstream.status == 404 and sid:
                self.legacy.end(sid)
            if upstream.status != 200 or not upstream.headers.get("Content-Type", "").startswith(
                "text/event-stream"
            ):
                upstream.release()
                stream.close()
                return
            await self._pump_get(session, stream, upstream, sid)

        stream.pump = asyncio.get_running_loop().create_task(pump(), name=f"legacy GET relay {self.name}")
        return await self._serve(
            request, session, stream, 0, headers={"Mcp-Session-Id": sid} if sid else None
        )

    async def _open_get(
        self, headers: dict[str, str], last_event_id: str | None = None
    ) -> aiohttp.ClientResponse | None:
        """An upstream GET stream (resuming after `last_event_id`), or None when the upstream
        refuses one or sends no headers within connect_timeout + request_timeout."""
        if last_event_id is not None:
            headers = {**headers, "Last-Event-ID": last_event_id}
        try:
            resp = await self._send(
                "GET",
                b"",
                headers,
                self.bounds.connect_timeout + self.bounds.request_timeout,
                headers_only=True,
            )
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            log.info(
                "legacy_upstream_get_failed", server=self.name, reason=str(exc) or exc.__class__.__name__
            )
            return None
        if resp.status != 200 or not resp.headers.get("Content-Type", "").startswith("text/event-stream"):
            resp.release()
            return None
        return resp

    # -- upstream side of a stream ----------------------------------------------------------------

    def _from_upstream(
        self, session: LegacySession, event: SseEvent, upstream_rid: int | None, request_id: Any
    ) -> tuple[SseEvent | None, bool]:
        """One upstream event as the client gets it, and whether it answers the client's request:
        a response for the proxy's upstream id gets the client's id back, a server→client request a
        proxy id; a response for any other id is dropped (never shown to the wrong request)."""
        message = decode(event.data)
        if not isinstance(message, dict):
            return (
                event if not event.data.strip() else None
            ), False  # a priming event passes (empty data); garbage does not
        if jsonrpc.is_request(message):
            proxy_id = session.question_id()
            session.request_ids[proxy_id] = message["id"]
            while len(session.request_ids) > MAX_OPEN_QUESTIONS:  # never answered: the oldest are forgotten
                del session.request_ids[next(iter(session.request_ids))]
            return SseEvent(event.event, dumps({**message, "id": proxy_id}), None, event.retry), False
        if jsonrpc.is_response(message):
            if upstream_rid is not None and message.get("id") == upstream_rid:
                return SseEvent(event.event, dumps({**message, "id": request_id}), None, event.retry), True
            log.warning(
                "legacy_foreign_response_dropped",
                server=self.name,
                reason="a response for an id this stream does not carry",
            )
            return None, False
        if message.get("method") == "notifications/cancelled":
            return self._question_cancelled(session, event, message), False
        return SseEvent(event.event, event.data, None, event.retry), False

    async def _refuse_question(
        self, session: LegacySession, event: SseEvent, headers: dict[str, str]
    ) -> bool:
        """A server→client request on the stream of a client that takes no SSE (it could never see
        it): the upstream gets a -32601 answer at once instead of waiting for one until its call's
        timeout. Returns whether `event` was such a request. `headers` are the call's upstream headers."""
        message = decode(event.data)
        if not (isinstance(message, dict) and jsonrpc.is_request(message)):
            return False
        upstream_id = session.request_ids.pop(message["id"], None)
        if upstream_id is None:
            return False
        text = "the client accepts no text/event-stream, so it cannot receive this request"
        reply = jsonrpc.error_response(upstream_id, {"code": METHOD_NOT_FOUND, "message": text})
        log.info("legacy_question_refused", server=self.name, reason=text)
        try:
            resp = await self._send("POST", dumps(reply).encode(), headers, self.bounds.request_timeout)
            resp.release()
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            log.info(
                "legacy_question_refusal_failed", server=self.name, reason=str(exc) or exc.__class__.__name__
            )
        return True

    def _question_cancelled(
        self, session: LegacySession, event: SseEvent, message: dict[str, Any]
    ) -> SseEvent | None:
        """The upstream withdrew one of its questions: the client gets the proxy id it knows that
        question by, and a later answer from it is not forwarded (the question is forgotten). A
        cancel for no question the client has open is dropped."""
        raw = message.get("params")
        params: dict[str, Any] = raw if isinstance(raw, dict) else {}
        upstream_id = params.get("requestId")
        proxy_id = next(
            (
                p
                for p, u in reversed(session.request_ids.items())
                if u == upstream_id and type(u) is type(upstream_id)
            ),
            None,
        )
        if proxy_id is None:
            log.info(
                "legacy_cancel_dropped",
                server=self.name,
                reason="the upstream cancelled no question the client has open",
            )
            return None
        del session.request_ids[proxy_id]
        return SseEvent(
            event.event, dumps({**message, "params": {**params, "requestId": proxy_id}}), None, event.retry
        )

    async def _pump_get(
        self, session: LegacySession, stream: RelayStream, upstream: aiohttp.ClientResponse, sid: str
    ) -> None:
        """Read the upstream's standalone GET stream into `stream` (with the v1 status notifications
        of the session's principal) until the upstream ends it or no client reads it any more."""
        status = self.v1.status_pump(stream, session.principal, sid) if sid else None  # type: ignore[arg-type]
        try:
            async with upstream:
                async for event in ReaderEvents(
                    upstream.content, max_event_bytes=self.bounds.max_response_bytes
                ):
                    out, _ = self._from_upstream(session, event, None, None)
                    if out is not None:
                        stream.append(out)
        except (TimeoutError, aiohttp.ClientError, OSError, EventTooLargeError) as exc:
            log.info("legacy_get_stream_ended", server=self.name, reason=str(exc) or exc.__class__.__name__)
        finally:
            if status is not None:
                status.cancel()
            stream.close()
            with contextlib.suppress(Exception):
                upstream.release()
