"""The CSI plugin's own Prometheus metrics (each mount process serves its own). A registry per plugin, so
tests can run several plugins in one process.

A mount's series (pffs_cache_*, pffs_backend_*, ..., re-exported by the mounter) carry the label `volume`:
the CSI volume id the mount was staged with, which for an inline volume is the kubelet's `csi-<sha256>`.
The node plugin says what each one is, in names a person knows, with two info series (value 1), as
kube-state-metrics does for pods and volumes:

    pffs_csi_volume_info{volume, persistentvolume, source, read_only}
        one per mount: the PV's name (empty for an inline volume's mount) and the source URL;
    pffs_csi_volume_pod_info{volume, persistentvolume, pod_namespace, pod_name, pod_volume}
        one per pod using it (an inline mount is shared by every pod naming the same source).

A query joins them on (node, volume), e.g. `... * on (node, volume) group_left (persistentvolume, source)
pffs_csi_volume_info`. The pod's labels are pod_namespace/pod_name, not namespace/pod, which a scrape sets
to the exporting pod's own.
"""

from __future__ import annotations

import http.server
import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from pffs.csi.state import Staged

log = logging.getLogger(__name__)

# What /healthz asks: None while healthy, else why not (the probe's body, and the log's line).
HealthCheck = Callable[[], "str | None"]


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
        self.volume_info = Gauge(
            "pffs_csi_volume_info",
            "1 per mount: what its `volume` label is (the PV's name, empty for inline volumes; the source)",
            ["volume", "persistentvolume", "source", "read_only"],
            registry=self.registry,
        )
        self.volume_pod_info = Gauge(
            "pffs_csi_volume_pod_info",
            "1 per pod using a mount: the pod and its volume's name (inline) or PV",
            ["volume", "persistentvolume", "pod_namespace", "pod_name", "pod_volume"],
            registry=self.registry,
        )
        self._shown: dict[Gauge, set[tuple[str, ...]]] = {
            self.volume_info: set(),
            self.volume_pod_info: set(),
        }
        self._shown_lock = threading.Lock()
        self._mounts: list[Staged] = []  # the records' own objects: a repair's new pid shows at once
        self.registry.register(MountMemory(self))

    def show_volumes(self, staged: Iterable[Staged]) -> None:
        """Sets the info series to what `staged` (the node's records) holds: new ones added, gone ones
        removed, the others untouched (a scrape never sees a volume vanish and come back)."""
        wanted: dict[Gauge, set[tuple[str, ...]]] = {self.volume_info: set(), self.volume_pod_info: set()}
        for mount in staged:
            names = {target_volume_name(path) for path in mount.targets}
            inline = mount.inline_key is not None
            pv = "" if inline else ",".join(sorted(names))
            source = mount.attributes.get("source", "")
            wanted[self.volume_info].add((mount.volume_id, pv, source, str(mount.read_only).lower()))
            for path, target in mount.targets.items():
                pod = target.pod
                wanted[self.volume_pod_info].add(
                    (
                        mount.volume_id,
                        pv,
                        pod.namespace if pod else "",
                        pod.name if pod else "",
                        target_volume_name(path) if inline else "",
                    )
                )
        with self._shown_lock:
            self._mounts = list(staged)
            for gauge, rows in wanted.items():
                for gone in self._shown[gauge] - rows:
                    gauge.remove(*gone)
                for row in rows:
                    gauge.labels(*row).set(1)
                self._shown[gauge] = rows

    def serve(self, address: str, port: int, health: HealthCheck) -> http.server.ThreadingHTTPServer:
        return serve_http(address, port, self.registry, health)


class MountMemory(Collector):
    """pffs_csi_mount_memory_bytes{volume}: the resident memory of each mount's process, read from /proc
    at each scrape (the node plugin shares the host's pid namespace with the mounter). Every mount of the
    node runs in the mounter's pod, under its one memory limit (mounter.resources): this is each one's
    share of it, mostly its memory cache (memoryCacheSize, 512M by default) once warm."""

    def __init__(self, metrics: PluginMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "pffs_csi_mount_memory_bytes",
            "resident memory of each mount process (all of them count against the mounter's limit)",
            labels=["volume"],
        )
        with self.metrics._shown_lock:
            mounts = [(m.volume_id, m.pid) for m in self.metrics._mounts]
        for volume, pid in mounts:
            rss = resident_bytes(pid) if pid else None
            if rss is not None:
                family.add_metric([volume], rss)
        yield family


def resident_bytes(pid: int) -> int | None:
    """VmRSS of a process; None if it is gone."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def target_volume_name(target_path: str) -> str:
    """The kubelet's target is .../pods/UID/volumes/kubernetes.io~csi/NAME/mount: NAME is the PV's name, or
    the pod's volume's for an inline volume."""
    parts = target_path.rstrip("/").split("/")
    return parts[-2] if len(parts) >= 2 and parts[-1] == "mount" else ""


class MounterMetrics:
    """`pffs csi-mounter`'s own metrics. Its /metrics also carries every mount's metrics (pffs_cache_*,
    pffs_backend_*, ...), each series labelled with the `volume` it serves."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.mounts = Gauge(
            "pffs_csi_mounter_mounts", "pffs mount processes this mounter runs", registry=self.registry
        )
        self.mount_exits = Counter(
            "pffs_csi_mounter_mount_exits",
            "mount processes that ended, by how (clean, failed, killed)",
            ["how"],
            registry=self.registry,
        )
        self.scrape_failures = Counter(
            "pffs_csi_mounter_scrape_failures",
            "a mount's /metrics that did not answer when /metrics was asked",
            registry=self.registry,
        )


def serve_http(
    address: str, port: int, registry: CollectorRegistry, health: HealthCheck
) -> http.server.ThreadingHTTPServer:
    """/metrics (Prometheus text) and /healthz (200 "ok", or 503 and the reason: the liveness probe's
    endpoint, so no livenessprobe sidecar is needed) on one port, from a daemon thread."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._answer(200, generate_latest(registry), CONTENT_TYPE_LATEST)
            elif path in ("/healthz", "/livez", "/readyz"):
                problem = health()
                if problem:
                    log.warning("health check failed: %s", problem)
                self._answer(503 if problem else 200, (problem or "ok").encode() + b"\n", "text/plain")
            else:
                self._answer(404, b"/metrics or /healthz\n", "text/plain")

        def _answer(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass  # a scrape every 15 s per pod is not news

    server = http.server.ThreadingHTTPServer((address, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name=f"http-{port}", daemon=True).start()
    return server
