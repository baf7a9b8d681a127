"""Pod objects as the core's ``Pod``: what a pod requests (as kube-scheduler adds it up), its GPU count or
share, the GPU models it accepts, its node selector, its datasets; and the small facts the snapshot reads
(priority, finished or not)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from fractions import Fraction
from typing import Any

from pffs.scheduler.core.objects import MILLI, Pod
from pffs.scheduler.kube.json_fields import BadObject, json_list, json_object, object_key, str_map
from pffs.scheduler.kube.locality import pod_datasets
from pffs.scheduler.kube.names import (
    GPU_MILLI_ANNOTATION,
    GPU_MODELS_ANNOTATION,
    GPU_PRODUCT_LABEL,
    GPU_RESOURCE,
)
from pffs.scheduler.kube.quantity import MIB, amount

POD_LEVEL_RESOURCES = ("cpu", "memory")  # component-helpers IsSupportedPodLevelResource


def _requests(container: Any, what: str) -> dict[str, Fraction]:
    container = json_object(container, what)
    resources = json_object(container.get("resources"), f"{what}.resources")
    requests = dict(json_object(resources.get("requests"), f"{what}.resources.requests"))
    # The API server defaults a missing request to its limit; do the same for objects that skipped it.
    for key, value in json_object(resources.get("limits"), f"{what}.resources.limits").items():
        requests.setdefault(key, value)
    return {k: amount(v, f"{what} request {k}") for k, v in requests.items()}


def _add(total: dict[str, Fraction], more: Mapping[str, Fraction]) -> dict[str, Fraction]:
    out = dict(total)
    for key, value in more.items():
        out[key] = out.get(key, Fraction(0)) + value
    return out


def _maximum(a: Mapping[str, Fraction], b: Mapping[str, Fraction]) -> dict[str, Fraction]:
    return {k: max(a.get(k, Fraction(0)), b.get(k, Fraction(0))) for k in set(a) | set(b)}


def pod_requests(pod: Mapping[str, Any]) -> dict[str, Fraction]:
    """What a pod needs of each resource, computed as kube-scheduler does (component-helpers PodRequests):
    the sum over containers, sidecars (init containers with restartPolicy Always) added to it, against the
    largest plain init container (plus the sidecars started before it); pod-level spec.resources in place
    of that for cpu and memory where set; plus spec.overhead."""
    spec = json_object(pod.get("spec"), "spec")
    total: dict[str, Fraction] = {}
    for i, container in enumerate(json_list(spec.get("containers"), "spec.containers")):
        total = _add(total, _requests(container, f"spec.containers[{i}]"))
    sidecars: dict[str, Fraction] = {}
    init_peak: dict[str, Fraction] = {}
    for i, container in enumerate(json_list(spec.get("initContainers"), "spec.initContainers")):
        requests = _requests(container, f"spec.initContainers[{i}]")
        if json_object(container, "init container").get("restartPolicy") == "Always":
            total = _add(total, requests)
            sidecars = _add(sidecars, requests)
            requests = sidecars
        else:
            requests = _add(requests, sidecars)
        init_peak = _maximum(init_peak, requests)
    total = _maximum(total, init_peak)
    if spec.get("resources"):  # PodLevelResources (beta, on by default since 1.34): cpu and memory only
        pod_level = _requests(spec, "spec")
        total.update({k: v for k, v in pod_level.items() if k in POD_LEVEL_RESOURCES})
    overhead = {
        k: amount(v, f"spec.overhead {k}") for k, v in json_object(spec.get("overhead"), "overhead").items()
    }
    return _add(total, overhead)


def pod_from_json(obj: Mapping[str, Any], group: str = "") -> Pod:
    """A Pod object as the core's Pod, named 'namespace/name', in ``group`` (default: a group of its own)."""
    key = object_key(obj, "Pod")
    try:
        return _pod(obj, key, group or single_group(key))
    except BadObject as exc:
        raise BadObject(f"Pod {key}: {exc}") from None


def single_group(pod_key: str) -> str:
    return f"pod:{pod_key}"


def _pod(obj: Mapping[str, Any], key: str, group: str) -> Pod:
    metadata = json_object(obj.get("metadata"), "metadata")
    annotations = str_map(metadata.get("annotations"), "metadata.annotations")
    str_map(metadata.get("labels"), "metadata.labels")
    spec = json_object(obj.get("spec"), "spec")
    node_selector = str_map(spec.get("nodeSelector"), "spec.nodeSelector")
    requests = pod_requests(obj)
    cpu = math.ceil(requests.get("cpu", Fraction(0)) * MILLI)
    memory = math.ceil(requests.get("memory", Fraction(0)) / MIB)
    gpus = requests.get(GPU_RESOURCE, Fraction(0))
    if gpus < 0 or gpus.denominator != 1:
        raise BadObject(f"{GPU_RESOURCE} must be a whole number of GPUs, not {gpus}")
    count, milli = int(gpus), MILLI if gpus else 0
    share = annotations.get(GPU_MILLI_ANNOTATION)
    if share is not None:
        if not share.strip().isdigit() or not 0 < int(share) <= MILLI:
            raise BadObject(f"annotation {GPU_MILLI_ANNOTATION} must be 1-{MILLI} (milli-GPU), not {share!r}")
        if count:
            raise BadObject(
                f"annotation {GPU_MILLI_ANNOTATION} asks for a share of one GPU, but the pod also requests "
                f"{count} {GPU_RESOURCE}: drop the {GPU_RESOURCE} request for a shared GPU"
            )
        count, milli = 1, int(share)
    models = {m.strip() for m in annotations.get(GPU_MODELS_ANNOTATION, "").split(",") if m.strip()}
    selected = node_selector.get(GPU_PRODUCT_LABEL)
    if selected is not None:
        if models and selected not in models:
            raise BadObject(
                f"nodeSelector {GPU_PRODUCT_LABEL}={selected} is not among annotation "
                f"{GPU_MODELS_ANNOTATION} ({', '.join(sorted(models))}): no node can match both"
            )
        models = {selected}
    priority = spec.get("priority", 0)
    if priority is not None and (not isinstance(priority, int) or isinstance(priority, bool)):
        raise BadObject(f"spec.priority must be an integer, not {priority!r}")
    return Pod(
        name=key,
        group=group,
        cpu_milli=cpu,
        memory_mib=memory,
        gpu_count=count,
        gpu_milli=milli,
        gpu_models=frozenset(models),
        node_selector=node_selector,
        datasets=tuple(pod_datasets(obj)),
    )


def pod_priority(obj: Mapping[str, Any]) -> int:
    priority = json_object(obj.get("spec"), "spec").get("priority")
    return priority if isinstance(priority, int) and not isinstance(priority, bool) else 0


def is_terminal(obj: Mapping[str, Any]) -> bool:
    return json_object(obj.get("status"), "status").get("phase") in ("Succeeded", "Failed")
