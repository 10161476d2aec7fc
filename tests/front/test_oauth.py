"""The proxy as an OAuth 2.1 resource server (MCP authorization): Protected Resource Metadata
(RFC 9728), `WWW-Authenticate` challenges, audience-bound token checks against a real authorization
server (oauth2-mock-server, tests/fixtures/oauth_server.mjs), scopes per tool, introspection of
opaque tokens, and the proxy's own client-credentials token toward an upstream that wants one.
Official clients sign in on their own: the `mcp` SDK's OAuth providers (through FastMCP with the
tasks extension) and the TypeScript client; headless Chromium on a page of another origin reads the
metadata (its CORS preflight)."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import aiohttp
import fastmcp_tasks
import pytest
from aiohttp import web
from fastmcp import Client
from mcp.client.auth import OAuthClientProvider
from mcp.client.auth.extensions.client_credentials import ClientCredentialsOAuthProvider
from mcp.shared.auth import AuthorizationCodeResult, OAuthClientInformationFull, OAuthClientMetadata
from support.browser import CHROMIUM, CHROMIUM_ARGS
from support.clients import LEGACY_INITIALIZE as INITIALIZE
from support.clients import TASKS_CAPS, envelope
from support.oauth import NODE, NODE_MODULES, AuthorizationServer, MemoryStorage
from support.proxy import Serve
from support.servers import ROOT, ServerProcess, free_port, served_app
from support.v1_client import V1Client

from proxy.cli.check_config import auth_warnings
from proxy.config import Config, config_from_data
from proxy.protocol.era import MODERN_VERSION

SCOPES = {"legacy": {"*": ["mcp:use"], "slow_compute": ["mcp:use", "compute"]}}


def oauth_config(upstream: str, tmp_path: Path, issuer: str, port: int, **jwt: object) -> Config:
    """One server (`legacy`) in front of `upstream`, mode jwt with `issuer`, served at `port`."""
    return config_from_data(
        {
            "listen": {"public_url": f"http://127.0.0.1:{port}"},
            "store": {"path": str(tmp_path / "store"), "durable": False},
            "tasks": {"detach_after": "50ms", "poll_interval": "100ms"},
            "auth": {"mode": "jwt", "jwt": {"issuer": issuer, **jwt}, "scopes": SCOPES},
            "mcpServers": {"legacy": {"url": upstream}},
        }
    )


OAuthProxy = Callable[..., Awaitable[str]]


@pytest.fixture
def oauth_proxy(
    auth_server: AuthorizationServer, legacy_url: str, tmp_path: Path, serve: Serve
) -> OAuthProxy:
    """`await oauth_proxy(upstream=legacy_url, **jwt)`: a proxy (`oauth_config`) with `auth_server`
    as its issuer, on a port of its own; its `/mcp` URL."""

    async def start(upstream: str = legacy_url, **jwt: object) -> str:
        port = free_port()
        await serve(oauth_config(upstream, tmp_path, auth_server.url, port, **jwt))
        return f"http://127.0.0.1:{port}/mcp"

    return start


@pytest.fixture(scope="module")
def auth_server() -> Iterator[AuthorizationServer]:
    server = AuthorizationServer()
    yield server
    server.stop()


async def post(url: str, body: dict, token: str | None = None, **headers: str) -> tuple[int, dict, str]:
    """(status, JSON body, WWW-Authenticate) of one POST."""
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    async with aiohttp.ClientSession() as http, http.post(url, json=body, headers=headers) as resp:
        text = await resp.text()
        return (
            resp.status,
            (json.loads(text) if text.startswith("{") else {}),
            resp.headers.get("WWW-Authenticate", ""),
        )


def modern_call(tool: str, arguments: dict) -> tuple[dict, dict[str, str]]:
    """A 2026-07-28 `tools/call` with the tasks extension, and its routing headers."""
    body = {
        "jsonrpc": "2.0",
        "id": 7,
        "method": "tools/call",
        "params": {"name": tool, "arguments": arguments, "_meta": envelope(TASKS_CAPS)},
    }
    headers = {"MCP-Protocol-Version": MODERN_VERSION, "Mcp-Method": "tools/call", "Mcp-Name": tool}
    return body, headers


def modern_get(task_id: str) -> tuple[dict, dict[str, str]]:
    body = {
        "jsonrpc": "2.0",
        "id": 8,
        "method": "tasks/get",
        "params": {"taskId": task_id, "_meta": envelope(TASKS_CAPS)},
    }
    return body, {"MCP-Protocol-Version": MODERN_VERSION, "Mcp-Method": "tasks/get", "Mcp-Name": task_id}


# -- metadata and challenges (no authorization server needed) --------------------------------------


async def idp_named_proxy(legacy_url: str, tmp_path: Path, serve: Serve) -> str:
    """A proxy (`oauth_config`) whose issuer is only named (https://idp.example.com, never asked:
    nothing here verifies a token), on a port of its own; its base URL."""
    port = free_port()
    await serve(oauth_config(legacy_url, tmp_path, "https://idp.example.com", port))
    return f"http://127.0.0.1:{port}"


async def test_protected_resource_metadata_and_challenges(
    legacy_url: str, tmp_path: Path, serve: Serve
) -> None:
    base = await idp_named_proxy(legacy_url, tmp_path, serve)
    async with aiohttp.ClientSession() as http:
        for path, resource in (
            ("/.well-known/oauth-protected-resource/mcp", f"{base}/mcp"),
            ("/.well-known/oauth-protected-resource", f"{base}/mcp"),
            ("/.well-known/oauth-protected-resource/servers/legacy/mcp", f"{base}/servers/legacy/mcp"),
        ):
            async with http.get(base + path, headers={"Host": "evil.example"}) as resp:
                # never from the Host header: the host guard refuses a foreign Host outright
                assert resp.status in (403, 421)
            async with http.get(base + path) as resp:
                assert resp.status == 200 and "max-age=" in resp.headers["Cache-Control"]
                document = await resp.json()
            assert document["resource"] == resource
            assert document["authorization_servers"] == ["https://idp.example.com"]
            assert sorted(document["scopes_supported"]) == ["compute", "mcp:use"]
            assert document["bearer_methods_supported"] == ["header"]
    status, body, challenge = await post(f"{base}/mcp", INITIALIZE)
    assert status == 401 and body["error"]["code"] == -32600
    assert (
        challenge
        == f'Bearer resource_metadata="{base}/.well-known/oauth-protected-resource/mcp", scope="mcp:use"'
    )
    status, _, challenge = await post(f"{base}/servers/legacy/mcp", INITIALIZE, token="not-a-jwt")
    assert status == 401
    assert challenge.startswith(
        f'Bearer resource_metadata="{base}/.well-known/oauth-protected-resource/servers/legacy/mcp", '
        'error="invalid_token", error_description="'
    )


PAGE = "<!doctype html><title>a browser-based MCP client</title>"


async def test_a_metadata_preflight_gets_cors_and_no_credentials_are_asked(
    legacy_url: str, tmp_path: Path, serve: Serve
) -> None:
    base = await idp_named_proxy(legacy_url, tmp_path, serve)
    preflight = {
        "Origin": "http://localhost:5173",
        "Access-Control-Request-Method": "GET",
        "Access-Control-Request-Headers": "mcp-protocol-version",
    }
    async with aiohttp.ClientSession() as http:
        for path in ("/.well-known/oauth-protected-resource/mcp", "/.well-known/oauth-protected-resource"):
            async with http.options(base + path, headers=preflight) as resp:
                assert resp.status == 204
                assert resp.headers["Access-Control-Allow-Origin"] == "*"
                assert "GET" in resp.headers["Access-Control-Allow-Methods"]
                assert resp.headers["Access-Control-Allow-Headers"] == "*, Authorization"
                assert int(resp.headers["Access-Control-Max-Age"]) > 0
        async with http.options(base + "/mcp", headers=preflight) as resp:
            assert resp.status in (401, 405)  # the MCP endpoint itself offers no CORS


@pytest.mark.browser
async def test_chromium_on_another_origin_reads_the_metadata_with_the_protocol_header(
    legacy_url: str, tmp_path: Path, serve: Serve
) -> None:
    from playwright.async_api import async_playwright

    base = await idp_named_proxy(legacy_url, tmp_path, serve)
    # the page is on localhost, the proxy on 127.0.0.1: two origins, both hosts the guard allows
    metadata = f"{base}/.well-known/oauth-protected-resource/mcp"

    async def page(_: web.Request) -> web.Response:
        return web.Response(text=PAGE, content_type="text/html")

    app = web.Application()
    app.router.add_get("/", page)
    fetch = """async (url) => {
        const resp = await fetch(url, {headers: {"MCP-Protocol-Version": "2025-11-25"}});
        return {status: resp.status, document: await resp.json()};
    }"""
    async with served_app(app) as page_port, async_playwright() as playwright:
        browser = await playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            tab = await browser.new_page()
            await tab.goto(f"http://localhost:{page_port}/")
            answer = await tab.evaluate(fetch, metadata)
        finally:
            await browser.close()
    assert answer["status"] == 200
    assert answer["document"]["resource"] == f"{base}/mcp"
    assert answer["document"]["authorization_servers"] == ["https://idp.example.com"]


async def test_without_a_public_url_nothing_is_discoverable(
    legacy_url: str, tmp_path: Path, serve: Serve
) -> None:
    config = oauth_config(
        legacy_url, tmp_path, "https://idp.example.com", free_port(), audience="https://mcp.example.com"
    )
    config.listen.public_url = None
    proxy = await serve(config)
    status, _, challenge = await post(proxy.url(), INITIALIZE)
    assert status == 401 and challenge == 'Bearer realm="mcp-tasks-proxy", scope="mcp:use"'
    async with (
        aiohttp.ClientSession() as http,
        http.get(proxy.base + "/.well-known/oauth-protected-resource") as resp,
    ):
        assert resp.status == 404
    config.auth.jwt.issuer = f"http://127.0.0.1:{free_port()}"  # type: ignore[union-attr]  (loopback, down)
    warnings = await asyncio.to_thread(auth_warnings, config)
    assert warnings[0].startswith("auth mode jwt without listen.public_url: MCP clients cannot discover")
    assert "metadata cannot be fetched now" in warnings[1]


# -- official clients sign in on their own ---------------------------------------------------------


@pytest.mark.node
async def test_mcp_sdk_client_credentials_sign_in_and_a_detached_call(
    auth_server: AuthorizationServer, oauth_proxy: OAuthProxy
) -> None:
    url = await oauth_proxy()
    provider = ClientCredentialsOAuthProvider(
        server_url=url,
        storage=MemoryStorage(),
        client_id="builder",
        client_secret="secret",
        scope="mcp:use compute",
        issuer=auth_server.url,
    )
    async with Client(url, auth=provider) as client:
        task = await fastmcp_tasks.call_tool_task(
            client, "slow_compute", {"seconds": 0.4, "label": "oauth-cc"}
        )
        assert task.task_id
        assert (await task.status()).status in ("working", "completed")
        result = await asyncio.wait_for(task.result(), 20)
    assert result.content[0].text == "computed oauth-cc after 0.4s"


@pytest.mark.node
async def test_mcp_sdk_authorization_code_with_pkce_sign_in(
    auth_server: AuthorizationServer, oauth_proxy: OAuthProxy
) -> None:
    url = await oauth_proxy()
    redirect_uri = "http://127.0.0.1:9/callback"  # never opened: the redirect is read, not followed
    codes: asyncio.Queue[AuthorizationCodeResult] = asyncio.Queue()

    async def sign_in(authorization_url: str) -> None:
        """What a browser does for a signed-in user: the authorization server redirects at once."""
        async with (
            aiohttp.ClientSession() as http,
            http.get(authorization_url, allow_redirects=False) as resp,
        ):
            assert resp.status == 302
            query = parse_qs(urlsplit(resp.headers["Location"]).query)
        await codes.put(AuthorizationCodeResult(code=query["code"][0], state=query.get("state", [None])[0]))

    metadata = OAuthClientMetadata(
        redirect_uris=[redirect_uri],
        grant_types=["authorization_code", "refresh_token"],
        response_types=["code"],
        token_endpoint_auth_method="none",
        scope="mcp:use compute",
    )
    registered = OAuthClientInformationFull(client_id="coder", **metadata.model_dump(exclude_none=True))
    provider = OAuthClientProvider(
        server_url=url,
        client_metadata=metadata,
        storage=MemoryStorage(registered),
        redirect_handler=sign_in,
        callback_handler=codes.get,
    )
    async with Client(url, auth=provider) as client:
        task = await fastmcp_tasks.call_tool_task(
            client, "slow_compute", {"seconds": 0.3, "label": "oauth-pkce"}
        )
        result = await asyncio.wait_for(task.result(), 20)
        assert result.content[0].text == "computed oauth-pkce after 0.3s"
        tools = await client.list_tools()  # every tool is listed; a call without its scope gets 403
        assert {"greet", "slow_compute"} <= {tool.name for tool in tools}


@pytest.mark.node
async def test_typescript_client_signs_in_with_client_credentials(
    auth_server: AuthorizationServer, oauth_proxy: OAuthProxy
) -> None:
    url = await oauth_proxy()
    proc = await asyncio.create_subprocess_exec(
        str(NODE),
        str(Path(__file__).parents[1] / "fixtures" / "ts_oauth_client.mjs"),
        str(NODE_MODULES),
        url,
        auth_server.url,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()[-3000:]
    report = json.loads(out.decode().strip().splitlines()[-1])
    assert report["greeting"] == "Hello, ts!" and report["created"] == "working"
    assert report["status"] == "completed" and report["computed"] == "computed ts-oauth after 0.5s"


# -- refusals --------------------------------------------------------------------------------------


@pytest.mark.node
async def test_tokens_are_refused_with_the_right_status_and_challenge(
    auth_server: AuthorizationServer, oauth_proxy: OAuthProxy
) -> None:
    url = await oauth_proxy(refetch_interval="1s")
    good = auth_server.token("alice", scope="mcp:use compute", resource=url)
    assert (await post(url, INITIALIZE, good))[0] == 200
    # A URL no endpoint serves is a 404 with a good token or none: a 401 ("Audience doesn't match")
    # sent the client to sign in again when its URL was wrong.
    base = url.removesuffix("/mcp")
    for wrong in (f"{base}/mcp/", f"{base}/servers/nope/mcp", f"{base}/foo"):
        assert (await post(wrong, INITIALIZE, good))[0] == 404, wrong
        assert (await post(wrong, INITIALIZE))[0] == 404, wrong
    fetched = auth_server.jwks_served()

    def refused_as_invalid(result: tuple[int, dict, str]) -> None:
        status, body, challenge = result
        assert status == 401 and 'error="invalid_token"' in challenge and body["error"]["code"] == -32600
        assert (
            f'resource_metadata="{url.removesuffix("/mcp")}/.well-known/oauth-protected-resource/mcp"'
            in challenge
        )

    refused_as_invalid(await post(url, INITIALIZE, auth_server.signed(expires_in=-120, payload={"aud": url})))
    refused_as_invalid(
        await post(url, INITIALIZE, auth_server.signed(payload={"aud": url, "iss": "http://127.0.0.1:9"}))
    )
    refused_as_invalid(
        await post(url, INITIALIZE, auth_server.token("alice", resource="https://other.example/mcp"))
    )
    refused_as_invalid(await post(url, INITIALIZE, auth_server.token("alice")))  # no audience at all
    # A rotated-in key: fetched once, then its tokens pass.
    new_kid = auth_server.rotate()
    await asyncio.sleep(1.1)
    rotated = next(
        t
        for t in (auth_server.token("alice", scope="mcp:use", resource=url) for _ in range(6))
        if json.loads(_b64(t.split(".")[0]))["kid"] == new_kid
    )
    assert (await post(url, INITIALIZE, rotated))[0] == 200
    assert auth_server.jwks_served() == fetched + 1
    # Unknown kids: refused; a flood fetches nothing more within the interval, later once more.
    unknown = auth_server.signed(payload={"aud": url}, header={"kid": "no-such-key"})
    for _ in range(10):
        refused_as_invalid(await post(url, INITIALIZE, unknown))
    assert auth_server.jwks_served() == fetched + 1
    await asyncio.sleep(1.1)
    refused_as_invalid(await post(url, INITIALIZE, unknown))
    assert auth_server.jwks_served() == fetched + 2


def _b64(segment: str) -> str:
    return base64.urlsafe_b64decode(segment + "=" * (-len(segment) % 4)).decode()


@pytest.mark.node
async def test_insufficient_scope_is_a_403_a_client_can_step_up_from(
    auth_server: AuthorizationServer, oauth_proxy: OAuthProxy
) -> None:
    url = await oauth_proxy()
    narrow = auth_server.token("alice", scope="mcp:use", resource=url)
    wide = auth_server.token("alice", scope="mcp:use compute", resource=url)
    body, headers = modern_call("greet", {"name": "a"})
    status, reply, _ = await post(url, body, narrow, **headers)
    assert status == 200 and reply["result"]["content"][0]["text"] == "Hello, a!"
    body, headers = modern_call("slow_compute", {"seconds": 0.3, "label": "scoped"})
    status, reply, challenge = await post(url, body, narrow, **headers)
    assert status == 403 and reply["error"]["code"] == -32600
    assert reply["id"] == body["id"]  # the body was read: its answer carries its id
    assert 'error="insufficient_scope"' in challenge and 'scope="mcp:use compute"' in challenge
    status, reply, _ = await post(url, body, wide, **headers)  # stepped up
    assert status == 200 and reply["result"]["resultType"] == "task"
    task_id = reply["result"]["taskId"]
    # Reading the task needs the scope of the tool that made it, besides being its principal.
    body, headers = modern_get(task_id)
    status, reply, challenge = await post(url, body, narrow, **headers)
    assert status == 403 and 'error="insufficient_scope"' in challenge
    status, reply, _ = await post(url, body, wide, **headers)
    assert status == 200 and reply["result"]["taskId"] == task_id
    other = auth_server.token("mallory", scope="mcp:use compute", resource=url)
    status, reply, _ = await post(url, body, other, **headers)  # another principal: not found, as ever
    assert status == 400 and reply["error"]["code"] == -32602
    # Status pushes carry a task's result: listening to one needs the same scopes as reading it.
    listen = {
        "jsonrpc": "2.0",
        "id": 10,
        "method": "subscriptions/listen",
        "params": {"notifications": {"taskIds": [task_id]}, "_meta": envelope(TASKS_CAPS)},
    }
    listen_headers = {"MCP-Protocol-Version": MODERN_VERSION, "Mcp-Method": "subscriptions/listen"}
    status, reply, challenge = await post(url, listen, narrow, **listen_headers)
    assert status == 403 and 'error="insufficient_scope"' in challenge, reply
    # Listing shows the principal's own tasks: it needs the server's "*" scopes.
    listing = {"jsonrpc": "2.0", "id": 9, "method": "tasks/list", "params": {"_meta": envelope(TASKS_CAPS)}}
    list_headers = {"MCP-Protocol-Version": MODERN_VERSION, "Mcp-Method": "tasks/list"}
    status, reply, challenge = await post(
        url, listing, auth_server.token("alice", resource=url), **list_headers
    )
    assert status == 403 and 'scope="mcp:use"' in challenge
    status, reply, _ = await post(url, listing, narrow, **list_headers)
    assert status != 403, reply


@pytest.mark.node
async def test_an_unreachable_jwks_refuses_every_token(
    auth_server: AuthorizationServer, oauth_proxy: OAuthProxy
) -> None:
    dead = f"http://127.0.0.1:{free_port()}/jwks"
    url = await oauth_proxy(jwks_url=dead, jwks_timeout="2s")
    token = auth_server.token("alice", scope="mcp:use", resource=url)
    status, body, challenge = await post(url, INITIALIZE, token)
    assert status == 401 and 'error="invalid_token"' in challenge
    assert dead not in json.dumps(body) and dead not in challenge  # the cause is logged, not told


@pytest.mark.node
async def test_a_hanging_jwks_is_asked_once_per_interval(
    auth_server: AuthorizationServer, oauth_proxy: OAuthProxy
) -> None:
    """A key endpoint that never answers: the first token waits for `jwks_timeout`, the next ones
    within `refetch_interval` are refused at once without asking again."""
    asked: list[float] = []
    release = asyncio.Event()

    async def hang(request: web.Request) -> web.Response:
        asked.append(time.monotonic())
        await release.wait()
        return web.json_response({"keys": []})

    app = web.Application()
    app.router.add_get("/jwks", hang)
    async with served_app(app) as port:
        url = await oauth_proxy(jwks_url=f"http://127.0.0.1:{port}/jwks", jwks_timeout="500ms")
        token = auth_server.token("alice", scope="mcp:use", resource=url)
        for _ in range(5):
            status, _, challenge = await post(url, INITIALIZE, token)
            assert status == 401 and 'error="invalid_token"' in challenge
        assert len(asked) == 1
        release.set()


@pytest.mark.node
async def test_opaque_tokens_are_introspected(
    auth_server: AuthorizationServer, oauth_proxy: OAuthProxy
) -> None:
    url = await oauth_proxy(
        introspection={"client_id": "introspector", "client_secret": "introspector-secret"}
    )
    opaque = auth_server.token("opaque-client", scope="mcp:use", resource=url)
    assert opaque.startswith("opaque-")
    assert (await post(url, INITIALIZE, opaque))[0] == 200
    status, _, challenge = await post(url, INITIALIZE, "opaque-never-issued")
    assert status == 401 and 'error="invalid_token"' in challenge
    elsewhere = auth_server.token("opaque-client", scope="mcp:use", resource="https://other.example/mcp")
    assert (await post(url, INITIALIZE, elsewhere))[0] == 401
    # Accepted at /mcp (and so cached there), the token is still not one for another endpoint.
    other_endpoint = url.removesuffix("/mcp") + "/servers/legacy/mcp"
    assert (await post(other_endpoint, INITIALIZE, opaque))[0] == 401
    # Introspection refused (the proxy's own credentials are wrong): a generic reason, no address.
    wrong = await oauth_proxy(introspection={"client_id": "intro:spector", "client_secret": "wrong"})
    token = auth_server.token("opaque-client", scope="mcp:use", resource=wrong)
    status, body, challenge = await post(wrong, INITIALIZE, token)
    assert status == 401 and "cannot be checked now" in challenge
    assert auth_server.url not in challenge + json.dumps(body)


# -- the proxy's own token toward an upstream --------------------------------------------------------


@pytest.mark.node
async def test_an_upstream_gets_the_proxys_token_never_the_clients(
    auth_server: AuthorizationServer, tmp_path: Path, serve: Serve
) -> None:
    upstream = ServerProcess([sys.executable, "tests/fixtures/oauth_upstream.py", auth_server.url])
    try:
        port = free_port()
        url = f"http://127.0.0.1:{port}/mcp"
        config = oauth_config(upstream.url, tmp_path, auth_server.url, port)
        config.mcpServers["legacy"].oauth = (
            config_from_data(
                {
                    "mcpServers": {
                        "x": {
                            "url": upstream.url,
                            "oauth": {
                                "token_url": auth_server.url + "/token",
                                "client_id": "proxy-upstream",
                                "client_secret": "upstream-secret",
                                "resource": upstream.url,
                            },
                        }
                    }
                }
            )
            .mcpServers["x"]
            .oauth
        )
        await serve(config)
        client_token = auth_server.token("alice-app", scope="mcp:use compute", resource=url)
        body, headers = modern_call("greet", {"name": "up"})
        status, reply, _ = await post(url, body, client_token, **headers)
        assert status == 200 and reply["result"]["content"][0]["text"] == "Hello, up!", reply
        legacy = V1Client(url)  # and a 2025-11-25 session, through the legacy relay
        legacy.http.headers["Authorization"] = f"Bearer {client_token}"  # type: ignore[index]
        try:
            await legacy.initialize()
            status, message, _ = await legacy.request(
                "tools/call", {"name": "greet", "arguments": {"name": "v1"}}
            )
            assert status == 200 and message["result"]["content"][0]["text"] == "Hello, v1!", message
        finally:
            await legacy.close()
        async with (
            aiohttp.ClientSession() as http,
            http.get(upstream.url.removesuffix("/mcp") + "/seen") as resp,
        ):
            seen = await resp.json()
        assert len(seen) >= 2 and all(
            (entry["client_id"], entry["aud"]) == ("proxy-upstream", upstream.url) for entry in seen
        ), seen
        assert len({entry["iat"] for entry in seen}) == 1  # one token, kept for every request
        # The upstream revokes it: the next request gets 401, and the proxy fetches a new token once.
        async with (
            aiohttp.ClientSession() as http,
            http.post(upstream.url.removesuffix("/mcp") + "/revoke") as resp,
        ):
            not_before = (await resp.json())["not_before"]
        await asyncio.sleep(max(0.0, not_before - time.time()) + 0.05)
        body, headers = modern_call("greet", {"name": "again"})
        status, reply, _ = await post(url, body, client_token, **headers)
        assert status == 200 and reply["result"]["content"][0]["text"] == "Hello, again!", reply
        async with (
            aiohttp.ClientSession() as http,
            http.get(upstream.url.removesuffix("/mcp") + "/seen") as resp,
        ):
            after = (await resp.json())[len(seen) :]
        assert after[0] == {"refused": "revoked"} and after[1]["iat"] >= not_before, after
        assert all(entry.get("client_id", "proxy-upstream") == "proxy-upstream" for entry in after)
    finally:
        upstream.stop()


@pytest.mark.node
async def test_an_upstream_that_refuses_the_proxys_own_token_is_named_with_the_setting(
    auth_server: AuthorizationServer, tmp_path: Path, serve: Serve
) -> None:
    """The proxy's own token is refused even when fresh (here: issued for another resource): both
    eras name the upstream and the setting to fix, not "unreachable" (the network is fine)."""
    upstream = ServerProcess([sys.executable, "tests/fixtures/oauth_upstream.py", auth_server.url])
    try:
        port = free_port()
        url = f"http://127.0.0.1:{port}/mcp"
        config = oauth_config(upstream.url, tmp_path, auth_server.url, port)
        oauth = {
            "token_url": auth_server.url + "/token",
            "client_id": "proxy-upstream",
            "client_secret": "upstream-secret",
            "resource": "http://127.0.0.1:9/elsewhere",
        }
        entry = config_from_data({"mcpServers": {"x": {"url": upstream.url, "oauth": oauth}}}).mcpServers["x"]
        config.mcpServers["legacy"].oauth = entry.oauth
        await serve(config)
        client_token = auth_server.token("alice-app", scope="mcp:use compute", resource=url)
        body, headers = modern_call("greet", {"name": "up"})
        _, modern, _ = await post(url, body, client_token, **headers)
        _, legacy, _ = await post(url, INITIALIZE, client_token)
        for reply in (modern, legacy):
            message = reply["error"]["message"]
            assert "refused the proxy's token (HTTP 401), a fresh one too" in message, reply
            assert "mcpServers.legacy.oauth" in message and "unreachable" not in message, reply
    finally:
        upstream.stop()


@pytest.mark.node
async def test_the_clients_token_never_reaches_an_upstream_without_proxy_credentials(
    auth_server: AuthorizationServer, oauth_proxy: OAuthProxy
) -> None:
    """No token passthrough: in front of an upstream that wants a token, with no `oauth` of the
    proxy's own, the upstream is sent no token at all (its log stays empty) and the client gets an
    error, on both eras."""
    upstream = ServerProcess([sys.executable, "tests/fixtures/oauth_upstream.py", auth_server.url])
    try:
        url = await oauth_proxy(upstream.url)
        client_token = auth_server.token("alice-app", scope="mcp:use compute", resource=url)
        body, headers = modern_call("greet", {"name": "up"})
        status, reply, _ = await post(url, body, client_token, **headers)
        assert reply["error"]["message"] == (
            "upstream legacy refused the proxy (HTTP 401): it wants credentials; configure "
            "mcpServers.legacy.oauth or headers"
        ), reply
        status, reply, challenge = await post(url, INITIALIZE, client_token)
        # The upstream's sign-in is not the client's: no 401, no challenge.
        assert status != 401 and not challenge, (status, challenge)
        assert reply["error"]["message"].startswith("upstream legacy refused the proxy (HTTP 401)"), reply
        async with (
            aiohttp.ClientSession() as http,
            http.get(upstream.url.removesuffix("/mcp") + "/seen") as resp,
        ):
            assert await resp.json() == []
    finally:
        upstream.stop()


# -- check-config --------------------------------------------------------------------------------


@pytest.mark.node
def test_check_config_on_the_oauth_example(auth_server: AuthorizationServer) -> None:
    """config/oauth.yaml is valid; with its issuer reachable, no warning; offline, a warning (not a
    failure); without a public URL, the warning that clients cannot discover where to sign in. The
    upstream's client secret is never printed."""
    env = {
        **os.environ,
        "MCP_PUBLIC_URL": "https://mcp.example.com",
        "MCP_OAUTH_ISSUER": auth_server.url,
        "BUILD_CLIENT_SECRET": "do-not-print-me",
    }

    def check(**overrides: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "proxy", "check-config", "config/oauth.yaml"],
            capture_output=True,
            text=True,
            timeout=60,
            env={**env, **overrides},
            cwd=ROOT,
        )

    online = check()
    assert online.returncode == 0, online.stderr
    assert "auth: OAuth access tokens from " + auth_server.url in online.stdout
    assert "warning" not in online.stdout and "do-not-print-me" not in online.stdout + online.stderr
    offline = check(MCP_OAUTH_ISSUER=f"http://127.0.0.1:{free_port()}")
    assert (
        offline.returncode == 0 and "warning: the issuer's metadata cannot be fetched now" in offline.stdout
    )
