"""The embedded store's directory: made private, and refused when someone else could change it.

A store directory another local user can write to is a way into the proxy: whoever plants a value
there decides what the proxy reads (and, with a serializer that runs code, what it runs). So before
the store is opened (the serving lock included):

- missing directories of `store.path` are created one by one with mode 0700 (whatever the umask);
- the directory itself, and every file and directory in it, must be owned by the proxy's user and
  not writable by group or others;
- each parent, walking up, must be owned by the proxy's user or root and not writable by group or
  others, up to the first root-owned directory or sticky directory (`/tmp`), where the walk stops;
- a directory that passes has its mode narrowed to 0700 (group and others lose read access too);
- when `store.path` goes through a symbolic link, the parents of the link are checked too, and the
  store is opened at the real path (a link swapped later changes nothing).

Anything else raises UnsafeStoreError, naming the path, what is wrong and the fix.
"""

from __future__ import annotations

import os
import stat

from proxy.tasks.store import StoreUnavailableError


class UnsafeStoreError(StoreUnavailableError):
    """The store directory, a file in it, or a parent may be changed by another local user.
    The message names the path, the owner or mode found, and the fix."""


def prepare_store_directory(path: str | os.PathLike[str]) -> str:
    """Create `path` (missing parts mode 0700), check it, its contents and its parents as the module
    docstring says, narrow it to 0700, and return its real path.

    Raises UnsafeStoreError for an unsafe directory, file or parent; OSError when it cannot be created
    or read.
    """
    wanted = os.path.abspath(os.fspath(path))
    if os.path.exists(wanted) and not os.path.isdir(wanted):
        raise UnsafeStoreError(
            f"task store {wanted}: not a directory; store.path names the store's directory"
        )
    _make_private(wanted)
    real = os.path.realpath(wanted)
    _check_parents(os.path.dirname(real))
    if real != wanted:  # a symbolic link on the way: whoever can change it can swap the store
        _check_parents(os.path.dirname(wanted))
        link = os.lstat(wanted)
        if stat.S_ISLNK(link.st_mode) and link.st_uid not in (os.geteuid(), 0):
            raise UnsafeStoreError(
                f"task store {wanted}: a symbolic link owned by uid {link.st_uid}, who can point it "
                "elsewhere before the next start. Fix: point store.path at the directory itself"
            )
    _check_own(real, os.lstat(real))
    os.chmod(real, 0o700)
    for root, dirs, files in os.walk(real):
        for name in dirs + files:
            entry = os.path.join(root, name)
            _check_own(entry, os.lstat(entry))
    return real


def _make_private(path: str) -> None:
    """Create the missing directories of `path`, each with mode 0700 (mkdir's mode is narrowed by the
    umask, never widened, so none is wider than 0700)."""
    missing = []
    here = path
    while not os.path.lexists(here):
        missing.append(here)
        parent = os.path.dirname(here)
        if parent == here:
            break
        here = parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory, 0o700)
        except FileExistsError:
            pass


def _check_own(path: str, st: os.stat_result) -> None:
    """The store's own directory or a file in it: ours, and writable by us alone."""
    uid = os.geteuid()
    if st.st_uid != uid:
        raise UnsafeStoreError(
            f"task store {path}: owned by uid {st.st_uid}, not by the proxy's uid {uid}; another user "
            f"could plant data there. Fix: chown -R {uid} the store directory if it is yours, or choose "
            "another store.path"
        )
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeStoreError(
            f"task store {path}: a symbolic link inside the store directory; remove it or choose another "
            "store.path"
        )
    if st.st_mode & 0o022:
        raise UnsafeStoreError(
            f"task store {path}: writable by group or others (mode {stat.S_IMODE(st.st_mode):04o}); "
            f"another user could plant data there. Fix: chmod go-w {path} (the proxy keeps its store "
            "0700), or choose another store.path"
        )


def _check_parents(directory: str) -> None:
    """Walk up from `directory` until a root-owned or sticky directory; each one on the way must be
    ours (or root's) and writable by its owner alone."""
    uid = os.geteuid()
    while True:
        st = os.stat(directory)
        if st.st_mode & stat.S_ISVTX:
            return  # /tmp and the like: others may add entries, not replace ours
        if st.st_uid not in (uid, 0):
            raise UnsafeStoreError(
                f"task store: the parent directory {directory} is owned by uid {st.st_uid}, who could "
                "replace the store directory. Fix: put store.path under a directory of the proxy's user"
            )
        if st.st_mode & 0o022:
            raise UnsafeStoreError(
                f"task store: the parent directory {directory} is writable by group or others (mode "
                f"{stat.S_IMODE(st.st_mode):04o}) without the sticky bit, so another user could replace "
                f"the store directory. Fix: chmod go-w {directory}, or put store.path elsewhere"
            )
        parent = os.path.dirname(directory)
        if st.st_uid == 0 or parent == directory:
            return
        directory = parent
