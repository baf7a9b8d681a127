"""Read-ahead: which blocks to fetch before a reader asks for them.

Per open object, a reader that keeps reading where it stopped doubles its window (up to the byte budget); a
seek elsewhere drops it back to none. Reads near each other that skip much of what lies between them (a
parquet column projection: 1 MB reads 2 MB apart) are no stream: read-ahead starts only while the recent
reads cover at least DENSE_FRACTION of the stretch they span.

All readers of a process share one budget of read-ahead bytes (issue 43): a block fetched ahead counts from
the moment it is asked for until its reader has moved past it (or closed the file) and its fetch has ended,
not only while it is in flight; held, finished blocks were what grew the mount to 1.4 GiB with 16 readers.
A window the budget cannot give shrinks to what it can (the rest is asked for again at the next read), and
a reader holds at most its fair share of the budget while others hold some too. See docs/guides/memory.md.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Iterator
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


class ByteBudget:
    """A bound on bytes of buffers in use, shared by threads: `acquire` waits for room (reads that need
    blocks), `try_acquire` takes room only if there is some (read-ahead, which must never wait)."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self._in_use = 0
        self._holders = 0  # readers holding read-ahead (for try_acquire's fair share)
        # Reentrant: a state dropped by the garbage collector (an SDK file never closed) releases its
        # read-ahead from __del__, which may run in a thread inside acquire or release.
        self._cond = threading.Condition(threading.RLock())

    def reset_after_fork(self) -> None:
        self._cond = threading.Condition(threading.RLock())
        self._in_use = 0
        self._holders = 0

    @property
    def in_use(self) -> int:
        return self._in_use

    def try_acquire(self, nbytes: int, held: int = 0) -> bool:
        """Takes `nbytes` if the budget has them and the taker, holding `held` bytes already, stays within
        its fair share (the limit over the readers holding any, itself counted)."""
        with self._cond:
            if self._in_use + nbytes > self.limit_bytes:
                return False
            if held and held + nbytes > self.limit_bytes // max(1, self._holders):
                return False
            self._in_use += nbytes
            return True

    def acquire(self, nbytes: int) -> int:
        """Waits until `nbytes` (at most the whole budget) fit, takes them and returns what was taken."""
        nbytes = min(nbytes, self.limit_bytes)
        with self._cond:
            while self._in_use + nbytes > self.limit_bytes:
                self._cond.wait()
            self._in_use += nbytes
        return nbytes

    def release(self, nbytes: int) -> None:
        with self._cond:
            self._in_use = max(0, self._in_use - nbytes)  # (a forked child drops its parent's blocks)
            self._cond.notify_all()

    @contextlib.contextmanager
    def held(self, nbytes: int) -> Iterator[None]:
        """`nbytes` taken (waiting for them) for the body, given back after."""
        taken = self.acquire(nbytes)
        try:
            yield
        finally:
            self.release(taken)

    def holding(self, started: bool) -> None:
        """A reader started (or stopped) holding read-ahead."""
        with self._cond:
            self._holders += 1 if started else -1


ReadAheadBudget = ByteBudget


class ReadAheadState:
    """The sequential-access detector of one open object, and the blocks fetched ahead for it.

    Prefetched blocks are held here until read, not only in the memory tier, so read-ahead works however
    small the memory tier is (and never has to be fetched twice).
    """

    def __init__(
        self, max_window_blocks: int, slack_bytes: int = 0, budget: ByteBudget | None = None
    ) -> None:
        self.max_window_blocks = max(0, max_window_blocks)
        self.budget = budget  # what the blocks in `pending` are counted against (see hold)
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
        self.held: dict[int, int] = {}  # bytes of the budget each pending block holds
        self.held_bytes = 0
        self.lock = threading.Lock()  # a handle may be read from several threads (FUSE does)

    def hold(self, index: int, nbytes: int) -> bool:
        """Takes `nbytes` of the budget for block `index` about to be fetched ahead; False if the budget
        (or this reader's share of it) has no room: the window shrinks to what it got."""
        if self.budget is not None:
            if not self.budget.try_acquire(nbytes, self.held_bytes):
                return False
            if not self.held_bytes:
                self.budget.holding(True)
        self.held[index] = nbytes
        self.held_bytes += nbytes
        return True

    def _drop(self, index: int) -> None:
        """Drops a pending block: its budget comes back once its fetch has ended (at once if it had)."""
        future = self.pending.pop(index)
        future.cancel()
        nbytes = self.held.pop(index, 0)
        if not nbytes:
            return
        self.held_bytes -= nbytes
        budget = self.budget
        if budget is None:
            return
        if not self.held_bytes:
            budget.holding(False)
        future.add_done_callback(lambda _: budget.release(nbytes))

    def take(self, first: int, last: int) -> dict[int, Future[Block]]:
        """The prefetched blocks of [first, last]; drops those behind `first` (read, or skipped by a seek).
        A block stays here until the reader moves past it: the several requests that read one block find
        it here (prefetched blocks do not go into the memory tier, see ObjectReader._prefetch)."""
        for index in [i for i in self.pending if i < first]:
            self._drop(index)
        return {i: self.pending[i] for i in range(first, last + 1) if i in self.pending}

    def close(self) -> None:
        with self.lock:
            for index in list(self.pending):
                self._drop(index)

    def __del__(self) -> None:
        # A file dropped unclosed gives its read-ahead budget back (no lock: nothing else can hold it now).
        for index in list(self.pending):
            self._drop(index)

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
