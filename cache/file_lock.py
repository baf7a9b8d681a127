"""Cross-process block locks: two processes missing the same block fetch it once.

Locks are striped over a fixed set of lock files (a block key hashes to one), so the lock directory never
grows. flock() locks belong to the open file, so each acquisition opens its own descriptor: nothing is shared
between threads or carried across fork. An unrelated block that hashes to the same stripe only waits a little.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import threading
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

from .fork import hold_across_fork

STRIPES = 1024


class StripedFileLocks:
    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        # Descriptors of the locks held now. A lock lives until every copy of its descriptor is closed, and
        # a forked child (a DataLoader worker) gets copies: it closes them at once, or the lock would stay
        # held for as long as the child lives (other processes would wait on it), however soon we release.
        # A descriptor is added before it is locked and closed before it is dropped, both under
        # _held_lock, which fork() takes too: a child never gets a descriptor that is not in _held.
        self._held: set[int] = set()
        self._held_lock = threading.Lock()
        hold_across_fork(self._before_fork, self._after_fork, self._close_inherited)

    def _before_fork(self) -> None:
        self._held_lock.acquire()

    def _after_fork(self) -> None:
        self._held_lock.release()

    def _close_inherited(self) -> None:
        for fd in self._held:
            with contextlib.suppress(OSError):
                os.close(fd)  # the child's copy only: the parent still holds the lock
        self._held = set()
        self._held_lock = threading.Lock()

    @contextlib.contextmanager
    def hold(self, key: str) -> Iterator[None]:
        release = self.acquire(key)
        try:
            yield
        finally:
            release()

    def acquire(self, key: str) -> Callable[[], None]:
        """Takes the key's lock; returns the function that releases it (from any thread, once)."""
        stripe = zlib.crc32(key.encode()) % STRIPES
        path = self.directory / f"{stripe:04d}.lock"
        with self._held_lock:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            self._held.add(fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # waits, outside _held_lock
        except BaseException:
            self._release(fd)
            raise
        return functools.partial(self._release, fd)

    def _release(self, fd: int) -> None:
        with self._held_lock:
            self._held.discard(fd)
            os.close(fd)  # closing the (last) descriptor releases the lock
