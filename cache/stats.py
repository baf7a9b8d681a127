"""Cache counters: kept per process in memory, added up across processes in a small SQLite file.

Each process records events in memory (cheap: one dict update under a lock) and every few seconds, and at
exit, adds what it counted since the last flush to `stats.sqlite` in the cache directory, so `pffs stats`
reports the whole machine's cache, not one process's.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
import time
from pathlib import Path

from .fork import at_exit, sqlite_fork_gate

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
)

FLUSH_EVERY_S = 2.0


class CacheStats:
    def __init__(self, store_path: str | Path | None = None) -> None:
        self._store_path = Path(store_path) if store_path else None
        self._lock = threading.Lock()
        self._totals = dict.fromkeys(COUNTERS, 0)  # since this object was made (this process)
        self._unflushed = dict.fromkeys(COUNTERS, 0)
        self._next_flush = time.monotonic() + FLUSH_EVERY_S
        if self._store_path is not None:
            at_exit(self.flush)

    def reset_after_fork(self) -> None:
        # What the parent counted is the parent's to flush.
        self._lock = threading.Lock()
        self._totals = dict.fromkeys(COUNTERS, 0)
        self._unflushed = dict.fromkeys(COUNTERS, 0)

    def add(self, name: str, amount: int = 1) -> None:
        with self._lock:
            self._totals[name] += amount
            self._unflushed[name] += amount
        if self._store_path is not None and time.monotonic() >= self._next_flush:
            self.flush()

    def snapshot(self) -> dict[str, int]:
        """Counts of this process since start."""
        with self._lock:
            return dict(self._totals)

    def flush(self) -> None:
        if self._store_path is None:
            return
        with self._lock:
            deltas = {k: v for k, v in self._unflushed.items() if v}
            self._unflushed = dict.fromkeys(COUNTERS, 0)
            self._next_flush = time.monotonic() + FLUSH_EVERY_S
        if not deltas:
            return
        try:
            with sqlite_fork_gate, _connect(self._store_path) as con:
                con.executemany(
                    "INSERT INTO counters(name, value) VALUES (?, ?) "
                    "ON CONFLICT(name) DO UPDATE SET value = value + excluded.value",
                    list(deltas.items()),
                )
        except (OSError, sqlite3.Error) as exc:
            log.debug("could not save cache statistics to %s: %s", self._store_path, exc)


def read_totals(store_path: str | Path) -> dict[str, int]:
    """Counts of every process that used this cache directory, since it was made or cleared."""
    totals = dict.fromkeys(COUNTERS, 0)
    if not Path(store_path).exists():
        return totals
    with sqlite_fork_gate, _connect(Path(store_path)) as con:
        for name, value in con.execute("SELECT name, value FROM counters"):
            if name in totals:
                totals[name] = int(value)
    return totals


def reset_totals(store_path: str | Path) -> None:
    if Path(store_path).exists():
        with sqlite_fork_gate, _connect(Path(store_path)) as con:
            con.execute("DELETE FROM counters")


class _connect:
    """A short-lived connection: opened per flush so nothing is shared across fork."""

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
