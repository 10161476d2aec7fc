"""Small shared state of the diskcache store: single-use claims, blobs, the legacy session map.

The same API as the Redis store (`TaskStore.claim_once`, `put_blob`, `get_blob`, `session_*`),
kept in the store directory under `once:`, `blob:` and `session:` keys with diskcache expiry,
and written through the store's single writer (so a claim is atomic across this process's tasks).
`DiskcacheStore` mixes this in; it provides `_write`, `_cache`, `path` and `_listeners`.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from typing import Any

import diskcache

from proxy.tasks.model import TaskRecord, TaskStatus
from proxy.tasks.store import StoreUnavailableError

_STORE_ERRORS = (OSError, sqlite3.Error, diskcache.Timeout)


class DiskcacheSharedState:
    """Mixin for `DiskcacheStore`; see the module docstring."""

    path: str
    _cache: diskcache.Cache
    _listeners: list[Callable[[TaskStatus | None, TaskRecord], None]]

    async def _write(self, op: Callable[[], Any], *, fsync: bool = True) -> Any:
        raise NotImplementedError

    def _read(self, key: str) -> Any:
        try:
            return self._cache.get(key)
        except _STORE_ERRORS as exc:
            raise StoreUnavailableError(f"task store {self.path}: {exc}") from exc

    def add_remote_listener(self, listener: Callable[[TaskStatus | None, TaskRecord], None]) -> None:
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
