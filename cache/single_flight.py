"""Single-flight: however many threads ask for the same missing block at once, one of them fetches it.

The leader may `publish` its result before it has finished (the cache publishes a fetched block before
writing it to disk), so waiters need not wait for work that is not theirs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Generic, TypeVar

T = TypeVar("T")


class SingleFlight(Generic[T]):
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._in_flight: dict[str, Future[T]] = {}

    def reset_after_fork(self) -> None:
        # Fetches in flight belonged to threads that do not exist in the child.
        self._lock = threading.Lock()
        self._in_flight = {}

    def claim(self, key: str) -> tuple[Future[T], bool]:
        """The future of `key`'s fetch, and whether the caller leads it (then it must `settle` it)."""
        with self._lock:
            future = self._in_flight.get(key)
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
                future.set_exception(error)
            else:
                future.set_result(result)  # type: ignore[arg-type]

    def run(self, key: str, fn: Callable[[Callable[[T], None]], T]) -> T:
        """Runs fn(publish) once per key at a time; concurrent callers get the published or returned value."""
        with self._lock:
            future = self._in_flight.get(key)
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
            if not future.done():
                future.set_result(result)

        try:
            result = fn(publish)
        except BaseException as exc:
            forget()
            if not future.done():
                future.set_exception(exc)
            raise
        publish(result)
        return result
