"""JSON-RPC 2.0 envelopes and the MCP error codes the proxy emits.

Spec: JSON-RPC 2.0 §4-5; MCP 2026-07-28 basic/index "Error Codes" (protocol.md §1.4.4).
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any

import orjson

JsonObject = dict[str, Any]
RequestId = str | int

PARSE_ERROR = -32700
INVALID_REQUEST = -32600
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602
INTERNAL_ERROR = -32603
REQUEST_CANCELLED = -32800  # LSP's RequestCancelled: what the MCP SDKs answer an abandoned request with
# Legacy (2025-11-25) codes that must never reach a 2026-07-28 client.
RESOURCE_NOT_FOUND_LEGACY = -32002
URL_ELICITATION_REQUIRED_LEGACY = -32042
# 2026-07-28 codes.
HEADER_MISMATCH = -32020
MISSING_REQUIRED_CLIENT_CAPABILITY = -32021
UNSUPPORTED_PROTOCOL_VERSION = -32022

_HTTP_STATUS = {
    PARSE_ERROR: 400,
    INVALID_REQUEST: 400,
    METHOD_NOT_FOUND: 404,
    INVALID_PARAMS: 400,
    HEADER_MISMATCH: 400,
    MISSING_REQUIRED_CLIENT_CAPABILITY: 400,
    UNSUPPORTED_PROTOCOL_VERSION: 400,
}


class JsonRpcError(Exception):
    """A JSON-RPC error to send to the downstream client.

    `code` is a JSON-RPC error code (ints above), `message` a human sentence naming the layer
    that gave up, `data` the optional structured detail, `status` the HTTP status when not the one
    the code maps to, `retry_after_s` (s) when a limit knows when it lets the caller in again.
    """

    def __init__(
        self,
        code: int,
        message: str,
        data: Any = None,
        *,
        status: int | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.data = data
        self._status = status
        self.retry_after_s = retry_after_s

    def to_error(self) -> JsonObject:
        """Return the JSON-RPC `error` member: `{code, message, data?}`."""
        return error_object(self.code, self.message, self.data)

    @property
    def http_status(self) -> int:
        """HTTP status for this error: the one given (e.g. 429 for a limit), else what the
        2026-07-28 transport prescribes for the code (400/404, else 200)."""
        return self._status or http_status_for(self.code)

    @property
    def http_headers(self) -> dict[str, str]:
        """HTTP headers for this error's response: `Retry-After` (s, RFC 9110 §10.2.3) when
        `retry_after_s` is known, else none."""
        return {"Retry-After": str(self.retry_after_s)} if self.retry_after_s is not None else {}


def limit_error(limit: str, message: str, *, retry_after_s: int | None = None, **data: Any) -> JsonRpcError:
    """A refusal by a configured limit: -32603 with `data.limit` naming it, HTTP 429, and
    `Retry-After` when `retry_after_s` (s) is given (a rate knows it; a count does not).

    (The spec defines no rate-limit code, and -32020…-32099 are reserved for the spec.)
    """
    return JsonRpcError(
        INTERNAL_ERROR,
        f"limit {limit}: {message}",
        {"limit": limit, **data},
        status=429,
        retry_after_s=retry_after_s,
    )


def http_status_for(code: int) -> int:
    """Map a JSON-RPC error code to the HTTP status the 2026-07-28 transport prescribes."""
    return _HTTP_STATUS.get(code, 200)


# -- the codec: orjson on the hot path, byte for byte what `json` gave -------------------------

# those stay TypeErrors, as with json
_OPTS = orjson.OPT_PASSTHROUGH_DATACLASS | orjson.OPT_PASSTHROUGH_DATETIME
# orjson output that json.dumps would write differently: floats in exponent form (`1e-07` vs
# `1e-7`) or below 1e-4 (`1e-05` vs `0.00001`), DEL (json writes `\u007f`), and any non-ASCII
# byte (json escapes it). Integers beyond 64 bits (20 digits or more, or 19 after a `-`): orjson
# reads them as floats where json keeps an int. Both are looked for in a copy with every digit made
# `0` and `E` made `e` (one C pass), by patterns that start with a literal (the fast search of
# `re`) and look back one byte to tell a number from a string: an exponent's digit follows `:`,
# `,`, `[`, `-`, a digit or `.`; a long integer's first digit follows `:`, `,`, `[`, `-` or JSON
# whitespace (or starts the text). A hex id's `d4e5` does not match; a match inside a string
# (`"12e"`) only costs the slower, exact path.
_FOLD = bytes.maketrans(b"0123456789E", b"0000000000e")
_SMALL, _DEL, _DIGITS_19 = b"0.0000", b"\x7f", b"0" * 19
_EXPONENT = re.compile(rb"0e(?<![^:,\[\-0.]0e)")
_BIG_INT = re.compile(rb"-0{19}|0{20}(?<![^:,\[\- \t\r\n]0{20})")


def _json_writes_otherwise(out: bytes) -> bool:
    """True when `json.dumps` would not write the compact `out` (orjson's) byte for byte."""
    if not out.isascii() or _DEL in out:
        return True
    folded = out.translate(_FOLD)
    return _SMALL in folded or _EXPONENT.search(folded) is not None


def _has_big_int(raw: bytes | bytearray) -> bool:
    """True when the JSON text `raw` may hold an integer beyond 64 bits (orjson would read a float)."""
    folded = raw.translate(_FOLD)
    return _DIGITS_19 in folded and _BIG_INT.search(folded) is not None


class _NonFinite(float):
    """NaN / Infinity read by the fallback parser: orjson refuses to write a float subclass, so
    `dumps` falls back to json, which writes them back as `NaN` / `Infinity` (as before)."""


def dumps(obj: Any) -> bytes:
    """Compact JSON bytes, identical to `json.dumps(obj, separators=(",", ":")).encode()`
    (ASCII with `\\uXXXX` escapes, same float forms); orjson does the work when that gives the
    same bytes. Raises TypeError / ValueError as json does."""
    try:
        out = orjson.dumps(obj, option=_OPTS)
    except TypeError:
        return json.dumps(obj, separators=(",", ":")).encode()
    if not _json_writes_otherwise(out):
        return out
    return json.dumps(obj, separators=(",", ":")).encode()


def dumps_str(obj: Any) -> str:
    """`dumps` as a str (for APIs that take text)."""
    return dumps(obj).decode()


class TooDeepError(ValueError):
    """JSON text nested deeper than the parser can follow (about 1,000 levels: `json` raises
    RecursionError there). A ValueError, so every reader that refuses text that is not JSON refuses
    this too; one that must name the cause catches it first."""


def loads(raw: bytes | bytearray | str) -> Any:
    """Parse JSON like `json.loads` (same values, same errors: ValueError, UnicodeDecodeError),
    with orjson where it reads the same values: big integers, NaN / Infinity, lone surrogates, a
    BOM and bad input go through `json` so results and messages are unchanged. Text nested too
    deeply to parse raises TooDeepError (a ValueError), never RecursionError; an integer past
    Python's digit limit a ValueError naming the limit."""
    if not _has_big_int(raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw):
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass
    try:
        return json.loads(raw, parse_constant=_NonFinite, parse_float=_float)
    except RecursionError:
        raise TooDeepError("the JSON text nests too deeply to parse") from None
    except ValueError as exc:
        if "max_str_digits" not in str(exc):  # (Python's advice for an integer past its digit limit)
            raise
        limit = sys.get_int_max_str_digits()
        raise ValueError(f"a number has more than {limit} digits, too long to read") from None


def nests_deeper_than(raw: bytes | bytearray, value: Any, limit: int) -> bool:
    """True when `value` (parsed from `raw`) nests arrays and objects more than `limit` levels deep.
    Such a body would parse, yet fail later on its way out (the encoders' recursion limits) as an
    internal error. Only a body with more than `limit` brackets in all is walked (iteratively)."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            depth += 1
            if depth > limit:
                return True
            stack.extend((child, depth) for child in (item.values() if isinstance(item, dict) else item))
    return False


def _float(text: str) -> float:
    value = float(text)
    return value if value - value == 0 else _NonFinite(text)  # 1e400 reads as inf


def object_of(value: Any) -> JsonObject:
    """`value` when it is a JSON object, else an empty one (for optional `params` / `_meta` members)."""
    return value if isinstance(value, dict) else {}


def error_object(code: int, message: str, data: Any = None) -> JsonObject:
    """Build a JSON-RPC error object `{code, message, data?}`."""
    err: JsonObject = {"code": code, "message": message}
    if data is not None:
        err["data"] = data
    return err


def response(request_id: RequestId | None, result: JsonObject) -> JsonObject:
    """Build a JSON-RPC success response."""
    return {"jsonrpc": "2.0", "id": request_id, "result": result}


def error_response(request_id: RequestId | None, error: JsonObject) -> JsonObject:
    """Build a JSON-RPC error response from an error object."""
    return {"jsonrpc": "2.0", "id": request_id, "error": error}


def request(request_id: RequestId, method: str, params: JsonObject | None = None) -> JsonObject:
    """Build a JSON-RPC request."""
    msg: JsonObject = {"jsonrpc": "2.0", "id": request_id, "method": method}
    if params is not None:
        msg["params"] = params
    return msg


def notification(method: str, params: JsonObject | None = None) -> JsonObject:
    """Build a JSON-RPC notification (a request without `id`)."""
    msg: JsonObject = {"jsonrpc": "2.0", "method": method}
    if params is not None:
        msg["params"] = params
    return msg


def request_id_of(msg: Any) -> RequestId | None:
    """The `id` of the JSON-RPC message `msg` when it is a valid request id (a string or an
    integer, not a bool), else None (no id, an invalid one, or `msg` not an object)."""
    rid = msg.get("id") if isinstance(msg, dict) else None
    return rid if isinstance(rid, (str, int)) and not isinstance(rid, bool) else None


def is_request(msg: Any) -> bool:
    """True for a JSON-RPC request object (has `method` and `id`)."""
    return isinstance(msg, dict) and "method" in msg and "id" in msg


def is_notification(msg: Any) -> bool:
    """True for a JSON-RPC notification (has `method`, no `id`)."""
    return isinstance(msg, dict) and "method" in msg and "id" not in msg


# Requests a server may receive twice with the effect of once: they only read, set a state to the
# same value, or (`initialize`) at worst leave a session unused. A `tools/call` may act, so it is
# never among them; nor is `tasks/cancel` (a second one answers "already cancelled").
RESENDABLE_METHODS = frozenset(
    {
        "initialize",
        "ping",
        "tools/list",
        "prompts/list",
        "prompts/get",
        "resources/list",
        "resources/templates/list",
        "resources/read",
        "completion/complete",
        "logging/setLevel",
        "resources/subscribe",
        "resources/unsubscribe",
        "tasks/get",
        "tasks/list",
        "tasks/result",
    }
)


def safe_to_resend(msg: Any) -> bool:
    """True when sending `msg` to a server a second time does what sending it once did: a request
    for one of RESENDABLE_METHODS, a notification, or a response (the client's answer to one of the
    server's questions: lost, the server's call would wait for it until its timeout; a server that
    closed the connection unread never saw the first, and one that read it and died has no session
    left to be confused by a second). Never a `tools/call` or another request that may act."""
    if not isinstance(msg, dict):
        return False
    method = msg.get("method")
    if method is None:
        return "id" in msg and ("result" in msg or "error" in msg)
    return isinstance(method, str) and ("id" not in msg or method in RESENDABLE_METHODS)


def is_response(msg: Any) -> bool:
    """True for a JSON-RPC response (has `id` and `result` or `error`, no `method`)."""
    return (
        isinstance(msg, dict) and "method" not in msg and "id" in msg and ("result" in msg or "error" in msg)
    )


MALFORMED_ERROR = "a malformed JSON-RPC error"  # (`response_problem`'s phrase for one)


def response_problem(msg: JsonObject) -> str | None:
    """What makes the response `msg` (`is_response`) unfit to hand an MCP client, as a phrase
    ("a result that is not an object"), or None when it is fit: exactly one of `result` and
    `error` (JSON-RPC 2.0 §5), a result that is an object (every MCP result is one), an error object
    with an integer `code` and a string `message` (§5.1)."""
    if "result" in msg and "error" in msg:
        return "a response with both a result and an error"
    if "result" in msg:
        return None if isinstance(msg["result"], dict) else "a result that is not an object"
    error = msg["error"]
    if (
        not isinstance(error, dict)
        or not isinstance(error.get("code"), int)
        or isinstance(error.get("code"), bool)
        or not isinstance(error.get("message"), str)
    ):
        return MALFORMED_ERROR
    return None


def unfit_answer_error(who: str, problem: str, message: JsonObject) -> JsonObject:
    """The -32603 error object that stands in for `message`, an answer unfit for an MCP client
    (`problem`, as `response_problem` words it), sent by `who` ("upstream NAME"): a malformed error
    is kept in `data.upstreamError`."""
    error = error_object(INTERNAL_ERROR, f"{who} answered with {problem}")
    if problem == MALFORMED_ERROR:
        error["data"] = {"upstreamError": message.get("error")}
    return error


def validate_request(msg: Any) -> None:
    """Check that `msg` is a single JSON-RPC 2.0 request or notification.

    Raises JsonRpcError(-32600) for batches, responses and malformed envelopes.
    """
    if isinstance(msg, list):
        raise JsonRpcError(INVALID_REQUEST, "JSON-RPC batches are not supported")
    if not isinstance(msg, dict):
        raise JsonRpcError(INVALID_REQUEST, "the body must be one JSON-RPC object")
    if msg.get("jsonrpc") != "2.0":
        raise JsonRpcError(INVALID_REQUEST, 'the body must carry "jsonrpc": "2.0"')
    if "method" not in msg:
        if "result" in msg or "error" in msg:
            raise JsonRpcError(
                INVALID_REQUEST, "a client may send requests and notifications only, not responses"
            )
        raise JsonRpcError(INVALID_REQUEST, "the request has no `method`")
    if not isinstance(msg["method"], str) or not msg["method"]:
        raise JsonRpcError(INVALID_REQUEST, "`method` must be a non-empty string")
    if "id" in msg and (isinstance(msg["id"], bool) or not isinstance(msg["id"], (str, int))):
        raise JsonRpcError(INVALID_REQUEST, "`id` must be a string or an integer")
    if "params" in msg and not isinstance(msg["params"], dict):
        raise JsonRpcError(INVALID_REQUEST, "`params` must be an object")
