"""Metrics and the `task_transition` audit line for every status change a store commits in this process."""

from __future__ import annotations

import structlog

from proxy.runtime import metrics
from proxy.tasks.model import TaskRecord, TaskStatus, principal_hash

log = structlog.get_logger("proxy.tasks")


def observe_transition(before: TaskStatus | None, record: TaskRecord) -> None:
    """A store listener: count the new status, observe the age (s) of a task that ended, and log one
    `task_transition` line (principal hash, never a payload). `before` is None on creation."""
    if before is record.status:
        return
    age_s = (record.last_updated_ms - record.created_ms) / 1000
    metrics.TASKS.labels(record.status.value).inc()
    if record.status.terminal:
        metrics.TASK_AGE.labels(record.status.value).observe(age_s)
    log.info(
        "task_transition",
        task_id=record.task_id,
        server=record.server,
        tool=record.tool,
        principal=principal_hash(record.principal),
        **{"from": before.value if before else None},
        to=record.status.value,
        age_ms=int(age_s * 1000),
    )
