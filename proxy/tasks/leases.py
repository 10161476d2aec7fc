"""When a node may judge other nodes' leases: a lapsed lease means a lost replica only when this
node has itself been renewing its own on the same store server for a full lease period."""

from __future__ import annotations

import asyncio

import structlog

log = structlog.get_logger("proxy.tasks")


async def store_instance(store: object) -> str | None:
    """The store server's identity when the store has one (Redis `run_id`), else None.

    Raises StoreUnavailableError."""
    instance = getattr(store, "instance_id", None)
    return None if instance is None else str(await instance())


class LeaseJudge:
    """When a node may take another node's lapsed lease for a lost replica.

    After a store outage longer than the lease (`lease_s`, s) every lease has lapsed by the clock,
    live replicas' too. So a node judges other nodes' leases only once it has been renewing its own
    without a store error, and on the same store server (Redis `run_id`), for a full lease period:
    by then every live replica has renewed its own.
    """

    def __init__(self, lease_s: float) -> None:
        self.lease_s = lease_s
        self._since: float | None = None  # loop time (s) of the first good renewal since the last error
        self._instance: str | None = None

    def started(self, instance: str | None) -> None:
        """The node just took its lease at start-up on store server `instance` (trusted at once)."""
        self._instance = instance
        self._since = asyncio.get_running_loop().time() - self.lease_s

    def renewed(self, instance: str | None) -> None:
        """The node's lease was just renewed on store server `instance`."""
        if instance != self._instance:  # the store server restarted: leases may have lapsed meanwhile
            log.warning("store_restarted", previous=self._instance, now=instance)
            self._instance = instance
            self._since = None
        if self._since is None:
            self._since = asyncio.get_running_loop().time()

    def failed(self) -> None:
        """A store operation failed: start counting again at the next good renewal."""
        self._since = None

    def may_judge(self) -> bool:
        """True when other nodes' lapsed leases mean they are lost (see the class docstring)."""
        return self._since is not None and asyncio.get_running_loop().time() - self._since >= self.lease_s
