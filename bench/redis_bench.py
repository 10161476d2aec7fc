"""Redis pieces of the benchmark (sections b and c measure the Redis store beside diskcache).

A redis-server is started the way the tests start one (tests/support/redis_server.py: a free loopback
port, its own directory, `--save ''`, AOF on with the given `appendfsync`), pinned like the proxy.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent / "tests"))

from support.redis_server import RedisServer, redis_server_binary  # noqa: E402


def redis_available() -> bool:
    """True when `redis-server` is installed."""
    return redis_server_binary() is not None


def start_redis(workdir: Path, name: str, *, appendfsync: str, cpus: str | None) -> RedisServer:
    """A redis-server in `workdir/name` with AOF on and `appendfsync` (`always` or `everysec`), pinned to
    `cpus`."""
    launcher = (sys.executable, str(BENCH / "pinned.py"), cpus) if cpus is not None else ()
    return RedisServer(workdir / name, appendfsync=appendfsync, launcher=launcher).start()


def redis_store(url: str, prefix: str) -> dict:
    """The `store` section of a proxy config on this Redis under `prefix`."""
    return {"url": url, "prefix": prefix}


def fill_redis(url: str, prefix: str, n: int, server: str) -> tuple[list[str], float]:
    """N completed tasks of principal `anonymous` on `server`, made 64 at a time; returns (ids, seconds)."""
    import logging

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    from proxy.tasks.model import TaskRecord, TaskStatus, new_task_id, now_ms
    from proxy.tasks.redis_store import RedisTaskStore

    ids: list[str] = []
    now = now_ms()
    outcome = {"result": {"content": [{"type": "text", "text": "report ready"}], "isError": False}}

    async def fill() -> None:
        store = RedisTaskStore(url, prefix=prefix, timeout_s=30)
        try:
            for start in range(0, n, 64):
                records = [
                    TaskRecord(
                        task_id=new_task_id(),
                        principal="anonymous",
                        server=server,
                        tool="slow_report",
                        created_ms=now,
                        ttl_ms=24 * 3600 * 1000,
                        poll_interval_ms=500,
                        owner="bench-fill",
                        status=TaskStatus.COMPLETED,
                        status_message="done",
                        terminal_ms=now,
                        outcome=outcome,
                    )
                    for _ in range(start, min(n, start + 64))
                ]
                await asyncio.gather(*(store.create(r) for r in records))
                ids.extend(r.task_id for r in records)
        finally:
            await store.close()

    t0 = time.perf_counter()
    asyncio.run(fill())
    return ids, time.perf_counter() - t0
