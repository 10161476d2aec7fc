"""Console sessions and credentials (issue "Security round 2", items 3-5): sessions kept in the
store survive a restart and hold on another replica, signing out ends them everywhere, the cookie
is Secure when the request came over HTTPS, wrong credentials are throttled per client address
(429 with Retry-After, counters shared through Redis), and the principal hash is keyed."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from multidict import CIMultiDict
from support.clients import ModernClient
from support.console import CLIENT_TOKEN, CONSOLE_TOKEN, client_for, console_config
from support.proxy import RunningProxy, Serve
from support.redis_server import RedisServer

from proxy.config import Config
from proxy.front.auth import hash_token
from proxy.tasks.model import principal_hash

COOKIE = "mcp_tasks_proxy_console"
LOOPBACK = {"trusted_proxies": ["127.0.0.1"]}


async def sign_in(proxy: RunningProxy, headers: dict[str, str] | None = None) -> tuple[int, str, str]:
    """(status, Set-Cookie header, cookie value) of a console sign-in with the console token."""
    async with aiohttp.ClientSession() as http:
        async with http.post(
            proxy.base + "/console/login", data={"token": CONSOLE_TOKEN}, headers=headers
        ) as resp:
            morsel = resp.cookies.get(COOKIE)
            return resp.status, resp.headers.get("Set-Cookie", ""), morsel.value if morsel else ""


async def session_status(proxy: RunningProxy, cookie: str) -> int:
    async with aiohttp.ClientSession() as http:
        async with http.get(
            proxy.base + "/console/api/session", headers={"Cookie": f"{COOKIE}={cookie}"}
        ) as resp:
            return resp.status


async def sign_out(proxy: RunningProxy, cookie: str) -> int:
    async with aiohttp.ClientSession() as http:
        headers = {"Cookie": f"{COOKIE}={cookie}"}
        async with http.get(proxy.base + "/console/api/session", headers=headers) as resp:
            csrf = (await resp.json())["csrf"]
        async with http.post(
            proxy.base + "/console/logout", headers={**headers, "X-CSRF-Token": csrf}
        ) as resp:
            return resp.status


def redis_console(legacy_url: str, redis_server: RedisServer, prefix: str) -> Config:
    """The console config on a Redis store (`prefix`): what replicas share."""
    store = {"url": redis_server.url, "prefix": prefix, "timeout": "2s", "lease": "2s"}
    return console_config(legacy_url, store)


async def test_a_console_session_survives_a_restart(legacy_url: str, tmp_path: Path, serve: Serve) -> None:
    first = await serve(console_config(legacy_url, tmp_path / "store"))
    status, _, cookie = await sign_in(first)
    assert status == 200 and await session_status(first, cookie) == 200
    hashed = principal_hash("ci")
    await first.close()
    second = await serve(console_config(legacy_url, tmp_path / "store"))
    assert await session_status(second, cookie) == 200  # the same store, the same deployment key
    assert principal_hash("ci") == hashed  # the keyed hash is stable across restarts
    assert await sign_out(second, cookie) == 200
    assert await session_status(second, cookie) == 401


@pytest.mark.redis
async def test_a_console_session_holds_on_another_replica_and_sign_out_ends_it_everywhere(
    legacy_url: str, tmp_path: Path, serve: Serve, redis_server: RedisServer, redis_prefix: str
) -> None:
    a = await serve(redis_console(legacy_url, redis_server, redis_prefix))
    b = await serve(redis_console(legacy_url, redis_server, redis_prefix))
    status, _, cookie = await sign_in(a)
    assert status == 200
    assert await session_status(b, cookie) == 200
    assert await sign_out(b, cookie) == 200
    assert await session_status(a, cookie) == 401 and await session_status(b, cookie) == 401


async def test_the_cookie_is_secure_over_https_or_when_configured(
    legacy_url: str, tmp_path: Path, serve: Serve
) -> None:
    https = {"X-Forwarded-Proto": "https"}
    plain = await serve(console_config(legacy_url, tmp_path / "plain"))
    assert "Secure" not in (await sign_in(plain))[1]
    assert "Secure" not in (await sign_in(plain, https))[1]  # from an untrusted peer: ignored
    await plain.close()
    behind = await serve(console_config(legacy_url, tmp_path / "behind", listen=LOOPBACK))
    assert "Secure" in (await sign_in(behind, https))[1]
    assert "Secure" not in (await sign_in(behind, {"X-Forwarded-Proto": "http"}))[1]
    await behind.close()
    config = console_config(legacy_url, tmp_path / "forced")
    assert config.console is not None
    config.console.secure_cookie = True
    forced = await serve(config)
    assert "Secure" in (await sign_in(forced))[1]


async def _statuses(proxy: RunningProxy, attempts: int, send: Any) -> list[int]:
    async with aiohttp.ClientSession() as http:
        return [await send(http, proxy, n) for n in range(attempts)]


async def _wrong_sign_in(http: aiohttp.ClientSession, proxy: RunningProxy, n: int, xff: str = "") -> int:
    headers = {"X-Forwarded-For": xff} if xff else None
    async with http.post(
        proxy.base + "/console/login", data={"token": f"guess-{n}"}, headers=headers
    ) as resp:
        if resp.status == 429:
            assert int(resp.headers["Retry-After"]) >= 1
        return resp.status


async def _wrong_console_bearer(http: aiohttp.ClientSession, proxy: RunningProxy, n: int) -> int:
    headers = {"Authorization": f"Bearer guess-{n}", "X-Forwarded-For": "192.0.2.2"}
    async with http.get(proxy.base + "/console/api/tasks", headers=headers) as resp:
        return resp.status


async def _wrong_client_bearer(http: aiohttp.ClientSession, proxy: RunningProxy, n: int) -> int:
    client = ModernClient(proxy.url("legacy"))
    try:
        headers = {"Authorization": f"Bearer guess-{n}", "X-Forwarded-For": "192.0.2.3"}
        answer = await client.call("greet", {"name": "x"}, headers=headers)
    finally:
        await client.close()
    if answer.status == 429:
        assert answer.error is not None and answer.error["data"]["limit"] == "failed_auth"
    return answer.status


async def test_sixty_wrong_credentials_of_each_kind_reach_429(
    legacy_url: str, tmp_path: Path, serve: Serve
) -> None:
    proxy = await serve(console_config(legacy_url, tmp_path / "store", listen=LOOPBACK))
    good = client_for(proxy)
    try:
        assert (await good.call("greet", {"name": "x"})).status == 200  # verified once: never throttled
        sign_ins = await _statuses(proxy, 60, lambda h, p, n: _wrong_sign_in(h, p, n, "192.0.2.1"))
        bearers = await _statuses(proxy, 60, _wrong_console_bearer)
        clients = await _statuses(proxy, 60, _wrong_client_bearer)
        for statuses in (sign_ins, bearers, clients):
            assert statuses[:20] == [401] * 20 and statuses[20:] == [429] * 40, statuses
        # the right console token from a blocked address waits too (no oracle), another address does not
        assert (await sign_in(proxy, {"X-Forwarded-For": "192.0.2.1"}))[0] == 429
        assert (await sign_in(proxy, {"X-Forwarded-For": "192.0.2.9"}))[0] == 200
        # a client whose token verified before keeps working from a blocked address
        assert (
            await good.call("greet", {"name": "y"}, headers={"X-Forwarded-For": "192.0.2.3"})
        ).status == 200
    finally:
        await good.close()


async def test_forwarded_for_from_an_untrusted_peer_does_not_escape_the_limit(
    legacy_url: str, tmp_path: Path, serve: Serve
) -> None:
    proxy = await serve(console_config(legacy_url, tmp_path / "store"))  # no trusted_proxies
    async with aiohttp.ClientSession() as http:
        statuses = [await _wrong_sign_in(http, proxy, n, f"198.51.100.{n}") for n in range(25)]
    assert statuses[:20] == [401] * 20 and statuses[20:] == [429] * 5


@pytest.mark.redis
async def test_wrong_credentials_count_across_replicas(
    legacy_url: str, tmp_path: Path, serve: Serve, redis_server: RedisServer, redis_prefix: str
) -> None:
    a = await serve(redis_console(legacy_url, redis_server, redis_prefix))
    b = await serve(redis_console(legacy_url, redis_server, redis_prefix))
    async with aiohttp.ClientSession() as http:
        assert [await _wrong_sign_in(http, a, n) for n in range(20)] == [401] * 20
        assert await _wrong_sign_in(http, b, 20) == 429


async def test_the_principal_hash_is_keyed(legacy_url: str, tmp_path: Path, serve: Serve) -> None:
    await serve(console_config(legacy_url, tmp_path / "store"))
    assert principal_hash(CLIENT_TOKEN) != hashlib.sha256(CLIENT_TOKEN.encode()).hexdigest()[:16]
    assert principal_hash("ci") != hashlib.sha256(b"ci").hexdigest()[:16]


@pytest.mark.redis
async def test_wrong_credentials_sent_in_parallel_get_no_more_checks_than_the_limit(
    legacy_url: str, serve: Serve, redis_server: RedisServer, redis_prefix: str
) -> None:
    """Each unverified credential counts before it is checked, so 100 at once get 20 checks (401)
    and 80 refusals (429), for client bearer tokens and console sign-ins alike (counters in Redis,
    where every count is a round trip the requests interleave around)."""
    store = {"url": redis_server.url, "prefix": redis_prefix, "timeout": "2s", "lease": "2s"}
    proxy = await serve(console_config(legacy_url, store, listen=LOOPBACK))
    async with aiohttp.ClientSession() as http:
        sign_ins = await asyncio.gather(*(_wrong_sign_in(http, proxy, n, "192.0.2.20") for n in range(100)))
        clients = await asyncio.gather(*(_wrong_client_bearer(http, proxy, n) for n in range(100)))
    for statuses in (sign_ins, clients):
        assert sorted(statuses) == [401] * 20 + [429] * 80, statuses


async def test_rotating_a_console_token_ends_the_sessions_it_opened(
    legacy_url: str, tmp_path: Path, serve: Serve
) -> None:
    first = await serve(console_config(legacy_url, tmp_path / "store"))
    status, _, cookie = await sign_in(first)
    assert status == 200
    await first.close()
    rotated = console_config(legacy_url, tmp_path / "store")
    assert rotated.console is not None
    rotated.console.tokens = {"alice": hash_token("a-new-console-token-after-a-leak")}
    second = await serve(rotated)
    assert await session_status(second, cookie) == 401


async def test_a_forged_forwarded_for_line_before_the_balancers_does_not_escape_the_limit(
    legacy_url: str, tmp_path: Path, serve: Serve
) -> None:
    """HAProxy's `option forwardfor` adds its own X-Forwarded-For line after the client's: the
    client's forged first line must not pick the address that is counted."""
    proxy = await serve(console_config(legacy_url, tmp_path / "store", listen=LOOPBACK))
    statuses = []
    async with aiohttp.ClientSession() as http:
        for n in range(25):
            headers = CIMultiDict([("X-Forwarded-For", f"10.66.{n}.1"), ("X-Forwarded-For", "192.0.2.50")])
            async with http.post(
                proxy.base + "/console/login", data={"token": f"guess-{n}"}, headers=headers
            ) as resp:
                statuses.append(resp.status)
    assert statuses == [401] * 20 + [429] * 5, statuses


async def test_an_open_event_stream_ends_when_its_session_signs_out(
    legacy_url: str, tmp_path: Path, serve: Serve
) -> None:
    proxy = await serve(console_config(legacy_url, tmp_path / "store", listen={"sse_keepalive": "100ms"}))
    status, _, cookie = await sign_in(proxy)
    assert status == 200
    headers = {"Cookie": f"{COOKIE}={cookie}"}
    async with aiohttp.ClientSession() as http:
        async with http.get(proxy.base + "/console/api/events", headers=headers) as stream:
            assert stream.status == 200
            await stream.content.readuntil(b"event: ready")
            assert await sign_out(proxy, cookie) == 200
            async with asyncio.timeout(5):  # SESSION_RECHECK_S (2 s) at most, then the stream ends
                while await stream.content.readany():
                    pass
