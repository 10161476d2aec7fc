"""One serving process per store directory: an OS lock (flock on `<dir>/proxy.lock`) that the kernel
releases when its holder dies, SIGKILL included. The file holds the holder's pid for the message."""

from __future__ import annotations

import fcntl
import os

from proxy.tasks.store import StoreLockedError
from proxy.tasks.storedir import prepare_store_directory

_HELD: dict[str, list[int]] = {}  # directory → [lock fd, holders in this process]


def lock_directory(path: str) -> int:
    """Take the exclusive serving lock of a store directory (created 0700 if missing, and checked
    first: `storedir.prepare_store_directory`); return its fd.

    Re-entrant within one process (each call needs one `unlock_directory`). Raises StoreLockedError,
    naming the directory and the holder's pid, when another process holds it; UnsafeStoreError for a
    directory another user could change; OSError when the directory cannot be created.
    """
    key = os.path.realpath(path)
    if key in _HELD:
        _HELD[key][1] += 1
        return _HELD[key][0]
    prepare_store_directory(path)
    fd = os.open(os.path.join(path, "proxy.lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise StoreLockedError(
            f"the task store {path} is in use by another proxy (pid {holder}); one serving process per store "
            "directory: give this one its own store.path"
        ) from None
    pid = str(os.getpid()).encode()
    os.pwrite(fd, pid, 0)  # the pid first, then cut what an earlier holder left: never read empty
    os.ftruncate(fd, len(pid))
    _HELD[key] = [fd, 1]
    return fd


def unlock_directory(path: str) -> None:
    """Release one hold of `lock_directory(path)`; the lock goes when the last holder releases it."""
    key = os.path.realpath(path)
    held = _HELD.get(key)
    if held is not None:
        held[1] -= 1
        if held[1] <= 0:
            del _HELD[key]
            os.close(held[0])
