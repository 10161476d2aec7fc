"""Reading and writing Server-Sent Events frames (WHATWG HTML "Server-sent events" §9.2).

Only what MCP's Streamable HTTP uses: `event`, `data` (multi-line), `id`, `retry`, comments.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass


@dataclass
class SseEvent:
    """One dispatched event: `event` name ("message" by default), joined `data`, last `id`, `retry` (ms)."""

    event: str
    data: str
    id: str | None
    retry: int | None


async def iter_events(chunks: AsyncIterator[bytes]) -> AsyncIterator[SseEvent]:
    """Turn a byte stream into SSE events. Lines may be of any length (a 5 MB `data:` line is fine)."""
    buffer = b""
    data: list[str] = []
    event = ""
    last_id: str | None = None
    retry: int | None = None
    async for chunk in chunks:
        buffer += chunk
        while True:
            cut = buffer.find(b"\n")
            if cut < 0:
                break
            raw, buffer = buffer[:cut], buffer[cut + 1 :]
            line = raw.rstrip(b"\r").decode("utf-8", errors="replace")
            if not line:
                if data or event:
                    yield SseEvent(event or "message", "\n".join(data), last_id, retry)
                data, event = [], ""
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
    return b"event: message\ndata: " + json.dumps(message, separators=(",", ":")).encode() + b"\n\n"


KEEPALIVE = b": keepalive\n\n"
