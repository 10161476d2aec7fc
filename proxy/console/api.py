"""The console's HTTP routes: the page, sign-in, and the JSON API under `/console/api/`.

Mounted by `app.build_app` as a sub-application at `/console/` when the config has a `console`
section. Every answer is JSON (errors: `{"error": {"status", "message"}}`, 4xx for bad input,
503 when the store cannot be read), except the page, its static files and the event stream.

- `GET /console/api/session`: `{operator, csrf, servers, keepaliveMs}`
- `GET /console/api/tasks?status=&server=&tool=&principal=<hash>&cursor=&limit=`: `{tasks, nextCursor}`,
  newest first, everyone's tasks (`limit` 1..200, default 50)
- `GET /console/api/tasks/{taskId}`: the detail view (see `views.detail`); 404 unknown or expired
- `POST /console/api/tasks/{taskId}/cancel`: cancel through `TaskService.cancel(by="operator")`
  (the live call is stopped upstream); 409 when the task had already ended
- `GET /console/api/events`: server-sent events (see `events.ConsoleHub.stream`)
- `GET /console/api/overview`: upstream readiness, the store, live calls and `views.metrics_snapshot`
- `GET /console/api/running?limit=`: the requests being answered right now on every live replica,
  synchronous calls included (`running_requests`)
"""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path
from typing import Any

import structlog
from aiohttp import web

from proxy.calls.keys import joined_requests
from proxy.config import Config
from proxy.console.access import CONSOLE_KEY, OPERATOR_KEY, ConsoleAccess, error
from proxy.console.events import ConsoleHub, TooManyStreamsError
from proxy.console.views import detail, metrics_snapshot, row
from proxy.replicas.forward import HopError
from proxy.runtime.running import MAX_LISTED, VIEW_NAMES
from proxy.tasks.model import TaskRecord, TaskStatus
from proxy.tasks.rates import FailedAttempts
from proxy.tasks.service import TaskService
from proxy.tasks.store import ListFilter, StoreUnavailableError

log = structlog.get_logger("proxy.console")

STATIC_DIR = Path(__file__).with_name("static")
HUB_KEY = web.AppKey("console_hub", ConsoleHub)
ACCESS_KEY = web.AppKey("console_access", ConsoleAccess)


READY_CACHE_S = 5.0  # upstream readiness is probed at most this often (s) for the overview
MAX_LIMIT = 200
RUNNING_LIMIT = 200  # requests `GET /console/api/running` lists by default
_HASH = re.compile(r"^[0-9a-f]{16}$")
_DIGITS = re.compile(r"[0-9]{1,6}")
_MAX_MS = 8_640_000_000_000_000  # the largest epoch-ms a JavaScript Date holds
_PRINCIPAL_ROUNDS = 20  # store pages one principal-filtered listing may read before it returns a cursor
_SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'; base-uri "
    "'none'; form-action 'self'",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
}


def build_console(config: Config, throttle: FailedAttempts) -> web.Application:
    """The console as an aiohttp sub-application (mount it at `/console/`); `config.console` must be set.
    Wrong console tokens count in `throttle` (`limits.failed_auth`, shared with client credentials).

    The root application must provide its `ConsoleData` under `CONSOLE_KEY` by the time requests arrive.
    """
    assert config.console is not None
    access = ConsoleAccess(config.console, throttle=throttle, listen=config.listen)
    console = web.Application(middlewares=access.middlewares())
    hub = ConsoleHub()
    console[HUB_KEY] = hub
    console[ACCESS_KEY] = access
    console.on_shutdown.append(hub.close)
    console.on_response_prepare.append(_security_headers)
    keepalive_s = config.listen.sse_keepalive
    ready: dict[str, Any] = {"at": 0.0, "checks": {}}

    async def index(request: web.Request) -> web.FileResponse:
        return web.FileResponse(STATIC_DIR / "index.html")

    async def session(request: web.Request) -> web.Response:
        return web.json_response(
            {
                "operator": request[OPERATOR_KEY],
                "csrf": await access.csrf_token(request),
                "servers": sorted(config.servers),
                "keepaliveMs": int(keepalive_s * 1000),
            }
        )

    async def events(request: web.Request) -> web.StreamResponse:
        try:
            return await hub.stream(
                request,
                _tasks(request).changes,
                keepalive_s=keepalive_s,
                signed_in=access.signed_in_check(request),
            )
        except TooManyStreamsError as exc:
            return error(503, str(exc))

    async def overview(request: web.Request) -> web.Response:
        tasks = _tasks(request)
        if time.monotonic() - ready["at"] > READY_CACHE_S:
            pools = request.config_dict[CONSOLE_KEY].pools
            problems = await asyncio.gather(*(pool.check(timeout_s=2.0) for pool in pools.values()))
            ready["checks"] = {name: problem or "ok" for name, problem in zip(pools, problems, strict=True)}
            ready["at"] = time.monotonic()
        return web.json_response(
            {
                "upstreams": ready["checks"],
                "store": tasks.store_problem or "ok",
                "liveHere": len(tasks.live),
                **metrics_snapshot(),
            }
        )

    console.router.add_get("/", index)
    console.router.add_static("/static/", STATIC_DIR)
    console.router.add_post("/login", access.login)
    console.router.add_post("/logout", access.logout)
    console.router.add_get("/api/session", session)
    console.router.add_get("/api/tasks", list_tasks)
    console.router.add_get("/api/tasks/{task_id}", show_task)
    console.router.add_post("/api/tasks/{task_id}/cancel", cancel_task)
    console.router.add_get("/api/events", events)
    console.router.add_get("/api/overview", overview)
    console.router.add_get("/api/running", running_requests)
    return console


async def _security_headers(request: web.Request, response: web.StreamResponse) -> None:
    response.headers.update(_SECURITY_HEADERS)
    if request.path.startswith("/console/api/") or request.path in ("/console/login", "/console/logout"):
        response.headers["Cache-Control"] = "no-store"


def _tasks(request: web.Request) -> TaskService:
    return request.config_dict[CONSOLE_KEY].tasks


async def list_tasks(request: web.Request) -> web.Response:
    """`GET /console/api/tasks`: a page of everyone's tasks, newest first, with filters; 400 for a bad filter
    or cursor."""
    query = request.query
    status = query.get("status") or None
    if status is not None and status not in {s.value for s in TaskStatus}:
        return error(400, f"status must be one of {', '.join(s.value for s in TaskStatus)}")
    principal = (query.get("principal") or "").lower() or None
    if principal is not None and not _HASH.match(principal):
        return error(400, "principal must be a principal hash (16 hex characters, as the console shows it)")
    limit = _limit(query, default=50, maximum=MAX_LIMIT)
    if isinstance(limit, web.Response):
        return limit
    for name in ("server", "tool", "cursor"):
        if len(query.get(name, "")) > 512:
            return error(400, f"{name} is too long")
    where = ListFilter(
        principal=None, server=query.get("server") or None, status=status, tool=query.get("tool") or None
    )
    cursor = query.get("cursor") or None
    store = _tasks(request).store
    found: list[TaskRecord] = []
    try:
        for _ in range(_PRINCIPAL_ROUNDS if principal else 1):
            # With a principal filter, ask for no more than the rows still
            # missing, so a page is never cut in the middle.
            page, cursor = await store.list_tasks(where, cursor=cursor, limit=limit - len(found))
            found.extend(r for r in page if principal is None or row(r)["principalHash"] == principal)
            if cursor is None or len(found) >= limit:
                break
    except ValueError:
        return error(400, "invalid cursor (pass back a nextCursor from this listing, with the same filters)")
    except StoreUnavailableError as exc:
        return error(503, str(exc))
    return web.json_response({"tasks": [row(r) for r in found], "nextCursor": cursor})


async def running_requests(request: web.Request) -> web.Response:
    """`GET /console/api/running?limit=`: `{requests, replicas, total}`. `requests`: the requests being
    answered right now by an MCP endpoint, on this replica and every live peer, longest-running
    first, at most `limit` (1..`MAX_LISTED`, default 200); each is a `RunningRequest.shown` view plus
    its `replica` (node id). A request one replica relays to another is listed once, where it is
    served, with `relayedBy` (the relaying replica; its request id is the view's
    `relayedRequestId`). `replicas`: `[{replica, total}]` (how many requests each is answering), or
    `{replica, error}` for a peer that did not answer within `replicas.hop_timeout`, answered for
    another node (a stale registry record), or runs a version without this list; `{replica: null,
    error}` when the registry cannot be read (this replica's requests are still listed). `total`:
    the requests answered in all, a relayed one counted once (each replica says how many it got
    relayed). 400 for a bad limit."""
    limit = _limit(request.query, default=RUNNING_LIMIT, maximum=MAX_LISTED)
    if isinstance(limit, web.Response):
        return limit
    data = request.config_dict[CONSOLE_KEY]
    node = data.tasks.node
    here, total = data.running.snapshot(limit)
    found = [{**view, "replica": node} for view in here]
    replicas: list[dict[str, Any]] = [{"replica": node, "total": total}]
    relayed = data.running.relayed()  # requests the replicas that relayed them count too
    if data.replicas is not None:
        try:
            answers = await data.replicas.ask_peers("running", {"limit": limit})
        except StoreUnavailableError as exc:
            answers = []
            replicas.append({"replica": None, "error": f"the replica registry cannot be read: {exc}"})
        for peer, answer in answers:
            if isinstance(answer, HopError):
                why = str(answer)
                if answer.status == 404:  # mid-deploy: a peer of a version before this list
                    why = f"replica {peer.node} runs a version that cannot list its requests (HTTP 404)"
                replicas.append({"replica": peer.node, "error": why})
            elif answer.get("node") != peer.node:  # its record outlived it; the address serves another
                why = f"replica {peer.node}'s address answers for another node: a stale registry record"
                replicas.append({"replica": peer.node, "error": why})
            else:
                listed = answer.get("requests")
                rebuilt = [_peer_view(view) for view in listed] if isinstance(listed, list) else []
                views = [view for view in rebuilt if view is not None]
                found.extend({**view, "replica": peer.node} for view in views)
                count, theirs = answer.get("total"), answer.get("relayed")
                replicas.append({"replica": peer.node, "total": count if type(count) is int else len(views)})
                relayed += theirs if type(theirs) is int else 0
    found = _fold_relays(found)
    found.sort(key=lambda view: view["ageMs"], reverse=True)
    total = max(0, sum(entry.get("total") or 0 for entry in replicas) - relayed)
    return web.json_response({"requests": found[:limit], "replicas": replicas, "total": total})


def _peer_view(view: Any) -> dict[str, Any] | None:
    """A peer's view of one request rebuilt from the names a view has (`running.VIEW_NAMES`): the
    times (`startedMs`, `ageMs`) whole numbers of ms within a date's range, every other value a
    string of at most 256 characters or a whole number; None without a good `ageMs`."""
    if not isinstance(view, dict):
        return None
    kept = {name: view[name] for name in VIEW_NAMES if _plain(name, view.get(name))}
    return kept if "ageMs" in kept else None


def _plain(name: str, value: Any) -> bool:
    if name in ("startedMs", "ageMs"):
        return type(value) is int and 0 <= value <= _MAX_MS
    if type(value) is str:
        return len(value) <= 256
    return type(value) is int and abs(value) <= _MAX_MS


def _fold_relays(views: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`views` with each relaying replica's view of a request dropped where the serving replica's
    view names it (`relayedRequestId`), which gains `relayedBy`."""
    relaying = {view["requestId"]: view for view in views if "requestId" in view}
    dropped: set[int] = set()
    for view in views:
        origin = relaying.get(view["relayedRequestId"]) if "relayedRequestId" in view else None
        if origin is not None and origin is not view:
            view["relayedBy"] = origin["replica"]
            dropped.add(id(origin))
    return [view for view in views if id(view) not in dropped]


def _limit(query: Any, *, default: int, maximum: int) -> int | web.Response:
    """The `limit` query parameter, 1..`maximum` in ASCII digits (`default` when absent or empty), or
    the 400 answer."""
    raw = query.get("limit") or str(default)
    limit = int(raw) if _DIGITS.fullmatch(raw) else 0
    if not 1 <= limit <= maximum:
        return error(400, f"limit must be a whole number from 1 to {maximum}")
    return limit


async def _record(request: web.Request) -> TaskRecord | web.Response:
    task_id = request.match_info["task_id"]
    if not task_id or len(task_id) > 256:
        return error(400, "taskId must be 1 to 256 characters")
    try:
        record = await _tasks(request).store.get(task_id)
    except StoreUnavailableError as exc:
        return error(503, str(exc))
    return record if record is not None else error(404, f"unknown or expired task: {task_id}")


async def _detail(request: web.Request, record: TaskRecord) -> dict[str, Any]:
    tasks = _tasks(request)
    live_here = record.task_id in tasks.live
    owner_alive = live_here or record.status.terminal or await tasks.store.lease_alive(record.owner)
    joined = await joined_requests(tasks.store, record.task_id)
    return detail(record, live_here=live_here, owner_alive=owner_alive, requests=1 + joined)


async def show_task(request: web.Request) -> web.Response:
    """`GET /console/api/tasks/{taskId}`: the detail view; 404 unknown or expired."""
    record = await _record(request)
    if isinstance(record, web.Response):
        return record
    try:
        return web.json_response(await _detail(request, record))
    except StoreUnavailableError as exc:
        return error(503, str(exc))


async def cancel_task(request: web.Request) -> web.Response:
    """`POST /console/api/tasks/{taskId}/cancel`: cancel as an operator; 404 unknown or expired,
    409 (with the task) when it had already ended."""
    record = await _record(request)
    if isinstance(record, web.Response):
        return record
    operator = request[OPERATOR_KEY]
    if record.status.terminal:
        return error(409, f"task is already {record.status.value}", task=row(record))
    try:
        new = await _tasks(request).cancel(record, by="operator")
        if new.status is not TaskStatus.CANCELLED and await _tasks(request).store.get(record.task_id) is None:
            return error(404, f"unknown or expired task: {record.task_id}")  # it expired meanwhile
        if new.status is not TaskStatus.CANCELLED:
            return error(409, f"task ended as {new.status.value} before the cancel", task=row(new))
        log.info("console_cancel", task_id=record.task_id, operator=operator, server=record.server)
        return web.json_response(await _detail(request, new))
    except StoreUnavailableError as exc:
        return error(503, str(exc))
