"""Read-ahead: which blocks to fetch before a reader asks for them.

Per open object, a reader that keeps reading where it stopped doubles its window (up to the byte budget); a
seek elsewhere drops it back to none. Reads near each other that skip much of what lies between them (a
parquet column projection: 1 MB reads 2 MB apart) are no stream: read-ahead starts only while the recent
reads cover at least DENSE_FRACTION of the stretch they span. All readers of a process share one budget of
bytes in flight.
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future

from pffs.cache import Block
from pffs.vfs.byte_ranges import covered_bytes

MIN_RUN = 256 << 10
# After a seek, reads are a stream again only past this many bytes read one after another (issue 34): FUSE
# sends one random read as several requests (up to 1 MiB each, and an unaligned 1 MiB read as 1 MiB and one
# page), and two random reads may land close together; either looked like a stream past MIN_RUN, and
# fetched whole blocks and read ahead for a read that wanted a fraction of them.
RESUME_RUN = 4 << 20
DENSE_FRACTION = 2 / 3
RECENT_READS = 8  # the reads whose coverage decides


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
        # Bytes read one after the other since the last seek. Read-ahead starts only past MIN_RUN (from
        # the start) or RESUME_RUN (after a seek): the kernel splits some random reads in several requests,
        # which would look sequential.
        self.run_bytes = 0
        self.run_start = 0  # where the run of reads following one another began
        self.recent: deque[tuple[int, int]] = deque(maxlen=RECENT_READS)  # [offset, end) of the last reads
        self.seeks = 0  # reads that were no part of a stream (see random)
        self.streaming = True  # the last read continued the ones before it densely (or started at 0)
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
        """The last read was no part of a stream: read only what it asks for, not whole blocks (a first
        read from the start, or one following the last ones closely, is part of a stream)."""
        return not self.streaming

    def on_read(self, offset: int, end: int, last_block: int) -> range:
        """Records a read of [offset, end) and returns the block indexes to prefetch now."""
        # The first read follows on only from the start: a handle's first read elsewhere (a parquet reader's
        # first column chunk, just past the file's magic bytes) says nothing of a stream yet.
        follows = abs(offset - self.next_offset) <= self.slack_bytes if self.recent else offset == 0
        if follows:
            self.recent.append((offset, end))
            self.run_bytes += end - offset
            self.next_offset = max(self.next_offset, end)
            # After a seek, a stream again only past RESUME_RUN: a random read may come in several requests.
            self.streaming = self._dense() and (self.run_bytes >= RESUME_RUN or self.run_start == 0)
        else:
            self.run_start = offset
            self.run_bytes = end - offset
            self.recent.clear()
            self.recent.append((offset, end))
            self.scheduled_up_to = last_block
            self.next_offset = end
            self.streaming = False
        if not self.streaming:
            self.window_blocks = 0
            self.seeks += 1
        elif self.run_bytes >= MIN_RUN and self.max_window_blocks:
            self.window_blocks = min(self.max_window_blocks, max(1, self.window_blocks * 2))
        first = max(last_block + 1, self.scheduled_up_to + 1)
        stop = last_block + 1 + self.window_blocks
        if first >= stop:
            return range(0)
        self.scheduled_up_to = stop - 1
        return range(first, stop)

    def _dense(self) -> bool:
        """Whether the recent reads cover at least DENSE_FRACTION of the stretch from the first byte of
        them to the last (reads that arrive out of order or overlap, as FUSE's do, still cover it all)."""
        span = max(end for _, end in self.recent) - min(start for start, _ in self.recent)
        return covered_bytes(self.recent) >= DENSE_FRACTION * span
