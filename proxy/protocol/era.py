"""Eras of the MCP wire and the 2026-07-28 per-request envelope.

Legacy era: revisions with an `initialize` handshake and `Mcp-Session-Id` (2024-11-05 … 2025-11-25).
Modern era: 2026-07-28, every request carries `params._meta` with the protocol version and the
client capabilities, plus the routing headers `MCP-Protocol-Version`, `Mcp-Method`, `Mcp-Name`
(protocol.md §1.4.1, §4.2; SEP-2243, SEP-2575).
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from proxy.protocol.jsonrpc import (
    HEADER_MISMATCH,
    INVALID_PARAMS,
    METHOD_NOT_FOUND,
    UNSUPPORTED_PROTOCOL_VERSION,
    JsonObject,
    JsonRpcError,
)

MODERN_VERSION = "2026-07-28"
MODERN_VERSIONS = (MODERN_VERSION,)
LEGACY_VERSIONS = ("2025-11-25", "2025-06-18", "2025-03-26", "2024-11-05")
UPSTREAM_VERSION = "2025-11-25"

META_PROTOCOL_VERSION = "io.modelcontextprotocol/protocolVersion"
META_CLIENT_CAPABILITIES = "io.modelcontextprotocol/clientCapabilities"
META_CLIENT_INFO = "io.modelcontextprotocol/clientInfo"
META_LOG_LEVEL = "io.modelcontextprotocol/logLevel"
META_SERVER_INFO = "io.modelcontextprotocol/serverInfo"
META_RELATED_TASK = "io.modelcontextprotocol/related-task"
META_SUBSCRIPTION_ID = "io.modelcontextprotocol/subscriptionId"
ENVELOPE_META_KEYS = (META_PROTOCOL_VERSION, META_CLIENT_CAPABILITIES, META_CLIENT_INFO, META_LOG_LEVEL)

TASKS_EXTENSION = "io.modelcontextprotocol/tasks"

# Server notifications a `subscriptions/listen` stream may carry, by the capability that announces
# them (`capabilities.<key>.listChanged`) and the SubscriptionFilter flag that opts in to them.
LIST_CHANGED_NOTIFICATIONS = {
    "notifications/tools/list_changed": ("tools", "toolsListChanged"),
    "notifications/prompts/list_changed": ("prompts", "promptsListChanged"),
    "notifications/resources/list_changed": ("resources", "resourcesListChanged"),
}

# The client→server requests of each era (protocol.md §1.6). A request outside its era's surface is
# answered -32601 by the proxy itself, never relayed: upstream SDKs disagree on what to say (the
# `mcp` 1.x line answers -32602, "Invalid request parameters", for a method it cannot parse).
MODERN_METHODS = frozenset(
    {
        "server/discover",
        "subscriptions/listen",
        "tools/list",
        "tools/call",
        "prompts/list",
        "prompts/get",
        "resources/list",
        "resources/templates/list",
        "resources/read",
        "completion/complete",
        "tasks/get",
        "tasks/update",
        "tasks/cancel",  # the io.modelcontextprotocol/tasks extension (SEP-2663)
    }
)
# Methods of the legacy era that the 2026-07-28 core removed (the proxy names them in its -32601).
REMOVED_METHODS = frozenset(
    {
        "initialize",
        "ping",
        "logging/setLevel",
        "resources/subscribe",
        "resources/unsubscribe",
        "tasks/result",
        "tasks/list",
    }
)
LEGACY_METHODS = frozenset(
    {
        "initialize",
        "ping",
        "logging/setLevel",
        "tools/list",
        "tools/call",
        "prompts/list",
        "prompts/get",
        "resources/list",
        "resources/templates/list",
        "resources/read",
        "resources/subscribe",
        "resources/unsubscribe",
        "completion/complete",
    }
)
# v1 tasks (2025-11-25 experimental tasks): in the surface unless the client's MCP-Protocol-Version
# names an older revision.
LEGACY_TASK_METHODS = frozenset({"tasks/get", "tasks/result", "tasks/list", "tasks/cancel"})
LEGACY_BEFORE_TASKS = frozenset(LEGACY_VERSIONS) - {"2025-11-25"}

# Methods whose `Mcp-Name` header mirrors a body field (SEP-2243 core table, plus the tasks extension).
NAME_FIELDS = {"tools/call": "name", "prompts/get": "name", "resources/read": "uri"}
TASK_NAME_METHODS = ("tasks/get", "tasks/update", "tasks/cancel")


def is_modern_request(headers: Mapping[str, str], body: Any) -> bool:
    """Decide whether an HTTP POST belongs to the modern (2026-07-28) era.

    Rule (after conformance.md §9.5): never with an `Mcp-Session-Id`; always when `params._meta`
    carries `io.modelcontextprotocol/protocolVersion` (the modern envelope); otherwise by the
    `MCP-Protocol-Version` header: modern unless it names a legacy revision, legacy when absent.
    A bare `initialize` is legacy. So a legacy client that sends `_meta.progressToken` without a
    session stays legacy, and a 2026 request with a broken envelope still reaches modern validation
    (-32602).
    """
    if headers.get("Mcp-Session-Id"):
        return False
    params = body.get("params") if isinstance(body, dict) else None
    meta = params.get("_meta") if isinstance(params, dict) else None
    if isinstance(meta, dict) and META_PROTOCOL_VERSION in meta:
        return True
    if isinstance(body, dict) and body.get("method") == "initialize":
        return False  # a bare initialize starts a legacy session, whatever the header says
    version = (headers.get("MCP-Protocol-Version") or "").strip()
    return bool(version) and version not in LEGACY_VERSIONS


def modern_method_refusal(method: str) -> JsonRpcError | None:
    """The -32601 (HTTP 404) for a 2026-07-28 request outside the modern surface, else None.

    2026-07-28 basic/transports: a method the server does not implement gets HTTP 404 with -32601,
    whatever the upstream would answer (MODERN_METHODS; removed legacy methods are named as such).
    """
    if method in MODERN_METHODS:
        return None
    if method in REMOVED_METHODS:
        return JsonRpcError(
            METHOD_NOT_FOUND, f"method {method!r} is not available on the 2026-07-28 wire", status=404
        )
    return JsonRpcError(METHOD_NOT_FOUND, f"method {method!r} not found", status=404)


def legacy_method_refusal(headers: Mapping[str, str], body: Any) -> JsonRpcError | None:
    """The -32601 for a legacy-era (handshake) *request* outside the legacy surface, else None.

    `body` is the parsed POST body; responses, notifications and malformed bodies pass (None), as
    do the v1 `tasks/*` methods unless `MCP-Protocol-Version` names a revision before 2025-11-25.
    The error carries HTTP 200, as JSON-RPC errors do on the legacy wire: a 404 there would tell a
    client its session is gone (2025-11-25 basic/transports, "Session Management").
    """
    if (
        not isinstance(body, dict)
        or body.get("jsonrpc") != "2.0"
        or "id" not in body
        or not isinstance(body.get("method"), str)
    ):
        return None  # not a well-formed request: the relay's own checks answer it (-32600)
    method = body["method"]
    if method in LEGACY_METHODS:
        return None
    if (
        method in LEGACY_TASK_METHODS
        and (headers.get("MCP-Protocol-Version") or "").strip() not in LEGACY_BEFORE_TASKS
    ):
        return None
    return JsonRpcError(METHOD_NOT_FOUND, f"method {method!r} not found", status=200)


@dataclass(frozen=True)
class Envelope:
    """The per-request envelope of a modern request.

    `protocol_version` is the declared revision, `capabilities` the client capabilities object,
    `log_level` the optional requested log level (None: send no `notifications/message`).
    """

    protocol_version: str
    capabilities: JsonObject
    client_info: JsonObject | None
    log_level: str | None

    @property
    def declares_tasks(self) -> bool:
        """True when this request declared the `io.modelcontextprotocol/tasks` extension."""
        extensions = self.capabilities.get("extensions")
        return isinstance(extensions, dict) and isinstance(extensions.get(TASKS_EXTENSION), dict)


def parse_envelope(params: Any) -> Envelope:
    """Read the modern envelope from `params._meta`.

    Raises JsonRpcError(-32602) when `_meta`, its protocol version or its client capabilities are
    missing or of the wrong type (2026-07-28 basic/index, "Statelessness").
    """
    meta = params.get("_meta") if isinstance(params, dict) else None
    if meta is None:
        raise JsonRpcError(
            INVALID_PARAMS, "missing params._meta: a 2026-07-28 request must carry the envelope"
        )
    if not isinstance(meta, dict):
        raise JsonRpcError(INVALID_PARAMS, "params._meta must be an object (the 2026-07-28 envelope)")
    version = meta.get(META_PROTOCOL_VERSION)
    if version is not None and not isinstance(version, str):
        raise JsonRpcError(INVALID_PARAMS, f"_meta[{META_PROTOCOL_VERSION!r}] must be a string")
    if not version:
        raise JsonRpcError(INVALID_PARAMS, f"missing _meta[{META_PROTOCOL_VERSION!r}]")
    caps = meta.get(META_CLIENT_CAPABILITIES)
    if not isinstance(caps, dict):
        raise JsonRpcError(INVALID_PARAMS, f"missing or invalid _meta[{META_CLIENT_CAPABILITIES!r}]")
    info = meta.get(META_CLIENT_INFO)
    level = meta.get(META_LOG_LEVEL)
    return Envelope(
        protocol_version=version,
        capabilities=caps,
        client_info=info if isinstance(info, dict) else None,
        log_level=level if isinstance(level, str) else None,
    )


def decode_header_value(raw: str) -> str:
    """Decode one routing header value: strip optional whitespace, undo `=?base64?…?=` (SEP-2243).

    Raises JsonRpcError(-32020) for a malformed base64 value.
    """
    value = raw.strip(" \t")
    if value.startswith("=?base64?") and value.endswith("?="):
        try:
            return base64.b64decode(value[len("=?base64?") : -2], validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError) as exc:
            raise JsonRpcError(HEADER_MISMATCH, f"malformed base64 routing header value: {exc}") from None
    return value


def _single_header(headers: Any, name: str) -> str | None:
    values = (
        headers.getall(name, [])
        if hasattr(headers, "getall")
        else ([headers[name]] if name in headers else [])
    )
    if len(values) > 1:
        raise JsonRpcError(HEADER_MISMATCH, f"duplicate {name} header")
    return decode_header_value(values[0]) if values else None


def check_headers(headers: Any, body: JsonObject, envelope: Envelope) -> None:
    """Validate the 2026-07-28 routing headers against the body, in the order the spec's probes expect.

    `headers` is a case-insensitive multi-dict (aiohttp's `CIMultiDictProxy`).
    Raises JsonRpcError -32020 on a missing or mismatched header, -32022 on an unserved version,
    and -32602 when the field `Mcp-Name` mirrors is there but not a string.
    `Mcp-Name` is required for tools/call, prompts/get, resources/read; for tasks/* it is checked
    only when present (protocol.md §5 item 14).
    """
    header_version = _single_header(headers, "MCP-Protocol-Version")
    if header_version is not None and header_version != envelope.protocol_version:
        raise JsonRpcError(
            HEADER_MISMATCH,
            f"MCP-Protocol-Version header {header_version!r} does not match _meta protocol version "
            f"{envelope.protocol_version!r}",
        )
    if envelope.protocol_version not in MODERN_VERSIONS:
        raise JsonRpcError(
            UNSUPPORTED_PROTOCOL_VERSION,
            f"protocol version {envelope.protocol_version!r} is not served here",
            {"supported": list(MODERN_VERSIONS), "requested": envelope.protocol_version},
        )
    if header_version is None:
        raise JsonRpcError(HEADER_MISMATCH, "missing MCP-Protocol-Version header")
    method = body["method"]
    header_method = _single_header(headers, "Mcp-Method")
    if header_method is None:
        raise JsonRpcError(HEADER_MISMATCH, "missing Mcp-Method header")
    if header_method != method:
        raise JsonRpcError(
            HEADER_MISMATCH, f"Mcp-Method header {header_method!r} does not match method {method!r}"
        )
    params = body.get("params") or {}
    header_name = _single_header(headers, "Mcp-Name")
    if method in NAME_FIELDS:
        expected = params.get(NAME_FIELDS[method])
        if expected is not None and not isinstance(expected, str):
            raise JsonRpcError(INVALID_PARAMS, f"params.{NAME_FIELDS[method]} must be a string")
        if header_name is None:
            raise JsonRpcError(HEADER_MISMATCH, f"missing Mcp-Name header for {method}")
        if header_name != expected:
            raise JsonRpcError(
                HEADER_MISMATCH, f"Mcp-Name header {header_name!r} does not match {expected!r}"
            )
    elif method in TASK_NAME_METHODS and header_name is not None:
        expected = params.get("taskId")
        if header_name != (expected if isinstance(expected, str) else json.dumps(expected)):
            raise JsonRpcError(
                HEADER_MISMATCH, f"Mcp-Name header {header_name!r} does not match params.taskId {expected!r}"
            )


def upstream_capabilities(capabilities: JsonObject) -> JsonObject:
    """The legacy `initialize` client capabilities that mirror a modern request's capabilities.

    Keeps `elicitation`, `sampling` and `roots` (legacy servers decide what to offer from these;
    one declared as a bare `true`, as some clients write it, counts as `{}`); never declares `tasks`
    or extensions upstream (protocol.md §3.4).
    """
    return {
        key: value if isinstance(value, dict) else {}
        for key in ("elicitation", "sampling", "roots")
        if (value := capabilities.get(key)) is not None and value is not False
    }


def strip_envelope(params: JsonObject) -> JsonObject:
    """Copy of request params without the modern envelope keys, the v1 `task` param and MRTR fields.

    Other `_meta` keys and unknown params are kept (faithful relay).
    """
    out = {k: v for k, v in params.items() if k not in ("task", "inputResponses", "requestState")}
    meta = params.get("_meta")
    if isinstance(meta, dict):
        rest = {k: v for k, v in meta.items() if k not in ENVELOPE_META_KEYS}
        if rest:
            out["_meta"] = rest
        else:
            out.pop("_meta", None)
    return out


_HEADER_TOKEN = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")  # RFC 9110 token


def param_header_names(input_schema: Any) -> dict[str, str]:
    """`{argument: header name}` for a tool's top-level arguments annotated with `x-mcp-header`
    (SEP-2243: only string, integer and boolean properties, the name an RFC 9110 token)."""
    properties = input_schema.get("properties") if isinstance(input_schema, dict) else None
    names: dict[str, str] = {}
    if isinstance(properties, dict):
        for argument, schema in properties.items():
            header = schema.get("x-mcp-header") if isinstance(schema, dict) else None
            if (
                isinstance(header, str)
                and _HEADER_TOKEN.match(header)
                and schema.get("type") in ("string", "integer", "boolean")
            ):
                names[argument] = header
    return names


def _param_matches(header: str, value: Any) -> bool:
    if isinstance(value, bool):
        return header == ("true" if value else "false")
    if isinstance(value, int):
        try:
            return int(header) == value  # integers compare numerically
        except ValueError:
            return False
    return isinstance(value, str) and header == value


def check_param_headers(headers: Any, arguments: Any, names: dict[str, str]) -> None:
    """Validate the `Mcp-Param-{Name}` headers of a tools/call against its arguments (SEP-2243).

    `names` comes from `param_header_names`. A header must be present exactly when the argument is,
    decode (`=?base64?…?=`) cleanly and equal the argument. Raises JsonRpcError -32020.
    """
    arguments = arguments if isinstance(arguments, dict) else {}
    for argument, name in names.items():
        header = _single_header(headers, f"Mcp-Param-{name}")
        value = arguments.get(argument)
        if value is None:
            if header is not None:
                raise JsonRpcError(
                    HEADER_MISMATCH, f"Mcp-Param-{name} header given but arguments.{argument} is absent"
                )
            continue
        if header is None:
            raise JsonRpcError(HEADER_MISMATCH, f"missing Mcp-Param-{name} header for arguments.{argument}")
        if not _param_matches(header, value):
            raise JsonRpcError(
                HEADER_MISMATCH, f"Mcp-Param-{name} header {header!r} does not match arguments.{argument}"
            )
