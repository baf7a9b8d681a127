"""Cross-process block locks: two processes missing the same block fetch it once.

BlockLocks: one lock file, and a lock per block on one byte of it (an open file description lock,
F_OFD_SETLKW, at an offset the key hashes to, out of 2^62): no file opened per block, and two blocks wait
for each other only if their 62-bit hashes meet. A lock is held from the fetch until the block is on disk
(the disk writer releases it), so it was the striped locks below that made a cold reader wait: with 1,024
stripes and tens of blocks waiting for the disk, a new block met a held stripe often enough to spend 18% of
8 readers' time in acquire (py-spy; mean 2.7 ms per block, p99 64 ms). StripedFileLocks stays as the
fallback for file systems without OFD locks.

StripedFileLocks: locks striped over a fixed set of lock files (a block key hashes to one), so the lock
directory never grows. flock() locks belong to the open file, so each acquisition opens its own descriptor:
nothing is shared between threads or carried across fork.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import hashlib
import os
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

from .fork import after_fork_in_child, hold_across_fork

STRIPES = 1024


# A wait for a lock another process holds polls: a blocking wait (F_OFD_SETLKW, flock) cannot be given a
# deadline from a thread. The first polls come quickly (a fetch of a small block ends in milliseconds); then
# every POLL_MAX_S, which a waiter pays at most once per block, against fetches of tens of milliseconds.
POLL_FIRST_S = 0.0005
POLL_MAX_S = 0.01


def _poll(try_once: Callable[[], bool], wait_s: float) -> bool:
    """Calls `try_once` until it returns True (then True) or `wait_s` has passed (then False)."""
    if try_once():
        return True
    end = time.monotonic() + wait_s
    pause = POLL_FIRST_S
    while time.monotonic() < end:
        time.sleep(max(0.0, min(pause, end - time.monotonic())))
        if try_once():
            return True
        pause = min(pause * 2, POLL_MAX_S)
    return False


class KeyLocks:
    """What both kinds of lock give: acquire(key) -> release(), and hold(key) around a block of code."""

    def acquire(self, key: str, wait_s: float | None = None) -> Callable[[], None] | None:
        """Takes the key's lock, waiting for another process that holds it at most `wait_s` (None: as
        long as it takes); returns the function that releases it (from any thread, once), or None if the
        wait ran out."""
        raise NotImplementedError

    @contextlib.contextmanager
    def hold(self, key: str) -> Iterator[None]:
        release = self.acquire(key)
        assert release is not None  # no wait_s: it waits as long as it takes
        try:
            yield
        finally:
            release()


class StripedFileLocks(KeyLocks):
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

    def acquire(self, key: str, wait_s: float | None = None) -> Callable[[], None] | None:
        stripe = zlib.crc32(key.encode()) % STRIPES
        path = self.directory / f"{stripe:04d}.lock"
        with self._held_lock:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            self._held.add(fd)
        try:
            if wait_s is None:
                fcntl.flock(fd, fcntl.LOCK_EX)  # waits, outside _held_lock
            elif not _poll(functools.partial(_try_flock, fd), wait_s):
                self._release(fd)
                return None
        except BaseException:
            self._release(fd)
            raise
        return functools.partial(self._release, fd)

    def _release(self, fd: int) -> None:
        with self._held_lock:
            self._held.discard(fd)
            os.close(fd)  # closing the (last) descriptor releases the lock


def _try_flock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


LOCK_FILE = "blocks.lock"  # in the locks folder, beside the striped locks' files
_FLOCK = struct.Struct("hh4xqqi4x")  # struct flock on 64-bit Linux: type, whence, start, len, pid


def block_locks(directory: str | Path) -> BlockLocks | StripedFileLocks:
    """BlockLocks where the file system has OFD locks, else StripedFileLocks."""
    try:
        return BlockLocks(directory)
    except (OSError, AttributeError):  # no F_OFD_* here, or the file system refuses them
        return StripedFileLocks(directory)


class BlockLocks(KeyLocks):
    def __init__(self, directory: str | Path) -> None:
        self.path = Path(directory) / LOCK_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = self._open()
        try:
            self._lock_byte(fcntl.F_OFD_SETLK, fcntl.F_WRLCK, 0)  # works here: then unlock it again
            self._lock_byte(fcntl.F_OFD_SETLK, fcntl.F_UNLCK, 0)
        except OSError:
            os.close(self._fd)
            raise
        after_fork_in_child(self._in_child)

    def _open(self) -> int:
        return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)

    def _in_child(self) -> None:
        # The inherited descriptor shares the parent's open file description, so the parent's locks would
        # count as the child's own. The child locks through a description of its own (closing its copy of
        # the parent's releases nothing: the parent still holds it).
        inherited, self._fd = self._fd, self._open()
        with contextlib.suppress(OSError):
            os.close(inherited)

    def _lock_byte(self, command: int, kind: int, offset: int, fd: int | None = None) -> None:
        fcntl.fcntl(self._fd if fd is None else fd, command, _FLOCK.pack(kind, os.SEEK_SET, offset, 1, 0))

    def acquire(self, key: str, wait_s: float | None = None) -> Callable[[], None] | None:
        offset = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big") >> 2
        fd = self._fd
        if wait_s is None:
            self._lock_byte(fcntl.F_OFD_SETLKW, fcntl.F_WRLCK, offset, fd)  # waits, without the GIL
        elif not _poll(functools.partial(self._try_lock, offset, fd), wait_s):
            return None
        return functools.partial(self._release, fd, offset)

    def _try_lock(self, offset: int, fd: int) -> bool:
        try:
            self._lock_byte(fcntl.F_OFD_SETLK, fcntl.F_WRLCK, offset, fd)
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EACCES):  # held by another open file description
                return False
            raise
        return True

    def _release(self, fd: int, offset: int) -> None:
        if fd != self._fd:  # taken before a fork, released in the child: the parent's to release
            return
        with contextlib.suppress(OSError):
            self._lock_byte(fcntl.F_OFD_SETLK, fcntl.F_UNLCK, offset, fd)
