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
import ctypes
import itertools
import json
import os
import signal
import time
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any

import structlog
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from .. import __version__
from ..protocol import jsonrpc
from ..protocol.era import LEGACY_VERSIONS, UPSTREAM_VERSION
from ..protocol.jsonrpc import JsonObject, RequestId
from .http import MessageHandler, UpstreamError, caps_key, probe

log = structlog.get_logger("proxy.upstream.stdio")

_PR_SET_PDEATHSIG = 1
_ASKING_METHODS = frozenset({"tools/call", "prompts/get", "resources/read"})  # requests a server may ask questions for


def _die_with_parent() -> None:  # runs in the child between fork and exec (Linux)
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
    concurrent requests (None: unbounded). Raises UpstreamError when the child cannot start, dies,
    or writes to a closed pipe; the message names the exit status.
    """

    def __init__(self, server: str, command: StdioCommand, *, capabilities: JsonObject, limit: asyncio.Semaphore | None, init_timeout: float) -> None:
        self.server = server
        self.command = command
        self.capabilities = dict(capabilities)
        self.limit = limit
        self.init_timeout = init_timeout
        self.initialize_result: JsonObject = {}
        self.protocol_version = UPSTREAM_VERSION
        self.proc: asyncio.subprocess.Process | None = None
        self.closed = False
        self.started_at = 0.0
        self.exit_status: int | None = None
        self.last_used = time.monotonic()
        self._pending: dict[RequestId, _Pending] = {}
        self._ids = itertools.count(1)
        self._write_lock = asyncio.Lock()
        self._readers: list[asyncio.Task[None]] = []
        self.exited = asyncio.Event()
        self.on_notification: Callable[[JsonObject], None] | None = None
        self.single_owner = False  # all requests on this child come from one principal

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        """Requests waiting for their response."""
        return len(self._pending)

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
                preexec_fn=_die_with_parent,
            )
        except OSError as exc:
            raise UpstreamError(f"upstream {self.server}: cannot start {self.command.command!r}: {exc.strerror or exc}") from exc
        self.started_at = time.monotonic()
        loop = asyncio.get_running_loop()
        self._readers = [loop.create_task(self._read_stdout()), loop.create_task(self._read_stderr())]
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
            await self.close()
            raise UpstreamError(f"upstream {self.server} did not answer initialize within {self.init_timeout:g} s") from None
        except UpstreamError:
            await self.close()
            raise
        if "error" in reply:
            await self.close()
            raise UpstreamError(f"upstream {self.server} refused initialize: {reply['error'].get('message')}")
        result = reply.get("result") or {}
        if result.get("protocolVersion") not in LEGACY_VERSIONS:
            await self.close()
            raise UpstreamError(f"upstream {self.server} negotiated unsupported protocol version {result.get('protocolVersion')!r}")
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

    async def close(self) -> None:
        """Stop the child: close stdin, then SIGTERM, then SIGKILL (2 s apart)."""
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
                    await asyncio.wait_for(proc.wait(), timeout=2)
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

    async def _write(self, message: JsonObject) -> None:
        proc = self.proc
        if proc is None or proc.stdin is None or proc.returncode is not None or self.exited.is_set():
            raise UpstreamError(self._gone_message())
        data = json.dumps(message, separators=(",", ":")).encode() + b"\n"
        async with self._write_lock:
            try:
                proc.stdin.write(data)
                await proc.stdin.drain()
            except (BrokenPipeError, ConnectionResetError) as exc:
                raise UpstreamError(self._gone_message()) from exc

    def _gone_message(self) -> str:
        status = self.proc.returncode if self.proc is not None else None
        return f"upstream {self.server} exited with status {status}" if status is not None else f"upstream {self.server} is not running"

    async def notify(self, method: str, params: JsonObject | None = None) -> None:
        """Send a notification. Raises UpstreamError."""
        await self._write(jsonrpc.notification(method, params))

    async def respond(self, request_id: RequestId, *, result: JsonObject | None = None, error: JsonObject | None = None) -> None:
        """Answer a server→client request under the child's own id. Raises UpstreamError."""
        msg = jsonrpc.error_response(request_id, error) if error is not None else jsonrpc.response(request_id, result or {})
        await self._write(msg)

    async def request(self, method: str, params: JsonObject | None, *, handler: MessageHandler | None, request_id: RequestId | None = None) -> JsonObject:
        """Send one request and return its response message (`result` or `error`).

        Messages for it (progress with its token, server→client requests) go to `handler`.
        Raises UpstreamError when the child dies first (naming the exit status).
        """
        if self.limit is not None:
            async with self.limit:
                return await self._request(method, params, handler, request_id)
        return await self._request(method, params, handler, request_id)

    async def _request(self, method: str, params: JsonObject | None, handler: MessageHandler | None, request_id: RequestId | None) -> JsonObject:
        rid = self.next_id() if request_id is None else request_id
        meta = (params or {}).get("_meta") if isinstance((params or {}).get("_meta"), dict) else {}
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

    async def _lines(self, stream: asyncio.StreamReader):
        buffer = bytearray()
        while True:
            chunk = await stream.read(1 << 16)
            if not chunk:
                if buffer:
                    yield bytes(buffer)
                return
            start = len(buffer)
            buffer += chunk
            cut = buffer.find(b"\n", start)
            while cut >= 0:
                yield bytes(buffer[:cut])
                del buffer[: cut + 1]
                cut = buffer.find(b"\n")

    async def _read_stdout(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        try:
            async for raw in self._lines(self.proc.stdout):
                line = raw.strip()
                if not line:
                    continue
                try:
                    msg = json.loads(line)
                except ValueError:
                    msg = None
                if not isinstance(msg, dict) or msg.get("jsonrpc") != "2.0":
                    log.warning("upstream_stdout_not_jsonrpc", server=self.server, sample=line[:200].decode(errors="replace"))
                    continue
                await self._dispatch(msg)
        except (OSError, ValueError) as exc:
            log.warning("upstream_stdout_broken", server=self.server, error=str(exc))
        # stdout closed: the child is exiting (cancellation skips this, nothing waits on the child then)
        status = await self.proc.wait()
        self.exit_status = status
        self.exited.set()
        if not self.closed:
            log.warning("upstream_exited", server=self.server, status=status, in_flight=len(self._pending))
        self._fail_all(f"upstream {self.server} exited with status {status} while the request was running")

    async def _read_stderr(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        async for raw in self._lines(self.proc.stderr):
            text = raw.decode(errors="replace").rstrip()
            if text:
                log.info("upstream_stderr", server=self.server, line=text[:2000])

    async def _dispatch(self, msg: JsonObject) -> None:
        if jsonrpc.is_response(msg):
            pending = self._pending.get(msg["id"])
            if pending is not None and not pending.future.done():
                if "result" in msg and not isinstance(msg["result"], dict):
                    pending.future.set_exception(UpstreamError(f"upstream {self.server} sent a non-object result"))
                else:
                    pending.future.set_result(msg)
            return
        if "method" not in msg:
            return
        if jsonrpc.is_request(msg) and msg["method"] == "ping":
            asyncio.get_running_loop().create_task(self._quiet(self.respond(msg["id"], result={})))
            return
        targets = self._targets(msg)
        for pending in targets:
            if pending.handler is not None:
                await pending.handler(msg)
        if not targets and jsonrpc.is_notification(msg) and self.on_notification is not None:
            self.on_notification(msg)  # server-wide (list changes) with no request in flight

    def _targets(self, msg: JsonObject) -> list[_Pending]:
        """Which waiting requests a message from the child belongs to.

        Progress goes by token; other notifications to every request; a server→client request to
        the one request in flight that can take it. stdio has no per-request stream, so when several
        could take it the question is refused upstream rather than guessed (a wrong guess could show
        one client's question to another); a child owned by one principal (`isolation:
        per_principal`) gives it to its newest request instead.
        """
        params = msg.get("params") if isinstance(msg.get("params"), dict) else {}
        if msg["method"] == "notifications/progress":
            return [p for p in self._pending.values() if p.progress_token is not None and p.progress_token == params.get("progressToken")]
        candidates = [p for p in self._pending.values() if p.handler is not None]
        if jsonrpc.is_request(msg):
            candidates = [p for p in candidates if p.method in _ASKING_METHODS]
            if len(candidates) == 1 or (candidates and self.single_owner):
                return [max(candidates, key=lambda p: p.started)]
            reason = "no request in flight can take this" if not candidates else "several requests are in flight on this shared stdio child"
            asyncio.get_running_loop().create_task(self._quiet(self.respond(msg["id"], error={"code": jsonrpc.INVALID_REQUEST, "message": reason})))
            log.warning("upstream_question_refused", server=self.server, method=msg["method"], reason=reason)
            return []
        return candidates

    async def _quiet(self, coro: Any) -> None:
        with contextlib.suppress(UpstreamError):
            await coro


def _touch(session: StdioSession) -> StdioSession:
    """Mark a child as just used, so the idle reaper leaves it alone until the caller's request is in."""
    session.last_used = time.monotonic()
    return session


@dataclass
class _Slot:
    """The children of one (capability set, principal) key, plus its crash bookkeeping."""

    sessions: list[StdioSession] = field(default_factory=list)
    quick_exits: int = 0
    last_exit: float = 0.0
    last_status: int | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    capabilities: JsonObject = field(default_factory=dict)
    principal: str | None = None


class StdioPool:
    """The child processes of one configured stdio server.

    `instances` children per key (least-loaded wins), restarted as soon as one exits (after a
    backoff when it exits quickly again), `max_concurrency` requests in flight across the server, `per_principal` gives each principal its own children, `idle_timeout` (s) stops a
    child nobody used for that long, `max_restarts` quick exits in a row make a crash loop that is
    refused for `crash_cooloff` (s). A child that ran less than `stable_after` (s) exited "quickly".
    """

    def __init__(
        self,
        server: str,
        command: StdioCommand,
        *,
        instances: int = 1,
        max_concurrency: int | None = None,
        per_principal: bool = False,
        idle_timeout: float | None = None,
        init_timeout: float = 30.0,
        max_restarts: int = 5,
        crash_cooloff: float = 60.0,
        stable_after: float = 10.0,
    ) -> None:
        self.server = server
        self.command = command
        self.instances = instances
        self.per_principal = per_principal
        self.idle_timeout = idle_timeout
        self.init_timeout = init_timeout
        self.max_restarts = max_restarts
        self.crash_cooloff = crash_cooloff
        self.stable_after = stable_after
        self.limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        self._slots: dict[str, _Slot] = {}
        self._starting: set[StdioSession] = set()
        self.on_notification: Callable[[JsonObject], None] | None = None  # server-wide notifications
        self._reaper: asyncio.Task[None] | None = None
        self._restarts: set[asyncio.Task[None]] = set()
        self._closing = False

    def _key(self, capabilities: JsonObject, principal: str | None) -> str:
        caps = caps_key(capabilities)
        return f"{caps}|{principal}" if self.per_principal else caps

    def _note_exit(self, slot: _Slot, session: StdioSession) -> None:
        if session in slot.sessions:
            slot.sessions.remove(session)
        if session.closed:
            return  # we stopped it (idle, shutdown): not a crash
        ran = time.monotonic() - session.started_at
        slot.quick_exits = slot.quick_exits + 1 if ran < self.stable_after else 1
        slot.last_exit = time.monotonic()
        slot.last_status = session.exit_status
        if slot.quick_exits < self.max_restarts and not self._closing:
            # Restart it now (after the backoff `session()` applies), so the next request finds it running.
            task = asyncio.get_running_loop().create_task(self._restart(slot))
            self._restarts.add(task)
            task.add_done_callback(self._restarts.discard)

    async def _restart(self, slot: _Slot) -> None:
        try:
            await self.session(slot.capabilities, slot.principal)
        except UpstreamError as exc:
            log.warning("upstream_restart_failed", server=self.server, reason=str(exc))

    def crash_loop(self) -> str | None:
        """Why the server is refused right now (a crash loop), or None."""
        for slot in self._slots.values():
            if slot.quick_exits >= self.max_restarts and time.monotonic() - slot.last_exit < self.crash_cooloff:
                return (
                    f"upstream {self.server} is in a crash loop: it exited {slot.quick_exits} times in a row soon after starting "
                    f"(last exit status {slot.last_status}); next try in {self.crash_cooloff - (time.monotonic() - slot.last_exit):.0f} s"
                )
        return None

    async def session(self, capabilities: JsonObject, principal: str | None = None) -> StdioSession:
        """A running child for this key: the least loaded, or a new one (after a backoff when the last
        one died quickly). Raises UpstreamError when it cannot start or while in a crash loop."""
        self._ensure_reaper()
        slot = self._slots.setdefault(self._key(capabilities, principal), _Slot(capabilities=dict(capabilities), principal=principal))
        live = [s for s in slot.sessions if not s.exited.is_set() and not s.closed]
        if len(live) >= self.instances:
            return _touch(min(live, key=lambda s: s.in_flight))
        async with slot.lock:
            live = [s for s in slot.sessions if not s.exited.is_set() and not s.closed]
            if len(live) >= self.instances:
                return _touch(min(live, key=lambda s: s.in_flight))
            if slot.quick_exits >= self.max_restarts:
                if time.monotonic() - slot.last_exit < self.crash_cooloff:
                    raise UpstreamError(self.crash_loop() or f"upstream {self.server} is in a crash loop")
                slot.quick_exits = self.max_restarts - 1  # cool-off over: allow one more try
            if slot.quick_exits:  # back off after quick exits: 0.1 s, 0.2 s, 0.4 s, … up to 10 s
                wait = min(10.0, 0.1 * 2 ** (slot.quick_exits - 1)) - (time.monotonic() - slot.last_exit)
                if wait > 0:
                    await asyncio.sleep(wait)
            return _touch(await self._start(slot, capabilities))

    async def _start(self, slot: _Slot, capabilities: JsonObject) -> StdioSession:
        session: StdioSession | None = None
        async for attempt in AsyncRetrying(
            stop=stop_after_attempt(3), wait=wait_exponential(multiplier=0.1, max=2), retry=retry_if_exception_type(UpstreamError), reraise=True
        ):
            with attempt:
                session = StdioSession(self.server, self.command, capabilities=capabilities, limit=self.limit, init_timeout=self.init_timeout)
                session.on_notification = self.on_notification
                session.single_owner = self.per_principal
                try:
                    self._starting.add(session)
                    await session.open()
                except UpstreamError:
                    slot.quick_exits += 1
                    slot.last_exit = time.monotonic()
                    slot.last_status = session.proc.returncode if session.proc else None
                    raise
                finally:
                    self._starting.discard(session)
        assert session is not None
        slot.sessions.append(session)
        watcher = asyncio.get_running_loop().create_task(session.exited.wait())
        watcher.add_done_callback(lambda _t, s=session: self._note_exit(slot, s))
        return session

    def discard(self, session: Any) -> None:
        """Nothing to do for stdio: a dead child is noticed by its exit."""

    async def check(self, timeout_s: float = 5.0) -> str | None:
        """None when a child without optional capabilities runs (starting one if needed), else why not."""
        return self.crash_loop() or await probe(self, timeout_s)

    def _ensure_reaper(self) -> None:
        if self.idle_timeout and (self._reaper is None or self._reaper.done()):
            self._reaper = asyncio.get_running_loop().create_task(self._reap_idle())

    async def _reap_idle(self) -> None:
        assert self.idle_timeout
        while True:
            await asyncio.sleep(min(self.idle_timeout / 2, 5.0))
            now = time.monotonic()
            for slot in self._slots.values():
                for session in list(slot.sessions):
                    if session.in_flight == 0 and now - session.last_used >= self.idle_timeout:
                        log.info("upstream_idle_stop", server=self.server)
                        slot.sessions.remove(session)
                        await session.close()

    def children(self) -> list[int]:
        """PIDs of the running children (for tests and diagnostics)."""
        return [s.proc.pid for slot in self._slots.values() for s in slot.sessions if s.proc is not None and s.proc.returncode is None]

    async def close(self) -> None:
        """Stop every child."""
        self._closing = True
        for task in list(self._restarts):
            task.cancel()
        if self._reaper is not None:
            self._reaper.cancel()
        sessions = [s for slot in self._slots.values() for s in slot.sessions]
        self._slots.clear()
        for starting in list(self._starting):
            starting.kill_now()
        await asyncio.gather(*(s.close() for s in sessions), return_exceptions=True)
