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
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

STRIPES = 1024


class StripedFileLocks:
    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)

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
        return functools.partial(os.close, fd)  # closing the descriptor releases the lock
