"""The disk-backed task store (diskcache over SQLite).

Rules it enforces itself, whoever calls it:
- a record is committed (SQLite `synchronous=FULL`, so fsync'd) before `create` returns;
- a terminal status never changes, nor does the result or error of a terminal task;
- retention: each record expires `ttl_ms` after its `created_ms` (diskcache drops it; then it is unknown);
- a result larger than `max_result_bytes` is not stored: the task fails with an error naming the limit;
- the ids of non-terminal tasks are also kept in a small side index (`<path>/live`), so a restart
  finds the calls it lost without reading every record.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import diskcache
import structlog

from .. import observability as obs
from ..auth import principal_hash
from ..protocol.jsonrpc import INTERNAL_ERROR
from .model import TaskRecord, TaskStatus, TerminalTaskError, check_transition, now_ms

_UNSET: Any = object()
log = structlog.get_logger("proxy.tasks")
_PREFIX = "task:"


class TaskNotFoundError(KeyError):
    """Raised when a task id is unknown or expired."""


class TaskStore:
    """Task records in a diskcache directory.

    `path` is the directory (created if missing). `durable=True` makes every write fsync
    (SQLite `synchronous=FULL`); `False` keeps SQLite's `NORMAL`, which survives a process kill
    but not a power cut. All methods are synchronous and cheap (one SQLite transaction).
    """

    def __init__(self, path: str | os.PathLike[str], *, durable: bool = True, max_result_bytes: int = 16 * 1024 * 1024) -> None:
        os.makedirs(path, exist_ok=True)
        self.path = os.fspath(path)
        self.max_result_bytes = max_result_bytes
        sync = 2 if durable else 1
        self._cache = diskcache.Cache(self.path, sqlite_synchronous=sync, eviction_policy="none")
        # A second connection without fsync on commit, for writes a crash may lose (progress text).
        self._relaxed = diskcache.Cache(self.path, sqlite_synchronous=1, eviction_policy="none") if durable else self._cache
        self._live = diskcache.Cache(os.path.join(self.path, "live"), sqlite_synchronous=sync, eviction_policy="none")

    def close(self) -> None:
        """Close the SQLite connections."""
        self._cache.close()
        if self._relaxed is not self._cache:
            self._relaxed.close()
        self._live.close()

    @staticmethod
    def _expire_s(record: TaskRecord) -> float | None:
        expires = record.expires_ms
        if expires is None:
            return None
        return max(0.001, (expires - now_ms()) / 1000)

    def create(self, record: TaskRecord) -> None:
        """Commit a new record. Raises ValueError if the id already exists."""
        if not record.status.terminal:
            self._live.set(record.task_id, record.created_ms, expire=self._expire_s(record))
        added = self._cache.add(_PREFIX + record.task_id, record.to_dict(), expire=self._expire_s(record))
        if not added:
            raise ValueError(f"task {record.task_id} already exists")
        obs.TASKS.labels(record.status.value).inc()
        log.info("task_transition", task_id=record.task_id, server=record.server, tool=record.tool,
                 principal=principal_hash(record.principal), to=record.status.value, age_ms=0)

    def get(self, task_id: str) -> TaskRecord | None:
        """The record for `task_id`, or None when unknown or expired."""
        data = self._cache.get(_PREFIX + task_id)
        return None if data is None else TaskRecord.from_dict(data)

    def update(
        self,
        task_id: str,
        *,
        status: TaskStatus | None = None,
        status_message: str | None = _UNSET,
        result: dict[str, Any] | None = _UNSET,
        error: dict[str, Any] | None = _UNSET,
        input_requests: dict[str, Any] = _UNSET,
        boot: str = _UNSET,
        fsync: bool = True,
    ) -> TaskRecord:
        """Change a record in one transaction and bump `last_updated_ms`; return the new record.

        `fsync=False` commits without waiting for the disk (SQLite `synchronous=NORMAL` in WAL
        mode: it survives a killed process, not a power cut); for writes worth losing over a
        slower event loop, like progress text. Raises TaskNotFoundError for an unknown or expired
        id, and TerminalTaskError when the task is already terminal (nothing is written then).
        """
        key = _PREFIX + task_id
        cache = self._cache if fsync else self._relaxed
        with cache.transact():
            data = cache.get(key)
            if data is None:
                raise TaskNotFoundError(task_id)
            record = TaskRecord.from_dict(data)
            before = record.status
            if record.status.terminal:
                raise TerminalTaskError(f"task {task_id} is {record.status.value}; it can no longer change")
            if status is TaskStatus.COMPLETED and result is not _UNSET and result is not None:
                size = len(json.dumps(result, separators=(",", ":")))
                if size > self.max_result_bytes:
                    status, result = TaskStatus.FAILED, None
                    message = f"the result ({size} bytes) exceeds the limit max_result_bytes ({self.max_result_bytes} bytes)"
                    obs.LIMIT_REJECTIONS.labels("max_result_bytes").inc()
                    error, status_message = {"code": INTERNAL_ERROR, "message": message, "data": {"limit": "max_result_bytes"}}, message
            if status is not None:
                check_transition(record.status, status)
                record.status = status
            if status_message is not _UNSET:
                record.status_message = status_message
            if result is not _UNSET:
                record.result = result
            if error is not _UNSET:
                record.error = error
            if input_requests is not _UNSET:
                record.input_requests = input_requests
            if boot is not _UNSET:
                record.boot = boot
            record.last_updated_ms = max(now_ms(), record.last_updated_ms)
            if record.status.terminal:
                record.rerun = None
            cache.set(key, record.to_dict(), expire=self._expire_s(record))
        if record.status.terminal:
            self._live.delete(task_id)
        if record.status is not before:
            age_s = (record.last_updated_ms - record.created_ms) / 1000
            obs.TASKS.labels(record.status.value).inc()
            if record.status.terminal:
                obs.TASK_AGE.labels(record.status.value).observe(age_s)
            log.info("task_transition", task_id=task_id, server=record.server, tool=record.tool,
                     principal=principal_hash(record.principal), **{"from": before.value}, to=record.status.value, age_ms=int(age_s * 1000))
        return record

    def live_ids(self) -> list[str]:
        """Ids of tasks that were not terminal when last written (the side index; cheap to read)."""
        return [key for key in self._live.iterkeys() if isinstance(key, str)]

    def forget_live(self, task_id: str) -> None:
        """Drop an id from the side index (its record is terminal or gone)."""
        self._live.delete(task_id)

    def ids(self) -> Iterator[str]:
        """Iterate over the ids of all stored (unexpired) tasks."""
        for key in self._cache.iterkeys():
            # iterkeys() also lists expired rows that are not culled yet; `in` checks the expiry.
            if isinstance(key, str) and key.startswith(_PREFIX) and key in self._cache:
                yield key[len(_PREFIX) :]

    def volume(self) -> int:
        """Bytes the store takes on disk."""
        return self._cache.volume() + self._live.volume()

    def count(self) -> int:
        """Number of records on disk (expired ones may count until culled)."""
        return len(self._cache)

    def purge_expired(self) -> int:
        """Drop expired records now; return how many were removed."""
        return self._cache.expire()

    def check_writable(self) -> None:
        """Write and delete a probe key; raises on a read-only or broken store."""
        self._cache.set("probe:", now_ms())
        self._cache.delete("probe:")
