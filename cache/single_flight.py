"""Single-flight: however many threads ask for the same missing block at once, one of them fetches it.

The leader may `publish` its result before it has finished (the cache publishes a fetched block before
writing it to disk), so waiters need not wait for work that is not theirs.

Waiters share the leader's deadline: they wait for its fetch, which ends within its deadline. A fetch that
failed because the backend could not be reached (TimeoutError, ConnectionError) stays the answer for a
moment after (FAILURE_SHARED_S), unless a fetch has succeeded since, for callers on other threads (in a
FUSE mount, on every thread: share_failures): waiters that were held elsewhere (the kernel re-sends a
page's read when the read that covered it failed; the SDK's readers wait for room in the read budget)
must not each start a deadline of their own, one after another.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Generic, TypeVar

T = TypeVar("T")
FAILURE_SHARED_S = 1.0  # waiters released by a failure ask again within milliseconds
_failures_shared_s = FAILURE_SHARED_S
_with_every_thread = False  # a FUSE mount's (share_failures)


def share_failures(seconds: float) -> None:
    """A failed fetch answers every caller of its key who comes within `seconds` after, the thread that
    met it too: set by a FUSE mount, whose reads run on any of its threads (the kernel's re-sent read
    may come to the thread that led the failed fetch). Elsewhere (the SDK) the thread that met a failure
    gets a fetch of its own when it asks again (its caller's retry), and other threads share it: readers
    of one object wait for room in the read budget one after the other, then ask for the same block."""
    global _failures_shared_s, _with_every_thread
    _failures_shared_s = seconds
    _with_every_thread = True


class SingleFlight(Generic[T]):
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._in_flight: dict[str, Future[T]] = {}
        # key -> (when, its failed fetch, the threads that met the failure)
        self._failed: dict[str, tuple[float, Future[T], set[int]]] = {}

    def reset_after_fork(self) -> None:
        # Fetches in flight belonged to threads that do not exist in the child.
        self._lock = threading.Lock()
        self._in_flight = {}
        self._failed = {}

    def _recent_failure(self, key: str) -> Future[T] | None:
        """The fetch of `key` that failed to reach the backend within FAILURE_SHARED_S (under _lock)."""
        if not self._failed:
            return None
        failed = self._failed.get(key)
        if failed is None or time.monotonic() - failed[0] >= _failures_shared_s:
            return None
        me = threading.get_ident()
        if me in failed[2] and not _with_every_thread:
            return None  # the thread that met it, asking again: a fetch of its own
        failed[2].add(me)
        return failed[1]

    def _answered(self) -> None:
        """A fetch succeeded: the backend answers, and failures to reach it no longer stand."""
        if self._failed:
            with self._lock:
                self._failed = {}

    def _remember(self, key: str, future: Future[T], error: BaseException) -> None:
        if _failures_shared_s > 0 and isinstance(error, (TimeoutError, ConnectionError)):
            with self._lock:
                now = time.monotonic()
                self._failed = {k: v for k, v in self._failed.items() if now - v[0] < _failures_shared_s}
                self._failed[key] = (now, future, {threading.get_ident()})

    def claim(self, key: str) -> tuple[Future[T], bool]:
        """The future of `key`'s fetch, and whether the caller leads it (then it must `settle` it)."""
        with self._lock:
            future = self._in_flight.get(key) or self._recent_failure(key)
            if future is not None:
                return future, False
            future = self._in_flight[key] = Future()
            return future, True

    def settle(
        self, key: str, future: Future[T], result: T | None = None, error: BaseException | None = None
    ) -> None:
        """Ends a fetch the caller leads (see claim): its waiters get `result`, or `error` if given."""
        with self._lock:
            if self._in_flight.get(key) is future:
                del self._in_flight[key]
        if not future.done():
            if error is not None:
                self._remember(key, future, error)
                future.set_exception(error)
            else:
                self._answered()
                future.set_result(result)  # type: ignore[arg-type]

    def run(self, key: str, fn: Callable[[Callable[[T], None]], T]) -> T:
        """Runs fn(publish) once per key at a time; concurrent callers get the published or returned value."""
        with self._lock:
            future = self._in_flight.get(key) or self._recent_failure(key)
            leader = future is None
            if future is None:
                future = self._in_flight[key] = Future()
        if not leader:
            return future.result()

        def forget() -> None:
            with self._lock:
                if self._in_flight.get(key) is future:
                    del self._in_flight[key]

        def publish(result: T) -> None:
            forget()
            self._answered()
            if not future.done():
                future.set_result(result)

        try:
            result = fn(publish)
        except BaseException as exc:
            forget()
            if not future.done():
                self._remember(key, future, exc)
                future.set_exception(exc)
            raise
        publish(result)
        return result
