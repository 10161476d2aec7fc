"""The task record and every rule about it, as pure code over records (no storage, no I/O).

Spec: ext-tasks (SEP-2663) "Task Status" and the shared diagram in protocol.md §2.1:
working → input_required | completed | failed | cancelled; input_required → working | terminal;
terminal states never change. Each backend of `TaskStore` persists records and calls `apply`
inside its own atomic step, so these rules hold whatever stores them.

Retention: a task that is not terminal never expires. `ttl_ms` is kept after the task becomes
terminal; the store may forget it at `terminal_ms + ttl_ms`. The `ttlMs` a client is shown makes
`createdAt + ttlMs` that real end, so it grows while the call runs (`reported_ttl_ms`).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import secrets
import time
from dataclasses import asdict, dataclass, field, replace
from enum import StrEnum
from typing import Any

INTERNAL_ERROR = -32603  # JSON-RPC "Internal error" (the proxy's own failures)
ANONYMOUS = "anonymous"  # the one principal when clients are not authenticated (auth mode none)


class TaskStatus(StrEnum):
    """Status of a task (v2 wire values)."""

    WORKING = "working"  # the upstream call is running
    INPUT_REQUIRED = "input_required"  # the upstream asked for input; see `input_requests`
    COMPLETED = "completed"  # the upstream returned a result (also an `isError: true` one)
    FAILED = "failed"  # a JSON-RPC error, an upstream fault, a timeout, a lost owner ended it
    CANCELLED = "cancelled"  # a cancel (client, operator) was accepted before the call ended

    @property
    def terminal(self) -> bool:
        """True for completed, failed and cancelled."""
        return self in TERMINAL


TERMINAL = frozenset({TaskStatus.COMPLETED, TaskStatus.FAILED, TaskStatus.CANCELLED})

_ALLOWED = {
    TaskStatus.WORKING: {TaskStatus.WORKING, TaskStatus.INPUT_REQUIRED, *TERMINAL},
    TaskStatus.INPUT_REQUIRED: {TaskStatus.WORKING, TaskStatus.INPUT_REQUIRED, *TERMINAL},
}


class TerminalTaskError(Exception):
    """Raised when a change would alter a task that already reached a terminal status."""


class ConflictError(Exception):
    """Raised when a conditional change finds the record not as it expected (another writer won)."""


def check_transition(current: TaskStatus, new: TaskStatus) -> None:
    """Raise TerminalTaskError unless `current → new` is allowed by the status machine."""
    if new not in _ALLOWED.get(current, set()):
        raise TerminalTaskError(f"task is {current.value}; it cannot become {new.value}")


def new_task_id() -> str:
    """A fresh task id: 256 bits from the OS CSPRNG, URL-safe base64 (43 characters)."""
    return secrets.token_urlsafe(32)


def new_node_id() -> str:
    """A fresh node id for one proxy process (16 hex characters)."""
    return secrets.token_hex(8)


def valid_task_id(value: str) -> bool:
    """Whether `value` could be a task id at all: at most 256 printable characters that UTF-8 can
    carry (a lone surrogate from a `\\ud800` JSON escape cannot be stored or looked up)."""
    if not value or len(value) > 256 or not value.isprintable():
        return False
    try:
        value.encode()
    except UnicodeEncodeError:
        return False
    return True


def now_ms() -> int:
    """Wall-clock time in integer milliseconds since the Unix epoch."""
    return int(time.time() * 1000)


def iso(ms: int) -> str:
    """RFC 3339 UTC timestamp with millisecond precision and a `Z`, from epoch milliseconds."""
    return f"{_iso_second(ms // 1000)}.{ms % 1000:03d}Z"


@functools.lru_cache(maxsize=4096)  # a polled task shows the same two times on every answer
def _iso_second(s: int) -> str:
    t = time.gmtime(s)  # what datetime.strftime gave, at a fifth of the cost
    date = f"{t.tm_year:04d}-{t.tm_mon:02d}-{t.tm_mday:02d}"
    return f"{date}T{t.tm_hour:02d}:{t.tm_min:02d}:{t.tm_sec:02d}"


def principal_key(principal: str) -> str:
    """A fixed-length key for a principal inside store keys (SHA-256, 32 hex characters)."""
    return (
        _principal_key(principal)
        if len(principal) <= 256
        else hashlib.sha256(principal.encode()).hexdigest()[:32]
    )


@functools.lru_cache(maxsize=1024)  # one hash per principal, not per request (bounded: at most ~1 MB)
def _principal_key(principal: str) -> str:
    return hashlib.sha256(principal.encode()).hexdigest()[:32]


_HASH_KEY = [secrets.token_bytes(32)]  # replaced at start by the deployment's (use_principal_hash_key)


def use_principal_hash_key(key: bytes) -> None:
    """Key `principal_hash` with `key` (derived from the deployment's key, the same on every
    replica), so the hashes in logs and the console cannot be reversed by hashing guessed names."""
    if key != _HASH_KEY[0]:
        _HASH_KEY[0] = key
        _principal_hash.cache_clear()


def principal_hash(principal: str) -> str:
    """A short stable hash of a principal for logs and the console (16 hex characters): HMAC-SHA256
    with the deployment's key (`use_principal_hash_key`), not a bare hash of the name."""
    return _principal_hash(principal) if len(principal) <= 256 else _keyed(principal)


@functools.lru_cache(maxsize=1024)  # one HMAC per principal, not per log line
def _principal_hash(principal: str) -> str:
    return _keyed(principal)


def _keyed(principal: str) -> str:
    return hmac.new(_HASH_KEY[0], principal.encode("utf-8", "surrogatepass"), hashlib.sha256).hexdigest()[:16]


@dataclass(slots=True)  # slots: a live task keeps its record in memory (TaskService snapshots)
class TaskRecord:
    """One task as stored. Times are epoch milliseconds.

    `principal` is who created it (only they may see it); `owner` the node id of the proxy process
    that runs its upstream call (its lease says whether that process lives); `method` the upstream
    method (`tools/call`); `outcome` the upstream's raw JSON-RPC answer once known, `{"result": …}`
    or `{"error": …}` (the proxy's own failures are errors too), rendered per dialect when read;
    `input_requests` the outstanding upstream questions by key (`{method, params}` values);
    `ttl_ms` the retention after the task is terminal (None: forever); `terminal_ms` when it became
    terminal; `rerun` what is needed to send the call again after its owner died (`{method, params,
    capabilities}`), kept only for tools configured `on_restart: rerun` and dropped once terminal;
    `version` counts committed changes (for conditional writes and change waits); `history` the
    status changes with their times (`[{"status": str, "at_ms": int}]`, oldest first, at most
    HISTORY_MAX entries: the first and the newest), seeded with the initial status for a new
    record (version 1) and appended by `apply`; a record stored before this field existed has
    an empty history. `trace` is the W3C `traceparent` of the task's span when tracing was on at
    detach (its trace id ties the task to the trace of the request that created it), else None.
    `upstream_ref` is where its upstream request went (`{"session", "requestId", "protocolVersion",
    "origin"}` on an HTTP upstream; None on a stdio child, before the request left, and from a
    take-over until the re-run's request leaves), so that a process taking the task over from a
    dead owner can send the upstream its cancel. `origin` names the legacy client session that
    created a v1 task when every client is one principal (`auth.mode: none`), as a hash
    (`session_origin`): its `tasks/list` and status stream show that session's tasks only, on any
    replica and after a restart.
    """

    task_id: str
    principal: str
    server: str
    tool: str
    created_ms: int
    ttl_ms: int | None
    poll_interval_ms: int
    owner: str
    method: str = "tools/call"
    status: TaskStatus = TaskStatus.WORKING
    status_message: str | None = None
    last_updated_ms: int = 0
    terminal_ms: int | None = None
    outcome: dict[str, Any] | None = None
    input_requests: dict[str, Any] = field(default_factory=dict)
    rerun: dict[str, Any] | None = None
    version: int = 1
    history: list[dict[str, Any]] = field(default_factory=list)
    trace: str | None = None
    upstream_ref: dict[str, Any] | None = None
    origin: str | None = None

    def __post_init__(self) -> None:
        self.status = TaskStatus(self.status)
        if not self.last_updated_ms:
            self.last_updated_ms = self.created_ms
        if not self.history and self.version == 1:
            self.history = [{"status": self.status.value, "at_ms": self.created_ms}]

    @property
    def expires_ms(self) -> int | None:
        """When the store may forget this task (epoch ms); None while it runs or when kept forever."""
        if self.terminal_ms is None or self.ttl_ms is None:
            return None
        return self.terminal_ms + self.ttl_ms

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form for storage."""
        data = asdict(self)
        data["status"] = self.status.value
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TaskRecord:
        """Inverse of `to_dict`; fields this version does not know are ignored. Raises TypeError when
        a field without a default is missing."""
        known = cls.__dataclass_fields__
        if data.keys() <= known.keys():  # the usual case: a record this version wrote
            return cls(**data)
        return cls(**{k: v for k, v in data.items() if k in known})


def session_origin(session_id: str) -> str:
    """The stored name (`TaskRecord.origin`) of a legacy client session: 32 hex of its id's SHA-256,
    never the id itself (it lets whoever holds it use the session)."""
    return hashlib.sha256(session_id.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def reported_ttl_ms(record: TaskRecord, at_ms: int | None = None) -> int | None:
    """The `ttlMs` to show: `createdAt + ttlMs` is the real expiry, so it grows while the task runs.

    `at_ms` is the time of the answer (epoch ms, default now). None when kept forever.
    """
    if record.ttl_ms is None:
        return None
    end = (
        record.terminal_ms
        if record.terminal_ms is not None
        else max(at_ms or now_ms(), record.last_updated_ms)
    )
    return end - record.created_ms + record.ttl_ms


_UNSET: Any = object()
HISTORY_MAX = 32  # status changes kept per record (the first and the newest ones)


def with_transition(history: list[dict[str, Any]], status: TaskStatus, at_ms: int) -> list[dict[str, Any]]:
    """`history` plus `{status, at_ms}` (epoch ms), cut to HISTORY_MAX keeping the first; a new list."""
    entries = [*history, {"status": TaskStatus(status).value, "at_ms": at_ms}]
    if len(entries) > HISTORY_MAX:
        entries = [entries[0], *entries[-(HISTORY_MAX - 1) :]]
    return entries


@dataclass(frozen=True)
class Change:
    """One change to a record, applied atomically by the store through `apply`.

    Fields left `_UNSET` stay as they are. `expect_owner`, when set, makes the change conditional
    on the record's owner (a node that lost its lease cannot write over the one that took over);
    `expect_version` on the record's version (a take-over of an orphan: two nodes that read the same
    orphan never both win it, even when the owner stays the same).
    """

    status: TaskStatus | None = None
    status_message: Any = _UNSET
    outcome: Any = _UNSET
    input_requests: Any = _UNSET
    owner: Any = _UNSET
    upstream_ref: Any = _UNSET
    expect_owner: str | None = None
    expect_version: int | None = None

    @property
    def progress_only(self) -> bool:
        """True when only the status message changes (progress text): a crash may lose it, so
        stores may commit it without waiting for the disk."""
        return (
            self.status is None
            and self.outcome is _UNSET
            and self.input_requests is _UNSET
            and self.owner is _UNSET
            and self.upstream_ref is _UNSET
        )


def apply(record: TaskRecord, change: Change, *, at_ms: int, max_result_bytes: int) -> TaskRecord:
    """The record after `change`, or an exception; the input record is not modified.

    Rules: a terminal record never changes (TerminalTaskError); transitions follow the status
    machine; a result outcome larger than `max_result_bytes` (JSON bytes) is replaced by an error
    naming the limit (the task fails); reaching a terminal status clears `input_requests` and
    `rerun` and sets `terminal_ms`; `last_updated_ms` never goes back; `version` grows by one; a
    status change is appended to `history` (bounded, see `with_transition`). Raises ConflictError when
    `expect_owner` or `expect_version` does not match.
    """
    if record.status.terminal:
        raise TerminalTaskError(f"task {record.task_id} is {record.status.value}; it can no longer change")
    if change.expect_owner is not None and record.owner != change.expect_owner:
        raise ConflictError(f"task {record.task_id} is owned by {record.owner}, not {change.expect_owner}")
    if change.expect_version is not None and record.version != change.expect_version:
        raise ConflictError(f"task {record.task_id} changed (version {record.version}) since it was read")
    status, message, outcome = change.status, change.status_message, change.outcome
    if isinstance(outcome, dict) and "result" in outcome:
        size = len(json.dumps(outcome["result"], separators=(",", ":")))
        if size > max_result_bytes:
            status = TaskStatus.FAILED
            message = (
                f"the result ({size} bytes) exceeds the limit max_result_bytes ({max_result_bytes} bytes)"
            )
            outcome = {
                "error": {"code": INTERNAL_ERROR, "message": message, "data": {"limit": "max_result_bytes"}}
            }
    updates: dict[str, Any] = {
        "last_updated_ms": max(at_ms, record.last_updated_ms),
        "version": record.version + 1,
    }
    if status is not None:
        check_transition(record.status, status)
        updates["status"] = status
        if status is not record.status:
            updates["history"] = with_transition(record.history, status, updates["last_updated_ms"])
    for name, value in (
        ("status_message", message),
        ("outcome", outcome),
        ("input_requests", change.input_requests),
        ("owner", change.owner),
        ("upstream_ref", change.upstream_ref),
    ):
        if value is not _UNSET:
            updates[name] = value
    new = replace(record, **updates)
    if new.status.terminal:
        new.terminal_ms = new.last_updated_ms
        new.input_requests = {}
        new.rerun = None
    return new


def outcome_status(outcome: dict[str, Any]) -> TaskStatus:
    """The stored status for an upstream outcome: a result completes, an error fails."""
    return TaskStatus.COMPLETED if "result" in outcome else TaskStatus.FAILED


def proxy_error(message: str, **data: Any) -> dict[str, Any]:
    """An outcome for a failure of the proxy's own (-32603 with `message`, optional `data`)."""
    error: dict[str, Any] = {"code": INTERNAL_ERROR, "message": message}
    if data:
        error["data"] = data
    return {"error": error}
