"""The node's cache report: what its pffs cache holds of each dataset staged here, published on the Node
object as the annotation `pffs.io/cache`, in the JSON that `pffs extender` and `pffs scheduler` read
(pffs.scheduler.kube.locality.node_cache):

    {"datasets": {"s3://bucket/prefix": {"cached_bytes": N, "total_bytes": M}},
     "capacity_bytes": C, "used_bytes": U, "updated_at": "2026-11-25T10:00:00Z"}

A dataset's total is the size of what one listing of its source finds; its cached bytes are the bytes of
the blocks of those objects on the disk tier. The report is published at most once per interval, when it
changed or REPORT_HEARTBEAT_S after the last one (its `updated_at` is the plugin's heartbeat: readers ignore
a report older than REPORT_MAX_AGE_S, the last word of a plugin that is gone), with a patch of that one
annotation through the official `kubernetes` client (RBAC: get and patch on nodes). An API server that
does not answer is logged once and retried with backoff, on this thread only: it never holds a CSI call.
"""

from __future__ import annotations

import datetime
import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from pffs.backends.urls import open_backend
from pffs.csi.attributes import backend_options, parse_attributes, parse_credentials
from pffs.csi.metrics import PluginMetrics
from pffs.csi.periodic import Periodic
from pffs.csi.volumes import VolumeManager
from pffs.scheduler.kube.locality import CACHE_ANNOTATION, REPORT_HEARTBEAT_S, normalize_dataset
from pffs.vfs import Vfs

log = logging.getLogger(__name__)

MAX_BACKOFF_S = 300.0


def dataset_usage(manager: VolumeManager, staging_path: str) -> tuple[str, int, int]:
    """(dataset URL, cached bytes, total bytes) of one staged volume, from one listing of its source."""
    with manager.state.lock:
        staged = manager.state.records.staged[staging_path]
        context = dict(staged.attributes)
    attributes = parse_attributes(context, "recorded volume attributes")
    credentials = parse_credentials(manager.state.read_secrets(staging_path), "recorded secret")
    backend, root = open_backend(attributes.source, backend_options(attributes, credentials))
    vfs = Vfs(backend, manager.cache_settings_for(staging_path, attributes))
    objects = [info for info in vfs.walk_files(root)]
    total = sum(info.size for info in objects)
    cached = sum(vfs.reader.cached_bytes(info) for info in objects)
    return normalize_dataset(attributes.source), cached, total


def build_report(manager: VolumeManager) -> dict[str, Any]:
    datasets: dict[str, dict[str, int]] = {}
    with manager.state.lock:
        paths = list(manager.state.records.staged)
    for path in paths:
        try:
            url, cached, total = dataset_usage(manager, path)
        except Exception as exc:  # one unreachable source must not hide the others
            log.info("cache report: could not measure the volume at %s: %s", path, exc)
            continue
        entry = datasets.setdefault(url, {"cached_bytes": 0, "total_bytes": 0})
        entry["cached_bytes"] = max(entry["cached_bytes"], cached)
        entry["total_bytes"] = max(entry["total_bytes"], total)
    manager.refresh_warmed()
    with manager.state.lock:  # datasets warmed here by DatasetWarmups (measured again after evictions)
        warmed = dict(manager.state.records.warmed)
    for url, found in warmed.items():
        entry = datasets.setdefault(url, {"cached_bytes": 0, "total_bytes": 0})
        entry["cached_bytes"] = max(entry["cached_bytes"], found.cached_bytes)
        entry["total_bytes"] = max(entry["total_bytes"], found.total_bytes)
    node_cache = manager.config.cache
    return {
        "datasets": dict(sorted(datasets.items())),
        "capacity_bytes": node_cache.cache_size,
        "used_bytes": manager.disk_bytes_used(),
    }


def stamped(report: dict[str, Any]) -> str:
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return json.dumps({**report, "updated_at": now}, sort_keys=True)


class NodeAnnotation:
    """Writes one annotation of one Node through the official client."""

    def __init__(self, node_name: str, api: Any, key: str = CACHE_ANNOTATION) -> None:
        self.node_name = node_name
        self.api = api  # kubernetes.client.CoreV1Api
        self.key = key

    def write(self, value: str) -> None:
        body = {"metadata": {"annotations": {self.key: value}}}
        # A JSON merge patch touches only this key; the client would otherwise label a dict body
        # as a JSON patch (its first JSON content type), which the API server refuses.
        self.api.patch_node(
            self.node_name, body, _request_timeout=10, _content_type="application/merge-patch+json"
        )


class CacheReporter:
    """A thread: measure, and publish when the report changed, every `interval_s` (longer while the API
    server fails)."""

    def __init__(
        self,
        manager: VolumeManager,
        publish: Callable[[str], None],
        metrics: PluginMetrics,
        interval_s: float,
        where: str,
        heartbeat_s: float = REPORT_HEARTBEAT_S,
    ) -> None:
        self.manager = manager
        self.publish = publish
        self.metrics = metrics
        self.interval_s = interval_s
        self.where = where
        self.heartbeat_s = heartbeat_s
        self._last: str | None = None
        self._last_at = 0.0  # time.monotonic() of the last publish
        self._failing = False
        self._backoff = interval_s
        self._rounds = Periodic("cache-report", self.report_once, interval_s, min(5.0, interval_s))
        self._lock = threading.Lock()  # rounds, and a warm-up that just ended, report one at a time

    def start(self) -> None:
        self._rounds.start()

    def stop(self) -> None:
        self._rounds.stop(timeout_s=5)

    def report_once(self) -> float:
        """Measures and publishes if changed; returns the seconds until the next round."""
        with self._lock:
            return self._report()

    def _report(self) -> float:
        try:
            report = build_report(self.manager)
        except Exception:
            log.exception("cache report: could not be made")
            return self.interval_s
        unchanged = json.dumps(report, sort_keys=True)
        if unchanged == self._last and time.monotonic() - self._last_at < self.heartbeat_s:
            return self.interval_s
        try:
            self.publish(stamped(report))
        except Exception as exc:
            self.metrics.report_failures.inc()
            if not self._failing:
                log.warning(
                    "cache report: could not write it to %s (%s); retrying with backoff, CSI calls go on",
                    self.where,
                    _short(exc),
                )
            self._failing = True
            self._backoff = min(MAX_BACKOFF_S, 2 * self._backoff)
            return self._backoff
        if self._failing:
            log.info("cache report: %s takes reports again", self.where)
        self._failing = False
        self._backoff = self.interval_s
        self._last, self._last_at = unchanged, time.monotonic()
        self.metrics.report_publishes.inc()
        return self.interval_s


def _short(exc: BaseException) -> str:
    """An API error in a few words: its status and reason, never its headers or body."""
    status = getattr(exc, "status", None)
    if status is not None:
        return f"HTTP {status} {getattr(exc, 'reason', '')}".strip()
    return f"{type(exc).__name__}: {exc}"[:200]
