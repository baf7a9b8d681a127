"""Warm before bind: a gang placed now, bound once its datasets are warm on the nodes it got.

A pod of ours with the annotation ``pffs.io/warm-before-bind: "300s"`` (a deadline: seconds, or with s, m
or h) makes its whole gang wait, once placed, until every node chosen for it reports each of the gang's
datasets whole in its cache report (``pffs.io/cache``, the same report the locality score reads): then the
pods are bound. When the deadline passes first, they are bound cold, with a Warning Event saying which
nodes were not warm. Meanwhile the placements are held (their room counts as taken, so nothing else is put
there) and one DatasetWarmup (pffs.io/v1alpha1) per dataset, made here, has the nodes' CSI plugins warm
exactly those nodes.

A warm-up's dataset comes from the gang's pffs CSI inline volumes (source, endpointUrl, region,
blockSize); a dataset named only in the annotation ``pffs.io/datasets`` is warmed from its URL alone.
Its credentials: the Secret the pod annotation ``pffs.io/warm-secret`` names, else the inline volume's
``nodePublishSecretRef``, read (as for every DatasetWarmup) in the CSI plugin's namespace.

Holds live in the scheduler's memory: a restarted scheduler places the gang again (its nodes, warm by
then or partly, score higher) and starts a new deadline.
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pffs.scheduler.core.objects import Placement
from pffs.scheduler.kube.json_fields import BadObject, json_object
from pffs.scheduler.kube.locality import CSI_DRIVER, node_cache, normalize_dataset

WARM_BEFORE_BIND_ANNOTATION = "pffs.io/warm-before-bind"
WARM_SECRET_ANNOTATION = "pffs.io/warm-secret"
POD_GROUP_LABEL_ON_WARMUP = "pffs.io/pod-group"
WARMUP_API = "/apis/pffs.io/v1alpha1/namespaces/{namespace}/datasetwarmups"
WARMUP_TTL_S = 3600  # a made warm-up is deleted this long after it ended (its nodes' reports stay)
DATASET_ATTRIBUTES = ("source", "endpointUrl", "region", "blockSize")
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*$")


def parse_deadline(text: str) -> float:
    """ "300", "300s", "5m", "1h" -> seconds; anything else one clear BadObject."""
    found = _DURATION.match(text) if isinstance(text, str) else None
    if not found or float(found.group(1)) <= 0:
        raise BadObject(
            f"annotation {WARM_BEFORE_BIND_ANNOTATION}: {text!r} is not a deadline (e.g. 300s, 5m, 1h)"
        )
    return float(found.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[found.group(2)]


def warm_deadline(pods: Sequence[Mapping[str, Any]]) -> float | None:
    """The gang's deadline (the shortest its pods give), or None if none of them asks to warm first."""
    found = [
        parse_deadline(value)
        for pod in pods
        if (value := _annotations(pod).get(WARM_BEFORE_BIND_ANNOTATION)) is not None
    ]
    return min(found) if found else None


def cold_nodes(datasets: Sequence[str], nodes: Mapping[str, Mapping[str, Any] | None]) -> list[str]:
    """The nodes whose cache report does not hold every one of `datasets` whole (a node not seen: cold)."""
    cold = []
    for name, obj in sorted(nodes.items()):
        cache = node_cache(obj) if obj is not None else None
        if cache is None or not all(d in cache and cache[d].whole for d in datasets):
            cold.append(name)
    return cold


def warmup_objects(
    group: str, pods: Sequence[Mapping[str, Any]], datasets: Sequence[str], nodes: Sequence[str]
) -> list[dict[str, Any]]:
    """One DatasetWarmup per dataset, on exactly `nodes` (namespace: the pods')."""
    attributes: dict[str, dict[str, str]] = {d: {"source": d} for d in datasets}
    secrets: dict[str, str] = {}
    named_secret = next(
        (s for p in pods if (s := _annotations(p).get(WARM_SECRET_ANNOTATION))), None
    )  # fmt: skip
    for pod in pods:
        for volume in json_object(pod.get("spec"), "Pod.spec").get("volumes") or []:
            csi = volume.get("csi") if isinstance(volume, Mapping) else None
            if not isinstance(csi, Mapping) or csi.get("driver") != CSI_DRIVER:
                continue
            given = csi.get("volumeAttributes") or {}
            url = normalize_dataset(str(given.get("source", "")))
            if url in attributes:
                attributes[url].update({k: str(given[k]) for k in DATASET_ATTRIBUTES if k in given})
                attributes[url]["source"] = url
                ref = (csi.get("nodePublishSecretRef") or {}).get("name")
                if ref:
                    secrets.setdefault(url, str(ref))
    short = _dns_name(group.split("/")[-1])
    made = []
    for dataset in datasets:
        spec: dict[str, Any] = {
            **attributes[dataset],
            "nodes": {"names": sorted(nodes)},
            "ttlSecondsAfterFinished": WARMUP_TTL_S,
        }
        secret = named_secret or secrets.get(dataset)
        if secret:
            spec["secretName"] = secret
        made.append(
            {
                "apiVersion": "pffs.io/v1alpha1",
                "kind": "DatasetWarmup",
                "metadata": {
                    "generateName": f"{short}-warm-",
                    "labels": {POD_GROUP_LABEL_ON_WARMUP: _label_value(group)},
                },
                "spec": spec,
            }
        )
    return made


@dataclass
class Hold:
    """A gang placed and waiting for its nodes to be warm."""

    group: str
    placements: list[Placement]
    datasets: tuple[str, ...]
    deadline_s: float
    started: float = field(default_factory=time.monotonic)

    @property
    def nodes(self) -> list[str]:
        return sorted({p.node for p in self.placements})

    def overdue(self) -> bool:
        return time.monotonic() - self.started >= self.deadline_s

    def why(self) -> str:
        return (
            f"warming {', '.join(self.datasets)} on {', '.join(self.nodes)} before binding "
            f"(binds cold after {self.deadline_s:g} s)"
        )


def _annotations(pod: Mapping[str, Any]) -> Mapping[str, Any]:
    metadata = pod.get("metadata")
    annotations = metadata.get("annotations") if isinstance(metadata, Mapping) else None
    return annotations if isinstance(annotations, Mapping) else {}


def _dns_name(text: str) -> str:
    """A DNS-1123 label prefix (room left for the generated suffix)."""
    name = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-") or "gang"
    return name[:40].rstrip("-")


def _label_value(group: str) -> str:
    """A label value naming the group: its own name if it is one, else a hash of it."""
    name = group.split("/")[-1]
    if re.fullmatch(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?", name):
        return name
    return hashlib.sha256(group.encode()).hexdigest()[:16]
