"""The store contract suite: the same tests against every `TaskStore` backend (diskcache, and Redis
on a real redis-server of the test session), plus the pure rules of `tasks/model.py` (transitions,
result size, retention) that hold whatever stores the records."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from support.records import make_record

from proxy.tasks.diskcache_store import DiskcacheStore
from proxy.tasks.model import (
    HISTORY_MAX,
    Change,
    ConflictError,
    TaskRecord,
    TaskStatus,
    TerminalTaskError,
    apply,
    new_task_id,
    now_ms,
    reported_ttl_ms,
)
from proxy.tasks.redis_store import RedisTaskStore
from proxy.tasks.store import ListFilter, TaskNotFoundError, TaskStore

BACKENDS = ["diskcache", pytest.param("redis", marks=pytest.mark.redis)]


@pytest.fixture(params=BACKENDS)
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[TaskStore]:
    backend: TaskStore
    if request.param == "redis":
        server = request.getfixturevalue("redis_server")
        backend = RedisTaskStore(
            server.url, prefix=request.getfixturevalue("redis_prefix"), max_result_bytes=2048, timeout_s=5
        )
    else:
        backend = DiskcacheStore(tmp_path / "store", durable=False, max_result_bytes=2048)
    assert isinstance(backend, TaskStore)
    try:
        yield backend
    finally:
        await backend.close()


def completed(**fields) -> TaskRecord:
    return make_record(status=TaskStatus.COMPLETED, outcome={"result": {"content": []}}, **fields)


# -- records and the status machine ---------------------------------------------------------------


async def test_create_get_round_trip(store: TaskStore) -> None:
    record = make_record(
        task_id="a",
        input_requests={"k": {"method": "roots/list"}},
        rerun={"method": "tools/call", "params": {}},
    )
    await store.create(record)
    assert await store.get("a") == record
    assert await store.get("nope") is None
    with pytest.raises(ValueError):
        await store.create(make_record(task_id="a"))
    assert await store.count() == 1


async def test_terminal_status_never_changes(store: TaskStore) -> None:
    await store.create(make_record(task_id="t"))
    done = await store.update("t", Change(status=TaskStatus.COMPLETED, outcome={"result": {"content": []}}))
    assert done.status is TaskStatus.COMPLETED and done.terminal_ms is not None and done.version == 2
    for change in (
        Change(status=TaskStatus.CANCELLED),
        Change(status_message="late"),
        Change(outcome={"error": {"code": 1, "message": "x"}}),
    ):
        with pytest.raises(TerminalTaskError):
            await store.update("t", change)
    assert await store.get("t") == done
    with pytest.raises(TaskNotFoundError):
        await store.update("missing", Change(status_message="x"))


async def test_two_writers_never_both_win_a_transition(store: TaskStore) -> None:
    for i in range(20):
        await store.create(make_record(task_id=f"r{i}"))
    for i in range(20):
        results = await asyncio.gather(
            store.update(f"r{i}", Change(status=TaskStatus.CANCELLED)),
            store.update(f"r{i}", Change(status=TaskStatus.COMPLETED, outcome={"result": {}})),
            return_exceptions=True,
        )
        winners = [r for r in results if isinstance(r, TaskRecord)]
        assert len(winners) == 1 and sum(isinstance(r, TerminalTaskError) for r in results) == 1
        assert (await store.get(f"r{i}")).status is winners[0].status


async def test_an_orphan_taken_over_by_its_own_node_and_another_is_won_once(store: TaskStore) -> None:
    """A node whose lease lapsed while cut off finds its own orphan (owner unchanged: itself) as
    another node does: both take it over from the version they read (`expect_version`), and one
    wins, so the call is re-run once (a condition on the owner alone let both win)."""
    for i in range(10):
        await store.create(make_record(task_id=f"own{i}", owner="cut-off"))
        read = await store.get(f"own{i}")
        changes = (
            Change(
                status=TaskStatus.WORKING,
                status_message="re-run",
                owner=node,
                expect_owner="cut-off",
                expect_version=read.version,
            )
            for node in ("cut-off", "node-b")
        )
        results = await asyncio.gather(
            *(store.update(f"own{i}", change) for change in changes), return_exceptions=True
        )
        winners = [r for r in results if isinstance(r, TaskRecord)]
        assert len(winners) == 1 and sum(isinstance(r, ConflictError) for r in results) == 1, results


async def test_conditional_change_on_owner(store: TaskStore) -> None:
    await store.create(make_record(task_id="o", owner="node-a"))
    with pytest.raises(ConflictError):
        await store.update("o", Change(status_message="x", expect_owner="node-b"))
    moved = await store.update("o", Change(owner="node-b", expect_owner="node-a"))
    assert moved.owner == "node-b" and [r.owner for r in await store.live_tasks()] == ["node-b"]


async def test_two_nodes_racing_to_take_over_an_orphan_never_both_win(store: TaskStore) -> None:
    """The take-over path (`TaskService._take_over`): a status change conditional on the lost owner.
    Of two nodes re-running the same orphan at once, one wins; the other gets ConflictError and
    writes nothing. A later status change still conditional on the lost owner (failing the orphan,
    or the lost node itself ending its call) is refused too."""
    for i in range(10):
        await store.create(make_record(task_id=f"orphan{i}", owner="lost-node"))
        by_b, by_c = (
            Change(status=TaskStatus.WORKING, status_message="re-run", owner=node, expect_owner="lost-node")
            for node in ("node-b", "node-c")
        )
        results = await asyncio.gather(
            store.update(f"orphan{i}", by_b), store.update(f"orphan{i}", by_c), return_exceptions=True
        )
        winners = [r for r in results if isinstance(r, TaskRecord)]
        assert len(winners) == 1 and sum(isinstance(r, ConflictError) for r in results) == 1, results
        stored = await store.get(f"orphan{i}")
        assert (stored.owner, stored.version) == (winners[0].owner, winners[0].version)
        for late in (
            Change(status=TaskStatus.FAILED, outcome={"error": {}}, expect_owner="lost-node"),
            Change(status=TaskStatus.COMPLETED, outcome={"result": {}}, expect_owner="lost-node"),
        ):
            with pytest.raises(ConflictError):
                await store.update(f"orphan{i}", late)
        stored = await store.get(f"orphan{i}")
        assert (stored.status, stored.version) == (TaskStatus.WORKING, winners[0].version)


async def test_result_over_the_size_limit_fails_the_task(store: TaskStore) -> None:
    await store.create(make_record(task_id="big"))
    record = await store.update(
        "big", Change(status=TaskStatus.COMPLETED, outcome={"result": {"text": "x" * 4096}})
    )
    assert record.status is TaskStatus.FAILED and "max_result_bytes" in record.outcome["error"]["message"]


async def test_live_tasks_are_the_non_terminal_ones(store: TaskStore) -> None:
    await store.create(make_record(task_id="w"))
    await store.create(make_record(task_id="i", status=TaskStatus.INPUT_REQUIRED))
    await store.create(completed(task_id="c"))
    assert sorted(r.task_id for r in await store.live_tasks()) == ["i", "w"]
    await store.update(
        "w", Change(status=TaskStatus.FAILED, outcome={"error": {"code": -32603, "message": "x"}})
    )
    assert [r.task_id for r in await store.live_tasks()] == ["i"]


async def test_status_history_is_kept_with_times_and_survives_the_store(store: TaskStore) -> None:
    await store.create(make_record(task_id="h", created_ms=1_000))
    await store.update("h", Change(status_message="progress only"))
    await store.update("h", Change(status=TaskStatus.INPUT_REQUIRED, input_requests={"k": {}}))
    # no status change
    await store.update("h", Change(status=TaskStatus.INPUT_REQUIRED, input_requests={"k": {}, "j": {}}))
    await store.update("h", Change(status=TaskStatus.WORKING, input_requests={}))
    done = await store.update("h", Change(status=TaskStatus.CANCELLED))
    assert [e["status"] for e in done.history] == ["working", "input_required", "working", "cancelled"]
    times = [e["at_ms"] for e in done.history]
    assert times[0] == 1_000 and times == sorted(times) and times[-1] == done.terminal_ms
    assert (await store.get("h")).history == done.history


# -- retention ------------------------------------------------------------------------------------


async def test_a_running_task_never_expires_and_retention_counts_from_its_end(store: TaskStore) -> None:
    await store.create(make_record(task_id="slow", ttl_ms=100, created_ms=now_ms() - 10_000))
    await asyncio.sleep(0.15)
    assert (await store.get("slow")) is not None  # created 10 s ago with a 100 ms ttl, still running
    ended = await store.update("slow", Change(status=TaskStatus.COMPLETED, outcome={"result": {}}))
    assert ended.expires_ms == ended.terminal_ms + 100
    assert await store.get("slow") is not None
    await asyncio.sleep(0.15)
    assert await store.get("slow") is None
    await store.purge_expired()
    assert await store.count() == 0
    assert (await store.list_tasks(ListFilter(principal="p")))[0] == []


# -- listing --------------------------------------------------------------------------------------


async def test_listing_is_scoped_newest_first_and_paginated(store: TaskStore) -> None:
    base = now_ms()
    for i in range(120):
        await store.create(make_record(task_id=f"mine-{i:03d}", created_ms=base + i, server="s"))
    await store.create(make_record(task_id="other-server", created_ms=base, server="s2"))
    await store.create(make_record(task_id="other-principal", created_ms=base, principal="q"))
    seen, cursor, pages = [], None, 0
    while True:
        page, cursor = await store.list_tasks(ListFilter(principal="p", server="s"), cursor=cursor, limit=50)
        seen += [r.task_id for r in page]
        pages += 1
        if cursor is None:
            break
    assert pages == 3 and seen == [f"mine-{i:03d}" for i in reversed(range(120))]
    everyone, _ = await store.list_tasks(ListFilter(), limit=500)
    assert len(everyone) == 122
    with pytest.raises(ValueError):
        await store.list_tasks(ListFilter(principal="p", server="s"), cursor="not-a-cursor")
    stolen = (await store.list_tasks(ListFilter(principal="q"), limit=1))[1]
    assert stolen is None  # one task: no next page


async def test_listing_filters_by_status_and_tool(store: TaskStore) -> None:
    for i in range(30):
        await store.create(
            (completed if i % 3 == 0 else make_record)(task_id=f"t{i}", tool="a" if i % 2 else "b")
        )
    done, _ = await store.list_tasks(ListFilter(status="completed"), limit=100)
    assert len(done) == 10 and all(r.status is TaskStatus.COMPLETED for r in done)
    tool_a, _ = await store.list_tasks(ListFilter(tool="a", principal="p"), limit=100)
    assert len(tool_a) == 15


# -- change waits and leases ----------------------------------------------------------------------


async def test_wait_for_change_wakes_on_a_change_and_is_bounded(store: TaskStore) -> None:
    record = make_record(task_id="w")
    await store.create(record)
    loop = asyncio.get_running_loop()
    started = loop.time()
    assert (await store.wait_for_change("w", record.version, timeout_s=0.1)).version == record.version
    assert 0.09 <= loop.time() - started < 1.0
    waiter = asyncio.create_task(store.wait_for_change("w", record.version, timeout_s=5))
    await asyncio.sleep(0.02)
    await store.update("w", Change(status_message="moved"))
    changed = await asyncio.wait_for(waiter, 1)
    assert changed.status_message == "moved" and changed.version == record.version + 1
    assert await store.wait_for_change("gone", 1, timeout_s=0.05) is None


async def test_leases_lapse_unless_renewed(store: TaskStore) -> None:
    await store.renew_lease("n1", 150)
    await store.renew_lease("n2", 10_000)
    assert await store.lease_alive("n1") and await store.lease_alive("n2")
    await asyncio.sleep(0.2)
    assert not await store.lease_alive("n1")
    await store.release_lease("n2")
    assert not await store.lease_alive("n2") and not await store.lease_alive("never")


async def test_group_commit_lands_every_concurrent_write(store: TaskStore) -> None:
    ids = [new_task_id() for _ in range(200)]
    await asyncio.gather(*(store.create(make_record(task_id=i)) for i in ids))
    await asyncio.gather(
        *(
            store.update(i, Change(status=TaskStatus.COMPLETED, outcome={"result": {"n": n}}))
            for n, i in enumerate(ids)
        )
    )
    assert [(await store.get(i)).outcome["result"]["n"] for i in ids] == list(range(200))
    await store.check_writable()


# -- small shared state: single-use claims, blobs, the legacy session map ------------------------


async def test_a_claim_is_single_use_until_its_ttl(store: TaskStore) -> None:
    results = await asyncio.gather(*(store.claim_once("mrtr:a:n1", 150) for _ in range(10)))
    assert sorted(results) == [False] * 9 + [True]
    assert await store.claimed("mrtr:a:n1") and not await store.claimed("mrtr:a:n2")
    await asyncio.sleep(0.2)
    assert not await store.claimed("mrtr:a:n1") and await store.claim_once("mrtr:a:n1", 1000)


async def test_blobs_and_the_session_map_round_trip_and_expire(store: TaskStore) -> None:
    assert await store.put_blob("k", b"\x00first", None, only_new=True)
    assert not await store.put_blob("k", b"second", None, only_new=True)
    assert await store.get_blob("k") == b"\x00first" and await store.get_blob("nope") is None
    await store.delete_blob("k")  # gone at once: the next write-if-absent takes it
    await store.delete_blob("nope")
    assert await store.get_blob("k") is None and await store.put_blob("k", b"again", None, only_new=True)
    assert await store.put_blob("short", b"x", 100) and await store.get_blob("short") == b"x"
    info = {"server": "s", "principal": "p", "upstream_session": "abc", "node": "n1"}
    await store.session_put("sess-1", info, 10_000)
    await store.session_put("sess-2", {"n": 2}, 100)
    assert await store.session_get("sess-1") == info and await store.session_get("sess-2") == {"n": 2}
    await store.session_delete("sess-1")
    assert await store.session_get("sess-1") is None and await store.session_get("never") is None
    await asyncio.sleep(0.15)
    assert await store.session_get("sess-2") is None and await store.get_blob("short") is None
    assert await store.count() == 0  # none of it counts as a task


# -- the diskcache backend ------------------------------------------------------------------------


async def test_diskcache_records_survive_reopen(tmp_path: Path) -> None:
    first = DiskcacheStore(tmp_path / "s", durable=True)
    await first.create(completed(task_id="kept"))
    await first.close()
    again = DiskcacheStore(tmp_path / "s")
    try:
        assert (await again.get("kept")).status is TaskStatus.COMPLETED
    finally:
        await again.close()


async def test_diskcache_serving_lock_names_the_holder(tmp_path: Path) -> None:
    holder = DiskcacheStore(tmp_path / "s", exclusive=True)
    probe = (
        "import sys; from proxy.tasks.dirlock import lock_directory\n"
        "try:\n    lock_directory(sys.argv[1])\nexcept Exception as exc:\n    print(exc); sys.exit(3)"
    )
    try:
        other = subprocess.run(
            [sys.executable, "-c", probe, str(tmp_path / "s")], capture_output=True, text=True, timeout=30
        )
        assert (
            other.returncode == 3
            and str(tmp_path / "s") in other.stdout
            and f"pid {os.getpid()}" in other.stdout
        ), other
        shared = DiskcacheStore(tmp_path / "s")  # operators' tools open it without the lock
        await shared.close()
    finally:
        await holder.close()
    free = subprocess.run(
        [sys.executable, "-c", probe, str(tmp_path / "s")], capture_output=True, text=True, timeout=30
    )
    assert free.returncode == 0, free  # released on close


async def test_diskcache_directory_and_database_are_private(tmp_path: Path) -> None:
    (tmp_path / "private").mkdir(mode=0o755)  # an existing directory is made private too
    store = DiskcacheStore(tmp_path / "private")
    try:
        await store.create(make_record())
        assert (tmp_path / "private").stat().st_mode & 0o777 == 0o700
        files = [p for p in (tmp_path / "private").iterdir() if p.name.startswith("cache.db")]
        assert {p.name for p in files} >= {"cache.db", "cache.db-wal", "cache.db-shm"}
        assert all(p.stat().st_mode & 0o777 == 0o600 for p in files), [
            (p.name, oct(p.stat().st_mode)) for p in files
        ]
    finally:
        await store.close()


class HeldCommit:
    """Holds the diskcache store's writer thread inside a commit until `release()`: a real batch,
    kept open so that the test can queue writes behind it (no timing involved)."""

    def __init__(self, store: DiskcacheStore) -> None:
        self.entered, self.released = threading.Event(), threading.Event()
        # The store's group commit takes any callable; this one waits on the writer thread (bounded).
        self.done = asyncio.ensure_future(store._write(self._hold, fsync=False))

    def _hold(self) -> None:
        self.entered.set()
        self.released.wait(10)

    async def wait_entered(self) -> None:
        assert await asyncio.to_thread(self.entered.wait, 10), "the writer never started the held commit"

    def release(self) -> None:
        self.released.set()


async def test_a_batch_mixing_progress_and_a_status_change_is_committed_with_fsync(tmp_path: Path) -> None:
    """Group commit fsyncs a batch when any write in it needs it: progress text alone may be lost
    in a crash, a status change may not. The batch's own durability setting (SQLite's `synchronous`
    pragma inside the commit: 2 = FULL, 1 = NORMAL) is read by a probe committed in the same batch."""
    store = DiskcacheStore(tmp_path / "s", durable=True)
    try:
        await store.create(make_record(task_id="mixed"))
        await store.create(make_record(task_id="progress-only"))

        def probe() -> int:
            return int(store._cache._con.execute("PRAGMA synchronous").fetchone()[0])

        for task_id, changes, expected in (
            ("mixed", [Change(status_message="50%"), Change(status=TaskStatus.INPUT_REQUIRED)], 2),
            ("progress-only", [Change(status_message="10%"), Change(status_message="20%")], 1),
        ):
            held = HeldCommit(store)
            await held.wait_entered()
            batch = [asyncio.ensure_future(store.update(task_id, change)) for change in changes]
            seen = asyncio.ensure_future(store._write(probe, fsync=False))
            await asyncio.sleep(0)  # all three queued behind the held commit: one batch
            held.release()
            await asyncio.wait_for(asyncio.gather(held.done, *batch), 10)
            assert await asyncio.wait_for(seen, 10) == expected, task_id
    finally:
        await store.close()


async def test_a_write_queued_during_a_commit_lands_without_a_further_write(tmp_path: Path) -> None:
    """The writer keeps committing while writes are queued: one that arrives while a batch commits
    is committed right after it, not when some later write comes."""
    store = DiskcacheStore(tmp_path / "s", durable=False)
    try:
        await store.create(make_record(task_id="queued"))
        held = HeldCommit(store)
        await held.wait_entered()
        queued = asyncio.ensure_future(
            store.update("queued", Change(status_message="queued during a commit"))
        )
        await asyncio.sleep(0)
        held.release()
        await asyncio.wait_for(held.done, 10)
        record = await asyncio.wait_for(queued, 10)  # no other write follows
        assert record.status_message == "queued during a commit"
        assert (await store.get("queued")).status_message == "queued during a commit"
    finally:
        await store.close()


# -- pure rules (tasks/model.py) ------------------------------------------------------------------


def test_apply_does_not_touch_its_input_and_bumps_version() -> None:
    record = make_record(last_updated_ms=1_000, created_ms=1_000)
    new = apply(
        record,
        Change(status=TaskStatus.INPUT_REQUIRED, input_requests={"k": {}}),
        at_ms=2_000,
        max_result_bytes=100,
    )
    assert record.status is TaskStatus.WORKING and record.version == 1
    assert new.status is TaskStatus.INPUT_REQUIRED and new.version == 2 and new.last_updated_ms == 2_000
    back = apply(new, Change(status_message="x"), at_ms=1_500, max_result_bytes=100)
    assert back.last_updated_ms == 2_000  # never goes back


@pytest.mark.parametrize("terminal", [TaskStatus.COMPLETED, TaskStatus.FAILED, TaskStatus.CANCELLED])
def test_apply_refuses_any_change_of_a_terminal_record(terminal: TaskStatus) -> None:
    record = make_record(status=terminal)
    with pytest.raises(TerminalTaskError):
        apply(record, Change(status_message="x"), at_ms=now_ms(), max_result_bytes=100)


def test_reaching_a_terminal_status_clears_questions_and_rerun_and_starts_retention() -> None:
    record = make_record(
        created_ms=1_000,
        ttl_ms=500,
        status=TaskStatus.INPUT_REQUIRED,
        input_requests={"k": {}},
        rerun={"m": 1},
    )
    assert record.expires_ms is None
    ended = apply(record, Change(status=TaskStatus.CANCELLED), at_ms=9_000, max_result_bytes=100)
    assert (
        ended.input_requests == {}
        and ended.rerun is None
        and ended.terminal_ms == 9_000
        and ended.expires_ms == 9_500
    )


def test_reported_ttl_grows_while_running_then_fixes_the_real_end() -> None:
    record = make_record(created_ms=1_000, ttl_ms=500)
    assert reported_ttl_ms(record, 1_000) == 500
    assert reported_ttl_ms(record, 4_000) == 3_500  # createdAt + ttlMs = now + ttl
    ended = apply(
        record, Change(status=TaskStatus.COMPLETED, outcome={"result": {}}), at_ms=5_000, max_result_bytes=100
    )
    assert reported_ttl_ms(ended, 99_000) == 4_500 and ended.created_ms + 4_500 == ended.expires_ms
    assert reported_ttl_ms(make_record(ttl_ms=None)) is None


def test_history_is_bounded_keeps_the_first_entry_and_old_records_load_without_it() -> None:
    record = make_record(created_ms=1_000)
    for i in range(HISTORY_MAX * 2):
        status = TaskStatus.INPUT_REQUIRED if i % 2 == 0 else TaskStatus.WORKING
        record = apply(record, Change(status=status), at_ms=2_000 + i, max_result_bytes=100)
    assert len(record.history) == HISTORY_MAX and record.history[0] == {"status": "working", "at_ms": 1_000}
    assert record.history[-1] == {"status": "working", "at_ms": 2_000 + HISTORY_MAX * 2 - 1}
    # stored before `history` existed
    old = {k: v for k, v in make_record(version=3).to_dict().items() if k != "history"}
    assert TaskRecord.from_dict(old).history == []
    assert (
        TaskRecord.from_dict({k: v for k, v in make_record().to_dict().items() if k != "history"}).history[0][
            "status"
        ]
        == "working"
    )


def test_record_dict_round_trip_ignores_unknown_fields() -> None:
    record = make_record(outcome={"error": {"code": 1, "message": "x"}})
    assert TaskRecord.from_dict({**record.to_dict(), "future_field": 1}) == record
