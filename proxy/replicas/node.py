"""This replica among the others: its registry record, the hop to peers, drain, and the remote
half of `tasks/update` and `tasks/cancel` for tasks whose call runs on another replica."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import structlog
from aiohttp import web

from proxy.config import Config
from proxy.protocol.jsonrpc import INTERNAL_ERROR, JsonObject, JsonRpcError
from proxy.replicas.forward import FORWARDED_HEADER, SECRET_HEADER, Forwarder, HopError
from proxy.replicas.registry import Peer, Registry, SharedMap
from proxy.tasks.model import TaskRecord
from proxy.tasks.store import StoreUnavailableError

log = structlog.get_logger("proxy.replicas")


def advertised_url(config: Config) -> str:
    """The base URL other replicas reach this one at: `replicas.advertise` with `{host}` and
    `{port}` replaced by the listen address (the bound port when it was 0), else
    `http://<listen.host>:<listen.port>`. Raises ValueError when the listen host is a wildcard
    (`0.0.0.0`, `::`, empty) and no `advertise` is configured."""
    assert config.replicas is not None
    host, port = config.listen.host, config.listen.port
    wildcard = ("", "0.0.0.0", "::", "[::]", "*")
    if config.replicas.advertise:
        url = config.replicas.advertise.replace("{host}", host).replace("{port}", str(port)).rstrip("/")
        if (urlsplit(url).hostname or "") in wildcard or "://[::]" in url:
            raise ValueError(
                f"replicas.advertise gives {url!r}, a wildcard address other replicas cannot reach: "
                "name this replica's own address (not {host} when listening on every address)"
            )
        return url
    if host in wildcard:
        raise ValueError(
            f"replicas.advertise is needed when listening on {host or 'every address'!r}: other replicas "
            f"cannot reach a wildcard"
        )
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class Replicas:
    """The replica side of one proxy process (node `node`) over a shared store (`shared`); it is
    the task service's `RemoteOwner` (the live calls other replicas run).

    `url` is this replica's advertised base URL; the registry record is renewed every third of
    the lease `lease_s` (s). `draining` turns true on SIGTERM (`begin_drain`).
    """

    def __init__(self, config: Config, *, node: str, lease_s: float, shared: SharedMap, url: str) -> None:
        assert config.replicas is not None
        self.secret = config.replicas.secret
        self.node = node
        self.lease_s = lease_s
        self.registry = Registry(shared, node=node, url=url, lease_ms=int(lease_s * 1000))
        hop = config.replicas.hop_timeout
        longest_call = max((entry.timeout for entry in config.servers.values()), default=1800.0)
        self.forwarder = Forwarder(
            node=node,
            secret=self.secret,
            timeout_s=hop,
            read_timeout_s=longest_call + hop,
            stream_idle_s=3 * config.listen.sse_keepalive + hop,
            keepalive_s=min(4.0, config.listen.header_timeout / 2),  # peers close idle ones at header_timeout
            registered_at=self._registered_at,
        )
        self.shared = shared
        self.draining = False
        self._loop: asyncio.Task[None] | None = None
        self._stopping = False
        self._streams: set[asyncio.Task[Any]] = set()
        self._requests: set[asyncio.Task[Any]] = set()
        self.peer_problem: str | None = None  # a peer that refused this replica's secret (shown on /readyz)
        self._check: asyncio.Task[Any] | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Announce this replica and keep its record renewed. Raises StoreUnavailableError."""
        await self.registry.announce()
        self._loop = asyncio.get_running_loop().create_task(self._renew(), name="replica-announce")
        self._check = asyncio.get_running_loop().create_task(self.check_peers(), name="replica-peer-check")
        log.info("replica_started", node=self.node, url=self.registry.url)

    async def live_count(self) -> int:
        """How many replicas are live as this one sees them: itself and every peer whose registry
        record has not expired. Raises StoreUnavailableError."""
        return 1 + len(await self.registry.peers())

    async def check_peers(self) -> str | None:
        """Ping every registered peer with this replica's secret (bounded by `hop_timeout` each, in
        parallel); log an error naming each one that refuses it (a different `replicas.secret`) and
        keep the finding in `peer_problem` for /readyz. Non-fatal; returns the finding."""
        try:
            results = await self.ask_peers("ping", {})
        except StoreUnavailableError:
            return self.peer_problem
        refused = [f"{p.node} at {p.url}" for p, r in results if isinstance(r, HopError) and r.status == 403]
        for who in refused:
            log.error(
                "replica_peer_refused",
                peer=who,
                reason="it refuses this replica's secret: replicas.secret differs",
            )
        self.peer_problem = (
            f"refused by {', '.join(refused)} (a different replicas.secret)" if refused else None
        )
        return self.peer_problem

    async def ask_peers(self, op: str, payload: JsonObject) -> list[tuple[Peer, JsonObject | HopError]]:
        """POST `payload` to `/_replica/<op>` on every live peer at once (each bounded by
        `hop_timeout`, s): each peer with its JSON answer, or the HopError saying why there is none.
        Raises StoreUnavailableError when the registry cannot be read."""
        peers = await self.registry.peers()
        results = await asyncio.gather(
            *(self.forwarder.ask(p, op, payload) for p in peers), return_exceptions=True
        )
        answers: list[tuple[Peer, JsonObject | HopError]] = []
        for peer, result in zip(peers, results, strict=True):
            if isinstance(result, asyncio.CancelledError):
                raise result
            if isinstance(result, BaseException) and not isinstance(result, HopError):  # a bug: logged
                log.error("replica_hop_failed", peer=peer.node, op=op, exc_info=result)
                result = HopError(f"replica {peer.node} at {peer.url}: {result.__class__.__name__}")
            answers.append((peer, result))
        return answers

    async def _renew(self) -> None:
        while not self._stopping:  # a flag too: redis-py can swallow a cancel (redis/redis-py#2028)
            await asyncio.sleep(self.lease_s / 3)
            try:
                await self.registry.announce()
            except StoreUnavailableError as exc:
                log.warning("replica_announce_failed", reason=str(exc))
            except Exception:  # the loop must outlive any one bad round
                log.exception("replica_announce_failed")

    async def begin_drain(self) -> None:
        """Mark this replica draining (in memory at once, then in its registry record)."""
        self.draining = True
        with contextlib.suppress(StoreUnavailableError):
            await self.registry.announce_draining()
        log.info("replica_draining", node=self.node)

    async def wait_idle(self, timeout_s: float, busy: Callable[[], bool]) -> bool:
        """Wait (at most `timeout_s` s) until this replica has no request in flight (a call still
        attached may yet detach) and `busy()` (its detached calls, parked MRTR calls) is false.
        True when idle, False on timeout."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while any(not t.done() for t in self._requests) or busy():
            if loop.time() >= deadline:
                log.warning("replica_drain_timeout", node=self.node)
                return False
            await asyncio.sleep(0.05)
        return True

    def track(self, *, stream: bool) -> None:
        """Remember the current request handler: a `stream` (a GET or listen stream that lasts as long
        as its client; `close_streams` ends it at exit), or a request that ends by itself (a call
        that may still detach: `wait_idle` waits for it)."""
        task = asyncio.current_task()
        if task is not None:
            held = self._streams if stream else self._requests
            held.add(task)
            task.add_done_callback(held.discard)

    def close_streams(self) -> int:
        """End every open stream and every request still running (a relayed legacy stream, a call
        past its drain): the client sees it cut and reconnects, through the balancer, to a replica
        that is up; returns how many. Called once the drain is over, before the listener closes,
        so the exit is bounded by the drain and not by the clients."""
        streams = [task for task in (*self._streams, *self._requests) if not task.done()]
        for task in streams:
            task.cancel()
        return len(streams)

    async def stop(self) -> None:
        """Stop renewing, remove the registry record, close the hop."""
        self._stopping = True
        if self._check is not None:
            self._check.cancel()
        if self._loop is not None:
            self._loop.cancel()
            await asyncio.wait({self._loop}, timeout=2.0)
        with contextlib.suppress(StoreUnavailableError):
            await self.registry.withdraw()
        await self.forwarder.close()

    # -- trust -------------------------------------------------------------------------------

    def authentic(self, request: web.Request) -> bool:
        """True when the request carries the shared secret (constant-time comparison)."""
        given = request.headers.get(SECRET_HEADER, "")
        return hmac.compare_digest(
            given.encode("utf-8", "surrogatepass"), self.secret.encode()
        )  # raw bytes: no 500

    def forwarded(self, request: web.Request) -> bool:
        """True for a client request another replica relayed here (authentic: it is served here as is)."""
        return FORWARDED_HEADER in request.headers and self.authentic(request)

    async def _registered_at(self, node: str, url: str) -> bool:
        """True when the live replica `node` is registered at `url` (False when unknown, elsewhere,
        or the store cannot say)."""
        if node == self.node:  # (a hop this replica sent to the address it now holds itself)
            return url == self.registry.url
        found = await self.peer(node)
        return found is not None and found.url == url

    async def peer(self, node: Any) -> Peer | None:
        """The live peer `node`, or None (unknown, gone, this replica, or the store unreadable)."""
        try:
            return await self.registry.peer(node)
        except StoreUnavailableError:
            return None

    # -- the remote owner of a task (TaskService.remote) ---------------------------------------

    async def answer(self, record: TaskRecord, responses: JsonObject) -> list[str]:
        """Deliver input responses to the replica running `record`'s call; the keys it used.

        Raises JsonRpcError -32603 (HTTP 503) naming the cause when they cannot be delivered (that
        replica is gone, unreachable, or refuses this one's secret): nothing was answered then.
        """
        peer = await self.peer(record.owner)
        if peer is None:
            cause = (
                f"the proxy replica running this task (node {record.owner}) is gone or its record cannot "
                f"be read"
            )
        else:
            try:
                answer = await self.forwarder.ask(
                    peer, "tasks/answer", {"taskId": record.task_id, "inputResponses": responses}
                )
            except HopError as exc:
                cause = str(exc)
            else:
                keys = answer.get("keys")
                return [k for k in keys if isinstance(k, str)] if isinstance(keys, list) else []
        raise JsonRpcError(
            INTERNAL_ERROR,
            f"the input responses were not delivered: {cause}",
            {"node": record.owner},
            status=503,
        )

    async def cancel(self, record: TaskRecord, reason: str) -> None:
        """Stop the call of a task another replica runs (the task is already `cancelled` in the
        store; an unreachable owner stops it at its next sweep, or died with it)."""
        peer = await self.peer(record.owner)
        if peer is not None:
            await self.forwarder.call(peer, "tasks/cancel", {"taskId": record.task_id, "reason": reason})
