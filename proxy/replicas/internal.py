"""The internal endpoints replicas call on each other (`/_replica/...`), only with the shared
secret: the live half of `tasks/update` and `tasks/cancel` for calls running here."""

from __future__ import annotations

import json

import structlog
from aiohttp import web

from proxy.protocol.jsonrpc import JsonObject
from proxy.replicas.node import REPLICAS_KEY, Replicas
from proxy.tasks.model import principal_hash

log = structlog.get_logger("proxy.replicas")

PREFIX = "/_replica"


def add_routes(app: web.Application) -> None:
    """Mount the internal endpoints (call only when `replicas` is configured)."""
    app.router.add_post(f"{PREFIX}/tasks/cancel", _cancel)
    app.router.add_post(f"{PREFIX}/tasks/answer", _answer)
    app.router.add_post(f"{PREFIX}/ping", _ping)


def _refuse(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


async def _payload(request: web.Request) -> tuple[Replicas, JsonObject] | web.Response:
    replicas: Replicas = request.app[REPLICAS_KEY]
    if not replicas.authentic(request):
        log.warning("security_replica_auth_failed", remote=request.remote, path=request.path)
        return _refuse(403, "replica secret missing or wrong")
    try:
        payload = json.loads(await request.read())
    except (ValueError, UnicodeDecodeError):
        return _refuse(400, "body must be a JSON object")
    if not isinstance(payload, dict) or not isinstance(payload.get("taskId"), str):
        return _refuse(400, "body must be a JSON object with a string taskId")
    return replicas, payload


async def _cancel(request: web.Request) -> web.Response:
    """`{"taskId", "reason"}` → `{"stopped": bool}`: stop the live call of a task another replica
    marked cancelled in the store (the upstream gets notifications/cancelled for its request id)."""
    got = await _payload(request)
    if isinstance(got, web.Response):
        return got
    replicas, payload = got
    task_id = payload["taskId"]
    call = replicas.tasks.live.get(task_id)
    if call is not None:
        replicas.tasks.release(task_id)
        reason = payload.get("reason")
        call.cancel(reason if isinstance(reason, str) else "task cancelled")
        log.info(
            "task_cancelled",
            task_id=task_id,
            by="client",
            via="replica",
            principal=principal_hash(call.principal),
        )
    return web.json_response({"stopped": call is not None})


async def _answer(request: web.Request) -> web.Response:
    """`{"taskId", "inputResponses"}` → `{"keys": [...]}`: deliver answers to the live call; the
    answered keys have left the stored `inputRequests` when this returns."""
    got = await _payload(request)
    if isinstance(got, web.Response):
        return got
    replicas, payload = got
    responses = payload.get("inputResponses")
    if not isinstance(responses, dict):
        return _refuse(400, "inputResponses must be an object")
    task_id = payload["taskId"]
    if task_id not in replicas.tasks.live:
        return web.json_response({"keys": []})
    record = await replicas.tasks.store.get(task_id)
    keys = await replicas.tasks.answer(record, responses) if record is not None else []
    return web.json_response({"keys": keys})


async def _ping(request: web.Request) -> web.Response:
    """`{}` → `{"node": id}` with the right secret (403 without): a replica checks its peers at start."""
    replicas: Replicas = request.app[REPLICAS_KEY]
    if not replicas.authentic(request):
        log.warning("security_replica_auth_failed", remote=request.remote, path=request.path)
        return _refuse(403, "replica secret missing or wrong")
    return web.json_response({"node": replicas.node})
