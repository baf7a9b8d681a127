"""The backend deadline: every backend call made for a reader (a block GET, a HEAD, a LIST) ends within
`--backend-timeout` seconds, retries included, with BackendTimeoutError (ETIMEDOUT) naming the URL.

A hung backend (a black-holed network, a frozen gateway: connections accepted, never answered) would
otherwise hold a reader for the client's read timeout times its retries: minutes. The retry loop
(retry.py) sets the deadline for the thread making the call; the clients below it take their socket
timeouts from what is left of it (``timeout_left``), and fsspec's async filesystems get it as ``sync``'s
own timeout, which cancels the request.

Within the deadline, each wait for the next bytes of an answer lasts at most ``attempt_timeout``: an answer
that stalls (headers sent, then part of the body, then nothing) is abandoned and the call tried again,
rather than holding its reader for the whole deadline. And callers of one call (SharedCalls: a lookup of
one name) share its deadline.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time
from collections.abc import Callable, Hashable, Iterator
from concurrent.futures import Future
from typing import Generic, TypeVar

T = TypeVar("T")

_current = threading.local()


class BackendTimeoutError(TimeoutError):
    """The backend did not answer within the deadline (TimeoutError with errno ETIMEDOUT)."""

    def __init__(self, url: str, seconds: float, last_error: str = "") -> None:
        self.url, self.seconds, self.last_error = url, seconds, last_error
        last = f" (last error: {last_error})" if last_error else ""
        super().__init__(
            errno.ETIMEDOUT,
            f"{url}: no answer from the backend within {seconds:g} s (--backend-timeout){last}; "
            "is it reachable? cached data is still served",
        )

    def __reduce__(self) -> tuple[type, tuple[str, float, str]]:
        # As an OSError it would be rebuilt from (errno, message): a worker process sends it this way.
        return (type(self), (self.url, self.seconds, self.last_error))


@contextlib.contextmanager
def deadline(seconds: float | None) -> Iterator[float | None]:
    """Calls inside end by now + ``seconds`` (or an earlier deadline already set); None: no deadline of
    its own. Yields the deadline as a time.monotonic() value."""
    previous: float | None = getattr(_current, "at", None)
    at = previous
    if seconds is not None:
        mine = time.monotonic() + seconds
        at = mine if previous is None else min(previous, mine)
    _current.at = at
    try:
        yield at
    finally:
        _current.at = previous


def time_left() -> float | None:
    """Seconds until this thread's deadline (negative once past), or None if there is none."""
    at: float | None = getattr(_current, "at", None)
    return None if at is None else at - time.monotonic()


def timeout_left(default: float) -> float:
    """A socket or request timeout for the next wait: ``default``, or less if the deadline is nearer (at
    least 1 ms, so a past deadline still times out at once rather than blocking)."""
    at: float | None = getattr(_current, "at", None)
    if at is None:
        return default
    return max(0.001, min(default, at - time.monotonic()))


# The per-attempt timeout. A healthy S3 server sends the first byte of an answer within a few hundred ms and
# its body without pauses; a busy one can pause for seconds (a Go server's garbage collection, a 2-core
# machine under a CI run). A wait for bytes longer than ATTEMPT_FLOOR_S is taken for a stall (a frozen
# server, a connection dropped without a reset): the attempt is abandoned and retried. A fifth of the
# deadline (6 s of the default 30 s) leaves room for at least four attempts against a server that stalls
# every one of them; under a short deadline the floor wins (a 6 s deadline: one wait of 5 s, then what is
# left). A slow but moving answer (bytes keep arriving) is never cut: it bounds each wait, not the transfer.
ATTEMPT_SHARE = 0.2
ATTEMPT_FLOOR_S = 5.0


def attempt_timeout(deadline_s: float) -> float:
    """The longest wait for the next bytes of an answer (a socket's connect and read timeout) under a call
    deadline of ``deadline_s``: a fifth of it, at least ATTEMPT_FLOOR_S, at most the deadline."""
    return min(deadline_s, max(ATTEMPT_FLOOR_S, deadline_s * ATTEMPT_SHARE))


# How long a call that failed because the backend could not be reached keeps failing the callers of its key
# who come right after it. The kernel sends concurrent lookups of one name one after the other (the later
# ones wait in the kernel for the first, and are sent when it fails): each would start a deadline of its
# own, n waiters taking n deadlines. They are sent within milliseconds of the failure; a second covers a
# busy machine, and a caller who retries later than that gets a call of its own.
FAILURE_SHARED_S = 1.0
_failures_shared_s = 0.0  # in force in this process: FAILURE_SHARED_S in a FUSE mount, else 0


def share_failures(seconds: float = FAILURE_SHARED_S) -> None:
    """Failures to reach the backend answer the callers of one key (SharedCalls) who come within `seconds`
    after: set by a FUSE mount, where the kernel sends waiting lookups again one by one. Elsewhere (the
    SDK) concurrent callers share the call in flight, and one who asks again after a failure (a retry of
    its own) gets a call of its own."""
    global _failures_shared_s
    _failures_shared_s = seconds


class SharedCalls(Generic[T]):
    """One call per key at a time (a lookup of one name): callers who come while it is in flight wait for
    its answer, within its deadline, instead of starting their own; a failure to reach the backend
    (TimeoutError, ConnectionError) is also the answer of those who come within FAILURE_SHARED_S after
    (in a FUSE mount: share_failures), unless the backend has answered another call since (`answered`)."""

    def __init__(self) -> None:
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._calls: dict[Hashable, Future[T]] = {}
        self._failed: dict[Hashable, tuple[float, BaseException]] = {}

    def run(self, key: Hashable, fn: Callable[[], T]) -> T:
        if self._pid != os.getpid():  # a forked child: the parent's calls are not in flight here
            self.__init__()  # type: ignore[misc]
        with self._lock:
            failed = self._failed.get(key)
            if failed is not None and time.monotonic() - failed[0] < _failures_shared_s:
                raise failed[1]
            future = self._calls.get(key)
            leader = future is None
            if future is None:
                future = self._calls[key] = Future()
        if not leader:
            return future.result()
        try:
            result = fn()
        except BaseException as exc:
            with self._lock:
                if self._calls.get(key) is future:
                    del self._calls[key]
                if _failures_shared_s > 0 and isinstance(exc, (TimeoutError, ConnectionError)):
                    now = time.monotonic()
                    self._failed = {k: v for k, v in self._failed.items() if now - v[0] < _failures_shared_s}
                    self._failed[key] = (now, exc)
            future.set_exception(exc)
            raise
        with self._lock:
            if self._calls.get(key) is future:
                del self._calls[key]
        future.set_result(result)
        return result

    def answered(self) -> None:
        """The backend answered a call: failures to reach it no longer stand for the callers after them."""
        if self._failed:
            with self._lock:
                self._failed = {}

    def forget(self, matches: Callable[[Hashable], bool]) -> None:
        """Callers of the keys that `matches` start calls of their own from now on (a write changed what
        the calls in flight would answer)."""
        with self._lock:
            for key in [k for k in self._calls if matches(k)]:
                del self._calls[key]
            for key in [k for k in self._failed if matches(k)]:
                del self._failed[key]
