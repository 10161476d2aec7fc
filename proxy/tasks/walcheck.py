"""Committed transactions in an SQLite write-ahead log that SQLite would silently skip.

When SQLite opens a database in WAL mode it replays the log's frames in order and stops at the
first frame whose salts or checksum do not match (https://www.sqlite.org/fileformat2.html#walformat,
"Checksum Algorithm"): what follows is taken for a write a crash tore. That is right for the torn
tail a power loss leaves, but when a frame in the middle is damaged afterwards (a bad disk block, a
stray write), every transaction committed after it is dropped without a word: completed tasks come
back as running, running ones as unknown. A tear can only end the log, so a commit frame of the
log's current generation (its salts) *after* the first bad frame means damage, not a tear.

Frames a checkpoint already copied into the database (`nBackfill` in the `-shm` wal-index, trusted
when it describes this log: its salts are the log's) are safe whatever the log says. `skipped_commits`
reads the log's fixed-size headers and checksums the frames SQLite would accept (those since the log
last restarted: a checkpoint each second keeps them few); it never opens the database, so the log
stays as it is for a recovery.
"""

from __future__ import annotations

import os
import struct
import sys

WAL_MAGIC = (0x377F0682, 0x377F0683)  # the low bit: checksums over big-endian (1) or little-endian words
WAL_HEADER = struct.Struct(">8I")  # magic, version, page size, checkpoint seq, salt-1, salt-2, checksum x2
FRAME_HEADER = struct.Struct(">6I")  # page number, db size after commit (0: not a commit), salts, checksums
MASK = 0xFFFFFFFF
SHM_SALTS = slice(32, 40)  # the first wal-index header's copy of the log header's salts (raw bytes)
SHM_BACKFILL = slice(96, 100)  # nBackfill: frames already copied into the database (native order)


def _backfilled(shm_path: str, salts: bytes) -> int:
    """Frames of the log with header salts `salts` that a checkpoint copied into the database, from
    the `-shm` file when it describes that log (else 0: nothing is taken as safe)."""
    try:
        with open(shm_path, "rb") as shm:
            index = shm.read(SHM_BACKFILL.stop)
    except OSError:
        return 0
    if len(index) < SHM_BACKFILL.stop or index[SHM_SALTS] != salts:
        return 0
    return int.from_bytes(index[SHM_BACKFILL], sys.byteorder)


def _checksum(data: bytes, s0: int, s1: int, big_endian: bool) -> tuple[int, int]:
    """SQLite's WAL checksum of `data` (a multiple of 8 bytes) continued from `(s0, s1)`."""
    words = struct.unpack(f"{'>' if big_endian else '<'}{len(data) // 4}I", data)
    for i in range(0, len(words), 2):
        s0 = (s0 + words[i] + s1) & MASK
        s1 = (s1 + words[i + 1] + s0) & MASK
    return s0, s1


def skipped_commits(wal_path: str) -> int:
    """How many committed transactions of the log at `wal_path` (`cache.db-wal`) lie after a frame
    SQLite will reject, so that it would skip them: commit frames of the current generation (the
    header's salts) after the first bad frame and not yet copied into the database (`-shm`'s
    nBackfill). 0 without a log, for an intact one, and for a torn tail. A header SQLite cannot read
    (bad magic or page size) with a frame after it counts as 1 (SQLite then ignores the whole log).
    Raises OSError when the file cannot be read."""
    try:
        size = os.path.getsize(wal_path)
    except FileNotFoundError:
        return 0
    if size <= WAL_HEADER.size:
        return 0
    with open(wal_path, "rb") as wal:
        header = wal.read(WAL_HEADER.size)
        magic, _version, page_size, _seq, salt1, salt2, check1, check2 = WAL_HEADER.unpack(header)
        frame_size = FRAME_HEADER.size + page_size
        if magic not in WAL_MAGIC or page_size < 512 or page_size & (page_size - 1) or page_size > 65536:
            return 1 if size >= WAL_HEADER.size + FRAME_HEADER.size + 512 else 0
        backfilled = _backfilled(wal_path.removesuffix("-wal") + "-shm", header[16:24])
        big_endian = bool(magic & 1)
        sums = _checksum(header[:24], 0, 0, big_endian)
        accepting = sums == (check1, check2)  # a bad header: SQLite accepts no frame at all
        skipped = 0
        for number, offset in enumerate(range(WAL_HEADER.size, size - frame_size + 1, frame_size), 1):
            wal.seek(offset)
            frame = wal.read(frame_size) if accepting else wal.read(FRAME_HEADER.size)
            _page, commit, frame_salt1, frame_salt2, frame_check1, frame_check2 = FRAME_HEADER.unpack(
                frame[: FRAME_HEADER.size]
            )
            ours = (frame_salt1, frame_salt2) == (salt1, salt2)
            if accepting:
                sums = _checksum(frame[:8] + frame[FRAME_HEADER.size :], *sums, big_endian) if ours else sums
                if ours and sums == (frame_check1, frame_check2):
                    continue
                accepting = False  # SQLite stops here: a tear, unless commits of this generation follow
                continue
            if ours and commit and number > backfilled:
                skipped += 1
        return skipped
