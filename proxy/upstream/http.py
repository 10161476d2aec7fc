"""Streamable HTTP connector to a legacy (handshake-era) MCP server.

Implements the client side of MCP 2025-11-25 basic/transports "Streamable HTTP" (protocol.md §4.1):
one POST per message, JSON or SSE replies, `Mcp-Session-Id` and `MCP-Protocol-Version` on every
request after `initialize`, server→client requests answered with a new POST.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import itertools
from collections.abc import Callable

import aiohttp
import structlog
from tenacity import AsyncRetrying, retry_if_exception_type, wait_exponential

from proxy import __version__
from proxy.protocol import jsonrpc
from proxy.protocol.era import LEGACY_VERSIONS, UPSTREAM_VERSION
from proxy.protocol.jsonrpc import JsonObject, RequestId
from proxy.protocol.sse import EventTooLargeError, ReaderEvents, SseEvent, iter_events
from proxy.runtime import tracing
from proxy.upstream.connections import UpstreamHttp
from proxy.upstream.credentials import ClientCredentials
from proxy.upstream.pooling import drain_later, shed_headers
from proxy.upstream.types import (
    CALL_METHODS,
    MAX_RESUME_ATTEMPTS,
    MAX_RETRY_WAIT_S,
    Bounds,
    MessageHandler,
    OpenQuestions,
    SessionBrokenError,
    SessionExpiredError,
    UpstreamError,
    UpstreamTimeoutError,
    UpstreamUndeliveredError,
    error_text,
    failure_text,
    read_body,
    url_origin,
)

log = structlog.get_logger("proxy.upstream")


class UpstreamSession:
    """One initialized legacy session with an upstream server, multiplexing concurrent requests.

    `url` is the upstream MCP endpoint, `headers` extra headers from the config (credentials: never
    logged or stored), `capabilities` the client capabilities declared in `initialize`;
    `on_notification` receives the server-wide notifications of its standalone GET stream.
    """

    def __init__(
        self,
        http: UpstreamHttp,
        url: str,
        *,
        server: str,
        headers: dict[str, str] | None = None,
        capabilities: JsonObject | None = None,
        bounds: Bounds | None = None,
        on_notification: Callable[[JsonObject], None] | None = None,
        credentials: ClientCredentials | None = None,
    ) -> None:
        self.http = http
        self.url = url
        self.server = server
        self.extra_headers = dict(headers or {})
        self.credentials = credentials
        self.capabilities = dict(capabilities or {})
        self.bounds = bounds or Bounds()
        self.connect_timeout = self.bounds.connect_timeout
        self.session_id: str | None = None
        self.origin = url_origin(url)
        self.protocol_version: str = UPSTREAM_VERSION
        self.initialize_result: JsonObject = {}
        self._ids = itertools.count(1)
        self.closed = False
        self.in_flight = 0
        self._deleted = False
        self.broken: str | None = None  # why the session is no longer trusted (a stream died unanswered)
        self.questions = OpenQuestions()  # server→client request ids not answered yet: one response each
        self.on_notification = on_notification
        self._listener: asyncio.Task[None] | None = None

    def next_id(self) -> int:
        """A fresh upstream JSON-RPC request id for this session."""
        return next(self._ids)

    def _headers(self) -> dict[str, str]:
        headers = {
            **self.extra_headers,
            **(self.credentials.header() if self.credentials is not None else {}),
            "Content-Type": "application/json",
            "Accept": "application/json, text/event-stream",
        }
        if self.session_id:
            headers["Mcp-Session-Id"] = self.session_id
            headers["MCP-Protocol-Version"] = self.protocol_version
        return headers

    async def open(self) -> JsonObject:
        """Run the `initialize` handshake (bounded by `init_timeout`); return the upstream's InitializeResult.

        Raises UpstreamError when the upstream is unreachable or answers with an error, and
        UpstreamTimeoutError when it does not finish the handshake in time.
        """
        try:
            async with asyncio.timeout(self.bounds.init_timeout):
                return await self._open()
        except TimeoutError:
            raise UpstreamTimeoutError(
                f"upstream {self.server} did not answer initialize within {self.bounds.init_timeout:g} s "
                f"(init_timeout)"
            ) from None

    async def _open(self) -> JsonObject:
        params = {
            "protocolVersion": UPSTREAM_VERSION,
            "capabilities": self.capabilities,
            "clientInfo": {"name": "mcp-tasks-proxy", "version": __version__},
        }
        self.session_id = None
        reply = await self.request("initialize", params, handler=None, request_id=0)
        if "error" in reply:
            err = reply["error"]
            raise UpstreamError(f"upstream {self.server} refused initialize: {err.get('message')}")
        result = reply.get("result") or {}
        version = result.get("protocolVersion")
        if version not in LEGACY_VERSIONS:
            raise UpstreamError(f"upstream {self.server} negotiated unsupported protocol version {version!r}")
        self.protocol_version = version
        self.initialize_result = result
        await self.notify("notifications/initialized")
        if self.session_id:
            # (a context of its own: it outlives the request that opened the session, see stdio.py)
            self._listener = asyncio.get_running_loop().create_task(
                self._listen(), name=f"upstream GET stream {self.server}", context=contextvars.Context()
            )
        return result

    async def _listen(self) -> None:
        """Keep the standalone GET stream open (2025-11-25 transports, "Listening for Messages"):
        server-wide notifications (list changes) go to `on_notification`; `ping` is answered; other
        requests are refused. Reconnects with exponential backoff; stops on 405 or close. It lives
        as long as the session, so it traces into no request's trace."""
        tracing.leave_trace()
        async for attempt in AsyncRetrying(
            wait=wait_exponential(multiplier=0.5, max=30), retry=retry_if_exception_type(UpstreamError)
        ):
            with attempt:
                if self.closed:
                    return
                if self.credentials is not None:
                    await self.credentials.ensure()
                headers = {k: v for k, v in self._headers().items() if k != "Content-Type"}
                headers["Accept"] = "text/event-stream"
                try:
                    resp = await self.http.get(
                        self.url,
                        headers=headers,
                        allow_redirects=False,
                        timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout),
                    )
                except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                    raise UpstreamError(f"upstream {self.server} GET stream: {exc}") from exc
                async with resp:
                    if resp.status >= 300:
                        # the upstream offers no standalone stream (or forgot
                        # the session); redirects are not followed
                        return
                    try:
                        async for event in iter_events(
                            resp.content.iter_any(), max_event_bytes=self.bounds.max_response_bytes
                        ):
                            await self._on_stream_message(event.data)
                    except (aiohttp.ClientError, OSError, EventTooLargeError) as exc:
                        raise UpstreamError(f"upstream {self.server} GET stream broke: {exc}") from exc
                if not self.closed:
                    raise UpstreamError(f"upstream {self.server} GET stream ended")

    async def _on_stream_message(self, data: str) -> None:
        try:
            msg = jsonrpc.loads(data) if data.strip() else None
        except ValueError:
            return
        if isinstance(msg, dict) and jsonrpc.is_request(msg):
            self.questions.asked(msg["id"])
            if msg["method"] == "ping":
                await self._answer_ping(msg["id"])
            else:
                with contextlib.suppress(UpstreamError):
                    await self.respond(
                        msg["id"],
                        error={
                            "code": jsonrpc.METHOD_NOT_FOUND,
                            "message": f"{msg['method']} is only answered for a request in flight",
                        },
                    )
        elif isinstance(msg, dict) and jsonrpc.is_notification(msg) and self.on_notification is not None:
            self.on_notification(msg)

    async def _post(
        self, message: JsonObject, *, timeout: aiohttp.ClientTimeout | None = None
    ) -> aiohttp.ClientResponse:
        if self.credentials is not None:
            await self.credentials.ensure()
        resp = await self._post_once(message, timeout)
        if resp.status == 401 and self.credentials is not None:  # the proxy's token expired early
            resp.release()
            await self.credentials.refused(self.credentials.header())
            resp = await self._post_once(message, timeout, fresh=True)  # (the 401's connection may close)
            if resp.status == 401:
                resp.release()
                raise UpstreamError(
                    f"upstream {self.server} refused the proxy's token (HTTP 401), a fresh one too: check "
                    f"mcpServers.{self.server}.oauth"
                )
        if 300 <= resp.status < 400:
            resp.release()
            raise UpstreamError(
                f"upstream {self.server} answered HTTP {resp.status} (a redirect); redirects are not "
                f"followed: configure the final URL"
            )
        if resp.status in (401, 403):  # its own sign-in, refused before it ran anything
            resp.release()
            raise UpstreamUndeliveredError(
                f"upstream {self.server} refused the proxy (HTTP {resp.status}): it wants credentials; "
                f"configure mcpServers.{self.server}.oauth or headers"
            )
        if resp.status == 404 and self.session_id and message.get("method") != "initialize":
            resp.release()
            raise SessionExpiredError(f"upstream {self.server} no longer knows session {self.session_id}")
        return resp

    async def notify(self, method: str, params: JsonObject | None = None) -> None:
        """Send a notification; the upstream answers 202. Raises UpstreamError."""
        await self._send_no_reply(jsonrpc.notification(method, params))

    async def respond(
        self, request_id: RequestId, *, result: JsonObject | None = None, error: JsonObject | None = None
    ) -> None:
        """Answer a server→client request under the upstream's own id, once: a second answer for the
        same id (a race between an answer, a cancel, a timeout) or one for an id the upstream never
        asked is dropped and logged. Raises UpstreamError."""
        if not self.questions.claim(request_id):
            log.warning(
                "upstream_answer_dropped", server=self.server, reason="already answered or never asked"
            )
            return
        msg = (
            jsonrpc.error_response(request_id, error)
            if error is not None
            else jsonrpc.response(request_id, result or {})
        )
        await self._send_no_reply(msg)

    async def _send_no_reply(self, message: JsonObject) -> None:
        resp = await self._post(
            message,
            timeout=aiohttp.ClientTimeout(
                total=self.bounds.request_timeout, sock_connect=self.connect_timeout
            ),
        )
        async with resp:
            if resp.status >= 400:
                body = await resp.text(errors="replace")
                raise UpstreamError(
                    f"upstream {self.server} answered HTTP {resp.status} to "
                    f"{message.get('method') or 'a response'}: {body[:200]}"
                )

    @tracing.traced_request
    async def request(
        self,
        method: str,
        params: JsonObject | None,
        *,
        handler: MessageHandler | None,
        request_id: RequestId | None = None,
        on_sent: Callable[[], None] | None = None,
    ) -> JsonObject:
        """Send one request and return its JSON-RPC response message (`result` or `error`);
        `on_sent()` runs just before it is POSTed (no queue here: at once).

        Messages arriving before the response go to `handler`; `ping` requests are answered here.
        The wait is bounded (`Bounds.for_method`: `timeout`, `request_timeout` or `init_timeout`, s).
        Raises UpstreamError on transport faults (unreachable, bad status, a redirect, invalid JSON,
        a reply over `max_response_bytes` or for another id, stream closed before the response, no
        answer in time) and SessionExpiredError on a 404 for the session.
        Cancel the awaiting task to abandon the request (the caller sends `notifications/cancelled`).
        While tracing is on, the request is an upstream span whose context goes in `params._meta`.
        """
        bound, key = self.bounds.for_method(method)
        self.in_flight += 1
        try:
            async with asyncio.timeout(bound):  # (one frame with the exchange: a detached call holds it)
                if on_sent is not None:
                    on_sent()
                rid = self.next_id() if request_id is None else request_id
                message = jsonrpc.request(rid, method, params)
                # Sent again on a new session when the stream ends with no event at all: on a session
                # already broken (never delivered), or for a method harmless to run twice (see _read_stream).
                retry_safe = self.broken is not None or (
                    method not in CALL_METHODS and method != "initialize"
                )
                resp = await self._post(message)
                # Sent: neither is read again (a detached call holds this frame for hours).
                del message, params
                handed_off = False
                try:
                    if method == "initialize":
                        sid = resp.headers.get("Mcp-Session-Id")
                        if sid:
                            self.session_id = sid
                    ctype = resp.headers.get("Content-Type", "").split(";")[0].strip().lower()
                    if ctype == "text/event-stream" and resp.status < 400:
                        shed_headers(resp)  # a detached call may hold this reply for hours
                        answer = await self._read_stream(resp, rid, handler, retry_safe)
                        handed_off = drain_later(resp)
                        return answer
                    raw = await read_body(resp, self.bounds.max_response_bytes, self.server)
                    try:
                        body = jsonrpc.loads(raw)
                    except (ValueError, UnicodeDecodeError):
                        text = raw[:200].decode("utf-8", errors="replace").strip()  # (text, not b'...')
                        if resp.status >= 400:
                            raise UpstreamError(
                                f"upstream {self.server} answered HTTP {resp.status}: {text}"
                            ) from None
                        if not text:
                            raise UpstreamError(
                                f"upstream {self.server} answered HTTP {resp.status} with no body, not a "
                                "JSON-RPC response"
                            ) from None
                        raise UpstreamError(f"upstream {self.server} sent invalid JSON: {text!r}") from None
                    if isinstance(body, dict) and "error" in body and isinstance(body["error"], dict):
                        return {"jsonrpc": "2.0", "id": rid, "error": body["error"]}
                    if resp.status >= 400:
                        raise UpstreamError(f"upstream {self.server} answered HTTP {resp.status}")
                    if not jsonrpc.is_response(body) or (
                        "result" in body and not isinstance(body["result"], dict)
                    ):
                        raise UpstreamError(
                            f"upstream {self.server} sent something that is not a JSON-RPC response"
                        )
                    if body.get("id") != rid:
                        raise UpstreamError(
                            f"upstream {self.server} answered request {rid!r} with a response for id "
                            f"{body.get('id')!r}"
                        )
                    return body
                finally:
                    if not handed_off:  # what `async with resp` does
                        resp.release()
                        await resp.wait_for_close()
        except TimeoutError:
            raise UpstreamError(
                f"upstream {self.server} did not answer {method} within {bound:g} s ({key})"
            ) from None
        finally:
            self.in_flight -= 1
            if self.closed and self.broken is not None and self.in_flight == 0:
                asyncio.get_running_loop().create_task(self._delete())

    def retire(self) -> None:
        """Out of the pool: no new requests, no GET stream; a broken session is ended (DELETE) once
        its requests in flight are over (an expired one needs nothing more)."""
        self.closed = True
        if self._listener is not None:
            self._listener.cancel()
        if self.broken is not None and self.in_flight == 0:
            asyncio.get_running_loop().create_task(self._delete())

    async def _read_stream(
        self, resp: aiohttp.ClientResponse, rid: RequestId, handler: MessageHandler | None, retry_safe: bool
    ) -> JsonObject:
        """The response to `rid` from an SSE reply. When the upstream ends the stream on purpose
        (SSE polling, SEP-1699: an event id and `retry`, then a close) the stream is resumed with GET
        and `Last-Event-ID`. A stream that dies or closes before answering marks the session broken
        (the pool opens a new one). A request that got no event at all raises SessionBrokenError
        (the caller sends it once more on a new session) when `retry_safe`: the session was already
        broken before it was sent (such a session reads nothing: never delivered), or the method is
        not a call (`tools/list`, `ping`, …: harmless to run twice). A call (`CALL_METHODS`) on a
        session that breaks silently under it is NOT retried: the upstream accepted the POST, and
        whether it ran the tool cannot be known from outside, so it fails with UpstreamError rather
        than risk running a tool twice. (A 404 for the session is retried for every method:
        SessionExpiredError, the upstream forgot the session and ran nothing.)"""
        # One frame reads every event (no helper frame or state dict: a detached call holds it for hours).
        last_id: str | None = None
        retry: int | None = None
        events = 0
        current: aiohttp.ClientResponse | None = resp
        fruitless = 0
        reason = "closed the stream before answering"
        while current is not None:
            before = events
            try:
                async for event in ReaderEvents(
                    current.content, max_event_bytes=self.bounds.max_response_bytes
                ):
                    events += 1
                    last_id = event.id if event.id is not None else last_id
                    retry = event.retry if event.retry is not None else retry
                    msg = self._event_message(event)
                    if msg is None:
                        continue
                    if jsonrpc.is_response(msg) and msg.get("id") == rid:
                        if "result" in msg and not isinstance(msg["result"], dict):
                            raise UpstreamError(f"upstream {self.server} sent a non-object result")
                        return msg
                    if jsonrpc.is_request(msg):
                        self.questions.asked(msg["id"])
                        if msg.get("method") == "ping":
                            asyncio.get_running_loop().create_task(self._answer_ping(msg["id"]))
                            continue
                    if handler is not None and "method" in msg:
                        await handler(msg)
            except EventTooLargeError:
                raise UpstreamError(
                    f"upstream {self.server} sent a message larger than max_response_bytes "
                    f"({self.bounds.max_response_bytes} bytes)"
                ) from None
            except (aiohttp.ClientError, OSError) as exc:
                reason = f"broke the stream mid-call: {exc.__class__.__name__}: {exc}"
                retry = None
            finally:
                if current is not resp:
                    current.release()
            fruitless = 0 if events > before else fruitless + 1
            if retry is None or last_id is None or fruitless >= MAX_RESUME_ATTEMPTS:
                break
            log.info("upstream_stream_resume", server=self.server, reason=reason, after_ms=retry)
            await asyncio.sleep(min(retry / 1000, MAX_RETRY_WAIT_S))
            current = await self._resume(last_id)
            if current is None:
                reason = "closed the stream before answering and refused to resume it"
        self.broken = self.broken or reason
        if retry_safe and events == 0:
            raise SessionBrokenError(
                f"upstream {self.server} session {self.session_id} is broken ({self.broken}); the request "
                f"got no answer"
            )
        raise UpstreamError(f"upstream {self.server} {reason}")

    def _event_message(self, event: SseEvent) -> JsonObject | None:
        """The JSON object an SSE `message` event carries, or None (other event, no data, not JSON: logs)."""
        if event.event != "message" or not event.data.strip():
            return None
        try:
            msg = jsonrpc.loads(event.data)
        except ValueError:
            log.warning("upstream_invalid_sse_data", server=self.server, sample=event.data[:120])
            return None
        return msg if isinstance(msg, dict) else None

    async def _post_once(
        self, message: JsonObject, timeout: aiohttp.ClientTimeout | None, *, fresh: bool = False
    ) -> aiohttp.ClientResponse:
        try:
            return await self.http.post(
                self.url,
                resend=jsonrpc.safe_to_resend(message),
                fresh=fresh,
                data=jsonrpc.dumps(message),
                headers=self._headers(),
                allow_redirects=False,  # configured headers (credentials) never follow a redirect
                timeout=timeout or aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout),
            )
        except (
            aiohttp.ClientConnectorError,
            aiohttp.ConnectionTimeoutError,
        ) as exc:  # the request never left
            reason = error_text(exc, self.url)
            raise UpstreamUndeliveredError(f"upstream {self.server} unreachable: {reason}") from exc
        except TimeoutError as exc:  # reached, but silent (its `total` passed)
            within = f" within {timeout.total:g} s" if timeout is not None and timeout.total else ""
            raise UpstreamError(f"upstream {self.server} did not answer{within}") from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise UpstreamError(failure_text(self.server, exc, self.url)) from exc

    async def _resume(self, last_event_id: str) -> aiohttp.ClientResponse | None:
        """A GET resuming the session's stream after `last_event_id`; None when refused."""
        if self.credentials is not None:
            try:
                await self.credentials.ensure()
            except UpstreamError:
                return None
        headers = {k: v for k, v in self._headers().items() if k != "Content-Type"}
        headers["Accept"] = "text/event-stream"
        headers["Last-Event-ID"] = last_event_id
        try:
            resp = await self.http.get(
                self.url,
                headers=headers,
                allow_redirects=False,
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout),
            )
        except (TimeoutError, aiohttp.ClientError, OSError):
            return None
        if resp.status != 200 or not resp.headers.get("Content-Type", "").startswith("text/event-stream"):
            resp.release()
            return None
        return resp

    async def _answer_ping(self, request_id: RequestId) -> None:
        try:
            await self.respond(request_id, result={})
        except UpstreamError:
            log.info("upstream_ping_answer_failed", server=self.server)

    async def close(self) -> None:
        """End the upstream session with DELETE (best effort)."""
        if self.closed:
            return
        self.closed = True
        if self._listener is not None:
            self._listener.cancel()
        await self._delete()

    async def _delete(self) -> None:
        if not self.session_id or self._deleted:
            return
        self._deleted = True
        try:
            async with self.http.delete(
                self.url,
                headers=self._headers(),
                allow_redirects=False,
                timeout=aiohttp.ClientTimeout(total=self.bounds.connect_timeout),
            ):
                pass
        except (TimeoutError, aiohttp.ClientError, OSError):
            pass
