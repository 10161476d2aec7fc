"""How the embedded store writes values: data, never code (issue: CVE-2025-69872 in diskcache's
default `Disk`, which pickles every value that is not a string, a number or bytes).

`DataDisk` is the diskcache `Disk` the store opens its cache with:

- keys are strings (stored raw, as diskcache does);
- strings, numbers and bytes are stored as diskcache stores them (raw in SQLite, or in a value file
  from 32 KiB on);
- every other value (task records, session maps: dicts, lists, None, booleans) is JSON, in SQLite
  or in a value file the same way: written by orjson and marked `MODE_JSON` (5; diskcache's own
  modes are 0-4), or, for what orjson refuses (lone surrogates, integers past 64 bits, NaN), by
  `json` and marked `MODE_JSON_STDLIB` (6), so the common read is one orjson call;
- a value an older version pickled (mode 4) is read with `read_plain_pickle`, which refuses every
  global (class, function, module attribute): a record holds only dicts, lists, strings and numbers.
  `DiskcacheStore` rewrites those as JSON when it starts serving (`convert_pickled`);
- value files and the two levels of directories above them are made 0600 / 0700 as soon as they
  are written, whatever the process umask.

A value that cannot be read back (a refused pickle, damaged JSON) raises StoredValueError.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import sqlite3
from typing import Any

import diskcache
import orjson

from proxy.protocol import jsonrpc

MODE_JSON = 5  # orjson wrote it: orjson reads it back
MODE_JSON_STDLIB = 6  # json wrote it (what orjson refuses): read back with json's rules


class StoredValueError(Exception):
    """A stored value that is not plain data (a pickle naming a class or function) or cannot be
    decoded. The message says which; the value is never run."""


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise StoredValueError(f"a pickled value names {module[:60]}.{name[:60]}; only plain data is read")


MAX_PICKLED_ITEMS = 1_000_000  # values (shared ones counted each time) one old pickle may hold
MAX_PICKLED_DEPTH = 128  # nesting levels one old pickle may hold


def read_plain_pickle(data: bytes) -> Any:
    """The dicts, lists, tuples, strings, numbers, bytes, booleans and None in a pickle; raises
    StoredValueError when it names any global, is damaged, or is a bomb of plain data (a list
    holding itself, or shared lists nested into billions of items once written out: more than
    MAX_PICKLED_ITEMS items or MAX_PICKLED_DEPTH levels)."""
    try:
        value = _PlainUnpickler(io.BytesIO(data)).load()
    except StoredValueError:
        raise
    except Exception as exc:  # pickle raises many kinds for damaged input; none may escape as a 500
        raise StoredValueError(f"a pickled value cannot be read ({exc.__class__.__name__})") from None
    _check_bounded(value)
    return value


def _check_bounded(value: Any) -> None:
    """Walk `value` as JSON would write it, counting every item; StoredValueError past the bounds."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    items = 0
    while stack:
        item, depth = stack.pop()
        items += 1
        if items > MAX_PICKLED_ITEMS or depth > MAX_PICKLED_DEPTH:
            raise StoredValueError("a pickled value is too large or too deep once written out; not read")
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, (list, tuple, set, frozenset)):
            stack.extend((v, depth + 1) for v in item)


def encode(value: Any) -> tuple[int, bytes]:
    """`(mode, JSON bytes)` for a stored value: orjson (`MODE_JSON`), or `json` for what orjson
    refuses (`MODE_JSON_STDLIB`). Raises TypeError for values JSON cannot hold."""
    try:
        return MODE_JSON, orjson.dumps(value)
    except TypeError:
        return MODE_JSON_STDLIB, json.dumps(value, separators=(",", ":")).encode()


def decode(mode: int, data: bytes) -> Any:
    """The value `encode` wrote with `mode`; raises StoredValueError for bytes that are not JSON."""
    try:
        return orjson.loads(data) if mode == MODE_JSON else jsonrpc.loads(data)
    except ValueError as exc:
        raise StoredValueError(f"a stored value is not valid JSON ({exc.__class__.__name__})") from None


class DataDisk(diskcache.Disk):
    """diskcache's `Disk` with JSON instead of pickle; see the module docstring. Built by
    `diskcache.Cache(directory, disk=DataDisk)`."""

    def put(self, key: Any) -> tuple[Any, bool]:
        """Store keys as they are; only strings (raw in SQLite) are accepted. Raises TypeError."""
        if type(key) is not str:
            raise TypeError(f"store keys are strings, not {type(key).__name__}")
        return super().put(key)

    def get(self, key: Any, raw: bool) -> Any:
        """A key as stored; a pickled (non-raw) key is read as plain data only."""
        if raw:
            return super().get(key, raw)
        return read_plain_pickle(bytes(key))

    def store(self, value: Any, read: bool, key: Any = diskcache.core.UNKNOWN) -> tuple[Any, ...]:
        """`(size, mode, filename, db value)` for the Cache table: JSON for every value that is not a
        string, a number or bytes. Raises TypeError for values JSON cannot hold."""
        if read or type(value) in (str, int, float, bytes):
            size, mode, filename, db_value = super().store(value, read, key)
        else:
            mode, data = encode(value)
            size, _, filename, db_value = super().store(data, False, key)
        if filename is not None:
            self._make_private(filename)
        return size, mode, filename, db_value

    def fetch(self, mode: int, filename: str | None, value: Any, read: bool) -> Any:
        """The value of a Cache row. Raises StoredValueError for a refused pickle or damaged JSON,
        OSError when its value file cannot be read."""
        if mode in (MODE_JSON, MODE_JSON_STDLIB):
            return decode(mode, self._bytes(filename, value))
        if mode == diskcache.core.MODE_PICKLE:
            return read_plain_pickle(self._bytes(filename, value))
        return super().fetch(mode, filename, value, read)

    def _bytes(self, filename: str | None, value: Any) -> bytes:
        if value is not None:
            return bytes(value)
        assert filename is not None
        with open(os.path.join(self._directory, filename), "rb") as reader:
            return reader.read()

    def _make_private(self, filename: str) -> None:
        """Value file 0600, its two directories 0700 (diskcache creates them under the umask)."""
        full = os.path.join(self._directory, filename)
        os.chmod(full, 0o600)
        parent = os.path.dirname(full)
        for directory in (parent, os.path.dirname(parent)):
            os.chmod(directory, 0o700)


def convert_pickled(cache: diskcache.Cache, now_s: float) -> tuple[int, list[str]]:
    """Rewrite as JSON every value of `cache` an older version pickled, keeping its expiry (`now_s`:
    epoch s). A pickle that is not plain data, or whose expiry has passed, is deleted. Returns
    (values converted, keys deleted because they were not plain data)."""
    connection: sqlite3.Connection = cache._con  # diskcache's own connection (its documented `_con`)
    rows = connection.execute(
        "SELECT key, expire_time FROM Cache WHERE mode = ? AND raw = 1", (diskcache.core.MODE_PICKLE,)
    ).fetchall()
    converted, refused = 0, []
    for key, expire_time in rows:
        remaining = None if expire_time is None else expire_time - now_s
        if remaining is not None and remaining <= 0:
            cache.delete(key, retry=True)
            continue
        try:
            value = cache.get(key, retry=True)
        except StoredValueError:
            refused.append(key)
            cache.delete(key, retry=True)
            continue
        cache.set(key, value, expire=remaining, retry=True)
        converted += 1
    return converted, refused
