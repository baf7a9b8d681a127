"""Fork hooks that do not keep their objects alive: a forked child (a DataLoader worker) must not inherit
locks held by threads that no longer exist there, nor work queued for them."""

from __future__ import annotations

import atexit
import multiprocessing
import os
import threading
import weakref
from collections.abc import Callable


def _weak_call(method: Callable[[], object]) -> Callable[[], None]:
    ref = weakref.WeakMethod(method)

    def call() -> None:
        bound = ref()
        if bound is not None:
            bound()

    return call


def after_fork_in_child(method: Callable[[], object]) -> None:
    """Calls the bound `method` in every forked child, for as long as its object lives."""
    os.register_at_fork(after_in_child=_weak_call(method))


def hold_across_fork(
    acquire: Callable[[], object], release: Callable[[], object], in_child: Callable[[], object]
) -> None:
    """Bound methods: `acquire` before every fork(), `release` after it in the parent, `in_child` after
    it in the child (which must leave the lock usable there), for as long as their object lives."""
    os.register_at_fork(
        before=_weak_call(acquire), after_in_parent=_weak_call(release), after_in_child=_weak_call(in_child)
    )


_first_pid = os.getpid()  # the process that imported this module; a fork child has another pid


def in_worker_process() -> bool:
    """True in a forked child or a multiprocessing child (a DataLoader worker, fork or spawn): such a
    process may leave through os._exit or SIGTERM, where no exit hook runs."""
    return os.getpid() != _first_pid or multiprocessing.parent_process() is not None


def at_exit(method: Callable[[], object]) -> None:
    """Calls the bound `method` at interpreter exit if its object still lives."""
    atexit.register(_weak_call(method))


class _ForkGate:
    """Held around every SQLite transaction of the cache, and taken by fork() itself: a child must not be
    forked while a thread is inside a transaction. SQLite keeps the process's lock state in memory; a child
    that inherits it "holding" a write lock no thread of its own holds finds the database locked forever
    (seen: a DataLoader worker forked while the disk writer committed a batch)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        hold_across_fork(self._acquire, self._release, self._reset)

    def _acquire(self) -> None:
        self._lock.acquire()

    def _release(self) -> None:
        self._lock.release()

    def _reset(self) -> None:
        self._lock = threading.RLock()  # the child's only thread holds nothing

    def __enter__(self) -> None:
        self._lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


sqlite_fork_gate = _ForkGate()
