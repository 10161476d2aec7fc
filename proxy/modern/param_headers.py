"""The `Mcp-Param-*` header index (SEP-2243): which `tools/call` arguments must be mirrored in headers.

Built from the upstream's `tools/list` (arguments annotated `x-mcp-header`), once per principal,
and forgotten when the upstream announces a tool list change.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import structlog

from proxy.protocol.era import param_header_names
from proxy.protocol.jsonrpc import JsonObject, JsonRpcError

log = structlog.get_logger("proxy.modern")
MAX_PAGES = 100  # tools/list pages read at most


class ParamHeaderIndex:
    """principal → tool → {argument: Mcp-Param header name}, for one server."""

    def __init__(self, server: str) -> None:
        self.server = server
        self._by_principal: dict[str, dict[str, dict[str, str]]] = {}

    def remember(self, principal: str, tools_list: JsonObject) -> None:
        """Keep the index of a complete (single-page) `tools/list` result seen on the way back."""
        self._by_principal[principal] = tools_of(tools_list)

    def clear(self) -> None:
        """Forget everything (the upstream's tool list changed)."""
        self._by_principal.clear()

    def known(self, tool: str, principal: str) -> dict[str, str] | None:
        """What `names` would answer, when the principal's index is already built; else None."""
        tools = self._by_principal.get(principal)
        return None if tools is None else tools.get(tool, {})

    async def names(
        self, tool: str, principal: str, fetch: Callable[[JsonObject], Awaitable[JsonObject]]
    ) -> dict[str, str]:
        """`{argument: header name}` of `tool`'s `x-mcp-header` arguments. `fetch(params)` returns
        one `tools/list` page (JsonRpcError when the upstream fails: then no header is required and
        the call itself reports what is wrong with the upstream)."""
        tools = self._by_principal.get(principal)
        if tools is None:
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
                return {}
            self._by_principal[principal] = tools
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
