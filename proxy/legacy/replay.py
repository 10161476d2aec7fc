"""The proxy's own SSE streams toward legacy clients: event ids, a bounded replay buffer, keepalives.

Every SSE stream the proxy serves a legacy client (a POST's reply stream, the session's standalone
GET stream), whatever the upstream, is a `RelayStream`. Events get ids of the proxy's own,
`<token>:<seq>` (opaque to the client; `token` is random and names one stream of one client
session), whatever ids the upstream used. The last events are kept (bounded by count and bytes) so
a client that lost its connection resumes with `GET` + `Last-Event-ID` (2025-11-25 basic/transports
"Resumability and Redelivery"): the proxy replays that stream's later events and then continues
live, whether or not the upstream keeps events itself. A stream is fed by a pump task (the upstream
side) that does not depend on the client's connection.
"""

from __future__ import annotations

import asyncio
import functools
import re
import secrets
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

import structlog

from proxy.protocol import jsonrpc
from proxy.protocol.jsonrpc import JsonObject
from proxy.protocol.sse import KEEPALIVE, SseEvent, encode_event, encode_message
from proxy.runtime import metrics

EVENT_SEQ = re.compile(r"[1-9][0-9]{0,17}")  # ASCII digits only (str.isdigit takes any script's)
DEFAULT_REPLAY_EVENTS = 256
DEFAULT_REPLAY_BYTES = 1 << 20

log = structlog.get_logger("proxy.legacy")

# A writer's own write into its client connection, called from the pump's task: whether the frame
# went out; False (nothing written) when that could have waited for the client (`proxy.runtime.flow`).
Direct = Callable[[bytes], Awaitable[bool]]


class RelayStream:
    """One SSE stream toward a legacy client: numbered events, the last ones kept for replay.

    `kind` is "post" (a request's reply) or "get" (the standalone stream); `server` names the
    upstream (logs, metrics). `max_events` and
    `max_bytes` bound what is kept (older events are dropped first). `closed` turns True once the
    stream has said everything (its response, or its error); `cuts` counts the times the proxy
    dropped the client's connection on purpose (SSE polling, SEP-1699) so the client reconnects
    with `Last-Event-ID`. `json_only` marks a reply whose client takes no SSE (it gets the answer
    alone). `ended` is why the proxy gave up on the stream before its answer (`abandon`).
    """

    def __init__(
        self,
        *,
        kind: str,
        server: str = "",
        max_events: int = DEFAULT_REPLAY_EVENTS,
        max_bytes: int = DEFAULT_REPLAY_BYTES,
        json_only: bool = False,
    ) -> None:
        self.kind = kind
        self.server = server  # the upstream it relays (logs and metrics)
        self.token = secrets.token_urlsafe(12)
        self.max_events = max(1, max_events)
        self.max_bytes = max(1024, max_bytes)
        self._seq = 0
        self._events: deque[tuple[int, bytes]] = deque()
        self._bytes = 0
        self.closed = False
        self.cuts = 0
        self.owner = 0  # the ticket of the client connection that has the stream (the newest one)
        self.attached = 0  # client connections writing this stream now
        self.idle_since = asyncio.get_running_loop().time()
        self.pump: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self.last_data: str | None = None  # the data of the newest event (a reply's answer once closed)
        self.json_only = json_only
        self.ended: tuple[int, str] | None = None  # (JSON-RPC code, message) of `abandon`
        self._direct: Direct | None = None  # the waiting writer's own write (see `frames`)
        self._delivered = 0  # the newest event `push` wrote through `_direct`

    def event_id(self, seq: int) -> str:
        """The opaque id of event `seq` of this stream."""
        return f"{self.token}:{seq}"

    @property
    def last_seq(self) -> int:
        """The number of the newest event (0 before the first)."""
        return self._seq

    def append(self, event: SseEvent) -> None:
        """Number `event` (its upstream id is replaced), keep it, wake the writers. Ignored once closed."""
        if self._keep(event) is not None:
            self._signal()

    async def push(self, event: SseEvent) -> None:
        """`append` from the task that feeds the stream (its pump): when the connection that has
        the stream sent everything before and waits for more, the pump writes the frame into it
        itself, if that cannot wait for the client (`Direct`, registered by `frames`), and wakes
        nobody; else the writer is woken as by `append`. The frame is kept for replay either way."""
        frame = self._keep(event)
        if frame is None:
            return
        seq, direct = self._seq, self._direct
        if direct is not None and await direct(frame):
            self._delivered = max(self._delivered, seq)
            return
        self._signal()

    async def push_message(self, message: JsonObject) -> None:
        """`push` one JSON-RPC message as a `message` event."""
        await self.push(SseEvent("message", jsonrpc.dumps_str(message), None, None))

    def _keep(self, event: SseEvent) -> bytes | None:
        """Number `event`, keep its frame (dropping the oldest past the bounds) and return it; None
        once closed."""
        if self.closed:
            return None
        self._seq += 1
        frame = encode_event(SseEvent(event.event, event.data, self.event_id(self._seq), event.retry))
        self._events.append((self._seq, frame))
        self.last_data = event.data
        self._bytes += len(frame)
        while len(self._events) > 1 and (len(self._events) > self.max_events or self._bytes > self.max_bytes):
            _, dropped = self._events.popleft()
            self._bytes -= len(dropped)
        return frame

    def feed(self, pump: Coroutine[Any, Any, None], name: str) -> None:
        """Start `pump`, the task that feeds this stream from the upstream side (`name` names it);
        it runs whatever the client's connection does, until it ends or the stream is abandoned."""
        self.pump = asyncio.get_running_loop().create_task(pump, name=name)

    def append_message(self, message: JsonObject) -> None:
        """Append one JSON-RPC message as a `message` event."""
        self.append(SseEvent("message", jsonrpc.dumps_str(message), None, None))

    def close(self) -> None:
        """Nothing more will be appended; writers end once they sent everything. A stream no
        client reads is idle from now on (its LINGER_S for resumption starts)."""
        self.closed = True
        if not self.attached:
            self.idle_since = asyncio.get_running_loop().time()
        self._signal()

    def abandon(self, code: int, message: str) -> None:
        """Give the stream up before its answer: its pump stops, and a reply still waiting gets a
        JSON-RPC error with `code` and `message` (the pump writes it on its way out, it knows the
        client's id); then the stream closes."""
        self.ended = (code, message)
        if self.pump is not None and not self.pump.done():
            self.pump.add_done_callback(functools.partial(_close_after, self))  # whatever the pump did last
            self.pump.cancel()
        else:
            self.close()

    def reopen(self) -> None:
        """A closed standalone GET stream goes on (a new pump feeds it); numbering continues."""
        self.closed = False

    def cut(self) -> None:
        """Drop the attached client connections (the stream goes on; clients resume with Last-Event-ID)."""
        self.cuts += 1
        self._signal()

    def take_over(self) -> int:
        """A new client connection takes the stream: the one writing it so far ends (a message is
        never sent on two connections, 2025-11-25 transports). Returns the new connection's ticket."""
        self.owner += 1
        self._signal()
        return self.owner

    def _signal(self) -> None:
        """Wake the writers; a direct write stays off until its writer has caught up and waits again."""
        self._direct = None
        self._wake.set()
        self._wake = asyncio.Event()

    async def changed(self, timeout_s: float) -> None:
        """Wait (at most `timeout_s`, s) until something is appended, or the stream closes or is cut."""
        wake = self._wake
        if self.closed:
            return
        try:
            async with asyncio.timeout(timeout_s):
                await wake.wait()
        except TimeoutError:
            pass

    def gap_notice(self, after: int, lost: int, why: str) -> JsonObject:
        """The `notifications/message` (level `error`, logger `mcp-tasks-proxy`) sent in place of
        events `after`+1 to `after`+`lost`, which left the replay buffer (`max_events`, `max_bytes`)
        before they were sent; `why` says when (before a resumption; while the client read too
        slowly). Logged (`legacy_replay_gap`) and counted (`LEGACY_REPLAY_GAPS`) here."""
        log.warning("legacy_replay_gap", server=self.server, lost_events=lost, reason=f"dropped {why}")
        metrics.LEGACY_REPLAY_GAPS.labels(self.server).inc()
        text = (
            f"{lost} event(s) after event {self.event_id(after)} were dropped from the proxy's replay buffer "
            f"{why} (it keeps the last {self.max_events} events and {self.max_bytes} bytes of a stream); "
            f"what they carried cannot be delivered"
        )
        data = {
            "error": "replay_gap",
            "message": text,
            "lostEvents": lost,
            "firstLost": self.event_id(after + 1),
        }
        return jsonrpc.notification(
            "notifications/message", {"level": "error", "logger": "mcp-tasks-proxy", "data": data}
        )

    def replay_from(self, seq: int) -> tuple[int, bool]:
        """Where a resumption after event `seq` starts: (first kept seq to send, whether events
        between were already dropped from the buffer)."""
        first = self._events[0][0] if self._events else self._seq + 1
        return max(seq + 1, first), seq + 1 < first

    async def frames(
        self,
        after: int,
        keepalive_s: float,
        ticket: int | None = None,
        direct: Direct | None = None,
        cuts: int | None = None,
    ) -> AsyncIterator[bytes]:
        """The frames after event `after`, then live ones as they come, with `KEEPALIVE` after
        each `keepalive_s` (s) of waiting; ends once the stream is closed and everything was
        yielded, when the stream is cut, or (with a `ticket` from `take_over`) as soon as another
        connection took the stream over. With `direct` (the same connection's write that never
        waits) and a `ticket`, while it waits with everything sent, the pump writes new events
        itself (`push`): they are not yielded again, and its keepalive comes each `keepalive_s`
        chatty or not. (Without a ticket `direct` is not used: what `push` wrote directly is
        counted per stream, so only the one connection that has the stream may take it.) `cuts`
        is the stream's `cuts` when its reply began (default: now): a cut since then ends these
        frames too, once the events before it went out."""
        cuts = self.cuts if cuts is None else cuts
        sent = after
        if ticket is None:
            direct = None
        while True:
            wake = self._wake
            # The events after `sent`, read from the newest end (seqs only grow along the buffer):
            # a writer that keeps up touches only what is new, not the whole replay buffer.
            pending: list[tuple[int, bytes]] = []
            for event in reversed(self._events):
                if event[0] <= sent:
                    break
                pending.append(event)
            pending.reverse()
            if pending:
                if pending[0][0] > sent + 1:  # its client read too slowly: never a silent gap
                    why = "before this connection could send them (its client read too slowly)"
                    yield encode_message(self.gap_notice(sent, pending[0][0] - 1 - sent, why))
                for seq, frame in pending:
                    if ticket is not None and ticket != self.owner:
                        return
                    yield frame
                    sent = seq
                continue
            if self.closed or self.cuts != cuts or (ticket is not None and ticket != self.owner):
                return
            if direct is not None:
                self._direct = direct  # until the next `_signal`
                self._delivered = sent
            try:
                async with asyncio.timeout(keepalive_s):
                    await wake.wait()
            except TimeoutError:
                yield KEEPALIVE
            finally:
                if direct is not None:
                    if self._direct is direct:
                        self._direct = None
                    sent = max(sent, self._delivered)


def _close_after(stream: RelayStream, _task: asyncio.Future[None]) -> None:
    stream.close()


def parse_event_id(value: str | None) -> tuple[str, int] | None:
    """(stream token, seq) from a `Last-Event-ID` the proxy minted; None when it is not one."""
    if not value:
        return None
    token, _, seq = value.strip().rpartition(":")
    if not token or not EVENT_SEQ.fullmatch(seq):  # the form event_id mints: no 0, no leading zero
        return None
    return token, int(seq)
