"""Modern-era (2026-07-28) method dispatch for one configured upstream server: a method table that
only routes.

The proxy answers `server/discover` and `tasks/*` itself (`task_methods`), runs `tools/call`,
`prompts/get` and `resources/read` as proxy-owned calls (`calls`), relays list changes on
`subscriptions/listen` (`listen`), and forwards everything else to the upstream session that
matches the request's client capabilities, translating results on the way back (protocol.md §1.6).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import structlog

from proxy import __version__
from proxy.calls.keys import call_key
from proxy.calls.mrtr import ParkedCalls
from proxy.calls.runner import CallRunner, require_tasks_for
from proxy.calls.types import Reply
from proxy.calls.upstream_tasks import UpstreamTasks
from proxy.config import Config, ResolvedPolicy, ToolMode
from proxy.modern.listen import listen
from proxy.modern.param_headers import ParamHeaderIndex
from proxy.modern.task_methods import TaskMethods
from proxy.modern.types import ModernRequest
from proxy.protocol.era import (
    LEGACY_VERSIONS,
    META_SERVER_INFO,
    MODERN_VERSIONS,
    TASKS_EXTENSION,
    Envelope,
    check_param_headers,
    modern_method_refusal,
    strip_envelope,
    upstream_capabilities,
)
from proxy.protocol.jsonrpc import INTERNAL_ERROR, INVALID_PARAMS, METHOD_NOT_FOUND, JsonObject, JsonRpcError
from proxy.protocol.translate import modern_error, modern_result
from proxy.runtime import metrics
from proxy.runtime.drain import Drain
from proxy.runtime.fanout import Fanout
from proxy.runtime.running import MAX_BOUND_METHOD, MAX_BOUND_NAME, bind
from proxy.tasks.service import TaskService
from proxy.upstream.types import Pool, Session, SessionExpiredError, UpstreamError, with_session

log = structlog.get_logger("proxy.modern")

MIN_LOOKUP_WAIT_S = 0.001  # even past detach_after, a cached lookup (s) gets to answer

Handler = Callable[[ModernRequest], Awaitable[JsonObject]]


class ServerDispatcher:
    """Routes modern requests for one upstream server (`name`); shares the TaskService across servers.

    `notifications` is the server's fan-out of upstream server-wide notifications (list changes),
    which its pool and its calls publish; the dispatcher forgets its cached tool facts on a tool
    list change and relays them on `subscriptions/listen`. `keepalive_s` (s) is the SSE comment
    interval while a client waits; `drain` the process's SIGTERM drain.
    """

    def __init__(
        self,
        *,
        name: str,
        config: Config,
        pool: Pool,
        tasks: TaskService,
        parked: ParkedCalls,
        notifications: Fanout[JsonObject],
        drain: Drain,
        keepalive_s: float = 15.0,
    ) -> None:
        self.name = name
        self.config = config
        self.pool = pool
        self.tasks = tasks
        self.notifications = notifications
        self.keepalive_s = keepalive_s
        self.param_headers = ParamHeaderIndex(name)
        self._lookups_left: set[asyncio.Future[Any]] = set()  # `_lookups` that outlasted detach_after
        self.task_methods = TaskMethods(tasks, name)
        self.upstream_tasks = UpstreamTasks(
            name=name, pool=pool, tasks=tasks, keepalive_s=keepalive_s, drain=drain
        )
        self.calls = CallRunner(
            name=name,
            pool=pool,
            tasks=tasks,
            parked=parked,
            drain=drain,
            keepalive_s=keepalive_s,
            on_server_notification=notifications.publish,
        )
        notifications.listen(self._forget_tool_facts)
        self.routes: dict[str, Handler] = {
            "server/discover": self._discover,
            "tasks/get": self.task_methods.get,
            "tasks/update": self.task_methods.update,
            "tasks/cancel": self.task_methods.cancel,
            "tools/call": self.call_tool,
            "prompts/get": self._prompt,
            "resources/read": self._resource,
            "subscriptions/listen": self._listen,
        }

    async def dispatch(
        self, body: JsonObject, envelope: Envelope, *, principal: str, reply: Reply
    ) -> JsonObject:
        """Answer one request; return the `result` object. Raises JsonRpcError for error replies
        (-32601, HTTP 404, for any method outside the 2026-07-28 surface: it never reaches the upstream)."""
        method = body["method"]
        params = body.get("params") or {}
        bind(rpc_method=method[:MAX_BOUND_METHOD], server=self.name)
        refusal = modern_method_refusal(method)
        if refusal is not None:
            raise refusal
        handler = self.routes.get(method)
        if handler is not None:
            return await handler(ModernRequest(body, params, envelope, principal, reply))
        return await self.forward(method, params, envelope, principal)

    # -- server/discover ---------------------------------------------------------------------

    async def _discover(self, request: ModernRequest) -> JsonObject:
        """`server/discover`, built from the upstream's `initialize` result plus the tasks extension."""
        session = await self._session(request.envelope, request.principal)
        init = session.initialize_result
        caps = {
            k: v for k, v in (init.get("capabilities") or {}).items() if k not in ("tasks", "experimental")
        }
        for key in ("tools", "prompts", "resources"):
            if isinstance(caps.get(key), dict):
                # listChanged stays: the proxy relays the upstream's list changes on subscriptions/listen.
                caps[key] = {k: v for k, v in caps[key].items() if k != "subscribe"}
        extensions = dict(caps.get("extensions") or {})
        extensions[TASKS_EXTENSION] = {}
        caps["extensions"] = extensions
        result: JsonObject = {
            "resultType": "complete",
            "supportedVersions": [*MODERN_VERSIONS, *LEGACY_VERSIONS],
            "capabilities": caps,
            "ttlMs": 0,
            "cacheScope": "private",
            "_meta": {
                META_SERVER_INFO: {
                    "name": "mcp-tasks-proxy",
                    "version": __version__,
                    "upstream": init.get("serverInfo"),
                }
            },
        }
        if init.get("instructions"):
            result["instructions"] = init["instructions"]
        return result

    async def _listen(self, request: ModernRequest) -> JsonObject:
        session = await self._session(request.envelope, request.principal)
        return await listen(
            request.body["id"],
            request.params,
            request.envelope,
            upstream_capabilities=session.initialize_result.get("capabilities") or {},
            notifications=self.notifications,
            tasks=self.tasks,
            principal=request.principal,
            server=self.name,
            reply=request.reply,
            keepalive_s=self.keepalive_s,
        )

    # -- tools/call, prompts/get, resources/read ---------------------------------------------

    async def call_tool(self, request: ModernRequest) -> JsonObject:
        """Run `tools/call` upstream; return its result, an InputRequiredResult (SEP-2322), or a flat
        CreateTaskResult (ext-tasks, once the call outlives `detach_after` s since it arrived).

        Raises JsonRpcError: -32602 for bad params or a bad `requestState`, -32020 for a missing
        `Mcp-Param` header, -32021 for a `required` tool without the tasks extension, a limit error
        (HTTP 429), the upstream's own error (translated), or -32603 naming the layer that gave up.
        """
        params, envelope, principal, reply = (
            request.params,
            request.envelope,
            request.principal,
            request.reply,
        )
        arrived = reply.arrived or asyncio.get_running_loop().time()
        tool = params.get("name")
        if not isinstance(tool, str) or not tool:
            raise JsonRpcError(INVALID_PARAMS, "tools/call needs params.name (a string)")
        if "arguments" in params and not isinstance(params["arguments"], dict):
            raise JsonRpcError(INVALID_PARAMS, "tools/call params.arguments must be an object")
        bind(tool=tool[:MAX_BOUND_NAME])
        key = call_key(reply.headers, params)
        policy = self.config.policy(self.name, tool)
        if policy.mode is ToolMode.REQUIRED and not envelope.declares_tasks:
            raise require_tasks_for(tool)
        known = self._known_lookups(tool, params, policy, principal)
        if known is not None:  # what the call needs is cached: no task, no wait
            names, support = known
        elif envelope.declares_tasks and policy.mode is not ToolMode.FORBIDDEN:
            lookups = asyncio.ensure_future(self._lookups(tool, params, policy, envelope, principal))
            names, support = await self._by_detach(lookups, arrived + policy.detach_after, tool)
        else:
            names, support = await self._lookups(tool, params, policy, envelope, principal)
        if names:
            check_param_headers(reply.headers, params.get("arguments"), names)
        # An upstream with v1 tasks of its own (upstream_tasks): its task backs the client's.
        upstream_task = support == "required" or (support == "optional" and envelope.declares_tasks)
        if not upstream_task and policy.mode is ToolMode.REQUIRED:
            await self.tasks.check_capacity(principal)  # refuse before anything reaches the upstream
        keyed = None
        if "requestState" not in params:  # (an MRTR retry goes on with the call it resumes)
            keyed, answer = await self.calls.keys.claim_or_join(
                principal=principal,
                server=self.name,
                tool=tool,
                arguments=params.get("arguments"),
                key=key,
                policy=policy,
                as_task=envelope.declares_tasks and policy.mode is not ToolMode.FORBIDDEN,
                reply=reply,
                keepalive_s=self.keepalive_s,
            )
            if answer is not None:
                return answer
        if upstream_task:
            return await self.upstream_tasks.call(
                params,
                envelope,
                principal=principal,
                reply=reply,
                policy=policy,
                as_task=envelope.declares_tasks,
                keyed=keyed,
            )
        return await self.calls.run(
            "tools/call",
            tool,
            params,
            envelope,
            principal=principal,
            reply=reply,
            policy=policy,
            arrived=arrived,
            keyed=keyed,
        )

    def _known_lookups(
        self, tool: str, params: JsonObject, policy: ResolvedPolicy, principal: str
    ) -> tuple[dict[str, str], str | None] | None:
        """What `_lookups` would answer when what it needs is cached already (the common case past a
        principal's first call), else None: the Mcp-Param names always, the upstream's task support
        too unless the call resumes a `requestState` or the tool is `mode: forbidden`."""
        names = self.param_headers.known(tool, principal)
        if names is None:
            return None
        if "requestState" in params or policy.mode is ToolMode.FORBIDDEN:
            return names, None
        read, support = self.upstream_tasks.known_support(tool)
        return (names, support) if read else None

    async def _lookups(
        self, tool: str, params: JsonObject, policy: ResolvedPolicy, envelope: Envelope, principal: str
    ) -> tuple[dict[str, str], str | None]:
        """What a `tools/call` needs before it starts: `{argument: Mcp-Param header name}` of `tool`
        (from the upstream's `tools/list`) and the upstream's own `taskSupport` for it (None: the
        upstream has no tasks for it, or the call resumes a `requestState` or is `mode: forbidden`).
        Both wait on the upstream session (its `init_timeout`) and `tools/list` (`request_timeout`)
        the first time; later calls read them cached."""
        names = await self.param_headers.names(
            tool, principal, lambda page: self.forward("tools/list", page, envelope, principal)
        )
        support = None
        if "requestState" not in params and policy.mode is not ToolMode.FORBIDDEN:
            support = await self.upstream_tasks.support(
                tool, upstream_capabilities(envelope.capabilities), principal
            )
        return names, support

    async def _by_detach(
        self, lookups: asyncio.Future[tuple[dict[str, str], str | None]], deadline: float, tool: str
    ) -> tuple[dict[str, str], str | None]:
        """The `_lookups` of a task-capable call, waited for until `deadline` (loop time, s: the
        request's arrival plus `detach_after`) at most, so the handle comes on time whatever the
        upstream makes them wait. Past it the call starts without them (no `Mcp-Param` check, the
        proxy's own task) and they go on in the background, cached for later calls."""
        left = deadline - asyncio.get_running_loop().time()
        done, _ = await asyncio.wait({lookups}, timeout=max(MIN_LOOKUP_WAIT_S, left))
        if done:
            return lookups.result()
        self._lookups_left.add(lookups)
        lookups.add_done_callback(self._lookup_settled)
        log.info("call_lookups_overdue", server=self.name, tool=tool, reason="detach_after passed first")
        return {}, None

    def _lookup_settled(self, lookups: asyncio.Future[Any]) -> None:
        self._lookups_left.discard(lookups)
        if not lookups.cancelled():
            lookups.exception()  # retrieved: a failed lookup was logged where it failed

    async def _prompt(self, request: ModernRequest) -> JsonObject:
        return await self._read(request, "name")

    async def _resource(self, request: ModernRequest) -> JsonObject:
        return await self._read(request, "uri")

    async def _read(self, request: ModernRequest, key: str) -> JsonObject:
        """`prompts/get` / `resources/read` as MRTR-capable calls that never become tasks.

        Raises JsonRpcError -32602 when `params.<key>` is not a non-empty string, else as `call_tool`.
        """
        method, params, reply = request.method, request.params, request.reply
        arrived = reply.arrived or asyncio.get_running_loop().time()
        name = params.get(key)
        if not isinstance(name, str) or not name:
            raise JsonRpcError(INVALID_PARAMS, f"{method} needs params.{key} (a string)")
        policy = self.config.policy(self.name, name).model_copy(update={"mode": ToolMode.FORBIDDEN})
        return await self.calls.run(
            method,
            name,
            params,
            request.envelope,
            principal=request.principal,
            reply=reply,
            policy=policy,
            arrived=arrived,
        )

    # -- everything else ---------------------------------------------------------------------

    async def _session(self, envelope: Envelope, principal: str | None = None) -> Session:
        try:
            return await self.pool.session(upstream_capabilities(envelope.capabilities), principal)
        except UpstreamError as exc:
            raise JsonRpcError(INTERNAL_ERROR, str(exc)) from None

    async def forward(
        self, method: str, params: JsonObject, envelope: Envelope, principal: str | None = None
    ) -> JsonObject:
        """Forward a request upstream on the session for the request's capabilities; return its result
        in the 2026-07-28 shape (protocol.md §4.4).

        Raises JsonRpcError: the upstream's error (translated), or -32603 when the upstream is
        unreachable or keeps expiring its session.
        """
        upstream_params = strip_envelope(params) or None

        async def exchange(session: Session) -> JsonObject:
            handler = _ignore_messages(session, self.notifications.publish)
            return await session.request(method, upstream_params, handler=handler)

        try:
            reply = await with_session(
                self.pool, upstream_capabilities(envelope.capabilities), principal, exchange
            )
        except SessionExpiredError:
            raise JsonRpcError(INTERNAL_ERROR, f"upstream {self.name} keeps expiring its session") from None
        except UpstreamError as exc:
            raise JsonRpcError(INTERNAL_ERROR, str(exc)) from None
        if "error" in reply:
            error = modern_error(reply["error"])
            raise JsonRpcError(error["code"], error["message"], error.get("data"))
        result = modern_result(method, reply["result"])
        if method == "tools/list":
            metrics.listed_tools(self.name, result.get("tools"))
        if method == "tools/list" and not params.get("cursor") and not result.get("nextCursor"):
            self.param_headers.remember(principal or "", result)
        return result

    def _forget_tool_facts(self, message: JsonObject) -> None:
        """A fan-out listener: on the upstream's tool list change, forget the cached `Mcp-Param`
        header index and the upstream's task support per tool."""
        if message.get("method") == "notifications/tools/list_changed":
            self.param_headers.clear()
            self.upstream_tasks.clear()


def _ignore_messages(
    session: Any, on_notification: Callable[[JsonObject], None]
) -> Callable[[JsonObject], Awaitable[None]]:
    """Message handler for a forwarded request: list changes go to the listen streams, upstream
    questions are refused (only tools/call, prompts/get and resources/read run MRTR rounds)."""

    async def handler(msg: JsonObject) -> None:
        if "id" not in msg:
            on_notification(msg)
        elif "method" in msg:
            await session.respond(
                msg["id"],
                error={"code": METHOD_NOT_FOUND, "message": f"the proxy does not relay {msg['method']} here"},
            )

    return handler
