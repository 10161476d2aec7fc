"""Task records for tests that seed a store before a proxy opens it."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from proxy.tasks.diskcache_store import DiskcacheStore
from proxy.tasks.model import TaskRecord, now_ms


def make_record(**fields: Any) -> TaskRecord:
    """A task record with test defaults (principal `p`, server `s`, owner `ghost`); `fields` override."""
    defaults: dict[str, Any] = {
        "task_id": "task-1",
        "principal": "p",
        "server": "s",
        "tool": "t",
        "created_ms": now_ms(),
        "ttl_ms": 60_000,
        "poll_interval_ms": 500,
        "owner": "ghost",
    }
    record = TaskRecord(**{**defaults, **fields})
    if record.status.terminal and record.terminal_ms is None:
        record.terminal_ms = record.last_updated_ms
    return record


def seed_store(path: Path, *records: TaskRecord) -> None:
    """Write records into a diskcache store directory from synchronous test code."""

    async def seed() -> None:
        store = DiskcacheStore(path, durable=False)
        try:
            for record in records:
                await store.create(record)
        finally:
            await store.close()

    asyncio.run(seed())
