"""Where the live replicas are: each replica's base URL and drain state, kept in the shared store
beside its lease (a record `replica:<node>` that expires with the lease when not renewed).

The store's small key-value map (`session_put` / `session_get` / `session_delete`, JSON values with
an expiry) holds these records and the legacy session map; a record that has expired means the
replica is gone (its lease lapsed too, and the recovery sweep ends its tasks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class SharedMap(Protocol):
    """The part of a shared task store the replicas use: JSON values by key, each with an expiry.

    Every method may raise StoreUnavailableError.
    """

    async def session_put(self, session_id: str, info: dict[str, Any], ttl_ms: int) -> None:
        """Store `info` under `session_id`, expiring `ttl_ms` (ms) from now."""

    async def session_get(self, session_id: str) -> dict[str, Any] | None:
        """The value under `session_id`, or None when absent or expired."""

    async def session_delete(self, session_id: str) -> None:
        """Remove `session_id` (nothing happens when absent)."""


@dataclass(frozen=True)
class Peer:
    """A live replica as the registry shows it: its node id, base URL (`http://host:port`), and
    whether it is draining (it takes no new calls or sessions)."""

    node: str
    url: str
    draining: bool = False


def _key(node: str) -> str:
    return f"replica:{node}"


class Registry:
    """Reads and writes the replica records in a `SharedMap`. `lease_ms` (ms) is how long a
    record lasts without renewal (the node's lease)."""

    def __init__(self, shared: SharedMap, *, node: str, url: str, lease_ms: int) -> None:
        self.shared = shared
        self.node = node
        self.url = url
        self.lease_ms = lease_ms
        self.draining = False

    async def announce(self) -> None:
        """Write (renew) this replica's record. Raises StoreUnavailableError."""
        await self.shared.session_put(
            _key(self.node), {"url": self.url, "draining": self.draining}, self.lease_ms
        )

    async def announce_draining(self) -> None:
        """From now on this replica's record says it is draining (it takes no new calls or sessions);
        written at once. Raises StoreUnavailableError (the next `announce` writes it again)."""
        self.draining = True
        await self.announce()

    async def withdraw(self) -> None:
        """Remove this replica's record (clean exit). Raises StoreUnavailableError."""
        await self.shared.session_delete(_key(self.node))

    async def peers(self) -> list[Peer]:
        """Every other live replica (none when the map cannot list keys). Raises StoreUnavailableError."""
        keys = getattr(self.shared, "session_keys", None)
        if keys is None:
            return []
        found = [await self.peer(key.removeprefix("replica:")) for key in await keys("replica:")]
        return [p for p in found if p is not None]

    async def peer(self, node: Any) -> Peer | None:
        """The live replica `node` (None when unknown, gone, or this replica itself). Raises
        StoreUnavailableError."""
        if not isinstance(node, str) or not node or node == self.node:
            return None
        value = await self.shared.session_get(_key(node))
        if not isinstance(value, dict) or not isinstance(value.get("url"), str):
            return None
        return Peer(node=node, url=value["url"], draining=bool(value.get("draining")))
