"""The child processes of one configured stdio server (see `stdio.py` for one child)."""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog
from tenacity import (
    AsyncRetrying,
    retry_if_exception_type,
    stop_after_attempt,
    stop_after_delay,
    wait_exponential,
)

from proxy.protocol.jsonrpc import JsonObject
from proxy.runtime import metrics
from proxy.upstream.stdio import StdioCommand, StdioSession
from proxy.upstream.types import Bounds, RecentFailure, UpstreamError, UpstreamTimeoutError, caps_key, probe

log = structlog.get_logger("proxy.upstream.stdio")


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
    failed: RecentFailure = field(default_factory=RecentFailure)  # the last failed start


class StdioPool:
    """The child processes of one configured stdio server.

    `instances` children per key (least-loaded wins), restarted as soon as one exits (after a
    backoff when it exits quickly again), `max_concurrency` requests in flight across the server,
    `per_principal` gives each principal its own children, `idle_timeout` (s) stops a child nobody
    used for that long, `max_restarts` quick exits in a row make a crash loop that is refused for
    `crash_cooloff` (s). A child that ran less than `stable_after` (s) exited "quickly".
    `max_children` caps the children running at once across keys (an idle one is stopped to make
    room; when all are busy the request is refused); `bounds` are the waits and sizes of each child;
    `on_notification` receives the server-wide notifications (list changes) of every child.
    Every start, failed start, exit and crash loop is logged and counted
    (`mcp_tasks_proxy_upstream_processes_total`).
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
        bounds: Bounds | None = None,
        max_children: int | None = None,
        on_notification: Callable[[JsonObject], None] | None = None,
    ) -> None:
        self.bounds = bounds or Bounds(init_timeout=init_timeout)
        self.max_children = max_children
        self._reserved = 0  # places under max_children taken by children being started
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
        self.on_notification = on_notification  # server-wide notifications (list changes)
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
        metrics.UPSTREAM_PROCESSES.labels(self.server, "exited").inc()
        if slot.quick_exits >= self.max_restarts:
            metrics.UPSTREAM_PROCESSES.labels(self.server, "crash_loop").inc()
            log.error(
                "upstream_crash_loop",
                server=self.server,
                quick_exits=slot.quick_exits,
                last_status=session.exit_status,
                cooloff_s=self.crash_cooloff,
            )
        if slot.quick_exits < self.max_restarts and not self._closing:
            # Restart it now (after the backoff `session()` applies), so the next request finds it running.
            # (a context of its own, as the child's readers: no request's log fields)
            task = asyncio.get_running_loop().create_task(self._restart(slot), context=contextvars.Context())
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
            if (
                slot.quick_exits >= self.max_restarts
                and time.monotonic() - slot.last_exit < self.crash_cooloff
            ):
                return (
                    f"upstream {self.server} is in a crash loop: it exited {slot.quick_exits} times in a row "
                    f"soon after starting "
                    f"(last exit status {slot.last_status}); next try in "
                    f"{self.crash_cooloff - (time.monotonic() - slot.last_exit):.0f} s"
                )
        return None

    async def session(self, capabilities: JsonObject, principal: str | None = None) -> StdioSession:
        """A running child for this key: the least loaded, or a new one (after a backoff when the last
        one died quickly). A failed start answers the callers that come (or waited for it) within as
        long again as it took, with its error at once, so callers never queue one start after
        another. Raises UpstreamError when it cannot start or while in a crash loop."""
        self._ensure_reaper()
        slot = self._slots.setdefault(
            self._key(capabilities, principal), _Slot(capabilities=dict(capabilities), principal=principal)
        )
        live = [s for s in slot.sessions if s.usable]
        if len(live) >= self.instances:
            return _touch(min(live, key=lambda s: s.in_flight))
        async with slot.lock:
            live = [s for s in slot.sessions if s.usable]
            if len(live) >= self.instances:
                return _touch(min(live, key=lambda s: s.in_flight))
            if slot.quick_exits >= self.max_restarts:
                if time.monotonic() - slot.last_exit < self.crash_cooloff:
                    raise UpstreamError(self.crash_loop() or f"upstream {self.server} is in a crash loop")
                slot.quick_exits = self.max_restarts - 1  # cool-off over: allow one more try
            slot.failed.check()
            if slot.quick_exits:  # back off after quick exits: 0.1 s, 0.2 s, 0.4 s, … up to 10 s
                wait = min(10.0, 0.1 * 2 ** (slot.quick_exits - 1)) - (time.monotonic() - slot.last_exit)
                if wait > 0:
                    await asyncio.sleep(wait)
            reserved = await self._make_room()
            started = time.monotonic()
            try:
                session = await self._start(slot, capabilities)
            except UpstreamError as exc:
                slot.failed.failed(started, str(exc), timed_out=isinstance(exc, UpstreamTimeoutError))
                raise
            finally:
                self._reserved -= reserved
            slot.failed.clear()
            return _touch(session)

    async def _make_room(self) -> int:
        """Keep the running children under `max_children`: reserve room for one more (returns the
        number of places reserved, 0 or 1), stopping the least recently used idle child if needed.
        Raises UpstreamError when every child is busy. Deciding and reserving happen without an
        await, so concurrent starts never overshoot the cap."""
        if self.max_children is None:
            return 0
        running = [(s, slot) for slot in self._slots.values() for s in slot.sessions if s.usable]
        if len(running) + self._reserved < self.max_children:
            self._reserved += 1
            return 1
        idle = [(s, slot) for s, slot in running if s.in_flight == 0]
        if not idle:
            metrics.LIMIT_REJECTIONS.labels("max_children").inc()
            raise UpstreamError(
                f"upstream {self.server} already runs max_children ({self.max_children}) children, all busy; "
                f"try again later"
            )
        victim, owner = min(idle, key=lambda pair: pair[0].last_used)
        owner.sessions.remove(victim)
        self._reserved += 1
        log.info("upstream_idle_stop", server=self.server, reason="max_children")
        await victim.close()
        return 1

    async def _start(self, slot: _Slot, capabilities: JsonObject) -> StdioSession:
        session: StdioSession | None = None
        async for attempt in AsyncRetrying(
            # three tries, but none started after init_timeout: a caller waits about that long at most
            stop=stop_after_attempt(3) | stop_after_delay(self.init_timeout),
            wait=wait_exponential(multiplier=0.1, max=2),
            retry=retry_if_exception_type(UpstreamError),
            reraise=True,
        ):
            with attempt:
                session = StdioSession(
                    self.server,
                    self.command,
                    capabilities=capabilities,
                    limit=self.limit,
                    init_timeout=self.init_timeout,
                    bounds=self.bounds,
                    on_notification=self.on_notification,
                    single_owner=self.per_principal,
                )
                try:
                    self._starting.add(session)
                    await session.open()
                except UpstreamError as exc:
                    slot.quick_exits += 1
                    slot.last_exit = time.monotonic()
                    slot.last_status = session.proc.returncode if session.proc else None
                    metrics.UPSTREAM_PROCESSES.labels(self.server, "start_failed").inc()
                    log.warning(
                        "upstream_start_failed",
                        server=self.server,
                        command=self.command.command,
                        reason=str(exc),
                        attempt=attempt.retry_state.attempt_number,
                        quick_exits=slot.quick_exits,
                    )
                    if slot.quick_exits == self.max_restarts:
                        metrics.UPSTREAM_PROCESSES.labels(self.server, "crash_loop").inc()
                        log.error(
                            "upstream_crash_loop",
                            server=self.server,
                            quick_exits=slot.quick_exits,
                            last_status=slot.last_status,
                            cooloff_s=self.crash_cooloff,
                        )
                    raise
                finally:
                    self._starting.discard(session)
        assert session is not None
        metrics.UPSTREAM_PROCESSES.labels(self.server, "started").inc()
        log.info(
            "upstream_started",
            server=self.server,
            pid=session.proc.pid if session.proc else None,
            per_principal=self.per_principal,
        )
        slot.sessions.append(session)
        watcher = asyncio.get_running_loop().create_task(session.exited.wait(), context=contextvars.Context())

        def exited(_task: asyncio.Task[Any], child: StdioSession = session) -> None:
            self._note_exit(slot, child)

        watcher.add_done_callback(exited, context=contextvars.Context())
        return session

    def discard(self, session: Any) -> None:
        """Nothing to do for stdio: a dead child is noticed by its exit."""

    async def check(self, timeout_s: float = 5.0) -> str | None:
        """None when a child without optional capabilities runs (starting one if needed), else why not."""
        return self.crash_loop() or await probe(self, timeout_s)

    def _ensure_reaper(self) -> None:
        if self.idle_timeout and (self._reaper is None or self._reaper.done()):
            self._reaper = asyncio.get_running_loop().create_task(
                self._reap_idle(), context=contextvars.Context()
            )

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
        return [
            s.proc.pid
            for slot in self._slots.values()
            for s in slot.sessions
            if s.proc is not None and s.proc.returncode is None
        ]

    async def cancel_elsewhere(self, ref: JsonObject, reason: str) -> bool:
        """See `Pool.cancel_elsewhere`: never possible here (a child dies with the process that
        started it, and its requests with it)."""
        return False

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
