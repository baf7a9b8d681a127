"""The disk tier: checksummed blocks in a diskcache directory shared by every process on the machine.

diskcache gives process-safe, crash-safe storage (a value file is written before the SQLite row that names it
is committed) and least-recently-used eviction by bytes. We add the checksum (see block_format) and our own
culling so evictions can be counted. When the disk is full or unwritable, writes are switched off for a while
and reads carry on from the backend: the cache is an accelerator, never a reason for a read to fail.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from pathlib import Path

from .block_disk import BlockDisk, BlockPayload, BlockStore
from .block_format import CorruptBlockError, is_intact
from .stats import CacheStats

log = logging.getLogger(__name__)

# After a failed write, try writing again only after this many seconds (the disk may have been freed).
WRITE_RETRY_AFTER_S = 30.0


class DiskTier:
    def __init__(self, directory: str | Path, capacity_bytes: int, stats: CacheStats) -> None:
        self.directory = Path(directory)
        self.capacity_bytes = capacity_bytes
        self.stats = stats
        self._writes_disabled_until = 0.0
        self._warned = False
        self._cache = BlockStore(
            str(self.directory / "blocks"),
            disk=BlockDisk,
            size_limit=capacity_bytes,
            eviction_policy="least-recently-used",
            cull_limit=0,  # we cull ourselves, after each write, to count evictions
            statistics=False,
            tag_index=False,
        )

    def get(self, key: str, start: int = 0, end: int | None = None) -> bytes | None:
        """The block, or bytes [start, end) of it; None if it is not here (or was corrupt: dropped)."""
        try:
            return self._cache.get_block(key, start, end)
        except (OSError, sqlite3.Error) as exc:
            log.warning("disk cache read failed for block %s: %s; reading from the backend", key, exc)
            return None
        except CorruptBlockError as exc:
            self.stats.add("corrupt_blocks")
            log.warning("dropping corrupt cached block %s (%s); it will be fetched again", key, exc)
            self.discard(key)
            return None

    def contains(self, key: str) -> bool:
        try:
            return key in self._cache
        except (OSError, sqlite3.Error):
            return False

    def put(self, key: str, payload: bytes | memoryview) -> bool:
        """Stores a block; returns False (and serves on without the disk) if the disk refuses it."""
        if time.monotonic() < self._writes_disabled_until:
            return False
        try:
            self._cache.set(key, BlockPayload(payload), retry=True)
            if self._cache.volume() > self.capacity_bytes:
                self.stats.add("disk_evictions", self._cache.cull(retry=True))
        except (OSError, sqlite3.Error) as exc:
            self.stats.add("disk_write_failures")
            self._writes_disabled_until = time.monotonic() + WRITE_RETRY_AFTER_S
            if not self._warned:
                self._warned = True
                log.warning(
                    "cannot write to the disk cache in %s (%s); serving reads straight from the backend. "
                    "Free space or point --cache-dir at a writable disk.",
                    self.directory,
                    exc,
                )
            return False
        return True

    def discard(self, key: str) -> None:
        try:
            self._cache.delete(key, retry=True)
        except (OSError, sqlite3.Error) as exc:
            log.warning("could not delete cached block %s: %s", key, exc)

    def used_bytes(self) -> int:
        return int(self._cache.volume())

    def __len__(self) -> int:
        return len(self._cache)

    def clear(self) -> int:
        return int(self._cache.clear(retry=True))

    def gc(self, verify: bool = False) -> dict[str, int]:
        """Evicts down to the byte bound; with verify, also reads every block and drops corrupt ones."""
        evicted = int(self._cache.cull(retry=True))
        self.stats.add("disk_evictions", evicted)
        corrupt = 0
        if verify:
            for key in list(self._cache.iterkeys()):
                stored = self._cache.get(key, default=None, retry=True)
                if stored is not None and not is_intact(stored):
                    corrupt += 1
                    self.discard(key)
        return {"evicted": evicted, "corrupt": corrupt}

    def close(self) -> None:
        try:
            self._cache.flush_touches()
        finally:
            self._cache.close()
