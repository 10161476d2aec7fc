"""The project's legacy fixture server (tests/fixtures/legacy_server.py: official `mcp` SDK, Streamable
HTTP, stateful sessions, SSE replies; tools `greet`, `slow_compute`, ...) served for the benchmark.

Same app, same CLI, one difference: accepted connections get TCP_NODELAY. The fixture creates its
listening socket itself with `socket.socket(AF_INET, SOCK_STREAM)` (proto 0), and asyncio only sets
TCP_NODELAY on sockets whose proto is IPPROTO_TCP (`asyncio.base_events._set_nodelay`). Without it,
the SSE reply (headers, then the event) meets Nagle + the client's delayed ACK and every keep-alive
request takes ~44 ms whatever the load, so section (a) would measure that timer rather than the code
under test. A server started the usual way (uvicorn binding host/port itself) has TCP_NODELAY, so this
is also the more realistic upstream. Patching asyncio's helper (rather than the fixture's bind code)
keeps this working while the fixture's serving code changes.

    python bench/sdk_upstream.py --port 0      # prints `listening on http://127.0.0.1:PORT/mcp`
    python bench/sdk_upstream.py --stdio       # unchanged
"""

from __future__ import annotations

import asyncio.base_events
import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _set_nodelay(sock: socket.socket) -> None:
    if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


asyncio.base_events._set_nodelay = _set_nodelay

from tests.fixtures import legacy_server  # noqa: E402  (after the patch above: the fixture must bind with it)

if __name__ == "__main__":
    legacy_server.main()
