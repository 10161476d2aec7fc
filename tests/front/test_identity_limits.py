"""Identity and limits: every task is bound to its principal; other principals see an unknown id;
each limit refuses with a JSON-RPC error that names it."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import rsa
from multidict import CIMultiDict
from support.clients import AuthClient, ModernClient, envelope
from support.proxy import Serve, make_config, with_auth
from support.servers import served_app
from support.v1_client import V1Client

from proxy.app import TASKS_KEY
from proxy.front.auth import hash_token


async def test_bearer_tokens_bind_tasks_to_their_principal(
    legacy_url: str, tmp_path: Path, capsys, serve: Serve
) -> None:
    auth = {
        "mode": "bearer",
        "tokens": {"alice": hash_token("alice-secret"), "bob": hash_token("bob-secret")},
    }
    proxy = await serve(with_auth(legacy_url, tmp_path, auth))
    alice = AuthClient(proxy.url(), {"Authorization": "Bearer alice-secret"})
    bob = AuthClient(proxy.url(), {"Authorization": "Bearer bob-secret"})
    nobody = ModernClient(proxy.url())
    wrong = AuthClient(proxy.url(), {"Authorization": "Bearer guess"})
    try:
        for client in (nobody, wrong):
            reply = await client.call("greet", {"name": "x"})
            assert (
                reply.status == 401
                and reply.error["code"] == -32600
                and "authentication required" in reply.error["message"]
            )
        # RFC 6750 §3.1: a token that was sent and refused is named in the challenge; none sent, none named
        for sent, named in (({"Authorization": "Bearer guess"}, True), ({}, False)):
            async with wrong.http.post(proxy.url(), json={}, headers=sent) as resp:
                assert resp.status == 401
                assert ('error="invalid_token"' in resp.headers["WWW-Authenticate"]) is named
        created = (await alice.call("slow_compute", {"seconds": 0.3, "label": "alice"})).result
        task_id = created["taskId"]
        unknown = await bob.get("no-such-task")
        for method, params in (
            ("tasks/get", {"taskId": task_id}),
            ("tasks/update", {"taskId": task_id, "inputResponses": {}}),
            ("tasks/cancel", {"taskId": task_id}),
        ):
            reply = await bob.request(method, params)
            assert reply.error["code"] == unknown.error["code"] == -32602
            assert reply.error["message"].replace(task_id, "X") == unknown.error["message"].replace(
                "no-such-task", "X"
            )
        done = await alice.wait_terminal(task_id)
        assert done["status"] == "completed"  # bob's cancel did nothing
        assert (await proxy.store.get(task_id)).principal == "alice"
    finally:
        for client in (alice, bob, nobody, wrong):
            await client.close()
    await proxy.stop()
    logs = capsys.readouterr()
    text = logs.out + logs.err
    assert "security_foreign_task_access" in text and "security_auth_failed" in text
    assert "bob-secret" not in text and "alice-secret" not in text


def _rsa_jwks(tmp_path: Path) -> tuple[object, Path]:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    jwk = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(key.public_key()))
    jwk.update({"kid": "k1", "use": "sig", "alg": "RS256"})
    path = tmp_path / "jwks.json"
    path.write_text(json.dumps({"keys": [jwk]}))
    return key, path


def _token(key: object, **claims) -> str:
    body = {"iss": "https://idp.test", "aud": "mcp-proxy", "exp": int(time.time()) + 300, **claims}
    body = {name: value for name, value in body.items() if value is not None}  # (None: left out)
    return jwt.encode(body, key, algorithm="RS256", headers={"kid": "k1"})


async def test_two_authorization_headers_are_refused_whichever_comes_first(
    legacy_url: str, tmp_path: Path, serve: Serve
) -> None:
    """Which of two `Authorization` headers counts would depend on who reads them (the proxy read the
    first: a wrong token then a good one was refused, the other way round let in): both orders 401."""
    auth = {"mode": "bearer", "tokens": {"alice": hash_token("alice-secret")}}
    proxy = await serve(with_auth(legacy_url, tmp_path, auth))
    client = ModernClient(proxy.url())
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "greet", "arguments": {}}}
    body["params"]["_meta"] = envelope()
    try:
        for pair in (("Bearer alice-secret", "Bearer guess"), ("Bearer guess", "Bearer alice-secret")):
            headers = CIMultiDict(client.headers_for("tools/call", body["params"]))
            for value in pair:
                headers.add("Authorization", value)
            async with client.http.post(proxy.url(), json=body, headers=headers) as resp:
                error = (await resp.json())["error"]
                assert resp.status == 401 and "2 Authorization headers" in error["message"], error
    finally:
        await client.close()


async def test_jwt_against_a_jwks_file(legacy_url: str, tmp_path: Path, serve: Serve) -> None:
    key, jwks = _rsa_jwks(tmp_path)
    auth = {
        "mode": "jwt",
        "jwt": {
            "jwks_file": str(jwks),
            "issuer": "https://idp.test",
            "audience": "mcp-proxy",
            "algorithms": ["RS256"],
        },
    }
    proxy = await serve(with_auth(legacy_url, tmp_path, auth))
    carol = AuthClient(proxy.url(), {"Authorization": f"Bearer {_token(key, sub='carol')}"})
    dave = AuthClient(proxy.url(), {"Authorization": f"Bearer {_token(key, sub='dave')}"})
    expired = AuthClient(
        proxy.url(), {"Authorization": f"Bearer {_token(key, sub='carol', exp=int(time.time()) - 600)}"}
    )
    foreign_aud = AuthClient(
        proxy.url(), {"Authorization": f"Bearer {_token(key, sub='carol', aud='someone-else')}"}
    )
    other_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    forged = AuthClient(proxy.url(), {"Authorization": f"Bearer {_token(other_key, sub='carol')}"})
    try:
        created = (await carol.call("slow_compute", {"seconds": 0.2, "label": "jwt"})).result
        assert (await proxy.store.get(created["taskId"])).principal == "carol"
        assert (await dave.get(created["taskId"])).error["code"] == -32602
        for client in (expired, foreign_aud, forged):
            assert (await client.get(created["taskId"])).status == 401
        assert (await carol.wait_terminal(created["taskId"]))["status"] == "completed"
    finally:
        for client in (carol, dave, expired, foreign_aud, forged):
            await client.close()


async def test_jwt_audience_star_is_the_written_out_way_to_accept_any_audience(
    legacy_url: str, tmp_path: Path, serve: Serve
) -> None:
    """Without `listen.public_url` a jwt config must name its audience (else tokens issued for any
    other service of the same identity provider passed); `"*"` accepts any, or none, on purpose."""
    key, jwks = _rsa_jwks(tmp_path)
    auth = {"mode": "jwt", "jwt": {"jwks_file": str(jwks), "issuer": "https://idp.test", "audience": "*"}}
    proxy = await serve(with_auth(legacy_url, tmp_path, auth))
    clients = [
        AuthClient(proxy.url(), {"Authorization": f"Bearer {_token(key, sub='gina', aud='someone-else')}"}),
        AuthClient(proxy.url(), {"Authorization": f"Bearer {_token(key, sub='gina', aud=None)}"}),
    ]
    try:
        for client in clients:
            assert (await client.call("greet", {"name": "x"})).status == 200
    finally:
        for client in clients:
            await client.close()


async def test_trusted_header_from_a_fronting_proxy(legacy_url: str, tmp_path: Path, serve: Serve) -> None:
    auth = {"mode": "header", "header": {"name": "X-Forwarded-User", "trusted_peers": ["127.0.0.1"]}}
    proxy = await serve(with_auth(legacy_url, tmp_path, auth))
    erin = AuthClient(proxy.url(), {"X-Forwarded-User": "erin"})
    anonymous = ModernClient(proxy.url())
    try:
        created = (await erin.call("slow_compute", {"seconds": 0.1})).result
        assert (await proxy.store.get(created["taskId"])).principal == "erin"
        assert (await anonymous.call("greet", {"name": "x"})).status == 401
    finally:
        await erin.close()
        await anonymous.close()
    await proxy.stop()
    auth = {"mode": "header", "header": {"name": "X-Forwarded-User", "trusted_peers": ["10.9.9.9"]}}
    proxy = await serve(with_auth(legacy_url, tmp_path, auth))
    spoofer = AuthClient(proxy.url(), {"X-Forwarded-User": "erin"})
    try:
        assert (await spoofer.call("greet", {"name": "x"})).status == 401
    finally:
        await spoofer.close()


async def test_upstream_credentials_never_reach_the_store(
    legacy_url: str, tmp_path: Path, serve: Serve
) -> None:
    secret = "upstream-credential-7f3a9c"
    config = make_config(
        legacy_url, tmp_path / "store", server={"headers": {"Authorization": f"Bearer {secret}"}}
    )
    proxy = await serve(config)
    client = ModernClient(proxy.url())
    try:
        seen = json.loads((await client.call("echo_meta", capabilities={})).result["content"][0]["text"])
        assert seen["headers"]["authorization"] == f"Bearer {secret}"  # it does reach the upstream
        for seconds in (0.2, 0.3):
            created = (await client.call("slow_compute", {"seconds": seconds})).result
            assert (await client.wait_terminal(created["taskId"]))["status"] == "completed"
        assert await proxy.store.count() >= 2
    finally:
        await client.close()
    await proxy.stop()
    for path in (tmp_path / "store").rglob("*"):
        if path.is_file():
            assert secret.encode() not in path.read_bytes(), path


async def test_limit_on_running_tasks_per_principal(legacy_url: str, tmp_path: Path, serve: Serve) -> None:
    config = make_config(legacy_url, tmp_path / "store")
    config.limits.max_tasks_per_principal = 1
    proxy = await serve(config)
    client = ModernClient(proxy.url())
    try:
        first = (await client.call("slow_compute", {"seconds": 0.6, "label": "first"})).result
        # At the cap, a call that started upstream cannot become a task: it is not cancelled and
        # refused with a 429 a client would send again (running it twice); it stays attached.
        attached = await client.call("slow_compute", {"seconds": 0.3, "label": "attached"})
        assert (
            attached.status == 200 and attached.result["content"][0]["text"] == "computed attached after 0.3s"
        )
        assert len(proxy.app[TASKS_KEY].live) <= 1
        await client.wait_terminal(first["taskId"])
        assert (await client.call("slow_compute", {"seconds": 0.2, "label": "later"})).result[
            "resultType"
        ] == "task"
    finally:
        await client.close()


async def test_limit_on_tasks_call_rate_says_when_to_retry_on_both_wires(
    legacy_url: str, tmp_path: Path, serve: Serve
) -> None:
    config = make_config(legacy_url, tmp_path / "store")
    config.limits.tasks_rate = "3/minute"
    proxy = await serve(config)
    client = ModernClient(proxy.url())
    try:
        replies = [await client.get("whatever") for _ in range(4)]
        assert [r.status for r in replies[:3]] == [400, 400, 400]
        assert replies[3].status == 429 and replies[3].error["data"]["limit"] == "tasks_rate"
        # the moving window frees its first place a minute after the first call: Retry-After says so
        assert 50 <= int(replies[3].retry_after) <= 60
        assert f"retry after {replies[3].retry_after} s" in replies[3].error["message"]
    finally:
        await client.close()
    v1 = V1Client(proxy.url())  # the 2025-11-25 wire, the same (anonymous) principal: past the rate
    try:
        await v1.initialize()
        status, message, _ = await v1.request("tasks/get", {"taskId": "whatever"})
        assert status == 429 and message["error"]["data"]["limit"] == "tasks_rate"
        assert 50 <= int(v1.last_headers["Retry-After"]) <= 60
    finally:
        await v1.close()


async def test_limit_on_stored_result_size(legacy_url: str, tmp_path: Path, serve: Serve) -> None:
    config = make_config(
        legacy_url, tmp_path / "store", server={"tasks": {"tools": {"big_result": {"mode": "required"}}}}
    )
    config.limits.max_result_bytes = 2048
    proxy = await serve(config)
    client = ModernClient(proxy.url())
    try:
        created = (await client.call("big_result", {"kb": 4})).result
        done = await client.wait_terminal(created["taskId"])
        assert done["status"] == "failed" and "max_result_bytes" in done["error"]["message"]
        small = (await client.call("big_result", {"kb": 1})).result
        assert (await client.wait_terminal(small["taskId"]))["status"] == "completed"
    finally:
        await client.close()


async def test_max_ttl_caps_retention_and_expired_tasks_are_unknown(
    legacy_url: str, tmp_path: Path, serve: Serve
) -> None:
    config = make_config(legacy_url, tmp_path / "store", tasks={"ttl": "1h"})
    config.limits.max_ttl = 0.6
    proxy = await serve(config)
    client = ModernClient(proxy.url())
    try:
        created = (await client.call("slow_compute", {"seconds": 0.1})).result
        assert created["ttlMs"] == 600
        assert (await client.wait_terminal(created["taskId"]))["status"] == "completed"
        async with asyncio.timeout(5):
            while (await client.get(created["taskId"])).status == 200:
                await asyncio.sleep(0.05)
        gone = await client.get(created["taskId"])
        assert gone.error["code"] == -32602
        # not before its ttl
        assert time.time() * 1000 >= _parse_ms(created["createdAt"]) + created["ttlMs"] - 50
    finally:
        await client.close()


def _parse_ms(stamp: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp() * 1000


@pytest.mark.parametrize("round_", range(1))
async def test_cancel_racing_completion_has_one_final_state(
    legacy_url: str, tmp_path: Path, round_: int, serve: Serve
) -> None:
    proxy = await serve(make_config(legacy_url, tmp_path / "store"))
    client = ModernClient(proxy.url())
    try:
        finals: dict[str, dict] = {}
        for i in range(12):
            created = (await client.call("slow_compute", {"seconds": 0.12, "label": f"race-{i}"})).result
            await asyncio.sleep(0.02 + 0.01 * i)  # sweep the cancel across the moment the call completes
            ack = await client.request("tasks/cancel", {"taskId": created["taskId"]})
            assert ack.result == {"resultType": "complete"}
            finals[created["taskId"]] = await client.wait_terminal(created["taskId"])
        await asyncio.sleep(0.3)
        for task_id, final in finals.items():
            again = (await client.get(task_id)).result
            assert again["status"] == final["status"] and again.get("result") == final.get("result")
            assert (final["status"] == "completed") == ("result" in final)
        assert {f["status"] for f in finals.values()} <= {"cancelled", "completed"}
    finally:
        await client.close()


async def test_a_legacy_session_belongs_to_the_principal_that_opened_it(
    legacy_url: str, tmp_path: Path, capsys, serve: Serve
) -> None:
    import aiohttp

    auth = {
        "mode": "bearer",
        "tokens": {"alice": hash_token("alice-secret"), "bob": hash_token("bob-secret")},
    }
    init = {
        "jsonrpc": "2.0",
        "id": 0,
        "method": "initialize",
        "params": {
            "protocolVersion": "2025-11-25",
            "capabilities": {},
            "clientInfo": {"name": "t", "version": "1"},
        },
    }
    base = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
    proxy = await serve(with_auth(legacy_url, tmp_path, auth))
    async with aiohttp.ClientSession() as http:
        async with http.post(
            proxy.url(), json=init, headers={**base, "Authorization": "Bearer alice-secret"}
        ) as resp:
            sid = resp.headers["Mcp-Session-Id"]
            await resp.read()
        listing = {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}
        session = {**base, "Mcp-Session-Id": sid, "MCP-Protocol-Version": "2025-11-25"}
        async with http.post(
            proxy.url(), json=listing, headers={**session, "Authorization": "Bearer bob-secret"}
        ) as resp:
            assert resp.status == 404
        async with http.post(
            proxy.url(), json=listing, headers={**session, "Authorization": "Bearer alice-secret"}
        ) as resp:
            assert resp.status == 200
            await resp.read()
    await proxy.stop()
    logs = capsys.readouterr()
    assert "security_foreign_session_access" in logs.out + logs.err


async def test_jwt_keys_fetched_from_a_jwks_url(legacy_url: str, tmp_path: Path, serve: Serve) -> None:
    from aiohttp import web

    key, jwks = _rsa_jwks(tmp_path)

    async def serve_jwks(request: web.Request) -> web.FileResponse:
        return web.FileResponse(jwks)

    app = web.Application()
    app.router.add_get("/.well-known/jwks.json", serve_jwks)
    async with served_app(app) as port:
        auth = {
            "mode": "jwt",
            "jwt": {
                "jwks_url": f"http://127.0.0.1:{port}/.well-known/jwks.json",
                "issuer": "https://idp.test",
                "audience": "mcp-proxy",
                "algorithms": ["RS256"],
            },
        }
        proxy = await serve(with_auth(legacy_url, tmp_path, auth))
        frank = AuthClient(proxy.url(), {"Authorization": f"Bearer {_token(key, sub='frank')}"})
        forged = AuthClient(
            proxy.url(),
            {
                "Authorization": f"Bearer "
                f"{_token(rsa.generate_private_key(public_exponent=65537, key_size=2048), sub='frank')}"
            },
        )
        try:
            created = (await frank.call("slow_compute", {"seconds": 0.1})).result
            assert (await proxy.store.get(created["taskId"])).principal == "frank"
            assert (await forged.get(created["taskId"])).status == 401
        finally:
            await frank.close()
            await forged.close()
        await proxy.stop()
