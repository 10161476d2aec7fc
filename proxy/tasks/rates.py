"""The `tasks_rate` limit (tasks/* calls per principal) and the `failed_auth` limit (wrong credentials
per client address), each a moving window of the `limits` library.

Counters live in the process (`limits`' memory storage) with the diskcache store, and in Redis
(`limits`' async Redis storage on redis-py, keys under `<store prefix>limits`) with the Redis
store, so replicas share one count per principal.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import time

import limits as limits_lib
import structlog
from limits.aio.storage import MemoryStorage, RedisStorage, Storage
from limits.aio.strategies import MovingWindowRateLimiter
from limits.errors import StorageError

from proxy.protocol.jsonrpc import INTERNAL_ERROR, JsonRpcError, limit_error
from proxy.runtime import metrics
from proxy.tasks.model import principal_hash, principal_key

log = structlog.get_logger("proxy.tasks")


def redis_rate_storage(url: str, *, prefix: str, timeout_s: float) -> RedisStorage:
    """`limits`' async Redis storage on redis-py for a `redis://` or `rediss://` `url`, keys under
    `<prefix>limits`, each call bounded by `timeout_s` (s). Storage errors raise StorageError."""
    return RedisStorage(
        "async+" + url,
        implementation="redispy",
        key_prefix=prefix + "limits",
        wrap_exceptions=True,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
    )


async def close_rate_storage(storage: Storage | None) -> None:
    """Close the Redis connections of a storage from `redis_rate_storage` (nothing for None or memory)."""
    client = getattr(getattr(storage, "bridge", None), "storage", None)
    if client is not None and hasattr(client, "aclose"):
        with contextlib.suppress(Exception):
            await client.aclose()


class TaskRate:
    """`rate` (`N/second`-style, None: no limit) per principal over `storage` (default: in memory).
    `where` names the store in errors."""

    def __init__(self, rate: str | None, storage: Storage | None = None, *, where: str = "") -> None:
        self.text = rate
        self._rate = limits_lib.parse(rate) if rate else None
        self._limiter = MovingWindowRateLimiter(storage or MemoryStorage()) if self._rate else None
        self.where = where

    async def check(self, principal: str) -> None:
        """Count one call of `principal`. Raises a limit error (HTTP 429) past the rate, and
        JsonRpcError -32603 (HTTP 503) when the counters cannot be reached (Redis down). The limit
        error carries the seconds until the window lets `principal` in again (`Retry-After`)."""
        if self._limiter is None or self._rate is None:
            return
        try:
            allowed = await self._limiter.hit(self._rate, principal_key(principal))
            wait_s = (
                None
                if allowed
                else await _seconds_until_free(self._limiter, self._rate, principal_key(principal))
            )
        except (StorageError, OSError) as exc:
            reason = exc.storage_error if isinstance(exc, StorageError) else exc
            message = (
                f"task store {self.where}: the tasks_rate counters cannot be reached "
                f"({reason.__class__.__name__})"
            )
            raise JsonRpcError(INTERNAL_ERROR, message, {"store": self.where}, status=503) from None
        if not allowed:
            log.warning("limit_refused", limit="tasks_rate", principal=principal_hash(principal))
            metrics.LIMIT_REJECTIONS.labels("tasks_rate").inc()
            raise limit_error(
                "tasks_rate",
                f"more than {self.text} tasks/* calls; retry after {wait_s} s",
                retry_after_s=wait_s,
                rate=self.text,
            )


async def _seconds_until_free(
    limiter: MovingWindowRateLimiter, rate: limits_lib.RateLimitItem, *key: str
) -> int:
    """Whole seconds (at least 1) until the moving window of `rate` under `key` frees a place."""
    stats = await limiter.get_window_stats(rate, *key)
    return max(1, math.ceil(stats.reset_time - time.time()))


GOOD_CREDENTIALS_KEPT = 10_000  # digests of credentials that verified, which skip the throttle check


class FailedAttempts:
    """The `failed_auth` limit: wrong credentials per client address in a moving window (`limits`).

    `rate` is `N/minute`-style (None: no limit). Counters live in memory until `use_storage` gives
    the store's (Redis: shared by replicas). Every credential not yet known good counts as an
    attempt *before* it is verified (`admit`: one atomic hit of the counter), so requests sent in
    parallel cannot get more verifications than the rate allows; only a credential that verified
    once (`remember_good`, kept as a SHA-256 digest, at most GOOD_CREDENTIALS_KEPT, per process)
    skips the counter, so the hot path of a signed-in client costs no counter write. When the
    counters cannot be reached the attempt is let through (logged): an unreachable store must not
    lock every client out.
    """

    def __init__(self, rate: str | None) -> None:
        self.text = rate
        self._rate = limits_lib.parse(rate) if rate else None
        self._limiter = MovingWindowRateLimiter(MemoryStorage()) if self._rate else None
        self._good: dict[bytes, None] = {}

    def use_storage(self, storage: Storage | None) -> None:
        """Count in `storage` from now on (None: keep memory)."""
        if self._rate is not None and storage is not None:
            self._limiter = MovingWindowRateLimiter(storage)

    def known_good(self, credential: str) -> bool:
        """True when `credential` verified before (its check can be skipped)."""
        return self._digest(credential) in self._good

    def remember_good(self, credential: str) -> None:
        """Remember that `credential` verified (the oldest is forgotten past GOOD_CREDENTIALS_KEPT)."""
        self._good[self._digest(credential)] = None
        if len(self._good) > GOOD_CREDENTIALS_KEPT:
            del self._good[next(iter(self._good))]

    async def admit(self, credential: str, address: str, *, path: str) -> int | None:
        """Before `credential` from `address` is checked: None when it may be (it verified before, or
        the attempt fits the rate: it is counted), else the seconds until the window lets this
        address try again (at least 1; logged as `security_auth_throttled` with `path`, and counted
        in the limit rejections)."""
        if self._limiter is None or self._rate is None or self.known_good(credential):
            return None
        try:
            if await self._limiter.hit(self._rate, "auth", address):
                return None
            wait_s = await _seconds_until_free(self._limiter, self._rate, "auth", address)
        except (StorageError, OSError) as exc:
            log.warning("limit_unavailable", limit="failed_auth", reason=exc.__class__.__name__)
            return None
        log.warning("security_auth_throttled", remote=address, path=path, retry_after_s=wait_s)
        metrics.LIMIT_REJECTIONS.labels("failed_auth").inc()
        return wait_s

    @staticmethod
    def _digest(credential: str) -> bytes:
        return hashlib.sha256(credential.encode("utf-8", "surrogatepass")).digest()
