"""Read-ahead: which blocks to fetch before a reader asks for them.

Per open object, a reader that keeps reading where it stopped doubles its window (up to the byte budget); a
seek elsewhere drops it back to none. All readers of a process share one budget of bytes in flight.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future

from pffs.cache import Block

MIN_RUN = 256 << 10


class ReadAheadBudget:
    """Bytes of read-ahead in flight in this process, bounded."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self._in_flight = 0
        self._lock = threading.Lock()

    def reset_after_fork(self) -> None:
        self._lock = threading.Lock()
        self._in_flight = 0

    def try_reserve(self, nbytes: int) -> bool:
        with self._lock:
            if self._in_flight + nbytes > self.limit_bytes:
                return False
            self._in_flight += nbytes
            return True

    def release(self, nbytes: int) -> None:
        with self._lock:
            self._in_flight -= nbytes


class ReadAheadState:
    """The sequential-access detector of one open object, and the blocks fetched ahead for it.

    Prefetched blocks are held here until read, not only in the memory tier, so read-ahead works however
    small the memory tier is (and never has to be fetched twice).
    """

    def __init__(self, max_window_blocks: int, slack_bytes: int = 0) -> None:
        self.max_window_blocks = max(0, max_window_blocks)
        # Reads within this distance of where the last one ended still count as sequential: the kernel
        # sends a FUSE file's read-ahead as several requests at once, which arrive in any order.
        self.slack_bytes = slack_bytes
        self.window_blocks = 0
        self.next_offset = 0
        # Bytes read one after the other since the last seek. Read-ahead starts only past MIN_RUN: the
        # kernel splits some random 128 KiB reads in two requests, which would look sequential.
        self.run_bytes = 0
        self.seeks = 0  # reads that did not follow the one before
        self.scheduled_up_to = -1  # highest block index already handed to the prefetcher
        self.pending: dict[int, Future[Block]] = {}
        self.lock = threading.Lock()  # a handle may be read from several threads (FUSE does)

    def take(self, first: int, last: int) -> dict[int, Future[Block]]:
        """The prefetched blocks of [first, last]; drops those behind `first` (read, or skipped by a seek).
        A block stays here until the reader moves past it: the several requests that read one block find
        it here (prefetched blocks do not go into the memory tier, see ObjectReader._prefetch)."""
        for index in [i for i in self.pending if i < first]:
            self.pending.pop(index).cancel()
        return {i: self.pending[i] for i in range(first, last + 1) if i in self.pending}

    def close(self) -> None:
        with self.lock:
            for future in self.pending.values():
                future.cancel()
            self.pending.clear()

    @property
    def random(self) -> bool:
        """The reader seeks: read only what it asks for, not whole blocks (a first read from the start,
        or one following the last, is not random)."""
        return self.window_blocks == 0 and self.seeks > 0

    def on_read(self, offset: int, end: int, last_block: int) -> range:
        """Records a read of [offset, end) and returns the block indexes to prefetch now."""
        if abs(offset - self.next_offset) <= self.slack_bytes and self.max_window_blocks:
            self.run_bytes += end - offset
            if self.run_bytes >= MIN_RUN:
                self.window_blocks = min(self.max_window_blocks, max(1, self.window_blocks * 2))
            self.next_offset = max(self.next_offset, end)
        else:
            self.window_blocks = 0
            self.seeks += 1
            self.run_bytes = end - offset
            self.scheduled_up_to = last_block
            self.next_offset = end
        first = max(last_block + 1, self.scheduled_up_to + 1)
        stop = last_block + 1 + self.window_blocks
        if first >= stop:
            return range(0)
        self.scheduled_up_to = stop - 1
        return range(first, stop)
