"""The task store interface every backend implements, and the errors it raises.

Everything outside `proxy/tasks/` talks to tasks through this Protocol (and the task service);
only the backend modules know how records are kept. The rules about records live in
`model.apply`, which every backend calls inside its own atomic step.

Leases: each proxy process is a node with an id; it holds a lease (`renew_lease`, a key that
expires after `ttl_ms`) while it runs, and it owns the tasks whose calls it runs (the record's
`owner`). A task whose owner's lease has lapsed is an orphan: its call died with that process.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from proxy.tasks.model import Change, TaskRecord, TaskStatus

# Called with (status before, record after) for each change a store commits (or, on a shared store,
# learns another replica committed); synchronous, so it must not block.
Listener = Callable[[TaskStatus | None, TaskRecord], None]


class TaskNotFoundError(KeyError):
    """Raised when a task id is unknown or expired."""


class TaskExistsError(ValueError):
    """Raised by `TaskStore.create` when a record with the id already exists (nothing written)."""


class LiveLimitError(Exception):
    """Raised by `TaskStore.create` when the principal already has `max_live` live (non-terminal)
    tasks in the store (nothing written); `live` is how many it has, `max_live` the cap."""

    def __init__(self, principal: str, live: int, max_live: int) -> None:
        super().__init__(f"this principal already has {live} running tasks (at most {max_live})")
        self.principal = principal
        self.live = live
        self.max_live = max_live


class LeaseLapsedError(Exception):
    """Raised by `TaskStore.create` of a store several processes share (Redis) for a live record
    whose owner's lease has lapsed (nothing written): other replicas would take the new task for an
    orphan at once. The owner renews its lease and creates again."""


class StoreUnavailableError(Exception):
    """Raised when the store cannot read or write (disk full, read-only, I/O error, server down).

    The message names the store (`task store <where>: <what failed>`).
    """


def owned_by(record: TaskRecord | None, principal: str, server: str) -> tuple[TaskRecord | None, bool]:
    """`TaskStore.get_for`'s answer for a record read whole: (the record when it is `principal`'s on
    `server`, else None; whether it exists but is someone else's)."""
    if record is None:
        return None, False
    if record.principal == principal and record.server == server:
        return record, False
    return None, True


class DamagedStoreError(StoreUnavailableError):
    """The store's files are damaged, or its database is not the one its directory held; the message
    names the file and how to recover. Raised at start, before anything is served from it."""


class StoreLockedError(Exception):
    """Raised when another process already serves from this store directory (message names its pid)."""


@dataclass(frozen=True)
class ListFilter:
    """What `TaskStore.list_tasks` returns: tasks of one principal (None: everyone's, for operators)
    and optionally one server, one status and one tool."""

    principal: str | None = None
    server: str | None = None
    status: str | None = None
    tool: str | None = None


@runtime_checkable
class TaskStore(Protocol):
    """Async persistence of task records, leases and retention (design.md "Where the code goes next" 1).

    Every method may raise StoreUnavailableError. Times are epoch milliseconds, durations ms.
    """

    where: str  # a human name of the store for messages: a directory or a redis URL
    damage: str | None  # damage found in the store's files since it opened (shown on /readyz), or None
    max_result_bytes: int  # the largest result (JSON bytes) a record keeps; a larger one becomes an error

    async def create(self, record: TaskRecord, *, max_live: int | None = None, leased: bool = False) -> None:
        """Commit a new record before returning. Raises TaskExistsError if the id already exists.

        `max_live`: a store several processes create in (Redis) commits a non-terminal record only
        while its principal has fewer live tasks than that, counted in the store across them all,
        in the same atomic step (two creates racing for the last place never both win), else raises
        LiveLimitError. A store one process serves (diskcache, an exclusive lock) leaves the count
        to that process (`TaskService` counts its calls) and ignores it. With `leased`, such a store
        also commits a non-terminal record only while its owner's lease is alive, else raises
        LeaseLapsedError (a node back from a cut off: the record would be an orphan at birth)."""

    async def live_count(self, principal: str) -> int | None:
        """The live (non-terminal) tasks of `principal` as a store several processes create in
        counts them (Redis), or None for a store one process serves (that process counts its own)."""

    async def get(self, task_id: str) -> TaskRecord | None:
        """The record, or None when unknown or expired."""

    async def get_for(self, task_id: str, principal: str, server: str) -> tuple[TaskRecord | None, bool]:
        """(the record when it belongs to `principal` on `server`, else None; whether it exists but
        is someone else's), in about the time of an unknown id: a store that can tell the owner
        without reading the whole record does so (diskcache keeps a small `own:` entry beside it)."""

    async def update(self, task_id: str, change: Change) -> TaskRecord:
        """Apply `change` atomically (two writers never both win a transition); return the new record.

        Raises TaskNotFoundError, TerminalTaskError (nothing written), ConflictError (`expect_owner`).
        """

    async def list_tasks(
        self, where: ListFilter, *, cursor: str | None = None, limit: int = 50
    ) -> tuple[list[TaskRecord], str | None]:
        """A page of records, newest first, and the opaque cursor of the next page (None at the end).

        Raises ValueError for a cursor this store did not hand out.
        """

    async def wait_for_change(self, task_id: str, version: int, timeout_s: float) -> TaskRecord | None:
        """The record once its `version` differs from `version` (at once if it already does), or
        the unchanged record after `timeout_s` seconds; None when the task is gone."""

    async def live_tasks(self) -> list[TaskRecord]:
        """Every record that is not terminal (for the orphan sweep)."""

    async def renew_lease(self, node: str, ttl_ms: int) -> None:
        """Hold (or extend) the lease of `node` for `ttl_ms` from now."""

    async def release_lease(self, node: str) -> None:
        """Give the lease of `node` up now (clean shutdown)."""

    async def lease_alive(self, node: str) -> bool:
        """True while `node`'s lease has not lapsed."""

    async def purge_expired(self) -> int:
        """Forget records past their retention now; return how many."""

    async def check_writable(self) -> None:
        """Write and remove a probe; raises StoreUnavailableError when the store cannot write."""

    async def count(self) -> int:
        """Number of stored task records."""

    async def volume(self) -> int:
        """Bytes the store takes (0 where unknown)."""

    async def close(self) -> None:
        """Flush pending writes and release resources."""

    def add_listener(self, listener: Listener) -> None:
        """Call `listener(previous status, or None on create; new record)` after each change this
        store object commits (in this process; for metrics and logs: never counted twice)."""

    def add_gap_listener(self, listener: Callable[[], None]) -> None:
        """Call `listener()` whenever changes of other processes may have been missed (a shared
        store's change feed was down and is back), so readers can resync."""

    def add_damage_listener(self, listener: Callable[[BaseException], None]) -> None:
        """Call `listener(error)` for each read, whoever asked for it, that finds the store's files
        damaged (the DamagedStoreError it raises), so one place reports it."""

    def add_remote_listener(self, listener: Listener) -> None:
        """Call `listener(previous status or None; record)` for the changes every process serving
        this store commits (all replicas on a Redis store; this process alone on diskcache), for
        status push and the console's event stream. Changes of other processes may come late, or
        (Redis connection lost) not at all; the record may be newer than the change."""

    async def claim_once(self, key: str, ttl_ms: int) -> bool:
        """True for the first claim of `key` within `ttl_ms` ms by any process on this store, False
        after (single-use MRTR states)."""

    async def claimed(self, key: str) -> bool:
        """True while `key` is claimed (its claim's `ttl_ms` has not passed)."""

    async def put_blob(
        self, key: str, value: bytes, ttl_ms: int | None = None, *, only_new: bool = False
    ) -> bool:
        """Keep a small `value` under `key` for `ttl_ms` ms (None: no expiry); with `only_new`, only
        when `key` is absent. Returns whether it was written."""

    async def get_blob(self, key: str) -> bytes | None:
        """The value under `key`, or None when absent or expired."""

    async def delete_blob(self, key: str) -> None:
        """Forget the value under `key` at once (nothing when absent), so that a `put_blob` with
        `only_new` takes the key right after."""

    async def session_put(self, session_id: str, info: dict[str, Any], ttl_ms: int) -> None:
        """Keep `info` (JSON-able) for a legacy session id, `ttl_ms` ms from now (the legacy session map)."""

    async def session_get(self, session_id: str) -> dict[str, Any] | None:
        """The info of a legacy session id, or None when unknown or expired."""

    async def session_delete(self, session_id: str) -> None:
        """Forget a legacy session id."""
