"""Single-flight: however many threads ask for the same missing block at once, one of them fetches it."""

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

    def run(self, key: str, fn: Callable[[], T]) -> T:
        with self._lock:
            future = self._in_flight.get(key)
            leader = future is None
            if future is None:
                future = self._in_flight[key] = Future()
        if not leader:
            return future.result()
        try:
            result = fn()
        except BaseException as exc:
            future.set_exception(exc)
            raise
        else:
            future.set_result(result)
            return result
        finally:
            with self._lock:
                self._in_flight.pop(key, None)
