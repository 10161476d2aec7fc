"""A bounded fuzz of the client-facing endpoint (hypothesis, loopback, a few hundred cases): every
method of both eras, every header the transport reads, well- and ill-formed bodies, on an HTTP and a
stdio upstream. Every answer must be a JSON-RPC result or error (or an empty 202) with a status below
500, within a bound; afterwards the proxy is healthy and a task stored before the fuzz is intact.

`subscriptions/listen` is left out on purpose: its answer is a stream that lasts as long as the client
keeps it open, which no per-request bound can judge."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from pathlib import Path
from typing import Any

import aiohttp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.clients import ModernClient
from support.proxy import running_proxy
from support.servers import FIXTURE_STDIO

from proxy.config import config_from_data
from proxy.protocol.era import META_CLIENT_CAPABILITIES, META_PROTOCOL_VERSION, TASKS_EXTENSION

MODERN_METHODS = [
    "server/discover",
    "tools/list",
    "tools/call",
    "prompts/list",
    "prompts/get",
    "resources/list",
    "resources/read",
    "resources/templates/list",
    "completion/complete",
    "tasks/get",
    "tasks/update",
    "tasks/cancel",
    "tasks/result",
    "tasks/list",
    "initialize",
    "ping",
    "logging/setLevel",
    "resources/subscribe",
    "notifications/cancelled",
]
LEGACY_METHODS = [
    "initialize",
    "notifications/initialized",
    "ping",
    "tools/list",
    "tools/call",
    "prompts/list",
    "prompts/get",
    "resources/list",
    "resources/read",
    "resources/templates/list",
    "logging/setLevel",
    "completion/complete",
    "tasks/get",
    "notifications/cancelled",
]
TOOLS = [
    "greet",
    "echo_meta",
    "instant_error",
    "failing_job",
    "protocol_error_job",
    "confirm_delete",
    "multi_input",
    "slow_compute",
    "nope",
    "",
]
VERSIONS = ["2026-07-28", "2025-11-25", "2025-06-18", "v999", "", "2026-07-28, 2025-11-25"]

ascii_text = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=40)
json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63)
    | st.floats(allow_nan=False)
    | st.text(max_size=30)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)
ids = st.one_of(
    st.integers(-5, 2**40),
    st.text(max_size=12),
    st.none(),
    st.booleans(),
    st.floats(allow_nan=False),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    st.lists(st.integers(), max_size=2),
)
arguments = st.fixed_dictionaries(
    {},
    optional={
        "name": st.text(max_size=20),
        "seconds": st.floats(0, 0.05),
        "label": st.text(max_size=10),
        "filename": st.text(max_size=10),
        "kb": st.integers(0, 4),
        "extra": json_values,
    },
)


@st.composite
def meta(draw: st.DrawFn) -> Any:
    choice = draw(st.integers(0, 4))
    if choice == 0:
        return draw(json_values)
    caps = draw(
        st.sampled_from([{}, {"extensions": {TASKS_EXTENSION: {}}}, {"elicitation": {}}, {"extensions": "x"}])
    )
    result: dict[str, Any] = {
        META_PROTOCOL_VERSION: draw(st.sampled_from(VERSIONS)),
        META_CLIENT_CAPABILITIES: caps,
    }
    if choice == 1:
        result.pop(draw(st.sampled_from([META_PROTOCOL_VERSION, META_CLIENT_CAPABILITIES])))
    if draw(st.booleans()):
        result["progressToken"] = draw(ids)
    return result


@st.composite
def params(draw: st.DrawFn, method: str) -> Any:
    if draw(st.integers(0, 9)) == 0:
        return draw(json_values)
    out: dict[str, Any] = {}
    if method in ("tools/call", "prompts/get"):
        out["name"] = draw(st.sampled_from(TOOLS) | st.text(max_size=10) | json_scalars)
        out["arguments"] = draw(arguments | json_values)
    elif method == "resources/read":
        out["uri"] = draw(st.sampled_from(["test://static-text", "test://nope", ""]) | json_scalars)
    elif method.startswith("tasks/"):
        out["taskId"] = draw(st.sampled_from(["TASK"]) | st.text(max_size=20) | json_scalars)
        if draw(st.booleans()):
            out["inputResponses"] = draw(json_values)
    elif method == "initialize":
        out = {
            "protocolVersion": draw(st.sampled_from(VERSIONS)),
            "capabilities": draw(st.just({}) | json_values),
            "clientInfo": {"name": "fuzz", "version": "0"},
        }
    if draw(st.booleans()):
        out["requestState"] = draw(st.text(max_size=40) | json_scalars)
    if draw(st.integers(0, 3)):
        out["_meta"] = draw(meta())
    return out


@st.composite
def cases(draw: st.DrawFn) -> dict[str, Any]:
    """A well-formed request of one era (half the time), then none to three mutations of it."""
    modern = draw(st.booleans())
    method = draw(st.sampled_from(MODERN_METHODS if modern else LEGACY_METHODS))
    message: dict[str, Any] = {"jsonrpc": "2.0", "method": method}
    if not method.startswith("notifications/"):
        message["id"] = draw(st.integers(0, 2**31) | st.text(min_size=1, max_size=8))
    p = draw(params(method)) if draw(st.integers(0, 3)) == 0 else _valid_params(draw, method, modern)
    if p is not None:
        message["params"] = p
    headers = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
    if modern:
        headers |= {"MCP-Protocol-Version": "2026-07-28", "Mcp-Method": method}
        name = p.get("name") if method in ("tools/call", "prompts/get") and isinstance(p, dict) else None
        name = p.get("uri") if method == "resources/read" and isinstance(p, dict) else name
        name = p.get("taskId") if method.startswith("tasks/") and isinstance(p, dict) else name
        if isinstance(name, str):
            headers["Mcp-Name"] = _header_safe(name)
    else:
        headers |= {"MCP-Protocol-Version": "2025-11-25"}
        if method != "initialize" and draw(st.integers(0, 4)):
            headers["Mcp-Session-Id"] = "SESSION"
    case = {
        "http_method": "POST",
        "server": draw(st.sampled_from(["http", "stdio"])),
        "headers": headers,
        "message": message,
        "body": None,
    }
    for _ in range(draw(st.integers(0, 3))):
        mutate(draw, case)
    if case["body"] is None:
        case["body"] = json.dumps(case.pop("message")).encode()
    else:
        case.pop("message", None)
    return case


def _valid_params(draw: st.DrawFn, method: str, modern: bool) -> Any:
    out: dict[str, Any] = {}
    if method in ("tools/call",):
        out = {"name": draw(st.sampled_from(TOOLS)), "arguments": draw(arguments)}
    elif method == "prompts/get":
        out = {"name": draw(st.sampled_from(["simple_prompt", "nope"]))}
    elif method == "resources/read":
        out = {"uri": draw(st.sampled_from(["test://static-text", "test://nope"]))}
    elif method.startswith("tasks/"):
        out = {"taskId": draw(st.sampled_from(["TASK", "unknown-task"]))}
    elif method == "initialize":
        out = {
            "protocolVersion": "2025-11-25",
            "capabilities": {},
            "clientInfo": {"name": "fuzz", "version": "0"},
        }
    elif method == "logging/setLevel":
        out = {"level": draw(st.sampled_from(["info", "debug", "loud"]))}
    if modern:
        caps = draw(st.sampled_from([{}, {"extensions": {TASKS_EXTENSION: {}}}, {"elicitation": {}}]))
        out["_meta"] = {META_PROTOCOL_VERSION: "2026-07-28", META_CLIENT_CAPABILITIES: caps}
    return out or None


def mutate(draw: st.DrawFn, case: dict[str, Any]) -> None:
    """One change that makes a request wrong in some way (or merely unusual)."""
    headers, message = case["headers"], case.get("message")
    kind = draw(st.integers(0, 11))
    if kind == 0 and headers:
        headers.pop(draw(st.sampled_from(sorted(headers))))
    elif kind == 1:
        name = draw(
            st.sampled_from(
                [
                    "MCP-Protocol-Version",
                    "Mcp-Method",
                    "Mcp-Name",
                    "Mcp-Session-Id",
                    "Mcp-Param-Name",
                    "Last-Event-ID",
                    "Accept",
                    "Content-Type",
                    "Authorization",
                ]
            )
        )
        headers[name] = draw(
            st.sampled_from(VERSIONS + TOOLS + ["=?base64?Z3JlZXQ=?=", "=?base64?***?="]) | ascii_text
        )
    elif kind == 2:
        headers["Origin"] = draw(
            st.sampled_from(
                ["http://localhost", "http://evil.example", "null", "http://[::1", "http://127.0.0.1:1"]
            )
        )
    elif kind == 3:
        headers["Host"] = draw(
            st.sampled_from(["localhost", "127.0.0.1", "[::1", "evil.example", "[::1]:80", ""])
        )
    elif kind == 4:
        headers["Content-Encoding"] = draw(st.sampled_from(["gzip", "deflate", "br", "identity", "bogus"]))
    elif kind == 5 and message is not None:
        message["id"] = draw(ids)
    elif kind == 6 and message is not None:
        message["jsonrpc"] = draw(st.sampled_from(["1.0", "", 2]))
    elif kind == 7 and message is not None:
        message["params"] = draw(json_values)
    elif kind == 8 and message is not None and isinstance(message.get("params"), dict):
        message["params"]["_meta"] = draw(meta())
    elif kind == 9:
        case["body"] = draw(st.binary(max_size=64))
    elif kind == 10 and message is not None:
        case["body"] = json.dumps(
            draw(
                st.sampled_from([[message], {"jsonrpc": "2.0", "id": 1, "result": {}}, message.get("params")])
            )
        ).encode()
    elif kind == 11:
        case["http_method"] = draw(st.sampled_from(["GET", "DELETE", "PUT"]))
        if case["http_method"] == "GET":
            headers["Accept"] = "text/event-stream"


def _header_safe(text: str) -> str:
    """`text` when it can travel in a header value (a client cannot send control characters)."""
    return text if text.isascii() and text.isprintable() else "x"


def check_answer(status: int, content_type: str, text: str, case: dict[str, Any]) -> None:
    assert status < 500, (status, text[:300], case)
    if not text and (status == 202 or (case["http_method"] == "DELETE" and status < 300)):
        return  # a notification accepted, a session ended
    if content_type.startswith("text/event-stream"):
        # SSE line ends only
        data = [line[6:] for line in re.split(r"\r\n|\r|\n", text) if line.startswith("data: ")]
        assert data, (text[:300], case)
        text = data[-1]
    message = json.loads(text)
    assert isinstance(message, dict) and message.get("jsonrpc") == "2.0", (message, case)
    assert ("result" in message) != ("error" in message), (message, case)
    if "error" in message:
        assert isinstance(message["error"].get("code"), int) and isinstance(
            message["error"].get("message"), str
        ), (message, case)


def test_fuzzed_requests_of_both_eras_never_break_the_proxy(legacy_url: str, tmp_path: Path) -> None:
    config = config_from_data(
        {
            "store": {"path": str(tmp_path / "store"), "durable": False},
            "tasks": {"detach_after": "50ms", "ttl": "10m", "poll_interval": "100ms", "input_timeout": "2s"},
            "mcpServers": {
                "http": {"url": legacy_url, "timeout": "2s", "request_timeout": "2s"},
                "stdio": {**FIXTURE_STDIO, "timeout": "2s", "request_timeout": "2s"},
            },
        }
    )
    loop = asyncio.new_event_loop()
    stack = contextlib.AsyncExitStack()
    try:
        proxy = loop.run_until_complete(stack.enter_async_context(running_proxy(config)))
        http = loop.run_until_complete(_enter_client(stack))
        before = loop.run_until_complete(_stored_task(proxy.url("http")))
        sessions = {
            server: loop.run_until_complete(_legacy_session(http, proxy.url(server)))
            for server in ("http", "stdio")
        }

        async def send(case: dict[str, Any]) -> None:
            body = case["body"].replace(b'"TASK"', json.dumps(before["taskId"]).encode())
            session = sessions[case["server"]]
            if case["http_method"] == "DELETE" and "SESSION" in case["headers"].values():
                # a DELETE may end it: not the shared one
                session = await _legacy_session(http, proxy.url(case["server"]))
            headers = {k: (session if v == "SESSION" else v) for k, v in case["headers"].items()}
            skip = ["Host"] if "Host" in headers else []
            async with asyncio.timeout(10):  # every answer is bounded (the upstream timeouts are 2 s)
                async with http.request(
                    case["http_method"],
                    proxy.url(case["server"]),
                    data=body,
                    headers=headers,
                    skip_auto_headers=skip,
                ) as resp:
                    if case["http_method"] == "GET" and resp.headers.get("Content-Type", "").startswith(
                        "text/event-stream"
                    ):
                        # a session's listen stream: open until the client leaves
                        assert resp.status == 200, case
                        case["status"] = resp.status
                        return
                    text = (await resp.read()).decode("utf-8", errors="replace")
                    check_answer(resp.status, resp.headers.get("Content-Type", ""), text, case)
                    case["status"] = resp.status

        @settings(max_examples=300, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(cases())
        def fuzz(case: dict[str, Any]) -> None:
            loop.run_until_complete(send(case))
            sent.append(case)

        sent: list[dict[str, Any]] = []
        fuzz()
        assert len(sent) >= 250 and {c["server"] for c in sent} == {"http", "stdio"}
        versions = {c["headers"].get("MCP-Protocol-Version") for c in sent}
        assert {"2026-07-28", "2025-11-25"} <= versions  # both eras were exercised
        # and many requests got through to a real answer
        assert sum(1 for c in sent if c["status"] == 200) >= 20
        after = loop.run_until_complete(_stored_task(proxy.url("http"), before["taskId"]))
        assert after == before
        assert loop.run_until_complete(_status(f"{proxy.base}/healthz", http)) == 200
    finally:
        loop.run_until_complete(stack.aclose())
        loop.close()


async def _stored_task(url: str, task_id: str | None = None) -> dict[str, Any]:
    """Create a completed task (or read `task_id` back): its DetailedTask, without volatile fields."""
    client = ModernClient(url)
    try:
        if task_id is None:
            created = (await client.call("slow_compute", {"seconds": 0.1, "label": "before the fuzz"})).result
            task_id = created["taskId"]
        task = await client.wait_terminal(task_id)
        return {k: v for k, v in task.items() if k not in ("pollIntervalMs", "ttlMs")}
    finally:
        await client.close()


async def _legacy_session(http: aiohttp.ClientSession, url: str) -> str:
    """A legacy session id (initialize + initialized) for the fuzz's legacy requests to use."""
    init = {
        "jsonrpc": "2.0",
        "id": 0,
        "method": "initialize",
        "params": {
            "protocolVersion": "2025-11-25",
            "capabilities": {},
            "clientInfo": {"name": "fuzz", "version": "0"},
        },
    }
    headers = {
        "Content-Type": "application/json",
        "Accept": "application/json, text/event-stream",
        "MCP-Protocol-Version": "2025-11-25",
    }
    async with http.post(url, json=init, headers=headers) as resp:
        sid = resp.headers["Mcp-Session-Id"]
        await resp.read()
    note = {"jsonrpc": "2.0", "method": "notifications/initialized"}
    async with http.post(url, json=note, headers={**headers, "Mcp-Session-Id": sid}) as resp:
        await resp.read()
    return sid


async def _enter_client(stack: contextlib.AsyncExitStack) -> aiohttp.ClientSession:
    return await stack.enter_async_context(aiohttp.ClientSession(auto_decompress=False))


async def _status(url: str, http: aiohttp.ClientSession) -> int:
    async with http.get(url) as resp:
        return resp.status
