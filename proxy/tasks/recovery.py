"""Orphans and tasks ended elsewhere: what the task service's sweep does (design.md "Where the code goes next" 1).

An orphan is a task that is not terminal and whose owner's lease has lapsed: its upstream call died
with that process. It is taken over by a node that notices (the periodic sweep, or any read): it
ends `failed` with an error saying what happened, or, for tools configured `on_restart: rerun`, its
ownership moves to this node first (a conditional write, so two nodes never both take it) and only
then is the call sent upstream again.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import structlog
from tenacity import AsyncRetrying, retry_if_exception_type, wait_exponential

from proxy.runtime import metrics
from proxy.tasks.model import (
    Change,
    ConflictError,
    TaskRecord,
    TaskStatus,
    TerminalTaskError,
    principal_hash,
    proxy_error,
)
from proxy.tasks.store import StoreUnavailableError, TaskNotFoundError, TaskStore

if TYPE_CHECKING:
    from proxy.tasks.service import TaskService

log = structlog.get_logger("proxy.tasks")

RESTART_MESSAGE = "the proxy restarted while this call was running; the upstream call was lost"
LOST_MESSAGE = "the proxy replica running this call (node {node}) was lost: it stopped renewing its lease; the upstream call was lost"


async def store_instance(store: object) -> str | None:
    """The store server's identity when the store has one (Redis `run_id`), else None. Raises StoreUnavailableError."""
    instance = getattr(store, "instance_id", None)
    return None if instance is None else str(await instance())


class LeaseJudge:
    """When a node may take another node's lapsed lease for a lost replica.

    After a store outage longer than the lease (`lease_s`, s) every lease has lapsed by the clock,
    live replicas' too. So a node judges other nodes' leases only once it has been renewing its own
    without a store error, and on the same store server (Redis `run_id`), for a full lease period:
    by then every live replica has renewed its own.
    """

    def __init__(self, lease_s: float) -> None:
        self.lease_s = lease_s
        self._since: float | None = None  # loop time (s) of the first good renewal since the last error
        self._instance: str | None = None

    def started(self, instance: str | None) -> None:
        """The node just took its lease at start-up on store server `instance` (trusted at once)."""
        self._instance = instance
        self._since = asyncio.get_running_loop().time() - self.lease_s

    def renewed(self, instance: str | None) -> None:
        """The node's lease was just renewed on store server `instance`."""
        if instance != self._instance:  # the store server restarted: leases may have lapsed meanwhile
            log.warning("store_restarted", previous=self._instance, now=instance)
            self._instance = instance
            self._since = None
        if self._since is None:
            self._since = asyncio.get_running_loop().time()

    def failed(self) -> None:
        """A store operation failed: start counting again at the next good renewal."""
        self._since = None

    def may_judge(self) -> bool:
        """True when other nodes' lapsed leases mean they are lost (see the class docstring)."""
        return self._since is not None and asyncio.get_running_loop().time() - self._since >= self.lease_s


async def sweep(service: TaskService, message: str | None = None) -> tuple[int, int]:
    """Take over every orphan in the store; `message` overrides the default lease-lapse message
    (the start-up sweep names a restart). Returns (re-run, failed). Raises StoreUnavailableError."""
    store = service.store
    rerun = failed = 0
    lapsed: dict[str, bool] = {}
    judge = service.leases.may_judge()  # not right after a store outage: live replicas renew first
    for record in await store.live_tasks():
        if record.task_id in service.live or service.unwritten(record.task_id):
            continue
        if record.owner != service.node:
            if not judge:
                continue
            if record.owner not in lapsed:
                lapsed[record.owner] = not await store.lease_alive(record.owner)
            if not lapsed[record.owner]:
                continue
        ended = await take_over(service, record, message or LOST_MESSAGE.format(node=record.owner))
        if ended.status is TaskStatus.FAILED:
            failed += 1
        elif not ended.status.terminal:
            rerun += 1
    if rerun or failed:
        log.info("tasks_recovered", rerun=rerun, failed=failed)
    return rerun, failed


async def take_over(service: TaskService, record: TaskRecord, message: str) -> TaskRecord:
    """Re-run (tools configured `on_restart: rerun`) or fail an orphan; return the record as it is now.

    Raises StoreUnavailableError (nothing was started then).
    """
    store = service.store
    try:
        if record.rerun is not None and service.rerun is not None:
            owned = await store.update(
                record.task_id,
                Change(
                    status=TaskStatus.WORKING,
                    status_message=f"re-running: {message}",
                    input_requests={},
                    owner=service.node,
                    expect_owner=record.owner,
                ),
            )
            call = service.rerun(owned)  # only once this node owns it: never sent twice
            if call is not None:
                service.adopt(owned, call)
                metrics.ORPHANED.labels("rerun").inc()
                return owned
            record = owned
        metrics.ORPHANED.labels("failed").inc()
        return await store.update(
            record.task_id,
            Change(
                status=TaskStatus.FAILED,
                status_message=message,
                outcome=proxy_error(message),
                input_requests={},
                expect_owner=record.owner,
            ),
        )
    except (TerminalTaskError, TaskNotFoundError, ConflictError):
        return await store.get(record.task_id) or record


async def stop_calls_ended_elsewhere(service: TaskService) -> None:
    """Cancel the live calls of this node whose task another writer ended (the operator CLI's cancel)."""
    for task_id, call in list(service.live.items()):
        if task_id in service.cancelling or task_id in service.creating:
            continue  # being cancelled here, or its record is not committed yet
        record = await service.store.get(task_id)
        if record is not None and not record.status.terminal:
            continue
        if service.live.get(task_id) is not call:
            continue  # ended here meanwhile
        service.release(task_id)
        call.cancel("the task ended outside this proxy")
        if record is not None and record.status is TaskStatus.CANCELLED:
            log.info(
                "task_cancelled", task_id=task_id, by="operator", principal=principal_hash(record.principal)
            )
        else:
            log.info(
                "task_ended_elsewhere", task_id=task_id, status=record.status.value if record else "gone"
            )


async def write_later(store: TaskStore, unwritten: dict[str, Any], task_id: str, change: Change) -> None:
    """Keep trying to write a failure the readers are already shown (waits ≤ 5 s apart); then
    forget the in-memory copy in `unwritten`."""
    try:
        async for attempt in AsyncRetrying(
            wait=wait_exponential(multiplier=0.1, max=5.0),
            retry=retry_if_exception_type(StoreUnavailableError),
        ):
            with attempt:
                await store.update(task_id, change)
        log.info("outcome_recorded_late", task_id=task_id)
    except (TerminalTaskError, TaskNotFoundError, ConflictError):
        pass
    finally:
        unwritten.pop(task_id, None)
