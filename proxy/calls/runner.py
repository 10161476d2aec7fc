"""The attach / detach / MRTR loop of one server's calls (design.md "Where the code goes next" 4).

A call starts attached to its client's request. What comes first decides the answer: the
upstream's outcome (a synchronous result), a question from the upstream (an MRTR round, SEP-2322),
or the detach deadline (a task handle, ext-tasks). The detach clock starts when the request
arrived at the proxy, not when the upstream was reached.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import structlog

from proxy.calls.call import Call
from proxy.calls.keys import CallKeys
from proxy.calls.mrtr import ParkedCalls, request_digest
from proxy.calls.types import KeyedCall, Reply
from proxy.config import ResolvedPolicy, ToolMode
from proxy.protocol.era import TASKS_EXTENSION, Envelope, strip_envelope, upstream_capabilities
from proxy.protocol.jsonrpc import (
    MISSING_REQUIRED_CLIENT_CAPABILITY,
    JsonObject,
    JsonRpcError,
    object_of,
)
from proxy.protocol.translate import outcome_answer
from proxy.runtime import metrics, tracing
from proxy.runtime.drain import Drain
from proxy.runtime.running import bind
from proxy.runtime.uncancelled import uncancelled
from proxy.tasks.model import TaskRecord
from proxy.tasks.service import TaskService
from proxy.tasks.wire_v2 import create_task_result, validate_input_responses
from proxy.upstream.types import Pool

log = structlog.get_logger("proxy.calls")

INPUT_GATHER_S = 0.05  # questions arriving within 50 ms of each other share one MRTR round


class CallRunner:
    """Runs the MRTR-capable requests (`tools/call`, `prompts/get`, `resources/read`) of server `name`.

    `keepalive_s` (s) is the SSE comment interval while a client waits; `on_server_notification`
    receives upstream list changes seen on a call's stream.
    """

    def __init__(
        self,
        *,
        name: str,
        pool: Pool,
        tasks: TaskService,
        parked: ParkedCalls,
        drain: Drain,
        keepalive_s: float,
        on_server_notification: Callable[[JsonObject], None],
    ) -> None:
        self.name = name
        self.pool = pool
        self.tasks = tasks
        self.parked = parked
        self.drain = drain
        self.keepalive_s = keepalive_s
        self.on_server_notification = on_server_notification
        self.keys = CallKeys(tasks)
        self._background: set[asyncio.Task[None]] = set()  # keyed calls carried on without their client

    def _start(
        self,
        method: str,
        name: str,
        params: JsonObject,
        envelope: Envelope,
        *,
        principal: str,
        policy: ResolvedPolicy,
    ) -> Call:
        meta = object_of(params.get("_meta"))
        call = Call(
            pool=self.pool,
            server=self.name,
            tool=name,
            method=method,
            params=strip_envelope(params),
            capabilities=upstream_capabilities(envelope.capabilities),
            timeout=policy.timeout,
            client_progress_token=meta.get("progressToken"),
            relay_logs=envelope.log_level is not None,
            input_timeout=policy.input_timeout,
            prefilled=params.get("inputResponses"),
            principal=principal,
            on_server_notification=self.on_server_notification,
        )
        call.start()
        return call

    async def run(
        self,
        method: str,
        name: str,
        params: JsonObject,
        envelope: Envelope,
        *,
        principal: str,
        reply: Reply,
        policy: ResolvedPolicy,
        arrived: float,
        keyed: KeyedCall | None = None,
    ) -> JsonObject:
        """Start (or, on an MRTR retry, resume) a proxy-owned upstream call and answer with what comes
        first: its result, an InputRequiredResult, or a flat CreateTaskResult once `policy.detach_after`
        (s) has passed since `arrived` (event-loop time, s). A `mode: required` tool composes the same
        way (SEP-2663 "resolve MRTR exchanges before the task"): questions before the deadline are
        MRTR rounds, and the round that reaches the deadline or the outcome mints the task (an
        outcome that came first is recorded in it), so it never answers synchronously.

        `keyed`: the slot the call holds (an idempotency key or `dedupe`, `keys.CallKeys.claim`):
        its task takes the slot's task id; an answer other than a task or an MRTR round is kept in
        the slot before it goes out; and a client that goes away does not stop it (it becomes a
        task when the request could have had one, else runs on until its outcome fills the slot).

        Raises JsonRpcError: -32602 for a bad `requestState` or `inputResponses`, -32021 when the
        upstream needs a capability the client did not declare, a limit error (HTTP 429), the
        upstream's own error (translated), -32603 naming the layer that gave up (store, shutdown).
        """
        may_detach = (
            method == "tools/call" and envelope.declares_tasks and policy.mode is not ToolMode.FORBIDDEN
        )
        meta = object_of(params.get("_meta"))
        digest = request_digest(method, name, params.get("arguments") if method != "resources/read" else None)
        responses = params.get("inputResponses")
        if responses is not None:
            validate_input_responses(responses)
        if "requestState" in params:
            call = await self.parked.resume(
                params["requestState"], principal=principal, server=self.name, digest=digest
            )
            call.resume(meta.get("progressToken"))
            _bind_upstream_ids(call)  # the upstream request this retry waits on
            call.answer(responses or {})
            if call.key is not None:  # the round a retry could be given is answered
                await self.keys.keep_round(call.key, None)
        else:
            call = self._start(method, name, params, envelope, principal=principal, policy=policy)
            call.key = keyed
            if keyed is not None:
                self.keys.settle_when_done(call, keyed)
        try:
            answer = await self._follow(
                call, policy, may_detach, digest, principal=principal, reply=reply, arrived=arrived
            )
        except JsonRpcError as exc:
            if call.key is not None and call.task_id is None:
                if call.done:  # its outcome is being kept (`settle_when_done`)
                    await self.keys.kept(call.key)
                else:
                    await self._keep(call, {"error": exc.to_error()})
            raise
        finally:
            _bind_upstream_ids(call)  # (also on the line of a client that left)
        if call.key is not None and call.task_id is None:
            if answer.get("resultType") == "input_required":
                await self.keys.keep_round(call.key, answer)
            elif answer.get("resultType") != "task":
                await self.keys.kept(call.key)
        return answer

    async def _keep(self, call: Call, outcome: JsonObject) -> None:
        """A keyed call's answer goes out as `outcome`: kept in its slot, unless the request never
        reached the upstream (then the slot is let go: a retry runs the call)."""
        assert call.key is not None
        if call.sent:
            await self.keys.settle(call.key, outcome)
        else:
            await self.keys.release(call.key)

    async def _follow(
        self,
        call: Call,
        policy: ResolvedPolicy,
        may_detach: bool,
        digest: str,
        *,
        principal: str,
        reply: Reply,
        arrived: float,
    ) -> JsonObject:
        """`run`'s loop over what the call does first (its outcome, a question, the detach deadline)."""
        method = call.method
        # `mode: required` never answers synchronously: its outcome, had it come first, goes into a task.
        required = method == "tools/call" and policy.mode is ToolMode.REQUIRED
        loop = asyncio.get_running_loop()
        deadline = arrived + policy.detach_after if may_detach else None
        shareable = call.key is not None and method == "tools/call" and policy.mode is not ToolMode.FORBIDDEN
        shadow_at = arrived + policy.detach_after if shareable and deadline is None else None
        # While this handler follows the call, the upstream reader writes notifications to the
        # client itself when it can (`Reply.relay`): no hand-over through `events` and this task.
        call.relay = reply.relay
        try:
            while True:
                if call.done:
                    if not required:
                        return self._result(call)
                    return await self._detach(call, policy, f"finished upstream on {self.name}") or {}
                if call.pending:
                    answer = await self._ask_client(
                        call, principal=principal, digest=digest, timeout_s=policy.input_timeout, reply=reply
                    )
                    if answer is None:  # the call ended while the round was being gathered
                        continue
                    return answer
                wait = self.keepalive_s
                for due in (deadline, shadow_at):
                    if due is not None:
                        wait = min(wait, max(0.0, due - loop.time()))
                wait = self.drain.cap(wait)
                # One wake-up for the whole wait: notifications relayed before it rings cost no timer
                # each (a keepalive follows `keepalive_s` after the wait began, chatty or not), and
                # it cancels nothing awaited here (a write to a slow client stays whole); it is
                # acted on after the relay in progress, not after the whole queue.
                timer = self.drain.timer(wait, call.wake)
                try:
                    while True:
                        kind, item = await call.events.get()
                        if kind == "notification":
                            await reply.notify(item)
                            if timer.done:  # it rang during the relays: its wake-up waits behind
                                kind = "timeout"  # the queue, the deadline does not
                                break
                        elif kind != "timeout" or item is timer:  # (a wake-up of an earlier wait: stale)
                            break
                finally:
                    timer.cancel()
                if kind == "timeout":
                    if call.done or call.pending:
                        continue
                    if self.drain.remaining() == 0.0:
                        raise call.abandon(self.drain) from None
                    if shadow_at is not None and loop.time() >= shadow_at:
                        shadow_at = None
                        await self._share(call, policy)
                        continue
                    if deadline is not None and loop.time() >= deadline:
                        if self._draining_alone():
                            deadline = None  # (a task made now would only be failed as the proxy stops)
                            continue
                        handle = await self._detach(
                            call,
                            policy,
                            f"still running upstream after {policy.detach_after:g} s; continuing in the "
                            f"background",
                            stay=True,
                        )
                        if handle is None:
                            # the store cannot take the task: the call stays attached (its own timeout
                            # bounds it)
                            deadline = None
                            continue
                        metrics.DETACH_LATENCY.observe(max(0.0, loop.time() - deadline))
                        return handle
                    await reply.keepalive()
                    continue
                if kind == "unsupported" and not call.done:
                    call.cancel(f"the upstream needs the {item} capability")
                    raise JsonRpcError(
                        MISSING_REQUIRED_CLIENT_CAPABILITY,
                        f"upstream {self.name} needs the {item} client capability for this request",
                        {"requiredCapabilities": {item: {}}},
                    )
        except asyncio.CancelledError:
            if call.task_id is None:
                self.parked.release(call)
                if call.key is None:
                    call.cancel("the client closed the request stream")
                else:  # a retry with its key joins it: it goes on without its client
                    self._spawn(self._carry_on(call, policy))
            raise
        finally:
            if call.relay == reply.relay:  # (not a later handler's, should one have taken over)
                call.relay = None

    def _draining_alone(self) -> bool:
        """True while a proxy without replicas drains: no other replica would serve a task detached
        now, and the shutdown fails every task still running, so a call reaching its detach deadline
        stays attached and gets what is left of drain_timeout to finish."""
        return self.drain.started and self.tasks.remote is None

    async def _carry_on(self, call: Call, policy: ResolvedPolicy) -> None:
        """A keyed call whose client went away goes on, as a task under its slot's task id (what
        a restart, a drain or a lost replica does to a task applies to it, and retries join it)
        whatever the request could have had; a tool that never runs as a task (`mode: forbidden`),
        or a task the store or a limit refuses, runs on until its outcome, which fills the slot
        (`CallKeys.settle_when_done`)."""
        assert call.key is not None
        if call.key.task_id in self.tasks.live or call.done:  # shared as a task already, or over
            return
        if call.method == "tools/call" and policy.mode is not ToolMode.FORBIDDEN:
            why = "its client went away; continuing in the background"
            try:
                await self._detach(call, policy, why, stay=True)
            except JsonRpcError as exc:  # refused, and cancelled: its slot keeps the refusal
                await self.keys.settle(call.key, {"error": exc.to_error()})

    async def _share(self, call: Call, policy: ResolvedPolicy) -> None:
        """A keyed call attached to a request without tasks, past `detach_after`: commit a task for
        it under its slot's task id while it stays attached, so that a task-capable retry with its
        key gets that task's handle (the call's outcome is written to the task when it ends, as the
        attached answer goes out). A store or a limit that refuses the task leaves the call as it
        was: retries then wait for its outcome."""
        assert call.key is not None
        if call.key.task_id in self.tasks.live:  # shared before (an MRTR round resumed it)
            return
        await uncancelled(
            self._share_as_task(call, policy),
            what=f"sharing a call of {self.name} as a task",
            expected=(JsonRpcError,),
        )

    async def _share_as_task(self, call: Call, policy: ResolvedPolicy) -> None:
        """`_share`'s commit and hand-over, which its client going away does not cut in two: a task
        committed for the call always gets the call's outcome."""
        try:
            record = await self._commit(
                call, policy, "running attached to its first request; retries with its key share it"
            )
        except JsonRpcError as exc:
            log.info("keyed_call_not_shared", server=self.name, tool=call.tool, reason=exc.message)
            return
        task_id = record.task_id

        def ended(done: Call) -> None:
            if done.task_id is None:  # (detached into this task since: its own end recorded it)
                self._spawn(self.tasks.finish(task_id, done.outcome.result(), None, by=done.ended_by))

        call.add_done_callback(ended)

    async def _commit(self, call: Call, policy: ResolvedPolicy, why: str) -> TaskRecord:
        """Commit the task of `call` (under its slot's task id when it has a key), with status
        message `why`; the service takes the call over. Raises what `TaskService.detach` raises."""
        return await self.tasks.detach(
            call,
            server=self.name,
            tool=call.tool,
            method=call.method,
            ttl_s=policy.ttl,
            poll_interval_s=policy.poll_interval,
            status_message=why,
            rerun=_rerun_of(call, policy),
            task_id=None if call.key is None else call.key.task_id,
        )

    async def _detach(
        self, call: Call, policy: ResolvedPolicy, why: str, *, stay: bool = False
    ) -> JsonObject | None:
        """Turn the call into a task (committed before the handle is returned); a refusal (limit,
        store) cancels the call, so it never goes on unseen. With `stay`, a store refusal (503) or a
        limit (`max_tasks_per_principal`, 429) keeps the call attached instead (None is returned): the
        upstream call has started, so the answer must not be a cancel and a status a client or a
        load balancer would send again. A `mode: required` call the store
        refuses ends with HTTP 500 (-32603) for the same reason.

        The commit and the hand-over run to their end even if the client goes away meanwhile (its
        handler is cancelled; `uncancelled`): a task the store may have taken always gets its call,
        which then ends it (the handler cancels a call without a key as it leaves, and that outcome
        is the task's) or runs on as it (a call with a key)."""
        self.parked.release(call)
        answer = await uncancelled(
            self._hand_over(call, policy, why, stay=stay),
            what=f"detaching a call of {self.name}",
            expected=(JsonRpcError,),
        )
        if answer is not None:
            tracing.bind_task_id(answer["taskId"])
        return answer

    async def _hand_over(
        self, call: Call, policy: ResolvedPolicy, why: str, *, stay: bool
    ) -> JsonObject | None:
        """`_detach`'s commit, then the call handed to its task; the CreateTaskResult, or None (`stay`)."""
        try:
            record = await self._commit(call, policy, why)
        except JsonRpcError as exc:
            if stay and exc.http_status in (429, 503):
                # The call has started upstream: a limit or the store refusing its task must not turn
                # into a cancel and a status a client (or a balancer) sends again; it stays attached.
                log.warning("detach_refused_call_stays_attached", server=self.name, reason=exc.message)
                return None
            if exc.http_status != 503:
                call.cancel("refused: the call could not become a task")
                raise
            call.cancel("refused: the call could not become a task")
            # 507: the task could not be stored; not 503, which balancers retry
            raise JsonRpcError(exc.code, exc.message, exc.data, status=507) from None
        call.detach(record.task_id, self.tasks, progress_interval_s=policy.progress_interval)
        if call.method == "tools/call":
            metrics.count_call(self.name, call.tool, "detached")
        return create_task_result(record)

    async def _ask_client(
        self, call: Call, *, principal: str, digest: str, timeout_s: float, reply: Reply
    ) -> JsonObject | None:
        """Answer with an InputRequiredResult for every outstanding question (SEP-2322), parking the
        call; None when the call ended meanwhile (the caller then answers with its outcome).

        Questions that arrive within INPUT_GATHER_S of each other go out in the same round.
        """
        loop = asyncio.get_running_loop()
        quiet_until = loop.time() + INPUT_GATHER_S
        while not call.done:
            remaining = quiet_until - loop.time()
            if remaining <= 0:
                break
            try:
                kind, item = await asyncio.wait_for(call.events.get(), timeout=remaining)
            except TimeoutError:
                break
            if kind == "notification":
                await reply.notify(item)
            elif kind == "input":
                quiet_until = loop.time() + INPUT_GATHER_S
        if call.done:
            return None
        state = self.parked.park(
            call, principal=principal, server=self.name, digest=digest, timeout_s=timeout_s
        )
        return {"resultType": "input_required", "inputRequests": call.input_requests(), "requestState": state}

    def _result(self, call: Call) -> JsonObject:
        self.parked.release(call)
        outcome = call.outcome.result()
        if call.method == "tools/call":
            metrics.count_call(
                self.name,
                call.tool,
                "sync" if "result" in outcome else "error",
                answered=metrics.succeeded(outcome),
            )
        return outcome_answer(call.method, outcome)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)


def _rerun_of(call: Call, policy: ResolvedPolicy) -> JsonObject | None:
    """What re-runs `call` after its owner died (`{method, params, capabilities}`), kept only for
    tools configured `on_restart: rerun`."""
    if policy.on_restart != "rerun":
        return None
    return {"method": call.method, "params": call.params, "capabilities": call.capabilities}


def require_tasks_for(tool: str) -> JsonRpcError:
    """The -32021 refusal for a `mode: required` tool called without the tasks extension."""
    return JsonRpcError(
        MISSING_REQUIRED_CLIENT_CAPABILITY,
        f"tool {tool!r} always runs as a task; declare the {TASKS_EXTENSION} extension",
        {"requiredCapabilities": {"extensions": {TASKS_EXTENSION: {}}}},
    )


def _bind_upstream_ids(call: Call) -> None:
    """The upstream's JSON-RPC id of `call` and the progress token it carried, in the request's log
    context (its access line): what the upstream's own logs know the call by."""
    if call.upstream_request_id is not None:
        bind(upstream_request_id=call.upstream_request_id, upstream_progress_token=call.progress_token)
