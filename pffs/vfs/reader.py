"""Reads byte ranges of objects through the block cache, with read-ahead.

A read of [offset, offset+length) is split into blocks; each block comes from memory, disk or one ranged GET
(see pffs.cache). Blocks of one large read are fetched in parallel; blocks beyond it are prefetched when the
reader is sequential. Every key carries the object's identity, so bytes of two versions never mix.
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

from pffs.backends.backend import Backend, ObjectInfo
from pffs.cache import Block, BlockCache
from pffs.cache.fork import after_fork_in_child
from pffs.vfs.readahead import ReadAheadBudget, ReadAheadState

log = logging.getLogger(__name__)


class ObjectReader:
    def __init__(
        self,
        backend: Backend,
        cache: BlockCache,
        block_size: int,
        readahead_bytes: int,
        workers: int,
    ) -> None:
        self.backend = backend
        self.cache = cache
        self.block_size = block_size
        self.readahead_blocks = readahead_bytes // block_size
        self.budget = ReadAheadBudget(readahead_bytes)
        self.workers = workers
        self._pool: ThreadPoolExecutor | None = None
        self._pool_pid = 0
        self._pool_lock = threading.Lock()
        after_fork_in_child(self._reset_after_fork)

    def _reset_after_fork(self) -> None:
        # The parent's worker threads do not exist here; make new ones on first use.
        self._pool = None
        self._pool_lock = threading.Lock()
        self.budget.reset_after_fork()

    @property
    def pool(self) -> ThreadPoolExecutor:
        if self._pool is None or self._pool_pid != os.getpid():
            with self._pool_lock:
                if self._pool is None or self._pool_pid != os.getpid():
                    self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="pffs-fetch")
                    self._pool_pid = os.getpid()
        return self._pool

    def new_state(self) -> ReadAheadState:
        return ReadAheadState(self.readahead_blocks)

    def key(self, info: ObjectInfo, index: int) -> str:
        return f"{info.cache_id}-{self.block_size}-{index}"

    def block_count(self, info: ObjectInfo) -> int:
        return -(-info.size // self.block_size)

    def block_range(self, info: ObjectInfo, index: int) -> tuple[int, int]:
        start = index * self.block_size
        return start, min(start + self.block_size, info.size)

    def block(self, info: ObjectInfo, index: int) -> Block:
        start, end = self.block_range(info, index)
        return self.cache.get(self.key(info, index), lambda: self.backend.read_range(info, start, end))

    def read(self, info: ObjectInfo, offset: int, length: int, state: ReadAheadState | None = None) -> bytes:
        """Bytes [offset, offset+length) of the version `info` names, clipped at the end of the object."""
        end = min(info.size, offset + length) if length >= 0 else info.size
        if offset >= end:
            return b""
        first, last = offset // self.block_size, (end - 1) // self.block_size
        if state is not None:
            for index in state.on_read(offset, end, last):
                if index < self.block_count(info):
                    self._prefetch(info, index)
        # Blocks after the first are fetched in parallel while the first is read here.
        later: list[Future[Block]] = [
            self.pool.submit(self.block, info, i) for i in range(first + 1, last + 1)
        ]
        try:
            blocks = [self.block(info, first)] + [f.result() for f in later]
        finally:
            for f in later:
                f.cancel()
        head = offset - first * self.block_size
        if len(blocks) == 1:
            return bytes(blocks[0][head : head + end - offset])
        parts = [memoryview(b) for b in blocks]
        parts[0] = parts[0][head:]
        parts[-1] = parts[-1][: end - last * self.block_size]
        return b"".join(parts)

    def _prefetch(self, info: ObjectInfo, index: int) -> None:
        if self.cache.memory.get(self.key(info, index)) is not None:
            return
        start, end = self.block_range(info, index)
        size = end - start
        if not self.budget.try_reserve(size):
            return

        def fetch() -> None:
            try:
                self.block(info, index)
            except Exception as exc:  # the reader will fetch it itself and see the error
                log.debug("read-ahead of %s block %d failed: %s", info.path, index, exc)
            finally:
                self.budget.release(size)

        self.pool.submit(fetch)

    def warm_block(self, info: ObjectInfo, index: int) -> int:
        """Puts one block on disk (not in memory); returns the bytes fetched, 0 if it was cached already."""
        start, end = self.block_range(info, index)
        if start >= end:
            return 0
        fetched = self.cache.ensure_on_disk(
            self.key(info, index), lambda: self.backend.read_range(info, start, end)
        )
        return end - start if fetched else 0

    def warm(self, info: ObjectInfo) -> int:
        """Puts every block of the object on disk; returns the bytes fetched from the backend."""
        return sum(self.warm_block(info, i) for i in range(self.block_count(info)))

    def cached_fraction(self, info: ObjectInfo) -> float:
        count = self.block_count(info)
        if count == 0 or self.cache.disk is None:
            return 1.0 if count == 0 else 0.0
        disk = self.cache.disk
        return sum(disk.contains(self.key(info, i)) for i in range(count)) / count
