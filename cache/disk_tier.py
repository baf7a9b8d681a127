"""The disk tier: checksummed blocks in a diskcache directory shared by every process on the machine.

diskcache gives process-safe, crash-safe storage (a value file is written before the SQLite row that names it
is committed) and least-recently-used eviction by bytes. We add the checksum (see block_format) and our own
culling so evictions can be counted. When the disk is full or unwritable, writes are switched off for a while
and reads carry on from the backend: the cache is an accelerator, never a reason for a read to fail.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import time
from concurrent.futures import Future
from pathlib import Path

from .block_disk import BlockDisk, BlockPayload, BlockStore, WrittenBlock
from .block_format import CorruptBlockError, is_intact
from .disk_writer import Block, DiskWriter, Then
from .stats import CacheStats

log = logging.getLogger(__name__)

# After a failed write, try writing again only after this many seconds (the disk may have been freed).
WRITE_RETRY_AFTER_S = 30.0
# Blocks waiting for the disk writer, at most (then fetching threads wait for the disk).
WRITE_BEHIND_BYTES = 64 << 20  # part of the mount's memory overhead (pffs.fuse.mount)


class DiskTier:
    def __init__(
        self,
        directory: str | Path,
        capacity_bytes: int,
        stats: CacheStats,
        direct_io: bool = False,
        keep_stored_bound: bool = False,
        free_space_ratio: float = 0.0,
    ) -> None:
        """`keep_stored_bound`: the bound is the cache's own, as last set (stored in its index), and
        `capacity_bytes` only that of a new cache. Else `capacity_bytes` is the bound from now on.
        `free_space_ratio`: the share of its file system the tier leaves free, evicting to keep it."""
        self.directory = Path(directory)
        self.stats = stats
        self._writes_disabled_until = 0.0
        self._warned = False
        self.off = False  # its directory was deleted under this process (turn_off)
        existing = (self.directory / "blocks" / "cache.db").exists()
        bound = {} if keep_stored_bound and existing else {"size_limit": capacity_bytes}
        self._cache = BlockStore(
            str(self.directory / "blocks"),
            disk=BlockDisk,
            eviction_policy="least-recently-used",
            cull_limit=0,  # we cull ourselves, after each write, to count evictions
            statistics=False,
            tag_index=False,
            **bound,
        )
        self.capacity_bytes = int(self._cache.size_limit)
        self._cache.direct_io = direct_io
        self._cache.free_space_ratio = free_space_ratio
        self.writer = DiskWriter(self._put_batch, WRITE_BEHIND_BYTES)

    def get(
        self, key: str, start: int = 0, end: int | None = None, length: int | None = None
    ) -> Block | None:
        """The block (of `length` bytes, if given), or bytes [start, end) of it; None if it is not here
        (or was corrupt: dropped). A block still waiting for the disk writer is served from its queue."""
        if self.off:
            return None
        waiting = self.writer.pending(key)
        if waiting is not None and (length is None or len(waiting) == length):
            return memoryview(waiting)[start:end] if start or end is not None else waiting
        try:
            return self._cache.get_block(key, start, end, length)
        except (OSError, sqlite3.Error) as exc:
            log.warning("disk cache read failed for block %s: %s; reading from the backend", key, exc)
            return None
        except CorruptBlockError as exc:
            self.stats.add("corrupt_blocks")
            log.warning("dropping corrupt cached block %s (%s); it will be fetched again", key, exc)
            self.discard(key)
            return None

    def contains(self, key: str) -> bool:
        return not self.off and self._cache.has_block(key)

    def turn_off(self) -> None:
        """Its directory was deleted under this process: its index names files that are gone, and what
        it wrote now would be in no index once the process ends. No more reads or writes of it."""
        self.off = True
        self._writes_disabled_until = float("inf")

    def stored_keys(self, prefix: str) -> set[str]:
        """Keys stored (not just being written) that start with `prefix`; empty if the index is unreadable."""
        if self.off:
            return set()
        try:
            return self._cache.stored_keys(prefix)
        except sqlite3.Error as exc:
            log.warning("could not list cached blocks: %s", exc)
            return set()

    def put(self, key: str, payload: bytes | memoryview) -> bool:
        """Stores a block now; returns False (and serves on without the disk) if the disk refuses it."""
        return self._put_batch([(key, payload)])

    def put_later(
        self, key: str, payload: bytes | memoryview, then: Then | None = None
    ) -> Future[bool] | None:
        """Stores a block from the writer thread, batched with others; `then` runs once it is written (or
        failed). None if disk writes are off for now (then `then` has run already)."""
        if time.monotonic() < self._writes_disabled_until:
            self.writer.forget(key, payload)  # if it was held
            if then is not None:
                then()
            return None
        return self.writer.submit(key, payload, then)

    def hold(self, key: str, payload: Block) -> None:
        """Makes a block about to be `put_later` readable from now on (see BlockCache._keep_fetched)."""
        self.writer.hold(key, payload)

    def _put_batch(self, blocks: list[tuple[str, bytes | memoryview]]) -> bool:
        return self._store([(key, BlockPayload(payload)) for key, payload in blocks])

    def adopt(self, blocks: list[tuple[str, str, int]]) -> bool:
        """Stores blocks whose files another writer (the native engine) made whole under a temporary name
        beside their place, as (key, temporary path, payload length): each is renamed into place with its
        row, or removed (stored already, no room, the disk refused). False if the disk refused them."""
        written: list[tuple[str, BlockPayload | WrittenBlock]] = [
            (key, WrittenBlock(temporary, length)) for key, temporary, length in blocks
        ]
        if self.off or not self._store(written):
            for _, temporary, _ in blocks:
                with contextlib.suppress(OSError):
                    os.unlink(temporary)
            return False
        return True

    def _store(self, blocks: list[tuple[str, BlockPayload | WrittenBlock]]) -> bool:
        if time.monotonic() < self._writes_disabled_until:
            return False
        try:
            evicted = self._cache.put_blocks(blocks)
            if evicted:
                self.stats.add("disk_evictions", evicted)
        except (OSError, sqlite3.Error) as exc:
            self.stats.add("disk_write_failures", len(blocks))
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
            self._cache.delete_block(key)
        except (OSError, sqlite3.Error) as exc:
            log.warning("could not delete cached block %s: %s", key, exc)

    def used_bytes(self) -> int:
        return int(self._cache.volume())

    def bound_bytes(self) -> int:
        """The bound in force: capacity_bytes, or less where the file system must keep its free share."""
        return self._cache.bound()

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
        self.stats.add("corrupt_blocks", corrupt)
        return {"evicted": evicted, "corrupt": corrupt}

    def close(self) -> None:
        self.writer.drain()
        try:
            self._cache.flush_touches()
        finally:
            self._cache.close()
