"""Scopes per server and tool (`auth.scopes`), checked on a request before any upstream work: a
`tools/call` needs the server's `*` scopes and the tool's own; reading or changing a task
(`tasks/get`, `tasks/result`, `tasks/update`, `tasks/cancel`, both dialects) needs those of the tool
that made it, besides being its principal, and so does listening to a task's status pushes
(`subscriptions/listen`, which carry its result); `tasks/list` (ids and statuses of the principal's
own tasks) needs the server's `*` scopes. A token without them gets HTTP 403 with
`error="insufficient_scope"` and the scopes needed, so that a client can step up (MCP authorization,
"Scope challenge handling"; RFC 6750 §3.1).

`tools/list` lists every tool (the upstream's list passes through unchanged); a call the token may
not make is refused with the 403 above.
"""

from __future__ import annotations

from aiohttp import web

from proxy.front.auth import PRINCIPAL_KEY, SCOPES_KEY, auth_refusal
from proxy.front.resource import ProtectedResource
from proxy.protocol.jsonrpc import JsonObject, JsonRpcError, object_of
from proxy.tasks.service import TaskService

TASK_READS = frozenset({"tasks/get", "tasks/result", "tasks/update", "tasks/cancel"})
MAX_LISTED = 1000  # task ids of one subscriptions/listen looked at


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
        for what, tool in await self._uses(request, body.get("method"), object_of(body.get("params"))):
            needed = self.resource.needed(self.server, tool)
            if all(scope in granted for scope in needed):
                continue
            message = f"insufficient scope: {what} needs {' '.join(needed)}"
            challenge = self.resource.challenge(
                request.path, error="insufficient_scope", description=message, scope=needed
            )
            request_id = body.get("id")
            valid = isinstance(request_id, (str, int)) and not isinstance(request_id, bool)
            return auth_refusal(403, message, challenge, request_id if valid else None)
        return None

    async def _uses(
        self, request: web.Request, method: object, params: JsonObject
    ) -> list[tuple[str, str | None]]:
        """What the request reaches, as (what, tool) pairs: the tool it calls, the tool that made
        each task it reads or listens to (tool None: the server's `*` scopes)."""
        if method == "tools/call":
            tool = params.get("name")
            return [(f"calling {tool[:128]}", tool)] if isinstance(tool, str) else []
        if method == "tasks/list":
            return [("listing tasks", None)]  # the principal's own tasks
        if method in TASK_READS:
            task_ids: list[object] = [params.get("taskId")]
        elif method == "subscriptions/listen":  # a task's status push carries its result
            listed = object_of(params.get("notifications")).get("taskIds")
            task_ids = list(listed)[:MAX_LISTED] if isinstance(listed, list) else []
        else:
            return []
        uses: list[tuple[str, str | None]] = [("reading tasks", None)]
        for task_id in task_ids:
            try:
                record = await self.tasks.lookup(
                    task_id, principal=request.get(PRINCIPAL_KEY, ""), server=self.server
                )
            except JsonRpcError:
                continue  # unknown or another's: the handler answers as it always does
            uses.append((f"task {record.task_id} (made by {record.tool[:128]})", record.tool))
        return uses
