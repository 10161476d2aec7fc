"""proxy.protocol and proxy.tasks.model wire shapes: pure unit tests, no sockets."""

from __future__ import annotations

import base64
import copy
import re

import pytest
from multidict import CIMultiDict

from proxy.protocol.era import (
    META_CLIENT_CAPABILITIES,
    META_CLIENT_INFO,
    META_LOG_LEVEL,
    META_PROTOCOL_VERSION,
    META_RELATED_TASK,
    MODERN_VERSION,
    TASKS_EXTENSION,
    Envelope,
    check_headers,
    decode_header_value,
    is_modern_request,
    parse_envelope,
    strip_envelope,
    upstream_capabilities,
)
from proxy.protocol.jsonrpc import (
    HEADER_MISMATCH,
    INTERNAL_ERROR,
    INVALID_PARAMS,
    INVALID_REQUEST,
    UNSUPPORTED_PROTOCOL_VERSION,
    JsonRpcError,
    TooDeepError,
    http_status_for,
    is_notification,
    is_request,
    is_response,
    loads,
    safe_to_resend,
    validate_request,
)
from proxy.protocol.translate import CACHEABLE_METHODS, modern_error, modern_result
from proxy.tasks.model import TaskRecord, TaskStatus, TerminalTaskError, check_transition, iso
from proxy.tasks.wire_v2 import create_task_result, detailed_task, wire_task

META = {META_PROTOCOL_VERSION: MODERN_VERSION, META_CLIENT_CAPABILITIES: {}}


def b64(text: str) -> str:
    return "=?base64?" + base64.b64encode(text.encode()).decode() + "?="


def body(method: str = "tools/call", **params) -> dict:
    return {"jsonrpc": "2.0", "id": 1, "method": method, "params": {**params, "_meta": dict(META)}}


def headers(
    method: str = "tools/call", name: str | None = "echo", version: str | None = MODERN_VERSION, **extra
) -> CIMultiDict:
    h: CIMultiDict = CIMultiDict({"Content-Type": "application/json"})
    if version is not None:
        h["MCP-Protocol-Version"] = version
    if method is not None:
        h["Mcp-Method"] = method
    if name is not None:
        h["Mcp-Name"] = name
    for k, v in extra.items():
        h[k.replace("_", "-")] = v
    return h


def envelope_of(b: dict) -> Envelope:
    return parse_envelope(b["params"])


def rpc_error(fn, *args) -> JsonRpcError:
    with pytest.raises(JsonRpcError) as info:
        fn(*args)
    return info.value


# --- era detection ------------------------------------------------------------------------------


def test_bare_initialize_is_legacy():
    init = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {"protocolVersion": "2025-11-25", "capabilities": {}},
    }
    assert not is_modern_request(CIMultiDict(), init)
    # even with the modern version header
    assert not is_modern_request(CIMultiDict({"MCP-Protocol-Version": MODERN_VERSION}), init)


def test_initialize_with_meta_is_modern():
    assert is_modern_request(CIMultiDict(), body("initialize"))


def test_session_id_is_legacy_even_with_meta():
    assert not is_modern_request(CIMultiDict({"Mcp-Session-Id": "abc"}), body("tools/call", name="echo"))
    assert not is_modern_request(
        CIMultiDict({"mcp-session-id": "abc", "MCP-Protocol-Version": MODERN_VERSION}), body()
    )


def test_modern_envelope_is_modern():
    assert is_modern_request(CIMultiDict(), body("tools/list"))
    assert is_modern_request(CIMultiDict({"MCP-Protocol-Version": "2025-11-25"}), body("tools/list"))


def test_legacy_meta_without_the_envelope_stays_legacy():
    call = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "tools/call",
        "params": {"name": "t", "_meta": {"progressToken": "p"}},
    }
    assert not is_modern_request(CIMultiDict({"MCP-Protocol-Version": "2025-11-25"}), call)
    assert not is_modern_request(CIMultiDict(), call)
    # then -32602 for the envelope
    assert is_modern_request(CIMultiDict({"MCP-Protocol-Version": "2026-07-28"}), call)


def test_meta_must_be_an_object():
    b = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {"_meta": "nope"}}
    assert not is_modern_request(CIMultiDict(), b)


def test_modern_header_without_meta_is_modern():
    b = {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}
    assert is_modern_request(CIMultiDict({"MCP-Protocol-Version": MODERN_VERSION}), b)
    assert is_modern_request(CIMultiDict({"mcp-protocol-version": f" {MODERN_VERSION} "}), b)
    # an unknown future revision is not legacy either
    assert is_modern_request(CIMultiDict({"MCP-Protocol-Version": "2027-01-01"}), b)


@pytest.mark.parametrize("version", ["2025-11-25", "2025-06-18", "2025-03-26", "2024-11-05"])
def test_legacy_header_without_meta_is_legacy(version: str):
    b = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}}
    assert not is_modern_request(CIMultiDict({"MCP-Protocol-Version": version}), b)


def test_no_header_no_meta_is_legacy():
    assert not is_modern_request(CIMultiDict(), {"jsonrpc": "2.0", "id": 1, "method": "tools/list"})
    assert not is_modern_request(CIMultiDict(), [{"jsonrpc": "2.0"}])


# --- envelope -----------------------------------------------------------------------------------


def test_parse_envelope_reads_fields():
    caps = {"extensions": {TASKS_EXTENSION: {}}, "elicitation": {}}
    env = parse_envelope(
        {
            "_meta": {
                META_PROTOCOL_VERSION: MODERN_VERSION,
                META_CLIENT_CAPABILITIES: caps,
                META_CLIENT_INFO: {"name": "c"},
                META_LOG_LEVEL: "debug",
            }
        }
    )
    assert env == Envelope(MODERN_VERSION, caps, {"name": "c"}, "debug")
    assert env.declares_tasks


@pytest.mark.parametrize(
    "caps",
    [
        {},
        {"extensions": {}},
        {"extensions": {TASKS_EXTENSION: True}},
        {"extensions": [TASKS_EXTENSION]},
        {"tasks": {}},
    ],
)
def test_declares_tasks_needs_the_extension_object(caps: dict):
    assert not parse_envelope(
        {"_meta": {META_PROTOCOL_VERSION: MODERN_VERSION, META_CLIENT_CAPABILITIES: caps}}
    ).declares_tasks


@pytest.mark.parametrize(
    "params",
    [
        None,
        {},
        {"_meta": None},
        {"_meta": []},
        {"_meta": {META_CLIENT_CAPABILITIES: {}}},
        {"_meta": {META_PROTOCOL_VERSION: "", META_CLIENT_CAPABILITIES: {}}},
        {"_meta": {META_PROTOCOL_VERSION: 20260728, META_CLIENT_CAPABILITIES: {}}},
        {"_meta": {META_PROTOCOL_VERSION: MODERN_VERSION}},
        {"_meta": {META_PROTOCOL_VERSION: MODERN_VERSION, META_CLIENT_CAPABILITIES: []}},
        {"_meta": {META_PROTOCOL_VERSION: MODERN_VERSION, META_CLIENT_CAPABILITIES: None}},
    ],
)
def test_parse_envelope_errors(params):
    err = rpc_error(parse_envelope, params)
    assert err.code == INVALID_PARAMS
    assert err.http_status == 400


def test_parse_envelope_ignores_bad_optional_fields():
    env = parse_envelope({"_meta": {**META, META_CLIENT_INFO: "x", META_LOG_LEVEL: 3}})
    assert env.client_info is None and env.log_level is None


def test_strip_envelope_keeps_other_meta():
    params = {
        "name": "t",
        "arguments": {"a": 1},
        "task": {"ttl": 1},
        "inputResponses": {},
        "requestState": "x",
        "_meta": {**META, "progressToken": 7, META_CLIENT_INFO: {}, META_LOG_LEVEL: "info"},
    }
    original = copy.deepcopy(params)
    assert strip_envelope(params) == {"name": "t", "arguments": {"a": 1}, "_meta": {"progressToken": 7}}
    assert params == original
    assert strip_envelope({"name": "t", "_meta": dict(META)}) == {"name": "t"}


def test_upstream_capabilities():
    caps = {
        "elicitation": {"form": {}},
        "sampling": {},
        "roots": {"listChanged": True},
        "extensions": {TASKS_EXTENSION: {}},
        "tasks": {},
        "x": 1,
    }
    assert upstream_capabilities(caps) == {
        "elicitation": {"form": {}},
        "sampling": {},
        "roots": {"listChanged": True},
    }
    # a bare `true`, as some clients write it, is declared; `false` and `null` are not
    assert upstream_capabilities({"elicitation": True, "sampling": False, "roots": None}) == {
        "elicitation": {}
    }


# --- routing headers ----------------------------------------------------------------------------


def test_check_headers_accepts_a_good_request():
    b = body("tools/call", name="echo", arguments={})
    check_headers(headers("tools/call", "echo"), b, envelope_of(b))


def test_header_names_are_case_insensitive():
    b = body("tools/call", name="echo")
    h = CIMultiDict({"mcp-protocol-version": MODERN_VERSION, "MCP-METHOD": "tools/call", "mcp-name": "echo"})
    check_headers(h, b, envelope_of(b))


def test_mismatched_version_header():
    b = body("tools/call", name="echo")
    err = rpc_error(check_headers, headers(version="2025-11-25"), b, envelope_of(b))
    assert err.code == HEADER_MISMATCH
    assert err.http_status == 400
    assert "MCP-Protocol-Version" in err.message


def test_mismatch_is_checked_before_unsupported_version():
    b = body("tools/call", name="echo")
    b["params"]["_meta"][META_PROTOCOL_VERSION] = "2099-01-01"
    err = rpc_error(check_headers, headers(version=MODERN_VERSION), b, envelope_of(b))
    assert err.code == HEADER_MISMATCH


def test_unsupported_version():
    b = body("tools/call", name="echo")
    b["params"]["_meta"][META_PROTOCOL_VERSION] = "2099-01-01"
    err = rpc_error(check_headers, headers(version="2099-01-01"), b, envelope_of(b))
    assert err.code == UNSUPPORTED_PROTOCOL_VERSION
    assert err.data == {"supported": [MODERN_VERSION], "requested": "2099-01-01"}
    assert err.to_error() == {"code": -32022, "message": err.message, "data": err.data}
    assert err.http_status == 400


def test_unsupported_version_without_header():
    b = body("tools/call", name="echo")
    b["params"]["_meta"][META_PROTOCOL_VERSION] = "2025-11-25"
    err = rpc_error(check_headers, headers(version=None), b, envelope_of(b))
    assert err.code == UNSUPPORTED_PROTOCOL_VERSION
    assert err.data["requested"] == "2025-11-25"


def test_missing_version_header():
    b = body("tools/call", name="echo")
    err = rpc_error(check_headers, headers(version=None), b, envelope_of(b))
    assert err.code == HEADER_MISMATCH and "missing MCP-Protocol-Version" in err.message


def test_missing_method_header():
    b = body("tools/call", name="echo")
    err = rpc_error(check_headers, headers(method=None), b, envelope_of(b))
    assert err.code == HEADER_MISMATCH and "Mcp-Method" in err.message


def test_mismatched_method_header():
    b = body("tools/call", name="echo")
    err = rpc_error(check_headers, headers(method="tools/list"), b, envelope_of(b))
    assert err.code == HEADER_MISMATCH and "Mcp-Method" in err.message


def test_duplicate_header_is_refused():
    b = body("tools/call", name="echo")
    h = headers()
    h.add("Mcp-Method", "tools/call")
    assert rpc_error(check_headers, h, b, envelope_of(b)).code == HEADER_MISMATCH


@pytest.mark.parametrize(
    ("method", "field", "value"),
    [
        ("tools/call", "name", "echo"),
        ("prompts/get", "name", "greet"),
        ("resources/read", "uri", "file:///a.txt"),
    ],
)
def test_mcp_name_required(method: str, field: str, value: str):
    b = body(method, **{field: value})
    check_headers(headers(method, value), b, envelope_of(b))
    missing = rpc_error(check_headers, headers(method, None), b, envelope_of(b))
    assert missing.code == HEADER_MISMATCH and "Mcp-Name" in missing.message
    wrong = rpc_error(check_headers, headers(method, value + "x"), b, envelope_of(b))
    assert wrong.code == HEADER_MISMATCH and "Mcp-Name" in wrong.message


@pytest.mark.parametrize("method", ["tasks/get", "tasks/update", "tasks/cancel"])
def test_mcp_name_optional_but_checked_for_tasks(method: str):
    b = body(method, taskId="abc123")
    check_headers(headers(method, None), b, envelope_of(b))
    check_headers(headers(method, "abc123"), b, envelope_of(b))
    err = rpc_error(check_headers, headers(method, "other"), b, envelope_of(b))
    assert err.code == HEADER_MISMATCH


def test_mcp_name_for_non_string_task_id():
    b = body("tasks/get", taskId=42)
    check_headers(headers("tasks/get", "42"), b, envelope_of(b))
    assert rpc_error(check_headers, headers("tasks/get", "43"), b, envelope_of(b)).code == HEADER_MISMATCH


def test_mcp_name_not_checked_for_other_methods():
    b = body("tools/list")
    check_headers(headers("tools/list", None), b, envelope_of(b))
    check_headers(headers("tools/list", "whatever"), b, envelope_of(b))


def test_base64_header_values_are_decoded():
    name = "déployer/prod ✓"
    b = body("tools/call", name=name)
    check_headers(headers("tools/call", b64(name)), b, envelope_of(b))
    b2 = body("tools/call", name="echo")
    check_headers(headers(b64("tools/call"), b64("echo"), version=b64(MODERN_VERSION)), b2, envelope_of(b2))


def test_malformed_base64_header():
    b = body("tools/call", name="echo")
    err = rpc_error(check_headers, headers("tools/call", "=?base64?!!!not-base64?="), b, envelope_of(b))
    assert err.code == HEADER_MISMATCH and "base64" in err.message
    bad_utf8 = "=?base64?" + base64.b64encode(b"\xff\xfe").decode() + "?="
    assert (
        rpc_error(check_headers, headers("tools/call", bad_utf8), b, envelope_of(b)).code == HEADER_MISMATCH
    )


def test_surrounding_whitespace_accepted():
    b = body("tools/call", name="echo")
    check_headers(headers(" tools/call\t", "  echo ", version=f"\t{MODERN_VERSION} "), b, envelope_of(b))
    assert decode_header_value("  " + b64("x y") + " ") == "x y"


def test_inner_whitespace_is_significant():
    b = body("tools/call", name="echo")
    assert rpc_error(check_headers, headers("tools/call", "ec ho"), b, envelope_of(b)).code == HEADER_MISMATCH


def test_header_values_are_case_sensitive():
    b = body("tools/call", name="echo")
    assert rpc_error(check_headers, headers("tools/call", "Echo"), b, envelope_of(b)).code == HEADER_MISMATCH
    assert rpc_error(check_headers, headers("Tools/Call", "echo"), b, envelope_of(b)).code == HEADER_MISMATCH


def test_plain_value_that_merely_looks_encoded():
    # Only the full =?base64?...?= form is decoded.
    assert decode_header_value("=?base64?abc") == "=?base64?abc"
    assert decode_header_value("x=?base64?YQ==?=") == "x=?base64?YQ==?="


# --- JSON-RPC envelopes -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "msg",
    [
        [],
        [{"jsonrpc": "2.0", "id": 1, "method": "ping"}],
        "ping",
        None,
        {"id": 1, "method": "ping"},
        {"jsonrpc": "1.0", "id": 1, "method": "ping"},
        {"jsonrpc": "2.0", "id": 1, "result": {}},
        {"jsonrpc": "2.0", "id": 1, "error": {"code": 1, "message": "x"}},
        {"jsonrpc": "2.0", "id": 1, "method": ""},
        {"jsonrpc": "2.0", "id": 1, "method": 5},
        {"jsonrpc": "2.0", "id": True, "method": "ping"},
        {"jsonrpc": "2.0", "id": 1.5, "method": "ping"},
        {"jsonrpc": "2.0", "id": None, "method": "ping"},
        {"jsonrpc": "2.0", "id": [1], "method": "ping"},
        {"jsonrpc": "2.0", "id": {"a": 1}, "method": "ping"},
        {"jsonrpc": "2.0", "id": 1, "method": "ping", "params": [1, 2]},
    ],
)
def test_validate_request_refuses(msg):
    err = rpc_error(validate_request, msg)
    assert err.code == INVALID_REQUEST
    assert err.http_status == 400


@pytest.mark.parametrize(
    "msg",
    [
        {"jsonrpc": "2.0", "id": 1, "method": "ping"},
        {"jsonrpc": "2.0", "id": "abc", "method": "tools/list", "params": {}},
        {"jsonrpc": "2.0", "id": 0, "method": "ping"},
        {"jsonrpc": "2.0", "method": "notifications/initialized"},
    ],
)
def test_validate_request_accepts(msg):
    validate_request(msg)


def test_message_kinds():
    assert is_request({"jsonrpc": "2.0", "id": 1, "method": "x"})
    assert is_notification({"jsonrpc": "2.0", "method": "x"})
    assert is_response({"jsonrpc": "2.0", "id": 1, "result": {}})
    assert not is_response({"jsonrpc": "2.0", "id": 1, "method": "x", "result": {}})
    assert not is_request([1])


def test_http_status_mapping():
    assert http_status_for(-32601) == 404
    assert http_status_for(INVALID_PARAMS) == 400
    assert http_status_for(INTERNAL_ERROR) == 200
    assert http_status_for(-1) == 200


def test_error_object_omits_absent_data():
    assert JsonRpcError(INVALID_PARAMS, "bad").to_error() == {"code": -32602, "message": "bad"}
    assert JsonRpcError(INVALID_PARAMS, "bad", {"x": 1}).to_error() == {
        "code": -32602,
        "message": "bad",
        "data": {"x": 1},
    }


# --- legacy → modern translation ----------------------------------------------------------------


def test_result_type_added_and_input_untouched():
    upstream = {"content": [{"type": "text", "text": "hi"}], "isError": False, "structuredContent": {"a": 1}}
    original = copy.deepcopy(upstream)
    out = modern_result("tools/call", upstream)
    assert out == {**original, "resultType": "complete"}
    assert upstream == original
    assert "ttlMs" not in out and "cacheScope" not in out


def test_existing_result_type_kept():
    assert modern_result("tools/call", {"resultType": "task", "taskId": "t"})["resultType"] == "task"


@pytest.mark.parametrize("method", sorted(CACHEABLE_METHODS))
def test_cacheable_methods_get_cache_hints(method: str):
    out = modern_result(method, {"items": []})
    assert out["ttlMs"] == 0 and isinstance(out["ttlMs"], int)
    assert out["cacheScope"] == "private"
    out2 = modern_result(method, {}, cache_ttl_ms=5000, cache_scope="public")
    assert (out2["ttlMs"], out2["cacheScope"]) == (5000, "public")
    # upstream-provided values win
    assert modern_result(method, {"ttlMs": 7, "cacheScope": "public"}, cache_ttl_ms=1)["ttlMs"] == 7


@pytest.mark.parametrize("method", ["tools/call", "prompts/get", "ping", "completion/complete"])
def test_non_cacheable_methods_get_no_cache_hints(method: str):
    out = modern_result(method, {})
    assert "ttlMs" not in out and "cacheScope" not in out


def test_execution_stripped_from_tools():
    upstream = {
        "tools": [
            {"name": "a", "inputSchema": {"type": "object"}, "execution": {"taskSupport": "optional"}},
            {"name": "b", "inputSchema": {"type": "object"}, "annotations": {"readOnlyHint": True}},
        ],
        "nextCursor": "c",
    }
    original = copy.deepcopy(upstream)
    out = modern_result("tools/list", upstream)
    assert out["tools"] == [
        {"name": "a", "inputSchema": {"type": "object"}},
        {"name": "b", "inputSchema": {"type": "object"}, "annotations": {"readOnlyHint": True}},
    ]
    assert out["nextCursor"] == "c"
    assert upstream == original


def test_related_task_meta_stripped():
    out = modern_result(
        "tools/call", {"content": [], "_meta": {META_RELATED_TASK: {"taskId": "x"}, "other": 1}}
    )
    assert out["_meta"] == {"other": 1}
    out = modern_result("tools/call", {"content": [], "_meta": {META_RELATED_TASK: {"taskId": "x"}}})
    assert "_meta" not in out
    out = modern_result("tools/call", {"content": [], "_meta": {"keep": True}})
    assert out["_meta"] == {"keep": True}


def test_error_codes_mapped():
    assert modern_error({"code": -32002, "message": "Resource not found", "data": {"uri": "x"}}) == {
        "code": -32602,
        "message": "Resource not found",
        "data": {"uri": "x"},
    }
    url = modern_error({"code": -32042, "message": "open this", "data": {"elicitations": [1]}})
    assert url["code"] == -32603
    assert "URL elicitation" in url["message"] and "open this" in url["message"]
    assert url["data"] == {"elicitations": [1]}
    assert "data" not in modern_error({"code": -32042, "message": "m"})


def test_other_errors_pass_through_as_copies():
    err = {"code": -32601, "message": "Method not found", "data": {"nested": [1]}}
    out = modern_error(err)
    assert out == err and out is not err
    out["data"]["nested"].append(2)
    assert err["data"]["nested"] == [1]
    assert modern_error({"code": 5, "message": 7})["message"] == "7"


@pytest.mark.parametrize(
    "bad", [None, "boom", {"message": "x"}, {"code": "1", "message": "x"}, {"code": True, "message": "x"}]
)
def test_malformed_errors_become_internal(bad):
    out = modern_error(bad)
    assert out["code"] == INTERNAL_ERROR
    assert out["data"] == {"upstreamError": bad}


# --- task record wire shapes --------------------------------------------------------------------

ISO_RE = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{3}Z$")


def task(**kw) -> TaskRecord:
    base = dict(
        task_id="tid",
        principal="p",
        server="s",
        tool="t",
        created_ms=1_700_000_000_123,
        ttl_ms=60_000,
        poll_interval_ms=500,
        owner="n",
    )
    record = TaskRecord(**{**base, **kw})
    if record.status.terminal:
        record.terminal_ms = record.last_updated_ms
    return record


def test_iso_timestamps():
    assert iso(1_700_000_000_123) == "2023-11-14T22:13:20.123Z"
    assert iso(0) == "1970-01-01T00:00:00.000Z"
    assert iso(5) == "1970-01-01T00:00:00.005Z"


def test_create_task_result_shape():
    rec = task()
    out = create_task_result(rec)
    assert out.keys() == {
        "resultType",
        "taskId",
        "status",
        "createdAt",
        "lastUpdatedAt",
        "ttlMs",
        "pollIntervalMs",
    }
    assert {k: v for k, v in out.items() if k != "ttlMs"} == {
        "resultType": "task",
        "taskId": "tid",
        "status": "working",
        "createdAt": "2023-11-14T22:13:20.123Z",
        "lastUpdatedAt": "2023-11-14T22:13:20.123Z",
        "pollIntervalMs": 500,
    }
    assert wire_task(rec, at_ms=rec.created_ms)["ttlMs"] == 60_000
    assert wire_task(rec, at_ms=rec.created_ms + 5_000)["ttlMs"] == 65_000  # grows while it runs
    assert "task" not in out  # flat, not wrapped
    with_msg = create_task_result(task(status_message="running"))
    assert with_msg["statusMessage"] == "running"
    assert create_task_result(task(ttl_ms=None))["ttlMs"] is None


def test_detailed_task_working():
    out = detailed_task(task(last_updated_ms=1_700_000_001_000))
    assert out["resultType"] == "complete"
    assert out["status"] == "working"
    assert ISO_RE.match(out["createdAt"]) and out["lastUpdatedAt"] == "2023-11-14T22:13:21.000Z"
    assert not {"result", "error", "inputRequests"} & out.keys()


def test_detailed_task_completed():
    result = {"content": [{"type": "text", "text": "ok"}], "isError": False}
    out = detailed_task(
        task(status=TaskStatus.COMPLETED, outcome={"result": result}, last_updated_ms=1_700_000_002_123)
    )
    assert out["status"] == "completed" and out["result"] == {**result, "resultType": "complete"}
    assert out["ttlMs"] == 62_000  # createdAt + ttlMs = the end of retention, fixed once terminal
    assert not {"error", "inputRequests"} & out.keys()


def test_detailed_task_failed():
    error = {"code": -32603, "message": "upstream unreachable"}
    out = detailed_task(
        task(status=TaskStatus.FAILED, outcome={"error": error}, status_message="upstream unreachable")
    )
    assert (
        out["status"] == "failed" and out["error"] == error and out["statusMessage"] == "upstream unreachable"
    )
    assert not {"result", "inputRequests"} & out.keys()


def test_detailed_task_renders_the_raw_upstream_outcome():
    legacy = {"content": [], "_meta": {"io.modelcontextprotocol/related-task": {"taskId": "x"}}}
    assert detailed_task(task(status=TaskStatus.COMPLETED, outcome={"result": legacy}))["result"] == {
        "content": [],
        "resultType": "complete",
    }
    assert (
        detailed_task(task(status=TaskStatus.FAILED, outcome={"error": {"code": -32002, "message": "gone"}}))[
            "error"
        ]["code"]
        == -32602
    )


def test_detailed_task_input_required():
    requests = {"k1": {"method": "elicitation/create", "params": {"message": "Deploy?"}}}
    rec = task(status=TaskStatus.INPUT_REQUIRED, input_requests=requests)
    out = detailed_task(rec)
    assert out["status"] == "input_required" and out["inputRequests"] == requests
    out["inputRequests"]["k2"] = {}
    assert "k2" not in rec.input_requests  # a copy
    assert detailed_task(task(status=TaskStatus.INPUT_REQUIRED))["inputRequests"] == {}


def test_detailed_task_cancelled():
    out = detailed_task(task(status=TaskStatus.CANCELLED, outcome={"result": {"content": []}}))
    assert out["status"] == "cancelled"
    assert not {"result", "error", "inputRequests"} & out.keys()


def test_status_from_string():
    assert task(status="completed").status is TaskStatus.COMPLETED
    with pytest.raises(ValueError):
        task(status="done")


@pytest.mark.parametrize("terminal", [TaskStatus.COMPLETED, TaskStatus.FAILED, TaskStatus.CANCELLED])
@pytest.mark.parametrize("new", list(TaskStatus))
def test_check_transition_from_terminal(terminal: TaskStatus, new: TaskStatus):
    assert terminal.terminal
    with pytest.raises(TerminalTaskError):
        check_transition(terminal, new)


@pytest.mark.parametrize("current", [TaskStatus.WORKING, TaskStatus.INPUT_REQUIRED])
@pytest.mark.parametrize("new", list(TaskStatus))
def test_check_transition_from_live(current: TaskStatus, new: TaskStatus):
    assert not current.terminal
    check_transition(current, new)


@pytest.mark.parametrize("text", ["[" * 5000 + "]" * 5000, '{"a":' * 5000 + "1" + "}" * 5000])
def test_text_too_deep_to_parse_is_a_value_error_never_a_recursion_error(text: str) -> None:
    """Every reader of client, upstream and token-endpoint JSON refuses it as it refuses text that
    is not JSON (a RecursionError escaped `except ValueError` in the stdio reader and killed it)."""
    for raw in (text, text.encode()):
        with pytest.raises(TooDeepError) as caught:
            loads(raw)
        assert isinstance(caught.value, ValueError)


@pytest.mark.parametrize(
    ("message", "safe"),
    [
        ({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "x"}}, False),
        ({"jsonrpc": "2.0", "id": 1, "method": "tasks/cancel", "params": {"taskId": "t"}}, False),
        ({"jsonrpc": "2.0", "id": 1, "method": "vendor/anything"}, False),
        ({"jsonrpc": "2.0", "id": 1, "method": "tools/list"}, True),
        ({"jsonrpc": "2.0", "id": 1, "method": "resources/read", "params": {"uri": "x"}}, True),
        ({"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 1}}, True),
        ({"jsonrpc": "2.0", "id": 5, "result": {"action": "accept"}}, True),  # an answer to elicitation
        ({"jsonrpc": "2.0", "id": 5, "error": {"code": -32601, "message": "no"}}, True),
        ({"jsonrpc": "2.0", "id": 5}, False),
        ("not a message", False),
    ],
)
def test_what_may_be_sent_again_on_a_fresh_connection(message: object, safe: bool) -> None:
    """A message lost on a stale pooled connection goes again only when a second copy does what the
    first did: never a `tools/call` (it may act, and must not run twice); an answer to one of the
    server's questions does (lost, the server's call would wait for it until its timeout)."""
    assert safe_to_resend(message) is safe
