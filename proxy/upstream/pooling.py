"""Giving upstream connections back to aiohttp's pool (issue "Performance").

A Streamable HTTP reply stream (2025-11-25 transports, "Sending Messages to the Server") ends after
its JSON-RPC response, but the end of the body usually arrives just after the response event. A
reader that stops at the response and releases the reply makes aiohttp close the connection (the
body is unfinished), so the next request opens a new TCP connection. `drain_later` reads the rest
in the background instead and releases the connection to the pool.
"""

from __future__ import annotations

import asyncio

import aiohttp

STREAM_DRAIN_S = 1.0  # how long (s) a reply stream may take to end after its response before its connection is closed
_DRAINS: set[asyncio.Task[None]] = set()


def drain_later(resp: aiohttp.ClientResponse) -> bool:
    """Read the rest of a reply stream whose response has arrived in the background, so its
    connection goes back to the pool instead of being closed (the server ends the stream right
    after the response, but the end usually arrives a moment later). Bounded by STREAM_DRAIN_S.
    Returns False when the stream already ended (the caller releases it)."""
    if resp.content.is_eof():
        return False
    task = asyncio.get_running_loop().create_task(_drain(resp))
    _DRAINS.add(task)
    task.add_done_callback(_DRAINS.discard)
    return True


async def _drain(resp: aiohttp.ClientResponse) -> None:
    ended = False
    try:
        async with asyncio.timeout(STREAM_DRAIN_S):
            while await resp.content.readany():
                pass
        ended = True
    except (TimeoutError, aiohttp.ClientError, OSError):
        pass
    finally:
        if ended:
            resp.release()  # back to the pool
        else:
            resp.close()
