"""The embedded store holds data, never code, and refuses a directory another user could change
(issue "Security round 2", item 1): a planted pickle never runs, values an older version pickled
are converted to JSON, unsafe directories and parents are refused with the fix named, and a store
made under `umask 000` is private."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import diskcache
import pytest
from support.records import make_record
from support.servers import serve_on_store

from proxy.tasks.datadisk import MODE_JSON, MODE_JSON_STDLIB
from proxy.tasks.diskcache_store import DiskcacheStore
from proxy.tasks.store import StoreUnavailableError
from proxy.tasks.storedir import UnsafeStoreError

ROOT = Path(__file__).resolve().parents[2]
NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another user")


class Planted:
    """A pickle that, when loaded by a trusting reader, creates the file `marker`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _bomb() -> list:
    """Plain data that is tiny pickled and 2**40 items once written out: shared lists nested 40 deep."""
    bomb: list = []
    for _ in range(40):
        bomb = [bomb, bomb]
    return bomb


def _plant(path: Path, marker: Path) -> dict:
    """An older store (diskcache's default pickling Disk) holding one record an earlier version wrote
    and one `task:` entry an attacker planted. Returns the old record's dict."""
    old = make_record(task_id="old-task").to_dict()
    cache = diskcache.Cache(str(path))
    try:
        cache.set("task:old-task", old)
        cache.set("task:evil", Planted(marker))
        cache.set("task:bomb", _bomb())
        cache.set("session:s1", {"owner": "n1"}, expire=3600)
    finally:
        cache.close()
    path.chmod(0o700)
    return old


def _modes(path: Path) -> dict[str, int]:
    with diskcache.Cache(str(path)) as cache:
        return dict(cache._con.execute("SELECT key, mode FROM Cache WHERE raw = 1").fetchall())


async def test_a_planted_pickle_never_runs_and_old_records_become_json(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    old = _plant(tmp_path / "store", marker)
    store = DiskcacheStore(tmp_path / "store", exclusive=True)
    try:
        assert await store.get("old-task") is not None
        assert (await store.get("old-task")).to_dict() == old  # type: ignore[union-attr]
        assert await store.get("evil") is None  # refused and deleted at start
        assert await store.get("bomb") is None  # plain data, but never written out whole
        assert await store.session_get("s1") == {"owner": "n1"}
    finally:
        await store.close()
    assert not marker.exists()
    modes = _modes(tmp_path / "store")
    assert modes["task:old-task"] == MODE_JSON and modes["session:s1"] == MODE_JSON
    assert "task:evil" not in modes and "task:bomb" not in modes


async def test_a_shared_reader_refuses_a_planted_pickle_without_running_it(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    _plant(tmp_path / "store", marker)
    reader = DiskcacheStore(tmp_path / "store")  # the operator CLI's way: no conversion
    try:
        with pytest.raises(StoreUnavailableError, match="names posix.system"):
            await reader.get("evil")
        assert (await reader.get("old-task")) is not None  # plain data is read
    finally:
        await reader.close()
    assert not marker.exists()


async def test_values_are_json_in_sqlite_and_in_value_files(tmp_path: Path) -> None:
    store = DiskcacheStore(tmp_path / "store")
    try:
        await store.create(make_record(task_id="small"))
        await store.create(make_record(task_id="large", outcome={"result": {"text": "x" * 100_000}}))
        odd = {"result": {"text": "\ud800", "big": 2**70}}  # what orjson refuses: json writes it
        await store.create(make_record(task_id="odd", outcome=odd))
        assert (await store.get("odd")).outcome == odd  # type: ignore[union-attr]
    finally:
        await store.close()
    modes = _modes(tmp_path / "store")
    assert modes["task:small"] == MODE_JSON and modes["task:large"] == MODE_JSON
    assert modes["task:odd"] == MODE_JSON_STDLIB
    files = list((tmp_path / "store").rglob("*.val"))
    assert len(files) == 1 and json.loads(files[0].read_bytes())["task_id"] == "large"


def test_a_directory_writable_by_others_is_refused(tmp_path: Path) -> None:
    (tmp_path / "store").mkdir()
    (tmp_path / "store").chmod(0o777)
    with pytest.raises(UnsafeStoreError, match=r"writable by group or others \(mode 0777\).*chmod go-w"):
        DiskcacheStore(tmp_path / "store", exclusive=True)
    assert not (tmp_path / "store" / "cache.db").exists()


def test_a_parent_writable_by_others_without_the_sticky_bit_is_refused(tmp_path: Path) -> None:
    (tmp_path / "open").mkdir()
    (tmp_path / "open").chmod(0o777)
    with pytest.raises(UnsafeStoreError, match="parent directory .*open is writable by group or others"):
        DiskcacheStore(tmp_path / "open" / "store", exclusive=True)
    (tmp_path / "open").chmod(0o1777)  # sticky, like /tmp: nobody may replace our entry
    store = DiskcacheStore(tmp_path / "open" / "store", exclusive=True)
    store._release_lock()
    store._cache.close()


def test_a_world_writable_file_inside_is_refused(tmp_path: Path) -> None:
    store = DiskcacheStore(tmp_path / "store")
    store._cache.close()
    (tmp_path / "store" / "cache.db").chmod(0o666)
    with pytest.raises(UnsafeStoreError, match="cache.db: writable by group or others"):
        DiskcacheStore(tmp_path / "store")


@as_root
def test_a_directory_or_file_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    (tmp_path / "store").mkdir(mode=0o700)
    os.chown(tmp_path / "store", NOBODY, NOBODY)
    with pytest.raises(UnsafeStoreError, match=f"owned by uid {NOBODY}, not by the proxy's uid 0"):
        DiskcacheStore(tmp_path / "store", exclusive=True)
    os.chown(tmp_path / "store", 0, 0)
    (tmp_path / "store" / "cache.db").write_bytes(b"")
    os.chown(tmp_path / "store" / "cache.db", NOBODY, NOBODY)
    with pytest.raises(UnsafeStoreError, match=f"cache.db: owned by uid {NOBODY}"):
        DiskcacheStore(tmp_path / "store", exclusive=True)


@as_root
def test_a_parent_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    (tmp_path / "theirs").mkdir(mode=0o755)
    os.chown(tmp_path / "theirs", NOBODY, NOBODY)
    with pytest.raises(UnsafeStoreError, match=f"theirs is owned by uid {NOBODY}"):
        DiskcacheStore(tmp_path / "theirs" / "store", exclusive=True)


def test_serve_refuses_an_unsafe_store_and_names_the_fix(tmp_path: Path) -> None:
    (tmp_path / "store").mkdir()
    (tmp_path / "store").chmod(0o777)
    done = serve_on_store(tmp_path / "store", tmp_path)
    assert done.returncode == 1, done
    assert "writable by group or others (mode 0777)" in done.stderr and "chmod go-w" in done.stderr


def test_a_store_made_under_umask_000_is_private(tmp_path: Path) -> None:
    script = f"""
import asyncio, os
os.umask(0)
from proxy.tasks.diskcache_store import DiskcacheStore
from proxy.calls.mrtr import load_or_create_key
from support.records import make_record

async def main():
    store = DiskcacheStore({str(tmp_path / "a" / "b" / "store")!r}, exclusive=True)
    await store.create(make_record(task_id="big", outcome={{"result": {{"text": "x" * 100000}}}}))
    await store.put_blob("blob", b"y" * 100000)
    load_or_create_key(store.path, None)
    await store.close()

asyncio.run(main())
"""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    seen = [tmp_path / "a", tmp_path / "a" / "b", *(tmp_path / "a").rglob("*")]
    assert len(seen) > 8  # directories, the database, value files, the lock, the key
    loose = {str(p): oct(p.stat().st_mode & 0o777) for p in seen if p.stat().st_mode & 0o077}
    assert loose == {}


def test_a_store_path_through_a_link_in_an_unsafe_directory_is_refused(tmp_path: Path) -> None:
    """The link's own directory is checked too: whoever can write there could swap the link."""
    (tmp_path / "safe").mkdir(mode=0o700)
    (tmp_path / "open").mkdir()
    (tmp_path / "open").chmod(0o777)
    (tmp_path / "open" / "store").symlink_to(tmp_path / "safe")
    with pytest.raises(UnsafeStoreError, match="parent directory .*open is writable by group or others"):
        DiskcacheStore(tmp_path / "open" / "store", exclusive=True)
    (tmp_path / "open").chmod(0o755)
    store = DiskcacheStore(tmp_path / "open" / "store", exclusive=True)
    try:
        assert store.path == str(tmp_path / "safe")  # opened at the real path: a later swap changes nothing
        assert store.where == str(tmp_path / "open" / "store")
    finally:
        store._close_now()


@as_root
def test_a_store_path_that_is_a_link_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    (tmp_path / "safe").mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(tmp_path / "safe")
    os.lchown(tmp_path / "link", NOBODY, NOBODY)
    with pytest.raises(UnsafeStoreError, match=f"a symbolic link owned by uid {NOBODY}"):
        DiskcacheStore(tmp_path / "link", exclusive=True)
