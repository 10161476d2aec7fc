"""Server→client questions (elicitation, sampling, roots) as the 2026-07-28 `inputRequests` carry them. No
I/O."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from proxy.protocol.jsonrpc import JsonObject, RequestId

INPUT_CAPABILITY = {
    "elicitation/create": "elicitation",
    "sampling/createMessage": "sampling",
    "roots/list": "roots",
}
INPUT_METHODS = frozenset(INPUT_CAPABILITY)
INPUT_KEY_HINT = "mcp-tasks-proxy/inputKey"  # optional upstream hint (in the question's `_meta`) for its key


def input_request_value(message: JsonObject) -> JsonObject:
    """The 2026-07-28 `{method, params}` value of a legacy server→client request.

    Drops `jsonrpc`/`id`, the params' `_meta` (related-task key included), the v1 `task` param and
    URL-mode `elicitationId` (protocol.md §3.4 step 3).
    """
    value: JsonObject = {"method": message["method"]}
    params = message.get("params")
    if isinstance(params, dict):
        value["params"] = {k: v for k, v in params.items() if k not in ("_meta", "task", "elicitationId")}
    elif message["method"] != "roots/list":
        value["params"] = {}
    return value


@dataclass
class PendingInput:
    """A server→client request the upstream is waiting on: its upstream id, the 2026 `{method, params}`
    value, and when it was asked (`time.monotonic()`, s)."""

    upstream_id: RequestId
    request: JsonObject
    asked: float = field(default_factory=time.monotonic)


class InputError(dict):  # type: ignore[type-arg]
    """An input response that is a JSON-RPC error object (`{code, message, data?}`): a client that
    declined to answer a relayed question in the v1 way. It goes upstream as an error response."""
