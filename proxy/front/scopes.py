"""Scopes per server and tool (`auth.scopes`), checked on a request before any upstream work: a
`tools/call` needs the server's `*` scopes and the tool's own; reading or changing a task
(`tasks/get`, `tasks/result`, `tasks/update`, `tasks/cancel`, both dialects) needs those of the tool
that made it, besides being its principal; `tasks/list` (ids and statuses of the principal's own
tasks) needs the server's `*` scopes. A token without them gets HTTP 403 with
`error="insufficient_scope"` and the scopes needed, so that a client can step up (MCP authorization,
"Scope challenge handling"; RFC 6750 §3.1).

`tools/list` lists every tool (the upstream's list passes through unchanged); a call the token may
not make is refused with the 403 above.
"""

from __future__ import annotations

from aiohttp import web

from proxy.front.auth import PRINCIPAL_KEY, SCOPES_KEY, auth_refusal
from proxy.front.resource import ProtectedResource
from proxy.protocol.jsonrpc import JsonRpcError, object_of
from proxy.tasks.service import TaskService

TASK_READS = frozenset({"tasks/get", "tasks/result", "tasks/update", "tasks/cancel"})


class ScopeCheck:
    """The scope rule of one server's endpoint (`server`), with `tasks` to find which tool made a
    task."""

    def __init__(self, resource: ProtectedResource, server: str, tasks: TaskService) -> None:
        self.resource = resource
        self.server = server
        self.tasks = tasks
        self.active = bool(resource.scopes.get(server))

    async def refusal(self, request: web.Request, body: object) -> web.Response | None:
        """None when the request's token has the scopes `body` (a parsed JSON-RPC message) needs,
        else the 403 answer. A request without OAuth scopes (a relayed one, another auth mode) and
        a task the caller cannot see (the handler answers that) pass here."""
        granted = request.get(SCOPES_KEY)
        if not self.active or granted is None or not isinstance(body, dict):
            return None
        method = body.get("method")
        params = object_of(body.get("params"))
        if method == "tools/call":
            tool = params.get("name")
            if not isinstance(tool, str):
                return None  # the handler refuses the malformed call
            what = f"calling {tool[:128]}"
        elif method in TASK_READS:
            try:
                record = await self.tasks.lookup(
                    params.get("taskId"), principal=request.get(PRINCIPAL_KEY, ""), server=self.server
                )
            except JsonRpcError:
                return None
            tool = record.tool
            what = f"task {record.task_id} (made by {tool[:128]})"
        elif method == "tasks/list":
            tool, what = None, "listing tasks"  # the principal's own tasks: the server's "*" scopes
        else:
            return None
        needed = self.resource.needed(self.server, tool)
        missing = [scope for scope in needed if scope not in granted]
        if not missing:
            return None
        message = f"insufficient scope: {what} needs {' '.join(needed)}"
        challenge = self.resource.challenge(
            request.path, error="insufficient_scope", description=message, scope=needed
        )
        return auth_refusal(403, message, challenge)
