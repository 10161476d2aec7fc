"""Modern-era (2026-07-28) method dispatch for one configured upstream server.

The proxy answers `server/discover` and `tasks/*` itself, runs `tools/call` as a proxy-owned
call that may become a task, and forwards everything else to the upstream session that matches
the request's client capabilities, translating results on the way back (protocol.md §1.6).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import structlog

from . import __version__
from . import observability as obs
from .calls import Call
from .config import Config, ResolvedPolicy, ToolMode
from .mrtr import ParkedCalls, request_digest, validate_input_responses
from .protocol.era import (
    LEGACY_VERSIONS,
    LIST_CHANGED_NOTIFICATIONS,
    META_SERVER_INFO,
    META_SUBSCRIPTION_ID,
    MODERN_VERSIONS,
    TASKS_EXTENSION,
    Envelope,
    check_param_headers,
    param_header_names,
    strip_envelope,
    upstream_capabilities,
)
from .protocol.jsonrpc import (
    INTERNAL_ERROR,
    INVALID_PARAMS,
    METHOD_NOT_FOUND,
    MISSING_REQUIRED_CLIENT_CAPABILITY,
    JsonObject,
    JsonRpcError,
    RequestId,
    notification,
)
from .protocol.translate import modern_error, modern_result
from .tasks.service import TaskService
from .upstream.http import SessionExpiredError, UpstreamError, UpstreamPool

log = structlog.get_logger("proxy.dispatch")

# Methods the 2026-07-28 core removed; the proxy answers -32601 (HTTP 404) itself.
REMOVED_METHODS = frozenset(
    {
        "initialize",
        "ping",
        "logging/setLevel",
        "resources/subscribe",
        "resources/unsubscribe",
        "tasks/result",
        "tasks/list",
    }
)
INPUT_GATHER_S = 0.05  # questions arriving within 50 ms of each other share one MRTR round


class Drain:
    """Graceful shutdown (SIGTERM): once started, synchronous calls have `timeout_s` seconds to
    finish; then their clients get a JSON-RPC error naming the shutdown instead of a cut connection."""

    def __init__(self) -> None:
        self.timeout_s = 0.0
        self._deadline: float | None = None
        self._started = asyncio.Event()

    def start(self, timeout_s: float) -> None:
        """Begin draining now; `timeout_s` in seconds."""
        self.timeout_s = timeout_s
        self._deadline = asyncio.get_running_loop().time() + timeout_s
        self._started.set()

    def remaining(self) -> float | None:
        """Seconds left before the drain deadline (0.0 once passed), or None when not draining."""
        if self._deadline is None:
            return None
        return max(0.0, self._deadline - asyncio.get_running_loop().time())

    async def wait_for(self, awaitable: Awaitable[Any], timeout: float) -> Any:
        """`asyncio.wait_for(awaitable, timeout)`, but a drain that starts meanwhile ends the wait
        early (TimeoutError), so the caller re-plans against the drain deadline."""
        if self._started.is_set():
            return await asyncio.wait_for(awaitable, timeout)
        getter = asyncio.ensure_future(awaitable)
        started = asyncio.ensure_future(self._started.wait())
        try:
            done, _ = await asyncio.wait({getter, started}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            started.cancel()
        if getter in done:
            return getter.result()
        getter.cancel()
        raise TimeoutError


class Reply:
    """How a handler talks back on one request's HTTP response while it is still running.

    `notify(msg)` sends a JSON-RPC notification (switching the response to SSE), `keepalive()`
    sends an SSE comment so idle-timeout intermediaries keep the connection.
    """

    notify: Callable[[JsonObject], Awaitable[None]]
    keepalive: Callable[[], Awaitable[None]]


class ListenHub:
    """The open `subscriptions/listen` streams of one server; upstream list-changed notifications
    are fanned out to every one of them (each stream then applies its own filter)."""

    def __init__(self) -> None:
        self._queues: set[asyncio.Queue[JsonObject]] = set()

    def publish(self, message: JsonObject) -> None:
        """Offer one upstream notification to every open stream (others than list changes are ignored)."""
        if message.get("method") in LIST_CHANGED_NOTIFICATIONS:
            for queue in list(self._queues):
                queue.put_nowait(message)

    @contextlib.contextmanager
    def subscribe(self) -> Iterator[asyncio.Queue[JsonObject]]:
        """A queue that receives what is published while the block runs."""
        queue: asyncio.Queue[JsonObject] = asyncio.Queue()
        self._queues.add(queue)
        try:
            yield queue
        finally:
            self._queues.discard(queue)


class ServerDispatcher:
    """Dispatches modern requests for one upstream server (`name`), sharing the TaskService."""

    def __init__(
        self,
        *,
        name: str,
        config: Config,
        pool: UpstreamPool,
        tasks: TaskService,
        parked: ParkedCalls,
        keepalive_s: float = 15.0,
        drain: Drain | None = None,
    ) -> None:
        self.drain = drain or Drain()
        self.name = name
        self.parked = parked
        self.config = config
        self.pool = pool
        self.tasks = tasks
        self.keepalive_s = keepalive_s
        self.listeners = ListenHub()
        # principal → tool → {argument: Mcp-Param header name}, from the upstream's tools/list.
        self._param_headers: dict[str, dict[str, dict[str, str]]] = {}

    async def dispatch(self, body: JsonObject, envelope: Envelope, *, principal: str, reply: Reply) -> JsonObject:
        """Answer one request; return the `result` object. Raises JsonRpcError for error replies."""
        method = body["method"]
        params = body.get("params") or {}
        structlog.contextvars.bind_contextvars(rpc_method=method, server=self.name)
        if method in REMOVED_METHODS:
            raise JsonRpcError(METHOD_NOT_FOUND, f"method {method!r} is not available on the 2026-07-28 wire")
        if method == "server/discover":
            return await self.discover(envelope, principal)
        if method == "tasks/get":
            return self.tasks.get(params, envelope, principal=principal, server=self.name)
        if method == "tasks/update":
            return self.tasks.update(params, envelope, principal=principal, server=self.name)
        if method == "tasks/cancel":
            return self.tasks.cancel(params, envelope, principal=principal, server=self.name)
        if method.startswith("tasks/"):
            raise JsonRpcError(METHOD_NOT_FOUND, f"unknown tasks method {method!r}")
        if method == "tools/call":
            return await self.call_tool(params, envelope, principal=principal, reply=reply)
        if method == "subscriptions/listen":
            return await self.listen(body["id"], params, envelope, principal=principal, reply=reply)
        if method in ("prompts/get", "resources/read"):
            name = params.get("name") if method == "prompts/get" else params.get("uri")
            if not isinstance(name, str) or not name:
                raise JsonRpcError(INVALID_PARAMS, f"{method} needs params.{'name' if method == 'prompts/get' else 'uri'} (a string)")
            policy = self.config.policy(self.name, name).model_copy(update={"mode": ToolMode.FORBIDDEN})
            return await self._run_call(method, name, params, envelope, principal=principal, reply=reply, policy=policy)
        return await self.forward(method, params, envelope, principal)

    # -- server/discover ---------------------------------------------------------------------

    async def discover(self, envelope: Envelope, principal: str | None = None) -> JsonObject:
        """`server/discover`, built from the upstream's `initialize` result plus the tasks extension."""
        session = await self._session(envelope, principal)
        init = session.initialize_result
        caps = {k: v for k, v in (init.get("capabilities") or {}).items() if k not in ("tasks", "experimental")}
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
            "_meta": {META_SERVER_INFO: {"name": "mcp-tasks-proxy", "version": __version__, "upstream": init.get("serverInfo")}},
        }
        if init.get("instructions"):
            result["instructions"] = init["instructions"]
        return result

    # -- subscriptions/listen ----------------------------------------------------------------

    async def listen(self, request_id: RequestId, params: JsonObject, envelope: Envelope, *, principal: str, reply: Reply) -> JsonObject:
        """`subscriptions/listen` (2026-07-28 basic/patterns/subscriptions): acknowledge the subset of the
        filter the proxy honours, then relay the upstream's list-changed notifications until the
        client closes the stream. Resource subscriptions and task ids are not honoured (left out of
        the acknowledgement); asking for task ids without the tasks extension is -32021."""
        wanted = params.get("notifications")
        if not isinstance(wanted, dict):
            raise JsonRpcError(INVALID_PARAMS, "subscriptions/listen needs params.notifications (a SubscriptionFilter object)")
        if "taskIds" in wanted and not envelope.declares_tasks:
            raise JsonRpcError(
                MISSING_REQUIRED_CLIENT_CAPABILITY,
                f"subscribing to taskIds needs the {TASKS_EXTENSION} extension declared in this request",
                {"requiredCapabilities": {"extensions": {TASKS_EXTENSION: {}}}},
            )
        session = await self._session(envelope, principal)
        upstream_caps = session.initialize_result.get("capabilities") or {}
        agreed: JsonObject = {}
        methods = set()
        for method, (capability, flag) in LIST_CHANGED_NOTIFICATIONS.items():
            cap = upstream_caps.get(capability)
            if wanted.get(flag) is True and isinstance(cap, dict) and cap.get("listChanged") is True:
                agreed[flag] = True
                methods.add(method)
        tag = {META_SUBSCRIPTION_ID: request_id}
        with self.listeners.subscribe() as queue:
            await reply.notify(notification("notifications/subscriptions/acknowledged", {"notifications": agreed, "_meta": tag}))
            while True:
                try:
                    message = await asyncio.wait_for(queue.get(), timeout=self.keepalive_s)
                except TimeoutError:
                    await reply.keepalive()
                    continue
                if message["method"] in methods:
                    relayed = dict(message.get("params") or {})
                    relayed["_meta"] = {**(relayed.get("_meta") or {}), **tag}
                    await reply.notify(notification(message["method"], relayed))

    # -- tools/call, prompts/get, resources/read (MRTR-capable) ------------------------------

    async def call_tool(self, params: JsonObject, envelope: Envelope, *, principal: str, reply: Reply) -> JsonObject:
        """Run `tools/call` upstream; return its result, an InputRequiredResult (SEP-2322), or a flat
        CreateTaskResult (ext-tasks, once the call outlives `detach_after`, in seconds).

        Raises JsonRpcError: -32602 for bad params or a bad `requestState`, -32021 for a `required`
        tool without the tasks extension, a limit error (HTTP 429), the upstream's own error
        (translated), or -32603 naming the layer that gave up (upstream unreachable, hard timeout,
        shutdown).
        """
        tool = params.get("name")
        if not isinstance(tool, str) or not tool:
            raise JsonRpcError(INVALID_PARAMS, "tools/call needs params.name (a string)")
        if "arguments" in params and not isinstance(params["arguments"], dict):
            raise JsonRpcError(INVALID_PARAMS, "tools/call params.arguments must be an object")
        names = await self.param_headers(tool, envelope, principal)
        if names:
            check_param_headers(getattr(reply, "headers", {}), params.get("arguments"), names)
        structlog.contextvars.bind_contextvars(tool=tool)
        policy = self.config.policy(self.name, tool)
        if policy.mode is ToolMode.REQUIRED and not envelope.declares_tasks:
            raise JsonRpcError(
                MISSING_REQUIRED_CLIENT_CAPABILITY,
                f"tool {tool!r} always runs as a task; declare the {TASKS_EXTENSION} extension",
                {"requiredCapabilities": {"extensions": {TASKS_EXTENSION: {}}}},
            )
        if policy.mode is ToolMode.REQUIRED:
            self.tasks.check_capacity(principal)  # refuse before anything reaches the upstream
        return await self._run_call("tools/call", tool, params, envelope, principal=principal, reply=reply, policy=policy)

    async def _run_call(
        self, method: str, name: str, params: JsonObject, envelope: Envelope, *, principal: str, reply: Reply, policy: ResolvedPolicy
    ) -> JsonObject:
        """Start (or, on an MRTR retry, resume) a proxy-owned upstream call and wait for what comes first:
        its outcome, a question for the client (MRTR round), or the detach deadline (task)."""
        may_detach = method == "tools/call" and envelope.declares_tasks and policy.mode is not ToolMode.FORBIDDEN
        meta = params.get("_meta") if isinstance(params.get("_meta"), dict) else {}
        digest = request_digest(method, name, params.get("arguments") if method != "resources/read" else None)
        responses = params.get("inputResponses")
        if responses is not None:
            validate_input_responses(responses)
        if "requestState" in params:
            call = self.parked.resume(params["requestState"], principal=principal, server=self.name, digest=digest)
            call.resume(meta.get("progressToken"))
            call.answer(responses or {})
        else:
            call = Call(
                pool=self.pool,
                server=self.name,
                tool=name,
                method=method,
                params=strip_envelope(params),
                capabilities=upstream_capabilities(envelope.capabilities),
                timeout=policy.timeout,
                store=self.tasks.store,
                client_progress_token=meta.get("progressToken"),
                relay_logs=envelope.log_level is not None,
                input_timeout=policy.input_timeout,
                prefilled=responses,
                principal=principal,
            )
            call.server_notifications = self.server_notification
            call.start()

        def detach(why: str) -> JsonObject:
            self.parked.release(call)
            try:
                record = self.tasks.detach(
                    call,
                    principal=principal,
                    ttl_s=policy.ttl,
                    poll_interval_s=policy.poll_interval,
                    status_message=why,
                    rerun=policy.on_restart == "rerun",
                )
            except JsonRpcError:  # a limit: the call cannot become a task, so it must not go on unseen
                call.cancel("refused by a limit")
                raise
            if method == "tools/call":
                obs.CALLS.labels(self.name, name, "detached").inc()
            structlog.contextvars.bind_contextvars(task_id=record.task_id)
            return record.create_task_result()

        if method == "tools/call" and policy.mode is ToolMode.REQUIRED and not call.pending:
            return detach(f"running upstream on {self.name} as a task")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + policy.detach_after if may_detach else None
        try:
            while True:
                if call.done:
                    return self._call_result(call)
                if call.pending:
                    return await self._ask_client(call, principal=principal, digest=digest, timeout_s=policy.input_timeout, reply=reply)
                wait = self.keepalive_s
                if deadline is not None:
                    wait = min(wait, max(0.0, deadline - loop.time()))
                if self.drain.remaining() is not None:
                    wait = min(wait, self.drain.remaining())
                try:
                    kind, item = await self.drain.wait_for(call.events.get(), timeout=wait)
                except TimeoutError:
                    if call.done or call.pending:
                        continue
                    if self.drain.remaining() == 0.0:
                        call.cancel("the proxy is shutting down")
                        raise JsonRpcError(
                            INTERNAL_ERROR,
                            f"proxy shutdown: the call did not finish within drain_timeout ({self.drain.timeout_s:g} s) and was abandoned",
                        ) from None
                    if deadline is not None and loop.time() >= deadline:
                        handle = detach(f"still running upstream after {policy.detach_after:g} s; continuing in the background")
                        obs.DETACH_LATENCY.observe(max(0.0, loop.time() - deadline))
                        return handle
                    await reply.keepalive()
                    continue
                if kind == "notification":
                    await reply.notify(item)
                elif kind == "unsupported" and not call.done:
                    call.cancel(f"the upstream needs the {item} capability")
                    raise JsonRpcError(
                        MISSING_REQUIRED_CLIENT_CAPABILITY,
                        f"upstream {self.name} needs the {item} client capability for this request",
                        {"requiredCapabilities": {item: {}}},
                    )
        except asyncio.CancelledError:
            if call.task_id is None:
                self.parked.release(call)
                call.cancel("the client closed the request stream")
            raise

    async def _ask_client(self, call: Call, *, principal: str, digest: str, timeout_s: float, reply: Reply) -> JsonObject:
        """Answer with an InputRequiredResult for every outstanding question (SEP-2322), parking the call.

        Questions that arrive within a short window of each other (concurrent upstream requests)
        go out in the same round.
        """
        quiet_until = asyncio.get_running_loop().time() + INPUT_GATHER_S
        while not call.done:
            remaining = quiet_until - asyncio.get_running_loop().time()
            if remaining <= 0:
                break
            try:
                kind, item = await asyncio.wait_for(call.events.get(), timeout=remaining)
            except TimeoutError:
                break
            if kind == "notification":
                await reply.notify(item)
            elif kind == "input":
                quiet_until = asyncio.get_running_loop().time() + INPUT_GATHER_S
        if call.done:
            return self._call_result(call)
        state = self.parked.park(call, principal=principal, server=self.name, digest=digest, timeout_s=timeout_s)
        return {"resultType": "input_required", "inputRequests": call.input_requests(), "requestState": state}

    def _call_result(self, call: Call) -> JsonObject:
        self.parked.release(call)
        outcome = call.outcome.result()
        if call.method == "tools/call":
            obs.CALLS.labels(self.name, call.tool, "sync" if "result" in outcome else "error").inc()
        if "result" in outcome:
            return modern_result(call.method, outcome["result"])
        error = modern_error(outcome.get("error"))
        raise JsonRpcError(error["code"], error["message"], error.get("data"))

    # -- everything else ---------------------------------------------------------------------

    async def _session(self, envelope: Envelope, principal: str | None = None):
        try:
            return await self.pool.session(upstream_capabilities(envelope.capabilities), principal)
        except UpstreamError as exc:
            raise JsonRpcError(INTERNAL_ERROR, str(exc)) from None

    async def forward(self, method: str, params: JsonObject, envelope: Envelope, principal: str | None = None) -> JsonObject:
        """Forward a request upstream on the session for the request's capabilities; return its result
        in the 2026-07-28 shape (protocol.md §4.4).

        Raises JsonRpcError: the upstream's error (translated), or -32603 when the upstream is
        unreachable or keeps expiring its session.
        """
        upstream_params = strip_envelope(params)
        for attempt in (1, 2):
            session = await self._session(envelope, principal)
            try:
                reply = await session.request(method, upstream_params or None, handler=_ignore_messages(session, self.server_notification))
                break
            except SessionExpiredError:
                self.pool.discard(session)
                if attempt == 2:
                    raise JsonRpcError(INTERNAL_ERROR, f"upstream {self.name} keeps expiring its session") from None
            except UpstreamError as exc:
                raise JsonRpcError(INTERNAL_ERROR, str(exc)) from None
        if "error" in reply:
            error = modern_error(reply["error"])
            raise JsonRpcError(error["code"], error["message"], error.get("data"))
        result = modern_result(method, reply["result"])
        if method == "tools/list" and not params.get("cursor") and not result.get("nextCursor"):
            self._param_headers[principal or ""] = _param_headers_of(result)
        return result

    # -- Mcp-Param-* headers (SEP-2243) and server notifications -----------------------------

    async def param_headers(self, tool: str, envelope: Envelope, principal: str | None) -> dict[str, str]:
        """`{argument: header name}` of `tool`'s `x-mcp-header` arguments, from the upstream's tools/list
        (fetched once per principal, again after the upstream announced a tool list change)."""
        key = principal or ""
        tools = self._param_headers.get(key)
        if tools is None:
            tools = {}
            params: JsonObject = {}
            try:
                for _ in range(100):  # pages
                    page = await self.forward("tools/list", params, envelope, principal)
                    tools.update(_param_headers_of(page))
                    if not page.get("nextCursor"):
                        break
                    params = {"cursor": page["nextCursor"]}
            except JsonRpcError as exc:
                log.info("tools_list_unavailable", server=self.name, reason=exc.message)
                return {}  # the call itself will report what is wrong with the upstream
            self._param_headers[key] = tools
        return tools.get(tool, {})

    def server_notification(self, message: JsonObject) -> None:
        """An upstream server-wide notification seen on some request's stream: forget cached tool
        annotations on a tool list change, and offer it to the listen streams."""
        if message.get("method") == "notifications/tools/list_changed":
            self._param_headers.clear()
        self.listeners.publish(message)


def _param_headers_of(tools_list: JsonObject) -> dict[str, dict[str, str]]:
    tools = tools_list.get("tools") if isinstance(tools_list.get("tools"), list) else []
    found = {}
    for tool in tools:
        if isinstance(tool, dict) and isinstance(tool.get("name"), str):
            names = param_header_names(tool.get("inputSchema"))
            if names:
                found[tool["name"]] = names
    return found


def _ignore_messages(session: Any, on_notification: Callable[[JsonObject], None]):
    """Message handler for a forwarded request: list changes go to the listen streams, upstream
    questions are refused (only tools/call, prompts/get and resources/read run MRTR rounds)."""

    async def handler(msg: JsonObject) -> None:
        if "id" not in msg:
            on_notification(msg)
        elif "method" in msg:
            await session.respond(msg["id"], error={"code": METHOD_NOT_FOUND, "message": f"the proxy does not relay {msg['method']} here"})

    return handler
