"""Write-behind for the disk tier: one thread writes fetched blocks to disk, many at a time, while readers go
on with the copy in memory.

Writing each block from the thread that fetched it made every fetch wait for the disk and made the fetching
threads queue for SQLite's write lock (busy-waits with sleeps, and a transaction per block: 13 page writes
and 10 lock calls per block in strace). One writer commits whatever has queued up in one transaction. The
queue is bounded in bytes: when the disk cannot keep up, submitters wait (the disk is then the bottleneck
anyway). A callback per block runs once it is on disk (or failed), which is how the cross-process fetch lock
stays held until another process can find the block there.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future

from .fork import after_fork_in_child, at_exit

log = logging.getLogger(__name__)

Block = bytes | memoryview
Then = Callable[[], None]
MAX_BATCH = 64
# After waking for a block, wait this long for others to write with it: one wake-up and one transaction
# for many blocks when small files arrive one by one (a block reaches the disk that much later).
LINGER_S = 0.005


class DiskWriter:
    def __init__(
        self, write_batch: Callable[[list[tuple[str, Block]]], bool], max_pending_bytes: int
    ) -> None:
        self._write_batch = write_batch  # writes the blocks; False if the disk refused them
        self.max_pending_bytes = max_pending_bytes
        self._reset()
        after_fork_in_child(self._reset)
        at_exit(self.drain)  # a short-lived process (a script, `pffs cat`) still leaves its blocks cached

    def _reset(self) -> None:
        # A forked child has no writer thread and must not write what its parent queued.
        self._queue: deque[tuple[str, Block, Future[bool], Then | None]] = deque()
        # Blocks queued or being written, readable meanwhile: a block fetched ahead is kept only here and
        # on disk, and a reader (or a cache-group member) asking for it before it is on disk must not
        # fetch it again (the second write would also race the first for its file).
        self._pending: dict[str, Block] = {}
        self._pending_bytes = 0
        self._busy = False
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()

    def submit(self, key: str, data: Block, then: Then | None = None) -> Future[bool]:
        """Queues a block; the future says whether it reached the disk. `then` runs after, either way."""
        done: Future[bool] = Future()
        with self._cond:
            self._pending[key] = data  # readable at once, while it waits for room in the queue too
            while self._pending_bytes > self.max_pending_bytes and self._queue:
                self._cond.wait()
            was_empty = not self._queue
            self._queue.append((key, data, done, then))
            self._pending_bytes += len(data)
            if self._thread is None or self._pid != os.getpid():
                self._pid = os.getpid()
                self._thread = threading.Thread(target=self._run, name="pffs-disk-writer", daemon=True)
                self._thread.start()
            if was_empty:  # the writer waits for work; while it lingers for more, let it linger
                self._cond.notify_all()
        return done

    def hold(self, key: str, data: Block) -> None:
        """Makes the block readable here before it is submitted (`submit` or `forget` must follow)."""
        with self._cond:
            self._pending[key] = data

    def forget(self, key: str, data: Block) -> None:
        """Drops a held block that will not be submitted."""
        with self._cond:
            if self._pending.get(key) is data:
                del self._pending[key]

    def pending(self, key: str) -> Block | None:
        """The block `key` if it is waiting to be written (or being written), else None."""
        with self._cond:
            return self._pending.get(key)

    def drain(self) -> None:
        """Returns once everything submitted so far is written (or failed)."""
        with self._cond:
            while self._queue or self._busy:
                self._cond.wait()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
                if len(self._queue) < MAX_BATCH and self._pending_bytes < self.max_pending_bytes:
                    self._cond.wait(LINGER_S)
                batch = [self._queue.popleft() for _ in range(min(MAX_BATCH, len(self._queue)))]
                self._busy = True
                # A submitter waits for the queue to empty, not for this batch's write: wake it now (it
                # waited for the whole write of a slow disk, and a block fetched meanwhile then skipped
                # the wait the queue's bound is for).
                self._cond.notify_all()
            written = False
            try:
                written = self._write_batch([(key, data) for key, data, _, _ in batch])
            except BaseException as exc:  # never let the writer die: the blocks are just not cached
                log.error("disk cache writer failed (a bug; blocks not cached): %s", exc, exc_info=exc)
            finally:
                for _, _, done, then in batch:
                    if then is not None:
                        then()
                    done.set_result(written)
                with self._cond:
                    self._pending_bytes -= sum(len(data) for _, data, _, _ in batch)
                    for key, data, _, _ in batch:
                        if self._pending.get(key) is data:
                            del self._pending[key]
                    self._busy = False
                    self._cond.notify_all()
