"""Slow, malformed and vanishing clients: every one gets a bounded 4xx JSON-RPC answer (or a closed
connection), never a 500, and the proxy keeps serving. Served the way the command line serves it
(`proxy.listener`), so header timeouts and the connection cap are the real ones."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import jwt
import pytest
import structlog
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from support.clients import ModernClient
from support.proxy import make_config, running_proxy

from proxy.config import Config, config_from_data
from proxy.runtime.logs import configure_logging

LEGACY = {
    "Content-Type": "application/json",
    "Accept": "application/json, text/event-stream",
    "MCP-Protocol-Version": "2025-11-25",
}


@asynccontextmanager
async def served(config: Config) -> AsyncIterator[str]:
    """Serve `config` (through `proxy.listener`, like every test proxy) on a free loopback port; yield the
    base URL."""
    async with running_proxy(config) as proxy:
        yield proxy.base


async def healthy(base: str) -> bool:
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"{base}/healthz", timeout=aiohttp.ClientTimeout(total=2)) as resp,
    ):
        return resp.status == 200


async def test_slow_headers_are_cut_off_and_health_stays_answered(legacy_url: str, tmp_path: Path) -> None:
    config = make_config(legacy_url, tmp_path / "store")
    config.listen.header_timeout = 0.3
    async with served(config) as base:
        port = int(base.rsplit(":", 1)[1])
        conns = [await asyncio.open_connection("127.0.0.1", port) for _ in range(20)]
        for _reader, writer in conns:
            writer.write(b"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # and never the end of the head
        started = time.monotonic()
        assert await healthy(base)
        async with asyncio.timeout(3):
            for reader, _writer in conns:
                assert await reader.read() == b""  # closed by the proxy
        assert time.monotonic() - started < 2.5
        for _reader, writer in conns:
            writer.close()


async def test_a_slow_body_is_answered_408(legacy_url: str, tmp_path: Path) -> None:
    config = make_config(legacy_url, tmp_path / "store")
    config.listen.body_timeout = 0.3
    config.listen.header_timeout = 0.3  # also bounds draining the unread rest of the body before the close
    async with served(config) as base:
        reader, writer = await asyncio.open_connection("127.0.0.1", int(base.rsplit(":", 1)[1]))
        writer.write(
            b"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: "
            b'100\r\n\r\n{"jsonrpc"'
        )
        async with asyncio.timeout(3):
            answer = await reader.read()
        writer.close()
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408")
        assert json.loads(body)["error"]["code"] == -32600 and b"body_timeout" in body


def _post_at_once(port: int) -> bytes:
    """Connect, send a whole request in one write, read to the end (or b"reset")."""
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=3) as sock:
        sock.sendall(
            b"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: "
            b"2\r\n\r\n{}"
        )
        time.sleep(0.05)  # the proxy refuses while the request sits unread
        chunks = []
        try:
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        except ConnectionResetError:
            return b"reset"
        return b"".join(chunks)


async def test_connections_past_the_cap_get_503_not_a_hang(legacy_url: str, tmp_path: Path) -> None:
    config = make_config(legacy_url, tmp_path / "store")
    config.listen.max_connections = 8
    async with served(config) as base:
        port = int(base.rsplit(":", 1)[1])
        idle = [await asyncio.open_connection("127.0.0.1", port) for _ in range(8)]
        await asyncio.sleep(0.05)  # let the server accept them all
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        async with asyncio.timeout(3):
            answer = await reader.read()
        writer.close()
        assert answer.startswith(b"HTTP/1.1 503") and b"max_connections" in answer
        # A client past the cap whose request is there before the proxy refuses it still reads the
        # 503 (closing with the request unread would send a reset that can destroy the 503).
        answers = await asyncio.to_thread(lambda: [_post_at_once(port) for _ in range(20)])
        assert all(a.startswith(b"HTTP/1.1 503") and b"max_connections" in a for a in answers), answers
        for _reader, w in idle:
            w.close()
        async with asyncio.timeout(5):
            while True:  # the server notices the closed connections, then serves again
                try:
                    if await healthy(base):
                        break
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.05)


def _legacy_session_post(body: bytes, **headers: str) -> tuple[bytes, dict[str, str]]:
    return body, {**LEGACY, **headers}


async def test_malformed_input_is_4xx_never_500(legacy_url: str, tmp_path: Path) -> None:
    cases: list[tuple[str, bytes, dict[str, str]]] = [
        ("bad Host", b'{"jsonrpc":"2.0","id":1,"method":"tools/list"}', {**LEGACY, "Host": "[::1"}),
        (
            "bad Origin",
            b'{"jsonrpc":"2.0","id":1,"method":"tools/list"}',
            {**LEGACY, "Origin": "http://[::1"},
        ),
        ("not gzip", b"this is not gzip at all", {**LEGACY, "Content-Encoding": "gzip"}),
        ("unsupported encoding", b"", {**LEGACY, "Content-Encoding": "br"}),
        ("unknown encoding", b"{}", {**LEGACY, "Content-Encoding": "bogus"}),
        ("object id (request)", b'{"jsonrpc":"2.0","id":{"a":1},"method":"tools/list"}', LEGACY),
        ("object id (response)", b'{"jsonrpc":"2.0","id":{"a":1},"result":{}}', LEGACY),
        ("list id", b'{"jsonrpc":"2.0","id":[1],"method":"initialize","params":{}}', LEGACY),
    ]
    async with served(make_config(legacy_url, tmp_path / "store")) as base:
        async with aiohttp.ClientSession(auto_decompress=False) as http:
            for label, body, headers in cases:
                async with http.post(
                    f"{base}/mcp",
                    data=body,
                    headers=headers,
                    skip_auto_headers=["Host"] if "Host" in headers else (),
                ) as resp:
                    answer = await resp.json(content_type=None)
                    assert 400 <= resp.status < 500, (label, resp.status, answer)
                    assert answer["jsonrpc"] == "2.0" and isinstance(answer["error"]["code"], int), (
                        label,
                        answer,
                    )
        # a request line aiohttp cannot parse: compact JSON like every other reply, its bytes not echoed
        reader, writer = await asyncio.open_connection("127.0.0.1", int(base.rsplit(":", 1)[1]))
        writer.write(b"GARBAGE / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        async with asyncio.timeout(5):
            raw = await reader.read()
        writer.close()
        head, _, body = raw.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.0 400") and body.startswith(b'{"jsonrpc":"2.0","id":null,"error":{')
        assert b"GARBAGE" not in body
        assert await healthy(base)


async def test_a_jwt_whose_alg_does_not_fit_its_key_is_401(legacy_url: str, tmp_path: Path) -> None:
    rsa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    jwk = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(rsa_key.public_key())) | {"kid": "k1"}
    (tmp_path / "jwks.json").write_text(json.dumps({"keys": [jwk]}))
    config = make_config(legacy_url, tmp_path / "store")
    config.auth = type(config.auth).model_validate(
        {
            "mode": "jwt",
            "jwt": {
                "jwks_file": str(tmp_path / "jwks.json"),
                "algorithms": ["RS256", "ES256", "HS256"],
                "audience": "*",
            },
        }
    )
    claims = {"sub": "mallory", "exp": int(time.time()) + 60}
    ec_token = jwt.encode(
        claims, ec.generate_private_key(ec.SECP256R1()), algorithm="ES256", headers={"kid": "k1"}
    )
    hs_token = jwt.encode(claims, "k" * 32, algorithm="HS256", headers={"kid": "k1"})
    junk = "e30." + base64.urlsafe_b64encode(b'{"sub":"x"}').decode().rstrip("=") + ".sig"
    async with served(config) as base:
        for token in (ec_token, hs_token, junk, "not-even-a-jwt"):
            client = ModernClient(f"{base}/mcp")
            try:
                reply = await client.post_raw(
                    b"{}", {**client.headers_for("tools/list", {}), "Authorization": f"Bearer {token}"}
                )
                assert reply.status == 401 and reply.error["code"] == -32600, (token[:20], reply)
            finally:
                await client.close()


async def test_header_trust_needs_trusted_peers_and_never_lists_them(legacy_url: str, tmp_path: Path) -> None:
    data = {"store": {"path": str(tmp_path / "s")}, "mcpServers": {"a": {"url": legacy_url}}}
    from proxy.config import ConfigError

    for header in (None, {"name": "X-Forwarded-User"}, {"trusted_peers": []}):
        with pytest.raises(ConfigError, match="trusted_peers"):
            config_from_data(
                {**data, "auth": {"mode": "header", **({"header": header} if header is not None else {})}}
            )
    assert (
        config_from_data(
            {**data, "auth": {"mode": "header", "header": {"trusted_peers": "any"}}}
        ).auth.header.trusted_peers
        == "any"
    )
    with pytest.raises(ConfigError, match="not an IP address"):
        config_from_data(
            {**data, "auth": {"mode": "header", "header": {"trusted_peers": ["auth-proxy.internal"]}}}
        )
    config = make_config(legacy_url, tmp_path / "store")
    config.auth = type(config.auth).model_validate(
        {"mode": "header", "header": {"trusted_peers": ["10.20.0.0/16"]}}
    )
    async with served(config) as base:
        client = ModernClient(f"{base}/mcp")
        try:
            reply = await client.post_raw(
                b"{}", {**client.headers_for("tools/list", {}), "X-Forwarded-User": "alice"}
            )
            assert reply.status == 401 and "10.20" not in json.dumps(reply.message)
        finally:
            await client.close()


async def test_a_client_that_hangs_up_is_logged_as_499_not_500(
    legacy_url: str, tmp_path: Path, capsys
) -> None:
    configure_logging("info")
    try:
        async with served(make_config(legacy_url, tmp_path / "store")) as base:
            client = ModernClient(f"{base}/mcp", capabilities={})
            call = asyncio.create_task(client.call("slow_compute", {"seconds": 2, "label": "gone"}))
            await asyncio.sleep(0.3)
            call.cancel()
            await client.close()
            await asyncio.sleep(0.3)
            async with aiohttp.ClientSession() as http, http.get(f"{base}/metrics") as resp:
                metrics = await resp.text()
        lines = [json.loads(line) for line in capsys.readouterr().err.splitlines() if line.startswith("{")]
    finally:
        structlog.reset_defaults()
    gone = [line for line in lines if line["event"] == "client_disconnected"]
    assert gone and gone[0]["status"] == 499 and gone[0]["tool"] == "slow_compute"
    assert not [line for line in lines if line.get("status") == 500 or line["event"] == "unhandled_error"]
    assert 'mcp_tasks_proxy_http_requests_total{kind="mcp",status="499"}' in metrics
