"""The `Mcp-Param-*` header index (SEP-2243): which `tools/call` arguments must be mirrored in headers.

Built from the upstream's `tools/list` (arguments annotated `x-mcp-header`), once per principal,
and forgotten when the upstream announces a tool list change.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

import structlog

from proxy.protocol.era import param_header_names
from proxy.protocol.jsonrpc import JsonObject, JsonRpcError

log = structlog.get_logger("proxy.modern")
MAX_PAGES = 100  # tools/list pages read at most
# After a tools/list that failed slowly (SLOW_FAILURE_S or longer: hung until request_timeout), calls
# of that principal go on without the index this long (s), rather than each waiting for it again
# before it is sent; after a quick failure (an error answer), only FAILED_FAST_KEPT_S
FAILED_LIST_KEPT_S = 30.0
SLOW_FAILURE_S = 1.0
FAILED_FAST_KEPT_S = 2.0
MAX_FAILED_KEPT = 10_000  # principals whose failed tools/list is remembered at most


class ParamHeaderIndex:
    """principal → tool → {argument: Mcp-Param header name}, for one server."""

    def __init__(self, server: str) -> None:
        self.server = server
        self._by_principal: dict[str, dict[str, dict[str, str]]] = {}
        self._failed_until: dict[str, float] = {}  # principal → monotonic time (s) to try again

    def remember(self, principal: str, tools_list: JsonObject) -> None:
        """Keep the index of a complete (single-page) `tools/list` result seen on the way back."""
        self._by_principal[principal] = tools_of(tools_list)

    def clear(self) -> None:
        """Forget everything (the upstream's tool list changed)."""
        self._by_principal.clear()
        self._failed_until.clear()

    def known(self, tool: str, principal: str) -> dict[str, str] | None:
        """What `names` would answer, when the principal's index is already built; else None."""
        tools = self._by_principal.get(principal)
        return None if tools is None else tools.get(tool, {})

    async def names(
        self, tool: str, principal: str, fetch: Callable[[JsonObject], Awaitable[JsonObject]]
    ) -> dict[str, str]:
        """`{argument: header name}` of `tool`'s `x-mcp-header` arguments. `fetch(params)` returns
        one `tools/list` page (JsonRpcError when the upstream fails: then no header is required and
        the call itself reports what is wrong with the upstream). After a failure the principal's
        calls do without the index for FAILED_LIST_KEPT_S (s; FAILED_FAST_KEPT_S after a quick
        one) without asking again: a hung `tools/list` would otherwise hold every call back by up
        to `request_timeout`."""
        tools = self._by_principal.get(principal)
        if tools is None:
            started = time.monotonic()
            if started < self._failed_until.get(principal, 0.0):
                return {}
            tools = {}
            params: JsonObject = {}
            try:
                for _ in range(MAX_PAGES):
                    page = await fetch(params)
                    tools.update(tools_of(page))
                    if not page.get("nextCursor"):
                        break
                    params = {"cursor": page["nextCursor"]}
            except JsonRpcError as exc:
                log.info("tools_list_unavailable", server=self.server, reason=exc.message)
                if len(self._failed_until) >= MAX_FAILED_KEPT:
                    self._failed_until.clear()
                took = time.monotonic() - started
                kept = FAILED_LIST_KEPT_S if took >= SLOW_FAILURE_S else FAILED_FAST_KEPT_S
                self._failed_until[principal] = time.monotonic() + kept
                return {}
            self._by_principal[principal] = tools
            self._failed_until.pop(principal, None)
        return tools.get(tool, {})


def tools_of(tools_list: JsonObject) -> dict[str, dict[str, str]]:
    """`{tool: {argument: header name}}` of the annotated tools in one `tools/list` result."""
    tools = tools_list.get("tools") if isinstance(tools_list.get("tools"), list) else []
    found = {}
    for tool in tools or []:
        if isinstance(tool, dict) and isinstance(tool.get("name"), str):
            names = param_header_names(tool.get("inputSchema"))
            if names:
                found[tool["name"]] = names
    return found
