"""The shared task store: Redis (redis-py's asyncio client) behind `TaskStore`, for replicas.

Many proxy processes (replicas) serve from one Redis: there is no directory lock; each process is
a node with its own lease. Key layout and the atomic Lua scripts are in `redis_keys.py`; change
events (waits, changes of other replicas) in `redis_events.py`.

- A create or a change is one Lua script: the record, its indexes, the `live` entries (the
  orphan sweep's, and the principal's set that `limits.max_tasks_per_principal` counts across
  replicas: a create past the cap is refused in that same step), the expiry entry and the change
  message are written together. A change reads the record, applies `model.apply` here, and
  commits only if the version it read is still stored (compare and set, retried a bounded number
  of times), so two writers never both win a transition.
- Retention: a running task's record has no TTL; once terminal its key gets a TTL ending at
  `terminal_ms + ttl_ms`; `purge_expired` drops index entries of expired records.
- Durability is Redis's: a write is acknowledged once Redis has it in memory and, with
  `appendonly yes` + `appendfsync always`, on disk (README "Redis store").
- Every Redis call is bounded (`timeout_s` for connecting, each read, and waiting for a pooled
  connection); every Redis error becomes StoreUnavailableError naming the store by its URL
  without the password.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import secrets
from collections.abc import AsyncIterator, Callable
from typing import Any

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from proxy.config.base import redact_url, url_password
from proxy.tasks.model import Change, TaskRecord, TaskStatus, apply, now_ms, principal_key
from proxy.tasks.redis_events import POLL_S, ChangeFeed
from proxy.tasks.redis_keys import (
    CREATE,
    DEFAULT_PREFIX,
    GET_FOR,
    PURGE,
    SEP,
    UPDATE,
    RedisKeys,
    change_message,
    owner_field,
)
from proxy.tasks.store import (
    LeaseLapsedError,
    Listener,
    ListFilter,
    LiveLimitError,
    StoreUnavailableError,
    TaskExistsError,
    TaskNotFoundError,
    owned_by,
)

LIST_SCAN_LIMIT = 5000  # index entries one listing call may read while filtering (then it returns a cursor)
CAS_ATTEMPTS = 100  # compare-and-set rounds one change may take under contention before giving up
PURGE_BATCH = 500  # expired records one purge script forgets at a time


class RedisTaskStore:
    """Task records in Redis; see the module docstring.

    `url`: `redis://[[user]:password@]host[:port][/db]` or `rediss://` (TLS). `prefix`: the start
    of every key (several proxies may share a Redis under different prefixes). `timeout_s` (s):
    bound on connecting, on each reply, and on waiting for one of `max_connections` pooled
    connections, and on each call in all (`guard`: a call that fails on a connection error is tried
    once more within that bound). `max_result_bytes` feeds `model.apply`. Raises
    StoreUnavailableError for a URL redis-py cannot use; connecting happens at the first call.
    """

    def __init__(
        self,
        url: str,
        *,
        prefix: str = DEFAULT_PREFIX,
        max_result_bytes: int = 16 * 1024 * 1024,
        timeout_s: float = 5.0,
        max_connections: int = 64,
    ) -> None:
        self.where = redact_url(url)
        self.damage: str | None = None  # Redis has no files of ours to check
        self._password = url_password(url)
        self.max_result_bytes = max_result_bytes
        self.timeout_s = timeout_s
        self.keys = RedisKeys(prefix)
        try:
            self._pool = BlockingConnectionPool.from_url(
                url,
                max_connections=max_connections,
                timeout=timeout_s,
                socket_timeout=timeout_s,
                socket_connect_timeout=timeout_s,
                retry=Retry(
                    ExponentialBackoff(cap=0.2, base=0.05), 1
                ),  # one retry: a connection Redis dropped is re-made once
            )
        except (ValueError, RedisError) as exc:
            raise StoreUnavailableError(self._message(exc)) from None
        self.redis = Redis(connection_pool=self._pool)
        self._create = self.redis.register_script(CREATE)
        self._update = self.redis.register_script(UPDATE)
        self._get_for = self.redis.register_script(GET_FOR)
        self._purge = self.redis.register_script(PURGE)
        self._listeners: list[Listener] = []
        self.feed = ChangeFeed(self.redis, self.keys.changes, secrets.token_hex(8), self.get)

    # -- errors and events --------------------------------------------------------------------

    def _message(self, exc: BaseException) -> str:
        text = f"{exc.__class__.__name__}: {exc}" if str(exc) else exc.__class__.__name__
        if isinstance(exc, (TimeoutError, RedisTimeoutError)) and not str(exc):  # (they may say nothing)
            text += f" (no answer within {self.timeout_s:g} s: store.timeout)"
        if self._password:
            text = text.replace(self._password, "***")
        return f"task store {self.where}: {text}"

    @contextlib.asynccontextmanager
    async def guard(self) -> AsyncIterator[None]:
        """Bound the block by `timeout_s` (s) in all (a pooled connection, the command, its one
        retry), and turn Redis and socket errors inside it, and the bound, into
        StoreUnavailableError naming the store: a replica cut off from Redis answers 503 in that
        time, not after each layer's own timeout in turn."""
        try:
            async with asyncio.timeout(self.timeout_s):
                yield
        except (RedisError, OSError) as exc:
            raise StoreUnavailableError(self._message(exc)) from None
        except TimeoutError:
            raise StoreUnavailableError(
                f"task store {self.where}: no answer within {self.timeout_s:g} s (store.timeout)"
            ) from None

    def add_listener(self, listener: Listener) -> None:
        """Call `listener(previous status or None on create, record)` after each change this store commits."""
        self._listeners.append(listener)

    def add_remote_listener(self, listener: Listener) -> None:
        """Call `listener(previous status or None, record)` for the changes committed by every store
        object on this Redis under this prefix (all replicas), this one's included; see
        `redis_events`. Other replicas' changes arrive a pub/sub hop later; a record too large to
        travel in the message is read, so it may already be newer than the change."""
        self.feed.listeners.append(listener)
        self.feed.ensure_running()

    def add_damage_listener(self, listener: Callable[[BaseException], None]) -> None:
        """See TaskStore.add_damage_listener: never called (Redis has no files of ours to damage)."""

    def add_gap_listener(self, listener: Callable[[], None]) -> None:
        """See TaskStore.add_gap_listener: called when the pub/sub connection is back after a drop
        (other replicas' changes meanwhile were not delivered)."""
        self.feed.gap_listeners.append(listener)
        self.feed.ensure_running()

    def _committed(self, before: TaskStatus | None, record: TaskRecord) -> None:
        for listener in self._listeners:
            listener(before, record)
        self.feed.committed_here(before, record)

    # -- records ------------------------------------------------------------------------------

    def _retention(self, record: TaskRecord) -> tuple[str, str, str]:
        """(ttl ms, exp member, exp score) for a terminal record with a retention, else empty strings."""
        expires = record.expires_ms
        if expires is None:
            return "", "", ""
        return str(max(1, expires - now_ms())), self.keys.expiry_member(record), str(expires)

    async def create(self, record: TaskRecord, *, max_live: int | None = None, leased: bool = False) -> None:
        """See TaskStore.create: `max_live` is checked against the principal's `live:p` set (every
        replica's live tasks), and `leased` against the owner's `node:` key, inside the create
        script. Raises TaskExistsError (the id exists), LeaseLapsedError (`leased`, a live record whose
        owner's lease has lapsed), LiveLimitError (the principal has `max_live` live tasks),
        StoreUnavailableError."""
        data = json.dumps(record.to_dict(), separators=(",", ":"))
        member, by_principal, by_server = self.keys.record_keys(record)
        ttl, exp_member, exp_score = self._retention(record)
        owner = "" if record.status.terminal else record.owner
        message = change_message(self.feed.origin, None, record, data)
        async with self.guard():
            created = await self._create(
                keys=[
                    self.keys.task(record.task_id),
                    self.keys.all,
                    by_principal,
                    by_server,
                    self.keys.live,
                    self.keys.expiring,
                    self.keys.live_of(principal_key(record.principal)),
                ],
                args=[
                    data,
                    record.version,
                    member,
                    record.task_id,
                    owner,
                    ttl,
                    exp_member,
                    exp_score,
                    self.keys.changes,
                    message,
                    "" if max_live is None else max_live,
                    self.keys.prefix,
                    "1" if leased else "",
                    owner_field(principal_key(record.principal), record.server),
                ],
            )
        if created == 0:
            raise TaskExistsError(f"task {record.task_id} already exists")
        if created == 2:
            raise LeaseLapsedError(f"task store {self.where}: the lease of node {record.owner} has lapsed")
        if created < 0:
            raise LiveLimitError(record.principal, -int(created), max_live or 0)
        self._committed(None, record)

    async def _read(self, task_id: str) -> tuple[TaskRecord, bytes | str] | None:
        async with self.guard():
            data, version = await self.redis.hmget(self.keys.task(task_id), ["d", "v"])
        if data is None or version is None:
            return None
        return TaskRecord.from_dict(json.loads(data)), version

    async def get(self, task_id: str) -> TaskRecord | None:
        """See TaskStore.get."""
        found = await self._read(task_id)
        return None if found is None else found[0]

    async def get_for(self, task_id: str, principal: str, server: str) -> tuple[TaskRecord | None, bool]:
        """See TaskStore.get_for: one round trip, in which Redis compares the record's owner field
        with the asker's, so someone else's record is never sent or decoded (it costs what an
        unknown id does, whatever its size)."""
        async with self.guard():
            found = await self._get_for(
                keys=[self.keys.task(task_id)], args=[owner_field(principal_key(principal), server)]
            )
        if found == -1:
            return None, True
        data, version = found
        if data is None or version is None:
            return None, False
        return owned_by(TaskRecord.from_dict(json.loads(data)), principal, server)

    async def update(self, task_id: str, change: Change) -> TaskRecord:
        """See TaskStore.update. Raises StoreUnavailableError after CAS_ATTEMPTS lost races."""
        for _ in range(CAS_ATTEMPTS):
            found = await self._read(task_id)
            if found is None:
                raise TaskNotFoundError(task_id)
            record, version = found
            new = apply(record, change, at_ms=now_ms(), max_result_bytes=self.max_result_bytes)
            data = json.dumps(new.to_dict(), separators=(",", ":"))
            ttl, exp_member, exp_score = self._retention(new)
            owner = "" if new.status.terminal else new.owner
            message = change_message(self.feed.origin, record.status.value, new, data)
            async with self.guard():
                done = await self._update(
                    keys=[
                        self.keys.task(task_id),
                        self.keys.live,
                        self.keys.expiring,
                        self.keys.live_of(principal_key(record.principal)),
                    ],
                    args=[
                        version,
                        data,
                        new.version,
                        task_id,
                        owner,
                        ttl,
                        exp_member,
                        exp_score,
                        self.keys.changes,
                        message,
                    ],
                )
            if done == -1:
                raise TaskNotFoundError(task_id)
            if done == 1:
                self._committed(record.status, new)
                return new
        raise StoreUnavailableError(
            f"task store {self.where}: task {task_id} changed {CAS_ATTEMPTS} times while one change was "
            f"applied"
        )

    async def _records(self, task_ids: list[str]) -> list[TaskRecord | None]:
        """The records of `task_ids` (None where gone), in one round trip."""
        if not task_ids:
            return []
        async with self.guard():
            async with self.redis.pipeline(transaction=False) as pipe:
                for task_id in task_ids:
                    pipe.hget(self.keys.task(task_id), "d")
                rows = await pipe.execute()
        return [None if row is None else TaskRecord.from_dict(json.loads(row)) for row in rows]

    def _index(self, where: ListFilter) -> tuple[str, str]:
        """(scope name for cursors, index key) that lists `where`."""
        if where.principal is None:
            return "a", self.keys.all
        pkey = principal_key(where.principal)
        if where.server is None:
            return f"p:{pkey}", self.keys.by_principal(pkey)
        skey = principal_key(where.server)
        return f"ps:{pkey}:{skey}", self.keys.by_server(pkey, skey)

    async def list_tasks(
        self, where: ListFilter, *, cursor: str | None = None, limit: int = 50
    ) -> tuple[list[TaskRecord], str | None]:
        """See TaskStore.list_tasks. The cursor is the scope and the last index member read,
        base64url-encoded."""
        scope, index = self._index(where)
        start = "-"
        if cursor is not None:
            try:
                decoded = base64.urlsafe_b64decode(cursor.encode()).decode()
            except (ValueError, UnicodeDecodeError):
                raise ValueError("invalid cursor") from None
            cursor_scope, _, last = decoded.partition("\x1e")
            if cursor_scope != scope or SEP not in last:
                raise ValueError("invalid cursor")
            start = "(" + last
        found: list[TaskRecord] = []
        scanned = 0
        last_read: str | None = None
        while len(found) < limit and scanned < LIST_SCAN_LIMIT:
            async with self.guard():
                raw = await self.redis.zrangebylex(
                    index, start, "+", start=0, num=min(500, LIST_SCAN_LIMIT - scanned)
                )
            if not raw:
                return found, None
            members = [_text(m) for m in raw]
            records = await self._records([m.rsplit(SEP, 1)[1] for m in members])
            for member, record in zip(members, records, strict=True):
                scanned += 1
                last_read = member
                if record is not None and _matches(record, where):
                    found.append(record)
                    if len(found) == limit:
                        break
            start = "(" + str(last_read)
        async with self.guard():
            more = await self.redis.zrangebylex(index, start, "+", start=0, num=1)
        if not more or last_read is None:
            return found, None
        return found, base64.urlsafe_b64encode(f"{scope}\x1e{last_read}".encode()).decode()

    async def wait_for_change(self, task_id: str, version: int, timeout_s: float) -> TaskRecord | None:
        """See TaskStore.wait_for_change. Any replica's change wakes the wait (pub/sub); the record is
        also re-read every POLL_S seconds in case a message was lost."""
        self.feed.ensure_running()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0.0, timeout_s)
        while True:
            with self.feed.waiter(task_id) as event:
                record = await self.get(task_id)
                remaining = deadline - loop.time()
                if record is None or record.version != version or remaining <= 0:
                    return record
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(event.wait(), timeout=min(remaining, POLL_S))

    async def live_tasks(self) -> list[TaskRecord]:
        """See TaskStore.live_tasks."""
        async with self.guard():
            ids = [_text(key) for key in await self.redis.hkeys(self.keys.live)]
        return [r for r in await self._records(ids) if r is not None and not r.status.terminal]

    # -- leases, retention, health ------------------------------------------------------------

    async def renew_lease(self, node: str, ttl_ms: int) -> None:
        """See TaskStore.renew_lease (`SET node-key PX ttl_ms`)."""
        self.feed.ensure_running()
        async with self.guard():
            await self.redis.set(self.keys.node(node), str(now_ms()), px=max(1, ttl_ms))

    async def instance_id(self) -> str:
        """The Redis server's `run_id` (changes when the server restarts). Raises StoreUnavailableError."""
        async with self.guard():
            info = await self.redis.info("server")
        return str(info.get("run_id", ""))

    async def release_lease(self, node: str) -> None:
        """See TaskStore.release_lease."""
        async with self.guard():
            await self.redis.delete(self.keys.node(node))

    async def lease_alive(self, node: str) -> bool:
        """See TaskStore.lease_alive."""
        async with self.guard():
            return bool(await self.redis.exists(self.keys.node(node)))

    async def purge_expired(self) -> int:
        """See TaskStore.purge_expired (Redis already dropped the records; this drops their index entries)."""
        total = 0
        while True:
            async with self.guard():
                count = int(
                    await self._purge(
                        keys=[self.keys.expiring, self.keys.all, self.keys.live],
                        args=[now_ms(), PURGE_BATCH, self.keys.prefix],
                    )
                )
            total += count
            if count < PURGE_BATCH:
                return total

    async def check_writable(self) -> None:
        """See TaskStore.check_writable (a SET and a DEL; Redis refuses writes when its disk fails)."""
        self.feed.ensure_running()
        async with self.guard():
            await self.redis.set(self.keys.probe, str(now_ms()), px=10_000)
            await self.redis.delete(self.keys.probe)

    async def live_count(self, principal: str) -> int | None:
        """See TaskStore.live_count: the size of the principal's `live:p` set."""
        async with self.guard():
            return int(await self.redis.scard(self.keys.live_of(principal_key(principal))))

    async def count(self) -> int:
        """See TaskStore.count (index entries: records Redis expired count until `purge_expired`)."""
        async with self.guard():
            return int(await self.redis.zcard(self.keys.all))

    async def volume(self) -> int:
        """See TaskStore.volume: the memory the whole Redis server uses (`used_memory`, bytes)."""
        async with self.guard():
            info = await self.redis.info("memory")
        return int(info.get("used_memory", 0))

    async def persistence_report(self) -> tuple[str, str]:
        """(`warning` | `info`, sentence) about what a Redis crash would lose, from `CONFIG GET
        appendonly`, `appendfsync` and `save`. A Redis that refuses CONFIG gives a warning saying
        persistence could not be checked. Raises StoreUnavailableError when Redis does not answer."""
        settings: dict[Any, Any] = {}
        try:
            for name in ("appendonly", "appendfsync", "save"):
                settings.update(await self.redis.config_get(name))
        except ResponseError:
            return (
                "warning",
                f"task store {self.where}: could not check Redis persistence (CONFIG GET refused): make sure "
                f"appendonly is on",
            )
        except (RedisError, OSError) as exc:
            raise StoreUnavailableError(self._message(exc)) from None
        values = {_text(k): _text(v) for k, v in settings.items()}
        aof, fsync, save = values.get("appendonly", ""), values.get("appendfsync", ""), values.get("save", "")
        if aof == "yes":
            lost = (
                "nothing acknowledged"
                if fsync == "always"
                else "up to about 1 s of commits"
                if fsync == "everysec"
                else "the commits the OS had not flushed"
            )
            return (
                "info",
                f"task store {self.where}: Redis appendonly yes, appendfsync {fsync}: a Redis crash loses "
                f"{lost}",
            )
        if save:
            return "warning", (
                f"task store {self.where}: Redis appendonly is off (only RDB snapshots, save '{save}'): "
                "a Redis crash loses every commit since the last snapshot"
            )
        return (
            "warning",
            f"task store {self.where}: Redis persistence is off (appendonly no, save ''): every task is lost "
            f"when Redis restarts",
        )

    # -- small shared state (MRTR, legacy sessions) ----------------------------------------

    async def claim_once(self, key: str, ttl_ms: int) -> bool:
        """True for the first claim of `key` within `ttl_ms` (across all replicas), False after (`SET NX
        PX`)."""
        async with self.guard():
            return bool(await self.redis.set(self.keys.once(key), b"1", nx=True, px=max(1, ttl_ms)))

    async def claimed(self, key: str) -> bool:
        """True while `key` is claimed."""
        async with self.guard():
            return bool(await self.redis.exists(self.keys.once(key)))

    async def put_blob(
        self, key: str, value: bytes, ttl_ms: int | None = None, *, only_new: bool = False
    ) -> bool:
        """Store `value` under `key` (expiring after `ttl_ms`, or never); with `only_new`, only when
        `key` is absent. Returns whether it was written."""
        async with self.guard():
            return bool(
                await self.redis.set(
                    self.keys.blob(key), value, nx=only_new, px=None if ttl_ms is None else max(1, ttl_ms)
                )
            )

    async def get_blob(self, key: str) -> bytes | None:
        """The value under `key`, or None."""
        async with self.guard():
            value = await self.redis.get(self.keys.blob(key))
        return None if value is None else value if isinstance(value, bytes) else value.encode()

    async def delete_blob(self, key: str) -> None:
        """Forget the value under `key` (DEL)."""
        async with self.guard():
            await self.redis.delete(self.keys.blob(key))

    async def session_put(self, session_id: str, info: dict[str, Any], ttl_ms: int) -> None:
        """Keep `info` (JSON-able) for a legacy session id, for `ttl_ms` from now (a put refreshes it)."""
        async with self.guard():
            await self.redis.set(
                self.keys.session(session_id), json.dumps(info, separators=(",", ":")), px=max(1, ttl_ms)
            )

    async def session_get(self, session_id: str) -> dict[str, Any] | None:
        """The info of a legacy session id, or None when unknown or expired."""
        async with self.guard():
            value = await self.redis.get(self.keys.session(session_id))
        return None if value is None else dict(json.loads(value))

    async def session_keys(self, prefix: str) -> list[str]:
        """The session-map keys starting with `prefix` (SCAN, so it never blocks Redis), at most 1000."""
        start = self.keys.session("")
        found: list[str] = []
        async with self.guard():
            async for key in self.redis.scan_iter(match=self.keys.session(prefix) + "*", count=200):
                found.append(_text(key).removeprefix(start))
                if len(found) >= 1000:
                    break
        return found

    async def session_delete(self, session_id: str) -> None:
        """Forget a legacy session id."""
        async with self.guard():
            await self.redis.delete(self.keys.session(session_id))

    async def close(self) -> None:
        """See TaskStore.close: stops the change feed and closes the connections."""
        await self.feed.close()
        with contextlib.suppress(RedisError, OSError):
            await self.redis.aclose()
        with contextlib.suppress(RedisError, OSError):
            await self._pool.aclose()


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _matches(record: TaskRecord, where: ListFilter) -> bool:
    return (
        (where.server is None or record.server == where.server)
        and (where.status is None or record.status.value == where.status)
        and (where.tool is None or record.tool == where.tool)
    )
