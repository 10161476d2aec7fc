"""Open the task store a config names: diskcache (`store.path`) or Redis (`store.url`), with the
rate-limit counters and the MRTR key that go with it."""

from __future__ import annotations

from limits.aio.storage import Storage

from proxy.config.sections import StoreConfig
from proxy.tasks.diskcache_store import DiskcacheStore
from proxy.tasks.rates import redis_rate_storage
from proxy.tasks.redis_store import RedisTaskStore
from proxy.tasks.store import TaskStore


def open_store(store: StoreConfig, *, max_result_bytes: int, exclusive: bool) -> TaskStore:
    """The store of `store`: RedisTaskStore for `url` (connects at the first call), else a
    DiskcacheStore on `path` (`exclusive`: take its serving lock, StoreLockedError when held).
    Raises StoreUnavailableError."""
    if store.url is not None:
        return RedisTaskStore(
            store.url, prefix=store.prefix, max_result_bytes=max_result_bytes, timeout_s=store.timeout
        )
    return DiskcacheStore(
        store.path, durable=store.durable, exclusive=exclusive, max_result_bytes=max_result_bytes
    )


def rate_storage(store: StoreConfig) -> Storage | None:
    """Where `tasks_rate` counters live: Redis (shared by replicas) for a Redis store, else None (memory)."""
    if store.url is None:
        return None
    return redis_rate_storage(store.url, prefix=store.prefix, timeout_s=store.timeout)
