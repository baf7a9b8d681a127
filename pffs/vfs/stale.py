"""Stale-if-error: what the VFS answers while the backend cannot be reached.

A stat or listing past its TTL is asked of the backend again. If the backend cannot be reached (refused or
reset connections, timeouts, 5xx after retries: BackendUnavailableError, BackendTimeoutError; never a 403
or 404, which are answers), the VFS answers with what it last saw, for up to `stale_if_error` seconds past
the TTL (as HTTP caches do, RFC 5861), so a dataset whose bytes are cached reads to the end. A name its
folder's last listing does not hold is answered "no such file", as that listing said.

Serving a stale entry serves that version's identity, and cache keys carry it: a reader gets the old
version's blocks, whole, or an error for a block not cached; never a mix of versions. When the backend
answers again, a stat past the TTL sees the new version (within PROBE_S).

Counted (`stale_metadata_served` in `pffs stats` and Prometheus) and logged once per outage episode: at
WARNING when it starts, at INFO when the backend answers again. During an episode, a stat or listing that
has a stale answer does not wait for the backend: one request every PROBE_S seconds tries it, the others
are answered at once (a frozen store would otherwise cost --backend-timeout per stat).

The last listings are also kept on disk (`metadata.sqlite` in the cache directory, MetadataStore), so a
process started while the backend is down (a node restarted during an outage) has them: a mount starts
over its warm cache, saying so.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import queue
import sqlite3
import threading
import time
import zlib
from pathlib import Path

from pffs.backends.backend import ObjectInfo
from pffs.backends.posix_metadata import PosixAttributes
from pffs.cache.fork import after_fork_in_child, sqlite_fork_gate
from pffs.cache.stats import CacheStats

log = logging.getLogger(__name__)

PROBE_S = 5.0  # during an outage, one stat or listing tries the backend this often; the others wait not
COUNTER = "stale_metadata_served"


def unreachable(exc: BaseException) -> bool:
    """The backend could not be reached: retries exhausted on temporary failures (BackendUnavailableError,
    a ConnectionError) or the deadline passed (BackendTimeoutError, a TimeoutError). A 403 or 404 is an
    answer."""
    return isinstance(exc, ConnectionError | TimeoutError)


class Outage:
    """One process's view of whether its backend answers: episodes, their log lines, the counter."""

    def __init__(self, stale_s: float, stats: CacheStats, where: str) -> None:
        self.stale_s = stale_s
        self.stats = stats
        self.where = where  # the backend (its origin: protocol and endpoint), for the log lines
        self._lock = threading.Lock()
        self.since: float | None = None  # monotonic start of the episode, None while the backend answers
        self.reason = ""
        self._served = 0
        self._last_probe = 0.0

    def reset_after_fork(self) -> None:
        self._lock = threading.Lock()

    @property
    def active(self) -> bool:
        return self.since is not None

    def skip_backend(self) -> bool:
        """True during an episode between probes: answer from what was last seen without asking."""
        if self.since is None:
            return False
        now = time.monotonic()
        with self._lock:
            if now - self._last_probe < PROBE_S:
                return True
            self._last_probe = now
            return False

    def served(self, exc: BaseException | None) -> None:
        """A stale answer was given (exc: the failure that made it stale, None between probes)."""
        self.stats.add(COUNTER)
        with self._lock:
            self._served += 1
            if self.since is not None:
                return
            self.since = self._last_probe = time.monotonic()
            self.reason = _describe(exc)
        log.warning(
            "the backend %s cannot be reached (%s): serving metadata as last seen, up to %s past its TTL "
            "(--stale-if-error); cached data reads on, the rest fails until the backend answers",
            self.where,
            self.reason,
            _duration(self.stale_s),
        )

    def answered(self) -> None:
        """The backend answered (anything but unreachable): the episode, if any, ends."""
        if self.since is None:
            return
        with self._lock:
            if self.since is None:
                return
            lasted, served = time.monotonic() - self.since, self._served
            self.since, self._served = None, 0
        log.info(
            "the backend %s answers again after %.0f s; %d stats and listings were served as last seen "
            "meanwhile",
            self.where,
            lasted,
            served,
        )


def _describe(exc: BaseException | None) -> str:
    if exc is None:
        return "unknown"
    text = (exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)).strip()
    return (text or type(exc).__name__).splitlines()[0][:200]


def _duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:g} h"
    return f"{seconds:g} s"


# The store on disk

MAX_BYTES = 64 << 20  # all listings kept, compressed; the oldest go first
MAX_LISTING_BYTES = 16 << 20  # a bigger listing (compressed) is not kept
QUEUE = 256  # listings waiting to be written; more are dropped (kept on a best-effort basis)
_Item = tuple[str, str, list[ObjectInfo] | None]  # kind, path, entries (None: forget it)


class MetadataStore:
    """The last listing of each directory (and recursive listing) of one origin, kept in the cache
    directory for processes that start while the backend is down. One row per (origin, kind, path):
    the entries as zlib-compressed JSON, and the wall-clock time they were listed. Bounded by MAX_BYTES
    (least recently listed dropped first). Written by one background thread, so no listing waits for its
    write; read only when the backend cannot be reached."""

    def __init__(self, path: Path, origin: str) -> None:
        self.path = path
        self.origin = origin
        self._queue: queue.Queue[_Item | threading.Event] = queue.Queue(QUEUE)
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        after_fork_in_child(self.reset_after_fork)

    def reset_after_fork(self) -> None:
        self._lock = threading.Lock()
        self._queue = queue.Queue(QUEUE)  # what the parent queued is the parent's to write
        self._thread = None

    def save(self, kind: str, path: str, entries: list[ObjectInfo]) -> None:
        self._put((kind, path, entries))

    def forget(self, kind: str, path: str) -> None:
        self._put((kind, path, None))

    def _put(self, item: _Item | threading.Event) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="pffs-metadata-store", daemon=True)
                self._thread.start()
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            log.debug("metadata store busy: a listing is not kept")

    def flush(self, timeout_s: float = 10.0) -> None:
        """Waits until what was queued is written (tests, and a mount ending)."""
        if self._thread is None:
            return
        done = threading.Event()
        self._queue.put(done)
        done.wait(timeout_s)

    def _run(self) -> None:
        while True:
            batch = [self._queue.get()]
            while len(batch) < 64:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            rows = [item for item in batch if not isinstance(item, threading.Event)]
            try:
                if rows:
                    self._write(rows)
            except (OSError, sqlite3.Error) as exc:
                log.debug("could not keep listings in %s: %s", self.path, exc)
            for item in batch:
                if isinstance(item, threading.Event):
                    item.set()

    def _write(self, items: list[_Item]) -> None:
        rows = []
        for kind, path, entries in items:
            data = None if entries is None else zlib.compress(_encode(entries), 3)
            if data is not None and len(data) > MAX_LISTING_BYTES:
                data = None  # too big to keep: and an older one must not stand for it
            rows.append((kind, path, data))
        now = time.time()
        with sqlite_fork_gate, self._connect() as con:
            con.execute("BEGIN IMMEDIATE")
            for kind, path, data in rows:
                if data is None:
                    con.execute(
                        "DELETE FROM listings WHERE origin = ? AND kind = ? AND path = ?",
                        (self.origin, kind, path),
                    )
                else:
                    con.execute(
                        "INSERT OR REPLACE INTO listings(origin, kind, path, listed_at, size, data) "
                        "VALUES (?, ?, ?, ?, ?, ?)",
                        (self.origin, kind, path, now, len(data), data),
                    )
            total = con.execute("SELECT COALESCE(SUM(size), 0) FROM listings").fetchone()[0]
            if total > MAX_BYTES:
                _drop_oldest(con, total - MAX_BYTES)
            con.execute("COMMIT")

    def listing(self, kind: str, path: str, max_age_s: float) -> list[ObjectInfo] | None:
        """The listing kept of `path`, if listed within max_age_s seconds; None otherwise."""
        if not self.path.exists():
            return None
        try:
            with sqlite_fork_gate, self._connect() as con:
                row = con.execute(
                    "SELECT listed_at, data FROM listings WHERE origin = ? AND kind = ? AND path = ?",
                    (self.origin, kind, path),
                ).fetchone()
        except sqlite3.Error as exc:
            log.debug("could not read listings from %s: %s", self.path, exc)
            return None
        if row is None or time.time() - row[0] > max_age_s:
            return None
        try:
            return _decode(zlib.decompress(row[1]))
        except (zlib.error, ValueError, TypeError, KeyError) as exc:
            log.debug("a listing of %s kept in %s does not read: %s", path, self.path, exc)
            return None

    def _connect(self) -> _Connection:
        return _Connection(self.path)


def _drop_oldest(con: sqlite3.Connection, excess: int) -> None:
    dropped = 0
    rows = con.execute("SELECT rowid, size FROM listings ORDER BY listed_at").fetchall()
    for rowid, size in rows:
        if dropped >= excess:
            break
        con.execute("DELETE FROM listings WHERE rowid = ?", (rowid,))
        dropped += size


_POSIX_FIELDS = [f.name for f in dataclasses.fields(PosixAttributes)]


def _encode(entries: list[ObjectInfo]) -> bytes:
    """One row per entry, in ObjectInfo's field order (no dict per entry: a listing of 10,000 objects is
    encoded in milliseconds, in a thread that shares the GIL with the mount)."""
    rows = [
        [
            e.path,
            e.size,
            e.is_dir,
            e.identity,
            e.etag,
            e.version_id,
            e.mtime,
            None if e.posix is None else [getattr(e.posix, f) for f in _POSIX_FIELDS],
            e.content_type,
        ]
        for e in entries
    ]
    return json.dumps(rows, separators=(",", ":")).encode()


def _decode(data: bytes) -> list[ObjectInfo]:
    out = []
    for path, size, is_dir, identity, etag, version_id, mtime, posix, content_type in json.loads(data):
        attributes = (
            None if posix is None else PosixAttributes(**dict(zip(_POSIX_FIELDS, posix, strict=True)))
        )
        out.append(
            ObjectInfo(path, size, is_dir, identity, etag, version_id, mtime, attributes, content_type)
        )
    return out


class _Connection:
    """A short-lived connection: opened per use so nothing is shared across fork."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __enter__(self) -> sqlite3.Connection:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.con = sqlite3.connect(self.path, timeout=10, isolation_level=None)
        self.con.execute("PRAGMA journal_mode=WAL")
        self.con.execute(
            "CREATE TABLE IF NOT EXISTS listings (origin TEXT NOT NULL, kind TEXT NOT NULL, "
            "path TEXT NOT NULL, listed_at REAL NOT NULL, size INTEGER NOT NULL, data BLOB NOT NULL, "
            "PRIMARY KEY (origin, kind, path))"
        )
        return self.con

    def __exit__(self, *exc: object) -> None:
        self.con.close()
