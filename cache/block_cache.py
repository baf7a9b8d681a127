"""The two-level block cache: memory (LRU, bytes-bounded) over disk (diskcache, bytes-bounded, shared).

A block is looked up memory → disk → `fetch()`. One fetch per key at a time: threads of this process wait on
single-flight, other processes wait on a striped file lock and then find the block on disk. The cache knows
nothing of objects or backends: callers build keys that change when the object changes (see DESIGN.md).
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from functools import partial
from pathlib import Path

from .aligned import aligned_copy
from .disk_tier import DiskTier
from .file_lock import BlockLocks, StripedFileLocks, block_locks
from .fork import after_fork_in_child, in_worker_process
from .memory_tier import MemoryTier
from .single_flight import SingleFlight
from .stats import CacheStats, read_totals, reset_totals

log = logging.getLogger(__name__)

LOCK_WAIT_S = 30.0  # the default --backend-timeout

Block = bytes | memoryview
STATS_FILE = "stats.sqlite"
MAX_LOOKED_AHEAD = 65536  # keys remembered as looked up ahead, to count their reader's read rightly
FETCHED_AHEAD, FOUND_AHEAD = "fetched", "found"


class BlockCache:
    def __init__(
        self,
        directory: str | Path | None,
        disk_capacity_bytes: int,
        memory_capacity_bytes: int,
        direct_io: bool = False,
        keep_stored_bound: bool = False,
        free_space_ratio: float = 0.0,
    ) -> None:
        """`direct_io`: write and read the disk tier around the page cache (for a FUSE mount, whose files
        the kernel caches already); else through it (the page cache then keeps the disk tier hot).
        `keep_stored_bound`: the disk tier keeps the bound it was last given (see DiskTier).
        `free_space_ratio`: the share of its file system the disk tier leaves free (see DiskTier)."""
        self.directory = Path(directory) if directory is not None else None
        self.direct_io = direct_io
        self.disk: DiskTier | None = None
        self.locks: BlockLocks | StripedFileLocks | None = None
        if self.directory is not None:
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
                self.stats = CacheStats(self.directory / STATS_FILE)
                self.disk = DiskTier(
                    self.directory,
                    disk_capacity_bytes,
                    self.stats,
                    direct_io,
                    keep_stored_bound,
                    free_space_ratio,
                )
                self.locks = block_locks(self.directory / "locks")
            except (OSError, sqlite3.Error) as exc:
                log.warning(
                    "disk cache %s is not usable (%s); caching in memory only. "
                    "Point --cache-dir at a writable directory to share a disk cache.",
                    self.directory,
                    exc,
                )
                self.disk = None
        if self.disk is None:
            self.stats = CacheStats(None)
        self.memory = MemoryTier(memory_capacity_bytes, self.stats)
        self._flight: SingleFlight[Block] = SingleFlight()
        # How long a reader waits for another process's fetch of the same block before fetching it too:
        # the backend deadline (set by whoever reads through this cache), which that fetch has as well. A
        # process stopped or hung while it holds the lock costs a second fetch, never a reader with no
        # deadline. None: not set, LOCK_WAIT_S.
        self.lock_wait_s: float | None = None
        # Keys looked up ahead of their reader and not read since, oldest first: FETCHED_AHEAD or FOUND_AHEAD
        self._looked_ahead: dict[str, str] = {}
        self._ahead_lock = threading.Lock()
        after_fork_in_child(self._reset_after_fork)

    def _reset_after_fork(self) -> None:
        self.memory.reset_after_fork()
        self.stats.reset_after_fork()
        self._flight.reset_after_fork()
        self._looked_ahead = {}  # the parent's fetches are the parent's
        self._ahead_lock = threading.Lock()

    def get(
        self,
        key: str,
        fetch: Callable[[], Block],
        *,
        keep_in_memory: bool = True,
        length: int | None = None,
        ahead: bool = False,
    ) -> Block:
        """The block `key`, from memory, disk or `fetch()`. `length`, if the caller knows it, lets the disk
        tier read the block file in one call (a block of another length is corrupt). `ahead`: asked for
        ahead of its reader (read-ahead, a directory's next files): finding it cached is its reader's hit
        (counted now, not again when the reader gets it), fetching it is a prefetch, not a miss, and the
        read that then finds it is a prefetch hit, not a hit. So the hit ratio says what was in the cache
        before this run wanted it: a cold epoch shows 0 however much was fetched ahead."""
        data = self._from_memory(key, ahead=ahead)
        if data is not None:
            return data
        data = self._flight.run(
            key, lambda publish: self._load(key, fetch, keep_in_memory, publish, length, False, ahead)
        )
        if not ahead and self._looked_ahead:  # a reader that waited on a fetch ahead of it (a follower)
            with self._ahead_lock:
                fetched_ahead = self._looked_ahead.pop(key, None) == FETCHED_AHEAD
            if fetched_ahead:
                self.stats.add("prefetch_hits")
        return data

    def get_range_if_cached(self, key: str, start: int, end: int) -> Block | None:
        """Bytes [start, end) of a cached block, from memory or from a part of its disk file (not loaded
        into memory: for random reads, where the rest of the block may never be wanted); None if the block
        is in neither tier."""
        data = self.memory.get(key)
        if data is not None:
            self.count_hit("memory", key, end - start)
            return memoryview(data)[start:end]
        if self.disk is None:
            return None
        part = self.disk.get(key, start, end)
        if part is not None:
            self.count_hit("disk", key, len(part))
        return part

    def get_consecutive(
        self,
        keys: Sequence[str],
        lengths: Sequence[int],
        fetch: Callable[[int, int], Block],
        found: Sequence[Block | None] | None = None,
    ) -> list[Block]:
        """Blocks that lie one after another in their source (the small pieces of a random read): each
        from `found` (what the caller already holds, None where it holds nothing), memory or disk; the
        missing ones fetched together, one `fetch(i, j)` (the bytes of keys[i:j], in order) per run of
        consecutive missing keys, and stored under their own keys. A hit or a miss is counted per key.
        Single-flight per key: a key another thread is fetching is waited for, not fetched again (runs
        are cut around it); a thread fetches what it leads before it waits for others, so none waits in
        a circle."""
        blocks: list[Block | None] = list(found) if found is not None else [None] * len(keys)
        for n, (key, length) in enumerate(zip(keys, lengths, strict=True)):
            if blocks[n] is None:
                blocks[n] = self._cached(key, length)
        led: dict[int, Future[Block]] = {}
        followed: dict[int, Future[Block]] = {}
        for n, key in enumerate(keys):
            if blocks[n] is not None:
                continue
            future, leader = self._flight.claim(key)
            if not leader:
                followed[n] = future
                continue
            data = self._cached(key, lengths[n])  # fetched by another thread since we looked
            if data is not None:
                self._flight.settle(key, future, data)
                blocks[n] = data
            else:
                led[n] = future
        try:
            i = 0
            while i < len(keys):
                if i not in led:
                    i += 1
                    continue
                j = i
                while j < len(keys) and j in led:
                    j += 1
                run = memoryview(fetch(i, j))
                offset = 0
                for k in range(i, j):
                    piece = run[offset : offset + lengths[k]]
                    if j - i > 1:
                        # Each its own (page-aligned) copy: a slice would keep the whole run alive after
                        # the memory tier evicted the rest of it, unaccounted.
                        piece = aligned_copy(piece)
                    blocks[k] = piece
                    offset += lengths[k]
                    future = led.pop(k)
                    self._keep_fetched(keys[k], piece, publish=partial(self._flight.settle, keys[k], future))
                i = j
        except BaseException as exc:
            for k, future in led.items():
                self._flight.settle(keys[k], future, error=exc)
            raise
        for n, future in followed.items():
            blocks[n] = future.result()  # fetched by another thread: neither a hit nor a miss here
        return [data for data in blocks if data is not None]

    def _cached(self, key: str, length: int) -> Block | None:
        """A block from memory or disk (then kept in memory too), or None."""
        data = self._from_memory(key)
        if data is None:
            data = self._from_disk(key, length)
            if data is not None:
                self.memory.put(key, data)
        return data

    def ensure_on_disk(self, key: str, fetch: Callable[[], Block]) -> bool:
        """For warm-up: stores the block on disk if it is not there yet. Returns True if it was fetched."""
        if self.disk is not None and self.disk.contains(key):
            return False
        misses_before = self.stats.snapshot()["misses"]
        self._flight.run(key, lambda publish: self._load(key, fetch, False, publish, None, True))
        return self.stats.snapshot()["misses"] > misses_before

    def _load(
        self,
        key: str,
        fetch: Callable[[], Block],
        keep_in_memory: bool,
        publish: Callable[[Block], None],
        length: int | None,
        wait_for_disk: bool,
        ahead: bool = False,
    ) -> Block:
        data = self._from_disk(key, length, ahead=ahead)
        if data is None:
            release = self._lock(key)
            try:
                # Another process may have fetched it while we waited for the lock.
                data = self._from_disk(key, length, ahead=ahead) if release is not None else None
                if data is None:
                    data = fetch()
                    self._keep_fetched(key, data, keep_in_memory, publish, release, wait_for_disk, ahead)
                    release = None  # the disk writer releases it
                    return data
            finally:
                if release is not None:
                    release()
        if keep_in_memory:
            self.memory.put(key, data)
        return data

    def _lock(self, key: str) -> Callable[[], None] | None:
        """The cross-process lock of `key` (None: none to take, or its holder took too long)."""
        if self.locks is None:
            return None
        wait_s = self.lock_wait_s or LOCK_WAIT_S
        release = self.locks.acquire(key, wait_s=wait_s)
        if release is None:
            log.warning(
                "block %s: another process has been fetching it for more than %g s (the backend deadline); "
                "fetching it here too",
                key,
                wait_s,
            )
        return release

    def _from_memory(self, key: str, ahead: bool = False) -> Block | None:
        data = self.memory.get(key)
        if data is not None:
            self.count_hit("memory", key, len(data), ahead)
        return data

    def _from_disk(self, key: str, length: int | None, ahead: bool = False) -> Block | None:
        if self.disk is None:
            return None
        data = self.disk.get(key, length=length)
        if data is not None:
            self.count_hit("disk", key, len(data), ahead)
        return data

    def count_hit(self, tier: str, key: str, size: int, ahead: bool = False) -> None:
        """A block found in `tier`. For a reader: a hit, a prefetch hit if this process fetched it ahead of
        the reader, or nothing if a look ahead found it cached (and counted the hit then). For a look
        ahead: the hit of the reader to come."""
        earlier = None
        if ahead:
            with self._ahead_lock:
                self._remember_ahead(key, FOUND_AHEAD)
        elif self._looked_ahead:  # (no lock on a reader's hit while nothing was looked up ahead)
            with self._ahead_lock:
                earlier = self._looked_ahead.pop(key, None)
        if earlier == FOUND_AHEAD:
            return
        self.stats.add("prefetch_hits" if earlier == FETCHED_AHEAD else f"{tier}_hits")
        self.stats.add(f"bytes_from_{tier}", size)

    def forget_ahead(self, key: str) -> None:
        """The reader took the block from the look ahead itself (a read-ahead future): nothing to count."""
        if self._looked_ahead:
            with self._ahead_lock:
                self._looked_ahead.pop(key, None)

    def _remember_ahead(self, key: str, how: str) -> None:
        self._looked_ahead.pop(key, None)  # to the end: the oldest are forgotten first
        self._looked_ahead[key] = how
        while len(self._looked_ahead) > MAX_LOOKED_AHEAD:  # never read: forgotten
            self._looked_ahead.pop(next(iter(self._looked_ahead)))

    def _keep_fetched(
        self,
        key: str,
        data: Block,
        keep_in_memory: bool = True,
        publish: Callable[[Block], None] | None = None,
        release_lock: Callable[[], None] | None = None,
        wait_for_disk: bool = False,
        ahead: bool = False,
    ) -> None:
        """A block just fetched: counted as a miss (a prefetch if fetched ahead of its reader), kept in
        memory, handed to the readers waiting on it, and written to disk (the cross-process lock, if held,
        released once it is there)."""
        if ahead:
            self.stats.add("prefetches")
            with self._ahead_lock:
                self._remember_ahead(key, FETCHED_AHEAD)
        else:
            self.stats.add("misses")
        self.stats.add("bytes_fetched", len(data))
        if keep_in_memory:
            self.memory.put(key, data)
        if self.disk is not None:
            # Readable from the writer's queue before the single flight ends: a block fetched ahead is in
            # neither tier, and one asked for in between (by a reader or a group member) was fetched again
            # while put_later waited for room in a full queue (bench/peers.py: 1-3% of the blocks).
            self.disk.hold(key, data)
        if publish is not None:
            publish(data)  # readers of this process go on while the block is written to disk
        if self.disk is None:
            if release_lock is not None:
                release_lock()
            return
        written = self.disk.put_later(key, data, then=release_lock)
        # On disk before the caller goes on: for warm-up, and in a worker process, which may end through
        # os._exit or SIGTERM at any time after (no exit hook would write what is still queued).
        if written is not None and (wait_for_disk or in_worker_process()):
            written.result()

    def wait_for_disk(self) -> None:
        """Returns once every block fetched so far is on disk (or failed to get there)."""
        if self.disk is not None:
            self.disk.writer.drain()

    def stored_keys(self, prefix: str) -> set[str]:
        """Keys on the disk tier that start with `prefix` (from its index: blocks written so far)."""
        return self.disk.stored_keys(prefix) if self.disk is not None else set()

    def discard(self, key: str) -> None:
        self.memory.discard(key)
        if self.disk is not None:
            self.disk.discard(key)

    def clear(self) -> int:
        self.memory.clear()
        removed = self.disk.clear() if self.disk is not None else 0
        if self.directory is not None:
            reset_totals(self.directory / STATS_FILE)
        return removed

    def usage(self) -> dict[str, int]:
        return {
            "memory_bytes": self.memory.used_bytes,
            "memory_blocks": len(self.memory),
            "memory_capacity_bytes": self.memory.capacity_bytes,
            "disk_bytes": self.disk.used_bytes() if self.disk is not None else 0,
            "disk_blocks": len(self.disk) if self.disk is not None else 0,
            "disk_capacity_bytes": self.disk.capacity_bytes if self.disk is not None else 0,
            "disk_bound_bytes": self.disk.bound_bytes() if self.disk is not None else 0,
        }

    def machine_totals(self) -> dict[str, int]:
        """Counters of every process that used this cache directory, this one included."""
        if self.directory is None:
            return self.stats.snapshot()
        return read_totals(self.directory / STATS_FILE)

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()
