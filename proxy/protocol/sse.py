"""Reading and writing Server-Sent Events frames (WHATWG HTML "Server-sent events" §9.2).

Only what MCP's Streamable HTTP uses: `event`, `data` (multi-line), `id`, `retry`, comments.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from proxy.protocol import jsonrpc

# The response headers of every SSE stream the proxy serves: no cache may keep it, and no buffering
# reverse proxy (nginx's X-Accel-Buffering) may hold its events back.
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass
class SseEvent:
    """One dispatched event: `event` name ("message" by default), joined `data`, last `id`, `retry` (ms)."""

    event: str
    data: str
    id: str | None
    retry: int | None


class EventTooLargeError(ValueError):
    """An SSE event grew past the size limit given to `iter_events` (bytes)."""


class SseParser:
    """Incremental SSE parser: `feed(chunk)` returns the events that chunk completed, `end()` the
    last one when the stream ends without a blank line. Lines may be of any length.

    With `max_event_bytes`, an event (its lines, buffered) larger than that many bytes raises
    EventTooLargeError from `feed`, after the events the same chunk completed were handed out
    (`pending_error`, raised by the caller once it has used them)."""

    __slots__ = ("_buffer", "_data", "_size", "_event", "_last_id", "_retry", "max_event_bytes")

    def __init__(self, max_event_bytes: int | None = None) -> None:
        self._buffer = bytearray()
        self._data: list[str] = []
        self._size = 0
        self._event = ""
        self._last_id: str | None = None
        self._retry: int | None = None
        self.max_event_bytes = max_event_bytes

    def feed(self, chunk: bytes) -> tuple[list[SseEvent], EventTooLargeError | None]:
        """The events `chunk` completes, and the error to raise after them (an event grew too large).

        A chunk with no line end is only buffered (a long line costs its length once, not once per
        chunk); one with line ends is split once, the buffered start joined to its first line."""
        out: list[SseEvent] = []
        buffer = self._buffer
        if b"\n" not in chunk:
            buffer += chunk
        else:
            lines = chunk.split(b"\n")
            tail = lines.pop()  # what follows the last line end (b"" when the chunk ends with one)
            if buffer:
                lines[0] = bytes(buffer) + lines[0]
                buffer.clear()
            buffer += tail
            for raw in lines:
                self._size += len(raw) + 1
                if raw.endswith(b"\r"):
                    raw = raw.rstrip(b"\r")
                if not raw:
                    if self._data or self._event:
                        out.append(self._event_so_far())
                    self._data, self._event, self._size = [], "", 0
                    continue
                field, _, value = raw.partition(b":")
                if value[:1] == b" ":
                    value = value[1:]
                if field == b"data":
                    self._data.append(value.decode("utf-8", errors="replace"))
                elif field == b"event":
                    self._event = value.decode("utf-8", errors="replace")
                elif field == b"id":
                    self._last_id = value.decode("utf-8", errors="replace")
                elif field == b"retry" and value.isdigit() and len(value) <= 10:  # ms; no absurd ints
                    self._retry = int(value)
        if self.max_event_bytes is not None and self._size + len(buffer) > self.max_event_bytes:
            return out, EventTooLargeError(f"an SSE event is larger than {self.max_event_bytes} bytes")
        return out, None

    @property
    def mid_event(self) -> bool:
        """True when the bytes fed so far stop inside a line or an event (no blank line after it yet)."""
        return self._size > 0 or bool(self._buffer)

    def end(self) -> list[SseEvent]:
        """The event left unterminated when the stream ended (if it has data)."""
        return [self._event_so_far()] if self._data else []

    def _event_so_far(self) -> SseEvent:
        return SseEvent(self._event or "message", "\n".join(self._data), self._last_id, self._retry)


async def iter_events(
    chunks: AsyncIterator[bytes], *, max_event_bytes: int | None = None
) -> AsyncIterator[SseEvent]:
    """Turn a byte stream into SSE events. Lines may be of any length (a 5 MB `data:` line is fine).

    With `max_event_bytes`, an event (its lines, buffered) larger than that many bytes raises
    EventTooLargeError before it is held in memory in full.
    """
    parser = SseParser(max_event_bytes)
    async for chunk in chunks:
        events, error = parser.feed(chunk)
        for event in events:
            yield event
        if error is not None:
            raise error
    for event in parser.end():
        yield event


class ReaderEvents:
    """`iter_events` over `reader.readany()` (an aiohttp StreamReader) as a plain async iterator:
    no async generator and no chunk iterator stay alive per open stream (issue "Performance": a
    detached call holds its reply stream for as long as the upstream works)."""

    __slots__ = ("_reader", "_parser", "_ready", "_error", "_ended")

    def __init__(self, reader: Any, *, max_event_bytes: int | None = None) -> None:
        self._reader = reader
        self._parser = SseParser(max_event_bytes)
        self._ready: list[SseEvent] = []
        self._error: EventTooLargeError | None = None
        self._ended = False

    def __aiter__(self) -> ReaderEvents:
        return self

    async def __anext__(self) -> SseEvent:
        while not self._ready:
            if self._error is not None:
                raise self._error
            if self._ended:
                raise StopAsyncIteration
            chunk = await self._reader.readany()
            if chunk:
                events, self._error = self._parser.feed(chunk)
            else:
                events, self._ended = self._parser.end(), True
            self._ready = events[::-1]
        return self._ready.pop()


def encode_event(event: SseEvent) -> bytes:
    """Serialize an event again (name, id and retry kept; multi-line data split into lines)."""
    out = []
    if event.event != "message":
        out.append(f"event: {event.event}")
    else:
        out.append("event: message")
    if event.id is not None:
        out.append(f"id: {event.id}")
    if event.retry is not None:
        out.append(f"retry: {event.retry}")
    out.extend(f"data: {line}" for line in event.data.split("\n"))
    return ("\n".join(out) + "\n\n").encode()


def encode_message(message: dict) -> bytes:
    """One SSE `message` event carrying a JSON-RPC message."""
    return b"event: message\ndata: " + jsonrpc.dumps(message) + b"\n\n"


KEEPALIVE = b": keepalive\n\n"
