"""The backend deadline: every backend call made for a reader (a block GET, a HEAD, a LIST) ends within
`--backend-timeout` seconds, retries included, with BackendTimeoutError (ETIMEDOUT) naming the URL.

A hung backend (a black-holed network, a frozen gateway: connections accepted, never answered) would
otherwise hold a reader for the client's read timeout times its retries: minutes. The retry loop
(retry.py) sets the deadline for the thread making the call; the clients below it take their socket
timeouts from what is left of it (``timeout_left``), and fsspec's async filesystems get it as ``sync``'s
own timeout, which cancels the request.
"""

from __future__ import annotations

import contextlib
import errno
import threading
import time
from collections.abc import Iterator

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


def timeout_left(default: float) -> float:
    """A socket or request timeout for the next wait: ``default``, or less if the deadline is nearer (at
    least 1 ms, so a past deadline still times out at once rather than blocking)."""
    at: float | None = getattr(_current, "at", None)
    if at is None:
        return default
    return max(0.001, min(default, at - time.monotonic()))
