"""Guards before any handler: which `Host` and `Origin` values the proxy answers (DNS rebinding),
and what an `Expect` header may ask."""

from __future__ import annotations

import functools
import ipaddress
from urllib.parse import urlsplit

from aiohttp import HttpVersion11, web

from proxy.console.access import error as console_error
from proxy.protocol import jsonrpc
from proxy.protocol.jsonrpc import INVALID_REQUEST, JsonRpcError


def _json_error(exc: JsonRpcError, status: int) -> web.Response:
    return web.json_response(
        jsonrpc.error_response(None, exc.to_error()), status=status, dumps=jsonrpc.dumps_str
    )


@functools.lru_cache(maxsize=256)  # a handful of distinct values in practice; parsing each request cost ~3 µs
def _host_name(value: str) -> str | None:
    """The host of a `Host` or `Origin` value, lower case; None when it cannot be parsed."""
    try:
        host = urlsplit(value if "//" in value else f"//{value}").hostname or ""
    except ValueError:  # `[::1` and other broken IPv6 literals
        return None
    return host.lower()


def host_guard(allowed: set[str] | None, console_prefix: str | None = None):
    """Middleware factory: reject a `Host` or `Origin` outside `allowed` with 403 (DNS-rebinding guard),
    a value that is no host with 400: a JSON-RPC error, or under `console_prefix` the console's own
    error shape (`{"error": {"status", "message"}}`).

    `allowed` None accepts any host.
    """

    def refusal(request: web.Request, message: str, status: int) -> web.Response:
        path = request.path
        if console_prefix is not None and (path == console_prefix or path.startswith(console_prefix + "/")):
            return console_error(status, message)
        return _json_error(JsonRpcError(INVALID_REQUEST, message), status=status)

    @web.middleware
    async def middleware(request: web.Request, handler):
        if allowed is not None:
            for header in ("Host", "Origin"):
                value = request.headers.get(header)
                if not value:
                    continue
                host = _host_name(value)
                if host is None:
                    return refusal(request, f"{header} {value[:200]!r} is not a valid host", 400)
                if host not in allowed:  # `Origin: null` (sandboxed pages) too
                    return refusal(request, f"{header} {value[:200]!r} is not allowed here", 403)
        return await handler(request)

    return middleware


def default_allowed_hosts(listen_host: str, public_url: str | None = None) -> set[str] | None:
    """Localhost names when bound to loopback (and the host of `public_url`, the name a fronting
    reverse proxy passes on), else None (any host)."""
    try:
        loopback = listen_host == "localhost" or ipaddress.ip_address(listen_host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        return None
    names = {"localhost", "127.0.0.1", "::1", "[::1]"}
    public_host = urlsplit(public_url).hostname if public_url else None
    return names | {public_host} if public_host else names


async def expect_continue(request: web.Request) -> web.StreamResponse | None:
    """The `Expect` handler of every route (aiohttp runs it before the middlewares): `100-continue`
    is answered as aiohttp does; any other value gets HTTP 417 with a JSON-RPC error that does not
    repeat the value (aiohttp's own answer quoted it, and bytes that are not UTF-8 made it a 500)."""
    if request.version != HttpVersion11:
        return None
    if request.headers.get("Expect", "").lower() == "100-continue":
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # the body proper has not started
        return None
    return _json_error(JsonRpcError(INVALID_REQUEST, "the only Expect value served is 100-continue"), 417)
