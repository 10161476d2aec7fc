"""The internal endpoints replicas call on each other (`/_replica/...`), only with the shared
secret: the live half of `tasks/update` and `tasks/cancel` for calls running here, the requests
this replica is answering (for the console), and a ping."""

from __future__ import annotations

import structlog
from aiohttp import web

from proxy.protocol import jsonrpc
from proxy.protocol.jsonrpc import JsonObject
from proxy.replicas.node import Replicas
from proxy.runtime import tracing
from proxy.runtime.running import MAX_LISTED, RunningRequests
from proxy.tasks.service import TaskService

log = structlog.get_logger("proxy.replicas")

PREFIX = "/_replica"


class InternalEndpoints:
    """What the internal endpoints act on, opened with the app (its cleanup context puts it under
    `INTERNAL_KEY`): this replica, its task service and its requests in flight."""

    def __init__(self, replicas: Replicas, tasks: TaskService, running: RunningRequests) -> None:
        self.replicas = replicas
        self.tasks = tasks
        self.running = running

    async def cancel(self, request: web.Request) -> web.Response:
        """`{"taskId", "reason"}` → `{"stopped": bool}`: stop the live call of a task another replica
        marked cancelled in the store (the upstream gets notifications/cancelled for its request id)."""
        payload = await self._payload(request)
        if isinstance(payload, web.Response):
            return payload
        reason = payload.get("reason")
        stopped = self.tasks.stop_cancelled(
            payload["taskId"], reason if isinstance(reason, str) else "task cancelled"
        )
        return web.json_response({"stopped": stopped})

    async def answer(self, request: web.Request) -> web.Response:
        """`{"taskId", "inputResponses"}` → `{"keys": [...]}`: deliver answers to the live call; the
        answered keys have left the stored `inputRequests` when this returns."""
        payload = await self._payload(request)
        if isinstance(payload, web.Response):
            return payload
        responses = payload.get("inputResponses")
        if not isinstance(responses, dict):
            return _refuse(400, "inputResponses must be an object")
        task_id = payload["taskId"]
        if task_id not in self.tasks.live:
            return web.json_response({"keys": []})
        record = await self.tasks.store.get(task_id)
        keys = await self.tasks.answer(record, responses) if record is not None else []
        return web.json_response({"keys": keys})

    async def ping(self, request: web.Request) -> web.Response:
        """`{}` → `{"node": id}` with the right secret (403 without): a replica checks its peers at start."""
        if not self._authentic(request):
            return _refuse(403, "replica secret missing or wrong")
        return web.json_response({"node": self.replicas.node})

    async def list_running(self, request: web.Request) -> web.Response:
        """`{"limit"}` → `{"node", "requests", "total", "relayed"}`: the `limit` oldest requests this
        replica is answering (1..`running.MAX_LISTED`, which is also the default; see
        `RunningRequests.snapshot`), how many there are in all, and how many of those came relayed."""
        if not self._authentic(request):
            return _refuse(403, "replica secret missing or wrong")
        try:
            asked = jsonrpc.object_of(jsonrpc.loads(await request.read())).get("limit")
        except ValueError:
            asked = None
        limit = asked if isinstance(asked, int) and 1 <= asked <= MAX_LISTED else MAX_LISTED
        requests, total = self.running.snapshot(limit)
        relayed = self.running.relayed()
        return web.json_response(
            {"node": self.replicas.node, "requests": requests, "total": total, "relayed": relayed}
        )

    def _authentic(self, request: web.Request) -> bool:
        if self.replicas.authentic(request):
            return True
        log.warning("security_replica_auth_failed", remote=request.remote, path=request.path)
        return False

    async def _payload(self, request: web.Request) -> JsonObject | web.Response:
        if not self._authentic(request):
            return _refuse(403, "replica secret missing or wrong")
        try:
            payload = jsonrpc.loads(await request.read())
        except (ValueError, UnicodeDecodeError):
            return _refuse(400, "body must be a JSON object")
        if not isinstance(payload, dict) or not isinstance(payload.get("taskId"), str):
            return _refuse(400, "body must be a JSON object with a string taskId")
        return payload


INTERNAL_KEY = web.AppKey("replica_internal", InternalEndpoints)


def add_routes(app: web.Application) -> None:
    """Mount the internal endpoints (only when `replicas` is configured); each request is served by
    the `InternalEndpoints` under `INTERNAL_KEY`."""

    async def cancel(request: web.Request) -> web.Response:
        with tracing.hop_span(request.headers, "tasks/cancel"):
            return await request.app[INTERNAL_KEY].cancel(request)

    async def answer(request: web.Request) -> web.Response:
        with tracing.hop_span(request.headers, "tasks/answer"):
            return await request.app[INTERNAL_KEY].answer(request)

    async def ping(request: web.Request) -> web.Response:
        return await request.app[INTERNAL_KEY].ping(request)

    async def running(request: web.Request) -> web.Response:
        return await request.app[INTERNAL_KEY].list_running(request)

    app.router.add_post(f"{PREFIX}/tasks/cancel", cancel)
    app.router.add_post(f"{PREFIX}/tasks/answer", answer)
    app.router.add_post(f"{PREFIX}/ping", ping)
    app.router.add_post(f"{PREFIX}/running", running)


def _refuse(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)
