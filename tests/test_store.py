"""proxy.tasks.store: the diskcache-backed task store, on a real directory under tmp_path."""

from __future__ import annotations

import base64
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from proxy.tasks.model import TaskRecord, TaskStatus, TerminalTaskError, new_task_id, now_ms
from proxy.tasks.store import TaskNotFoundError, TaskStore


@pytest.fixture
def store(tmp_path: Path) -> Iterator[TaskStore]:
    s = TaskStore(tmp_path / "tasks", durable=False)
    yield s
    s.close()


def record(task_id: str | None = None, *, ttl_ms: int | None = 600_000, **extra) -> TaskRecord:
    return TaskRecord(
        task_id=task_id or new_task_id(),
        principal="alice",
        server="build",
        tool="deploy",
        created_ms=now_ms(),
        ttl_ms=ttl_ms,
        poll_interval_ms=100,
        boot="boot-1",
        **extra,
    )


def wait_until(predicate, timeout: float = 2.0, step: float = 0.01) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step)
    return predicate()


def test_create_get_round_trip(store: TaskStore):
    rec = record(status_message="starting", input_requests={})
    store.create(rec)
    got = store.get(rec.task_id)
    assert got == rec
    assert got is not rec
    assert got.status is TaskStatus.WORKING
    assert got.last_updated_ms == rec.created_ms
    assert list(store.ids()) == [rec.task_id]


def test_unknown_id(store: TaskStore):
    assert store.get("no-such-task") is None
    with pytest.raises(TaskNotFoundError):
        store.update("no-such-task", status=TaskStatus.COMPLETED)


def test_create_of_existing_id_is_refused(store: TaskStore):
    rec = record()
    store.create(rec)
    store.update(rec.task_id, status=TaskStatus.COMPLETED, result={"content": []})
    with pytest.raises(ValueError, match="already exists"):
        store.create(record(rec.task_id))
    # The first record is untouched.
    assert store.get(rec.task_id).status is TaskStatus.COMPLETED


def test_store_directory_is_created(tmp_path: Path):
    path = tmp_path / "a" / "b" / "c"
    s = TaskStore(path)
    try:
        assert path.is_dir()
        s.check_writable()
    finally:
        s.close()


@pytest.mark.parametrize(
    ("terminal", "fields", "change"),
    [
        (TaskStatus.COMPLETED, {"result": {"content": [{"type": "text", "text": "ok"}]}}, {"status": TaskStatus.WORKING}),
        (TaskStatus.COMPLETED, {"result": {"content": []}}, {"status": TaskStatus.INPUT_REQUIRED}),
        (TaskStatus.COMPLETED, {"result": {"content": []}}, {"status": TaskStatus.FAILED}),
        (TaskStatus.CANCELLED, {}, {"status": TaskStatus.COMPLETED, "result": {"content": []}}),
        (TaskStatus.CANCELLED, {}, {"status": TaskStatus.CANCELLED}),
        (TaskStatus.FAILED, {"error": {"code": -32603, "message": "boom"}}, {"status": TaskStatus.CANCELLED}),
        (TaskStatus.COMPLETED, {"result": {"content": []}}, {"result": {"content": [{"type": "text", "text": "other"}]}}),
        (TaskStatus.COMPLETED, {"result": {"content": []}}, {"result": None}),
        (TaskStatus.FAILED, {"error": {"code": -32603, "message": "boom"}}, {"error": {"code": 1, "message": "rewritten"}}),
        (TaskStatus.FAILED, {"error": {"code": -32603, "message": "boom"}}, {"status_message": "changed"}),
        (TaskStatus.CANCELLED, {}, {"input_requests": {"k": {"method": "elicitation/create", "params": {}}}}),
    ],
)
def test_terminal_status_never_changes(store: TaskStore, terminal: TaskStatus, fields: dict, change: dict):
    rec = record()
    store.create(rec)
    store.update(rec.task_id, status=terminal, status_message="done", **fields)
    before = store.get(rec.task_id)
    with pytest.raises(TerminalTaskError):
        store.update(rec.task_id, **change)
    after = store.get(rec.task_id)
    assert after == before


def test_terminal_record_unchanged_after_reopen(tmp_path: Path):
    path = tmp_path / "tasks"
    s = TaskStore(path)
    rec = record()
    s.create(rec)
    s.update(rec.task_id, status=TaskStatus.COMPLETED, result={"content": [{"type": "text", "text": "ok"}]})
    s.close()
    s = TaskStore(path)
    try:
        with pytest.raises(TerminalTaskError):
            s.update(rec.task_id, status=TaskStatus.FAILED, error={"code": -32603, "message": "restarted"})
        assert s.get(rec.task_id).result == {"content": [{"type": "text", "text": "ok"}]}
        assert s.get(rec.task_id).status is TaskStatus.COMPLETED
    finally:
        s.close()


def test_allowed_transitions(store: TaskStore):
    rec = record()
    store.create(rec)
    question = {"q1": {"method": "elicitation/create", "params": {"message": "Deploy?"}}}
    r = store.update(rec.task_id, status=TaskStatus.INPUT_REQUIRED, status_message="waiting for you", input_requests=question)
    assert r.status is TaskStatus.INPUT_REQUIRED
    assert store.get(rec.task_id).input_requests == question
    r = store.update(rec.task_id, status=TaskStatus.WORKING, status_message=None, input_requests={})
    assert (r.status, r.status_message, r.input_requests) == (TaskStatus.WORKING, None, {})
    # Same-status updates are allowed while not terminal.
    store.update(rec.task_id, status=TaskStatus.WORKING, status_message="step 2/5")
    r = store.update(rec.task_id, status=TaskStatus.COMPLETED, result={"content": [{"type": "text", "text": "deployed"}]})
    stored = store.get(rec.task_id)
    assert stored == r
    assert stored.status is TaskStatus.COMPLETED
    assert stored.status_message == "step 2/5"
    assert stored.result == {"content": [{"type": "text", "text": "deployed"}]}


@pytest.mark.parametrize("terminal", [TaskStatus.COMPLETED, TaskStatus.FAILED, TaskStatus.CANCELLED])
def test_input_required_may_end_in_any_terminal(store: TaskStore, terminal: TaskStatus):
    rec = record()
    store.create(rec)
    store.update(rec.task_id, status=TaskStatus.INPUT_REQUIRED)
    assert store.update(rec.task_id, status=terminal).status is terminal


def test_update_without_status_keeps_status(store: TaskStore):
    rec = record()
    store.create(rec)
    r = store.update(rec.task_id, status_message="halfway")
    assert r.status is TaskStatus.WORKING and r.status_message == "halfway"


def test_last_updated_bumps(store: TaskStore):
    rec = record()
    rec.created_ms -= 1000  # pretend it was created a second ago
    rec.last_updated_ms = rec.created_ms
    store.create(rec)
    first = store.update(rec.task_id, status_message="a")
    assert first.last_updated_ms > rec.created_ms
    assert first.last_updated_ms >= now_ms() - 1000
    assert wait_until(lambda: now_ms() > first.last_updated_ms, timeout=1.0, step=0.001)
    second = store.update(rec.task_id, status_message="b")
    assert second.last_updated_ms > first.last_updated_ms
    assert store.get(rec.task_id).last_updated_ms == second.last_updated_ms
    assert store.get(rec.task_id).created_ms == rec.created_ms


def test_last_updated_never_goes_backwards(store: TaskStore):
    rec = record()
    rec.last_updated_ms = now_ms() + 60_000  # e.g. written by a host whose clock ran ahead
    store.create(rec)
    assert store.update(rec.task_id, status_message="x").last_updated_ms == rec.last_updated_ms


def test_retention_expires_record(store: TaskStore):
    short = record(ttl_ms=50)
    keep = record(ttl_ms=None)
    store.create(short)
    store.create(keep)
    assert store.get(short.task_id) is not None
    assert wait_until(lambda: store.get(short.task_id) is None, timeout=2.0)
    assert short.task_id not in set(store.ids())
    with pytest.raises(TaskNotFoundError):
        store.update(short.task_id, status=TaskStatus.COMPLETED)
    store.purge_expired()
    assert store.get(keep.task_id) is not None
    assert set(store.ids()) == {keep.task_id}


def test_retention_counts_from_creation_not_last_update(store: TaskStore):
    rec = record(ttl_ms=150)
    store.create(rec)
    # Keep updating: updates must not extend retention past created_ms + ttl_ms.
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        try:
            store.update(rec.task_id, status_message=str(now_ms()))
        except TaskNotFoundError:
            break
        time.sleep(0.01)
    else:
        pytest.fail("the record outlived its ttl while being updated")
    assert now_ms() < rec.created_ms + 150 + 1000


def test_already_expired_record_is_dropped(store: TaskStore):
    rec = record(ttl_ms=10)
    rec.created_ms -= 1000
    store.create(rec)
    assert wait_until(lambda: store.get(rec.task_id) is None, timeout=1.0)


def test_records_survive_reopen(tmp_path: Path):
    path = tmp_path / "tasks"
    s = TaskStore(path, durable=True)
    done, running = record(), record(ttl_ms=None)
    s.create(done)
    s.create(running)
    s.update(done.task_id, status=TaskStatus.FAILED, error={"code": -32603, "message": "upstream unreachable"})
    s.update(running.task_id, status=TaskStatus.INPUT_REQUIRED, input_requests={"k": {"method": "elicitation/create", "params": {}}})
    expected = {done.task_id: s.get(done.task_id), running.task_id: s.get(running.task_id)}
    s.close()

    s2 = TaskStore(path, durable=True)
    try:
        assert set(s2.ids()) == set(expected)
        for task_id, rec in expected.items():
            assert s2.get(task_id) == rec
        # The running one can still move on after the reopen.
        assert s2.update(running.task_id, status=TaskStatus.WORKING).status is TaskStatus.WORKING
    finally:
        s2.close()


def test_task_ids_are_unique_and_long():
    ids = [new_task_id() for _ in range(5000)]
    assert len(set(ids)) == len(ids)
    for task_id in ids[:200]:
        assert len(task_id) >= 22  # 22 url-safe base64 characters carry 132 bits
        raw = base64.urlsafe_b64decode(task_id + "=" * (-len(task_id) % 4))
        assert len(raw) * 8 >= 128
        assert set(task_id) <= set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")


def test_many_records(store: TaskStore):
    recs = [record() for _ in range(50)]
    for r in recs:
        store.create(r)
    assert set(store.ids()) == {r.task_id for r in recs}
    assert store.count() == 50


def test_record_dict_round_trip():
    rec = record(status=TaskStatus.INPUT_REQUIRED, input_requests={"a": {"method": "m", "params": {}}})
    data = rec.to_dict()
    assert data["status"] == "input_required"
    assert TaskRecord.from_dict(data) == rec
