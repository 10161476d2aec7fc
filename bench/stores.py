"""Seeded task stores for the bench, filled fast and cached between runs in bench/.cache (git-ignored).

A store of N completed tasks (principal `anonymous`, server `bench`, a small result) is written in
one SQLite transaction through the store's own record and key layout (`DiskcacheStore`), about
25 µs per task here; it is then kept under bench/.cache/store-<N>-<layout hash> and copied into the
run's work directory (the proxy writes its lease into the store it serves). The layout hash covers
`TaskRecord`'s fields and `to_dict` and the store's `create` / `_index_keys` as imported (so
`--ref` gets a store of its own layout when the layout changed). Records keep a 400-day TTL so a
cached store stays valid.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from pathlib import Path

CACHE = Path(__file__).resolve().parent / ".cache"
SERVER = "bench"
TTL_MS = 400 * 24 * 3600 * 1000


def _layout_hash() -> str:
    import inspect
    from dataclasses import fields

    from proxy.tasks import diskcache_store, model

    h = hashlib.sha256(repr([(f.name, str(f.type)) for f in fields(model.TaskRecord)]).encode())
    h.update(inspect.getsource(model.TaskRecord.to_dict).encode())
    h.update(inspect.getsource(diskcache_store.DiskcacheStore._index_keys).encode())
    h.update(inspect.getsource(diskcache_store.DiskcacheStore.create).encode())
    return h.hexdigest()[:10]


def fill(path: Path, n: int) -> list[str]:
    """Write N completed tasks into a new store at `path` in one transaction; return their ids."""
    import logging

    import structlog

    # no log line per record
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    from proxy.tasks.diskcache_store import DiskcacheStore
    from proxy.tasks.model import TaskRecord, TaskStatus, new_task_id, now_ms

    if path.exists():
        shutil.rmtree(path)
    now = now_ms()
    outcome = {"result": {"content": [{"type": "text", "text": "report ready"}], "isError": False}}
    store = DiskcacheStore(path, durable=False)
    ids: list[str] = []
    try:
        cache = store._cache
        with cache.transact():
            for _ in range(n):
                r = TaskRecord(
                    task_id=new_task_id(),
                    principal="anonymous",
                    server=SERVER,
                    tool="slow_report",
                    created_ms=now,
                    ttl_ms=TTL_MS,
                    poll_interval_ms=500,
                    owner="bench-fill",
                    status=TaskStatus.COMPLETED,
                    status_message="done",
                    terminal_ms=now,
                    outcome=outcome,
                )
                expire = store._expire_s(r)
                cache.add("task:" + r.task_id, r.to_dict(), expire=expire)
                for key in store._index_keys(r):
                    cache.set(key, 1, expire=expire)
                ids.append(r.task_id)
    finally:
        store._executor.shutdown(wait=True)
        store._checkpointer.shutdown(wait=True)
        store._reader.close()
        store._cache.close()
    return ids


def _checkpoint(path: Path) -> None:
    wal = path / "cache.db-wal"
    if wal.exists() and wal.stat().st_size > 0:
        import sqlite3

        con = sqlite3.connect(path / "cache.db", isolation_level=None)
        try:
            con.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
        finally:
            con.close()


def seeded_store(dest: Path, n: int, log=print) -> tuple[list[str], float, bool]:
    """A store of N tasks at `dest` (a copy of the cached one, filled first if needed).

    Returns (task ids, seconds spent filling or copying, whether the cache was hit)."""
    t0 = time.perf_counter()
    cached = CACHE / f"store-{n}-{_layout_hash()}"
    ids_file = cached / "bench-ids.json"
    hit = ids_file.exists()
    if not hit:
        CACHE.mkdir(exist_ok=True)
        tmp = cached.with_name(cached.name + ".partial")
        log(f"  filling a store with {n} tasks into {cached} (cached for later runs) ...")
        ids = fill(tmp, n)
        (tmp / "bench-ids.json").write_text(json.dumps(ids))
        if cached.exists():
            shutil.rmtree(cached)
        tmp.rename(cached)
    # a store as a running proxy leaves it: the WAL folded in (a 1 GB WAL costs seconds at first open)
    _checkpoint(cached)
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(cached, dest, ignore=shutil.ignore_patterns("bench-ids.json"))
    return json.loads(ids_file.read_text()), time.perf_counter() - t0, hit
