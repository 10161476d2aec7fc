"""Reading and writing Server-Sent Events frames (WHATWG HTML "Server-sent events" §9.2).

Only what MCP's Streamable HTTP uses: `event`, `data` (multi-line), `id`, `retry`, comments.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from ..protocol import jsonrpc


@dataclass
class SseEvent:
    """One dispatched event: `event` name ("message" by default), joined `data`, last `id`, `retry` (ms)."""

    event: str
    data: str
    id: str | None
    retry: int | None


class EventTooLargeError(ValueError):
    """An SSE event grew past the size limit given to `iter_events` (bytes)."""


async def iter_events(chunks: AsyncIterator[bytes], *, max_event_bytes: int | None = None) -> AsyncIterator[SseEvent]:
    """Turn a byte stream into SSE events. Lines may be of any length (a 5 MB `data:` line is fine).

    With `max_event_bytes`, an event (its lines, buffered) larger than that many bytes raises
    EventTooLargeError before it is held in memory in full.
    """
    buffer = bytearray()
    data: list[str] = []
    size = 0
    event = ""
    last_id: str | None = None
    retry: int | None = None
    async for chunk in chunks:
        start = len(buffer)
        buffer += chunk
        cut = buffer.find(b"\n", start)
        while cut >= 0:
            raw = bytes(buffer[:cut])
            del buffer[: cut + 1]
            cut = buffer.find(b"\n")
            line = raw.rstrip(b"\r").decode("utf-8", errors="replace")
            size += len(raw) + 1
            if not line:
                if data or event:
                    yield SseEvent(event or "message", "\n".join(data), last_id, retry)
                data, event, size = [], "", 0
                continue
            if line.startswith(":"):
                continue
            field, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if field == "data":
                data.append(value)
            elif field == "event":
                event = value
            elif field == "id":
                last_id = value
            elif field == "retry" and value.isdigit():
                retry = int(value)
        if max_event_bytes is not None and size + len(buffer) > max_event_bytes:
            raise EventTooLargeError(f"an SSE event is larger than {max_event_bytes} bytes")
    if data:
        yield SseEvent(event or "message", "\n".join(data), last_id, retry)


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
