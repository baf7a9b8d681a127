"""Prometheus `/metrics` for `pffs scheduler`: what its cycles did, counted as they end (`SchedulerStats`)
and read at scrape time."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry


@dataclass
class SchedulerStats:
    """Totals since start, and the state after the last cycle; updated by the scheduling loop's thread."""

    cycles: int = 0
    failed_cycles: int = 0  # the API server unreachable or refusing, or a bug: the cycle did nothing
    cycle_seconds_total: float = 0.0
    last_cycle_seconds: float = 0.0
    pods_bound: int = 0
    pods_evicted: int = 0
    action_errors: int = 0  # a Binding or an Eviction the API server refused
    groups_pending: int = 0
    last_success: float = 0.0  # unix time of the last cycle that ran to its end
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def cycle_done(
        self, bound: int, evicted: int, errors: int, pending: int, seconds: float, now: float
    ) -> None:
        with self._lock:
            self.cycles += 1
            self.cycle_seconds_total += seconds
            self.last_cycle_seconds = seconds
            self.pods_bound += bound
            self.pods_evicted += evicted
            self.action_errors += errors
            self.groups_pending = pending
            self.last_success = now

    def cycle_failed(self, seconds: float) -> None:
        with self._lock:
            self.cycles += 1
            self.failed_cycles += 1
            self.cycle_seconds_total += seconds
            self.last_cycle_seconds = seconds

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return {k: v for k, v in vars(self).items() if not k.startswith("_")}


class SchedulerCollector(Collector):
    def __init__(self, stats: SchedulerStats) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Any]:
        s = self._stats.snapshot()
        yield CounterMetricFamily("pffs_scheduler_cycles", "scheduling cycles run", value=s["cycles"])
        yield CounterMetricFamily(
            "pffs_scheduler_failed_cycles",
            "cycles that could not list or decide (API server down or refusing); see the log",
            value=s["failed_cycles"],
        )
        yield CounterMetricFamily(
            "pffs_scheduler_cycle_seconds", "time spent in cycles", value=s["cycle_seconds_total"]
        )
        yield GaugeMetricFamily(
            "pffs_scheduler_last_cycle_seconds", "duration of the last cycle", value=s["last_cycle_seconds"]
        )
        yield CounterMetricFamily("pffs_scheduler_pods_bound", "pods bound to nodes", value=s["pods_bound"])
        yield CounterMetricFamily(
            "pffs_scheduler_pods_evicted", "pods evicted by gang preemption", value=s["pods_evicted"]
        )
        yield CounterMetricFamily(
            "pffs_scheduler_action_errors",
            "Bindings and Evictions the API server refused",
            value=s["action_errors"],
        )
        yield GaugeMetricFamily(
            "pffs_scheduler_groups_pending",
            "pod groups waiting after the last cycle",
            value=s["groups_pending"],
        )
        yield GaugeMetricFamily(
            "pffs_scheduler_last_success_timestamp_seconds",
            "unix time of the last cycle that ran to its end (alert when it falls behind)",
            value=s["last_success"],
        )


def start_metrics_server(stats: SchedulerStats, address: str, port: int) -> None:
    from prometheus_client import start_http_server

    registry = CollectorRegistry()
    registry.register(SchedulerCollector(stats))
    start_http_server(port, addr=address, registry=registry)
