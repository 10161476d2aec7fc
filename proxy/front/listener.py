"""The listening socket and the HTTP server around the app: bound before anything starts, slow
clients bounded, connections capped, and accept errors (fd exhaustion) logged once, not as a flood.

aiohttp's `keepalive_timeout` also runs before the first request of a connection, so it bounds how
long a client may take to send a complete request head (`listen.header_timeout`); bodies are bounded
by the endpoint (`listen.body_timeout`). Past `listen.max_connections` open connections a new one is
answered `503` with a JSON-RPC error and closed, so a flood of idle sockets cannot use up the file
descriptors the proxy needs for its upstreams, its store and `/healthz`.
"""

from __future__ import annotations

import asyncio
import errno
import json
import re
import resource
import socket
import time
from collections.abc import Callable
from typing import Any, cast

import structlog
from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from proxy.config import Config
from proxy.protocol import jsonrpc
from proxy.runtime import event_loop, metrics

log = structlog.get_logger("proxy.front")

_ACCEPT_ERRORS = ("socket.accept() out of system resource", "Error on reading from the event loop self pipe")
# accept() failures that mean "out of a resource for now" (asyncio's own list): pause, then retry
_OUT_OF_RESOURCES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
ACCEPT_RETRY_S = 1.0  # (s) how long accepting pauses after such a failure, as on asyncio's own loop


class _AcceptFailures:
    """Counts accept failures (out of descriptors) and logs them as one `accept_failed` line per
    LOG_EVERY_S (s) with the count since the last line, not one traceback each."""

    LOG_EVERY_S = 10.0

    def __init__(self) -> None:
        self._last = 0.0
        self._count = 0

    def note(self, reason: str) -> None:
        """One failure; `reason` is the error's text."""
        metrics.LIMIT_REJECTIONS.labels("accept_failed").inc()
        self._count += 1
        now = time.monotonic()
        if now - self._last >= self.LOG_EVERY_S:
            log.error("accept_failed", reason=reason, failures=self._count)
            self._last, self._count = now, 0


_accept_failures = _AcceptFailures()


def default_max_connections() -> int:
    """Half the soft open-file limit (at least 8): the other half stays for upstreams, the store and logs."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 4096
    return max(8, soft // 2)


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on `host`:`port` (0: a free port). Raises OSError (address in use,
    permission denied, unknown host) before anything else of the proxy starts."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise OSError(f"cannot resolve listen host {host!r}: {exc.strerror}") from None
    family, _type, _proto, _name, address = infos[0]
    sock = socket.create_server(address[:2], family=family, backlog=128)
    sock.setblocking(False)
    return sock


class _Refuse(asyncio.Protocol):
    """Answers one connection past the cap with 503 and closes it. The answer is written and the
    sending side shut; what the client still sends is read and dropped until it closes, or for at
    most REFUSE_LINGER_S (s): closing at once with a request still unread makes the kernel answer
    with a reset, which can destroy the 503 before the client reads it. At most `max_lingering`
    refused connections linger at once (64, or a quarter of max_connections when less: the
    descriptors they hold are beyond the cap); past that they are closed at once, resets and all."""

    BODY = json.dumps(
        {
            "jsonrpc": "2.0",
            "id": None,
            "error": {
                "code": -32603,
                "message": "too many open connections (listen.max_connections); try again later",
            },
        }
    ).encode()
    REFUSE_LINGER_S = 1.0
    lingering = 0  # refused connections lingering now, in this process

    def __init__(self, max_lingering: int) -> None:
        self.max_lingering = max_lingering

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        head = (
            "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
            f"Content-Length: {len(self.BODY)}\r\nConnection: close\r\n\r\n"
        ).encode()
        writer = cast(asyncio.WriteTransport, transport)  # (uvloop's transports are not its subclasses)
        self._writer = writer
        self._timer: asyncio.TimerHandle | None = None
        writer.write(head + self.BODY)
        if _Refuse.lingering >= self.max_lingering or not writer.can_write_eof():
            writer.close()
            return
        writer.write_eof()
        _Refuse.lingering += 1
        self._timer = asyncio.get_running_loop().call_later(self.REFUSE_LINGER_S, writer.close)

    def data_received(self, data: bytes) -> None:
        """The refused client's request: dropped."""

    def eof_received(self) -> bool:
        """The client closed its side: close ours."""
        self._writer.close()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        """Stop lingering."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
            _Refuse.lingering -= 1


_QUOTED = re.compile(r"""b?'[^']*'?|b?"[^"]*"?""")  # quoted request bytes in aiohttp's parse errors


class JsonErrorRequestHandler(RequestHandler):
    """aiohttp's connection handler, but a request it cannot parse (a broken request line or
    header, a `Content-Encoding` it cannot decode) is answered with a JSON-RPC error, not a text
    page, and logged as one line without a traceback."""

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """The error response for a request that failed below the app; `status` as aiohttp decided.
        An `Expect` value aiohttp's own handler cannot even quote (bytes that are not UTF-8, on a
        route without the proxy's `guards.expect_continue`: the console, metadata, an unknown path)
        gets 417 with a JSON-RPC error, not a 500."""
        expect = request.headers.get("Expect")
        if (
            status >= 500
            and isinstance(exc, UnicodeError)
            and expect is not None
            and expect.lower() != "100-continue"
        ):
            log.info(
                "bad_http_request",
                status=417,
                reason="an Expect value other than 100-continue",
                remote=request.remote,
            )
            body = {
                "jsonrpc": "2.0",
                "id": None,
                "error": {"code": -32600, "message": "the only Expect value served is 100-continue"},
            }
            response = web.json_response(body, status=417, dumps=jsonrpc.dumps_str)
            response.force_close()
            return response
        if status >= 500:
            return super().handle_error(request, status, exc, message)
        reason = " ".join(str(getattr(exc, "message", None) or exc or message or "bad request").split())
        # aiohttp quotes the bytes it choked on (a header line: maybe a token): never log or echo them
        reason = _QUOTED.sub("<…>", reason)[:300]
        log.info("bad_http_request", status=status, reason=reason, remote=request.remote)
        if request.writer.output_size > 0:
            raise ConnectionError("a response was already sent; cannot send the error")
        code = -32700 if "encoding" in reason.lower() else -32600
        body = {
            "jsonrpc": "2.0",
            "id": None,
            "error": {"code": code, "message": f"malformed HTTP request: {reason}"},
        }
        response = web.json_response(body, status=status, dumps=jsonrpc.dumps_str)
        response.force_close()
        return response


class RetryingAcceptor(asyncio.AbstractServer):
    """Accepts connections on the listening socket `sock` with Python's `accept()` and hands each
    to `protocol_factory` through `loop.connect_accepted_socket`; used on uvloop, whose own accept
    loop (libuv's) cannot back off: out of descriptors (EMFILE once libuv's spare descriptor is
    spent, ENFILE) it retries `accept()` on every loop iteration, one CPU at 100 % and no log line.
    Here a failure for want of a resource (EMFILE, ENFILE, ENOBUFS, ENOMEM) is counted in
    `accept_failed` and accepting pauses ACCEPT_RETRY_S (s) before it resumes, as on asyncio's own
    loop. At most `backlog` connections are accepted per readable event. `close()` stops
    accepting; the socket stays its owner's (the site's)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        sock: socket.socket,
        protocol_factory: Callable[[], asyncio.Protocol],
        backlog: int,
    ) -> None:
        self._loop = loop
        self._sock = sock
        self._factory = protocol_factory
        self._backlog = backlog
        self._serving = False
        self._resume: asyncio.TimerHandle | None = None
        self._handshakes: set[asyncio.Task[None]] = set()

    def start(self) -> None:
        """Start accepting."""
        self._serving = True
        self._loop.add_reader(self._sock.fileno(), self._accept)

    async def start_serving(self) -> None:
        """Start accepting, unless it already does."""
        if not self._serving:
            self.start()

    async def serve_forever(self) -> None:
        """Not offered: the site starts and stops it. Raises NotImplementedError."""
        raise NotImplementedError("RetryingAcceptor is started and closed by its site")

    def _accept(self) -> None:
        for _ in range(self._backlog):
            try:
                conn, _address = self._sock.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return
            except OSError as exc:
                if exc.errno not in _OUT_OF_RESOURCES:
                    log.warning("accept_error", reason=str(exc))
                    return
                _accept_failures.note(str(exc))
                self._loop.remove_reader(self._sock.fileno())
                self._resume = self._loop.call_later(ACCEPT_RETRY_S, self._resume_accepting)
                return
            conn.setblocking(False)
            task = self._loop.create_task(self._connect(conn))
            self._handshakes.add(task)
            task.add_done_callback(self._handshakes.discard)

    async def _connect(self, conn: socket.socket) -> None:
        try:
            await self._loop.connect_accepted_socket(self._factory, conn)
        except OSError as exc:
            log.warning("accept_error", reason=str(exc))
            conn.close()

    def _resume_accepting(self) -> None:
        self._resume = None
        if self._serving:
            self._loop.add_reader(self._sock.fileno(), self._accept)

    def close(self) -> None:
        """Stop accepting (connections already accepted are the app's to close)."""
        if not self._serving:
            return
        self._serving = False
        if self._resume is not None:
            self._resume.cancel()
            self._resume = None
        elif self._sock.fileno() != -1:
            self._loop.remove_reader(self._sock.fileno())

    def get_loop(self) -> asyncio.AbstractEventLoop:
        """The loop it accepts on."""
        return self._loop

    def is_serving(self) -> bool:
        """Whether it accepts (or pauses after a failure and will resume)."""
        return self._serving

    async def wait_closed(self) -> None:
        """Return at once: stopping is immediate."""

    @property
    def sockets(self) -> tuple[socket.socket, ...]:
        """The listening socket."""
        return (self._sock,)


class CappedSite(web.SockSite):
    """A `SockSite` that serves at most `max_connections` connections at a time."""

    def __init__(
        self, runner: web.BaseRunner, sock: socket.socket, *, max_connections: int, **kwargs: Any
    ) -> None:
        super().__init__(runner, sock, **kwargs)
        self.max_connections = max_connections
        self._last_refusal_log = 0.0
        self._refused = 0

    async def start(self) -> None:
        """Start serving on the socket given at construction."""
        await web.BaseSite.start(self)
        server = self._runner.server
        assert server is not None
        loop = asyncio.get_running_loop()

        def factory() -> asyncio.Protocol:
            if len(server.connections) >= self.max_connections:
                self._note_refusal()
                return _Refuse(max_lingering=min(64, self.max_connections // 4))
            return JsonErrorRequestHandler(server, loop=loop, **server._kwargs)

        if event_loop.running() == "uvloop":
            acceptor = RetryingAcceptor(loop, self._sock, factory, self._backlog)
            acceptor.start()
            self._server = acceptor
        else:
            self._server = await loop.create_server(factory, sock=self._sock, backlog=self._backlog)

    def _note_refusal(self) -> None:
        metrics.LIMIT_REJECTIONS.labels("max_connections").inc()
        self._refused += 1
        now = time.monotonic()
        if now - self._last_refusal_log >= 10.0:
            log.warning("connections_refused", limit=self.max_connections, refused=self._refused)
            self._last_refusal_log, self._refused = now, 0


def quiet_accept_errors(loop: asyncio.AbstractEventLoop) -> None:
    """Replace asyncio's per-failure traceback for accept errors (EMFILE/ENFILE: out of file
    descriptors) with one log line per 10 s that counts them, and drop asyncio's accept retries that fire
    after shutdown closed the listening socket (ValueError: fd -1); other errors keep the default handler."""
    previous = loop.get_exception_handler()

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        message = str(context.get("message", ""))
        if "._start_serving(" in message and isinstance(context.get("exception"), (ValueError, OSError)):
            # After an accept failure asyncio retries accepting 1 s later (one retry per failure);
            # a retry that fires once shutdown has closed the listening socket fails harmlessly.
            log.debug("accept_retry_after_close")
            return
        if message.startswith(_ACCEPT_ERRORS):
            exc = context.get("exception")
            _accept_failures.note(str(exc) if exc else message)
            return
        if previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)


async def start(
    app: web.Application, config: Config, sock: socket.socket | None = None
) -> tuple[web.AppRunner, CappedSite]:
    """Run `app` on `sock` (bound from `config.listen` when None) with the listen section's bounds:
    `header_timeout` (s) for a request head, idle connections and draining an unread body, at most
    `max_connections` open connections, `drain_timeout` (s) (+1 s) for shutdown. Raises OSError
    when the address cannot be bound."""
    listen = config.listen
    sock = sock if sock is not None else bind(listen.host, listen.port)
    runner = web.AppRunner(
        app,
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=listen.drain_timeout + 1.0,
        keepalive_timeout=listen.header_timeout,
        lingering_time=listen.header_timeout,  # how long an unread rest of a body is drained before the close
    )
    await runner.setup()
    site = CappedSite(runner, sock, max_connections=listen.max_connections or default_max_connections())
    await site.start()
    return runner, site


def close_connections(runner: web.AppRunner) -> int:
    """Close every open client connection of `runner` now, in-flight requests included (their
    handlers end with a connection error): the end of a shutdown that must not wait for a client
    that stopped reading or sending. The socket is aborted, not closed: a close waits for the
    write buffer to empty, which a client that stopped reading never lets happen. Returns how many
    were closed."""
    server = runner.server
    if server is None:
        return 0
    connections = list(server.connections)
    for connection in connections:
        transport = connection.transport
        connection.force_close()
        if transport is not None:
            transport.abort()
    return len(connections)
