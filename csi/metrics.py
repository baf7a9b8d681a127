"""The CSI plugin's own Prometheus metrics (each mount process serves its own). A registry per plugin, so
tests can run several plugins in one process."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server


class PluginMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.rpcs = Counter(
            "pffs_csi_rpc",
            "CSI calls answered, by method and gRPC code",
            ["method", "code"],
            registry=self.registry,
        )
        self.rpc_seconds = Histogram(
            "pffs_csi_rpc_duration_seconds",
            "time to answer a CSI call, by method",
            ["method"],
            buckets=(0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=self.registry,
        )
        self.volumes_staged = Gauge(
            "pffs_csi_volumes_staged",
            "pffs mounts this node plugin keeps (one per volume)",
            registry=self.registry,
        )
        self.targets_published = Gauge(
            "pffs_csi_targets_published", "pod target paths bound to those mounts", registry=self.registry
        )
        self.recoveries = Counter(
            "pffs_csi_recoveries",
            "dead mounts mounted again in place (with their targets re-bound)",
            registry=self.registry,
        )
        self.recovery_failures = Counter(
            "pffs_csi_recovery_failures",
            "attempts to mount a dead volume again that failed",
            registry=self.registry,
        )
        self.report_publishes = Counter(
            "pffs_csi_cache_report_publishes",
            "cache reports written to the Node annotation",
            registry=self.registry,
        )
        self.report_failures = Counter(
            "pffs_csi_cache_report_failures",
            "cache reports the API server did not take",
            registry=self.registry,
        )

    def serve(self, address: str, port: int) -> None:
        start_http_server(port, address, registry=self.registry)
