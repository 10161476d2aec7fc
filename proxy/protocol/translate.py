"""Translate legacy (2025-11-25) upstream results and errors into 2026-07-28 shapes.

protocol.md §4.4: `resultType` on every result, `ttlMs` + `cacheScope` on cacheable results,
no v1 `execution` on tools, no related-task `_meta`, legacy-only error codes mapped.
"""

from __future__ import annotations

import copy
from typing import Any

from proxy.protocol.era import META_RELATED_TASK
from proxy.protocol.jsonrpc import (
    INTERNAL_ERROR,
    INVALID_PARAMS,
    RESOURCE_NOT_FOUND_LEGACY,
    URL_ELICITATION_REQUIRED_LEGACY,
    JsonObject,
    JsonRpcError,
)

CACHEABLE_METHODS = frozenset(
    {"tools/list", "prompts/list", "resources/list", "resources/templates/list", "resources/read"}
)


def modern_result(
    method: str, result: JsonObject, *, cache_ttl_ms: int = 0, cache_scope: str = "private"
) -> JsonObject:
    """A copy of an upstream result in the 2026-07-28 shape for `method`.

    Adds `resultType: "complete"` when missing; for cacheable methods adds `ttlMs` (integer ms)
    and `cacheScope` when missing; drops `execution` from listed tools and the v1 related-task
    key from `_meta`. Unknown fields are kept.
    """
    out = dict(result)
    out.setdefault("resultType", "complete")
    if method in CACHEABLE_METHODS:
        out.setdefault("ttlMs", cache_ttl_ms)
        out.setdefault("cacheScope", cache_scope)
    if method == "tools/list" and isinstance(out.get("tools"), list):
        out["tools"] = [
            {k: v for k, v in tool.items() if k != "execution"} if isinstance(tool, dict) else tool
            for tool in out["tools"]
        ]
    meta = out.get("_meta")
    if isinstance(meta, dict) and META_RELATED_TASK in meta:
        meta = {k: v for k, v in meta.items() if k != META_RELATED_TASK}
        if meta:
            out["_meta"] = meta
        else:
            out.pop("_meta")
    return out


def modern_error(error: Any) -> JsonObject:
    """A copy of an upstream JSON-RPC error object fit for a 2026-07-28 client.

    -32002 (resource not found) becomes -32602; -32042 (URL elicitation required) becomes
    -32603 with the original kept in `data`. A malformed error becomes -32603.
    """
    if (
        not isinstance(error, dict)
        or not isinstance(error.get("code"), int)
        or isinstance(error.get("code"), bool)
    ):
        return {
            "code": INTERNAL_ERROR,
            "message": "upstream sent a malformed JSON-RPC error",
            "data": {"upstreamError": error},
        }
    out = copy.deepcopy(error)
    if not isinstance(out.get("message"), str):
        out["message"] = str(out.get("message", "upstream error"))
    if out["code"] == RESOURCE_NOT_FOUND_LEGACY:
        out["code"] = INVALID_PARAMS
    elif out["code"] == URL_ELICITATION_REQUIRED_LEGACY:
        out = {
            "code": INTERNAL_ERROR,
            "message": f"upstream requires URL elicitation: {out['message']}",
            "data": out.get("data"),
        }
        if out["data"] is None:
            del out["data"]
    return out


def outcome_answer(method: str, outcome: JsonObject) -> JsonObject:
    """The 2026-07-28 answer to `method` whose upstream outcome is `outcome` (`{"result": …}` or
    `{"error": …}`): the result in the modern shape (`modern_result`). Raises JsonRpcError with
    the error fit for a 2026-07-28 client (`modern_error`)."""
    if "result" in outcome:
        return modern_result(method, outcome["result"])
    error = modern_error(outcome.get("error"))
    raise JsonRpcError(error["code"], error["message"], error.get("data"))
