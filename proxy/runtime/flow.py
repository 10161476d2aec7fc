"""Writing into a client's SSE stream from another task without ever waiting for that client.

A relay that reads an upstream may hand one event straight to the client's connection (no
hand-over to the task serving the client) only when the write cannot suspend: aiohttp's
`StreamResponse.write` puts the bytes into the transport at once and then waits for the
connection to drain only while the transport is paused for its client. A transport pauses above
its high-water mark (64 KiB on asyncio) and stays paused until its buffer falls to its low-water
mark (16 KiB on asyncio, 16 bytes on uvloop), so the write is taken only into a connection that
is not paused and keeps its buffer under `ROOM_BYTES` with the frame. Then a writer cancelled
meanwhile cannot leave aiohttp's drain waiter, shared by every writer of that connection,
cancelled, and a slow client never holds up the relay.
"""

from __future__ import annotations

from aiohttp import web

# The most a direct write may leave in a connection's write buffer (bytes): under the transports'
# high-water mark (64 KiB), so a write into a connection not paused for its client cannot pause it.
ROOM_BYTES = 32 * 1024


async def write_without_waiting(request: web.Request, response: web.StreamResponse, frame: bytes) -> bool:
    """Write `frame` (bytes of whole SSE events) into the prepared `response` of `request` when the
    write cannot wait for the client (see the module docstring); whether it was written. False,
    with nothing written, when the connection is closing or gone, paused for its client, or would
    hold more than ROOM_BYTES; also when the write fails (nothing raised: the caller, which may be
    an upstream reader serving other requests, hands the frame to the response's own writer)."""
    transport = request.transport
    if transport is None or transport.is_closing() or request.protocol.writing_paused:
        return False
    if transport.get_write_buffer_size() + len(frame) > ROOM_BYTES:
        return False
    try:
        await response.write(frame)  # never suspends past the checks above (no drain to wait for)
    except Exception:  # closing, ended meanwhile, or anything else: its own writer's to tell
        return False
    return True
