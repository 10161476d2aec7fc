"""Damage to the embedded store shows (issue "Reliability round 2", item 6): an emptied, deleted or
garbled database is refused at start with the file and the way to recover named, never served as a
new empty store; a page that fails to read at run time turns `/readyz` to 503 naming the store and
logs at error level."""

from __future__ import annotations

import asyncio
import gc
import os
import shutil
import sqlite3
from pathlib import Path

import aiohttp
import pytest
from support.clients import ModernClient
from support.proxy import Serve, make_config
from support.records import make_record
from support.servers import serve_on_store

from proxy.app import TASKS_KEY
from proxy.tasks import diskcache_store, walcheck
from proxy.tasks.diskcache_store import STORE_ID_FILE, DiskcacheStore
from proxy.tasks.model import TaskStatus, now_ms
from proxy.tasks.store import DamagedStoreError, StoreUnavailableError

RECORDS = 3000


async def _held_store(path: Path, records: int = 10) -> list[str]:
    """A store that has served (opened exclusively) and holds `records` completed tasks (nothing a
    restart rewrites); returns their ids."""
    store = DiskcacheStore(path, exclusive=True, durable=False)
    ids = [f"task-{n:05d}" for n in range(records)]
    done = {"status": TaskStatus.COMPLETED, "outcome": {"result": {"content": []}}, "terminal_ms": now_ms()}
    try:
        await asyncio.gather(
            *(
                store.create(make_record(task_id=i, principal="anonymous", server="legacy", **done))
                for i in ids
            )
        )
    finally:
        await store.close()
    return ids


def _checkpoint(path: Path) -> None:
    """Move every committed page into cache.db (and empty the WAL), as a clean shutdown leaves it."""
    with sqlite3.connect(path / "cache.db") as con:
        con.execute("PRAGMA wal_checkpoint(TRUNCATE)")


def _garble(database: Path) -> None:
    """Overwrite 8 KiB in the middle of `database` with pages no reader can parse."""
    with open(database, "r+b") as file:
        file.seek(database.stat().st_size // 2)
        file.write(b"\xff" * 8192)


def _garble_records(database: Path) -> None:
    """Overwrite a page in the middle of the `Cache` table's leaves (rows of records: `get` reads
    them), found with SQLite's `dbstat`; where that is not compiled in, `_garble`. (The middle of the
    file may hold only index pages a key lookup never reads, which left some runs undamaged.)"""
    with sqlite3.connect(database) as con:
        page_size = con.execute("PRAGMA page_size").fetchone()[0]
        try:
            leaves = [
                row[0]
                for row in con.execute(
                    "SELECT pageno FROM dbstat WHERE name = 'Cache' AND pagetype = 'leaf' ORDER BY pageno"
                )
            ]
        except sqlite3.OperationalError:  # no dbstat in this SQLite
            leaves = []
    if not leaves:
        _garble(database)
        return
    with open(database, "r+b") as file:
        file.seek((leaves[len(leaves) // 2] - 1) * page_size)
        file.write(b"\xff" * page_size)


@pytest.mark.parametrize("damage", ["emptied", "deleted", "replaced"])
async def test_a_database_that_lost_its_tasks_is_refused_naming_the_fix(tmp_path: Path, damage: str) -> None:
    store = tmp_path / "store"
    await _held_store(store)
    for name in ("cache.db", "cache.db-wal", "cache.db-shm"):
        target = store / name
        if damage == "emptied" and name == "cache.db":
            target.write_bytes(b"")
        elif target.exists() and damage in ("deleted", "replaced"):
            target.unlink()
    if damage == "replaced":
        DiskcacheStore(tmp_path / "other", durable=False)._close_now()
        (tmp_path / "other" / "cache.db").rename(store / "cache.db")
    why = {
        "emptied": "cache.db is empty, but this directory held a store",
        "deleted": "cache.db is missing, but this directory held a store",
        "replaced": "cache.db is not the database this directory held",
    }[damage]
    with pytest.raises(DamagedStoreError, match=f"{why}.*delete .*{STORE_ID_FILE}"):
        DiskcacheStore(store, exclusive=True)
    (store / STORE_ID_FILE).unlink()  # the operator's choice: start empty on purpose
    if damage == "emptied":
        (store / "cache.db").unlink()
    DiskcacheStore(store, exclusive=True)._close_now()


async def test_a_database_garbled_mid_file_is_refused_at_start(tmp_path: Path) -> None:
    store = tmp_path / "store"
    await _held_store(store, RECORDS)
    _checkpoint(store)
    _garble(store / "cache.db")
    with pytest.raises(DamagedStoreError, match=r"cache.db is damaged \(SQLite quick_check.*\.recover"):
        DiskcacheStore(store, exclusive=True)


def test_serve_exits_naming_the_damaged_database(tmp_path: Path) -> None:
    store = tmp_path / "store"
    asyncio.run(_held_store(store))
    (store / "cache.db").write_bytes(b"")
    (store / "cache.db-wal").unlink(missing_ok=True)
    done = serve_on_store(store, tmp_path)
    assert done.returncode == 1 and "cache.db is empty, but this directory held a store" in done.stderr, done


async def test_a_page_that_fails_to_read_turns_readyz_to_503(
    legacy_url: str, tmp_path: Path, serve: Serve
) -> None:
    store = tmp_path / "store"
    ids = await _held_store(store, RECORDS)
    _checkpoint(store)
    proxy = await serve(make_config(legacy_url, store))
    _garble_records(store / "cache.db")  # damage after the start-up check, as a failing disk would
    client = ModernClient(proxy.url())
    try:
        statuses = [(await client.get(task_id)).status for task_id in ids]
        assert 503 in statuses, sorted(set(statuses))
        assert "malformed" in (proxy.app[TASKS_KEY].read_problem() or "")  # what store_read_failed logs
        async with aiohttp.ClientSession() as http, http.get(f"{proxy.base}/readyz") as resp:
            body = await resp.json()
        assert resp.status == 503 and body["checks"]["store"].startswith("failed: reads fail"), body
    finally:
        await client.close()


async def test_another_principals_task_is_refused_without_reading_its_record(tmp_path: Path) -> None:
    """The small `own:` entry answers for someone else's task, so a foreign id costs what an unknown
    one does, whatever the record's size: here the record itself is unreadable, and only its owner
    finds out."""
    store = DiskcacheStore(tmp_path / "store", durable=False)
    try:
        await store.create(make_record(task_id="theirs", principal="p", server="s"))
        with sqlite3.connect(tmp_path / "store" / "cache.db") as con:
            con.execute("UPDATE Cache SET value = ? WHERE key = 'task:theirs'", (b"not json",))
        assert await store.get_for("theirs", "someone-else", "s") == (None, True)
        assert await store.get_for("theirs", "p", "other-server") == (None, True)
        assert await store.get_for("unknown", "p", "s") == (None, False)
        with pytest.raises(DamagedStoreError):
            await store.get_for("theirs", "p", "s")
    finally:
        await store.close()


async def test_a_large_damaged_database_is_checked_in_the_background_and_shows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past QUICK_CHECK_AT_START_BYTES the check would make start-up slow (seconds on a cold disk
    for a million tasks), so it runs after start: the damage then shows as `store.damage` (which
    `/readyz` reports) instead of refusing the start."""
    monkeypatch.setattr(diskcache_store, "QUICK_CHECK_AT_START_BYTES", 0)
    store_dir = tmp_path / "store"
    await _held_store(store_dir, RECORDS)
    _checkpoint(store_dir)
    _garble(store_dir / "cache.db")
    store = DiskcacheStore(store_dir, exclusive=True)
    try:
        async with asyncio.timeout(10):
            while store.damage is None:
                await asyncio.sleep(0.02)
        assert "is damaged (SQLite quick_check" in store.damage
    finally:
        await store.close()


async def test_a_database_deleted_under_the_running_proxy_turns_readyz_to_503(
    legacy_url: str, tmp_path: Path, serve: Serve
) -> None:
    proxy = await serve(make_config(legacy_url, tmp_path / "store"))
    for name in ("cache.db", "cache.db-wal", "cache.db-shm"):
        (tmp_path / "store" / name).unlink(missing_ok=True)
    async with aiohttp.ClientSession() as http, http.get(f"{proxy.base}/readyz") as resp:
        body = await resp.json()
    assert resp.status == 503 and "cache.db was deleted or replaced" in body["checks"]["store"], body


def test_a_file_that_is_not_a_database_or_not_a_directory_is_named_with_the_fix(tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir(mode=0o700)
    (store / "cache.db").write_bytes(os.urandom(8192))
    with pytest.raises(
        DamagedStoreError, match=r"cache.db cannot be opened \(file is not a database\).*\.recover"
    ):
        DiskcacheStore(store, exclusive=True)
    (tmp_path / "plain").write_text("x")
    with pytest.raises(
        StoreUnavailableError, match="not a directory; store.path names the store's directory"
    ):
        DiskcacheStore(tmp_path / "plain", exclusive=True)


def _killed_with_wal(store: Path, copy: Path, commits: int = 10) -> None:
    """`commits` transactions on `store`'s database left in its write-ahead log, and the directory
    copied as a SIGKILL leaves it (the connection still open: nothing checkpointed, -shm kept)."""
    con = sqlite3.connect(store / "cache.db", isolation_level=None)
    try:
        con.execute("PRAGMA wal_autocheckpoint=0")
        con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        for n in range(commits):
            con.execute("INSERT INTO Settings (key, value) VALUES (?, ?)", (f"chaos-{n}", n))
        shutil.copytree(store, copy)
    finally:
        con.close()


def _garble_frame(wal: Path, frame: int) -> None:
    """Overwrite 64 bytes of the page data of `frame` (1-based) of the log at `wal`."""
    page_size = int.from_bytes(wal.read_bytes()[8:12], "big")
    with open(wal, "r+b") as file:
        file.seek(32 + (frame - 1) * (24 + page_size) + 24 + 100)
        file.write(b"\xa5" * 64)


async def test_a_wal_garbled_after_a_kill_is_refused_at_start_a_torn_tail_is_not(tmp_path: Path) -> None:
    """Committed transactions after a damaged log frame, which SQLite would skip silently (here: 8 of
    10 rows gone), are refused at start naming cache.db-wal and the way out; an intact log and a
    torn last frame (what a power loss leaves) start as usual."""
    store = tmp_path / "store"
    await _held_store(store)
    _killed_with_wal(store, tmp_path / "garbled")
    shutil.copytree(tmp_path / "garbled", tmp_path / "intact")
    shutil.copytree(tmp_path / "garbled", tmp_path / "torn")
    wal = tmp_path / "garbled" / "cache.db-wal"
    frames = (wal.stat().st_size - 32) // (24 + int.from_bytes(wal.read_bytes()[8:12], "big"))
    _garble_frame(wal, 2)
    _garble_frame(tmp_path / "torn" / "cache.db-wal", frames)
    assert walcheck.skipped_commits(str(wal)) >= 8
    with sqlite3.connect(f"file:{tmp_path / 'garbled' / 'cache.db'}?mode=ro", uri=True) as con:
        kept = con.execute("SELECT count(*) FROM Settings WHERE key LIKE 'chaos-%'").fetchone()[0]
    assert kept < 10  # what SQLite alone would serve
    with pytest.raises(DamagedStoreError, match=r"cache.db-wal is damaged: \d+ committed .*wal_checkpoint"):
        DiskcacheStore(tmp_path / "garbled", exclusive=True)
    for healthy in ("intact", "torn"):
        assert walcheck.skipped_commits(str(tmp_path / healthy / "cache.db-wal")) == 0
        DiskcacheStore(tmp_path / healthy, exclusive=True)._close_now()


async def test_a_closed_store_leaves_no_connection_open_behind_a_backup(tmp_path: Path) -> None:
    """Once `close` returns, every SQLite connection of the store is closed (the last one folds the
    write-ahead log into cache.db and deletes it): a copy taken then is whole, and no connection left
    to the garbage collector deletes -wal and -shm files later, in the middle of someone's copy."""
    gc.disable()  # the collector would close a leaked connection at a moment of its choosing
    try:
        await _held_store(tmp_path / "store")
        left = set(os.listdir(tmp_path / "store"))
        assert "cache.db" in left and not left & {"cache.db-wal", "cache.db-shm"}
    finally:
        gc.enable()
