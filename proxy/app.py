"""Build the aiohttp Application from a Config: routes, middlewares, and what opens and closes with it."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
from collections.abc import AsyncIterator

import aiohttp
import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

from proxy.calls.call import Call
from proxy.calls.mrtr import ParkedCalls, load_or_create_key, shared_key
from proxy.calls.upstream_tasks import UpstreamTaskCall
from proxy.config import Config, ServerEntry
from proxy.console import CONSOLE_KEY, ConsoleData, build_console
from proxy.front.auth import Authenticator, auth_middleware
from proxy.front.endpoint import ServerEndpoint
from proxy.front.guards import default_allowed_hosts, host_guard
from proxy.front.middleware import access_log, json_errors
from proxy.legacy.bridge import LegacyBridge
from proxy.modern.dispatcher import ServerDispatcher
from proxy.protocol.jsonrpc import object_of
from proxy.replicas import REPLICAS_KEY, Replicas, advertised_url, make_router, on_response_prepare
from proxy.replicas.forward import SECRET_HEADER as REPLICA_SECRET_HEADER
from proxy.replicas.internal import PREFIX as REPLICA_PREFIX
from proxy.replicas.internal import add_routes as add_replica_routes
from proxy.runtime import metrics
from proxy.runtime.drain import Drain
from proxy.tasks.model import TaskRecord
from proxy.tasks.open_store import open_store, rate_storage
from proxy.tasks.rates import close_rate_storage
from proxy.tasks.recovery import RESTART_MESSAGE
from proxy.tasks.redis_store import RedisTaskStore
from proxy.tasks.service import TaskService
from proxy.tasks.store import StoreUnavailableError
from proxy.upstream.http_pool import UpstreamPool
from proxy.upstream.stdio import StdioCommand
from proxy.upstream.stdio_pool import StdioPool
from proxy.upstream.types import Bounds

log = structlog.get_logger("proxy.app")

CONFIG_KEY = web.AppKey("config", Config)
TASKS_KEY = web.AppKey("tasks", TaskService)
ENDPOINTS_KEY = web.AppKey("endpoints", dict)
POOLS_KEY = web.AppKey("pools", dict)
DRAIN_KEY = web.AppKey("drain", Drain)
PARKED_KEY = web.AppKey("parked", ParkedCalls)


def build_app(config: Config) -> web.Application:
    """The proxy as an aiohttp Application.

    Routes: `/servers/<name>/mcp` for each enabled server, `/mcp` too when exactly one is configured,
    `/healthz` and `/readyz`, and the operator console at `/console/` when `config.console` is set
    (its own sign-in; client credentials never open it). The task store opens and closes with the app (cleanup context); opening
    it raises StoreLockedError when another process serves the same store directory.
    """
    allowed = (
        set(config.listen.allowed_hosts)
        if config.listen.allowed_hosts is not None
        else default_allowed_hosts(config.listen.host)
    )
    authenticator = Authenticator(config.auth)
    if (
        config.replicas is not None
    ):  # a relayed request keeps the principal the relaying replica authenticated
        authenticator.replica_secret = (REPLICA_SECRET_HEADER, config.replicas.secret)
    middlewares = [
        access_log(payloads=config.logging.log_payloads),
        json_errors(),
        host_guard(allowed),
        auth_middleware(
            authenticator,
            own_auth_prefix="/console" if config.console is not None else None,
            internal_prefix=REPLICA_PREFIX if config.replicas is not None else None,
        ),
    ]
    app = web.Application(middlewares=middlewares, client_max_size=config.listen.max_body_bytes)
    app[CONFIG_KEY] = config
    app[ENDPOINTS_KEY] = {}
    app[DRAIN_KEY] = Drain()
    app.cleanup_ctx.append(_lifecycle)

    def endpoint_handler(name: str):
        async def handler(request: web.Request) -> web.StreamResponse:
            return await request.app[ENDPOINTS_KEY][name].handle(request)

        return handler

    servers = config.servers
    for name in servers:
        app.router.add_route("*", f"/servers/{name}/mcp", endpoint_handler(name))
    if len(servers) == 1:
        app.router.add_route("*", "/mcp", endpoint_handler(next(iter(servers))))
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/readyz", _readyz)
    app.router.add_get("/metrics", metrics_handler)
    if config.replicas is not None:
        add_replica_routes(app)
        app.on_response_prepare.append(on_response_prepare)
    if config.console is not None:
        app.router.add_get("/console", _to_console)
        app.add_subapp("/console/", build_console(config))
    return app


async def _to_console(request: web.Request) -> web.Response:
    raise web.HTTPFound("/console/")


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    config = app[CONFIG_KEY]
    store = open_store(config.store, max_result_bytes=config.limits.max_result_bytes, exclusive=True)
    counters = rate_storage(config.store)
    tasks = TaskService(
        store,
        lease_s=config.store.lease,
        outcome_retry_s=config.store.write_retry,
        max_tasks_per_principal=config.limits.max_tasks_per_principal,
        tasks_rate=config.limits.tasks_rate,
        rate_storage=counters,
    )
    app[TASKS_KEY] = tasks
    try:
        if isinstance(store, RedisTaskStore):
            level, message = await store.persistence_report()
            (log.warning if level == "warning" else log.info)(
                "store_persistence", store=store.where, detail=message
            )
            parked = ParkedCalls(await shared_key(store, config.request_state.secret), store)
        else:
            parked = ParkedCalls(load_or_create_key(config.store.path, config.request_state.secret))
    except BaseException:
        await store.close()
        await close_rate_storage(counters)
        raise
    parked.node = tasks.node
    app[PARKED_KEY] = parked
    replicas: Replicas | None = None
    if config.replicas is not None and isinstance(
        store, RedisTaskStore
    ):  # the config requires store.url with replicas
        replicas = Replicas(config, tasks=tasks, shared=store, url=advertised_url(config))
        tasks.remote = replicas
        app[REPLICAS_KEY] = replicas
    http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), auto_decompress=True)
    pools = []
    for name, entry in config.servers.items():
        pool = make_pool(name, entry, http)
        pools.append(pool)
        dispatcher = ServerDispatcher(
            name=name,
            config=config,
            pool=pool,
            tasks=tasks,
            parked=parked,
            keepalive_s=config.listen.sse_keepalive,
            drain=app[DRAIN_KEY],
        )
        pool.on_notification = dispatcher.server_notification
        bridge = LegacyBridge(name, pool, drain=app[DRAIN_KEY]) if isinstance(pool, StdioPool) else None
        endpoint = ServerEndpoint(
            name=name, url=entry.url, headers=entry.headers, http=http, dispatcher=dispatcher, bridge=bridge
        )
        app[DRAIN_KEY].at_deadline(endpoint.legacy.drained)
        if replicas is not None:
            endpoint.router = make_router(replicas, endpoint, parked).route
        app[ENDPOINTS_KEY][name] = endpoint
    by_name = {pool.server: pool for pool in pools}
    app[POOLS_KEY] = by_name
    if config.console is not None:
        app[CONSOLE_KEY] = ConsoleData(tasks, by_name)
    try:
        await tasks.start(
            lambda record: _rerun(config, app[POOLS_KEY], tasks, record),
            restart_message=None if replicas else RESTART_MESSAGE,
        )
        if replicas is not None:
            await replicas.start()
    except BaseException:
        await store.close()
        await close_rate_storage(counters)
        raise
    # Open each upstream session early (in the background) so the first call does not pay for initialize.
    warmups = [asyncio.get_running_loop().create_task(pool.check()) for pool in pools]
    log.info("proxy_started", servers=list(config.servers), store=store.where, node=tasks.node)
    try:
        yield
    finally:
        for warmup in warmups:
            warmup.cancel()
        await tasks.stop()
        if replicas is not None:
            await replicas.stop()
        for endpoint in app[ENDPOINTS_KEY].values():
            endpoint.legacy.close()  # the legacy relay's stream pumps
        for pool in pools:
            await pool.close()
        await http.close()
        await store.close()
        await close_rate_storage(counters)
        log.info("proxy_stopped", node=tasks.node)


def _rerun(config: Config, pools: dict, tasks: TaskService, record: TaskRecord) -> Call | None:
    """Start again, after its owner died, the upstream call of a task configured `on_restart: rerun`."""
    pool = pools.get(record.server)
    if pool is None or record.rerun is None:
        return None
    policy = config.policy(record.server, record.tool)
    # A task backed by the upstream's own task follows it again (and a cancel still reaches it).
    kind = UpstreamTaskCall if record.rerun["method"] == "tasks/result" else Call
    call = kind(
        pool=pool,
        server=record.server,
        tool=record.tool,
        method=record.rerun["method"],
        params=record.rerun["params"],
        capabilities=record.rerun["capabilities"],
        timeout=policy.timeout,
        input_timeout=policy.input_timeout,
        principal=record.principal,
    )
    if isinstance(call, UpstreamTaskCall):
        call.upstream_task_id = str(object_of(record.rerun["params"]).get("taskId", ""))
    call.detach(record.task_id, tasks)
    call.start()
    return call


def make_pool(name: str, entry: ServerEntry, http: aiohttp.ClientSession) -> UpstreamPool | StdioPool:
    """The upstream connector of one server: Streamable HTTP sessions or stdio children."""
    if entry.url:
        return UpstreamPool(http, name, entry.url, entry.headers, bounds=Bounds.from_entry(entry))
    assert entry.command is not None
    return StdioPool(
        name,
        StdioCommand(entry.command, list(entry.args), dict(entry.env), entry.cwd),
        instances=entry.instances,
        max_concurrency=entry.max_concurrency,
        per_principal=entry.isolation == "per_principal",
        idle_timeout=entry.idle_timeout,
        init_timeout=entry.init_timeout,
        max_restarts=entry.max_restarts,
        bounds=Bounds.from_entry(entry),
        max_children=entry.max_children,
    )


async def _healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def _readyz(request: web.Request) -> web.Response:
    checks: dict[str, str] = {}
    if request.app[DRAIN_KEY].started:  # shutting down: a load balancer sends nothing new here
        checks["drain"] = "draining: this proxy is shutting down"
    try:
        await asyncio.wait_for(request.app[TASKS_KEY].store.check_writable(), timeout=2.0)
        checks["store"] = "ok"
    except (StoreUnavailableError, TimeoutError) as exc:
        checks["store"] = f"failed: {exc or 'no answer within 2 s'}"
    pools = request.app[POOLS_KEY]
    problems = await asyncio.gather(*(pool.check(timeout_s=2.0) for pool in pools.values()))
    for name, problem in zip(pools, problems, strict=True):
        checks[f"upstream:{name}"] = problem or "ok"
    ready = all(v == "ok" for v in checks.values())
    replicas = request.app.get(REPLICAS_KEY)
    if replicas is not None and replicas.peer_problem:  # non-fatal: reported, the replica stays ready
        checks["replicas"] = replicas.peer_problem
    return web.json_response({"ready": ready, "checks": checks}, status=200 if ready else 503)


async def metrics_handler(request: web.Request) -> web.Response:
    """`/metrics` in the Prometheus text format; with `metrics.token` configured only for
    `Authorization: Bearer <token>` (401 with a JSON-RPC error otherwise)."""
    expected = request.app[CONFIG_KEY].metrics.token
    if expected is not None:
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        digest = hashlib.sha256(token.strip().encode()).hexdigest()
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            digest, expected.removeprefix("sha256:").lower()
        ):
            log.warning(
                "security_auth_failed",
                reason="metrics token missing or wrong",
                remote=request.remote,
                path=request.path,
            )
            body = {
                "jsonrpc": "2.0",
                "id": None,
                "error": {
                    "code": -32600,
                    "message": "authentication required: /metrics needs its bearer token",
                },
            }
            return web.json_response(
                body, status=401, headers={"WWW-Authenticate": 'Bearer realm="mcp-tasks-proxy metrics"'}
            )
    tasks = request.app[TASKS_KEY]
    try:
        metrics.STORE_TASKS.set(await tasks.store.count())
        metrics.STORE_BYTES.set(await tasks.store.volume())
    except Exception:  # a store fault must not hide the other metrics
        log.warning("store_metrics_unavailable")
    metrics.LIVE_TASKS.set(len(tasks.live))
    return web.Response(body=generate_latest(REGISTRY), headers={"Content-Type": CONTENT_TYPE_LATEST})
