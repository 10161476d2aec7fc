"""One in-flight upstream `tools/call`, owned by the proxy rather than by the client's HTTP handler.

A call is *attached* while its client waits on the original request (notifications are relayed to
that request's stream), and *detached* once it became a task: from then on it reports its status,
input requests and outcome through a `TaskSink` (the task service) (design.md "The path of one request").
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import structlog

from proxy.calls.types import KeyedCall
from proxy.protocol import jsonrpc
from proxy.protocol.era import LIST_CHANGED_NOTIFICATIONS
from proxy.protocol.inputs import (
    INPUT_CAPABILITY,
    INPUT_KEY_HINT,
    INPUT_METHODS,
    InputError,
    PendingInput,
    input_request_value,
)
from proxy.protocol.jsonrpc import INTERNAL_ERROR, REQUEST_CANCELLED, JsonObject, RequestId, object_of
from proxy.runtime import metrics
from proxy.runtime.drain import Drain
from proxy.runtime.running import bind
from proxy.tasks.types import TaskSink
from proxy.upstream.types import Pool, Session, UpstreamError, UpstreamUndeliveredError, with_session

log = structlog.get_logger("proxy.calls")


class _Discard(asyncio.Queue[tuple[str, Any]]):
    """Stands in for the event queue of a detached call: events for an attached client go nowhere."""

    def put_nowait(self, item: tuple[str, Any]) -> None:
        pass


_DISCARD = _Discard()  # the one shared stand-in queue

# how long (s) a call whose questions were just refused may take to end before it is cancelled
CANCEL_GRACE_S = 0.5


_NO_KEYS: frozenset[str] = frozenset()
_BACKGROUND: set[asyncio.Task[Any]] = set()


class Call:
    """An upstream request (`tools/call`, or `prompts/get` / `resources/read`) in its own asyncio task.

    `params` are the params to send upstream (envelope already stripped), `capabilities` the
    legacy client capabilities for the upstream session, `timeout` the hard limit in seconds,
    `input_timeout` how long (s) one upstream question may stay unanswered, `prefilled` input
    responses supplied before the question was asked (answered at once when their key comes up).
    `on_server_notification` receives the server-wide notifications (list changes) that arrive on the
    call's stream; `on_task_message(task_id, notification)` a detached call's progress under the
    client's own token (v1 tasks keep the token valid for the task's life).
    `outcome` resolves to the upstream response message (`{"result": …}` or `{"error": …}`).
    `events` carries `("notification", msg)`, `("input", key)`, `("unsupported", capability)`,
    `("done", None)` and the handler's own wake-ups `("timeout", token)` (`wake`) for the attached
    client; while one follows the call, `relay` (its `Reply.relay`) writes notifications to it
    directly when nothing is queued before them.
    """

    # Slots: ~10,000 detached calls may be alive at once, and a per-instance dict costs ~1.8 KB each.
    __slots__ = (
        "call_id",
        "_progress_text",
        "_progress_written",
        "_progress_timer",
        "progress_write_s",
        "ended_by",
        "started",
        "principal",
        "pool",
        "server",
        "method",
        "tool",
        "params",
        "input_timeout",
        "prefilled",
        "_used_keys",
        "_input_timers",
        "capabilities",
        "timeout",
        "sink",
        "client_progress_token",
        "relay_logs",
        "progress_token",
        "outcome",
        "events",
        "relay",
        "task_id",
        "key",
        "session",
        "upstream_request_id",
        "sent",
        "pending",
        "_runner",
        "_on_done",
        "_cancel_reason",
        "_cancel_outcome",
        "on_server_notification",
        "on_task_message",
        "__weakref__",
    )

    def __init__(
        self,
        *,
        pool: Pool,
        server: str,
        tool: str,
        params: JsonObject,
        capabilities: JsonObject,
        timeout: float,
        sink: TaskSink | None = None,
        method: str = "tools/call",
        client_progress_token: str | int | None = None,
        relay_logs: bool = False,
        input_timeout: float = 600.0,
        prefilled: JsonObject | None = None,
        principal: str = "",
        on_server_notification: Callable[[JsonObject], None] | None = None,
        on_task_message: Callable[[str, JsonObject], None] | None = None,
    ) -> None:
        self.call_id = secrets.token_urlsafe(16)
        self._progress_text: str | None = None
        self._progress_written = 0.0
        self._progress_timer: asyncio.TimerHandle | None = None
        self.progress_write_s = 0.0  # set by detach(): no progress is written before it
        # what ended the call, for the audit log: upstream, timeout, input_timeout, shutdown (the drain)
        self.ended_by = "upstream"
        self.started = time.monotonic()
        self.principal = principal
        self.pool = pool
        self.server = server
        self.method = method
        self.tool = tool
        self.params = params
        self.input_timeout = input_timeout
        self.prefilled = dict(prefilled or {})
        self._used_keys: set[str] | frozenset[str] = _NO_KEYS  # a set once the first input key is handed out
        self._input_timers: dict[str, asyncio.TimerHandle] = {}
        self.capabilities = capabilities
        self.timeout = timeout
        self.sink = sink
        self.client_progress_token = client_progress_token
        self.relay_logs = relay_logs
        self.progress_token = "mtp-" + secrets.token_urlsafe(12)
        self.outcome: asyncio.Future[JsonObject] = asyncio.get_running_loop().create_future()
        self.events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        # The following handler's direct writer, while one is attached (`Reply.relay`)
        self.relay: Callable[[JsonObject], Awaitable[bool]] | None = None
        self.task_id: str | None = None
        self.key: KeyedCall | None = None  # the slot an idempotency key (or `dedupe`) gave the call
        self.session: Session | None = None
        self.upstream_request_id: RequestId | None = None
        self.sent = False
        self.pending: dict[str, PendingInput] = {}
        self._runner: asyncio.Task[None] | None = None
        self._on_done: list[Callable[[Call], None]] = []
        self._cancel_reason = ""  # why `cancel` stopped the call, for its outcome
        self._cancel_outcome: JsonObject | None = None  # that outcome, when not the usual -32800
        self.on_server_notification = on_server_notification
        self.on_task_message = on_task_message

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Start the upstream request in a task of its own. A call cancelled before it started (the
        fence came while its task was being created) never reaches the upstream: it ends as -32800."""
        if self._cancel_reason:
            self._finish(self._cancelled_reply())
            return
        self._runner = asyncio.get_running_loop().create_task(
            self._run(), name=f"{self.method} {self.server}/{self.tool}"
        )

    def end_unsent(self, reason: str) -> None:
        """End a call that was never started (its task could not be committed) without sending
        anything: its outcome is -32800 naming `reason`. A task the store took all the same (its
        reply lost) then reads that outcome (`TaskService._keep_unsure`), not `working` for good."""
        if self._runner is None:
            self._cancel_reason = self._cancel_reason or reason  # (the fence's, if it came first)
            self.start()  # (which ends a cancelled call unsent)

    def add_done_callback(self, fn: Callable[[Call], None]) -> None:
        """Call `fn(call)` once, when the outcome is known: soon (from the event loop, as asyncio's
        futures do) if it is known already."""
        if self.outcome.done():
            asyncio.get_running_loop().call_soon(fn, self)
            return
        self._on_done.append(fn)

    @property
    def done(self) -> bool:
        """True once the outcome is known."""
        return self.outcome.done()

    async def _run(self) -> None:
        try:
            async with asyncio.timeout(self.timeout):
                reply = await with_session(self.pool, self.capabilities, self.principal or None, self._send)
        except TimeoutError:
            self.ended_by = "timeout"
            self._spawn(self._send_cancelled("hard timeout"))
            reply = {
                "error": {
                    "code": INTERNAL_ERROR,
                    "message": f"upstream {self.server} hard timeout: no answer within {self.timeout:g} s",
                }
            }
        except UpstreamError as exc:
            if isinstance(exc, UpstreamUndeliveredError):
                self.sent = False  # it never reached the upstream
            reply = {"error": {"code": INTERNAL_ERROR, "message": str(exc)}}
        except asyncio.CancelledError:
            if not self.outcome.done():
                self._finish(self._cancelled_reply())
            raise
        except Exception as exc:  # a bug or a garbage upstream must not kill the proxy
            log.exception("call_crashed", server=self.server, tool=self.tool)
            reply = {
                "error": {
                    "code": INTERNAL_ERROR,
                    "message": f"proxy error while calling upstream {self.server}: {exc.__class__.__name__}",
                }
            }
        if self._cancel_reason and object_of(reply.get("error")).get("code") == REQUEST_CANCELLED:
            reply = self._cancelled_reply()  # the upstream's answer to the cancel sent: say why
        self._finish(reply)

    def _cancelled_reply(self) -> JsonObject:
        """The -32800 outcome of a call cancelled here, naming why when `cancel` said (also when the
        upstream's own -32800, its answer to the cancel, came before the request was stopped); the
        drain's -32603 for a call it abandoned (`abandon`)."""
        if self._cancel_outcome is not None:
            return self._cancel_outcome
        why = f": {self._cancel_reason}" if self._cancel_reason else ""
        return {"error": {"code": REQUEST_CANCELLED, "message": f"the call was cancelled{why}"}}

    def _send(self, session: Session) -> Coroutine[Any, Any, JsonObject]:
        """One attempt at the upstream request on `session` (`with_session` makes a second on a new
        session when the upstream forgot this one), with the call's own progress token: the
        session's request coroutine, for `with_session` to await (no coroutine frame of its own: a
        detached call holds its chain of frames for hours)."""
        params = dict(self.params)
        params["_meta"] = {**object_of(params.get("_meta")), "progressToken": self.progress_token}
        self.session = session
        self.upstream_request_id = session.next_id()
        # (the call's own log context, and the console's entry of the request that started it)
        bind(upstream_request_id=self.upstream_request_id, upstream_progress_token=self.progress_token)
        self.sent = False  # True once the request left the max_concurrency queue (stdio) / was POSTed
        return session.request(
            self.method,
            params,
            handler=self._on_message,
            request_id=self.upstream_request_id,
            on_sent=self._mark_sent,
        )

    def _finish(self, reply: JsonObject) -> None:
        if self.outcome.done():
            return
        self.outcome.set_result(reply)
        if self._runner is not None:  # (not for a call ended before it was ever started)
            metrics.UPSTREAM_LATENCY.labels(self.server, self.method).observe(time.monotonic() - self.started)
        error = reply.get("error")
        if (
            self.method == "tools/call"
            and self.ended_by in ("upstream", "timeout")
            and isinstance(error, dict)
        ):
            if error.get("code") != REQUEST_CANCELLED:  # the upstream failed it, not a cancel here
                via = "request" if self.task_id is None else "task"
                metrics.UPSTREAM_ERRORS.labels(self.server, via).inc()
        for timer in self._input_timers.values():
            timer.cancel()
        self._input_timers.clear()
        self.events.put_nowait(("done", None))
        if self.task_id is not None:
            self._record_outcome(reply)  # with the last progress text, if its write was still pending
        if self._progress_timer is not None:
            self._progress_timer.cancel()
            self._progress_timer = None
        for fn in self._on_done:
            fn(self)

    def _record_outcome(self, reply: JsonObject) -> None:
        assert self.task_id is not None and self.sink is not None
        if "result" in reply:
            outcome: JsonObject = {"result": reply["result"]}
            message = self._progress_text  # the latest, whether or not a write of it already went
        else:
            error = reply.get("error")
            outcome = {"error": error}
            text = error.get("message") if isinstance(error, dict) else None
            if isinstance(error, dict) and error.get("code") == INTERNAL_ERROR:
                message = f"{text}"
            else:
                message = f"upstream {self.server} answered with a JSON-RPC error: {text}"
        self._spawn(self.sink.finish(self.task_id, outcome, message, by=self.ended_by))

    # -- messages from the upstream --------------------------------------------------------

    async def _on_message(self, msg: JsonObject) -> None:
        method = msg.get("method")
        if jsonrpc.is_request(msg):
            if method in INPUT_METHODS:
                self._on_input_request(msg)
            else:
                self._spawn(
                    self._respond(
                        msg["id"],
                        error={
                            "code": jsonrpc.METHOD_NOT_FOUND,
                            "message": f"the proxy does not relay {method}",
                        },
                    )
                )
            return
        params = object_of(msg.get("params"))
        if method == "notifications/progress" and params.get("progressToken") == self.progress_token:
            relayed = self._on_progress(params)
            if relayed is not None:
                await self._to_client(relayed)
        elif method == "notifications/message":
            if self.relay_logs and self.task_id is None:
                await self._to_client(msg)
        elif method == "notifications/cancelled":
            self._on_upstream_cancelled(params.get("requestId"))
        elif method in LIST_CHANGED_NOTIFICATIONS and self.on_server_notification is not None:
            self.on_server_notification(msg)

    async def _to_client(self, notification: JsonObject) -> None:
        """Relay a notification to the attached client: written at once by the handler's `relay`
        when nothing is queued before it (no hand-over to the handler's task), else queued."""
        if self.relay is not None and self.events.empty() and await self.relay(notification):
            return
        self.events.put_nowait(("notification", notification))

    def _on_progress(self, params: JsonObject) -> JsonObject | None:
        """Handle the upstream's progress on this call's token; returns the notification the
        attached client gets, if any (a detached call's goes to the task's store and v1 client)."""
        if self.task_id is not None:
            progress, total, message = params.get("progress"), params.get("total"), params.get("message")
            text = (
                f"{progress:g}/{total:g}"
                if isinstance(progress, (int, float)) and isinstance(total, (int, float))
                else f"{progress}"
            )
            if message:
                text = f"{text}: {message}"
            self._progress_text = text
            # At most one store write per progress_write_s: a chatty upstream must not flood the
            # store (each write is an fsync'd transaction); the latest text always lands.
            wait = self.progress_write_s - (time.monotonic() - self._progress_written)
            if wait <= 0:
                self._write_progress()
            elif self._progress_timer is None:
                self._progress_timer = asyncio.get_running_loop().call_later(wait, self._write_progress)
            if self.on_task_message is not None and self.client_progress_token is not None:
                relayed = dict(params, progressToken=self.client_progress_token)
                self.on_task_message(self.task_id, jsonrpc.notification("notifications/progress", relayed))
        elif self.client_progress_token is not None:
            relayed = dict(params, progressToken=self.client_progress_token)
            return jsonrpc.notification("notifications/progress", relayed)
        return None

    def _write_progress(self) -> None:
        self._progress_timer = None
        self._progress_written = time.monotonic()
        if self.task_id is None or self.done or self.sink is None:
            return
        self._spawn(self._report_progress(self.task_id, self.sink, self._progress_text or ""))

    async def _report_progress(self, task_id: str, sink: TaskSink, text: str) -> None:
        if not await sink.progress(task_id, text):
            # Ended from outside this call (an operator's cancel, another node): stop the upstream work too.
            self.cancel("the task ended outside this call")

    def _on_input_request(self, msg: JsonObject) -> None:
        capability = INPUT_CAPABILITY[msg["method"]]
        if capability not in self.capabilities:
            # The client of this call never declared it can answer this kind of question.
            self._spawn(
                self._respond(
                    msg["id"],
                    error={
                        "code": jsonrpc.INVALID_REQUEST,
                        "message": f"the client did not declare the {capability} capability",
                    },
                )
            )
            if self.task_id is None:
                self.events.put_nowait(("unsupported", capability))
            return
        key = self._key_for(msg)
        if key in self.prefilled:
            self._spawn(self._respond(msg["id"], result=self.prefilled.pop(key)))
            return
        self.pending[key] = PendingInput(upstream_id=msg["id"], request=input_request_value(msg))
        self._input_timers[key] = asyncio.get_running_loop().call_later(
            self.input_timeout, self.fail_input_timeout, self.input_timeout
        )
        if self.task_id is not None:
            self._write_inputs()
        else:
            self.events.put_nowait(("input", key))

    def _key_for(self, msg: JsonObject) -> str:
        """A key unique for the call's whole life: the upstream's hint (`_meta["mcp-tasks-proxy/inputKey"]`)
        if unused, else random."""
        params = object_of(msg.get("params"))
        meta = object_of(params.get("_meta"))
        hint = meta.get(INPUT_KEY_HINT)
        if isinstance(hint, str) and 0 < len(hint) <= 64 and hint not in self._used_keys:
            key = hint
        else:
            key = "in_" + secrets.token_urlsafe(9)
        self._used_keys = {*self._used_keys, key}  # input keys are few: a new set each time is fine
        return key

    def _on_upstream_cancelled(self, request_id: Any) -> None:
        for key, pending in list(self.pending.items()):
            if pending.upstream_id == request_id:
                del self.pending[key]
                self._cancel_timer(key)
                if self.task_id is not None:
                    self._write_inputs()

    def input_requests(self) -> dict[str, JsonObject]:
        """The outstanding upstream questions as a 2026 `inputRequests` map."""
        return {key: pending.request for key, pending in self.pending.items()}

    @property
    def upstream_ref(self) -> JsonObject | None:
        """Where the upstream request went, for another process to cancel it once this one is gone:
        `{"session", "requestId", "protocolVersion", "origin"}` of a request sent on an HTTP upstream
        session (`origin`: `upstream.types.url_origin` of its URL);
        None before it was sent, and for a stdio child (it dies with this process)."""
        session = self.session
        if session is None or session.session_id is None or self.upstream_request_id is None or not self.sent:
            return None
        return {
            "session": session.session_id,
            "requestId": self.upstream_request_id,
            "protocolVersion": session.protocol_version,
            "origin": session.origin,
        }

    def _write_inputs(self) -> None:
        assert self.task_id is not None
        if self.sink is not None:
            self._spawn(self.sink.set_inputs(self.task_id, self.input_requests()))

    # -- actions from the proxy ------------------------------------------------------------

    def detach(self, task_id: str, sink: TaskSink, *, progress_interval_s: float) -> None:
        """Hand the call over to the task `task_id` (already committed), reporting through `sink`.

        Progress text is written to the store at most once per `progress_interval_s` (s, the
        tool's `progress_interval`), off the request path; the task's create counts as this
        interval's write, so the first text lands one interval after the detach (not with the
        creates of the calls detaching beside it); the latest text always lands, with the outcome
        at the latest. No handler may be waiting on `events` any more (the handler detaches
        the call itself, or was cancelled): its events are dropped from here on (and its `relay`
        is cleared as the handler ends)."""
        self.task_id = task_id
        self.sink = sink
        self.progress_write_s = progress_interval_s
        self._progress_written = time.monotonic()
        self.events = _DISCARD  # nobody is attached any more: keep no queue per detached call
        if self.done:  # it ended while the task was being committed
            self._record_outcome(self.outcome.result())
        elif self.pending:
            self._write_inputs()

    def wake(self, token: object) -> None:
        """Queue `("timeout", token)` for the handler following this call (a `Drain.timer`'s fire):
        its wait for the next event ends there, after what was queued before."""
        self.events.put_nowait(("timeout", token))

    def answer(self, responses: JsonObject) -> list[str]:
        """Deliver input responses by key; unknown or already-answered keys are ignored.

        The JSON-RPC responses go upstream in the background under the upstream's own request ids.
        Returns the keys used; for a detached call the task service then records what is left.
        """
        used = []
        for key, value in responses.items():
            pending = self.pending.pop(key, None)
            if pending is None:
                continue
            self._cancel_timer(key)
            metrics.INPUT_WAIT.observe(time.monotonic() - pending.asked)
            used.append(key)
            if isinstance(value, InputError):
                self._spawn(self._respond(pending.upstream_id, error=dict(value)))
            elif isinstance(value, dict):
                self._spawn(self._respond(pending.upstream_id, result=value))
            else:
                self._spawn(
                    self._respond(
                        pending.upstream_id,
                        error={
                            "code": jsonrpc.INVALID_PARAMS,
                            "message": "the client sent a malformed input response",
                        },
                    )
                )
        return used

    def _cancel_timer(self, key: str) -> None:
        timer = self._input_timers.pop(key, None)
        if timer is not None:
            timer.cancel()

    def resume(self, client_progress_token: str | int | None) -> None:
        """A client picks the call up again (MRTR retry): drop what was queued for the old request."""
        self.client_progress_token = client_progress_token
        while not self.events.empty():
            self.events.get_nowait()

    def fail_input_timeout(self, timeout_s: float) -> None:
        """No answer arrived in time: release the upstream's questions, end the call (and its task) failed."""
        if self.done:
            return
        message = f"input timed out: the client did not answer within {timeout_s:g} s"
        self.ended_by = "input_timeout"
        self._finish({"error": {"code": INTERNAL_ERROR, "message": message}})
        self._release(message, {"code": INTERNAL_ERROR, "message": message})

    def cancel(self, reason: str) -> None:
        """Abandon the call: release pending input requests, tell the upstream, stop reading. An
        outcome not known yet becomes -32800 naming `reason`. Once only: a second cancel (a client
        leaving as the fence stops its call) changes nothing and sends nothing."""
        if self._cancel_reason:
            return
        self._cancel_reason = reason
        self._release(reason, {"code": REQUEST_CANCELLED, "message": f"cancelled: {reason}"})

    def abandon(self, drain: Drain) -> jsonrpc.JsonRpcError:
        """Give the call up as the shutdown drain ends (`drain_timeout` passed, or a second signal):
        cancelled upstream, logged (`call_abandoned`); returns the -32603 its client gets, which is
        also the call's outcome (its task's, its idempotency key's) unless its answer came first."""
        error = jsonrpc.JsonRpcError(INTERNAL_ERROR, drain.abandoned)
        self.shut_down({"error": error.to_error()})
        log.warning("call_abandoned", server=self.server, tool=self.tool, reason=drain.reason)
        return error

    def shut_down(self, outcome: JsonObject) -> None:
        """Stop the call as its proxy shuts down: cancelled upstream as `cancel` does, with `outcome`
        (a `{"error"}`: the failure its task records, or the drain's) as its own unless its answer
        came first, so that its idempotency key answers a retry as its task does, not with a -32800
        that reads as the client's own cancel. `ended_by` becomes `shutdown`."""
        if not self._cancel_reason and not self.outcome.done():
            self._cancel_outcome = outcome
            self.ended_by = "shutdown"
        self.cancel("the proxy is shutting down")

    def _release(self, reason: str, error: JsonObject) -> None:
        """Answer the pending questions with `error` first; cancel the request only if it still runs
        CANCEL_GRACE_S (s) later. Never both at once: a refused question usually ends the request,
        and a cancel racing that end crashes fragile SDKs (`mcp` 1.26 loses the session, python-sdk#2416)."""
        questions = [pending.upstream_id for pending in self.pending.values()]
        for key in list(self.pending):
            self._cancel_timer(key)
        self.pending.clear()
        self._spawn(self._release_then_cancel(questions, reason, error))

    async def _release_then_cancel(self, questions: list[RequestId], reason: str, error: JsonObject) -> None:
        runner = self._runner
        for upstream_id in questions:
            await self._respond(upstream_id, error=error)
        if (
            runner is None
            or runner.done()
            or (questions and (await asyncio.wait({runner}, timeout=CANCEL_GRACE_S))[0])
        ):
            return  # ended (by itself): a cancel now would name a request already answered
        await self._send_cancelled(reason)
        runner.cancel()

    def _mark_sent(self) -> None:
        self.sent = True
        if self.task_id is not None and self.sink is not None and (ref := self.upstream_ref) is not None:
            self._spawn(self.sink.sent_upstream(self.task_id, ref))  # (it left after its task was made)

    async def _send_cancelled(self, reason: str) -> None:
        """`notifications/cancelled` for the upstream request, only if it was actually sent: a call
        still queued for a stdio slot never reached the child, and the child must not hear of it."""
        if self.session is None or self.upstream_request_id is None or not self.sent:
            return
        try:
            await self.session.notify(
                "notifications/cancelled", {"requestId": self.upstream_request_id, "reason": reason}
            )
        except UpstreamError as exc:
            log.info("upstream_cancel_not_delivered", server=self.server, reason=str(exc))

    async def _respond(
        self, request_id: RequestId, *, result: JsonObject | None = None, error: JsonObject | None = None
    ) -> None:
        if self.session is None:
            return
        try:
            await self.session.respond(request_id, result=result, error=error)
        except UpstreamError as exc:
            log.info("upstream_answer_not_delivered", server=self.server, reason=str(exc))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        _BACKGROUND.add(task)  # one set for all calls (held until done), not one per call
        task.add_done_callback(_BACKGROUND.discard)
