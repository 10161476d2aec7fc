"""v1 tasks (2025-11-25 experimental tasks) for handshake-era clients, in front of upstreams that
have no tasks of their own, whatever the upstream kind (the legacy endpoint intercepts for both).

What a v1 client sees (README "What the proxy does, by client dialect"):

- `initialize` declares `capabilities.tasks` (`list`, `cancel`, `requests.tools.call`); the
  client's own `capabilities.tasks` never reaches the upstream (protocol.md §3.4);
- `tools/list` carries `execution.taskSupport` per tool from its configured `mode`;
- `tools/call` with `params.task` answers a v1 `CreateTaskResult` at once (the requestor decides in
  v1); the call runs upstream as a proxy-owned call without `params.task`;
- `tasks/get`, `tasks/result`, `tasks/list`, `tasks/cancel` are served by `v1_methods`.

When the upstream itself declares `capabilities.tasks`, none of this applies: v1 clients keep the
plain pass-through to the upstream's own tasks.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from aiohttp import web

from proxy.calls.call import Call
from proxy.calls.keys import CallKeys, call_key
from proxy.calls.types import KeyedCall
from proxy.config import Config, ResolvedPolicy, ToolMode
from proxy.legacy.replay import RelayStream
from proxy.legacy.v1_methods import LIST_PAGE, V1_TASK_METHODS, V1TaskMethods
from proxy.protocol import jsonrpc
from proxy.protocol.era import META_RELATED_TASK, upstream_capabilities
from proxy.protocol.jsonrpc import (
    INVALID_PARAMS,
    METHOD_NOT_FOUND,
    JsonObject,
    JsonRpcError,
    RequestId,
    object_of,
)
from proxy.runtime import metrics, tracing
from proxy.runtime.fanout import Overflow
from proxy.runtime.uncancelled import uncancelled
from proxy.tasks.model import TaskRecord, TaskStatus, session_origin
from proxy.tasks.service import TaskService
from proxy.tasks.store import ListFilter, StoreUnavailableError
from proxy.tasks.types import TaskChange, TaskMessage, about
from proxy.tasks.wire_v1 import (
    SERVER_TASKS_CAPABILITY,
    create_task_result_v1,
    status_notification,
    tool_with_task_support,
    with_related_task,
)
from proxy.upstream.types import Pool, UpstreamError, UpstreamTimeoutError

READER_CHECK_S = 0.5  # how often (s) a GET stream's feed looks for a reader its waiting questions can go to
# the protocol revision that has v1 tasks (`params.task`, `capabilities.tasks`)
V1_TASKS_VERSION = "2025-11-25"
REWRITTEN_REPLIES = frozenset({"initialize", "tools/list"})


def _dumps(obj: Any) -> str:
    return jsonrpc.dumps_str(obj)


class V1Front:
    """The v1 tasks front of one server (`server`): decides what to intercept, runs task calls,
    and rewrites the `initialize` and `tools/list` replies the relay passes back."""

    def __init__(
        self,
        *,
        server: str,
        config: Config,
        pool: Pool,
        tasks: TaskService,
        keepalive_s: float = 15.0,
    ) -> None:
        self.server = server
        self.config = config
        self.pool = pool
        self.tasks = tasks
        self.methods = V1TaskMethods(tasks, server, keepalive_s=keepalive_s)
        self.keys = CallKeys(tasks)
        self._upstream_tasks: bool | None = None
        # Without client authentication every client is the one principal `anonymous`: then tasks/list
        # and a session's stream only show the tasks that client session created (their ids are the
        # secret; 2025-11-25 asks receivers that cannot tell requestors apart not to list others' tasks).
        self.shared_principal = config.auth.mode == "none"

    def _origin_of(self, headers: Any) -> str | None:
        """The `TaskRecord.origin` of the session a request came on, when tasks are told apart by
        session (every client the one principal); else None."""
        if not self.shared_principal:
            return None
        return session_origin(str(headers.get("Mcp-Session-Id", "")).strip())

    async def upstream_has_tasks(self) -> bool:
        """True when the upstream's own `initialize` result declares `capabilities.tasks` (then the
        proxy stays out of v1 task traffic). An unreachable upstream counts as having none."""
        try:
            return await self._learn_upstream_tasks()
        except UpstreamError:
            return False

    async def _learn_upstream_tasks(self) -> bool:
        """`upstream_has_tasks`, learnt once from the pool's session (waits at most `init_timeout`).
        Raises UpstreamError while the upstream cannot be initialized."""
        if self._upstream_tasks is None:
            session = await self.pool.session({}, None)
            caps = object_of(session.initialize_result.get("capabilities"))
            self._upstream_tasks = isinstance(caps.get("tasks"), dict)
        return self._upstream_tasks

    # -- what passes through, rewritten --------------------------------------------------------

    async def strip_initialize(self, body: Any) -> Any:
        """The client's `initialize` request without `capabilities.tasks` (unless the upstream has tasks).

        Raises UpstreamTimeoutError when the upstream did not answer the proxy's own `initialize`
        within `init_timeout`: the client's would wait as long again, so the caller answers with
        this error at once. (Another failure, a refusal say, is the relayed initialize's to report.)"""
        if not (isinstance(body, dict) and body.get("method") == "initialize"):
            return body
        try:
            if await self._learn_upstream_tasks():
                return body
        except UpstreamTimeoutError:
            raise
        except UpstreamError:
            pass
        params = object_of(body.get("params"))
        caps = object_of(params.get("capabilities"))
        if "tasks" not in caps:
            return body
        return {**body, "params": {**params, "capabilities": {k: v for k, v in caps.items() if k != "tasks"}}}

    async def rewrite_reply(self, method: str | None, message: JsonObject) -> JsonObject:
        """The upstream's reply to `initialize` (adds `capabilities.tasks`) or `tools/list` (adds
        `execution.taskSupport` per tool); anything else, an error, or an upstream with tasks of
        its own passes unchanged. A `tools/list` reply names the tools that get metric labels."""
        if method == "tools/list":
            metrics.listed_tools(self.server, object_of(message.get("result")).get("tools"))
        if (
            method not in REWRITTEN_REPLIES
            or not isinstance(message.get("result"), dict)
            or await self.upstream_has_tasks()
        ):
            return message
        result = dict(message["result"])
        if method == "initialize":
            if str(result.get("protocolVersion", "")) < V1_TASKS_VERSION:  # v1 tasks are 2025-11-25's
                return message
            caps = dict(object_of(result.get("capabilities")))
            caps["tasks"] = SERVER_TASKS_CAPABILITY
            result["capabilities"] = caps
        elif isinstance(result.get("tools"), list):
            result["tools"] = [
                tool_with_task_support(tool, self.config.policy(self.server, tool["name"]).mode.value)
                if isinstance(tool, dict) and isinstance(tool.get("name"), str)
                else tool
                for tool in result["tools"]
            ]
        return {**message, "result": result}

    def input_timeout_s(self, body: JsonObject) -> float:
        """How long (s) a question the upstream asks during request `body` may wait for the client's
        answer: `input_timeout` of the called tool's policy (the server's for other methods)."""
        tool = object_of(body.get("params")).get("name") if body.get("method") == "tools/call" else None
        return self.config.policy(self.server, tool if isinstance(tool, str) else "").input_timeout

    def reply_rewriter(self, method: str) -> Callable[[JsonObject], Awaitable[JsonObject]] | None:
        """How the answer to `method` is rewritten (`rewrite_reply`), or None when it needs no rewrite."""
        if method not in REWRITTEN_REPLIES:
            return None

        async def rewrite(message: JsonObject) -> JsonObject:
            return await self.rewrite_reply(method, message)

        return rewrite

    def status_feed(
        self, stream: RelayStream, principal: str, session: str = ""
    ) -> Coroutine[Any, Any, None] | None:
        """A pump that emits `notifications/tasks/status` for each status change of `principal`'s
        tasks on this server (and their progress and questions, unless a `tasks/result` stream
        carries them) onto a session's standalone GET `stream`, until it is cancelled; None
        when the upstream has tasks of its own (its stream is left alone). Without client
        authentication only the tasks client session `session` created are carried.

        A question (elicitation, sampling, roots) goes out once, with the related-task `_meta`, while
        a client reads the stream, for clients that poll `tasks/get` and call `tasks/result` only at
        the end (the ext-tasks client): the client answers it with a POSTed response under its
        proxy id."""
        if self._upstream_tasks:
            return None

        # without client authentication, only what this session created (TaskRecord.origin)
        origin = session_origin(session) if self.shared_principal else None

        async def pump() -> None:
            mine: set[str] = set()  # with `origin`: live tasks seen to be this session's (their progress)
            asked: dict[str, list[RequestId]] = {}  # task id → proxy ids of questions this stream asked
            released: list[RequestId] = []  # asked while a reader was here; still answerable
            waiting: dict[str, TaskRecord] = {}  # tasks whose questions wait for a reader
            try:
                with self.tasks.changes.subscribe(about(principal, self.server)) as sub:
                    await self._waiting_for_input(principal, session, waiting)
                    reader = stream.owner
                    while True:
                        if asked and (not stream.attached or stream.owner != reader):
                            # the reader left, or a new one took over (it may not have seen them)
                            released += [proxy_id for ids in asked.values() for proxy_id in ids]
                            self.methods.release(released)
                            asked.clear()
                            await self._waiting_for_input(principal, session, waiting)
                        reader = stream.owner
                        for record in [waiting.pop(task_id) for task_id in list(waiting)]:
                            self._ask_on_get(record, principal, stream, asked, waiting)
                        # while questions wait for a reader, or were asked, look at the reader now and then
                        check_s = READER_CHECK_S if waiting or asked else None
                        try:
                            item = await asyncio.wait_for(sub.get(), check_s)
                        except TimeoutError:
                            continue  # a reader may have come (or gone): handled above
                        if isinstance(item, Overflow):  # changes were missed: questions too
                            await self._waiting_for_input(principal, session, waiting)
                            continue  # status pushes are advice: the client polls tasks/get for the rest
                        if isinstance(item, TaskChange) and origin is not None:
                            if item.record.origin != origin:
                                continue
                            if item.record.status.terminal:  # (no progress after the end: bounded)
                                mine.discard(item.task_id)
                            else:
                                mine.add(item.task_id)  # (its progress, below, is this session's too)
                        elif origin is not None and item.task_id not in mine:
                            continue
                        if isinstance(item, TaskChange):
                            if item.before is not item.record.status:
                                stream.append_message(status_notification(item.record))
                            self._ask_on_get(item.record, principal, stream, asked, waiting)
                        elif isinstance(item, TaskMessage) and not self.methods.watched(item.task_id):
                            # progress: the v1 token lives as long as the task
                            stream.append_message(item.message)
            finally:
                self.methods.withdraw(released + [proxy_id for ids in asked.values() for proxy_id in ids])

        return pump()

    async def _waiting_for_input(self, principal: str, session: str, waiting: dict[str, TaskRecord]) -> None:
        """Add to `waiting` the principal's tasks on this server that wait for input now (the newest
        LIST_PAGE: asked before the stream opened, or during a gap in its feed)."""
        where = ListFilter(principal=principal, server=self.server, status=TaskStatus.INPUT_REQUIRED.value)
        try:
            records, _ = await self.tasks.store.list_tasks(where, limit=LIST_PAGE)
        except StoreUnavailableError:
            return  # the questions come with the task's next change, or on tasks/result
        origin = session_origin(session) if self.shared_principal else None
        for record in records:
            if origin is None or record.origin == origin:
                waiting[record.task_id] = record

    def _ask_on_get(
        self,
        record: TaskRecord,
        principal: str,
        stream: RelayStream,
        asked: dict[str, list[RequestId]],
        waiting: dict[str, TaskRecord],
    ) -> None:
        """Put `record`'s questions no stream carries yet on `stream` while a client reads it, else
        keep the record in `waiting` for when one does (none while a `tasks/result` stream waits on
        the task: it asks them), noting their proxy ids in `asked`; a terminal task's are withdrawn."""
        if record.status.terminal:
            waiting.pop(record.task_id, None)
            self.methods.withdraw(asked.pop(record.task_id, []))
            return
        if self.methods.watched(record.task_id) or not record.input_requests:
            return
        if not stream.attached:
            waiting[record.task_id] = record
            return
        for proxy_id, question in self.methods.ask(record, principal, on_result=False):
            asked.setdefault(record.task_id, []).append(proxy_id)
            stream.append_message(question)

    # -- what the proxy answers itself -------------------------------------------------------

    def for_version(self, body: Any, version: str | None) -> Any:
        """`body` as the v1 front handles it for a session of `version`: before 2025-11-25 a
        `params.task` is not a task request (a `mode: required` tool is then refused, not run as a task)."""
        if (
            version is None
            or version >= V1_TASKS_VERSION
            or not isinstance(body, dict)
            or not isinstance(body.get("params"), dict)
            or "task" not in body["params"]
        ):
            return body
        return {**body, "params": {k: v for k, v in body["params"].items() if k != "task"}}

    async def intercepts(self, body: Any, principal: str, version: str | None = None) -> bool:
        """True when this legacy message is the proxy's to answer: a `tools/call` with `params.task`
        (from a 2025-11-25 session: `version` is the request's MCP-Protocol-Version, when sent; an
        older session's `params.task` is not a task request and passes through), a v1 `tasks/*`
        request, or a response to a question relayed on a `tasks/result` stream."""
        if not isinstance(body, dict):
            return False
        if jsonrpc.is_response(body):
            target = self.methods.questions.get(body.get("id"))  # type: ignore[arg-type]
            return target is not None and target[2] == principal
        method = body.get("method")
        params = object_of(body.get("params"))
        wants_task = "task" in params and (version is None or version >= V1_TASKS_VERSION)
        if method not in V1_TASK_METHODS and not (
            method == "tools/call" and (wants_task or self._required(params.get("name")))
        ):
            return False
        return "id" in body and not await self.upstream_has_tasks()

    async def handle(
        self, request: web.Request, body: JsonObject, *, principal: str, capabilities: JsonObject
    ) -> web.StreamResponse:
        """Answer an intercepted message. JSON-RPC errors go out in an HTTP 200, as on the 2025-11-25
        wire (the SDKs read codes only from a 2xx), except limits (429) and the store (503)."""
        if jsonrpc.is_response(body):
            await self.methods.answer(body, principal)
            return web.Response(status=202)
        request_id = body["id"]
        params = object_of(body.get("params"))
        try:
            method = body["method"]
            if method == "tasks/result":
                return await self.methods.result(request, request_id, params, principal)
            if method == "tasks/get":
                result = await self.methods.get(params, principal)
            elif method == "tasks/list":
                result = await self.methods.list_tasks(params, principal, self._origin_of(request.headers))
            elif method == "tasks/cancel":
                result = await self.methods.cancel(params, principal)
            elif "task" not in params:
                raise JsonRpcError(
                    METHOD_NOT_FOUND,
                    f"tool {params.get('name')!r} runs only as a task (execution.taskSupport: required): "
                    f"send params.task",
                )
            else:
                result = await self.call_as_task(
                    params, principal=principal, capabilities=capabilities, headers=request.headers
                )
                if isinstance(result.get("task"), dict):  # (a key joined to an ended call: its result)
                    tracing.bind_task_id(result["task"]["taskId"])
        except JsonRpcError as exc:
            return web.json_response(
                jsonrpc.error_response(request_id, exc.to_error()),
                status=legacy_status(exc),
                headers=exc.http_headers,
            )
        return web.json_response(jsonrpc.response(request_id, result), dumps=_dumps)

    def _progress_of(self, principal: str) -> Callable[[str, JsonObject], None]:
        """Where a v1 task's progress goes: the streams of `principal`'s task, with the related-task key."""

        def publish(task_id: str, message: JsonObject) -> None:
            related = with_related_task(message, task_id)
            self.tasks.publish_message(
                principal=principal, server=self.server, task_id=task_id, message=related
            )

        return publish

    def _required(self, tool: Any) -> bool:
        """True for a tool configured `mode: required` (then a call without `params.task` is -32601)."""
        return isinstance(tool, str) and self.config.tool_mode(self.server, tool) is ToolMode.REQUIRED

    async def call_as_task(
        self, params: JsonObject, *, principal: str, capabilities: JsonObject, headers: Any = None
    ) -> JsonObject:
        """`tools/call` with `params.task` → v1 `CreateTaskResult`, committed before it is returned.

        With an idempotency key (`headers`' `Idempotency-Key` or the `_meta` key, see
        `calls.keys`) or a `dedupe` tool, a call that repeats one its slot names joins it: that
        call's task, or its result once it ended, and nothing new reaches the upstream.

        The upstream gets the call without `params.task` (and with a progress token of the proxy's);
        `params.task.ttl` (ms) sets the retention, capped by the tool's configured `ttl`. The
        client's `progressToken` keeps receiving `notifications/progress` on its `tasks/result`
        streams. Raises JsonRpcError: -32602 for bad params, -32601 for a `mode: forbidden` tool
        (2025-11-25 tool-level rule), a limit error (HTTP 429), -32603 (HTTP 503) for the store.
        """
        tool = params.get("name")
        if not isinstance(tool, str) or not tool:
            raise JsonRpcError(INVALID_PARAMS, "tools/call needs params.name (a string)")
        if "arguments" in params and not isinstance(params["arguments"], dict):
            raise JsonRpcError(INVALID_PARAMS, "tools/call params.arguments must be an object")
        task = params.get("task")
        if not isinstance(task, dict):
            raise JsonRpcError(INVALID_PARAMS, "params.task must be an object ({ttl?: integer ms})")
        requested = task.get("ttl")
        if requested is not None and (
            isinstance(requested, bool) or not isinstance(requested, int) or requested < 0
        ):
            raise JsonRpcError(
                INVALID_PARAMS, "params.task.ttl must be a non-negative integer (ms) or absent"
            )
        policy = self.config.policy(self.server, tool)
        if policy.mode is ToolMode.FORBIDDEN:
            raise JsonRpcError(
                METHOD_NOT_FOUND, f"tool {tool!r} does not run as a task (execution.taskSupport: forbidden)"
            )
        ttl_s: float | None = policy.ttl
        if requested is not None:
            ttl_s = requested / 1000 if ttl_s is None else min(ttl_s, requested / 1000)
        meta = object_of(params.get("_meta"))
        upstream_params: JsonObject = {k: v for k, v in params.items() if k != "task"}
        rest = {k: v for k, v in meta.items() if k not in ("progressToken", META_RELATED_TASK)}
        if rest:
            upstream_params["_meta"] = rest
        else:
            upstream_params.pop("_meta", None)
        token = meta.get("progressToken")
        await self.tasks.check_capacity(principal)
        keyed, answer = await self.keys.claim_or_join(
            principal=principal,
            server=self.server,
            tool=tool,
            arguments=params.get("arguments"),
            key=call_key(headers or {}, params),
            policy=policy,
            as_task=True,
            reply=None,
            keepalive_s=self.methods.keepalive_s,
            dialect="v1",
        )
        if answer is not None:
            return answer
        call = Call(
            pool=self.pool,
            server=self.server,
            tool=tool,
            params=upstream_params,
            capabilities=capabilities,
            timeout=policy.timeout,
            client_progress_token=token
            if isinstance(token, (str, int)) and not isinstance(token, bool)
            else None,
            input_timeout=policy.input_timeout,
            principal=principal,
            on_task_message=self._progress_of(principal),
        )
        rerun = (
            {"method": "tools/call", "params": upstream_params, "capabilities": capabilities}
            if policy.on_restart == "rerun"
            else None
        )
        origin = self._origin_of(headers or {})
        return await uncancelled(
            self._hand_over(call, ttl_s=ttl_s, policy=policy, rerun=rerun, keyed=keyed, origin=origin),
            what=f"a v1 task of {self.server}",
            expected=(JsonRpcError,),
        )

    async def _hand_over(
        self,
        call: Call,
        *,
        ttl_s: float | None,
        policy: ResolvedPolicy,
        rerun: JsonObject | None,
        keyed: KeyedCall | None,
        origin: str | None,
    ) -> JsonObject:
        """Commit the task of `call` (not started yet), then start the call as that task; the v1
        CreateTaskResult. Runs to its end even if the client goes away meanwhile (`uncancelled`):
        a task the store may have taken always gets its call. Raises what `TaskService.detach`
        raises (the call ended unsent, and the slot of `keyed` let go: nothing reached the
        upstream)."""
        try:
            record = await self.tasks.detach(
                call,
                server=self.server,
                tool=call.tool,
                method="tools/call",
                ttl_s=ttl_s,
                poll_interval_s=policy.poll_interval,
                status_message=f"running upstream on {self.server} as a task",
                rerun=rerun,
                task_id=None if keyed is None else keyed.task_id,
                origin=origin,
            )
        except JsonRpcError as exc:
            call.end_unsent(exc.message)
            if keyed is not None:  # refused before it started: a retry may run it
                await self.keys.release(keyed)
            raise
        if keyed is not None:
            self.keys.settle_when_done(call, keyed)
        call.detach(record.task_id, self.tasks, progress_interval_s=policy.progress_interval)
        call.start()
        return create_task_result_v1(record)


def client_capabilities(body: Any) -> JsonObject:
    """The legacy client capabilities an `initialize` request declared that upstream calls may use
    (elicitation, sampling, roots: `upstream_capabilities`); `{}` for anything else."""
    if not isinstance(body, dict) or body.get("method") != "initialize":
        return {}
    caps = object_of(body.get("params")).get("capabilities")
    return upstream_capabilities(caps) if isinstance(caps, dict) else {}


def legacy_status(exc: JsonRpcError) -> int:
    """The HTTP status of a JSON-RPC error on the handshake-era wire: 200, as the 2025-11-25 SDK
    servers answer a request they understood (clients read the JSON-RPC code only from a 2xx);
    a refusal by a limit (429) or by the store (503) keeps its status."""
    return exc.http_status if exc.http_status in (429, 503) else 200
