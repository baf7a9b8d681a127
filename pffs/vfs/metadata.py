"""Stat and listing results, trusted for a TTL. A listing fills the entries of every object it names, so
reading a listed dataset costs no HEAD per file.

Past its TTL an entry is not trusted, but it is kept `stale_s` seconds longer: while the backend cannot be
reached, it is what the VFS answers with (stale-if-error, pffs.vfs.stale)."""

from __future__ import annotations

import threading
import time

from pffs.backends.backend import ObjectInfo


class MetadataCache:
    def __init__(self, ttl_s: float, stale_s: float = 0.0) -> None:
        self.ttl_s = ttl_s
        self.stale_s = stale_s
        self._lock = threading.Lock()
        # path -> (trusted until, entry): kept until stale_s past that
        self._entries: dict[str, tuple[float, ObjectInfo]] = {}
        # (kind, path) -> listing; kind is "dir" (one level) or "find" (recursive)
        self._listings: dict[tuple[str, str], tuple[float, list[ObjectInfo]]] = {}

    def reset_after_fork(self) -> None:
        self._lock = threading.Lock()

    def get(self, path: str) -> ObjectInfo | None:
        """The entry, if still within its TTL."""
        with self._lock:
            hit = self._entries.get(path)
        if hit is None or time.monotonic() >= hit[0]:
            return None
        return hit[1]

    def get_stale(self, path: str) -> ObjectInfo | None:
        """The entry as last seen, if within its TTL plus stale_s."""
        with self._lock:
            hit = self._entries.get(path)
        if hit is None or time.monotonic() >= hit[0] + self.stale_s:
            return None
        return hit[1]

    def put(self, info: ObjectInfo) -> None:
        self.put_many([info])

    def put_many(self, infos: list[ObjectInfo]) -> None:
        if self.ttl_s <= 0 and self.stale_s <= 0:
            return
        expires = time.monotonic() + self.ttl_s
        with self._lock:
            for info in infos:
                self._entries[info.path] = (expires, info)
            if len(self._entries) > 1_000_000:
                self._drop_expired()

    def get_listing(self, kind: str, path: str) -> list[ObjectInfo] | None:
        with self._lock:
            hit = self._listings.get((kind, path))
        if hit is None or time.monotonic() >= hit[0]:
            return None
        return hit[1]

    def get_stale_listing(self, kind: str, path: str) -> list[ObjectInfo] | None:
        with self._lock:
            hit = self._listings.get((kind, path))
        if hit is None or time.monotonic() >= hit[0] + self.stale_s:
            return None
        return hit[1]

    def put_listing(self, kind: str, path: str, entries: list[ObjectInfo]) -> None:
        """Remembers a listing and the entry of every object in it."""
        self.put_many(entries)
        if self.ttl_s > 0 or self.stale_s > 0:
            with self._lock:
                self._listings[(kind, path)] = (time.monotonic() + self.ttl_s, entries)

    def invalidate(self, path: str) -> None:
        with self._lock:
            self._entries.pop(path, None)
            # Any listing may name the path (its directory, a recursive listing above it): drop them all.
            # Writes through pffs are rare next to reads, so this costs little.
            self._listings.clear()

    def _drop_expired(self) -> None:
        now = time.monotonic()
        self._entries = {p: e for p, e in self._entries.items() if e[0] + self.stale_s > now}
        if len(self._entries) > 1_000_000:  # bounded: the stale ones go first, the listings keep theirs
            self._entries = {p: e for p, e in self._entries.items() if e[0] > now}
