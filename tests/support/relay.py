"""A TCP relay on a free loopback port, for network faults the tests make on purpose."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

from support.redis_server import RedisServer


class TcpRelay:
    """Relays every connection to `host:port`. `pause()` holds every byte in both directions (a
    network partition: nothing is refused, nothing arrives); `pause_after(marker)` pauses right after
    the next client bytes holding `marker` went through (a cut that falls between a command and its
    reply); `resume()` lets them on.

    With `close_idle_s` (s), a connection that has carried bytes and then sat idle that long is
    closed when the client's next bytes arrive, which are never forwarded: what a keep-alive
    server does when it closes an idle connection just as a request is sent on it."""

    def __init__(self, host: str, port: int, *, close_idle_s: float | None = None) -> None:
        self.target = (host, port)
        self.close_idle_s = close_idle_s
        self.closed_idle = 0  # connections closed by `close_idle_s`
        self._open = asyncio.Event()
        self._open.set()
        self._pause_marker: bytes | None = None
        self._server: asyncio.Server | None = None
        self._pipes: set[asyncio.Task[None]] = set()

    async def start(self) -> int:
        """Listen; returns the relay's port."""
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return int(self._server.sockets[0].getsockname()[1])

    def pause(self) -> None:
        self._open.clear()

    def pause_after(self, marker: bytes) -> None:
        """Pause once client bytes holding `marker` have been forwarded (a marker split across two
        reads is not seen)."""
        self._pause_marker = marker

    def resume(self) -> None:
        self._open.set()

    def cut(self) -> None:
        """Close every relayed connection now, dropping what a pause holds (the peers must connect
        again); new connections are still relayed."""
        for pipe in list(self._pipes):
            pipe.cancel()

    async def close(self) -> None:
        assert self._server is not None
        self._server.close()
        for pipe in self._pipes:
            pipe.cancel()
        await asyncio.gather(*self._pipes, return_exceptions=True)
        await self._server.wait_closed()

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        upstream_r, upstream_w = await asyncio.open_connection(*self.target)
        last = [0.0]  # monotonic time of the last byte either way; 0 before the first
        for reader, writer, other, outbound in (
            (client_r, upstream_w, client_w, True),
            (upstream_r, client_w, upstream_w, False),
        ):
            pipe = asyncio.get_running_loop().create_task(self._pipe(reader, writer, other, last, outbound))
            self._pipes.add(pipe)
            pipe.add_done_callback(self._pipes.discard)

    async def _pipe(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        other: asyncio.StreamWriter,
        last: list[float],
        outbound: bool,
    ) -> None:
        try:
            while data := await reader.read(65536):
                now = time.monotonic()
                idle = now - last[0] if last[0] else 0.0
                if outbound and self.close_idle_s is not None and idle > self.close_idle_s:
                    self.closed_idle += 1
                    other.close()
                    break
                last[0] = now
                await self._open.wait()
                writer.write(data)
                await writer.drain()
                if outbound and self._pause_marker is not None and self._pause_marker in data:
                    self._pause_marker = None
                    self.pause()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()


@contextlib.asynccontextmanager
async def relay_to(redis_server: RedisServer) -> AsyncIterator[tuple[TcpRelay, str]]:
    """A relay in front of `redis_server` for the block (pause it: a partition; cut it: a dropped
    link), and the Redis URL that goes through it."""
    host, port = redis_server.url.removeprefix("redis://").split("/")[0].split(":")
    relay = TcpRelay(host, int(port))
    relay_port = await relay.start()
    try:
        yield relay, redis_server.url.replace(f":{port}", f":{relay_port}")
    finally:
        await relay.close()
