"""stdio connector: legacy MCP servers run as child processes (MCP 2025-11-25 basic/transports "stdio").

Newline-delimited JSON-RPC on the child's stdin/stdout; stderr is free-form logging. One child is one
upstream session (one `initialize`); the proxy multiplexes many concurrent requests over its pipe,
matching responses by id, progress by progress token. `StdioPool` keeps the children of one
configured server: per capability set (and per principal with `isolation: per_principal`), up to
`instances` children each, restarted with exponential backoff when they exit, refused while in a
crash loop, stopped after `idle_timeout`, and never left behind by the proxy.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import ctypes
import itertools
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
import structlog

from proxy import __version__
from proxy.protocol import jsonrpc
from proxy.protocol.era import LEGACY_VERSIONS, UPSTREAM_VERSION
from proxy.protocol.jsonrpc import JsonObject, RequestId
from proxy.runtime import tracing
from proxy.upstream.types import Bounds, MessageHandler, OpenQuestions, UpstreamError, UpstreamTimeoutError

log = structlog.get_logger("proxy.upstream.stdio")

HUNG_GRACE_S = 0.2  # how long (s) a child that never answered initialize gets at each stopping step
EXIT_WAIT_S = 5.0  # how long (s) a child whose stdout closed or broke gets to be seen exiting, per step

_PR_SET_PDEATHSIG = 1
# requests a server may ask questions for
_ASKING_METHODS = frozenset({"tools/call", "prompts/get", "resources/read"})


def die_with_parent() -> None:
    """In a child between fork and exec (Linux): SIGKILL it when its parent dies, so no child
    outlives the proxy, even one killed with SIGKILL. Does nothing where prctl is missing."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


@dataclass
class StdioCommand:
    """How to start the child: `command` and `args`, extra `env` (on top of the proxy's), `cwd`."""

    command: str
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None


@dataclass
class _Pending:
    future: asyncio.Future[JsonObject]
    handler: MessageHandler | None
    progress_token: Any
    started: float
    method: str = ""


class StdioSession:
    """One child process speaking MCP over stdio, initialized with `capabilities`.

    Same surface as `UpstreamSession` (open, request, notify, respond, close). `limit` bounds
    concurrent requests (None: unbounded). `on_notification` receives the server-wide notifications
    that arrive while no request is in flight; `single_owner` says every request on this child comes
    from one principal (`isolation: per_principal`: its questions go to the newest request). Raises
    UpstreamError when the child cannot start, dies, or writes to a closed pipe; the message names
    the exit status.
    """

    session_id: str | None = None  # (a child has no session id)
    origin = ""  # (nor an upstream URL)

    def __init__(
        self,
        server: str,
        command: StdioCommand,
        *,
        capabilities: JsonObject,
        limit: asyncio.Semaphore | None,
        init_timeout: float,
        bounds: Bounds | None = None,
        on_notification: Callable[[JsonObject], None] | None = None,
        single_owner: bool = False,
    ) -> None:
        self.server = server
        self.command = command
        self.capabilities = dict(capabilities)
        self.limit = limit
        self.init_timeout = init_timeout
        self.bounds = bounds or Bounds(init_timeout=init_timeout)
        self.broken: str | None = None  # why the proxy stopped reading the child (an oversized message)
        self.initialize_result: JsonObject = {}
        self.protocol_version = UPSTREAM_VERSION
        self.proc: asyncio.subprocess.Process | None = None
        self.closed = False
        self.started_at = 0.0
        self.exit_status: int | None = None
        self.last_used = time.monotonic()
        self._pending: dict[RequestId, _Pending] = {}
        self.questions = OpenQuestions()  # the child's requests not answered yet: one response each
        self._ids = itertools.count(1)
        self._write_lock = asyncio.Lock()
        self._readers: list[asyncio.Task[None]] = []
        self.exited = asyncio.Event()
        self.on_notification = on_notification
        self.single_owner = single_owner

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        """Requests waiting for their response."""
        return len(self._pending)

    @property
    def usable(self) -> bool:
        """True while the child can take requests: not stopped, not exited, its stdout not broken
        (a broken child may take up to 2 × `EXIT_WAIT_S` s to be seen exiting)."""
        return not self.closed and not self.exited.is_set() and self.broken is None

    async def open(self) -> JsonObject:
        """Start the child and run the `initialize` handshake. Raises UpstreamError."""
        try:
            self.proc = await asyncio.create_subprocess_exec(
                self.command.command,
                *self.command.args,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env={**os.environ, **self.command.env},
                cwd=self.command.cwd,
                preexec_fn=die_with_parent,
            )
        except OSError as exc:
            raise UpstreamError(
                f"upstream {self.server}: cannot start {self.command.command!r}: {exc.strerror or exc}"
            ) from exc
        self.started_at = time.monotonic()
        loop = asyncio.get_running_loop()
        # In a context of their own: they outlive the request that happened to start the child, whose
        # log fields (request id, method, ...) and console entry their lines must not carry.
        self._readers = [
            loop.create_task(self._read_stdout(), context=contextvars.Context()),
            loop.create_task(self._read_stderr(), context=contextvars.Context()),
        ]
        params = {
            "protocolVersion": UPSTREAM_VERSION,
            "capabilities": self.capabilities,
            "clientInfo": {"name": "mcp-tasks-proxy", "version": __version__},
        }
        try:
            async with asyncio.timeout(self.init_timeout):
                reply = await self.request("initialize", params, handler=None, request_id=0)
        except asyncio.CancelledError:
            self.kill_now()
            raise
        except TimeoutError:
            await self.close(grace_s=HUNG_GRACE_S)  # it ignores its input: no 2 s for it to read EOF
            raise UpstreamTimeoutError(
                f"upstream {self.server} did not answer initialize within {self.init_timeout:g} s "
                "(init_timeout)"
            ) from None
        except UpstreamError:
            await self.close()
            raise
        if "error" in reply:
            await self.close()
            raise UpstreamError(f"upstream {self.server} refused initialize: {reply['error'].get('message')}")
        result = reply.get("result") or {}
        if result.get("protocolVersion") not in LEGACY_VERSIONS:
            await self.close()
            raise UpstreamError(
                f"upstream {self.server} negotiated unsupported protocol version "
                f"{result.get('protocolVersion')!r}"
            )
        self.protocol_version = result["protocolVersion"]
        self.initialize_result = result
        await self.notify("notifications/initialized")
        return result

    def kill_now(self) -> None:
        """SIGKILL the child and stop reading, without waiting (for cancellation paths)."""
        self.closed = True
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
        for reader in self._readers:
            reader.cancel()
        self._fail_all(f"upstream {self.server} was stopped")

    async def close(self, *, grace_s: float = 2.0) -> None:
        """Stop the child: close stdin, then SIGTERM, then SIGKILL (`grace_s` s apart)."""
        self.closed = True
        proc = self.proc
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(Exception):
                proc.stdin.close()  # type: ignore[union-attr]
            for sig in (None, signal.SIGTERM, signal.SIGKILL):
                if sig is not None:
                    with contextlib.suppress(ProcessLookupError):
                        proc.send_signal(sig)
                try:
                    await asyncio.wait_for(proc.wait(), timeout=grace_s)
                    break
                except TimeoutError:
                    continue
        for reader in self._readers:
            reader.cancel()
        self._fail_all(f"upstream {self.server} was stopped")

    # -- I/O ---------------------------------------------------------------------------------

    def next_id(self) -> int:
        """A fresh upstream JSON-RPC request id for this child."""
        return next(self._ids)

    def sent(self, request_id: RequestId) -> bool:
        """True once request `request_id` holds its `max_concurrency` slot and went (or is going) to
        the child; False while it still waits for a slot (or after its response)."""
        return request_id in self._pending

    async def _write(self, message: JsonObject) -> None:
        proc = self.proc
        if proc is None or proc.stdin is None or proc.returncode is not None or self.exited.is_set():
            raise UpstreamError(self._gone_message())
        data = jsonrpc.dumps(message) + b"\n"
        if b"\\ud" in data and _lone_surrogate(message):
            # The child could not read the line and would never answer: refuse now, not at the timeout.
            raise UpstreamError(
                f"upstream {self.server} (stdio) cannot be sent a string holding a lone surrogate "
                "(\\ud800-\\udfff without its pair): it is not Unicode text"
            )
        async with self._write_lock:
            try:
                proc.stdin.write(data)
                await proc.stdin.drain()
            except (BrokenPipeError, ConnectionResetError) as exc:
                raise UpstreamError(self._gone_message()) from exc

    def _gone_message(self) -> str:
        status = self.proc.returncode if self.proc is not None else None
        return (
            f"upstream {self.server} exited with status {status}"
            if status is not None
            else f"upstream {self.server} is not running"
        )

    async def notify(self, method: str, params: JsonObject | None = None) -> None:
        """Send a notification. Raises UpstreamError."""
        await self._write(jsonrpc.notification(method, params))

    async def respond(
        self, request_id: RequestId, *, result: JsonObject | None = None, error: JsonObject | None = None
    ) -> None:
        """Answer a server→client request under the child's own id, once (a second answer for the
        same id, or one for an id never asked, is dropped and logged). Raises UpstreamError."""
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
        await self._write(msg)

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
        """Send one request and return its response message (`result` or `error`).

        Messages for it (progress with its token, server→client requests) go to `handler`;
        `on_sent()` runs once it holds its `max_concurrency` slot, just before it is written (a
        request cancelled before that never reached the child, and needs no `notifications/cancelled`).
        The wait (a `max_concurrency` slot included) is bounded by `Bounds.for_method` (s).
        Raises UpstreamError when the child dies first (naming the exit status) or does not answer in time.
        While tracing is on, the request is an upstream span whose context goes in `params._meta`.
        """
        bound, key = self.bounds.for_method(method)
        try:
            async with asyncio.timeout(bound):
                if self.limit is not None:
                    async with self.limit:
                        return await self._request(method, params, handler, request_id, on_sent)
                return await self._request(method, params, handler, request_id, on_sent)
        except TimeoutError:
            raise UpstreamError(
                f"upstream {self.server} did not answer {method} within {bound:g} s ({key})"
            ) from None

    async def _request(
        self,
        method: str,
        params: JsonObject | None,
        handler: MessageHandler | None,
        request_id: RequestId | None,
        on_sent: Callable[[], None] | None,
    ) -> JsonObject:
        rid = self.next_id() if request_id is None else request_id
        if on_sent is not None:
            on_sent()
        raw_meta = (params or {}).get("_meta")
        meta: JsonObject = raw_meta if isinstance(raw_meta, dict) else {}
        future: asyncio.Future[JsonObject] = asyncio.get_running_loop().create_future()
        self._pending[rid] = _Pending(future, handler, meta.get("progressToken"), time.monotonic(), method)
        self.last_used = time.monotonic()
        try:
            await self._write(jsonrpc.request(rid, method, params))
            return await future
        finally:
            self._pending.pop(rid, None)
            self.last_used = time.monotonic()

    def _fail_all(self, message: str) -> None:
        for pending in list(self._pending.values()):
            if not pending.future.done():
                pending.future.set_exception(UpstreamError(message))

    async def _lines(self, stream: asyncio.StreamReader, limit: int, *, truncate: bool = False):
        """Lines of `stream`. A line longer than `limit` bytes raises ValueError, or with `truncate`
        is cut to `limit` bytes (the rest of it is skipped)."""
        buffer = bytearray()
        skipping = False
        while True:
            chunk = await stream.read(1 << 16)
            if not chunk:
                if buffer and not skipping:
                    yield bytes(buffer)
                return
            start = len(buffer)
            buffer += chunk
            cut = buffer.find(b"\n", start)
            while cut >= 0:
                if not skipping:
                    yield bytes(buffer[:cut])
                skipping = False
                del buffer[: cut + 1]
                cut = buffer.find(b"\n")
            if len(buffer) > limit:
                if not truncate:
                    raise ValueError(f"a message larger than max_response_bytes ({limit} bytes)")
                if not skipping:
                    yield bytes(buffer[:limit])
                skipping = True
                buffer.clear()

    async def _read_stdout(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        try:
            async for raw in self._lines(self.proc.stdout, self.bounds.max_response_bytes):
                line = raw.strip()
                if not line:
                    continue
                try:
                    msg = jsonrpc.loads(line)
                except ValueError:
                    msg = None
                if not isinstance(msg, dict) or msg.get("jsonrpc") != "2.0":
                    log.warning(
                        "upstream_stdout_not_jsonrpc",
                        server=self.server,
                        sample=line[:200].decode(errors="replace"),
                    )
                    continue
                await self._dispatch(msg)
        except Exception as exc:  # whatever stops the reader stops the child: no caller waits on it
            log.warning("upstream_stdout_broken", server=self.server, error=str(exc))
            sent = isinstance(exc, (OSError, ValueError))
            what = f"sent {exc}" if sent else f"broke the proxy's reader ({exc!r})"
            self.broken = f"upstream {self.server} {what}; the child was stopped"
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            self._fail_all(self.broken)  # now: the child's exit below may take a while to be seen
            await self._drain(self.proc.stdout)
        # stdout closed: the child is exiting (cancellation skips this, nothing waits on the child then)
        status = await self._reap()
        self.exit_status = status
        self.exited.set()
        if not self.closed:
            log.warning("upstream_exited", server=self.server, status=status, in_flight=len(self._pending))
        self._fail_all(
            self.broken or f"upstream {self.server} exited with status {status} while the request was running"
        )

    @staticmethod
    async def _drain(stream: asyncio.StreamReader) -> None:
        """Read and drop what is left on `stream` until EOF, for at most `EXIT_WAIT_S` s: unread
        output would pause the pipe, and the child's exit is only reported once its pipes close."""
        with contextlib.suppress(TimeoutError, OSError):
            async with asyncio.timeout(EXIT_WAIT_S):
                while await stream.read(1 << 16):
                    pass

    async def _reap(self) -> int | None:
        """The child's exit status, waiting at most `EXIT_WAIT_S` s for its exit to be reported,
        then SIGKILLing it and waiting as long again. None when it is still not reported (a
        grandchild holding its pipes open delays the report, never this session's failure)."""
        assert self.proc is not None
        for step in range(2):
            if step:
                with contextlib.suppress(ProcessLookupError):
                    self.proc.kill()
            try:
                return await asyncio.wait_for(self.proc.wait(), timeout=EXIT_WAIT_S)
            except TimeoutError:
                continue
        return self.proc.returncode

    async def _read_stderr(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        async for raw in self._lines(self.proc.stderr, 1 << 16, truncate=True):
            text = raw.decode(errors="replace").rstrip()
            if text:
                log.info("upstream_stderr", server=self.server, line=text[:2000])

    async def _dispatch(self, msg: JsonObject) -> None:
        if jsonrpc.is_response(msg):
            if msg["id"] is None and "error" in msg:
                self._error_without_id(msg)
                return
            if isinstance(msg["id"], bool) or not isinstance(msg["id"], (str, int)):
                log.warning("upstream_response_bad_id", server=self.server)
                return
            pending = self._pending.get(msg["id"])
            if pending is not None and not pending.future.done():
                if "result" in msg and not isinstance(msg["result"], dict):
                    pending.future.set_exception(
                        UpstreamError(f"upstream {self.server} sent a non-object result")
                    )
                else:
                    pending.future.set_result(msg)
            return
        if "method" not in msg:
            return
        if jsonrpc.is_request(msg):
            self.questions.asked(msg["id"])
        if jsonrpc.is_request(msg) and msg["method"] == "ping":
            asyncio.get_running_loop().create_task(self._quiet(self.respond(msg["id"], result={})))
            return
        targets = self._targets(msg)
        for pending in targets:
            if pending.handler is not None:
                await pending.handler(msg)
        if not targets and jsonrpc.is_notification(msg) and self.on_notification is not None:
            self.on_notification(msg)  # server-wide (list changes) with no request in flight

    def _error_without_id(self, msg: JsonObject) -> None:
        """An error with a null id (the child could not read a request's id): it answers the one
        request waiting, if exactly one is; with several it cannot be placed and is logged."""
        waiting = [(rid, p) for rid, p in self._pending.items() if not p.future.done()]
        if len(waiting) == 1:
            rid, pending = waiting[0]
            pending.future.set_result({**msg, "id": rid})
            return
        log.warning("upstream_error_without_id", server=self.server, waiting=len(waiting))

    def _targets(self, msg: JsonObject) -> list[_Pending]:
        """Which waiting requests a message from the child belongs to.

        Progress goes by token; other notifications to every request; a server→client request to
        the one request in flight that can take it. stdio has no per-request stream, so when several
        could take it the question is refused upstream rather than guessed (a wrong guess could show
        one client's question to another); a child owned by one principal (`isolation:
        per_principal`) gives it to its newest request instead.
        """
        raw = msg.get("params")
        params: JsonObject = raw if isinstance(raw, dict) else {}
        if msg["method"] == "notifications/progress":
            return [
                p
                for p in self._pending.values()
                if p.progress_token is not None and p.progress_token == params.get("progressToken")
            ]
        candidates = [p for p in self._pending.values() if p.handler is not None]
        if jsonrpc.is_request(msg):
            candidates = [p for p in candidates if p.method in _ASKING_METHODS]
            if len(candidates) == 1 or (candidates and self.single_owner):
                return [max(candidates, key=lambda p: p.started)]
            reason = (
                "no request in flight can take this"
                if not candidates
                else "several requests are in flight on this shared stdio child"
            )
            asyncio.get_running_loop().create_task(
                self._quiet(
                    self.respond(msg["id"], error={"code": jsonrpc.INVALID_REQUEST, "message": reason})
                )
            )
            log.warning("upstream_question_refused", server=self.server, method=msg["method"], reason=reason)
            return []
        return candidates

    async def _quiet(self, coro: Any) -> None:
        with contextlib.suppress(UpstreamError):
            await coro


def _lone_surrogate(message: JsonObject) -> bool:
    """True when a string in `message` holds a lone surrogate (orjson, which writes UTF-8, refuses
    exactly those; its other refusals, integers past 64 bits and the like, are not this)."""
    try:
        orjson.dumps(message)
    except TypeError as exc:
        return "surrogates not allowed" in str(exc)
    return False
