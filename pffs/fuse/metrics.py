"""Prometheus `/metrics` for a mount: read from the mount's own report at scrape time, so the hot path
counts nothing twice."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

CACHE_COUNTERS = {
    "memory_hits": "block reads served from the memory tier",
    "disk_hits": "block reads served from the disk tier",
    "misses": "blocks fetched from the backend for a reader waiting on them",
    "prefetches": "blocks fetched from the backend ahead of their reader",
    "prefetch_hits": "block reads served by a block fetched ahead for them",
    "bytes_from_memory": "bytes served from the memory tier",
    "bytes_from_disk": "bytes served from the disk tier",
    "bytes_fetched": "bytes fetched from the backend",
    "memory_evictions": "blocks evicted from the memory tier",
    "disk_evictions": "blocks evicted from the disk tier",
    "corrupt_blocks": "disk blocks dropped because their checksum failed",
    "disk_write_failures": "blocks that could not be written to the disk tier",
    "stale_metadata_served": "stats and listings served as last seen: the backend could not be reached",
}
# Per backend request kind: what the retries of calls that needed them met (request_stats.RETRY_COUNTERS).
RETRY_COUNTERS = {
    "retries": "attempts beyond the first, of calls retried within --backend-timeout",
    "throttled": "attempts answered with throttling (503 SlowDown, 429)",
    "timeouts": "attempts that got no answer, or an answer that stalled, within the per-attempt timeout",
    "resets": "attempts ended by a connection refused, reset or closed mid-answer",
    "server_errors": "attempts answered with a server error (5xx other than throttling)",
}


class MountCollector(Collector):
    def __init__(self, report: Callable[[], dict[str, Any]]) -> None:
        self._report = report

    def collect(self) -> Iterator[Any]:
        report = self._report()
        for name, text in CACHE_COUNTERS.items():
            yield CounterMetricFamily(f"pffs_cache_{name}", text, value=report["cache"].get(name, 0))
        usage = GaugeMetricFamily("pffs_cache_bytes", "bytes held per cache tier", labels=["tier"])
        usage.add_metric(["memory"], report["cache_usage"]["memory_bytes"])
        usage.add_metric(["disk"], report["cache_usage"]["disk_bytes"])
        yield usage
        requests = CounterMetricFamily("pffs_backend_requests", "backend requests", labels=["kind"])
        errors = CounterMetricFamily("pffs_backend_errors", "backend requests that failed", labels=["kind"])
        not_found = CounterMetricFamily(
            "pffs_backend_not_found",
            "backend requests answered: no such object (not errors)",
            labels=["kind"],
        )
        latency = GaugeMetricFamily(
            "pffs_backend_latency_seconds",
            "backend request latency over recent requests",
            labels=["kind", "quantile"],
        )
        retried = {
            name: CounterMetricFamily(f"pffs_backend_{name}", text, labels=["kind"])
            for name, text in RETRY_COUNTERS.items()
        }
        for kind, row in report["backend_requests"].items():
            for name, family in retried.items():
                family.add_metric([kind], row.get(name, 0))
            requests.add_metric([kind], row["requests"])
            errors.add_metric([kind], row["errors"])
            not_found.add_metric([kind], row.get("not_found", 0))
            for quantile, field in (("0.5", "p50_ms"), ("0.9", "p90_ms"), ("0.99", "p99_ms")):
                if field in row:  # (the native engine does not measure latencies yet)
                    latency.add_metric([kind, quantile], row[field] / 1e3)
        yield requests
        yield errors
        yield not_found
        yield latency
        yield from retried.values()
        yield GaugeMetricFamily(
            "pffs_uploads_pending", "files written and not uploaded yet", value=report["uploads_pending"]
        )
        yield CounterMetricFamily("pffs_uploads", "files uploaded", value=report["uploads_done"])
        yield CounterMetricFamily(
            "pffs_upload_failures", "uploads that failed", value=report["upload_failures"]
        )
        yield CounterMetricFamily(
            "pffs_killed_writes",
            "files not uploaded because their writer was killed by a signal (kept in staging/killed)",
            value=report.get("killed_writes", 0),
        )
        yield GaugeMetricFamily("pffs_open_files", "open file handles", value=report["open_files"])
        yield CounterMetricFamily(
            "pffs_files_prefetched",
            "small files fetched ahead by directory prefetch",
            value=report.get("files_prefetched", 0),
        )
        if "peers" in report:  # a cache group's traffic (pffs.peers.group.COUNTERS)
            peers = CounterMetricFamily(
                "pffs_peer",
                "blocks and bytes fetched from and served to cache-group members",
                labels=["what"],
            )
            for name, value in report["peers"].items():
                peers.add_metric([name], value)
            yield peers
            yield GaugeMetricFamily(
                "pffs_peer_members", "cache-group members this mount knows", value=report["peer_members"]
            )


def start_metrics_server(report: Callable[[], dict[str, Any]], address: str, port: int) -> None:
    from prometheus_client import start_http_server

    registry = CollectorRegistry()
    registry.register(MountCollector(report))
    start_http_server(port, addr=address, registry=registry)
