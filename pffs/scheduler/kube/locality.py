"""Cache locality: how much of a pod's datasets a node already holds, from what the nodes publish.

A node's pffs (its CSI node plugin) publishes what its disk cache holds on the Node object, as the
annotation `pffs.io/cache`: JSON `{"datasets": {DATASET: {"cached_bytes": N, "total_bytes": M}}}`, where
DATASET is the dataset's source URL (`s3://bucket/prefix`). A pod names the datasets it reads in its
annotation `pffs.io/datasets` (comma-separated URLs), and pffs CSI inline volumes name theirs in their
`source` volume attribute. Everything here reads plain Kubernetes JSON (dicts): no client library.

The CSI node plugin writes the report (``csi/cache_report.py``, with the names from here); `pffs scheduler`
(``nodes.py``, ``pods.py``) and `pffs extender` (``extender.py``) read it.

A report carries the time it was written (`updated_at`), and a running plugin writes it again at least
every REPORT_HEARTBEAT_S even when nothing changed. A report older than REPORT_MAX_AGE_S (three missed
heartbeats) is the last word of a plugin that is gone (uninstalled, or its node's pffs broken): it counts
as nothing cached, so no pod is drawn to a node whose cache nobody vouches for any more. A report without
`updated_at` (written by hand) is taken as it is.
"""

from __future__ import annotations

import datetime
import functools
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pffs.scheduler.kube.json_fields import BadObject, json_object

CACHE_ANNOTATION = "pffs.io/cache"
DATASETS_ANNOTATION = "pffs.io/datasets"
CSI_DRIVER = "csi.pffs.io"
REPORT_HEARTBEAT_S = 300.0  # a running plugin writes its report at least this often
REPORT_MAX_AGE_S = 3 * REPORT_HEARTBEAT_S  # older: the plugin is gone, the report is ignored


@dataclass(frozen=True)
class CachedDataset:
    cached_bytes: int
    total_bytes: int  # 0 where the node does not know the dataset's size

    @property
    def whole(self) -> bool:
        """Every byte of a dataset of known size is cached (what warm-before-bind and gated pods wait for)."""
        return self.total_bytes > 0 and self.cached_bytes >= self.total_bytes

    @property
    def fraction(self) -> float:
        if self.total_bytes > 0:
            return min(1.0, self.cached_bytes / self.total_bytes)
        return 1.0 if self.cached_bytes > 0 else 0.0


def normalize_dataset(url: str) -> str:
    """One spelling per dataset: no trailing slash, s3a:// as s3://."""
    url = url.strip().rstrip("/")
    return "s3://" + url[len("s3a://") :] if url.startswith("s3a://") else url


def pod_datasets(pod: Mapping[str, Any]) -> list[str]:
    """The datasets a pod reads (annotation and pffs CSI inline volumes), each once, in order."""
    metadata = json_object(pod.get("metadata"), "Pod.metadata")
    annotations = json_object(metadata.get("annotations"), "Pod.metadata.annotations")
    found: list[str] = []
    listed = annotations.get(DATASETS_ANNOTATION, "")
    if not isinstance(listed, str):
        raise BadObject(f"annotation {DATASETS_ANNOTATION} must be a string")
    found += [u for u in listed.split(",") if u.strip()]
    spec = json_object(pod.get("spec"), "Pod.spec")
    volumes = spec.get("volumes") or []
    if not isinstance(volumes, list):
        raise BadObject("Pod.spec.volumes must be a list")
    for volume in volumes:
        csi = json_object(json_object(volume, "a volume").get("csi"), "volume.csi")
        if csi.get("driver") == CSI_DRIVER:
            source = json_object(csi.get("volumeAttributes"), "volume.csi.volumeAttributes").get("source")
            if isinstance(source, str) and source:
                found.append(source)
    return list(dict.fromkeys(normalize_dataset(u) for u in found))


def node_cache(node: Mapping[str, Any], now: float | None = None) -> dict[str, CachedDataset] | None:
    """What a Node's pffs says it holds; None if the node publishes nothing (pffs does not run there).
    A malformed annotation, or a report older than REPORT_MAX_AGE_S at `now` (seconds since the epoch;
    default: the clock), counts as nothing cached (a node's bad report must not fail a pod)."""
    metadata = json_object(node.get("metadata"), "Node.metadata")
    annotations = json_object(metadata.get("annotations"), "Node.metadata.annotations")
    raw = annotations.get(CACHE_ANNOTATION)
    if raw is None:
        return None
    if not isinstance(raw, str):
        return {}
    datasets, written = parse_report(raw)
    if written is not None and (time.time() if now is None else now) - written > REPORT_MAX_AGE_S:
        return {}
    return dict(datasets)


@functools.lru_cache(maxsize=4096)
def parse_report(raw: str) -> tuple[Mapping[str, CachedDataset], float | None]:
    """A report's datasets and when it was written (seconds since the epoch; None if it does not say:
    a report written by hand). Malformed: nothing cached. Memoized: the extender asks for every candidate
    node's report on each request, and a report changes at most once per heartbeat."""
    try:
        report = json.loads(raw)
        if not isinstance(report, dict):
            return {}, None
        datasets = report.get("datasets", {})
        found = {
            normalize_dataset(url): CachedDataset(
                max(0, int(entry.get("cached_bytes", 0))), max(0, int(entry.get("total_bytes", 0)))
            )
            for url, entry in datasets.items()
            if isinstance(entry, dict)
        }
        stamp = report.get("updated_at")
        if stamp is None:
            return found, None
        written = datetime.datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC)
        return found, written.timestamp()
    # int(1e400) is an OverflowError, a deeply nested annotation a RecursionError in the decoder
    except (ValueError, TypeError, AttributeError, OverflowError, RecursionError):
        return {}, None


def locality(datasets: list[str], cache: Mapping[str, CachedDataset] | None) -> float:
    """The mean fraction of each dataset the node holds: 0 (nothing, or no pffs) to 1 (all of them)."""
    if not datasets or not cache:
        return 0.0
    return sum(cache[d].fraction if d in cache else 0.0 for d in datasets) / len(datasets)
