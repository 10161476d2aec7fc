"""Idempotency keys and duplicate joining: a retried `tools/call` joins the call it repeats instead
of running a second time (README "Retries and idempotency keys").

A call names itself with a key: the HTTP header `Idempotency-Key` (the IETF httpapi draft's name)
or `params._meta["mcp-tasks-proxy/idempotencyKey"]` (`_meta` wins). A tool configured with
`dedupe` names each call by its canonical arguments instead. Before the call starts it claims a
slot in the task store (one atomic write-if-absent, so two replicas claiming at once start one
call), holding the canonical digest of the call, the task id minted for it and the replica that
runs it. A second call that finds the slot taken:

- with the same tool and arguments joins the first: the stored outcome once it ended; while it
  runs as a task, the same task (a task-capable request gets its handle, any other request waits
  for its outcome); while it still runs attached to its first request, it waits until one of those;
- with another tool or other arguments is refused (-32602, HTTP 422) and never runs.

A slot is scoped to its principal and server; it holds for the call's `timeout` plus the
`idempotency_window` (or the `dedupe` window) and, once the call ended, for the window from then.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
from collections.abc import Coroutine
from typing import Any

import structlog

from proxy.calls.mrtr import request_digest
from proxy.calls.types import KeyedCall, Reply
from proxy.config import ResolvedPolicy
from proxy.protocol.jsonrpc import INTERNAL_ERROR, INVALID_PARAMS, JsonObject, JsonRpcError, object_of
from proxy.protocol.translate import outcome_answer
from proxy.runtime import metrics
from proxy.tasks.model import TaskRecord, new_task_id, principal_hash, proxy_error
from proxy.tasks.service import TaskService
from proxy.tasks.store import StoreUnavailableError, TaskStore
from proxy.tasks.wire_v1 import create_task_result_v1
from proxy.tasks.wire_v2 import create_task_result

log = structlog.get_logger("proxy.calls")

KEY_HEADER = "Idempotency-Key"
KEY_META = "mcp-tasks-proxy/idempotencyKey"
KEY_MAX_CHARS = 255
JOIN_POLL_S = 0.05  # how often (s) a joiner looks again while the first call runs attached
LEASE_CHECK_S = 1.0  # how often (s) it asks whether the replica running that call still lives
JOINS_PREFIX = "call-joins:"  # the store key of how many requests joined a task's call


def call_key(headers: Any, params: JsonObject) -> str | None:
    """The client's idempotency key for a call, or None: `params._meta[KEY_META]` (a JSON null
    there counts as absent), else the `Idempotency-Key` header (`headers`: a case-insensitive
    multi-dict, or a mapping), with surrounding whitespace dropped either way (HTTP drops it from
    a header). Raises JsonRpcError -32602 (HTTP 400) for a key that is not a string of 1 to
    KEY_MAX_CHARS printable characters, or for two `Idempotency-Key` headers."""
    meta = object_of(params.get("_meta"))
    key = meta.get(KEY_META)
    if key is None:
        given = headers.getall(KEY_HEADER, []) if hasattr(headers, "getall") else [headers.get(KEY_HEADER)]
        given = [value for value in given if value is not None]
        if len(given) > 1:
            raise JsonRpcError(INVALID_PARAMS, f"send one {KEY_HEADER} header, not {len(given)}")
        key = given[0] if given else None
    if key is None:
        return None
    if isinstance(key, str):
        key = key.strip()
    if not isinstance(key, str) or not 0 < len(key) <= KEY_MAX_CHARS or not key.isprintable():
        raise JsonRpcError(
            INVALID_PARAMS,
            f"an idempotency key must be a string of 1 to {KEY_MAX_CHARS} printable characters",
        )
    return key


def canonical_arguments(arguments: Any) -> Any:
    """A call's `arguments` in the form two equal calls share: none is `{}`, and a float with an
    integral value is that integer at any depth (JSON does not tell 1 from 1.0)."""
    return {} if arguments is None else _canonical(arguments)


def _canonical(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {k: _canonical(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_canonical(v) for v in value]
    return value


def _slot(kind: str, *parts: str) -> str:
    joined = "\0".join(parts).encode("utf-8", "surrogatepass")
    return f"{kind}:{hashlib.sha256(joined).hexdigest()}"


class SlotLetGoError(JsonRpcError):
    """The call a key's slot named let it go while a retry waited on it (it never reached the
    upstream): -32603, HTTP 503, "send it again". `quiet`: nothing was sent to the waiting client
    yet (no keep-alive), so the retry may still run the call itself."""

    def __init__(self, *, quiet: bool) -> None:
        super().__init__(
            INTERNAL_ERROR, "the call this key named never reached the upstream; send it again", status=503
        )
        self.quiet = quiet


class CallKeys:
    """The key slots of one task service's store (`tasks`), and the joining of calls that find
    their slot taken."""

    def __init__(self, tasks: TaskService) -> None:
        self.tasks = tasks
        self._background: set[asyncio.Task[None]] = set()  # slot writes no request waits for
        self._ending: dict[str, asyncio.Task[None]] = {}  # slot -> the write of its ended call's outcome

    async def claim(
        self,
        *,
        principal: str,
        server: str,
        tool: str,
        arguments: Any,
        key: str | None,
        policy: ResolvedPolicy,
    ) -> tuple[KeyedCall | None, JsonObject | None]:
        """Claim the slot of a call about to start: `key` the client's key, else the call's digest
        when the tool has `dedupe` (a task id is minted for the call). Returns (None, None) for a
        call that names no slot, (keyed, None) when this call holds the slot now, or (keyed, entry)
        with the first call's entry when the slot was taken (`keyed` then says where it is).
        Raises JsonRpcError -32603 (HTTP 503) when the store cannot be written: nothing ran."""
        digest = request_digest("tools/call", tool, canonical_arguments(arguments))
        if key is not None:
            slot, window_s = _slot("call-key", principal, server, key), policy.idempotency_window
        elif policy.dedupe_window is not None:
            slot, window_s = _slot("call-dedupe", principal, server, digest), policy.dedupe_window
        else:
            return None, None
        hold_s = policy.timeout + window_s  # it may run for `timeout`, then the window
        keyed = KeyedCall(slot, new_task_id(), digest, self.tasks.node, window_s, hold_s)
        attempt = asyncio.ensure_future(self._claim(keyed))
        try:
            return keyed, await asyncio.shield(attempt)
        except asyncio.CancelledError:  # the client left: a slot won for a call that never starts goes
            attempt.add_done_callback(lambda done: self._let_go_if_won(done, keyed))
            raise

    async def claim_or_join(
        self,
        *,
        principal: str,
        server: str,
        tool: str,
        arguments: Any,
        key: str | None,
        policy: ResolvedPolicy,
        as_task: bool,
        reply: Reply | None,
        keepalive_s: float,
        dialect: str = "v2",
    ) -> tuple[KeyedCall | None, JsonObject | None]:
        """`claim`, then `join` when the slot was taken. Returns (keyed, None) for a call to run
        (`keyed` None when it names no slot), or (keyed, answer) for a call the first one answers.
        A first call that lets the slot go while this one waits, before anything was sent to this
        one's client, is claimed again (once): this call then runs it. Raises what `claim` and
        `join` raise."""
        claim = functools.partial(
            self.claim,
            principal=principal,
            server=server,
            tool=tool,
            arguments=arguments,
            key=key,
            policy=policy,
        )
        claimed_again = False
        keyed, first = await claim()
        while keyed is not None and first is not None:
            try:
                answer = await self.join(
                    first,
                    keyed,
                    principal=principal,
                    server=server,
                    tool=tool,
                    as_task=as_task,
                    policy=policy,
                    reply=reply,
                    keepalive_s=keepalive_s,
                    dialect=dialect,
                )
            except SlotLetGoError as exc:
                if claimed_again or not exc.quiet:
                    raise
                claimed_again = True
                keyed, first = await claim()
                continue
            return keyed, answer
        return keyed, None

    async def _claim(self, keyed: KeyedCall) -> JsonObject | None:
        """The write-if-absent of `keyed`'s slot: None when won, else the entry that holds it."""
        store = self.tasks.store
        try:
            for _ in range(2):  # an entry that expires between the two steps is claimed anew
                if await store.put_blob(keyed.slot, keyed.entry(), int(keyed.hold_s * 1000), only_new=True):
                    return None
                taken = await store.get_blob(keyed.slot)
                if taken is not None:
                    return dict(json.loads(taken))
        except StoreUnavailableError as exc:
            self.tasks.store_failed(exc)
            raise _store_down(exc) from None
        raise _store_down(StoreUnavailableError("the key's slot kept changing"))

    def _let_go_if_won(self, attempt: asyncio.Future[JsonObject | None], keyed: KeyedCall) -> None:
        if not attempt.cancelled() and attempt.exception() is None and attempt.result() is None:
            self._spawn(self.release(keyed))

    def settle_when_done(self, call: Any, keyed: KeyedCall) -> None:
        """Keep `call`'s outcome in `keyed`'s slot whenever it ends (`call`: a calls.call.Call), so
        the slot outlives its task's record and a call ended by a timeout is not left waiting; a
        call the fence stopped is left to whoever re-runs its task, and one that never reached
        the upstream lets the slot go."""

        def ended(done: Any) -> None:
            if done.ended_by == "fence":
                return
            write = self.settle(keyed, done.outcome.result()) if done.sent else self.release(keyed)
            self._ending[keyed.slot] = self._spawn(write)

        call.add_done_callback(ended)

    async def kept(self, keyed: KeyedCall) -> None:
        """Wait until the write started for the ended call of `keyed` (`settle_when_done`,
        `settle_later` or `release_later`) is over, so an attached answer goes out only once it is
        kept, or once its key is let go (nothing to wait for: at once)."""
        writing = self._ending.get(keyed.slot)
        if writing is not None:
            await asyncio.shield(writing)

    def settle_later(self, keyed: KeyedCall, outcome: JsonObject) -> None:
        """`settle` in the background (a caller that leaves does not stop the write); `kept`
        waits for it."""
        self._ending[keyed.slot] = self._spawn(self.settle(keyed, outcome))

    def release_later(self, keyed: KeyedCall) -> None:
        """`release` in the background (for a caller that cannot wait: a callback); `kept` waits
        for it, so an answer can go out once its key is let go."""
        self._ending[keyed.slot] = self._spawn(self.release(keyed))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._written)
        return task

    def _written(self, task: asyncio.Task[None]) -> None:
        self._background.discard(task)
        for slot in [slot for slot, writing in self._ending.items() if writing is task]:
            del self._ending[slot]
        if not task.cancelled() and (exc := task.exception()) is not None:  # e.g. the store closed at exit
            log.warning("call_key_not_written", reason=f"{exc.__class__.__name__}: {exc}")

    async def settle(self, keyed: KeyedCall, outcome: JsonObject) -> None:
        """The call ended (an attached answer is about to go out): keep its outcome in the slot for
        the window, so a retry after a cut answer gets the same answer; a result larger than the
        store's `max_result_bytes` is kept as the error a task would show. A store that cannot
        take it is logged; the answer still goes out."""
        limit = self.tasks.store.max_result_bytes
        if "result" in outcome:
            size = len(json.dumps(outcome["result"], separators=(",", ":")).encode())
            if size > limit:
                message = f"the result ({size} bytes) exceeds the limit max_result_bytes ({limit} bytes)"
                outcome = proxy_error(message, limit="max_result_bytes")
        store, entry, ttl_ms = self.tasks.store, keyed.entry(outcome), int(keyed.window_s * 1000) or 1
        try:
            await store.put_blob(keyed.slot, entry, ttl_ms)
        except StoreUnavailableError as exc:
            self.tasks.store_failed(exc)
            log.warning("call_key_not_settled", task_id=keyed.task_id, reason=str(exc))
            # kept as soon as the store takes writes: a retry waiting on the slot gets it then
            self.tasks.write_later(
                lambda: store.put_blob(keyed.slot, entry, ttl_ms),
                f"key of {keyed.task_id}",
                for_s=keyed.window_s,
            )

    async def _count_join(self, task_id: str, hold_s: float) -> None:
        """One more request joined `task_id`'s call (shown by the console). A read, then a write:
        two joins at the same instant may count as one; a store that cannot be reached skips it."""
        store = self.tasks.store
        try:
            joined = await joined_requests(store, task_id)
            await store.put_blob(JOINS_PREFIX + task_id, str(joined + 1).encode(), int(hold_s * 1000))
        except StoreUnavailableError as exc:
            log.warning("call_join_not_counted", task_id=task_id, reason=str(exc))

    async def keep_round(self, keyed: KeyedCall, answer: JsonObject | None) -> None:
        """The call waits in an MRTR round: keep its InputRequiredResult `answer` in the slot, so a
        retry that lost it gets it again (same `requestState`, still single-use); None once the
        round was answered. A store that cannot take it is logged."""
        try:
            await self.tasks.store.put_blob(keyed.slot, keyed.entry(round_=answer), int(keyed.hold_s * 1000))
        except StoreUnavailableError as exc:
            self.tasks.store_failed(exc)
            log.warning("call_key_round_not_kept", task_id=keyed.task_id, reason=str(exc))

    async def release(self, keyed: KeyedCall) -> None:
        """Let the slot go (the call it held never reached the upstream): a retry with its key runs
        the call, and a retry that was waiting on it is told to send it again."""
        store = self.tasks.store
        try:
            await store.delete_blob(keyed.slot)  # (a retry's claim takes it right after)
        except StoreUnavailableError as exc:
            self.tasks.store_failed(exc)
            log.warning("call_key_not_released", task_id=keyed.task_id, reason=str(exc))
            # (bounded by the claim's own hold: past it the slot lapsed, and may be someone else's)
            self.tasks.write_later(
                lambda: store.delete_blob(keyed.slot), f"key of {keyed.task_id}", for_s=keyed.hold_s
            )

    async def join(
        self,
        entry: JsonObject,
        keyed: KeyedCall,
        *,
        principal: str,
        server: str,
        tool: str,
        as_task: bool,
        policy: ResolvedPolicy,
        reply: Reply | None,
        keepalive_s: float,
        dialect: str = "v2",
    ) -> JsonObject:
        """Answer a call whose slot the call in `entry` holds; `keyed` is this call's own claim.

        Returns the first call's result, or its task's CreateTaskResult (`as_task`), in `dialect`'s
        shape: `v2` (2026-07-28: the flat CreateTaskResult, results translated) or `v1` (2025-11-25:
        `{task}`, whatever the task's status, as a task-augmented request is answered; the
        upstream's result as it came only once that task is gone). `reply`, when the answer can
        still be an SSE stream, gets a keep-alive every `keepalive_s` (s) while this waits.

        Raises JsonRpcError: -32602 (HTTP 422) when the entry names another tool or other
        arguments; the first call's own error; -32603 when the process running it was lost before
        it became a task, or when it is not over within `policy.timeout` (s) (plus `detach_after`)."""
        if entry.get("digest") != keyed.digest:
            log.warning("call_key_conflict", server=server, tool=tool, principal=principal_hash(principal))
            raise JsonRpcError(
                INVALID_PARAMS,
                "this idempotency key already names another call (another tool or other arguments); "
                "use a new key for a new call",
                status=422,
            )
        task_id = str(entry.get("taskId"))
        log.info(
            "call_joined", server=server, tool=tool, task_id=task_id, principal=principal_hash(principal)
        )
        metrics.count_call(server, tool, "joined")
        await self._count_join(task_id, keyed.window_s + policy.timeout)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + policy.timeout + policy.detach_after
        next_lease_check = loop.time() + LEASE_CHECK_S
        next_keepalive = loop.time() + keepalive_s
        kept_alive = False  # whether a keep-alive went to the waiting client
        store = self.tasks.store
        # 2025-11-25 tasks: a task-augmented request is answered with its task (CreateTaskResult)
        # whatever the task's status; its result comes from tasks/result
        v1_task = as_task and dialect == "v1"
        try:
            while True:
                if isinstance(entry.get("outcome"), dict) and not v1_task:
                    return _answer(entry["outcome"], dialect)
                if dialect == "v2" and isinstance(entry.get("round"), dict):
                    return dict(entry["round"])  # the MRTR round it waits on, asked again
                record = await store.get(task_id)
                if record is not None and v1_task:
                    return create_task_result_v1(record)
                if record is None and isinstance(entry.get("outcome"), dict):  # (v1: its task is gone)
                    return _answer(entry["outcome"], dialect)
                if record is not None:
                    if record.status.terminal:
                        return _answer(_record_outcome(record), dialect)
                    if as_task:
                        return (
                            create_task_result(record) if dialect == "v2" else create_task_result_v1(record)
                        )
                    await store.wait_for_change(task_id, record.version, min(keepalive_s, 5.0))
                elif loop.time() >= next_lease_check:
                    next_lease_check = loop.time() + LEASE_CHECK_S
                    if not await store.lease_alive(str(entry.get("owner"))):
                        raise JsonRpcError(
                            INTERNAL_ERROR,
                            f"the call this key names was lost with the proxy process running it (node "
                            f"{entry.get('owner')}: it died or restarted) before the call became a task; "
                            "whether it ran is unknown: send it with a new key to run it again",
                        )
                else:
                    await asyncio.sleep(JOIN_POLL_S)
                if loop.time() >= deadline:
                    raise JsonRpcError(
                        INTERNAL_ERROR,
                        f"the call this key names did not end within {policy.timeout:g} s (timeout)",
                    )
                if reply is not None and loop.time() >= next_keepalive:
                    next_keepalive = loop.time() + keepalive_s
                    kept_alive = await reply.keepalive() or kept_alive
                taken = await store.get_blob(keyed.slot)
                if taken is None:  # let go (`release`), or lapsed
                    raise SlotLetGoError(quiet=not kept_alive)
                entry = json.loads(taken)
        except StoreUnavailableError as exc:
            self.tasks.store_failed(exc)
            raise _store_down(exc) from None


async def joined_requests(store: TaskStore, task_id: str) -> int:
    """How many requests joined the call of `task_id` (its key or `dedupe`), as far as counted
    (0 when none, or when the count expired with its slot). Raises StoreUnavailableError."""
    raw = await store.get_blob(JOINS_PREFIX + task_id)
    return int(raw) if raw is not None and raw.isdigit() else 0


def _answer(outcome: JsonObject, dialect: str) -> JsonObject:
    """A stored outcome as the answer to a `tools/call` of `dialect` (`v2` translates it to the
    2026-07-28 shapes; `v1` gives the upstream's as it came). Raises JsonRpcError for an error."""
    if dialect == "v2":
        return outcome_answer("tools/call", outcome)
    if isinstance(outcome.get("result"), dict):
        return dict(outcome["result"])
    error = object_of(outcome.get("error"))
    code = error.get("code")
    raise JsonRpcError(
        code if isinstance(code, int) and not isinstance(code, bool) else INTERNAL_ERROR,
        str(error.get("message", "upstream error")),
        error.get("data"),
    )


def _record_outcome(record: TaskRecord) -> JsonObject:
    """A terminal task's outcome as a JSON-RPC answer (`{"result"}` / `{"error"}`)."""
    if record.outcome is not None:
        return record.outcome
    return {"error": {"code": INTERNAL_ERROR, "message": record.status_message or record.status.value}}


def _store_down(exc: StoreUnavailableError) -> JsonRpcError:
    return JsonRpcError(INTERNAL_ERROR, f"the call's idempotency key could not be checked: {exc}", status=503)
