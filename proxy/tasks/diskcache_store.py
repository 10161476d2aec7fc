"""The embedded task store: a diskcache directory (SQLite in WAL mode), behind `TaskStore`.

- One serving process per directory: `DiskcacheStore(path, exclusive=True)` takes an OS lock on
  `<path>/proxy.lock` (flock, released by the kernel when the holder dies, SIGKILL included) and
  raises StoreLockedError naming the holder's pid. Tools like the operator CLI open it shared.
- Group commit: writes queue up while the single writer thread commits the previous batch; each
  batch is one SQLite transaction and so one fsync (`durable=True`: `synchronous=FULL`). A batch of
  progress text only is committed without the fsync (a crash may lose the last progress line,
  never a status or a result). WAL checkpoints run on a thread of their own, off the commit path.
- Keys: `task:<id>` the record; `ip:<principal>\\x1f<server>\\x1f<rev>\\x1f<id>` and
  `ia:<rev>\\x1f<id>` listing indexes (`rev` orders newest first); `live:<id>` non-terminal tasks;
  `node:<id>` leases. Index keys expire with their record. `once:`, `blob:`, `session:`: small
  shared state, the same API as the Redis store's (`claim_once`, `put_blob`, `get_blob`,
  `session_*`), with diskcache expiry and written through the single writer (so a claim is atomic
  across this process's tasks).
- Values are data, never code: `datadisk.DataDisk` writes JSON where diskcache would pickle, reads
  what an older version pickled as plain data only, and the serving process converts those at
  start. The directory is checked and made private first (`storedir.prepare_store_directory`).
"""

from __future__ import annotations

import asyncio
import base64
import os
import secrets
import sqlite3
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import diskcache
import structlog

from proxy.tasks import walcheck
from proxy.tasks.datadisk import DataDisk, StoredValueError, convert_pickled
from proxy.tasks.dirlock import lock_directory, unlock_directory
from proxy.tasks.model import (
    Change,
    ConflictError,
    TaskRecord,
    TaskStatus,
    TerminalTaskError,
    apply,
    now_ms,
    principal_key,
)
from proxy.tasks.store import (
    DamagedStoreError,
    Listener,
    ListFilter,
    StoreUnavailableError,
    TaskExistsError,
    TaskNotFoundError,
    owned_by,
)
from proxy.tasks.storedir import prepare_store_directory

log = structlog.get_logger("proxy.tasks")
STORE_ID_KEY = "store:id"  # this database's id, matched against STORE_ID_FILE at each serving start
STORE_ID_FILE = "store.id"
FORMAT_KEY = "store:format"  # "json" once the values an older version pickled are converted
QUICK_CHECK_AT_START_BYTES = 64 * 1024 * 1024  # larger databases are checked in the background
_DOMAIN_ERRORS = (TerminalTaskError, TaskNotFoundError, ConflictError, ValueError)
_STORE_ERRORS = (OSError, sqlite3.Error, diskcache.Timeout, StoredValueError)
_SEP = "\x1f"
_REV_BASE = 10**13 - 1  # ms; reversed creation times sort newest first
CHECKPOINT_EVERY_S = 1.0  # at most one WAL checkpoint (s apart), after writes, off the writer thread
CROSS_PROCESS_POLL_S = 0.5  # how often (s) a change wait re-reads the disk for writes of other processes
LIST_SCAN_LIMIT = 5000  # index entries one listing call may read while filtering (then it returns a cursor)


def _rev(created_ms: int) -> str:
    return f"{_REV_BASE - created_ms:013d}"


class DiskcacheStore:
    """Task records in a diskcache directory; see the module docstring.

    `path` is the directory (created 0700 if missing). `durable=True` fsyncs every batch (SQLite
    `synchronous=FULL`); `False` keeps `NORMAL`, which survives a process kill but not a power
    cut. `exclusive=True` takes the serving lock (StoreLockedError) and voids the leases of
    earlier holders, which the lock proves dead. `max_result_bytes` feeds `model.apply`.
    Raises StoreUnavailableError when the directory cannot be opened.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        durable: bool = True,
        exclusive: bool = False,
        max_result_bytes: int = 16 * 1024 * 1024,
    ) -> None:
        self.path = self.where = os.fspath(path)
        self.max_result_bytes = max_result_bytes
        self.durable = durable
        self.damage: str | None = None  # what the background integrity check found, if anything
        self._locked = False
        try:
            if exclusive:  # the lock prepares the directory first (once per process: serve took it already)
                lock_directory(self.path)
                self._locked = True
                self.path = os.path.realpath(self.path)
            else:
                self.path = prepare_store_directory(self.path)
            # the real path from here on: a swapped link cannot redirect the store
            self._check_database_file(exclusive=exclusive)
            umask = os.umask(0o077)  # cache.db and its -wal/-shm are created private (0600)
            try:
                self._cache = diskcache.Cache(
                    self.path,
                    disk=DataDisk,
                    sqlite_synchronous=2 if durable else 1,
                    eviction_policy="none",
                    timeout=10,
                )
            finally:
                os.umask(umask)
            for name in ("cache.db", "cache.db-wal", "cache.db-shm"):
                if os.path.exists(os.path.join(self.path, name)):
                    os.chmod(os.path.join(self.path, name), 0o600)
            self._reader = sqlite3.connect(
                os.path.join(self.path, "cache.db"), timeout=10, check_same_thread=False, isolation_level=None
            )
            self._inode = os.stat(os.path.join(self.path, "cache.db")).st_ino
        except sqlite3.DatabaseError as exc:
            self._release_lock()
            if isinstance(exc, sqlite3.OperationalError):
                raise StoreUnavailableError(f"task store {self.path}: {exc}") from exc
            database = os.path.join(self.path, "cache.db")
            raise DamagedStoreError(
                f"task store {self.path}: {database} cannot be opened ({exc}). To recover: stop every "
                f"proxy on it, copy the directory aside, then rebuild the database (`sqlite3 {database} "
                ".recover | sqlite3 recovered.db`), or move the directory away to start with an empty "
                "store (its tasks are lost)"
            ) from exc
        except _STORE_ERRORS as exc:
            self._release_lock()
            raise StoreUnavailableError(f"task store {self.path}: {exc}") from exc
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="task-store-writer")
        self._checkpointer = ThreadPoolExecutor(1, thread_name_prefix="task-store-checkpoint")
        self._checkpoint: asyncio.Future[Any] | None = None
        self._checkpoint_con: sqlite3.Connection | None = None
        self._last_checkpoint = 0.0
        self._executor.submit(self._cache.reset, "sqlite_wal_autocheckpoint", 0, update=False).result()
        self._pending: list[tuple[Callable[[], Any], bool, asyncio.Future[Any]]] = []
        self._flusher: asyncio.Task[None] | None = None
        self._changed: dict[str, tuple[asyncio.Event, int]] = {}  # task → (wake-up event, waiters)
        self._listeners: list[Listener] = []
        self._damage_listeners: list[Callable[[BaseException], None]] = []
        if exclusive:
            try:
                self._check_damage()
            except StoreUnavailableError:
                self._close_now()
                raise
            for key in self._keys("node:"):
                self._cache.delete(key)
            self._convert_pickled()

    def _check_database_file(self, *, exclusive: bool) -> None:
        """Before SQLite opens it: a directory that held a store (its `store.id` file) with its
        `cache.db` gone or empty is refused (DamagedStoreError), not opened as a new, empty store;
        so is (when serving, `exclusive`: nobody else writes the log) a write-ahead log with
        committed transactions after a damaged frame, which SQLite would skip without a word
        (`walcheck`)."""
        marker = os.path.join(self.path, STORE_ID_FILE)
        database = os.path.join(self.path, "cache.db")
        skipped = walcheck.skipped_commits(database + "-wal") if exclusive else 0
        if skipped:
            raise DamagedStoreError(
                f"task store {self.path}: {database}-wal is damaged: {skipped} committed transaction(s) "
                "follow a frame that fails its checksum, and SQLite would skip them (finished tasks "
                "would read as running, newer ones as unknown). Restore the directory from a backup, "
                f"or, to keep what precedes the damage and lose the rest, copy the directory aside and "
                f"run `sqlite3 {database} 'PRAGMA wal_checkpoint(TRUNCATE)'` before starting again"
            )
        if os.path.exists(marker) and (not os.path.exists(database) or os.path.getsize(database) == 0):
            state = "empty" if os.path.exists(database) else "missing"
            raise DamagedStoreError(
                f"task store {self.path}: {database} is {state}, "
                f"but this directory held a store ({STORE_ID_FILE}): its tasks would all be unknown. Restore "
                f"cache.db (with its -wal file) from a backup, or, to start with an empty store on purpose, "
                f"delete {marker} (and any cache.db-wal / cache.db-shm left beside it)"
            )

    def _check_damage(self) -> None:
        """Refuse a damaged store before serving from it (raises DamagedStoreError naming the file
        and how to recover): SQLite's `quick_check` must pass, and the database must be the one this
        directory has held (its id in `cache.db` matches the `store.id` file beside it: an emptied,
        deleted or swapped database would otherwise start as a new store, every task id unknown).
        A database over QUICK_CHECK_AT_START_BYTES is checked in the background instead (reading a
        1,000,000-task database from a cold disk takes seconds): what it finds is `damage`."""
        database = os.path.join(self.path, "cache.db")
        if os.path.getsize(database) <= QUICK_CHECK_AT_START_BYTES:
            problem = self._quick_check(self._reader)
            if problem is not None:
                raise DamagedStoreError(problem)
        else:
            self._checkpointer.submit(self._check_in_background)
        marker = os.path.join(self.path, STORE_ID_FILE)
        kept = self._cache.get(STORE_ID_KEY)
        try:
            with open(marker, encoding="ascii") as file:
                expected: str | None = file.read().strip()
        except FileNotFoundError:
            expected = None
        if expected and kept != expected:
            raise DamagedStoreError(
                f"task store {self.path}: {database} is not the database this directory held, or "
                f"{STORE_ID_FILE} was changed ({STORE_ID_FILE} names store {expected[:40]!r}, the database "
                f"{'none' if kept is None else kept}). Restore cache.db (with its -wal file) from a backup, "
                f"or, to start with an empty store on purpose, delete {marker}"
            )
        if kept is None:
            kept = secrets.token_hex(16)
            self._cache.set(STORE_ID_KEY, kept)
        if expected != kept:
            fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(fd, kept.encode())
                os.fsync(fd)
            finally:
                os.close(fd)

    def _quick_check(self, connection: sqlite3.Connection) -> str | None:
        """SQLite's `quick_check` on `connection`: None when it passes, else the message naming the
        database and how to recover."""
        database = os.path.join(self.path, "cache.db")
        try:
            found = [row[0] for row in connection.execute("PRAGMA quick_check(5)").fetchall()]
        except sqlite3.Error as exc:
            found = [str(exc)]
        if found == ["ok"]:
            return None
        problems = "; ".join(found).replace("\n", "; ")[:300]
        return (
            f"task store {self.path}: {database} is damaged (SQLite quick_check: {problems}). "
            f"To recover: stop every proxy on it, copy the directory aside, then rebuild the database "
            f"(`sqlite3 {database} .recover | sqlite3 recovered.db`, and put recovered.db in its place), "
            "or move the directory away to start with an empty store (its tasks are lost)"
        )

    def _check_in_background(self) -> None:
        """The start-up check of a large database, on the checkpoint thread: damage found is kept in
        `damage` (`/readyz` fails naming it) and logged at error level."""
        problem = self._quick_check(self._reader_for_checkpoint())
        if problem is not None:
            self.damage = problem
            log.error("store_damaged", store=self.path, reason=problem)

    def _close_now(self) -> None:
        """Close the threads, connections and lock (from `close`, or from `__init__` when it refuses
        the store: no writer batch can be in flight then). diskcache keeps one SQLite connection per
        thread, so the writer thread closes its own: left to the garbage collector, its close would
        checkpoint and delete the -wal and -shm files at some later moment, under a backup's feet."""
        self._executor.submit(self._cache.close).result()
        self._executor.shutdown(wait=True)
        self._checkpointer.shutdown(wait=True)
        self._reader.close()
        self._cache.close()
        self._release_lock()

    def _convert_pickled(self) -> None:
        """Rewrite the values an older version pickled as JSON (once: none are left after); delete
        those that are not plain data, logging each key."""
        try:
            if self._cache.get(FORMAT_KEY) == "json":
                return  # converted once: every value since is JSON (no scan of the table at each start)
            converted, refused = convert_pickled(self._cache, time.time())
            self._cache.set(FORMAT_KEY, "json")
        except _STORE_ERRORS as exc:
            raise StoreUnavailableError(f"task store {self.path}: {exc}") from exc
        if converted:
            log.info("store_values_converted", store=self.path, values=converted, to="json")
        for key in refused:
            log.error(
                "store_value_refused",
                store=self.path,
                key=key[:80],
                reason="a pickled value that is not plain data (deleted, never run)",
            )

    # -- the writer ---------------------------------------------------------------------------

    async def _write(self, op: Callable[[], Any], *, fsync: bool = True) -> Any:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._pending.append((op, fsync, future))
        if self._flusher is None or self._flusher.done():
            self._flusher = loop.create_task(self._flush())
        return await asyncio.shield(future)

    async def _flush(self) -> None:
        loop = asyncio.get_running_loop()
        while self._pending:
            batch, self._pending = self._pending, []
            fsync = self.durable and any(wants for _, wants, _ in batch)
            try:
                results = await loop.run_in_executor(
                    self._executor, self._commit, [op for op, _, _ in batch], fsync
                )
            except _STORE_ERRORS as exc:
                error = StoreUnavailableError(f"task store {self.path}: {exc.__class__.__name__}: {exc}")
                results = [error] * len(batch)
            except Exception as exc:  # a bug: fail the batch, keep the writer alive
                results = [exc] * len(batch)
            for (_, _, future), result in zip(batch, results, strict=True):
                if not future.done():
                    if isinstance(result, BaseException):
                        future.set_exception(result)
                    else:
                        future.set_result(result)
        if loop.time() - self._last_checkpoint >= CHECKPOINT_EVERY_S and (
            self._checkpoint is None or self._checkpoint.done()
        ):
            self._last_checkpoint = loop.time()
            self._checkpoint = loop.run_in_executor(self._checkpointer, self._run_checkpoint)

    def _commit(self, ops: list[Callable[[], Any]], fsync: bool) -> list[Any]:
        relaxed = self.durable and not fsync
        if relaxed:
            self._cache.reset("sqlite_synchronous", 1, update=False)
        results: list[Any] = []
        try:
            with self._cache.transact():
                for op in ops:
                    try:
                        results.append(op())
                    except _DOMAIN_ERRORS as exc:  # raised before the op wrote anything
                        results.append(exc)
                    except StoredValueError as exc:  # a damaged value read before writing: this op only
                        results.append(StoreUnavailableError(f"task store {self.path}: {exc}"))
        finally:
            if relaxed:
                self._cache.reset("sqlite_synchronous", 2, update=False)
        return results

    def _run_checkpoint(self) -> None:
        """Copy committed WAL frames into the database on this thread's connection (PASSIVE: it
        never waits for the writer, so checkpoint I/O stays off the commit path)."""
        try:
            self._reader_for_checkpoint().execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
        except _STORE_ERRORS:
            pass  # tried again after the next writes

    def _reader_for_checkpoint(self) -> sqlite3.Connection:
        if self._checkpoint_con is None:
            self._checkpoint_con = sqlite3.connect(
                os.path.join(self.path, "cache.db"), timeout=10, isolation_level=None
            )
        return self._checkpoint_con

    def _changed_now(self, before: TaskStatus | None, record: TaskRecord) -> None:
        waiting = self._changed.pop(record.task_id, None)
        if waiting is not None:
            waiting[0].set()
        for listener in self._listeners:
            listener(before, record)

    def add_listener(self, listener: Listener) -> None:
        """Call `listener(previous status or None on create, record)` after each change this store commits."""
        self._listeners.append(listener)

    # -- records ------------------------------------------------------------------------------

    def _expire_s(self, record: TaskRecord) -> float | None:
        expires = record.expires_ms
        return None if expires is None else max(0.001, (expires - now_ms()) / 1000)

    def _index_keys(self, record: TaskRecord) -> tuple[str, str]:
        rev = _rev(record.created_ms)
        return (
            f"ip:{principal_key(record.principal)}{_SEP}{record.server}{_SEP}{rev}{_SEP}{record.task_id}",
            f"ia:{rev}{_SEP}{record.task_id}",
        )

    async def create(self, record: TaskRecord, *, max_live: int | None = None, leased: bool = False) -> None:
        """See TaskStore.create. `max_live` is not counted here: the one process serving this
        directory (an exclusive lock) counts its principals' live tasks itself (`TaskService`);
        nor is `leased` checked (no other process takes its tasks over)."""

        def op() -> None:
            if not self._cache.add("task:" + record.task_id, record.to_dict(), expire=self._expire_s(record)):
                raise TaskExistsError(f"task {record.task_id} already exists")
            for key in self._index_keys(record):
                self._cache.set(key, 1, expire=self._expire_s(record))
            self._cache.set(
                "own:" + record.task_id,
                _owner(record.principal, record.server),
                expire=self._expire_s(record),
            )
            if not record.status.terminal:
                self._cache.set("live:" + record.task_id, record.owner)

        await self._write(op)
        self._changed_now(None, record)

    async def get(self, task_id: str) -> TaskRecord | None:
        """See TaskStore.get."""
        try:
            data = self._cache.get("task:" + task_id)
        except _STORE_ERRORS as exc:
            raise self._read_error(exc) from exc
        return None if data is None else TaskRecord.from_dict(data)

    async def get_for(self, task_id: str, principal: str, server: str) -> tuple[TaskRecord | None, bool]:
        """See TaskStore.get_for: the small `own:` entry answers for another principal's task
        (records stored before it existed are read whole). Another principal's id costs what an
        unknown one does, two lookups that find nothing past the first (the second looks up a key
        no record has), so the time of an answer does not tell them apart."""
        try:
            owner = self._cache.get("own:" + task_id)
            if owner is not None and owner != _owner(principal, server):
                self._cache.get("task:\x00" + task_id)  # a miss, as for an unknown id
                return None, True
        except _STORE_ERRORS as exc:
            raise self._read_error(exc) from exc
        return owned_by(await self.get(task_id), principal, server)

    def _read_error(self, exc: BaseException) -> StoreUnavailableError:
        """A failed read as the error to raise: DamagedStoreError when the file itself is bad (SQLite
        "malformed" and other database errors that are not about locking or I/O, a stored value
        that cannot be decoded), else StoreUnavailableError."""
        damaged = isinstance(exc, StoredValueError) or (
            isinstance(exc, sqlite3.DatabaseError) and not isinstance(exc, sqlite3.OperationalError)
        )
        if not damaged:
            return StoreUnavailableError(f"task store {self.path}: {exc}")
        error = DamagedStoreError(f"task store {self.path}: {exc}")
        for listener in self._damage_listeners:
            listener(error)
        return error

    async def update(self, task_id: str, change: Change) -> TaskRecord:
        """See TaskStore.update."""
        before: list[TaskStatus] = []

        def op() -> TaskRecord:
            data = self._cache.get("task:" + task_id)
            if data is None:
                raise TaskNotFoundError(task_id)
            record = TaskRecord.from_dict(data)
            new = apply(record, change, at_ms=now_ms(), max_result_bytes=self.max_result_bytes)
            expire = self._expire_s(new)
            self._cache.set("task:" + task_id, new.to_dict(), expire=expire)
            if new.status.terminal:
                for key in (*self._index_keys(new), "own:" + task_id):
                    self._cache.touch(key, expire=expire)
                self._cache.delete("live:" + task_id)
            elif new.owner != record.owner:
                self._cache.set("live:" + task_id, new.owner)
            before.append(record.status)
            return new

        new = await self._write(op, fsync=not change.progress_only)
        self._changed_now(before[0], new)
        return new

    def _keys(self, prefix: str, start: str | None = None, limit: int = 1_000_000) -> list[str]:
        """Unexpired keys with `prefix`, in key order, after `start` (exclusive) when given."""
        low, high = (start, True) if start is not None else (prefix, False)
        sql = (
            f"SELECT key FROM Cache WHERE key {'>' if high else '>='} ? AND key < ? AND raw = 1 AND "
            f"(expire_time IS NULL OR expire_time > ?) ORDER BY key LIMIT ?"
        )
        try:
            rows = self._reader.execute(sql, (low, prefix + "\uffff", time.time(), limit)).fetchall()
        except sqlite3.Error as exc:
            raise StoreUnavailableError(f"task store {self.path}: {exc}") from exc
        return [row[0] for row in rows]

    async def list_tasks(
        self, where: ListFilter, *, cursor: str | None = None, limit: int = 50
    ) -> tuple[list[TaskRecord], str | None]:
        """See TaskStore.list_tasks. The cursor is the last index key read, base64url-encoded."""
        if where.principal is not None:
            prefix = (
                f"ip:{principal_key(where.principal)}{_SEP}{where.server}{_SEP}"
                if where.server is not None
                else f"ip:{principal_key(where.principal)}{_SEP}"
            )
        else:
            prefix = "ia:"
        start = None
        if cursor is not None:
            try:
                start = base64.urlsafe_b64decode(cursor.encode()).decode()
            except (ValueError, UnicodeDecodeError):
                raise ValueError("invalid cursor") from None
            if not start.startswith(prefix):
                raise ValueError("invalid cursor")
        found: list[TaskRecord] = []
        scanned = 0
        while len(found) < limit and scanned < LIST_SCAN_LIMIT:
            keys = self._keys(prefix, start, limit=min(500, LIST_SCAN_LIMIT - scanned))
            if not keys:
                return found, None
            for key in keys:
                scanned += 1
                start = key
                record = await self.get(key.rsplit(_SEP, 1)[1])
                if record is not None and _matches(record, where):
                    found.append(record)
                    if len(found) == limit:
                        break
        more = self._keys(prefix, start, limit=1)
        return found, (
            base64.urlsafe_b64encode(start.encode()).decode() if more and start is not None else None
        )

    async def wait_for_change(self, task_id: str, version: int, timeout_s: float) -> TaskRecord | None:
        """See TaskStore.wait_for_change. Changes by this process wake the wait at once; changes
        by another process (the operator CLI) are seen within CROSS_PROCESS_POLL_S."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0.0, timeout_s)
        while True:
            record = await self.get(task_id)
            remaining = deadline - loop.time()
            if record is None or record.version != version or remaining <= 0:
                return record
            event, waiters = self._changed.get(task_id, (asyncio.Event(), 0))
            self._changed[task_id] = (event, waiters + 1)
            try:
                await asyncio.wait_for(event.wait(), timeout=min(remaining, CROSS_PROCESS_POLL_S))
            except TimeoutError:
                pass
            finally:
                current = self._changed.get(task_id)
                if current is not None and current[0] is event:
                    if current[1] <= 1:
                        del self._changed[task_id]
                    else:
                        self._changed[task_id] = (event, current[1] - 1)

    async def live_tasks(self) -> list[TaskRecord]:
        """See TaskStore.live_tasks."""
        records = []
        for key in self._keys("live:"):
            record = await self.get(key[len("live:") :])
            if record is not None and not record.status.terminal:
                records.append(record)
        return records

    # -- small shared state: single-use claims, blobs, the legacy session map ----------------------

    def _read(self, key: str) -> Any:
        try:
            return self._cache.get(key)
        except _STORE_ERRORS as exc:
            raise self._read_error(exc) from exc

    def add_damage_listener(self, listener: Callable[[BaseException], None]) -> None:
        """See TaskStore.add_damage_listener (called from `_read_error`)."""
        self._damage_listeners.append(listener)

    def add_gap_listener(self, listener: Callable[[], None]) -> None:
        """See TaskStore.add_gap_listener: never called (one process serves this store, and its own
        commits are delivered in the process)."""

    def add_remote_listener(self, listener: Listener) -> None:
        """See TaskStore.add_remote_listener: one process serves a diskcache store, so its own commits are
        all."""
        self._listeners.append(listener)

    async def claim_once(self, key: str, ttl_ms: int) -> bool:
        """See TaskStore.claim_once (diskcache `add`, which writes only an absent key)."""
        return bool(
            await self._write(lambda: self._cache.add("once:" + key, 1, expire=max(1, ttl_ms) / 1000))
        )

    async def claimed(self, key: str) -> bool:
        """See TaskStore.claimed."""
        return self._read("once:" + key) is not None

    async def put_blob(
        self, key: str, value: bytes, ttl_ms: int | None = None, *, only_new: bool = False
    ) -> bool:
        """See TaskStore.put_blob."""
        expire = None if ttl_ms is None else max(1, ttl_ms) / 1000
        if only_new:
            return bool(
                await self._write(lambda: self._cache.add("blob:" + key, bytes(value), expire=expire))
            )
        return bool(await self._write(lambda: self._cache.set("blob:" + key, bytes(value), expire=expire)))

    async def get_blob(self, key: str) -> bytes | None:
        """See TaskStore.get_blob."""
        value = self._read("blob:" + key)
        return None if value is None else bytes(value)

    async def delete_blob(self, key: str) -> None:
        """See TaskStore.delete_blob."""
        await self._write(lambda: self._cache.delete("blob:" + key))

    async def session_put(self, session_id: str, info: dict[str, Any], ttl_ms: int) -> None:
        """See TaskStore.session_put."""
        await self._write(
            lambda: self._cache.set("session:" + session_id, dict(info), expire=max(1, ttl_ms) / 1000),
            fsync=False,
        )

    async def session_get(self, session_id: str) -> dict[str, Any] | None:
        """See TaskStore.session_get."""
        value = self._read("session:" + session_id)
        return None if value is None else dict(value)

    async def session_delete(self, session_id: str) -> None:
        """See TaskStore.session_delete."""
        await self._write(lambda: self._cache.delete("session:" + session_id), fsync=False)

    # -- leases, retention, health ------------------------------------------------------------

    async def renew_lease(self, node: str, ttl_ms: int) -> None:
        """See TaskStore.renew_lease."""
        await self._write(lambda: self._cache.set("node:" + node, {"pid": os.getpid()}, expire=ttl_ms / 1000))

    async def release_lease(self, node: str) -> None:
        """See TaskStore.release_lease."""
        await self._write(lambda: self._cache.delete("node:" + node))

    async def lease_alive(self, node: str) -> bool:
        """See TaskStore.lease_alive."""
        try:
            return ("node:" + node) in self._cache
        except _STORE_ERRORS as exc:
            raise StoreUnavailableError(f"task store {self.path}: {exc}") from exc

    async def purge_expired(self) -> int:
        """See TaskStore.purge_expired (runs on the writer thread, outside any batch)."""
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, self._cache.expire)
        except _STORE_ERRORS as exc:
            raise StoreUnavailableError(f"task store {self.path}: {exc}") from exc

    async def check_writable(self) -> None:
        """See TaskStore.check_writable; also fails when `cache.db` was deleted or replaced under the
        running proxy (writes would go to a file nobody will open again)."""
        try:
            inode = os.stat(os.path.join(self.path, "cache.db")).st_ino
        except OSError:
            inode = None
        if inode != self._inode:
            raise StoreUnavailableError(
                f"task store {self.path}: cache.db was deleted or replaced while the proxy ran; what it "
                "writes now is lost at the next start. Restart the proxy (it then refuses the store and "
                "names the way to recover)"
            )
        await self._write(lambda: (self._cache.set("probe:", now_ms()), self._cache.delete("probe:")))

    async def live_count(self, principal: str) -> int | None:
        """See TaskStore.live_count: None (the one process serving this directory counts its calls)."""
        return None

    async def count(self) -> int:
        """See TaskStore.count."""
        try:
            row = self._reader.execute(
                "SELECT COUNT(*) FROM Cache WHERE key >= 'task:' AND key < 'task;' AND raw = 1"
            ).fetchone()
        except sqlite3.Error as exc:
            raise StoreUnavailableError(f"task store {self.path}: {exc}") from exc
        return int(row[0])

    async def volume(self) -> int:
        """See TaskStore.volume."""
        try:
            return int(self._cache.volume())
        except _STORE_ERRORS as exc:
            raise StoreUnavailableError(f"task store {self.path}: {exc}") from exc

    async def close(self) -> None:
        """See TaskStore.close; also releases the serving lock."""
        if self._flusher is not None:
            await asyncio.gather(self._flusher, return_exceptions=True)
        if self._checkpoint is not None:
            await asyncio.gather(self._checkpoint, return_exceptions=True)
        if self._checkpoint_con is not None:
            self._checkpointer.submit(self._checkpoint_con.close).result()
        self._close_now()

    def _release_lock(self) -> None:
        if self._locked:
            unlock_directory(self.path)
            self._locked = False


def _owner(principal: str, server: str) -> str:
    """The `own:` entry of a record of `principal` on `server`: who may read it, without reading it."""
    return f"{principal_key(principal)}{_SEP}{server}"


def _matches(record: TaskRecord, where: ListFilter) -> bool:
    return (
        (where.server is None or record.server == where.server)
        and (where.status is None or record.status.value == where.status)
        and (where.tool is None or record.tool == where.tool)
    )
