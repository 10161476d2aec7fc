"""The task lifecycle of one proxy process (node): detach, outcomes, leases, orphans, retention.

It owns the live detached calls of this node and writes what they report (`types.TaskSink`:
`set_inputs`, `progress`, `finish`). Readers go through `lookup`, which also ends orphans it meets.
A background loop renews this node's lease, sweeps for orphans and purges expired records. Every
change the store commits is published on `changes` (a fan-out) for the streams that wait on tasks.
Dialect rendering is not here: callers render records with `wire_v1` / `wire_v2`.

Orphans (design.md "Invariants"): a task that is not terminal and whose owner's lease has lapsed
lost its upstream call with that process. A node that notices (the sweep, or any read) takes it
over: it ends `failed` with an error saying what happened or, for tools configured `on_restart:
rerun`, its ownership moves to this node first (a conditional write, so two nodes never both take
it) and only then is the call sent upstream again. The sweep also stops live calls whose task an
operator ended from outside (the CLI's cancel).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

import structlog
from limits.aio.storage import Storage
from opentelemetry.trace import Span
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_delay, wait_exponential

from proxy.protocol.jsonrpc import INTERNAL_ERROR, INVALID_PARAMS, JsonObject, JsonRpcError, limit_error
from proxy.runtime import metrics, tracing
from proxy.runtime.fanout import Fanout
from proxy.tasks.audit import observe_transition
from proxy.tasks.leases import LeaseJudge, store_instance
from proxy.tasks.model import (
    Change,
    ConflictError,
    TaskRecord,
    TaskStatus,
    TerminalTaskError,
    new_node_id,
    new_task_id,
    now_ms,
    outcome_status,
    principal_hash,
    proxy_error,
    valid_task_id,
)
from proxy.tasks.rates import TaskRate
from proxy.tasks.store import (
    LeaseLapsedError,
    LiveLimitError,
    StoreUnavailableError,
    TaskExistsError,
    TaskNotFoundError,
    TaskStore,
)
from proxy.tasks.types import CancelOrphan, LiveCall, RemoteOwner, Rerun, TaskChange, TaskEvent, TaskMessage

log = structlog.get_logger("proxy.tasks")

SHUTDOWN_MESSAGE = "the proxy shut down while this call was running; the upstream call was abandoned"
RESTART_MESSAGE = (
    "the proxy restarted while this call was running; whether the upstream finished it is unknown (it "
    "may have run on there), and its result cannot reach this task"
)
LOST_MESSAGE = (
    "the proxy replica running this call (node {node}) was lost: it stopped renewing its lease (it "
    "died, or could not reach the store and stopped its calls); whether the upstream finished the call "
    "is unknown (it may have run on there), and its result cannot reach this task"
)
# Of a lease without renewal: stop this node's calls, after one last renewal bounded by LAST_RENEWAL
# of a lease; so they stop by 3/4 of the lease, a quarter before it lapses and another replica takes
# them (the margin Kubernetes' leader election leaves: renewDeadline 10 s of a 15 s lease), room for
# a loaded host's late timers and the upstream's cancel.
ORPHAN_CANCELS_AT_ONCE = 8  # upstream cancels of dead owners' requests in flight at once at most
FENCE_AFTER = 2 / 3
LAST_RENEWAL = 1 / 12
READ_FAILURE_SHOWN_S = 30.0  # how long (s) /readyz reports the store failed after a failed read
_RETRIEVED_MAX = 100_000  # terminal tasks remembered as already retrieved (for the audit line)


class TaskService:
    """Tasks of one node (`node`, a fresh id by default) over a `TaskStore`.

    `lease_s` (s) is how long this node's lease lasts without renewal; it is renewed every sixth
    of it, and the orphan sweep (which also stops calls whose task an operator ended, and purges
    expired records) runs every half of it. `outcome_retry_s` (s) bounds the retries of an outcome
    write the store refused; after that the task reads `working`, its message naming the store, while
    the write goes on being retried in the background. `fence`: the store is shared with other
    replicas, so a node that could not renew its lease for FENCE_AFTER of it stops its detached
    calls that another replica would re-run, before the lease lapses (no call runs on two replicas
    at once); off for a store one process serves. Limits: `max_tasks_per_principal` (live tasks:
    of every replica on a shared store, which checks it as it commits a task; see `detach`)
    and `tasks_rate` (`N/second`-style, per principal, for tasks/* methods), counted in
    `rate_storage` (a `limits.aio` storage; default in memory, Redis for replicas). `rerun` starts
    the call of a task configured `on_restart: rerun` again after its owner died (None: such tasks
    fail instead); `remote` reaches the calls other replicas run (None without replicas).
    """

    def __init__(
        self,
        store: TaskStore,
        *,
        node: str | None = None,
        lease_s: float = 15.0,
        outcome_retry_s: float = 5.0,
        max_tasks_per_principal: int | None = None,
        tasks_rate: str | None = None,
        rate_storage: Storage | None = None,
        rerun: Rerun | None = None,
        cancel_orphan: CancelOrphan | None = None,
        remote: RemoteOwner | None = None,
        fence: bool = False,
    ) -> None:
        self.store = store
        self.node = node or new_node_id()
        self.lease_s = lease_s
        metrics.LEASE_SECONDS.set(lease_s)
        self.outcome_retry_s = outcome_retry_s
        self.max_tasks_per_principal = max_tasks_per_principal
        self.rate = TaskRate(tasks_rate, rate_storage, where=store.where)
        self.rerun = rerun
        self.cancel_orphan = cancel_orphan
        # cancels sent upstream for dead owners' requests at once at most (a sweep may take over many)
        self._orphan_cancel_slots = asyncio.Semaphore(ORPHAN_CANCELS_AT_ONCE)
        self.remote = remote
        self.live: dict[str, LiveCall] = {}
        self.store_problem: str | None = None  # the last store failure, while it lasts
        self._read_failure: tuple[float, str] | None = None  # (time.monotonic(), why) of the last failed read
        # Every change a store commits, this process's and (Redis) every replica's: status push.
        self.changes: Fanout[TaskEvent] = Fanout("task changes")
        self._leases = LeaseJudge(lease_s)  # when this node may judge other nodes' leases
        self._creating: set[str] = set()  # task ids whose create is being committed
        self._fenced_creating: set[str] = set()  # of those, the ones the fence came to meanwhile
        self._unsure: set[str] = set()  # live calls whose create failed but may have committed
        self._cancelling: set[str] = set()  # tasks this node is cancelling right now
        # Live task → its record at detach (what readers see if its outcome cannot be written).
        self._snapshots: dict[str, TaskRecord] = {}
        self._unwritten: dict[str, TaskRecord] = {}  # outcomes the store has not taken yet, as shown
        self._retrieved: dict[str, None] = {}
        self._background: set[asyncio.Task[Any]] = set()
        self._late_writes = 0  # `write_later` writes still waiting for the store
        self._spans: dict[str, Span] = {}  # tracing: each live task's span, from detach to its end here
        self._loop_task: asyncio.Task[None] | None = None
        self._stopping = False
        self._stopped = False  # `stop` is over: outcomes reported later are discarded
        self.fence = fence
        # Fires FENCE_AFTER of a lease past the last renewal.
        self._fence_timer: asyncio.TimerHandle | None = None
        store.add_listener(observe_transition)
        store.add_remote_listener(lambda before, record: self.changes.publish(TaskChange(before, record)))
        store.add_gap_listener(self.changes.gap)  # a feed outage: every status stream resyncs
        store.add_damage_listener(self.read_failed)  # a damaged read, on any path: /readyz shows it

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self, *, restart_message: str | None = RESTART_MESSAGE) -> tuple[int, int]:
        """Take this node's lease, end (or re-run) the tasks earlier processes left running (saying
        `restart_message`, or naming the lost node when None), and start the lease/sweep loop.
        Returns (re-run, failed) counts of the first sweep."""
        await self._renew_lease()
        self._renewed()
        self._leases.started(await store_instance(self.store))
        counts = await self.sweep(message=restart_message)
        self._loop_task = asyncio.get_running_loop().create_task(
            self._maintain(), name="task-lease-and-sweep"
        )
        return counts

    async def _maintain(self) -> None:
        """Every sixth of the lease: renew it (so the fence, at FENCE_AFTER of a lease without one,
        comes only after three renewals in a row failed or were late), and every third tick (half
        the lease) sweep for orphans and purge expired records."""
        tick = 0
        while not self._stopping:
            await asyncio.sleep(self.lease_s / 6)
            tick += 1
            try:
                await self._renew_lease()
                self._renewed()
                self._leases.renewed(await store_instance(self.store))
                if self.store_problem is not None:
                    # back from an outage or a cut: another replica may have ended or taken over
                    # calls still running here (their lease lapsed): stop them now, not at the sweep
                    await self._stop_calls_ended_elsewhere()
                if tick % 3 == 0:
                    await self.sweep()
                    purged = await self.store.purge_expired()
                    if purged:
                        log.info("tasks_purged", count=purged)
                self.store_problem = None
            except StoreUnavailableError as exc:
                self.store_failed(exc)
                log.warning("store_unavailable", reason=str(exc))
            except Exception:  # the loop must outlive any one bad round
                log.exception("task_maintenance_failed")

    async def _renew_lease(self) -> None:
        """Hold this node's lease for another `lease_s` (s), noted in the metrics: a renewal is a
        store write, so one that succeeds sets `STORE_WRITABLE` and `LEASE_RENEWED` (the wall clock),
        one the store refuses counts in `LEASE_RENEWAL_FAILURES`. Raises StoreUnavailableError (a
        caller that bounds it with a timeout counts that failure itself)."""
        try:
            await self.store.renew_lease(self.node, int(self.lease_s * 1000))
        except StoreUnavailableError:
            metrics.LEASE_RENEWAL_FAILURES.inc()
            raise
        metrics.LEASE_RENEWED.set(time.time())
        metrics.STORE_WRITABLE.set(1)

    def _renewed(self) -> None:
        """The lease was just renewed: (re)arm the fence for FENCE_AFTER of a lease from now. A timer,
        not the maintenance loop, so a renewal stuck in a store call cannot delay it."""
        if not self.fence:
            return
        if self._fence_timer is not None:
            self._fence_timer.cancel()
        self._fence_timer = asyncio.get_running_loop().call_later(self.lease_s * FENCE_AFTER, self._fence_now)

    def _fence_now(self) -> None:
        """The fence timer fired: try one last renewal, bounded so that the fence still comes before
        the lease lapses (the store may just be back), and fence if it fails."""
        self._fence_timer = None
        if not self._stopping:
            self._spawn(self._renew_or_fence())

    async def _renew_or_fence(self) -> None:
        """One renewal within LAST_RENEWAL of the lease, else the fence (`_fence_calls`)."""
        try:
            async with asyncio.timeout(self.lease_s * LAST_RENEWAL):
                await self._renew_lease()
        except StoreUnavailableError:
            self._fence_calls()
        except TimeoutError:
            metrics.LEASE_RENEWAL_FAILURES.inc()
            self._fence_calls()
        else:
            self._renewed()

    def _fence_calls(self) -> None:
        """The lease was not renewed for FENCE_AFTER of it: before it lapses and another replica
        re-runs them, stop the detached calls running here whose tool is configured `on_restart:
        rerun` (upstream cancel; nothing is recorded: the task belongs to whoever takes it over).
        Other calls go on: no replica re-runs them, and if the store was down for every replica
        their outcome is still recorded; if another replica declared one lost, the sweep cancels it
        as soon as this node reaches the store again (`_stop_calls_ended_elsewhere`). A call whose
        task is still being created is stopped too, at once: its create may have reached the store
        with only its reply cut off, and then the record exists and another replica re-runs it when
        the lease lapses, long before the create here gives up (store.timeout). Its client gets
        -32800 naming the task, or the handle if the create's reply still comes."""
        if self._stopping:
            return
        fenced = [
            (task_id, call)
            for task_id, call in self.live.items()
            if (snapshot := self._snapshots.get(task_id)) is not None and snapshot.rerun is not None
        ]
        if not fenced:
            return
        running = sum(1 for _, call in fenced if not call.outcome.done())
        for task_id, call in fenced:
            if task_id not in self._creating:
                self._fence_call(task_id, call)
                continue
            # Stopped now, released when its create ends (`detach`, `_keep_unsure`): until then it
            # stays in `live`, so nothing detaches it again. One that had ended is left alone: its
            # outcome goes into the task if the create commits it (nothing is left to re-run).
            self._fenced_creating.add(task_id)
            if not call.outcome.done():
                self._stop_fenced(task_id, call)
        metrics.FENCES.inc()
        metrics.FENCED_CALLS.inc(running)
        log.error(
            "replica_fenced",
            node=self.node,
            calls=running,
            reason=f"the lease was not renewed for {self.lease_s * FENCE_AFTER:g} s",
        )

    def _fence_call(self, task_id: str, call: LiveCall) -> None:
        """Stop the detached call of `task_id` for the fence: released (if it is still this task's
        call here), cancelled upstream (`_stop_fenced`), and its outcome never recorded (see
        `_end`); whoever sweeps the task next re-runs it."""
        self._stop_fenced(task_id, call)  # (first: its message names the task while it is unsure)
        if self.live.get(task_id) is call:
            self.release(task_id)

    def _stopped_at_fence(self, task_id: str, call: LiveCall) -> bool:
        """Whether the fence stopped `call`, whose task `task_id` was being created when it came (a
        call that had ended before is not: its outcome is the task's)."""
        return task_id in self._fenced_creating and call.ended_by == "fence"

    def _stop_fenced(self, task_id: str, call: LiveCall) -> None:
        """Cancel `call` upstream for the fence, once (a call stopped while its task was being
        created is not stopped again when the create ends). Its client learns the task id it may go
        on as when the task may exist without this node having seen it committed (a create failed,
        or still waiting for its reply)."""
        if call.ended_by == "fence":
            return
        reason = "this replica could not renew its lease; another replica takes the task over"
        if task_id in self._unsure or task_id in self._fenced_creating:
            reason += f" (task {task_id}, if the store took it before it was cut off)"
        call.ended_by = "fence"
        call.cancel(reason)

    def read_failed(self, exc: BaseException) -> None:
        """Note a read the store failed because its files are damaged (DamagedStoreError: a bad page,
        a value that cannot be decoded): logged at error level, and `/readyz` reports the store failed
        for READ_FAILURE_SHOWN_S (s) after the last such read. (A store that cannot be reached at all
        fails `/readyz`'s own write probe instead.)"""
        log.error("store_read_failed", store=self.store.where, reason=str(exc))
        self._read_failure = (time.monotonic(), str(exc))

    def read_problem(self) -> str | None:
        """The last read failure of the store while it is recent (READ_FAILURE_SHOWN_S), else None."""
        if self._read_failure is None or time.monotonic() - self._read_failure[0] > READ_FAILURE_SHOWN_S:
            return None
        return self._read_failure[1]

    def store_failed(self, exc: BaseException) -> None:
        """Note a store failure (shown on /readyz; other nodes' leases are not judged for a lease period;
        counted in `STORE_ERRORS`, and `STORE_WRITABLE` reads 0 until a write succeeds)."""
        self.store_problem = str(exc)
        self._leases.failed()
        metrics.STORE_ERRORS.inc()
        metrics.STORE_WRITABLE.set(0)

    async def stop(self) -> None:
        """On shutdown: record `failed` for each detached call still running, cancel it, give the lease up."""
        self._stopping = True  # the loop also checks it: redis-py can swallow a cancel (redis/redis-py#2028)
        if self._fence_timer is not None:
            self._fence_timer.cancel()
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.wait({self._loop_task}, timeout=2.0)
        calls = list(self.live.items())
        shutdown = proxy_error(SHUTDOWN_MESSAGE)
        await asyncio.gather(
            *(self._end(task_id, shutdown, SHUTDOWN_MESSAGE, by="shutdown") for task_id, _ in calls)
        )
        for _, call in calls:
            call.shut_down(shutdown)  # its idempotency key then answers as its task does
        self.live.clear()
        self._stopped = True  # what the calls report from now on is discarded (the store closes next)
        for task in list(self._background):
            task.cancel()
        with contextlib.suppress(StoreUnavailableError):
            await self.store.release_lease(self.node)

    # -- creation ----------------------------------------------------------------------------

    async def check_capacity(self, principal: str) -> None:
        """Raise a limit error (HTTP 429) when `principal` has `max_tasks_per_principal` live tasks:
        the early refusal, before anything reaches the upstream. Its calls on this node count, and on
        a shared store every replica's (`TaskStore.live_count`; when the store cannot be read, the
        refusal is left to `detach`, whose create is the atomic check across replicas)."""
        cap = self.max_tasks_per_principal
        if cap is None:
            return
        self._check_local_capacity(principal)
        try:
            shared = await self.store.live_count(principal)
        except StoreUnavailableError:
            return
        if shared is not None and shared >= cap:
            raise self._over_capacity(principal, shared, cap)

    def _check_local_capacity(self, principal: str) -> None:
        """The limit error when `principal`'s live calls on this node reach `max_tasks_per_principal`."""
        cap = self.max_tasks_per_principal
        if cap is not None:
            live = sum(1 for c in self.live.values() if c.principal == principal)
            if live >= cap:
                raise self._over_capacity(principal, live, cap)

    def _over_capacity(self, principal: str, live: int, cap: int) -> JsonRpcError:
        """The `max_tasks_per_principal` refusal (HTTP 429) of `principal` with `live` live tasks,
        logged (`limit_refused`) and counted (`LIMIT_REJECTIONS`)."""
        log.warning("limit_refused", limit="max_tasks_per_principal", principal=principal_hash(principal))
        metrics.LIMIT_REJECTIONS.labels("max_tasks_per_principal").inc()
        return limit_error(
            "max_tasks_per_principal", f"this principal already has {live} running tasks", max=cap
        )

    async def detach(
        self,
        call: LiveCall,
        *,
        server: str,
        tool: str,
        method: str,
        ttl_s: float | None,
        poll_interval_s: float,
        status_message: str,
        rerun: JsonObject | None = None,
        task_id: str | None = None,
        origin: str | None = None,
    ) -> TaskRecord:
        """Commit a task for a running call and take the call over; return the record.

        The record is committed before this returns (the caller then sends the handle). `ttl_s` (s)
        is the retention after the task ends; `rerun` (`{method, params, capabilities}`) is kept for
        tools re-run after their owner died; `task_id` the id minted for the call beforehand (an
        idempotency key names it), else a new one; `origin` the creating session's
        `TaskRecord.origin`, if any. Raises a limit error (HTTP 429) for
        `max_tasks_per_principal` (this node's calls, then, on a shared store, the principal's live
        tasks on every replica, counted by the store as it commits: two replicas creating the last
        allowed task at once never both succeed), or JsonRpcError -32603 naming the store when it
        cannot write. A call already live here under `task_id` (shared as a task under its key,
        `CallRunner._share`) detaches into that task, as it reads now (terminal, if the call ended
        meanwhile) with `status_message`: nothing is created (unless that task's own create never
        landed), and a store that cannot be reached is the same -32603 (503).
        """
        if task_id is not None and self.live.get(task_id) is call:
            existing = await self._already_its_task(task_id, status_message)
            if existing is not None:
                return existing
            self._unsure.discard(task_id)  # an earlier create of it that never landed: create it now
        self._check_local_capacity(call.principal)
        record = TaskRecord(
            task_id=task_id or new_task_id(),
            principal=call.principal,
            server=server,
            tool=tool,
            method=method,
            created_ms=now_ms(),
            ttl_ms=None if ttl_s is None else int(ttl_s * 1000),
            poll_interval_ms=max(1, int(poll_interval_s * 1000)),
            owner=self.node,
            status_message=status_message,
            rerun=rerun,
            upstream_ref=call.upstream_ref,
            origin=origin,
        )
        if tracing.enabled():
            record.trace = tracing.sampled_traceparent(self._open_span(record))
        self.live[record.task_id] = call  # before the commit: the sweep must never see it ownerless
        self._snapshots[record.task_id] = record
        self._creating.add(record.task_id)  # no record yet: not "ended elsewhere" (the sweep)
        try:
            try:
                await self._create_owned(record)
            except TaskExistsError:
                record = await self._own_existing(record)
            if self._stopped_at_fence(record.task_id, call):
                self._fence_call(record.task_id, call)  # committed after the fence: taken over
        except JsonRpcError:  # (`_own_existing`: the id is not this call's task)
            self._close_span(record.task_id, "refused")
            self.release(record.task_id)
            raise
        except LiveLimitError as exc:
            self._close_span(record.task_id, "refused")
            self.release(record.task_id)
            raise self._over_capacity(call.principal, exc.live, exc.max_live) from None
        except StoreUnavailableError as exc:
            self._close_span(record.task_id, "refused")
            if rerun is None:
                self.release(record.task_id)
            else:
                self._keep_unsure(record.task_id, call)
            raise self._no_task(exc) from None
        finally:
            self._creating.discard(record.task_id)
            self._fenced_creating.discard(record.task_id)
        log.info(
            "task_created",
            task_id=record.task_id,
            server=server,
            tool=tool,
            principal=principal_hash(call.principal),
        )
        return record

    async def _create_owned(self, record: TaskRecord) -> None:
        """Commit `record` (owned by this node). A shared store refuses it while this node's lease
        has lapsed (LeaseLapsedError: back from a cut off, before the next renewal; another replica
        would take the task for an orphan and re-run it at once): then renew the lease and commit.
        Raises what `TaskStore.create` and `renew_lease` raise (StoreUnavailableError when the
        renewal fails, or when the lease lapses again meanwhile)."""
        try:
            await self.store.create(record, max_live=self.max_tasks_per_principal, leased=True)
        except LeaseLapsedError:
            await self._renew_lease()
            self._renewed()
            try:
                await self.store.create(record, max_live=self.max_tasks_per_principal, leased=True)
            except LeaseLapsedError as exc:
                raise StoreUnavailableError(str(exc)) from None

    async def _already_its_task(self, task_id: str, status_message: str) -> TaskRecord | None:
        """The record of `task_id`, whose call is live here already (see `detach`), with
        `status_message` written if it still runs here (else as it reads: ended, or taken over);
        None when there is none (an earlier create of it failed without landing). Raises
        JsonRpcError -32603 (HTTP 503) naming the store when it cannot be reached: the call stays
        as it was."""
        try:
            try:
                return await self.store.update(
                    task_id, Change(status_message=status_message, expect_owner=self.node)
                )
            except (TerminalTaskError, ConflictError):
                return await self.store.get(task_id)
            except TaskNotFoundError:
                return None
        except StoreUnavailableError as exc:
            raise self._no_task(exc) from None

    def _no_task(self, exc: StoreUnavailableError) -> JsonRpcError:
        """The -32603 (HTTP 503) naming the store for a call that could not become a task because
        of `exc` (noted as a store failure: `store_failed`)."""
        self.store_failed(exc)
        return JsonRpcError(
            INTERNAL_ERROR,
            f"the call could not become a task: {exc}",
            {"store": self.store.where},
            status=503,
        )

    async def _own_existing(self, record: TaskRecord) -> TaskRecord:
        """The id of `record` is taken, and no call here holds it. A key's task id is minted for one
        call alone, so the record holding it is this same call's task when this node owns it and it
        still runs: committed by a create whose reply was lost (the call then stayed attached, and
        is detached again as its client left). Returns that record, whose task takes the call over;
        else raises JsonRpcError -32603 (HTTP 409). Raises StoreUnavailableError."""
        existing = await self.store.get(record.task_id)
        if existing is None or existing.owner != self.node or existing.status.terminal:
            raise JsonRpcError(
                INTERNAL_ERROR,
                f"the call could not become a task: task {record.task_id} exists already",
                status=409,
            )
        self._snapshots[record.task_id] = existing
        return existing

    def _keep_unsure(self, task_id: str, call: LiveCall) -> None:
        """The create of `task_id` (a tool re-run after its owner died) failed on a store that may
        still have committed it (its reply lost to a cut): then the record exists, owned by this
        node, and another replica re-runs the call once this node's lease lapses. So the call,
        which stays attached to its client, stays in `live` too: the fence stops it as it stops a
        task's (at once if the fence came while it was being created and it still runs), and when
        it ends its outcome is written to the record if there is one, so nobody re-runs it after."""
        if self._stopped_at_fence(task_id, call):
            self._fence_call(task_id, call)  # (released now)
            return
        self._unsure.add(task_id)
        call.add_done_callback(lambda done: self._spawn(self._unsure_ended(task_id, done)))

    async def _unsure_ended(self, task_id: str, call: LiveCall) -> None:
        """A call kept by `_keep_unsure` ended: its outcome goes to its record, if the create had
        committed one (else nothing is written), unless the fence or a take-over stopped it first;
        an error's message becomes the status message (the create's would still read `running`)."""
        if self.live.get(task_id) is call:
            outcome = call.outcome.result()
            error = outcome.get("error")
            message = error.get("message") if isinstance(error, dict) else None
            await self._end(task_id, outcome, message if isinstance(message, str) else None, by=call.ended_by)

    def release(self, task_id: str) -> None:
        """The call of `task_id` is no longer this node's (it ended, or another replica stopped it)."""
        self._close_span(task_id, "released")
        self.live.pop(task_id, None)
        self._snapshots.pop(task_id, None)
        self._unsure.discard(task_id)

    def _open_span(self, record: TaskRecord, *, parent: str | None = None) -> Span:
        """Start the `task` span of `record`'s call on this node (tracing on): a child of the request
        that detached it, or of `parent` (a stored `traceparent`: a call taken over from a lost replica)."""
        attributes = {
            tracing.SERVER: record.server,
            tracing.TOOL: record.tool,
            tracing.PRINCIPAL: principal_hash(record.principal),
            tracing.REPLICA: self.node,
        }
        span = tracing.start_task_span(record.task_id, attributes, parent=parent)
        tracing.task_event(span, "taken_over" if parent else "detached")
        self._spans[record.task_id] = span
        return span

    def _close_span(self, task_id: str, status: str) -> None:
        """End the `task` span of `task_id` on this node, if it has one open, with `status`."""
        tracing.end_task_span(self._spans.pop(task_id, None), status)

    def publish_message(self, *, principal: str, server: str, task_id: str, message: JsonObject) -> None:
        """Offer a JSON-RPC notification that belongs to a task (a v1 client's progress) to its streams."""
        self.changes.publish(TaskMessage(principal, server, task_id, message))

    # -- the sink a running call writes through ------------------------------------------------

    async def sent_upstream(self, task_id: str, ref: JsonObject) -> bool:
        """Record where the task's upstream request went (`TaskRecord.upstream_ref`), for a call
        whose request left after its task was made (a 2025-11-25 task, a re-run, a session still
        opening at `detach_after`). One write, not retried: a lost ref only costs the cancel a
        take-over would send. False when the task ended, moved, or the store refused."""
        if self._stopped:
            return False
        try:
            await self.store.update(task_id, Change(upstream_ref=ref, expect_owner=self.node))
        except (TerminalTaskError, TaskNotFoundError, ConflictError, StoreUnavailableError):
            return False
        return True

    async def set_inputs(self, task_id: str, input_requests: JsonObject) -> bool:
        """Record the call's outstanding questions (status `input_required`, or `working` when none).

        A write the store refuses is retried for `outcome_retry_s`; if it still fails the client could
        never see the question, so the task ends `failed` naming the store and the call is cancelled.
        Returns False when the task ended (elsewhere, or so).
        """
        if self._stopped:  # `stop` ended the task (and the store closes next)
            return False
        status = TaskStatus.INPUT_REQUIRED if input_requests else TaskStatus.WORKING
        change = Change(status=status, input_requests=input_requests, expect_owner=self.node)
        try:
            await self._retrying(lambda: self.store.update(task_id, change))
        except (TerminalTaskError, TaskNotFoundError, ConflictError):
            return False
        except StoreUnavailableError as exc:
            message = f"the task store could not record the upstream's question ({exc})"
            call = self.live.get(task_id)
            await self._end(task_id, proxy_error(message, store=self.store.where), message, by="store")
            if call is not None:
                call.cancel(message)
            return False
        if input_requests:
            log.info("task_input_requested", task_id=task_id, keys=sorted(input_requests))
            tracing.task_event(self._spans.get(task_id), "input_requested", open=len(input_requests))
        return True

    async def _retrying(self, write: Callable[[], Awaitable[Any]]) -> Any:
        """`write()`, retried with backoff while the store is unavailable, for `outcome_retry_s` (s)."""
        async for attempt in AsyncRetrying(
            stop=stop_after_delay(self.outcome_retry_s),
            wait=wait_exponential(multiplier=0.05, max=1.0),
            retry=retry_if_exception_type(StoreUnavailableError),
            reraise=True,
        ):
            with attempt:
                return await write()

    async def progress(self, task_id: str, text: str) -> bool:
        """Record progress text as the status message. Returns False when the task already ended elsewhere
        (or `stop` ended it)."""
        if self._stopped:
            return False
        try:
            await self.store.update(task_id, Change(status_message=text, expect_owner=self.node))
        except (TerminalTaskError, TaskNotFoundError, ConflictError):
            return False
        except StoreUnavailableError as exc:
            self.store_failed(exc)
            log.warning("store_write_failed", task_id=task_id, reason=str(exc))
        return True

    async def finish(
        self, task_id: str, outcome: JsonObject, status_message: str | None, *, by: str = "upstream"
    ) -> None:
        """Record the call's outcome (the raw upstream answer, or the proxy's error) and release the call.
        `status_message` is the task's last: a completed call's last progress text (None clears what
        the task said while it ran), an error's message (None keeps the last progress text).

        `by` says what ended it, for the audit log (`upstream`, `timeout`, `input_timeout`). A write the
        store refuses is retried with backoff for `outcome_retry_s`; after that the task goes on
        reading `working`, its status message naming the store, while the write of this same outcome
        goes on in the background. A terminal status is never shown before it is stored, so a task
        reads the same forever once terminal: the outcome recorded first wins, after a restart too
        (a restart before the write lands reads as the restart's failure, and nothing else ever did).
        """
        if self._stopped:  # a call `stop` ended (its task already reads the shutdown's failure)
            log.info("late_outcome_discarded", task_id=task_id, reason="the proxy has stopped", by=by)
            return
        await self._end(task_id, outcome, status_message, by=by)

    async def _end(self, task_id: str, outcome: JsonObject, status_message: str | None, *, by: str) -> None:
        if by == "fence":  # stopped by the fence: the task belongs to whoever takes it over
            log.info("late_outcome_discarded", task_id=task_id, reason="fenced", by=by)
            return
        change = Change(
            status=outcome_status(outcome),
            outcome=outcome,
            input_requests={},
            expect_owner=self.node,
        )
        # A completed call's last progress text (None: it reported none, and what the task said
        # while it ran, "re-running: ...", a detach's note, no longer holds); an error's message.
        if status_message is not None or "result" in outcome:
            change = replace(change, status_message=status_message)
        try:
            record = await self._retrying(lambda: self.store.update(task_id, change))
            principal = principal_hash(record.principal)
            log.info("task_ended", task_id=task_id, status=record.status.value, by=by, principal=principal)
        except (TerminalTaskError, TaskNotFoundError, ConflictError) as exc:
            log.info("late_outcome_discarded", task_id=task_id, reason=str(exc), by=by)
            self._close_span(task_id, "outcome_discarded")
        except StoreUnavailableError as exc:
            self.store_failed(exc)
            message = (
                f"the call has ended, but the task store cannot record its outcome yet ({exc}); it is "
                "recorded as soon as the store takes writes again"
            )
            snapshot = self._snapshots.get(task_id)
            if snapshot is not None:
                self._unwritten[task_id] = replace(snapshot, status_message=message, input_requests={})
            log.error("outcome_not_recorded", task_id=task_id, reason=str(exc))
            self._spawn(self._write_later(task_id, change))
        finally:
            self._close_span(task_id, outcome_status(outcome).value)
            self.release(task_id)

    async def _write_later(self, task_id: str, change: Change) -> None:
        """Keep trying to write an outcome the store refused (waits ≤ 5 s apart) until it lands or
        the task ended otherwise; then forget the in-memory copy readers were shown meanwhile."""
        try:
            async for attempt in AsyncRetrying(
                wait=wait_exponential(multiplier=0.1, max=5.0),
                retry=retry_if_exception_type(StoreUnavailableError),
            ):
                with attempt:
                    await self.store.update(task_id, change)
            log.info("outcome_recorded_late", task_id=task_id)
        except (TerminalTaskError, TaskNotFoundError, ConflictError):
            pass
        finally:
            self._unwritten.pop(task_id, None)

    def write_later(self, write: Callable[[], Awaitable[Any]], what: str, *, for_s: float) -> None:
        """Keep trying `write()`, a store write the store refused (an idempotency key's answer), in
        the background, waits ≤ 5 s apart, until it lands, `for_s` (s) pass (what it writes would
        have lapsed by then) or `stop`; a replica's drain waits for it (`pending_writes`). `what`
        names it in the log (`store_write_recorded_late`, or `store_write_given_up`)."""
        self._spawn(self._keep_trying(write, what, for_s))

    async def _keep_trying(self, write: Callable[[], Awaitable[Any]], what: str, for_s: float) -> None:
        self._late_writes += 1
        try:
            async for attempt in AsyncRetrying(
                wait=wait_exponential(multiplier=0.1, max=5.0),
                stop=stop_after_delay(for_s),
                retry=retry_if_exception_type(StoreUnavailableError),
                reraise=True,
            ):
                with attempt:
                    await write()
            log.info("store_write_recorded_late", what=what)
        except StoreUnavailableError as exc:
            log.warning("store_write_given_up", what=what, reason=str(exc))
        finally:
            self._late_writes -= 1

    def pending_writes(self) -> int:
        """How many writes wait for the store to take them (outcomes, `write_later`): a replica's
        drain waits for them, since its replacement could not know what they hold."""
        return len(self._unwritten) + self._late_writes

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- readers -----------------------------------------------------------------------------

    async def check_rate(self, principal: str) -> None:
        """Raise a limit error (HTTP 429) when `principal` exceeds `tasks_rate` (see `rates.TaskRate.check`;
        -32603, HTTP 503, when Redis-held counters cannot be reached)."""
        await self.rate.check(principal)

    async def lookup(self, task_id: Any, *, principal: str, server: str) -> TaskRecord:
        """The record of `task_id` as `principal` may see it on `server`, ending it first if it is an orphan.

        Raises JsonRpcError -32602 for a missing, unknown, expired, foreign-principal or other-server
        id (all alike, in message and time: a foreign id's security event is logged after the
        answer), -32603 (HTTP 503) naming the store when it cannot be read.
        """
        if not isinstance(task_id, str) or not task_id:
            raise JsonRpcError(INVALID_PARAMS, "params.taskId must be a non-empty string")
        if not valid_task_id(task_id):  # no id of ours looks like that
            raise JsonRpcError(INVALID_PARAMS, f"unknown or expired task: {task_id[:64]!r}")
        record = self._unwritten.get(task_id)
        foreign = False
        if record is not None and (record.principal != principal or record.server != server):
            record, foreign = None, True
        elif record is None:
            try:
                record, foreign = await self.store.get_for(task_id, principal, server)
            except StoreUnavailableError as exc:
                raise JsonRpcError(
                    INTERNAL_ERROR, str(exc), {"store": self.store.where}, status=503
                ) from None
        if record is None:
            if foreign:  # logged after the answer is on its way: unknown and foreign ids take the same time
                asyncio.get_running_loop().call_soon(_log_foreign_access, task_id, server, principal)
            raise JsonRpcError(INVALID_PARAMS, f"unknown or expired task: {task_id}")
        tracing.link_current(record.trace, relation="task")  # this request touched the task
        mine = record.owner == self.node
        if not record.status.terminal and task_id not in self.live and (mine or self._leases.may_judge()):
            try:
                if not await self.store.lease_alive(record.owner):
                    record = await self._take_over(record, LOST_MESSAGE.format(node=record.owner))
            except StoreUnavailableError as exc:
                raise JsonRpcError(
                    INTERNAL_ERROR, str(exc), {"store": self.store.where}, status=503
                ) from None
        if record.status.terminal and task_id not in self._retrieved:
            self._retrieved[task_id] = None
            if len(self._retrieved) > _RETRIEVED_MAX:
                del self._retrieved[next(iter(self._retrieved))]
            principal_key = principal_hash(principal)
            log.info(
                "task_result_retrieved", task_id=task_id, status=record.status.value, principal=principal_key
            )
        return record

    async def answer(self, record: TaskRecord, responses: JsonObject) -> list[str]:
        """Deliver input responses to the task's live call (if it runs here; through `remote` when
        another replica runs it); the answered keys have left the stored `inputRequests` when this
        returns. Returns the keys used."""
        call = self.live.get(record.task_id)
        elsewhere = self.remote is not None and record.owner != self.node and not record.status.terminal
        if call is None and elsewhere:
            assert self.remote is not None
            return await self.remote.answer(record, responses)
        if call is None or record.status.terminal:
            return []
        keys = call.answer(responses)
        if keys:
            tracing.task_event(self._spans.get(record.task_id), "input_answered", link=True, keys=len(keys))
            await self.set_inputs(record.task_id, call.input_requests())
            principal = principal_hash(record.principal)
            log.info("task_input_answered", task_id=record.task_id, keys=len(keys), principal=principal)
        return keys

    async def cancel(self, record: TaskRecord, *, by: str) -> TaskRecord:
        """Cancel a task (sticky; a terminal task is returned untouched) and stop its live call.

        `by` names who asked (`client`, `operator`) for the audit log. Raises StoreUnavailableError.
        """
        if record.status.terminal:
            return record
        message = f"cancelled by {'client request' if by == 'client' else by}"
        self._cancelling.add(record.task_id)
        try:
            record = await self.store.update(
                record.task_id, Change(status=TaskStatus.CANCELLED, status_message=message, input_requests={})
            )
        except (TerminalTaskError, TaskNotFoundError):
            return await self.store.get(record.task_id) or record
        finally:
            self._cancelling.discard(record.task_id)
        call = self.live.get(record.task_id)
        tracing.task_event(self._spans.get(record.task_id), "cancel_requested", link=True, by=by)
        self._close_span(record.task_id, TaskStatus.CANCELLED.value)
        self.release(record.task_id)
        if call is not None:
            call.cancel(f"task {message}")
        elif self.remote is not None and record.owner != self.node:
            await self.remote.cancel(record, f"task {message}")  # the call runs on another replica
        log.info("task_cancelled", task_id=record.task_id, by=by, principal=principal_hash(record.principal))
        return record

    def stop_cancelled(self, task_id: str, reason: str) -> bool:
        """Stop the live call of `task_id`, which another replica marked cancelled in the store
        (the upstream gets notifications/cancelled with `reason`). Returns whether it ran here."""
        call = self.live.get(task_id)
        if call is None:
            return False
        tracing.task_event(self._spans.get(task_id), "cancel_requested", link=True, by="client")
        self._close_span(task_id, TaskStatus.CANCELLED.value)
        self.release(task_id)
        call.cancel(reason)
        principal = principal_hash(call.principal)
        log.info("task_cancelled", task_id=task_id, by="client", via="replica", principal=principal)
        return True

    # -- orphans and tasks ended elsewhere ---------------------------------------------------

    async def sweep(self, message: str | None = None) -> tuple[int, int]:
        """Stop live calls whose task was ended from outside (an operator's CLI cancel), then take
        over every orphan in the store; `message` overrides the default lease-lapse message (the
        start-up sweep names a restart). Returns (re-run, failed) counts. Raises StoreUnavailableError."""
        await self._stop_calls_ended_elsewhere()
        rerun = failed = 0
        lapsed: dict[str, bool] = {}
        judge = self._leases.may_judge()  # not right after a store outage: live replicas renew first
        for record in await self.store.live_tasks():
            if record.task_id in self.live or record.task_id in self._unwritten:
                continue
            if record.owner != self.node:
                if not judge:
                    continue
                if record.owner not in lapsed:
                    lapsed[record.owner] = not await self.store.lease_alive(record.owner)
                if not lapsed[record.owner]:
                    continue
            ended = await self._take_over(record, message or LOST_MESSAGE.format(node=record.owner))
            if ended.status is TaskStatus.FAILED:
                failed += 1
            elif not ended.status.terminal:
                rerun += 1
        if rerun or failed:
            log.info("tasks_recovered", rerun=rerun, failed=failed)
        return rerun, failed

    async def _take_over(self, record: TaskRecord, message: str) -> TaskRecord:
        """Re-run (tools configured `on_restart: rerun`) or fail an orphan; the record as it is now.

        Raises StoreUnavailableError (nothing was started then).
        """
        lost = record.owner
        try:
            if record.rerun is not None and self.rerun is not None:
                owned = await self.store.update(
                    record.task_id,
                    Change(
                        status=TaskStatus.WORKING,
                        status_message=f"re-running: {message}",
                        input_requests={},
                        owner=self.node,
                        upstream_ref=None,  # (the re-run's request writes its own once it leaves)
                        expect_owner=record.owner,
                        expect_version=record.version,
                    ),
                )
                # only once this node owns it (never sent twice), and in a log context of its own:
                # not that of the request whose read found the orphan
                context = contextvars.Context()
                context.run(
                    structlog.contextvars.bind_contextvars, task_id=owned.task_id, server=owned.server
                )
                call = context.run(self.rerun, owned, self)
                if call is not None:
                    log.info(
                        "task_taken_over",
                        task_id=record.task_id,
                        fate="rerun",
                        lost_node=record.owner,
                        node=self.node,
                    )
                    if tracing.enabled():
                        self._open_span(owned, parent=owned.trace)
                    self.live[owned.task_id] = call
                    self._snapshots[owned.task_id] = owned
                    metrics.ORPHANED.labels("rerun").inc()
                    self._cancel_orphaned_request(record, "re-run: " + message)
                    return owned
                record = owned
            metrics.ORPHANED.labels("failed").inc()
            failed = await self.store.update(
                record.task_id,
                Change(
                    status=TaskStatus.FAILED,
                    status_message=message,
                    outcome=proxy_error(message),
                    input_requests={},
                    expect_owner=record.owner,
                    expect_version=record.version,
                ),
            )
            log.info("task_taken_over", task_id=record.task_id, fate="failed", lost_node=lost, node=self.node)
            self._cancel_orphaned_request(record, message)
            return failed
        except (TerminalTaskError, TaskNotFoundError, ConflictError):
            return await self.store.get(record.task_id) or record

    def _cancel_orphaned_request(self, record: TaskRecord, reason: str) -> None:
        """Send the upstream a cancel, in the background (cut short by `stop`), for the request of
        `record`, an orphan just taken over (failed or re-run): an upstream may run a call on after
        the connection of the process that sent it closed, and a re-run would then run beside it.
        Only where the record says where the request went (`upstream_ref`: an HTTP upstream
        session); ORPHAN_CANCELS_AT_ONCE at most go out at once."""
        if self.cancel_orphan is None or not record.upstream_ref:
            return
        context = contextvars.Context()
        context.run(structlog.contextvars.bind_contextvars, task_id=record.task_id, server=record.server)
        sending = asyncio.get_running_loop().create_task(
            self._send_orphan_cancel(self.cancel_orphan, record, reason), context=context
        )
        self._background.add(sending)
        sending.add_done_callback(self._background.discard)

    async def _send_orphan_cancel(self, cancel: CancelOrphan, record: TaskRecord, reason: str) -> None:
        async with self._orphan_cancel_slots:
            sent = await cancel(record, reason)
        log.info("orphan_upstream_cancel", task_id=record.task_id, lost_node=record.owner, delivered=sent)

    async def _stop_calls_ended_elsewhere(self) -> None:
        """Cancel the live calls of this node whose task another writer ended (the operator CLI's
        cancel) or another replica took over (this node's lease lapsed while it was cut off); forget
        (without a cancel) those whose create turned out not to have committed (`_keep_unsure`)."""
        for task_id, call in list(self.live.items()):
            if task_id in self._cancelling or task_id in self._creating:
                continue  # being cancelled here, or its record is not committed yet
            record = await self.store.get(task_id)
            if record is not None and not record.status.terminal and record.owner == self.node:
                continue
            if self.live.get(task_id) is not call:
                continue  # ended here meanwhile
            if record is None and task_id in self._unsure:  # its create never committed: the call
                self.release(task_id)  # is its attached client's alone
                continue
            self.release(task_id)
            if record is not None and not record.status.terminal:  # taken over by another replica
                call.cancel("another replica took the task over")
                log.warning("task_owned_elsewhere", task_id=task_id, owner=record.owner)
                continue
            call.cancel("the task ended outside this proxy")
            if record is not None and record.status is TaskStatus.CANCELLED:
                principal = principal_hash(record.principal)
                log.info("task_cancelled", task_id=task_id, by="operator", principal=principal)
            else:
                log.info(
                    "task_ended_elsewhere", task_id=task_id, status=record.status.value if record else "gone"
                )


def _log_foreign_access(task_id: str, server: str, principal: str) -> None:
    log.warning(
        "security_foreign_task_access", task_id=task_id, server=server, principal=principal_hash(principal)
    )
