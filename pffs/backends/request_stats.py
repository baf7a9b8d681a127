"""Backend requests counted per kind, with their latencies, for `pffs stats` and Prometheus.

Each request ends one of three ways: answered (OK), answered "there is no such object" (NOT_FOUND: a
lookup of a name that is not there, which a listing of a dataset does all the time; not a failure), or
failed (ERROR, after its retries). A bounded ring of recent latencies per kind gives percentiles without
keeping every sample. Calls that needed retries count, per kind, their retries and what ended each failed
attempt: throttled (503 SlowDown, 429), timed out (no answer, or an answer that stalled, within the
per-attempt timeout), reset (a connection refused, reset or closed mid-answer), a server error (other 5xx).
`listeners` get every request too (the VFS counts them into the cache directory's
machine-wide totals).
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable

KINDS = ("get", "head", "list", "put", "delete", "copy")
RECENT = 4096  # latencies kept per kind for percentiles

OK, NOT_FOUND, ERROR = "ok", "not_found", "error"
RETRY_COUNTERS = ("retries", "throttled", "timeouts", "resets", "server_errors")
Listener = Callable[[str, float, str], None]  # (kind, seconds, outcome)


class RequestStats:
    def __init__(self) -> None:
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(KINDS, 0)
        self._errors = dict.fromkeys(KINDS, 0)
        self._not_found = dict.fromkeys(KINDS, 0)
        self._recent: dict[str, deque[float]] = {kind: deque(maxlen=RECENT) for kind in KINDS}
        self._retries = {kind: dict.fromkeys(RETRY_COUNTERS, 0) for kind in KINDS}
        self.listeners: list[Listener] = []

    def _after_fork(self) -> None:
        if self._pid != os.getpid():  # a forked child: the parent's requests (and lock) are the parent's
            listeners = self.listeners
            self.__init__()  # type: ignore[misc]
            self.listeners = listeners

    def record_retries(self, kind: str, retries: int, failures: dict[str, int]) -> None:
        """A call of `kind` that needed `retries` more attempts; `failures`: cause -> failed attempts."""
        self._after_fork()
        with self._lock:
            row = self._retries.get(kind)
            if row is None:
                return
            row["retries"] += retries
            for cause, count in failures.items():
                if cause in row:
                    row[cause] += count

    def record(self, kind: str, seconds: float, outcome: str) -> None:
        self._after_fork()
        with self._lock:
            self._counts[kind] += 1
            self._errors[kind] += outcome == ERROR
            self._not_found[kind] += outcome == NOT_FOUND
            self._recent[kind].append(seconds)
        for listener in self.listeners:
            listener(kind, seconds, outcome)

    def snapshot(self) -> dict[str, dict[str, float]]:
        """Per kind: requests, errors, not_found, p50/p90/p99 latency (ms) of the recent ones, and the
        RETRY_COUNTERS."""
        with self._lock:
            recent = {kind: sorted(samples) for kind, samples in self._recent.items()}
            counts, errors, missing = dict(self._counts), dict(self._errors), dict(self._not_found)
            retries = {kind: dict(row) for kind, row in self._retries.items()}
        out: dict[str, dict[str, float]] = {}
        for kind in KINDS:
            samples = recent[kind]
            row: dict[str, float] = {
                "requests": counts[kind],
                "errors": errors[kind],
                "not_found": missing[kind],
                **retries[kind],
            }
            for name, q in (("p50_ms", 0.50), ("p90_ms", 0.90), ("p99_ms", 0.99)):
                row[name] = (
                    round(samples[min(len(samples) - 1, int(q * len(samples)))] * 1e3, 3) if samples else 0.0
                )
            out[kind] = row
        return out
