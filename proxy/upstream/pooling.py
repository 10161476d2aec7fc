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
from multidict import CIMultiDict, CIMultiDictProxy

STREAM_DRAIN_S = 1.0  # how long (s) a reply stream may take to end after its response before its connection is closed
_DRAINS: set[asyncio.Task[None]] = set()
_NO_HEADERS: CIMultiDictProxy[str] = CIMultiDictProxy(CIMultiDict())


def shed_headers(resp: aiohttp.ClientResponse) -> None:
    """Let go of a reply's header maps once the caller has read what it needs from them (issue
    "Performance": a detached call holds its reply stream open for as long as the upstream works,
    and the parsed response headers, their raw bytes and the request's headers are ~3 KB of it).
    Afterwards `resp.headers` is empty; status, content, release and close work as before. Uses
    aiohttp's private `_headers`, `_raw_headers`, `_request_info` (checked in aiohttp 3.9-3.14);
    does nothing when they are not there."""
    if not hasattr(resp, "_raw_headers") or not isinstance(getattr(resp, "_request_info", None), aiohttp.RequestInfo):
        return
    info = resp._request_info
    resp._headers = _NO_HEADERS
    resp._raw_headers = ()
    resp._request_info = aiohttp.RequestInfo(info.url, info.method, _NO_HEADERS, info.real_url)


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
