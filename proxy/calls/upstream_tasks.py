"""Upstreams that speak v1 tasks themselves (2025-11-25: `capabilities.tasks.requests.tools.call`
and a tool's `execution.taskSupport`), in front of 2026-07-28 clients.

- A client with the tasks extension calling such a tool gets a v2 task backed by the upstream's
  own task: the proxy calls with `params.task`, commits its record, then follows the upstream's
  `tasks/result` (questions asked on that stream become `input_required`), and `tasks/cancel`
  reaches the upstream as `tasks/cancel`. The record's `rerun` is `tasks/result` for the upstream
  task id, so after a proxy restart the orphan sweep resumes following it (as long as the
  upstream keeps its task) instead of failing it.
- A client without the extension calling a `taskSupport: required` tool gets the synchronous
  result: the proxy waits on the upstream's `tasks/result` (SSE keep-alives meanwhile), never the
  upstream's "requires task augmentation".
"""

from __future__ import annotations

import asyncio

import structlog

from proxy.calls.call import Call
from proxy.calls.keys import CallKeys
from proxy.calls.types import KeyedCall, Reply
from proxy.config import ResolvedPolicy
from proxy.protocol.era import Envelope, strip_envelope, upstream_capabilities
from proxy.protocol.jsonrpc import INTERNAL_ERROR, REQUEST_CANCELLED, JsonObject, JsonRpcError, object_of
from proxy.protocol.translate import modern_error, modern_result
from proxy.runtime import tracing
from proxy.runtime.drain import Drain
from proxy.runtime.uncancelled import uncancelled
from proxy.tasks.service import TaskService
from proxy.tasks.wire_v2 import create_task_result
from proxy.upstream.types import Pool, Session, UpstreamError, UpstreamUndeliveredError

log = structlog.get_logger("proxy.calls")


MAX_TOOL_PAGES = 100  # tools/list pages read at most to learn the upstream's taskSupport


class UpstreamTaskCall(Call):
    """A `Call` that follows an upstream task: its method is `tasks/result` and its params name the
    upstream's `taskId`; cancelling it also sends the upstream `tasks/cancel`. It has no
    `upstream_ref`: the upstream's task goes on whoever follows it (a re-run follows it again)."""

    @property
    def upstream_ref(self) -> JsonObject | None:
        """None: see the class."""
        return None

    __slots__ = ()

    def cancel(self, reason: str) -> None:
        """Abandon the wait and cancel the upstream task (`tasks/cancel`, best effort); once only,
        as `Call.cancel`."""
        if self._cancel_reason:
            return
        super().cancel(reason)
        if self.session is not None:
            self._spawn(self._cancel_upstream(self.session))

    def end_unsent(self, reason: str, session: Session | None = None) -> None:
        """`Call.end_unsent`, and the upstream task this call would have followed is cancelled on
        `session` (the one that created it; `tasks/cancel`, best effort), so it does not run on
        with nobody to follow it while the client, told it failed, tries again."""
        started = self._runner is not None
        super().end_unsent(reason)
        if session is not None and not started:
            self._spawn(self._cancel_upstream(session))

    async def _cancel_upstream(self, session: Session) -> None:
        task_id = self.params.get("taskId")
        if not isinstance(task_id, str) or not task_id:
            return
        try:
            await session.request("tasks/cancel", {"taskId": task_id}, handler=None)
        except UpstreamError as exc:
            log.info("upstream_task_cancel_not_delivered", server=self.server, reason=str(exc))


class _NotSent(JsonRpcError):
    """A refusal before the upstream got the call (a limit, no session, no connection)."""

    def __init__(self, refusal: JsonRpcError) -> None:
        super().__init__(refusal.code, refusal.message, refusal.data, status=refusal.http_status)


class UpstreamTasks:
    """What one server's upstream offers as v1 tasks, and calls that use them."""

    def __init__(
        self, *, name: str, pool: Pool, tasks: TaskService, keepalive_s: float, drain: Drain
    ) -> None:
        self.name = name
        self.pool = pool
        self.tasks = tasks
        self.keepalive_s = keepalive_s
        self.drain = drain
        self.keys = CallKeys(tasks)
        self._support: dict[str, str] | None = None

    def clear(self) -> None:
        """Forget the tools' task support (the upstream's tool list changed)."""
        self._support = None

    def known_support(self, tool: str) -> tuple[bool, str | None]:
        """`(True, what support answers)` once the upstream's tools were read; `(False, None)` before."""
        return (False, None) if self._support is None else (True, self._support.get(tool))

    async def support(self, tool: str, capabilities: JsonObject, principal: str) -> str | None:
        """The upstream's `execution.taskSupport` for `tool` (`required`, `optional`), or None when the
        upstream has no task-augmented tools/call or the tool does not take tasks."""
        if self._support is None:
            try:
                session = await self.pool.session(capabilities, principal)
                caps = object_of(session.initialize_result.get("capabilities"))
                call_tasks = object_of(
                    object_of(object_of(caps.get("tasks")).get("requests")).get("tools")
                ).get("call")
                support: dict[str, str] = {}
                if isinstance(call_tasks, dict):
                    params: JsonObject | None = None
                    for _ in range(MAX_TOOL_PAGES):
                        page = object_of(
                            (await session.request("tools/list", params, handler=None)).get("result")
                        )
                        tools = page.get("tools")
                        for item in tools if isinstance(tools, list) else []:
                            value = object_of(object_of(item).get("execution")).get("taskSupport")
                            if (
                                isinstance(item, dict)
                                and isinstance(item.get("name"), str)
                                and value in ("required", "optional")
                            ):
                                support[item["name"]] = value
                        if not isinstance(page.get("nextCursor"), str) or not page["nextCursor"]:
                            break
                        params = {"cursor": page["nextCursor"]}
            except UpstreamError:
                return None
            self._support = support
        return self._support.get(tool)

    async def call(
        self,
        params: JsonObject,
        envelope: Envelope,
        *,
        principal: str,
        reply: Reply,
        policy: ResolvedPolicy,
        as_task: bool,
        keyed: KeyedCall | None = None,
    ) -> JsonObject:
        """Run `tools/call` as an upstream task: a flat v2 CreateTaskResult when `as_task`, else the
        synchronous result once the upstream's `tasks/result` answers. `keyed`: the slot the call
        holds (`keys.CallKeys.claim`): its task takes the slot's task id, and an answer that is not
        a task is kept in the slot before it goes out.

        Raises JsonRpcError: the upstream's own error (translated), -32603 when it is unreachable,
        a limit error (HTTP 429) or -32603 (HTTP 503) when the task cannot be committed.
        """
        try:
            answer = await self._call(
                params,
                envelope,
                principal=principal,
                reply=reply,
                policy=policy,
                as_task=as_task,
                keyed=keyed,
            )
        except _NotSent:
            if keyed is not None:  # nothing reached the upstream: a retry may run it
                await self.keys.release(keyed)
            raise
        except JsonRpcError as exc:
            if keyed is not None:
                await self.keys.settle(keyed, {"error": exc.to_error()})
            raise
        except asyncio.CancelledError:  # the client left and its upstream task was cancelled
            if keyed is not None and keyed.task_id not in self.tasks.live:  # (else its task goes on)
                error = {"code": REQUEST_CANCELLED, "message": "the call was cancelled: its client went away"}
                self.keys.settle_later(keyed, {"error": error})
            raise
        if keyed is not None and answer.get("resultType") != "task":
            await self.keys.settle(keyed, {"result": answer})
        return answer

    async def _call(
        self,
        params: JsonObject,
        envelope: Envelope,
        *,
        principal: str,
        reply: Reply,
        policy: ResolvedPolicy,
        as_task: bool,
        keyed: KeyedCall | None = None,
    ) -> JsonObject:
        caps = upstream_capabilities(envelope.capabilities)
        tool = params["name"]
        upstream_params = strip_envelope(params)
        upstream_params["task"] = {"ttl": int(policy.ttl * 1000)} if policy.ttl is not None else {}
        if as_task:
            try:
                await self.tasks.check_capacity(principal)
            except JsonRpcError as exc:
                raise _NotSent(exc) from None
        try:
            session = await self.pool.session(caps, principal)
        except UpstreamError as exc:
            raise _NotSent(JsonRpcError(INTERNAL_ERROR, str(exc))) from None
        try:
            created = await session.request("tools/call", upstream_params, handler=None)
        except UpstreamUndeliveredError as exc:
            raise _NotSent(JsonRpcError(INTERNAL_ERROR, str(exc))) from None
        except UpstreamError as exc:
            raise JsonRpcError(INTERNAL_ERROR, str(exc)) from None
        if "error" in created:
            error = modern_error(created["error"])
            raise JsonRpcError(error["code"], error["message"], error.get("data"))
        result = object_of(created.get("result"))
        task_id = object_of(result.get("task")).get("taskId")
        if not isinstance(task_id, str):
            return modern_result("tools/call", result)  # the upstream answered at once
        call = UpstreamTaskCall(
            pool=self.pool,
            server=self.name,
            tool=tool,
            method="tasks/result",
            params={"taskId": task_id},
            capabilities=caps,
            timeout=policy.timeout,
            input_timeout=policy.input_timeout,
            principal=principal,
        )
        if not as_task:
            call.start()
            return await self._wait(call, reply)
        answer = await uncancelled(
            self._hand_over(call, session, policy=policy, keyed=keyed),
            what=f"following an upstream task of {self.name}",
            expected=(JsonRpcError,),
        )
        tracing.bind_task_id(answer["taskId"])
        return answer

    async def _hand_over(
        self, call: UpstreamTaskCall, session: Session, *, policy: ResolvedPolicy, keyed: KeyedCall | None
    ) -> JsonObject:
        """Commit the task that follows the upstream's task (`call`, not started yet; the upstream
        created its task on `session`), then start following it; the flat v2 CreateTaskResult. Runs
        to its end even if the client goes away meanwhile (`uncancelled`): a task the store may have
        taken always gets its call. Raises what `TaskService.detach` raises (kept in the slot of
        `keyed` first: its client may be gone), after cancelling the upstream's task."""
        try:
            record = await self.tasks.detach(
                call,
                server=self.name,
                tool=call.tool,
                method="tools/call",
                ttl_s=policy.ttl,
                poll_interval_s=policy.poll_interval,
                status_message=f"running upstream on {self.name} as its own task",
                rerun={"method": call.method, "params": call.params, "capabilities": call.capabilities},
                task_id=None if keyed is None else keyed.task_id,
            )
        except JsonRpcError as exc:
            call.end_unsent(exc.message, session)  # (and the upstream's task, followed by nobody, cancelled)
            if keyed is not None:  # (`call` keeps it again when its client is still there: same entry)
                await self.keys.settle(keyed, {"error": exc.to_error()})
            raise
        if keyed is not None:
            self.keys.settle_when_done(call, keyed)
        call.detach(record.task_id, self.tasks, progress_interval_s=policy.progress_interval)
        call.start()
        return create_task_result(record)

    async def _wait(self, call: Call, reply: Reply) -> JsonObject:
        """The outcome of a followed upstream task, with SSE keep-alives every keepalive_s (s).

        A question the upstream's task asks cannot reach a client without the tasks extension: the
        upstream task is cancelled and the client gets -32603 saying so (not a wait for
        `input_timeout`). So does a call still waiting when the shutdown drain ends (`Drain`: at
        drain_timeout, or at once on a second signal)."""
        try:
            while not call.done:
                if call.pending:
                    kinds = sorted({pending.request["method"] for pending in call.pending.values()})
                    call.cancel("the upstream task asked for input a synchronous call cannot carry")
                    raise JsonRpcError(
                        INTERNAL_ERROR,
                        f"upstream {self.name}'s task asked for input ({', '.join(kinds)}), which a call "
                        f"without the "
                        "io.modelcontextprotocol/tasks extension cannot answer; declare the extension to "
                        "answer it through the task",
                    )
                timer = self.drain.timer(self.drain.cap(self.keepalive_s), call.wake)  # (rung by a drain)
                try:
                    kind, item = await call.events.get()  # input, done, notifications, or the wake-up
                finally:
                    timer.cancel()
                if kind != "timeout" or item is not timer or call.done or call.pending:
                    continue
                if self.drain.remaining() == 0.0:
                    raise call.abandon(self.drain)
                await reply.keepalive()
        except asyncio.CancelledError:
            call.cancel("the client closed the request stream")
            raise
        outcome = call.outcome.result()
        if "result" in outcome:
            return modern_result("tools/call", outcome["result"])
        error = modern_error(outcome.get("error"))
        raise JsonRpcError(error["code"], error["message"], error.get("data"))
