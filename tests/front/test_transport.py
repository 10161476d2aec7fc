"""Bad input of every kind gets a clear JSON-RPC error with the right code and HTTP status,
and the proxy keeps serving (2026-07-28 transport rules, conformance.md §6.6)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import pytest
from support.clients import ModernClient, envelope
from support.console import console_config
from support.proxy import RunningProxy, running_proxy

BASE_HEADERS = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}


def modern_headers(method: str, **extra: str) -> dict[str, str]:
    return {**BASE_HEADERS, "MCP-Protocol-Version": "2026-07-28", "Mcp-Method": method, **extra}


async def test_malformed_json_is_a_parse_error(client: ModernClient) -> None:
    reply = await client.post_raw(b"{not json", modern_headers("tools/list"))
    assert reply.status == 400 and reply.error["code"] == -32700 and reply.message["id"] is None


async def test_an_integer_too_long_to_read_is_a_parse_error_that_says_so(client: ModernClient) -> None:
    """A 5,000-digit id: -32700 naming the number's length, not Python's own advice."""
    body = b'{"jsonrpc": "2.0", "id": ' + b"7" * 5000 + b', "method": "tools/list"}'
    reply = await client.post_raw(body, modern_headers("tools/list"))
    assert reply.status == 400 and reply.error["code"] == -32700 and reply.message["id"] is None
    assert (
        reply.error["message"]
        == "the body is not valid JSON: a number has more than 4300 digits, too long to read"
    )


async def test_errors_before_the_body_is_read_are_compact_json_like_the_rest(client: ModernClient) -> None:
    """A GET without a session (refused before any body) and a body past max_body: the same
    compact JSON as every other reply (no spaces after `,` and `:`)."""
    async with client.http.get(client.url) as resp:
        assert resp.status == 405
        assert (await resp.read()).startswith(b'{"jsonrpc":"2.0","id":null,"error":{"code":-32600,')
    huge = b"x" * (5 * 1024 * 1024)  # past the default max_body (4 MiB)
    async with client.http.post(client.url, data=huge, headers=BASE_HEADERS) as resp:
        assert resp.status == 413 and b'-32600,"message":"request body too large' in await resp.read()


async def test_batch_and_wrong_shapes_are_invalid_requests(client: ModernClient) -> None:
    for body in (
        [{"jsonrpc": "2.0", "id": 1, "method": "tools/list"}],
        {"jsonrpc": "2.0", "id": 1, "result": {}},
        {"jsonrpc": "1.0", "id": 1, "method": "tools/list", "params": {"_meta": envelope()}},
        {"jsonrpc": "2.0", "id": {"x": 1}, "method": "tools/list", "params": {"_meta": envelope()}},
        {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": ["not", "an", "object"]},
    ):
        reply = await client.post_raw(json.dumps(body).encode(), modern_headers("tools/list"))
        assert reply.status == 400 and reply.error["code"] == -32600, body


async def test_missing_envelope_is_invalid_params(client: ModernClient) -> None:
    caps = {"io.modelcontextprotocol/clientCapabilities": {}}
    for meta, message in (
        (None, "missing params._meta"),
        ("x", "params._meta must be an object"),
        (caps, "missing _meta['io.modelcontextprotocol/protocolVersion']"),
        ({**caps, "io.modelcontextprotocol/protocolVersion": 5}, "protocolVersion'] must be a string"),
        ({"io.modelcontextprotocol/protocolVersion": "2026-07-28"}, "clientCapabilities"),
    ):
        params = {} if meta is None else {"_meta": meta}
        body = {"jsonrpc": "2.0", "id": 5, "method": "tools/list", "params": params}
        reply = await client.post_raw(json.dumps(body).encode(), modern_headers("tools/list"))
        assert reply.status == 400 and reply.error["code"] == -32602 and reply.message["id"] == 5
        assert message in reply.error["message"], (meta, reply.error)


async def test_a_name_that_is_not_a_string_is_invalid_params(client: ModernClient) -> None:
    body = {
        "jsonrpc": "2.0",
        "id": 4,
        "method": "tools/call",
        "params": {"name": 5, "arguments": {}, "_meta": envelope()},
    }
    reply = await client.post_raw(
        json.dumps(body).encode(), modern_headers("tools/call", **{"Mcp-Name": "5"})
    )
    assert reply.status == 400 and reply.error == {"code": -32602, "message": "params.name must be a string"}


async def test_a_request_without_method_is_named_so(client: ModernClient) -> None:
    """No `method`: a request without one is named so; a response is refused as one (2026 wire),
    and a legacy response without `id` is told it needs one."""
    reply = await client.post_raw(b'{"jsonrpc": "2.0", "id": 3}', modern_headers("tools/list"))
    assert reply.status == 400 and reply.error == {"code": -32600, "message": "the request has no `method`"}
    answer = await client.post_raw(b'{"jsonrpc": "2.0", "id": 3, "result": {}}', modern_headers("tools/list"))
    assert answer.status == 400 and "not responses" in answer.error["message"]
    legacy = {**BASE_HEADERS, "MCP-Protocol-Version": "2025-11-25"}  # where a client may answer
    unnamed = await client.post_raw(b'{"jsonrpc": "2.0", "result": {}}', legacy)
    assert unnamed.status == 400 and "a response needs the `id`" in unnamed.error["message"]


async def test_version_header_mismatch_then_unsupported_version(client: ModernClient) -> None:
    body = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "tools/list",
        "params": {"_meta": envelope() | {"io.modelcontextprotocol/protocolVersion": "v999.0.0"}},
    }
    mismatch = await client.post_raw(json.dumps(body).encode(), modern_headers("tools/list"))
    assert mismatch.status == 400 and mismatch.error["code"] == -32020
    unsupported = await client.post_raw(
        json.dumps(body).encode(), modern_headers("tools/list", **{"MCP-Protocol-Version": "v999.0.0"})
    )
    assert unsupported.status == 400 and unsupported.error["code"] == -32022
    assert unsupported.error["data"]["requested"] == "v999.0.0"
    discover = (await client.request("server/discover")).result
    assert set(unsupported.error["data"]["supported"]) <= set(discover["supportedVersions"])


async def test_routing_header_rules(client: ModernClient) -> None:
    params = {"name": "greet", "arguments": {"name": "h"}, "_meta": envelope()}
    body = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": params}).encode()
    assert (await client.post_raw(body, modern_headers("tasks/get", **{"Mcp-Name": "greet"}))).error[
        "code"
    ] == -32020
    assert (await client.post_raw(body, modern_headers("TOOLS/CALL", **{"Mcp-Name": "greet"}))).error[
        "code"
    ] == -32020
    # Mcp-Name missing
    assert (await client.post_raw(body, modern_headers("tools/call"))).error["code"] == -32020
    assert (await client.post_raw(body, modern_headers("tools/call", **{"Mcp-Name": "other"}))).error[
        "code"
    ] == -32020
    ok = await client.post_raw(body, modern_headers(" tools/call ", **{"Mcp-Name": "=?base64?Z3JlZXQ=?="}))
    assert ok.result["content"][0]["text"] == "Hello, h!"


async def test_unknown_and_removed_methods_are_404(client: ModernClient) -> None:
    for method in (
        "initialize",
        "ping",
        "logging/setLevel",
        "resources/subscribe",
        "no/such/method",
        "unknown/method",
        "tasks/result",
    ):
        reply = await client.request(method, {})
        assert reply.status == 404 and reply.error["code"] == -32601, method
        # the proxy's own answer, never the upstream's
        assert reply.error["message"].startswith(f"method {method!r}"), reply.error


async def test_oversized_body_is_refused_and_the_proxy_keeps_serving(
    client: ModernClient, proxy: RunningProxy
) -> None:
    limit = proxy.config.listen.max_body
    params = {"name": "greet", "arguments": {"name": "x" * (limit + 10)}}
    reply = await client.request("tools/call", params, headers={"Mcp-Name": "greet"})
    assert reply.status == 413 and reply.error["code"] == -32600 and "too large" in reply.error["message"]
    assert (await client.call("greet", {"name": "after"})).result["content"][0]["text"] == "Hello, after!"


async def test_a_declared_oversized_body_is_refused_at_once(proxy: RunningProxy) -> None:
    """A Content-Length over max_body is answered 413 before any of the body is awaited (not after
    body_timeout)."""
    host, port = proxy.url().split("//")[1].split("/")[0].split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(
            f"POST /mcp HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: "
            f"10000000000\r\n\r\n{{}}".encode()
        )
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 3)
    finally:
        writer.close()
    assert head.startswith(b"HTTP/1.1 413")


async def test_hostile_host_and_origin_are_rejected(proxy: RunningProxy) -> None:
    body = {"jsonrpc": "2.0", "id": 1, "method": "server/discover", "params": {"_meta": envelope()}}
    async with aiohttp.ClientSession() as http:
        for extra in ({"Host": "evil.example.com"}, {"Origin": "http://evil.example.com"}):
            async with http.post(
                proxy.url(), json=body, headers={**modern_headers("server/discover"), **extra}
            ) as resp:
                assert resp.status == 403
                assert (await resp.json())["error"]["code"] == -32600
        async with http.post(
            proxy.url(),
            json=body,
            headers={**modern_headers("server/discover"), "Origin": "http://localhost:3000"},
        ) as resp:
            assert resp.status == 200


async def test_notification_is_accepted_with_202(client: ModernClient) -> None:
    body = {"jsonrpc": "2.0", "method": "notifications/whatever", "params": {"_meta": envelope()}}
    async with client.http.post(
        client.url, json=body, headers=modern_headers("notifications/whatever")
    ) as resp:
        assert resp.status == 202


async def test_get_and_delete_without_session_are_405(proxy: RunningProxy) -> None:
    async with aiohttp.ClientSession() as http:
        for method in ("GET", "DELETE"):
            async with http.request(method, proxy.url(), headers={"Accept": "text/event-stream"}) as resp:
                assert resp.status == 405


async def test_discover_advertises_tasks_and_caching_fields(client: ModernClient) -> None:
    result = (await client.request("server/discover")).result
    assert result["resultType"] == "complete"
    assert "2026-07-28" in result["supportedVersions"]
    assert result["capabilities"]["extensions"]["io.modelcontextprotocol/tasks"] == {}
    assert "tasks" not in result["capabilities"]
    assert isinstance(result["ttlMs"], int) and result["cacheScope"] in ("public", "private")
    assert result["_meta"]["io.modelcontextprotocol/serverInfo"]["name"] == "mcp-tasks-proxy"


async def test_forwarded_lists_are_stamped(client: ModernClient) -> None:
    for method, key in (
        ("tools/list", "tools"),
        ("prompts/list", "prompts"),
        ("resources/list", "resources"),
    ):
        result = (await client.request(method)).result
        assert (
            result["resultType"] == "complete"
            and "ttlMs" in result
            and "cacheScope" in result
            and key in result
        )
    read = await client.request("resources/read", {"uri": "test://static-text"})
    assert read.result["contents"][0]["text"].startswith("This is static text")
    missing = await client.request("resources/read", {"uri": "test://nope"})
    # resource not found, 2026 code (was -32002)
    assert missing.status == 400 and missing.error["code"] == -32602, missing.message


async def test_envelope_is_not_forwarded_but_other_meta_is(client: ModernClient) -> None:
    reply = await client.call("echo_meta", {}, meta={"acme/trace": "t-1", "progressToken": "p-9"})
    seen = json.loads(reply.result["content"][0]["text"])
    assert seen["meta"]["acme/trace"] == "t-1"
    assert not any(k.startswith("io.modelcontextprotocol/") for k in seen["meta"])
    assert seen["meta"]["progressToken"] != "p-9"  # the proxy's own token, mapped back on relay


async def test_legacy_task_param_is_stripped(client: ModernClient) -> None:
    reply = await client.request(
        "tools/call", {"name": "echo_meta", "arguments": {}, "task": {"ttl": 60000}}, capabilities={}
    )
    assert reply.result["resultType"] == "complete"
    assert "taskId" not in reply.result


def test_accept_preference_for_sse() -> None:
    from proxy.front.endpoint import prefers_sse

    assert prefers_sse("text/event-stream, application/json")
    assert not prefers_sse("application/json, text/event-stream")
    assert prefers_sse("application/json;q=0.5, text/event-stream")
    assert not prefers_sse("text/event-stream;q=0, application/json")
    assert not prefers_sse("text/event-stream") and not prefers_sse(None)  # both must be acceptable


async def test_a_client_that_prefers_sse_gets_its_result_as_one_sse_event(client: ModernClient) -> None:
    body = json.dumps(
        {"jsonrpc": "2.0", "id": 7, "method": "tools/list", "params": {"_meta": envelope()}}
    ).encode()
    headers = {**modern_headers("tools/list"), "Accept": "text/event-stream, application/json"}
    reply = await client.post_raw(body, headers)
    assert reply.status == 200 and reply.content_type.startswith("text/event-stream")
    assert reply.message["id"] == 7 and reply.result["resultType"] == "complete" and reply.result["tools"]
    # Errors keep their HTTP status (and so go out as JSON) whatever the client prefers.
    unknown = await client.post_raw(
        body.replace(b"tools/list", b"nope/nope"), {**headers, "Mcp-Method": "nope/nope"}
    )
    assert unknown.status == 404 and unknown.content_type.startswith("application/json")


async def test_deeply_nested_json_is_a_parse_error_not_a_crash(client: ModernClient) -> None:
    deep = b"[" * 100_000 + b"]" * 100_000
    reply = await client.post_raw(deep, modern_headers("tools/list"))
    assert reply.status == 400 and reply.error["code"] == -32700
    assert (await client.call("greet", {"name": "still here"})).result["content"][0][
        "text"
    ] == "Hello, still here!"


@pytest.mark.parametrize("era", ["modern", "legacy"])
@pytest.mark.parametrize("depth", [129, 980, 1050])
async def test_a_request_nesting_deeper_than_the_limit_is_a_parse_error(
    client: ModernClient, era: str, depth: int
) -> None:
    """A body that parses but nests past MAX_JSON_DEPTH (128) gets -32700 in a 400 on both eras,
    however deep (near 1,000 levels it once parsed, then failed on its way out as a 500)."""
    arguments = b'{"text": "x", "extra": ' + b"[" * depth + b"]" * depth + b"}"
    params = b'{"name": "echo_meta", "arguments": ' + arguments
    if era == "modern":
        params += b', "_meta": ' + json.dumps(envelope()).encode()
        headers = modern_headers("tools/call", **{"Mcp-Name": "echo_meta"})
    else:
        headers = {**BASE_HEADERS, "MCP-Protocol-Version": "2025-11-25"}
    body = b'{"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": ' + params + b"}}"
    reply = await client.post_raw(body, headers)
    assert reply.status == 400 and reply.error["code"] == -32700, reply.message
    assert "128 levels" in reply.error["message"]
    shallow = b"[" * 100 + b"]" * 100
    assert (await client.call("echo_meta", {"nested": json.loads(shallow)})).status == 200


async def test_http_level_refusals_are_json_rpc_errors(proxy: RunningProxy) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.get(proxy.url(), headers={"Accept": "text/event-stream"}) as resp:
            assert resp.status == 405 and resp.headers["Allow"] == "POST"
            assert (await resp.json())["error"]["code"] == -32600
        async with http.post(f"{proxy.base}/servers/nope/mcp", json={}) as resp:
            assert resp.status == 404 and (await resp.json())["error"]["code"] == -32601
        async with http.put(proxy.url(), json={}) as resp:
            assert resp.status == 405 and "error" in await resp.json()


async def test_origin_null_is_rejected_on_loopback(proxy: RunningProxy) -> None:
    body = {"jsonrpc": "2.0", "id": 1, "method": "server/discover", "params": {"_meta": envelope()}}
    async with aiohttp.ClientSession() as http:
        async with http.post(
            proxy.url(), json=body, headers={**modern_headers("server/discover"), "Origin": "null"}
        ) as resp:
            assert resp.status == 403


async def test_max_body_error_names_the_limit(client: ModernClient, proxy: RunningProxy) -> None:
    params = {"name": "greet", "arguments": {"name": "x" * (proxy.config.listen.max_body + 10)}}
    reply = await client.request("tools/call", params, headers={"Mcp-Name": "greet"})
    assert reply.status == 413 and "max_body" in reply.error["message"]


async def test_legacy_client_meta_without_envelope_stays_on_the_legacy_path(proxy: RunningProxy) -> None:
    # A session-less legacy request that carries _meta.progressToken must not be judged by 2026 rules.
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {"_meta": {"progressToken": "p"}}}
    async with aiohttp.ClientSession() as http:
        async with http.post(
            proxy.url(), json=body, headers={**BASE_HEADERS, "MCP-Protocol-Version": "2025-11-25"}
        ) as resp:
            status, reply = resp.status, await resp.json()
    # The upstream answered (a legacy server wants a session first), not the 2026 envelope validator (-32602).
    assert (
        status == 400 and reply["error"]["code"] == -32600 and "session" in reply["error"]["message"].lower()
    ), reply


async def raw_exchange(base: str, request: bytes) -> tuple[bytes, bytes]:
    """Send `request` as raw bytes (what aiohttp's client will not build) to the proxy at `base`
    and read until it closes (10 s at most): (status line and headers, body)."""
    host, port = base.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(request)
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
        await writer.wait_closed()
    head, _, payload = answer.partition(b"\r\n\r\n")
    return head, payload


async def test_an_expect_header_other_than_100_continue_is_a_417_never_a_500(proxy: RunningProxy) -> None:
    """`Expect: 100-continue` still works (aiohttp's client sends it); any other value, bytes that
    are not UTF-8 included, gets HTTP 417 with a JSON-RPC error that does not repeat it."""
    body = (
        b'{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-11-25",'
        b'"capabilities":{},"clientInfo":{"name":"t","version":"0"}}}'
    )
    headers = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
    async with (
        aiohttp.ClientSession() as http,
        http.post(proxy.url(), data=body, headers=headers, expect100=True) as resp,
    ):
        assert resp.status == 200
    for value in (b"\xff\xfe", b"something-else"):
        head, payload = await raw_exchange(
            proxy.base,
            b"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nExpect: "
            + value
            + b"\r\nContent-Length: "
            + str(len(body)).encode()
            + b"\r\nConnection: close\r\n\r\n"
            + body,
        )
        assert head.split()[1] == b"417", head
        assert json.loads(payload)["error"]["code"] == -32600 and value not in payload


async def test_a_non_utf8_expect_header_is_a_417_on_every_path(legacy_url: str, tmp_path: Path) -> None:
    """Served the way the command line serves (`front.listener`): the console, the resource
    metadata and an unknown path, which have aiohttp's own Expect handler, answer 417 too."""
    config = console_config(legacy_url, tmp_path / "store", listen={"public_url": "http://127.0.0.1:1"})
    async with running_proxy(config) as proxy:
        for path in ("/console/", "/console/login", "/.well-known/oauth-protected-resource", "/nope"):
            head, payload = await raw_exchange(
                proxy.base,
                f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n".encode()
                + b"Expect: \xff\xfe\r\nConnection: close\r\n\r\n",
            )
            assert head.split()[1] == b"417", (path, head)
            assert json.loads(payload)["error"]["code"] == -32600
        async with aiohttp.ClientSession() as http, http.get(proxy.base + "/metrics") as resp:
            assert resp.status == 200


async def test_an_oversized_header_is_a_400_that_never_echoes_its_bytes(
    legacy_url: str, tmp_path: Path
) -> None:
    """aiohttp quotes the line it could not read; that may be a token, so neither the answer nor the
    log line repeats it."""
    async with running_proxy(console_config(legacy_url, tmp_path / "store")) as proxy:
        token = b"SECRET" * 4000
        head, payload = await raw_exchange(
            proxy.base,
            b"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " + token + b"\r\n\r\n",
        )
    assert head.split()[1] == b"400", head
    assert b"SECRET" not in payload and b"Bearer" not in payload, payload
