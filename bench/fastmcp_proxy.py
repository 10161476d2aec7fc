"""FastMCP 4.x's proxy (`fastmcp.server.create_proxy`) in front of one legacy Streamable HTTP upstream.

    python bench/fastmcp_proxy.py UPSTREAM_URL --port P [--reuse-session]

Default: exactly what `create_proxy(url)` gives, except `mode="legacy"` because the upstream only speaks
the handshake era (FastMCP otherwise mirrors a 2026-07-28 front onto a 2026-07-28 backend, which a
pre-2026 server refuses). That default opens a fresh backend session (initialize) per request.
`--reuse-session` passes an already-connected Client instead (FastMCP's documented opt-in to share one
backend session for all requests).
"""

from __future__ import annotations

import argparse
import asyncio
import logging


async def main(url: str, port: int, reuse: bool) -> None:
    from fastmcp import Client
    from fastmcp.server import create_proxy

    logging.getLogger("fastmcp").setLevel(logging.WARNING)
    if reuse:
        client = Client(url, mode="legacy")
        async with client:
            proxy = create_proxy(client, name="bench-fastmcp-proxy")
            print(f"listening on http://127.0.0.1:{port}/mcp", flush=True)
            await proxy.run_http_async(
                show_banner=False, host="127.0.0.1", port=port, log_level="warning", path="/mcp"
            )
    else:
        proxy = create_proxy(url, mode="legacy", name="bench-fastmcp-proxy")
        print(f"listening on http://127.0.0.1:{port}/mcp", flush=True)
        await proxy.run_http_async(
            show_banner=False, host="127.0.0.1", port=port, log_level="warning", path="/mcp"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--reuse-session", action="store_true")
    a = parser.parse_args()
    try:
        asyncio.run(main(a.url, a.port, a.reuse_session))
    except KeyboardInterrupt:
        pass
