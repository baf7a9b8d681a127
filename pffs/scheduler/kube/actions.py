"""What `pffs scheduler` writes to the cluster, one call each: a Binding (with the GPUs it chose), an
Eviction, the condition PodScheduled=False on a pod that waits, a FailedScheduling Event for a pod it
cannot read, and other Events on pods. Each raises ``ApiError`` if the API server refuses; the loop decides
what a refusal means. (The DatasetWarmups of gangs that warm before binding are made in the loop.)"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from pffs.scheduler.core.objects import Placement
from pffs.scheduler.kube.api_client import RestCalls
from pffs.scheduler.kube.names import GPUS_ANNOTATION


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def bind(api: RestCalls, placement: Placement) -> None:
    """Bind the placed pod to its node; its GPU indexes go along as the annotation ``pffs.io/gpus``."""
    namespace, name = placement.pod.name.split("/", 1)
    binding: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Binding",
        "metadata": {"name": name, "namespace": namespace},
        "target": {"apiVersion": "v1", "kind": "Node", "name": placement.node},
    }
    if placement.gpus:
        # The API server copies a Binding's annotations onto the pod, in the same write as nodeName.
        binding["metadata"]["annotations"] = {GPUS_ANNOTATION: ",".join(map(str, placement.gpus))}
    api.request("POST", f"/api/v1/namespaces/{namespace}/pods/{name}/binding", binding)


def evict(api: RestCalls, placement: Placement) -> None:
    """Evict the pod through the Eviction API (so PodDisruptionBudgets apply: 429 while one forbids it)."""
    namespace, name = placement.pod.name.split("/", 1)
    eviction = {
        "apiVersion": "policy/v1",
        "kind": "Eviction",
        "metadata": {"name": name, "namespace": namespace},
    }
    api.request("POST", f"/api/v1/namespaces/{namespace}/pods/{name}/eviction", eviction)


def mark_unschedulable(api: RestCalls, pod_key: str, why: str) -> None:
    """Set PodScheduled=False (reason Unschedulable, ``why`` in the message) on the pod 'namespace/name'."""
    namespace, name = pod_key.split("/", 1)
    condition = {
        "type": "PodScheduled",
        "status": "False",
        "reason": "Unschedulable",
        "message": f"pffs-scheduler: {why}",
        "lastTransitionTime": _now(),
    }
    api.request(
        "PATCH",
        f"/api/v1/namespaces/{namespace}/pods/{name}/status",
        {"status": {"conditions": [condition]}},
        "application/strategic-merge-patch+json",
    )


def post_scheduling_failure(api: RestCalls, namespace: str, name: str, problem: str, component: str) -> None:
    """A Warning Event FailedScheduling on the pod, from ``component`` (the scheduler's name)."""
    message = f"pffs-scheduler cannot schedule this pod: {problem}"
    post_pod_event(api, namespace, name, "Warning", "FailedScheduling", message, component)


def post_pod_event(
    api: RestCalls, namespace: str, name: str, kind: str, reason: str, message: str, component: str
) -> None:
    """An Event (``kind`` Normal or Warning) on the pod, from ``component``."""
    now = _now()
    event = {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{name}.", "namespace": namespace},
        "involvedObject": {"apiVersion": "v1", "kind": "Pod", "name": name, "namespace": namespace},
        "reason": reason,
        "message": message,
        "type": kind,
        "source": {"component": component},
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }
    api.request("POST", f"/api/v1/namespaces/{namespace}/events", event)
