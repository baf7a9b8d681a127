"""A background thread that runs one round of work, waits, and runs it again until stopped."""

from __future__ import annotations

import logging
import threading
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

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout_s)

    def _run(self) -> None:
        delay = self.first_delay_s
        while not self._stop.wait(delay):
            try:
                delay = self.work() or self.interval_s
            except Exception:
                log.exception("%s: round failed", self.name)
                delay = self.interval_s
