"""A background thread that runs one round of work, waits, and runs it again until stopped."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


class Periodic:
    """Calls `work()` every `interval_s` (first after `first_delay_s`); `work` may return another delay
    for the next round (a backoff). An exception is logged and the rounds go on."""

    def __init__(
        self,
        name: str,
        work: Callable[[], float | None],
        interval_s: float,
        first_delay_s: float | None = None,
    ) -> None:
        self.name = name
        self.work = work
        self.interval_s = interval_s
        self.first_delay_s = interval_s if first_delay_s is None else first_delay_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._last_round = time.monotonic()  # when the last round started (or the thread was made)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout_s)

    def is_current(self, stale_s: float = 300.0) -> bool:
        """Whether the thread runs and a round started within `stale_s` plus one interval (a round that
        hangs, or a thread that died, is what a liveness probe should restart)."""
        since = time.monotonic() - self._last_round
        return self._thread.is_alive() and since < stale_s + max(self.interval_s, self.first_delay_s)

    def _run(self) -> None:
        delay = self.first_delay_s
        while not self._stop.wait(delay):
            self._last_round = time.monotonic()
            try:
                delay = self.work() or self.interval_s
            except Exception:
                log.exception("%s: round failed", self.name)
                delay = self.interval_s
