"""Build the aiohttp Application from a Config: routes, middlewares, and what opens and closes with it."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
from collections.abc import AsyncIterator

import aiohttp
import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

from proxy.calls.mrtr import ParkedCalls, derive_key, load_or_create_key, shared_key
from proxy.calls.rerun import Rerunner
from proxy.config import Config, ServerEntry
from proxy.console import CONSOLE_KEY, ConsoleData, build_console
from proxy.front.auth import Authenticator, auth_middleware, too_many_failures
from proxy.front.endpoint import ServerEndpoint
from proxy.front.guards import default_allowed_hosts, expect_continue, host_guard
from proxy.front.middleware import access_log, json_errors, request_id_header
from proxy.front.resource import ProtectedResource
from proxy.front.scopes import ScopeCheck
from proxy.legacy.child import StdioChild
from proxy.legacy.endpoint import LegacyEndpoint
from proxy.legacy.relay import HttpRelay
from proxy.legacy.session import LegacySessions
from proxy.legacy.streams import StreamServer
from proxy.legacy.types import LegacyUpstream
from proxy.legacy.v1 import V1Front
from proxy.modern.dispatcher import ServerDispatcher
from proxy.protocol.jsonrpc import JsonObject
from proxy.replicas import EndpointRouter, Replicas, advertised_url, on_response_prepare
from proxy.replicas.internal import INTERNAL_KEY, InternalEndpoints
from proxy.replicas.internal import PREFIX as REPLICA_PREFIX
from proxy.replicas.internal import add_routes as add_replica_routes
from proxy.runtime import metrics, tracing
from proxy.runtime.drain import Drain
from proxy.runtime.fanout import Fanout
from proxy.runtime.running import RunningRequests
from proxy.tasks.model import new_node_id, use_principal_hash_key
from proxy.tasks.open_store import open_store, rate_storage
from proxy.tasks.rates import FailedAttempts, close_rate_storage
from proxy.tasks.redis_store import RedisTaskStore
from proxy.tasks.service import RESTART_MESSAGE, TaskService
from proxy.tasks.store import StoreUnavailableError, TaskStore
from proxy.upstream.connections import UpstreamHttp
from proxy.upstream.credentials import ClientCredentials
from proxy.upstream.http_pool import UpstreamPool
from proxy.upstream.stdio import StdioCommand
from proxy.upstream.stdio_pool import StdioPool
from proxy.upstream.types import Bounds, Pool

log = structlog.get_logger("proxy.app")

CONFIG_KEY = web.AppKey("config", Config)
TASKS_KEY = web.AppKey("tasks", TaskService)
ENDPOINTS_KEY = web.AppKey("endpoints", dict[str, ServerEndpoint])
POOLS_KEY = web.AppKey("pools", dict[str, Pool])
DRAIN_KEY = web.AppKey("drain", Drain)
RUNNING_KEY = web.AppKey("running", RunningRequests)  # the requests being answered (console, replicas)
PARKED_KEY = web.AppKey("parked", ParkedCalls)
REPLICAS_KEY = web.AppKey("replicas", Replicas)
RESOURCE_KEY = web.AppKey("resource", ProtectedResource)  # the proxy as an OAuth protected resource
THROTTLE_KEY = web.AppKey("throttle", FailedAttempts)  # wrong credentials per client address
READY_CHECK_S = 1.5  # bound (s) of each /readyz check, run at once: under a balancer's usual 2 s
ANSWER_GRACE_S = 0.5  # how long (s) requests the drain abandoned have to write their -32603 before cuts


def build_app(config: Config) -> web.Application:
    """The proxy as an aiohttp Application.

    Routes: `/servers/<name>/mcp` for each enabled server, `/mcp` too when exactly one is
    configured, `/healthz` and `/readyz`, and the operator console at `/console/` when
    `config.console` is set (its own sign-in; client credentials never open it). The task store
    opens and closes with the app (cleanup context); opening it raises StoreLockedError when
    another process serves the same store directory.
    """
    allowed = (
        set(config.listen.allowed_hosts)
        if config.listen.allowed_hosts is not None
        else default_allowed_hosts(config.listen.host, config.listen.public_url)
    )
    resource = ProtectedResource(config)
    # A relayed request keeps the principal the relaying replica authenticated.
    authenticator = Authenticator(
        config.auth,
        resource=resource if config.listen.public_url is not None else None,
        replica_secret=config.replicas.secret if config.replicas is not None else None,
    )
    throttle = FailedAttempts(config.limits.failed_auth)
    drain = Drain()
    running = RunningRequests()
    middlewares = [
        access_log(drain, running),
        json_errors(),
        host_guard(allowed, console_prefix="/console" if config.console is not None else None),
        auth_middleware(
            authenticator,
            resource,
            throttle=throttle,
            listen=config.listen,
            own_auth_prefix="/console" if config.console is not None else None,
            internal_prefix=REPLICA_PREFIX if config.replicas is not None else None,
        ),
    ]
    app = web.Application(middlewares=middlewares, client_max_size=config.listen.max_body_bytes)
    app.on_response_prepare.append(request_id_header)
    app[CONFIG_KEY] = config
    app[ENDPOINTS_KEY] = {}
    app[DRAIN_KEY] = drain
    app[RUNNING_KEY] = running
    app[RESOURCE_KEY] = resource
    app[THROTTLE_KEY] = throttle
    app.cleanup_ctx.append(_lifecycle)
    app.on_cleanup.append(lambda _: authenticator.close())

    def endpoint_handler(name: str):
        async def handler(request: web.Request) -> web.StreamResponse:
            return await request.app[ENDPOINTS_KEY][name].handle(request)

        return handler

    servers = config.servers
    for name in servers:
        app.router.add_route(
            "*", f"/servers/{name}/mcp", endpoint_handler(name), expect_handler=expect_continue
        )
    if len(servers) == 1:
        app.router.add_route(
            "*", "/mcp", endpoint_handler(next(iter(servers))), expect_handler=expect_continue
        )
    app.router.add_get("/healthz", _healthz, expect_handler=expect_continue)
    app.router.add_get("/readyz", _readyz, expect_handler=expect_continue)
    app.router.add_get("/metrics", metrics_handler, expect_handler=expect_continue)
    resource.add_routes(app)
    if config.replicas is not None:
        add_replica_routes(app)
        app.on_response_prepare.append(on_response_prepare)
    if config.console is not None:
        app.router.add_get("/console", _to_console)
        app.add_subapp("/console/", build_console(config, throttle))
    return app


async def _to_console(request: web.Request) -> web.Response:
    raise web.HTTPFound("/console/")


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    """Open what the app serves with, in the order each part needs the others, and close it all in
    reverse when the app stops: the store and its counters, this node (and, with `replicas`, its
    place among them), the upstream pools, the task service, parked MRTR calls, then the endpoint
    of each server."""
    config = app[CONFIG_KEY]
    async with contextlib.AsyncExitStack() as stack:
        if tracing.install(config.tracing):  # before the client sessions: they carry its instrumentation
            stack.push_async_callback(asyncio.to_thread, tracing.shutdown)  # a flush, bounded by the SDK
        store = open_store(config.store, max_result_bytes=config.limits.max_result_bytes, exclusive=True)
        stack.push_async_callback(store.close)
        counters = rate_storage(config.store)
        stack.push_async_callback(close_rate_storage, counters)
        app[THROTTLE_KEY].use_storage(counters)
        node = new_node_id()
        replicas = (
            Replicas(config, node=node, lease_s=config.store.lease, shared=store, url=advertised_url(config))
            if config.replicas is not None and isinstance(store, RedisTaskStore)  # the config requires it
            else None
        )
        http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), auto_decompress=True)
        stack.push_async_callback(http.close)  # token endpoints
        upstream_http = {  # one pool per HTTP upstream, its idle connections expiring before the server's
            name: UpstreamHttp(server=name, keepalive_s=entry.keepalive_timeout)
            for name, entry in config.servers.items()
            if entry.url
        }
        for client in upstream_http.values():
            stack.push_async_callback(client.close)
        notifications = {
            name: Fanout[JsonObject](f"upstream notifications {name}") for name in config.servers
        }
        children = {
            name: stdio_pool(name, entry, notifications[name])
            for name, entry in config.servers.items()
            if entry.command
        }
        credentials = {
            name: ClientCredentials(entry.oauth, http, server=name, timeout_s=entry.request_timeout)
            for name, entry in config.servers.items()
            if entry.oauth is not None
        }
        pools: dict[str, Pool] = {
            name: children.get(name)
            or http_pool(name, entry, upstream_http[name], notifications[name], credentials.get(name))
            for name, entry in config.servers.items()
        }
        for pool in pools.values():
            stack.push_async_callback(pool.close)
        rerunner = Rerunner(config, pools)
        tasks = TaskService(
            store,
            node=node,
            lease_s=config.store.lease,
            outcome_retry_s=config.store.write_retry,
            max_tasks_per_principal=config.limits.max_tasks_per_principal,
            tasks_rate=config.limits.tasks_rate,
            rate_storage=counters,
            rerun=rerunner,
            cancel_orphan=rerunner.cancel_orphan,
            remote=replicas,
            fence=isinstance(store, RedisTaskStore),
        )
        key = await _deployment_key(config, store)
        use_principal_hash_key(derive_key(key, "principal-hash"))
        parked = _parked_calls(key, store, node)
        drain = app[DRAIN_KEY]
        for name, entry in config.servers.items():
            dispatcher = ServerDispatcher(
                name=name,
                config=config,
                pool=pools[name],
                tasks=tasks,
                parked=parked,
                notifications=notifications[name],
                keepalive_s=config.listen.sse_keepalive,
                drain=drain,
            )
            sessions = LegacySessions(
                name,
                node=node if replicas is not None else "",
                max_per_principal=config.limits.max_sessions_per_principal,
            )
            drain.at_deadline(sessions.drained)
            stack.callback(sessions.close)  # every reply stream's pump
            streams = StreamServer(
                sessions=sessions,
                keepalive_s=config.listen.sse_keepalive,
                replay_events=config.listen.replay_events,
                replay_bytes=config.listen.replay_bytes,
            )
            v1 = V1Front(
                server=name,
                config=config,
                pool=pools[name],
                tasks=tasks,
                keepalive_s=config.listen.sse_keepalive,
            )
            child = children.get(name)
            upstream: LegacyUpstream = (
                StdioChild(name=name, pool=child, sessions=sessions, streams=streams, v1=v1)
                if child is not None
                else HttpRelay(
                    name=name,
                    url=entry.url or "",
                    headers=entry.headers,
                    http=upstream_http[name],
                    bounds=Bounds.from_entry(entry),
                    sessions=sessions,
                    streams=streams,
                    v1=v1,
                    credentials=credentials.get(name),
                )
            )
            router = (
                EndpointRouter(replicas, server=name, kind=upstream.kind, sessions=sessions, parked=parked)
                if replicas is not None
                else None
            )
            app[ENDPOINTS_KEY][name] = ServerEndpoint(
                name=name,
                dispatcher=dispatcher,
                legacy=LegacyEndpoint(
                    name=name,
                    sessions=sessions,
                    streams=streams,
                    upstream=upstream,
                    v1=v1,
                    forget_shared=router.forget if router is not None else None,
                ),
                body_timeout=config.listen.body_timeout,
                log_payloads=config.logging.log_payloads,
                router=router.route if router is not None else None,
                scopes=ScopeCheck(app[RESOURCE_KEY], name, tasks) if config.auth.scopes else None,
                drain=drain,
            )
        app[TASKS_KEY], app[POOLS_KEY], app[PARKED_KEY] = tasks, pools, parked
        if config.console is not None:
            app[CONSOLE_KEY] = ConsoleData(
                tasks,
                pools,
                running=app[RUNNING_KEY],
                replicas=replicas,
                cookie_key=derive_key(key, "console-cookie"),
            )
        await tasks.start(restart_message=None if replicas else RESTART_MESSAGE)
        stack.push_async_callback(tasks.stop)
        if replicas is not None:
            app[REPLICAS_KEY] = replicas
            app[INTERNAL_KEY] = InternalEndpoints(replicas, tasks, app[RUNNING_KEY])
            await replicas.start()
            stack.push_async_callback(replicas.stop)
        sweeper = asyncio.get_running_loop().create_task(
            _expire_legacy_sessions(app, config.listen.legacy_session_idle)
        )
        stack.callback(sweeper.cancel)
        # Open each upstream session early (in the background) so the first call does not pay for initialize.
        warmups = [asyncio.get_running_loop().create_task(pool.check()) for pool in pools.values()]
        for warmup in warmups:
            stack.callback(warmup.cancel)
        log.info("proxy_started", servers=list(config.servers), store=store.where, node=node)
        yield
    log.info("proxy_stopped", node=node)


async def _expire_legacy_sessions(app: web.Application, idle_s: float) -> None:
    """Every quarter of `idle_s` (s; at most every 60 s): forget the legacy sessions of every
    server that were idle for `idle_s` with nothing in flight, and DELETE their upstream sessions."""
    every = min(60.0, max(0.05, idle_s / 4))
    while True:
        await asyncio.sleep(every)
        for endpoint in list(app[ENDPOINTS_KEY].values()):
            try:
                await endpoint.legacy.expire_idle(idle_s)
            except Exception:  # the sweep must outlive any one bad round
                log.exception("legacy_session_expiry_failed", server=endpoint.name)


async def _deployment_key(config: Config, store: TaskStore) -> bytes:
    """The deployment's key: the `request_state` secret, else one generated once and kept beside a
    diskcache store or shared through a Redis store. It signs MRTR `requestState`; the console cookie
    key and the principal-hash key are derived from it (`mrtr.derive_key`). Raises ConfigError for an
    unusable key, StoreUnavailableError."""
    if isinstance(store, RedisTaskStore):
        level, message = await store.persistence_report()
        (log.warning if level == "warning" else log.info)(
            "store_persistence", store=store.where, detail=message
        )
        return await shared_key(store, config.request_state.secret)
    return load_or_create_key(config.store.path, config.request_state.secret)


def _parked_calls(key: bytes, store: TaskStore, node: str) -> ParkedCalls:
    """The MRTR calls of this node, signed with `key`; a Redis store's claims make every state
    single-use across replicas."""
    if isinstance(store, RedisTaskStore):
        return ParkedCalls(key, store, node=node)
    return ParkedCalls(key, node=node)


def http_pool(
    name: str,
    entry: ServerEntry,
    http: UpstreamHttp,
    notifications: Fanout[JsonObject],
    credentials: ClientCredentials | None,
) -> UpstreamPool:
    """The Streamable HTTP sessions of one server (`entry.url`), publishing the upstream's
    server-wide notifications on `notifications`, with the proxy's own token (`credentials`)."""
    return UpstreamPool(
        http,
        name,
        entry.url or "",
        entry.headers,
        bounds=Bounds.from_entry(entry),
        on_notification=notifications.publish,
        credentials=credentials,
    )


def stdio_pool(name: str, entry: ServerEntry, notifications: Fanout[JsonObject]) -> StdioPool:
    """The child processes of one stdio server (`entry.command`), publishing the upstream's
    server-wide notifications on `notifications`."""
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
        on_notification=notifications.publish,
    )


async def _healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def _readyz(request: web.Request) -> web.Response:
    checks: dict[str, str] = {}
    if request.app[DRAIN_KEY].started:  # shutting down: a load balancer sends nothing new here
        checks["drain"] = "draining: this proxy is shutting down"
    tasks = request.app[TASKS_KEY]
    try:
        await asyncio.wait_for(tasks.store.check_writable(), timeout=READY_CHECK_S)
        metrics.STORE_WRITABLE.set(1)
        read_problem = tasks.store.damage or tasks.read_problem()
        checks["store"] = "ok" if read_problem is None else f"failed: reads fail: {read_problem}"
    except (StoreUnavailableError, TimeoutError) as exc:
        metrics.STORE_WRITABLE.set(0)
        checks["store"] = f"failed: {str(exc) or f'no answer within {READY_CHECK_S:g} s'}"
    pools = request.app[POOLS_KEY]
    problems = await asyncio.gather(*(pool.check(timeout_s=READY_CHECK_S) for pool in pools.values()))
    for name, problem in zip(pools, problems, strict=True):
        checks[f"upstream:{name}"] = problem or "ok"
    # One broken server must not take the whole proxy out of a balancer: the others still serve.
    serving = [problem is None for problem in problems]
    ready = "drain" not in checks and checks["store"] == "ok" and (not serving or any(serving))
    replicas = request.app.get(REPLICAS_KEY)
    if replicas is not None and replicas.peer_problem:  # non-fatal: reported, the replica stays ready
        checks["replicas"] = replicas.peer_problem
    return web.json_response({"ready": ready, "checks": checks}, status=200 if ready else 503)


async def metrics_handler(request: web.Request) -> web.Response:
    """`/metrics` in the Prometheus text format (the store's gauges, and with replicas the live
    replica count, are read from the store first); with `metrics.token` configured only for
    `Authorization: Bearer <token>` (401 with a JSON-RPC error otherwise; wrong tokens count against
    `limits.failed_auth`, 429 past it)."""
    config = request.app[CONFIG_KEY]
    expected = config.metrics.token
    if expected is not None:
        headers = request.headers.getall("Authorization", [])
        header = headers[0] if len(headers) == 1 else None  # two: which counts is never guessed (401)
        throttle = request.app[THROTTLE_KEY]
        address = config.listen.client_address(request.remote, request.headers.getall("X-Forwarded-For", []))
        if header is not None and (wait_s := await throttle.admit(header, address, path=request.path)):
            return too_many_failures(wait_s, throttle.text)
        scheme, _, token = (header or "").partition(" ")
        digest = hashlib.sha256(token.strip().encode("utf-8", "surrogatepass")).hexdigest()
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            digest, expected.removeprefix("sha256:").lower()
        ):
            log.warning(
                "security_auth_failed",
                reason="metrics token missing or wrong",
                remote=address,
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
        throttle.remember_good(header or "")
    tasks = request.app[TASKS_KEY]
    replicas = request.app.get(REPLICAS_KEY)
    try:
        metrics.STORE_TASKS.set(await tasks.store.count())
        metrics.STORE_BYTES.set(await tasks.store.volume())
        if replicas is not None and isinstance(tasks.store, RedisTaskStore):
            # the replica set: its Redis server (no credentials) and key prefix
            store = metrics.label_value(f"{tasks.store.where} {tasks.store.keys.prefix}")
            metrics.REPLICAS.labels(store).set(await replicas.live_count())
    except Exception:  # a store fault must not hide the other metrics
        log.warning("store_metrics_unavailable")
    metrics.LIVE_TASKS.set(len(tasks.live))
    return web.Response(body=generate_latest(REGISTRY), headers={"Content-Type": CONTENT_TYPE_LATEST})


async def drain(app: web.Application, interrupted: asyncio.Event) -> None:
    """Begin the SIGTERM drain: synchronous calls have `listen.drain_timeout` (s) from now (the
    runner's shutdown waits for them). A replica also keeps serving while it drains: /readyz says
    503 at once, new calls and sessions are refused (503, so a load balancer retries them
    elsewhere), and the detached calls it runs (and MRTR calls parked here, and outcomes or
    idempotency answers the store has not taken yet: `TaskService.pending_writes`) go on for up to
    `listen.drain_detached` (s) while other replicas serve their polls, or until `interrupted` is
    set (a second SIGTERM or SIGINT); then its streams are cut, their clients reconnect elsewhere.
    Even with nothing left to run, a replica drains for `listen.drain_grace` (s) at least, so its
    load balancer has taken it out before its listener and keep-alive connections close."""
    config = app[CONFIG_KEY]
    app[DRAIN_KEY].start(config.listen.drain_timeout)
    replicas = app.get(REPLICAS_KEY)
    if replicas is None:  # a lone proxy: its streams end now, synchronous calls keep drain_timeout
        if cut := app[DRAIN_KEY].close_streams():
            log.info("streams_cut_at_shutdown", streams=cut)
        return
    tasks, parked = app[TASKS_KEY], app[PARKED_KEY]
    await replicas.begin_drain()
    listen = config.listen

    async def settled() -> None:
        await asyncio.gather(
            replicas.wait_idle(
                listen.drain_detached,
                busy=lambda: bool(tasks.live) or len(parked) > 0 or tasks.pending_writes() > 0,
            ),
            asyncio.sleep(min(listen.drain_grace, listen.drain_detached)),
        )

    idle = asyncio.ensure_future(settled())
    stopped = asyncio.ensure_future(interrupted.wait())
    try:
        await asyncio.wait({idle, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        idle.cancel()
        stopped.cancel()
    # Synchronous calls keep their drain_timeout (a second signal cuts it short): a request still
    # running gets until then, and ANSWER_GRACE_S more to write the -32603 the drain gives it, before
    # anything is cut. Streams that last as long as their client would hold it that long: they are
    # cut then, and their clients reconnect.
    await replicas.wait_idle((app[DRAIN_KEY].remaining() or 0.0) + ANSWER_GRACE_S, busy=lambda: False)
    app[DRAIN_KEY].cutting = True
    streams = replicas.close_streams()
    log.info("replica_drained", node=replicas.node, still_running=len(tasks.live), streams_cut=streams)
