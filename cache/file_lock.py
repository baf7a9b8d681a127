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

from .fork import after_fork_in_child

STRIPES = 1024


class StripedFileLocks:
    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        # Descriptors of the locks held now. A lock lives until every copy of its descriptor is closed, and
        # a forked child (a DataLoader worker) gets copies: it closes them at once, or the lock would stay
        # held for as long as the child lives (other processes would wait on it), however soon we release.
        self._held: set[int] = set()
        self._held_lock = threading.Lock()
        after_fork_in_child(self._close_inherited)

    def _close_inherited(self) -> None:
        self._held_lock = threading.Lock()
        for fd in self._held:
            with contextlib.suppress(OSError):
                os.close(fd)  # the child's copy only: the parent still holds the lock
        self._held = set()

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
        fd = os.open(self.directory / f"{stripe:04d}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except BaseException:
            os.close(fd)
            raise
        with self._held_lock:
            self._held.add(fd)
        return functools.partial(self._release, fd)

    def _release(self, fd: int) -> None:
        with self._held_lock:
            self._held.discard(fd)
        os.close(fd)  # closing the descriptor releases the lock
