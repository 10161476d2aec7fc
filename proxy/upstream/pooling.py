"""Giving upstream connections back to aiohttp's pool (issue "Performance").

A Streamable HTTP reply stream (2025-11-25 transports, "Sending Messages to the Server") ends after
its JSON-RPC response, but the end of the body usually arrives just after the response event. A
reader that stops at the response and releases the reply makes aiohttp close the connection (the
body is unfinished), so the next request opens a new TCP connection. `drain_later` reads the rest
in the background instead and releases the connection to the pool.
"""

from __future__ import annotations

import asyncio
import gc

import aiohttp
from multidict import CIMultiDict, CIMultiDictProxy

# how long (s) a reply stream may take to end after its response before its connection is closed
STREAM_DRAIN_S = 1.0
_DRAINS: set[asyncio.Task[None]] = set()
_NO_HEADERS: CIMultiDictProxy[str] = CIMultiDictProxy(CIMultiDict())


def shed_headers(resp: aiohttp.ClientResponse) -> None:
    """Let go of a reply's header maps once the caller has read what it needs from them (issue
    "Performance": a detached call holds its reply stream open for as long as the upstream works,
    and the parsed response headers, their raw bytes and the request's headers are ~3 KB of it).
    Afterwards `resp.headers` is empty; status, content, release and close work as before. Uses
    aiohttp's private `_headers`, `_raw_headers`, `_request_info`, `_cache` (checked in aiohttp 3.9-3.14);
    does nothing when they are not there. The C response parser keeps its own lists of the
    message's header pairs (decoded and raw) until the next message on the connection begins
    (it then makes new lists): they are emptied in place (`_shed_parser_headers`)."""
    if not hasattr(resp, "_raw_headers") or not isinstance(
        getattr(resp, "_request_info", None), aiohttp.RequestInfo
    ):
        return
    info = resp._request_info
    resp._headers = _NO_HEADERS
    resp._raw_headers = ()
    resp._request_info = aiohttp.RequestInfo(info.url, info.method, _NO_HEADERS, info.real_url)
    cache = getattr(resp, "_cache", None)  # what was read of them is cached there (aiohttp's `reify`)
    if isinstance(cache, dict):
        for name in ("headers", "raw_headers", "request_info"):
            cache.pop(name, None)
    _shed_parser_headers(resp)


def _shed_parser_headers(resp: aiohttp.ClientResponse) -> None:
    """Empty the header-pair lists aiohttp's C parser (`_http_parser.pyx`, `HttpParser._headers`
    and `_raw_headers`) holds for a message whose body is still being read: ~1-2.5 KB per held
    reply stream, by the upstream's header count. Their attributes are not visible from Python, so
    they are found among the parser's references (lists of 2-tuples, nothing else it holds is);
    the parser only appends to them while a head is parsed and replaces them when the next message
    begins. The pure-Python parser keeps no such lists: nothing is found, nothing done."""
    parser = getattr(getattr(resp, "_protocol", None), "_parser", None)
    if parser is None or resp.content.is_eof():
        return
    for held in gc.get_referents(parser):
        if type(held) is list and held and all(type(pair) is tuple and len(pair) == 2 for pair in held):
            held.clear()


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
