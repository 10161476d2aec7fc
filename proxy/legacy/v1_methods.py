"""The proxy's own `tasks/get`, `tasks/result`, `tasks/list` and `tasks/cancel` for v1 clients
(2025-11-25 `basic/utilities/tasks`, protocol.md §1.4), over HTTP and stdio upstreams alike.

Tasks belong to the principal and server, never to the session: a client that re-initializes
reaches them. `tasks/result` blocks until the task is terminal (waits on the store's change
signal, each wait bounded by the keep-alive interval, SSE comments in between); meanwhile it
carries the upstream's questions (elicitation, sampling, roots) as requests with proxy-minted ids
and the related-task `_meta`, the client's `notifications/progress` and
`notifications/tasks/status`. The client's answer to a question (a JSON-RPC response POSTed under
the proxy id) reaches the upstream under the upstream's own id.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import secrets
from collections.abc import Iterator
from typing import Any

import aiohttp
from aiohttp import web

from proxy.protocol import jsonrpc
from proxy.protocol.inputs import InputError
from proxy.protocol.jsonrpc import INTERNAL_ERROR, INVALID_PARAMS, JsonObject, JsonRpcError, RequestId
from proxy.protocol.sse import KEEPALIVE, SSE_HEADERS, encode_message
from proxy.runtime.fanout import Subscription
from proxy.tasks.model import TaskRecord, TaskStatus
from proxy.tasks.service import TaskService
from proxy.tasks.store import ListFilter, StoreUnavailableError
from proxy.tasks.types import TaskChange, TaskEvent, TaskMessage, about
from proxy.tasks.wire_v1 import (
    question_request,
    status_notification,
    task_outcome_v1,
    v1_status,
    v1_task,
    with_related_task,
)

LIST_PAGE = 50  # tasks per tasks/list page
V1_TASK_METHODS = frozenset({"tasks/get", "tasks/result", "tasks/list", "tasks/cancel"})


def _store_error(exc: StoreUnavailableError, where: str) -> JsonRpcError:
    return JsonRpcError(INTERNAL_ERROR, str(exc), {"store": where}, status=503)


class _Sse:
    """A lazily started SSE response for one `tasks/result` request; none for a client whose
    `Accept` does not name `text/event-stream` (`json_only`: what would go on it is dropped, and
    the answer comes as one JSON body)."""

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.stream: web.StreamResponse | None = None
        self.announced: str | None = None  # the last status sent in notifications/tasks/status
        self.json_only = "text/event-stream" not in request.headers.get("Accept", "")

    async def write(self, data: bytes) -> None:
        if self.json_only:
            return
        if self.stream is None:
            self.stream = web.StreamResponse(headers=SSE_HEADERS)
            await self.stream.prepare(self.request)
        await self.stream.write(data)


class V1TaskMethods:
    """v1 `tasks/*` for one server (`server`) over the shared TaskService.

    `keepalive_s` (s) bounds each wait of a blocking `tasks/result` (an SSE comment follows a
    quiet one). `questions` maps the proxy ids of relayed upstream questions to `(task id, input
    key, principal)` until they are answered or their stream ends.
    """

    def __init__(self, tasks: TaskService, server: str, *, keepalive_s: float = 15.0) -> None:
        self.tasks = tasks
        self.server = server
        self.keepalive_s = keepalive_s
        self.questions: dict[RequestId, tuple[str, str, str]] = {}
        # (task id, input key) → (the proxy id it was last asked under, whether on a tasks/result stream)
        self._offered: dict[tuple[str, str], tuple[RequestId, bool]] = {}
        self._watched: collections.Counter[str] = collections.Counter()  # task id → open tasks/result streams

    @contextlib.contextmanager
    def watching(self, task_id: str) -> Iterator[None]:
        """Count a `tasks/result` stream that carries `task_id`'s messages while the block runs."""
        self._watched[task_id] += 1
        try:
            yield
        finally:
            self._watched[task_id] -= 1
            if self._watched[task_id] <= 0:
                del self._watched[task_id]

    def ask(
        self, record: TaskRecord, principal: str, *, on_result: bool
    ) -> list[tuple[RequestId, JsonObject]]:
        """`(proxy id, JSON-RPC request)` of each of `record`'s questions that no open stream carries
        yet, now awaiting its answer under that proxy id: each question goes out once, except that a
        `tasks/result` stream (`on_result`, where v1 puts questions) also asks what only a GET
        stream carried (its reader may be gone unnoticed; the first answer wins). The stream that
        sends them `withdraw`s them when it ends, so a later stream asks again what is unanswered."""
        asked: list[tuple[RequestId, JsonObject]] = []
        for key, question in record.input_requests.items():
            offered = self._offered.get((record.task_id, key))
            if offered is not None and (offered[1] or not on_result):
                continue
            proxy_id = "mtp-" + secrets.token_urlsafe(9)
            self.questions[proxy_id] = (record.task_id, key, principal)
            self._offered[(record.task_id, key)] = (proxy_id, on_result)
            asked.append((proxy_id, question_request(proxy_id, key, question, record.task_id)))
        return asked

    def release(self, proxy_ids: list[RequestId]) -> None:
        """Let other streams ask again the questions `ask` handed out under `proxy_ids` (their stream
        lost its reader): each stays answerable under its old id too, and the first answer wins."""
        for proxy_id in proxy_ids:
            target = self.questions.get(proxy_id)
            if target is not None and self._offered.get((target[0], target[1]), (None,))[0] == proxy_id:
                del self._offered[(target[0], target[1])]

    def withdraw(self, proxy_ids: list[RequestId]) -> None:
        """Forget questions `ask` handed out whose stream ended (answered ones are gone already)."""
        for proxy_id in proxy_ids:
            target = self.questions.pop(proxy_id, None)
            if target is not None and self._offered.get((target[0], target[1]), (None,))[0] == proxy_id:
                del self._offered[(target[0], target[1])]

    def watched(self, task_id: str) -> bool:
        """True while a `tasks/result` stream carries `task_id`'s progress (the session's GET stream
        then leaves it out)."""
        return task_id in self._watched

    async def _lookup(self, params: JsonObject, principal: str) -> TaskRecord:
        await self.tasks.check_rate(principal)
        return await self.tasks.lookup(params.get("taskId"), principal=principal, server=self.server)

    async def get(self, params: JsonObject, principal: str) -> JsonObject:
        """`tasks/get` → the v1 Task (flat in the result).

        Raises JsonRpcError: -32602 for a missing, unknown, expired or foreign id; a limit error for
        `tasks_rate` (HTTP 429); -32603 (HTTP 503) when the store cannot be read.
        """
        return v1_task(await self._lookup(params, principal))

    async def list_tasks(self, params: JsonObject, principal: str, origin: str | None = None) -> JsonObject:
        """`tasks/list` → `{tasks: [Task…], nextCursor?}`: the caller's own tasks on this server,
        newest first, LIST_PAGE per page (with `origin`, only those its session created: a page
        may then hold fewer, its cursor still going on). Raises JsonRpcError -32602 for a cursor
        the proxy did not hand out, -32603 (HTTP 503) when the store cannot be read."""
        await self.tasks.check_rate(principal)
        cursor = params.get("cursor")
        if cursor is not None and not isinstance(cursor, str):
            raise JsonRpcError(INVALID_PARAMS, "params.cursor must be a string")
        try:
            records, next_cursor = await self.tasks.store.list_tasks(
                ListFilter(principal=principal, server=self.server), cursor=cursor, limit=LIST_PAGE
            )
        except ValueError:
            raise JsonRpcError(INVALID_PARAMS, "invalid cursor") from None
        except StoreUnavailableError as exc:
            raise _store_error(exc, self.tasks.store.where) from None
        shown = [record for record in records if origin is None or record.origin == origin]
        out: JsonObject = {"tasks": [v1_task(record) for record in shown]}
        if next_cursor:
            out["nextCursor"] = next_cursor
        return out

    async def cancel(self, params: JsonObject, principal: str) -> JsonObject:
        """`tasks/cancel` → the Task after cancellation (`cancelled` before this returns; sticky);
        the upstream gets `notifications/cancelled`.

        Raises JsonRpcError: -32602 for an unknown id or a task already terminal (v1 MUST), -32603
        (HTTP 503) naming the store when it cannot write.
        """
        record = await self._lookup(params, principal)
        if record.status.terminal:
            raise JsonRpcError(
                INVALID_PARAMS,
                f"task {record.task_id} is already {v1_status(record)}; it cannot be cancelled",
            )
        try:
            record = await self.tasks.cancel(record, by="client")
        except StoreUnavailableError as exc:
            raise _store_error(exc, self.tasks.store.where) from None
        if record.status is not TaskStatus.CANCELLED:  # the work won the race
            raise JsonRpcError(
                INVALID_PARAMS,
                f"task {record.task_id} is already {v1_status(record)}; it cannot be cancelled",
            )
        return v1_task(record)

    async def answer(self, body: JsonObject, principal: str) -> bool:
        """Deliver a client's JSON-RPC response to a relayed question (False: not one of ours).

        A result reaches the upstream as the response to its own request id; a JSON-RPC error goes
        upstream as that error; anything else as -32602 ("malformed input response")."""
        target = self.questions.get(body.get("id"))  # type: ignore[arg-type]
        if target is None or target[2] != principal:
            return False
        task_id, key, _ = target
        self.questions.pop(body["id"], None)
        self._offered.pop((task_id, key), None)
        try:
            record = await self.tasks.lookup(task_id, principal=principal, server=self.server)
        except JsonRpcError:
            return True  # the task is gone: nothing left to answer
        error = body.get("error")
        value = (
            body["result"]
            if isinstance(body.get("result"), dict)
            else InputError(error)
            if isinstance(error, dict)
            else None
        )
        await self.tasks.answer(record, {key: value})
        return True

    async def result(
        self, request: web.Request, request_id: RequestId, params: JsonObject, principal: str
    ) -> web.StreamResponse:
        """`tasks/result`: block until the task is terminal, then answer exactly the upstream's
        CallToolResult (with the related-task `_meta`) or its JSON-RPC error. Meanwhile an SSE
        stream carries the task's status, progress and questions, unless the client's `Accept`
        does not name `text/event-stream`: then it waits and gets one JSON body.

        Raises JsonRpcError before anything is streamed: -32602 for an unknown id, a limit error,
        -32603 (HTTP 503) for the store. A client that closes the stream only stops waiting.
        """
        record = await self._lookup(params, principal)
        task_id = record.task_id
        sse = _Sse(request)
        minted: list[RequestId] = []
        final: JsonObject | None = None
        waited = False
        try:
            with (
                self.tasks.changes.subscribe(about(principal, self.server, {task_id})) as sub,
                self.watching(task_id),
            ):
                while not record.status.terminal:
                    # (a JSON-only client cannot be asked here: its questions wait for its GET stream)
                    for proxy_id, question in (
                        [] if sse.json_only else self.ask(record, principal, on_result=True)
                    ):
                        minted.append(proxy_id)
                        await sse.write(encode_message(question))
                    record = await self._wait(sse, sub, record)
                    waited = True
                await self._relay(sse, sub, [], record.task_id)  # what was pushed while the last read ran
                if waited and sse.announced != record.status.value:
                    # The read can see the terminal record before the store's listeners ran: announce it here.
                    await sse.write(encode_message(status_notification(record)))
        except JsonRpcError as exc:  # the task expired or the store failed while we waited
            if sse.stream is None:
                raise
            final = jsonrpc.error_response(request_id, exc.to_error())
        except (ConnectionResetError, aiohttp.ClientConnectionError):
            return sse.stream or web.Response(status=499)  # the client went away; the task goes on
        finally:
            self.withdraw(minted)
        if final is None:
            result, error = task_outcome_v1(record)
            final = (
                jsonrpc.response(request_id, result)
                if result is not None
                else jsonrpc.error_response(request_id, error or {})
            )
        if sse.stream is None:
            return web.json_response(final)
        try:
            await sse.stream.write(encode_message(final))
            await sse.stream.write_eof()
        except (ConnectionResetError, aiohttp.ClientConnectionError):
            pass
        return sse.stream

    async def _wait(self, sse: _Sse, sub: Subscription[TaskEvent], record: TaskRecord) -> TaskRecord:
        """One bounded wait (≤ keepalive_s): relay what was pushed, then the record as it is now."""
        changed = asyncio.ensure_future(
            self.tasks.store.wait_for_change(record.task_id, record.version, self.keepalive_s)
        )
        pushed = asyncio.ensure_future(sub.get())
        try:
            done, _ = await asyncio.wait(
                {changed, pushed}, timeout=self.keepalive_s + 1.0, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            for fut in (changed, pushed):
                if not fut.done():
                    fut.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await fut
        items = await self._relay(
            sse, sub, [pushed.result()] if pushed in done and not pushed.cancelled() else [], record.task_id
        )
        now = (
            changed.result()
            if changed in done and not changed.cancelled() and changed.exception() is None
            else record
        )
        moved = now is None or now.version != record.version
        if not items and not moved:
            await sse.write(KEEPALIVE)
        return await self.tasks.lookup(record.task_id, principal=record.principal, server=self.server)

    async def _relay(
        self, sse: _Sse, sub: Subscription[TaskEvent], items: list[Any], task_id: str
    ) -> list[Any]:
        """Send `items` and whatever else the subscription queued: progress (with the related-task
        `_meta`) and `notifications/tasks/status` for status changes (after an overflow, the status
        comes from the record the caller reads next). Returns what it took from the queue."""
        while not sub.empty():
            items.append(sub.get_nowait())
        for item in items:
            if isinstance(item, TaskMessage):
                await sse.write(encode_message(with_related_task(item.message, task_id)))
            elif isinstance(item, TaskChange):
                new = item.record
                if item.before is not new.status and sse.announced != new.status.value:
                    await sse.write(encode_message(status_notification(new)))
                    sse.announced = new.status.value
        return items
