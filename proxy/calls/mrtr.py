"""Multi round-trip requests (SEP-2322, 2026-07-28 basic/patterns/mrtr) for calls not yet detached.

When a legacy upstream asks its client something (elicitation, sampling, roots) while a modern
client still waits on the original request, the proxy answers that request with an
`InputRequiredResult` and parks the live upstream call. The `requestState` it hands out is a
signed token (HS256 JWT) that names the parked call, binds it to the principal, the server and a
digest of the request, expires, and is single-use: each round mints a fresh nonce and a retry
must present the current one; the nonce is also claimed once in the task store (`claim_once`), so
with replicas on one Redis a state replayed to another replica is refused just the same. Anything
else is refused with -32602 before anything is touched.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import os
import secrets
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import jwt

from proxy.calls.call import Call
from proxy.config import ConfigError
from proxy.protocol.jsonrpc import INTERNAL_ERROR, INVALID_PARAMS, JsonRpcError
from proxy.tasks.store import StoreUnavailableError, TaskStore

KEY_FILE = "request_state.key"
KEY_BLOB = "request_state.key"  # the shared key's name in a Redis store


class OnceClaims(Protocol):
    """The single-use claims of a task store (`TaskStore.claim_once`, `TaskStore.claimed`)."""

    async def claim_once(self, key: str, ttl_ms: int) -> bool:
        """True for the first claim of `key` within `ttl_ms` ms."""

    async def claimed(self, key: str) -> bool:
        """True while `key` is claimed."""


async def _store_call(call: Awaitable[bool]) -> bool:
    """`await call`, a store unavailable becoming JsonRpcError -32603 (HTTP 503)."""
    try:
        return await call
    except StoreUnavailableError as exc:
        raise JsonRpcError(INTERNAL_ERROR, f"requestState cannot be checked: {exc}", status=503) from None


async def shared_key(store: TaskStore, configured: str | None) -> bytes:
    """The HMAC key for `requestState` shared by every replica of a Redis store: the configured
    secret, else 32 random bytes stored once in the store (the first replica's write wins).
    Raises StoreUnavailableError."""
    if configured:
        return configured.encode()
    await store.put_blob(KEY_BLOB, secrets.token_bytes(32), None, only_new=True)
    key = await store.get_blob(KEY_BLOB)
    if key is None or len(key) < 32:
        raise ConfigError(
            f"task store {store.where}: the shared request_state key is missing or short; set "
            f"request_state.secret"
        )
    return key


def derive_key(key: bytes, purpose: str) -> bytes:
    """A 32-byte key for one `purpose` (`console-cookie`, `principal-hash`) derived from the
    deployment's `requestState` key by HMAC-SHA256, so each use has its own key and every replica
    derives the same one."""
    return hmac.new(key, b"mcp-tasks-proxy/" + purpose.encode(), hashlib.sha256).digest()


def load_or_create_key(store_path: str, configured: str | None) -> bytes:
    """The HMAC key for `requestState`: the configured secret, else one generated once and kept
    beside the store (`<store>/request_state.key`, 64 hex digits, mode 0600, written atomically),
    so states survive restarts but the key never leaves the machine.

    Raises ConfigError when the key file exists but is empty, not hex, shorter than 32 bytes, or
    cannot be read or written (the message names the file and what to do).
    """
    if configured:
        return configured.encode()
    path = Path(store_path) / KEY_FILE
    try:
        return _read_key(path)
    except FileNotFoundError:
        pass
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        key = secrets.token_bytes(32)
        tmp = path.with_name(f".{KEY_FILE}.{secrets.token_hex(6)}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, key.hex().encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)  # atomic, and never replaces a key another process wrote meanwhile
        except FileExistsError:
            return _read_key(path)
        finally:
            os.unlink(tmp)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot write the request_state key: {exc.strerror or exc}") from None
    return key


def _read_key(path: Path) -> bytes:
    """The key in an existing key file. Raises FileNotFoundError when there is none, ConfigError when it is
    unusable."""
    try:
        text = path.read_text(encoding="ascii", errors="replace").strip()
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the request_state key: {exc.strerror or exc}") from None
    fix = (
        "delete the file to have a new key generated (open MRTR rounds are then refused), or set "
        "request_state.secret"
    )
    if not text:
        raise ConfigError(f"{path}: the request_state key file is empty; {fix}")
    try:
        key = bytes.fromhex(text)
    except ValueError:
        raise ConfigError(f"{path}: the request_state key file does not hold hex digits; {fix}") from None
    if len(key) < 32:
        raise ConfigError(f"{path}: the request_state key is {len(key)} bytes, fewer than 32; {fix}")
    return key


def request_digest(method: str, name: Any, arguments: Any) -> str:
    """SHA-256 over the canonical JSON of what identifies a request across MRTR rounds."""
    canonical = json.dumps(
        {"m": method, "n": name, "a": arguments}, sort_keys=True, separators=(",", ":"), default=str
    )
    return hashlib.sha256(canonical.encode("utf-8", "surrogatepass")).hexdigest()  # lone surrogates too


def principal_digest(principal: str) -> str:
    """A short hash of the principal (the token is signed, not encrypted)."""
    return hashlib.sha256(principal.encode("utf-8", "surrogatepass")).hexdigest()[:32]


@dataclass
class Parked:
    """A call waiting for its client's retry; `nonce` is the one state that may resume it."""

    call: Call
    nonce: str
    principal: str
    server: str
    digest: str
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)


class ParkedCalls:
    """The calls of this proxy process waiting for an MRTR retry.

    `key` signs the states; `timeout_s` is how long a parked call waits for its retry before it is
    cancelled upstream (the `input_timeout` of its tool). `once` (the task store, on Redis) marks
    each state's nonce used store-wide (`claim_once`), so that a replica the call is not parked on
    refuses a replay as used too (`claimed`); without it only this process remembers. `node` is
    this process's node id, named in each state when given (replicas route a retry to its call by it).
    """

    def __init__(self, key: bytes, once: OnceClaims | None = None, *, node: str = "") -> None:
        self._key = key
        self._once = once
        self.node = node
        self._parked: dict[str, Parked] = {}

    def __len__(self) -> int:
        return len(self._parked)

    def owner_of(self, state: Any) -> str | None:
        """The node a valid, unexpired `requestState` names as holding its call; None for anything else."""
        if not isinstance(state, str):
            return None
        try:
            if not state.isascii():  # a JWT is ASCII; anything else was not issued here
                return None
            claims = jwt.decode(
                state, self._key, algorithms=["HS256"], options={"require": ["exp", "pid", "n"]}
            )
        except jwt.InvalidTokenError:
            return None
        owner = claims.get("o")
        return owner if isinstance(owner, str) and owner else None

    def park(self, call: Call, *, principal: str, server: str, digest: str, timeout_s: float) -> str:
        """Park `call` (or re-park it for a new round) and return the new `requestState`."""
        pid = call.call_id
        entry = self._parked.get(pid)
        nonce = secrets.token_urlsafe(12)
        if entry is None:
            entry = Parked(call=call, nonce=nonce, principal=principal, server=server, digest=digest)
            self._parked[pid] = entry
            call.add_done_callback(lambda c: self._forget(pid))
        entry.nonce = nonce
        if entry.timer is not None:
            entry.timer.cancel()
        entry.timer = asyncio.get_running_loop().call_later(timeout_s, self._expire, pid, timeout_s)
        claims = {
            "pid": pid,
            "n": nonce,
            "p": principal_digest(principal),
            "s": server,
            "d": digest,
            "exp": int(time.time() + timeout_s),
        }
        if self.node:
            claims["o"] = self.node
        return jwt.encode(claims, self._key, algorithm="HS256")

    async def resume(self, state: Any, *, principal: str, server: str, digest: str) -> Call:
        """Verify a retry's `requestState` and take its call out of the parked set.

        Raises JsonRpcError(-32602) for a malformed, tampered, expired, foreign or replayed state;
        nothing changes then; JsonRpcError(-32603, HTTP 503) when the store-wide claim cannot be
        checked or written.
        """
        if not isinstance(state, str):
            raise JsonRpcError(INVALID_PARAMS, "requestState must be the string this server sent")
        try:
            if not state.isascii():  # a JWT is ASCII (a lone surrogate would not even encode)
                raise jwt.InvalidTokenError("not ASCII")
            claims = jwt.decode(
                state, self._key, algorithms=["HS256"], options={"require": ["exp", "pid", "n"]}
            )
        except jwt.ExpiredSignatureError:
            raise JsonRpcError(
                INVALID_PARAMS, "requestState has expired; send the request again without it"
            ) from None
        except jwt.InvalidTokenError:
            raise JsonRpcError(
                INVALID_PARAMS, "requestState is not valid (it was altered or not issued here)"
            ) from None
        pid = claims.get("pid")
        if (
            claims.get("p") != principal_digest(principal)
            or claims.get("s") != server
            or claims.get("d") != digest
        ):
            raise JsonRpcError(INVALID_PARAMS, "requestState does not belong to this request")
        once_key = f"mrtr:{pid}:{claims.get('n')}"
        entry = self._parked.get(pid) if isinstance(pid, str) else None
        if entry is None or entry.principal != principal or entry.server != server or entry.digest != digest:
            # Not parked here: a state another replica already took is refused as used, as it would be there.
            if self._once is not None and await _store_call(self._once.claimed(once_key)):
                raise JsonRpcError(INVALID_PARAMS, "requestState was already used; retry with the latest one")
            raise JsonRpcError(INVALID_PARAMS, "requestState does not belong to this request")
        if entry.nonce != claims.get("n"):
            raise JsonRpcError(INVALID_PARAMS, "requestState was already used; retry with the latest one")
        if self._once is not None:
            ttl_ms = max(1, int((float(claims["exp"]) - time.time()) * 1000) + 1000)
            if not await _store_call(self._once.claim_once(once_key, ttl_ms)):
                raise JsonRpcError(INVALID_PARAMS, "requestState was already used; retry with the latest one")
        entry.nonce = ""  # single use: the next round mints a new one
        if entry.timer is not None:
            entry.timer.cancel()
            entry.timer = None
        return entry.call

    def release(self, call: Call) -> None:
        """Stop tracking a call that left the MRTR flow (it finished or became a task)."""
        self._forget(call.call_id)

    def _forget(self, pid: str) -> None:
        entry = self._parked.pop(pid, None)
        if entry is not None and entry.timer is not None:
            entry.timer.cancel()

    def _expire(self, pid: str, timeout_s: float) -> None:
        entry = self._parked.get(pid)
        if entry is None or entry.nonce == "":
            return  # resumed in the meantime
        self._forget(pid)
        entry.call.fail_input_timeout(timeout_s)
