"""Cache counters, added up across every process that uses a cache directory.

Each process counts into a small file of its own, mapped into memory (`stats.live/<pid>-<random>.counts`):
a count is a store into shared memory, as cheap as a dict update, and it is in the file the moment it is
made, so it survives however the process ends. (A DataLoader worker leaves through os._exit or is ended by
SIGTERM: counts kept for an exit hook were lost, 1,511 misses and 0 hits reported for 2,000 and 2,000.)
The process holds an flock on its file while it lives; whoever takes that lock knows the process has ended,
whatever its PID namespace, and moves its counts into `stats.sqlite`, deleting the file in the same
transaction. That happens when any process starts counting and whenever totals are read. Totals are
`stats.sqlite` plus every counts file still there, so a running process's counts show at once.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import secrets
import sqlite3
import threading
from pathlib import Path

from .fork import sqlite_fork_gate

log = logging.getLogger(__name__)

COUNTERS = (
    "memory_hits",
    "disk_hits",
    "misses",
    "bytes_from_memory",
    "bytes_from_disk",
    "bytes_fetched",
    "memory_evictions",
    "disk_evictions",
    "corrupt_blocks",
    "disk_write_failures",
    # Backend requests of the processes reading through this cache (counted by the VFS; the cache knows
    # nothing of backends): per kind, requests, failures and "no such object" answers.
    *(
        f"backend_{kind}_{what}"
        for kind in ("get", "head", "list", "put", "delete", "copy")
        for what in ("requests", "errors", "not_found")
    ),
    "prefetches",  # blocks fetched ahead of their reader (read-ahead, a directory's next files)
    "prefetch_hits",  # reads that found a block fetched ahead for them (not counted as hits)
    "stale_metadata_served",  # stats and listings answered as last seen: the backend could not be reached
)  # new counters go at the end: a counts file written by an older version reads as zeros past its end
LIVE_FOLDER = "stats.live"  # beside stats.sqlite
SUFFIX = ".counts"
_SIZE = 8 * len(COUNTERS)  # one signed 64-bit count per counter, in COUNTERS' order
_INDEX = {name: i for i, name in enumerate(COUNTERS)}


class CacheStats:
    """This process's counters; with `store_path` (a cache directory's stats.sqlite), also the machine's."""

    def __init__(self, store_path: str | Path | None = None) -> None:
        self._store_path = Path(store_path) if store_path else None
        self._lock = threading.Lock()
        self._totals = dict.fromkeys(COUNTERS, 0)  # since this object was made (this process)
        self._file: _CountsFile | None = None  # made at the first count
        if self._store_path is not None:
            merge_ended(self._store_path)

    def reset_after_fork(self) -> None:
        # What the parent counted is the parent's; the child counts into a file of its own.
        self._lock = threading.Lock()
        self._totals = dict.fromkeys(COUNTERS, 0)
        if self._file is not None:
            self._file.close()  # the child's copy only: the parent keeps its file and its lock
            self._file = None

    def add(self, name: str, amount: int = 1) -> None:
        with self._lock:
            self._totals[name] += amount
            if self._store_path is None:
                return
            if self._file is None:
                try:
                    self._file = _CountsFile.create(self._store_path.parent / LIVE_FOLDER)
                except OSError as exc:
                    log.debug("cannot count into %s: %s", self._store_path.parent, exc)
                    self._store_path = None  # this process's counts stay its own
                    return
            self._file.add(_INDEX[name], amount)

    def snapshot(self) -> dict[str, int]:
        """Counts of this process since start."""
        with self._lock:
            return dict(self._totals)


class _CountsFile:
    """A process's counts file: mapped, and flock'ed for as long as the process lives."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path, self.fd = path, fd
        self._map = mmap.mmap(fd, _SIZE)
        self.counts = memoryview(self._map).cast("q")

    @classmethod
    def create(cls, folder: Path) -> _CountsFile:
        """A new counts file, locked before it takes its name: under that name an unlocked file is one
        whose process ended, and a merge starting in another process (each DataLoader worker merges as it
        starts) would take its zero counts and remove it, leaving this process counting into a file with
        no name (a worker's 7 disk hits lost in a CI run)."""
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{os.getpid()}-{secrets.token_hex(4)}{SUFFIX}"
        unnamed = path.with_name(path.name + ".new")  # merges and totals read *.counts only
        fd = os.open(unnamed, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # nobody else knows the name: never waits
            os.ftruncate(fd, _SIZE)
            os.rename(unnamed, path)  # the lock is the open file's: it goes with the new name
            return cls(path, fd)
        except BaseException:
            os.close(fd)
            unnamed.unlink(missing_ok=True)
            raise

    def add(self, index: int, amount: int) -> None:
        self.counts[index] += amount

    def close(self) -> None:
        self.counts.release()
        self._map.close()
        os.close(self.fd)


def _read_counts(fd: int) -> dict[str, int]:
    data = os.pread(fd, _SIZE, 0).ljust(_SIZE, b"\0")
    return dict(zip(COUNTERS, memoryview(data).cast("q").tolist(), strict=True))


def merge_ended(store_path: str | Path) -> None:
    """Moves the counts of processes that have ended into stats.sqlite (each file once, whoever else is
    merging: a file is merged only by the holder of its lock, and only while it still has its name)."""
    folder = Path(store_path).parent / LIVE_FOLDER
    try:
        names = [p for p in folder.iterdir() if p.name.endswith(SUFFIX)]
    except OSError:
        return
    for path in names:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            continue  # merged by another process meanwhile
        try:
            with contextlib.suppress(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if os.fstat(fd).st_nlink == 0:
                    continue  # merged and removed between our open and our lock
                counts = {k: v for k, v in _read_counts(fd).items() if v}
                with sqlite_fork_gate, _connect(Path(store_path)) as con:
                    con.execute("BEGIN IMMEDIATE")
                    _add(con, counts)
                    path.unlink()  # inside the transaction: at worst lost, never counted twice
                    con.execute("COMMIT")
        except (OSError, sqlite3.Error) as exc:
            log.debug("could not merge cache statistics %s: %s", path, exc)
        finally:
            os.close(fd)


def _add(con: sqlite3.Connection, counts: dict[str, int]) -> None:
    con.executemany(
        "INSERT INTO counters(name, value) VALUES (?, ?) "
        "ON CONFLICT(name) DO UPDATE SET value = value + excluded.value",
        list(counts.items()),
    )


def read_totals(store_path: str | Path) -> dict[str, int]:
    """Counts of every process that used this cache directory, since it was made or cleared: those that
    ended (stats.sqlite) and those still running (their counts files)."""
    totals = dict.fromkeys(COUNTERS, 0)
    if not Path(store_path).parent.exists():
        return totals
    merge_ended(store_path)
    if Path(store_path).exists():
        with sqlite_fork_gate, _connect(Path(store_path)) as con:
            for name, value in con.execute("SELECT name, value FROM counters"):
                if name in totals:
                    totals[name] += int(value)
    with contextlib.suppress(OSError):
        for path in (Path(store_path).parent / LIVE_FOLDER).iterdir():
            if path.name.endswith(SUFFIX):
                with contextlib.suppress(OSError), open(path, "rb") as f:
                    for name, value in _read_counts(f.fileno()).items():
                        totals[name] += value
    return totals


def reset_totals(store_path: str | Path) -> None:
    """Forgets what ended processes counted. (Running processes' counts stay: their files are theirs.)"""
    merge_ended(store_path)
    if Path(store_path).exists():
        with sqlite_fork_gate, _connect(Path(store_path)) as con:
            con.execute("DELETE FROM counters")


class _connect:
    """A short-lived connection: opened per use so nothing is shared across fork."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __enter__(self) -> sqlite3.Connection:
        os.makedirs(self.path.parent, exist_ok=True)
        self.con = sqlite3.connect(self.path, timeout=10, isolation_level=None)
        self.con.execute(
            "CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL)"
        )
        return self.con

    def __exit__(self, *exc: object) -> None:
        self.con.close()
