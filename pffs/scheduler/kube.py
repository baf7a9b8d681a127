"""`pffs scheduler`: the Kubernetes edge of the scheduling core.

Each cycle lists Nodes, Pods and scheduler-plugins PodGroups, translates them into the core's objects
(``objects.py``), runs one session (``session.run_session``) and carries out what it decided: a Binding per
placed pod, an Eviction per evicted pod, a PodScheduled=False condition for pods that wait. Everything is
plain Kubernetes JSON over a small REST client (urllib): no client library, easy to test.

What is read from the cluster (the names the README documents):

Nodes
  * ``status.allocatable`` cpu, memory and ``nvidia.com/gpu``; nodes that are cordoned
    (``spec.unschedulable``) or not Ready are left out.
  * label ``nvidia.com/gpu.product``: the GPU model (as NVIDIA's GPU feature discovery sets it).
  * label ``pffs.io/tor``: the top-of-rack switch (a rack-level name; the zone label is too coarse for this).
  * annotation ``pffs.io/gpu-topology``: JSON
    ``{"nvlink_groups": [[0,1,2,3],[4,5,6,7]], "numa": [0,0,0,0,1,1,1,1]}`` (both keys
    optional); without it all GPUs count as one NVLink group and NUMA domain.
  * annotation ``pffs.io/cache``: what the node's pffs cache holds (``locality.py``).
Pods (only those with ``spec.schedulerName`` = ours are placed; every pod on a node uses room there)
  * requests summed over containers, against the largest init container (sidecars added), plus overhead.
  * ``nvidia.com/gpu``: whole GPUs; annotation ``pffs.io/gpu-milli: "250"``: a share of one GPU instead.
  * GPU model: nodeSelector ``nvidia.com/gpu.product`` and/or annotation ``pffs.io/gpu-models: "A100,H100"``.
  * datasets: annotation ``pffs.io/datasets`` and pffs CSI inline volumes (``locality.py``).
  * ``spec.priority``; label ``pffs.io/queue`` (default ``default``).
  * label ``scheduling.x-k8s.io/pod-group``: the pod's gang. Min member from the PodGroup
    (``scheduling.x-k8s.io/v1alpha1``, ``spec.minMember``) or, without one, the pod annotation
    ``pffs.io/min-member``. A PodGroup's own label ``pffs.io/queue`` overrides its pods'.
  * annotation ``pffs.io/gpus: "0,1"``: the GPU indexes pffs chose; written through the Binding (the API
    server copies a Binding's annotations onto the pod), read back for running pods.

A malformed object is one `BadObject` message: the pod is reported (log and Event) and skipped, the loop
goes on. NoSchedule/NoExecute taints are honoured (as synthetic node selectors, see
`_taints_as_selectors`); node affinity and pod (anti-)affinity are not modelled.
"""

from __future__ import annotations

import json
import logging
import math
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from fractions import Fraction
from typing import TYPE_CHECKING, Any

from pffs.scheduler.kube_api import ApiError, RestCalls
from pffs.scheduler.locality import BadObject, json_list, json_object, node_cache, pod_datasets
from pffs.scheduler.objects import MILLI, Gpu, Node, Placement, Pod, PodGroup, Queue
from pffs.scheduler.prometheus import SchedulerStats

if TYPE_CHECKING:
    from pffs.scheduler.session import SessionResult, Weights

log = logging.getLogger(__name__)

SCHEDULER_NAME = "pffs-scheduler"
GPU_RESOURCE = "nvidia.com/gpu"
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
TOR_LABEL = "pffs.io/tor"
TOPOLOGY_ANNOTATION = "pffs.io/gpu-topology"
GPU_MILLI_ANNOTATION = "pffs.io/gpu-milli"
GPU_MODELS_ANNOTATION = "pffs.io/gpu-models"
GPUS_ANNOTATION = "pffs.io/gpus"
QUEUE_LABEL = "pffs.io/queue"
MIN_MEMBER_ANNOTATION = "pffs.io/min-member"
POD_GROUP_LABEL = "scheduling.x-k8s.io/pod-group"
PODGROUP_API = "/apis/scheduling.x-k8s.io/v1alpha1/podgroups"
DEFAULT_QUEUE = "default"
MIB = 2**20
POD_LEVEL_RESOURCES = ("cpu", "memory")  # component-helpers IsSupportedPodLevelResource


# ---------------------------------------------------------------------------------------------- quantities

_QUANTITY = re.compile(
    r"([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))"  # the number
    r"(?:(Ki|Mi|Gi|Ti|Pi|Ei)|([numkMGTPE])|[eE]([+-]?[0-9]+))?"  # binary SI, decimal SI, or exponent
)
_BINARY = {"Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40, "Pi": 50, "Ei": 60}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}


def parse_quantity(text: str) -> Fraction:
    """A Kubernetes resource quantity ("4", "500m", "16Gi", "1e3", "1.5G") as an exact number.

    The grammar of k8s.io/apimachinery's resource.Quantity: a signed decimal, then one binary-SI suffix
    (Ki..Ei), one decimal-SI suffix (n u m "" k M G T P E; "E" is exa) or a decimal exponent (e3, E-2).
    """
    if not isinstance(text, str):
        raise BadObject(f"quantity {text!r} must be a string")
    match = _QUANTITY.fullmatch(text.strip())
    if match is None or not text.strip():
        raise BadObject(f"{text!r} is not a Kubernetes quantity (examples: 4, 500m, 16Gi, 1e3)")
    number, binary, decimal, exponent = match.groups()
    if len(number) > 40:  # Fraction(str) of thousands of digits raises ValueError (int digits limit)
        raise BadObject(f"{text[:50]!r}...: too many digits for a quantity")
    value = Fraction(number)
    if binary:
        return value * 2 ** _BINARY[binary]
    power = _DECIMAL[decimal] if decimal else int(exponent) if exponent else 0
    if abs(power) > 30:  # keeps the arithmetic small; far beyond anything a cluster holds
        raise BadObject(f"{text!r}: exponent out of range")
    return value * Fraction(10) ** power


def _amount(value: Any, what: str) -> Fraction:
    try:
        return parse_quantity(value)
    except BadObject as exc:
        raise BadObject(f"{what}: {exc}") from None


# ---------------------------------------------------------------------------------------------- helpers


def _str_map(value: Any, what: str) -> dict[str, str]:
    mapping = json_object(value, what)
    for k, v in mapping.items():
        if not isinstance(v, str):
            raise BadObject(f"{what}[{k!r}] must be a string, not {type(v).__name__}")
    return dict(mapping)


def object_key(obj: Mapping[str, Any], kind: str) -> str:
    """'namespace/name' (or 'name' for a cluster-scoped object), or BadObject."""
    metadata = json_object(obj.get("metadata"), f"{kind}.metadata")
    name = metadata.get("name")
    if not isinstance(name, str) or not name:
        raise BadObject(f"a {kind} has no metadata.name")
    namespace = metadata.get("namespace")
    if kind == "Node":
        return name
    if not isinstance(namespace, str) or not namespace:
        raise BadObject(f"{kind} {name} has no metadata.namespace")
    return f"{namespace}/{name}"


def _timestamp(value: Any) -> float:
    if not isinstance(value, str):
        return 0.0
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return 0.0


# ---------------------------------------------------------------------------------------------- nodes


def node_from_json(obj: Mapping[str, Any]) -> Node:
    """A Node object as the core's Node (``schedulable`` False if cordoned or not Ready)."""
    name = object_key(obj, "Node")
    what = f"Node {name}"
    metadata = json_object(obj.get("metadata"), f"{what}: metadata")
    labels = _str_map(metadata.get("labels"), f"{what}: metadata.labels")
    annotations = _str_map(metadata.get("annotations"), f"{what}: metadata.annotations")
    spec = json_object(obj.get("spec"), f"{what}: spec")
    status = json_object(obj.get("status"), f"{what}: status")
    allocatable = json_object(status.get("allocatable"), f"{what}: status.allocatable")
    for key in ("cpu", "memory"):
        if key not in allocatable:
            raise BadObject(f"{what}: status.allocatable has no {key}")
    cpu = math.floor(_amount(allocatable["cpu"], f"{what}: allocatable cpu") * MILLI)
    memory = math.floor(_amount(allocatable["memory"], f"{what}: allocatable memory") / MIB)
    gpus = _amount(allocatable.get(GPU_RESOURCE, "0"), f"{what}: allocatable {GPU_RESOURCE}")
    if gpus < 0 or gpus.denominator != 1:
        raise BadObject(f"{what}: allocatable {GPU_RESOURCE} must be a whole number, not {gpus}")
    ready = any(
        isinstance(c, Mapping) and c.get("type") == "Ready" and c.get("status") == "True"
        for c in json_list(status.get("conditions"), f"{what}: status.conditions")
    )
    cache = node_cache(obj)
    return Node(
        name=name,
        cpu_milli=max(0, cpu),
        memory_mib=max(0, memory),
        gpus=_gpu_topology(annotations.get(TOPOLOGY_ANNOTATION), int(gpus), what),
        gpu_model=labels.get(GPU_PRODUCT_LABEL, ""),
        tor=labels.get(TOR_LABEL, ""),
        labels=labels,
        cached={url: entry.fraction for url, entry in (cache or {}).items()},
        schedulable=ready and not spec.get("unschedulable", False),
    )


def _gpu_topology(raw: str | None, count: int, what: str) -> tuple[Gpu, ...]:
    if raw is None:
        return tuple(Gpu(i) for i in range(count))
    bad = f"{what}: annotation {TOPOLOGY_ANNOTATION}"
    try:
        topology = json.loads(raw)
    except ValueError:
        raise BadObject(f"{bad} is not JSON") from None
    if not isinstance(topology, dict) or set(topology) - {"nvlink_groups", "numa"}:
        raise BadObject(f'{bad} must be {{"nvlink_groups": [[0,1],[2,3]], "numa": [0,0,1,1]}}')
    group_of = [0] * count
    groups = topology.get("nvlink_groups", [list(range(count))])
    if not isinstance(groups, list) or not all(isinstance(g, list) for g in groups):
        raise BadObject(f"{bad}: nvlink_groups must be a list of lists of GPU indexes")
    seen: set[int] = set()
    for number, group in enumerate(groups):
        for index in group:
            if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < count:
                raise BadObject(f"{bad}: GPU index {index!r} is not one of the node's {count} GPUs")
            if index in seen:
                raise BadObject(f"{bad}: GPU {index} is in two NVLink groups")
            seen.add(index)
            group_of[index] = number
    numa = topology.get("numa", [0] * count)
    if (
        not isinstance(numa, list)
        or len(numa) != count
        or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in numa)
    ):
        raise BadObject(f"{bad}: numa must list one NUMA domain (an integer >= 0) per GPU ({count})")
    return tuple(Gpu(i, group_of[i], numa[i]) for i in range(count))


# ---------------------------------------------------------------------------------------------- pods


def _requests(container: Any, what: str) -> dict[str, Fraction]:
    container = json_object(container, what)
    resources = json_object(container.get("resources"), f"{what}.resources")
    requests = dict(json_object(resources.get("requests"), f"{what}.resources.requests"))
    # The API server defaults a missing request to its limit; do the same for objects that skipped it.
    for key, value in json_object(resources.get("limits"), f"{what}.resources.limits").items():
        requests.setdefault(key, value)
    return {k: _amount(v, f"{what} request {k}") for k, v in requests.items()}


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
        k: _amount(v, f"spec.overhead {k}") for k, v in json_object(spec.get("overhead"), "overhead").items()
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
    annotations = _str_map(metadata.get("annotations"), "metadata.annotations")
    _str_map(metadata.get("labels"), "metadata.labels")
    spec = json_object(obj.get("spec"), "spec")
    node_selector = _str_map(spec.get("nodeSelector"), "spec.nodeSelector")
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


def tolerates(pod: Mapping[str, Any], node: Mapping[str, Any]) -> bool:
    """Whether the pod tolerates every NoSchedule/NoExecute taint of the node (PreferNoSchedule is advice)."""
    tolerations = [
        t for t in json_list(json_object(pod.get("spec"), "spec").get("tolerations"), "tolerations") if t
    ]
    for taint in json_list(json_object(node.get("spec"), "spec").get("taints"), "taints"):
        if not isinstance(taint, Mapping) or taint.get("effect") not in ("NoSchedule", "NoExecute"):
            continue
        if not any(_tolerates(t, taint) for t in tolerations if isinstance(t, Mapping)):
            return False
    return True


def _tolerates(toleration: Mapping[str, Any], taint: Mapping[str, Any]) -> bool:
    if toleration.get("effect") and toleration["effect"] != taint.get("effect"):
        return False
    if toleration.get("key") and toleration["key"] != taint.get("key"):
        return False
    if toleration.get("operator", "Equal") == "Exists":
        return True
    return bool(toleration.get("key")) and toleration.get("value", "") == taint.get("value", "")


# ---------------------------------------------------------------------------------------------- snapshot


@dataclass
class Snapshot:
    """One cycle's view of the cluster in the core's terms, and what could not be translated."""

    nodes: list[Node]
    groups: list[PodGroup]
    running: list[Placement]
    pods: dict[str, Mapping[str, Any]]  # pod key -> its JSON, for the pods of the snapshot
    node_objects: dict[str, Mapping[str, Any]]
    ours: set[str]  # keys of running pods that this scheduler placed (the only ones it may evict)
    problems: dict[str, str] = field(default_factory=dict)  # object -> why it was left out
    waiting: dict[str, str] = field(default_factory=dict)  # group -> why it was not offered to the core
    members: dict[str, list[str]] = field(default_factory=dict)  # group -> keys of its pending pods


def build_snapshot(
    node_objs: Iterable[Any],
    pod_objs: Iterable[Any],
    podgroup_objs: Iterable[Any],
    queues: Sequence[Queue],
    scheduler_name: str = SCHEDULER_NAME,
) -> Snapshot:
    """Translate listed objects. A malformed object lands in ``problems`` and is left out; nothing raises."""
    snap = Snapshot([], [], [], {}, {}, set())
    for obj in node_objs:
        try:
            node = node_from_json(json_object(obj, "Node"))
        except BadObject as exc:
            snap.problems[f"Node {_name_of(obj)}"] = str(exc)
            continue
        snap.nodes.append(node)  # cordoned and NotReady ones too: the core places nothing there
        snap.node_objects[node.name] = obj
    podgroups = _podgroups(podgroup_objs, snap)
    queue_names = {q.name for q in queues}
    members: dict[str, list[tuple[Pod, Mapping[str, Any]]]] = {}  # group -> its running and pending pods
    for obj in pod_objs:
        try:
            key = object_key(json_object(obj, "Pod"), "Pod")
        except BadObject as exc:
            snap.problems[f"Pod {_name_of(obj)}"] = str(exc)
            continue
        try:
            if is_terminal(obj):
                continue
            spec = json_object(obj.get("spec"), f"Pod {key}: spec")
            metadata = json_object(obj.get("metadata"), f"Pod {key}: metadata")
            labels = _str_map(metadata.get("labels"), f"Pod {key}: metadata.labels")
            mine = spec.get("schedulerName") == scheduler_name
            group = _group_name(key, labels) if mine else single_group(key)
            node_name = spec.get("nodeName")
            if not mine and not node_name:
                continue  # another scheduler's business
            try:
                pod = pod_from_json(obj, group)
            except BadObject as exc:
                if not node_name:
                    raise
                # Already on a node: what it uses counts even if its pffs hints are wrong (annotations can
                # be edited on a running pod; other schedulers' pods may carry anything).
                log.debug("pod %s on %s: %s; counting its requests only", key, node_name, exc)
                pod = pod_from_json(_requests_only(obj), group)
            if node_name:
                # Every pod on a node uses room there; only ours are in groups (so only ours are evicted).
                snap.running.append(_placement(pod, str(node_name), metadata))
                snap.pods[key] = obj
                if mine:
                    snap.ours.add(key)
                    members.setdefault(group, []).append((pod, obj))
            elif not metadata.get("deletionTimestamp") and not spec.get("schedulingGates"):
                members.setdefault(group, []).append((pod, obj))
                snap.members.setdefault(group, []).append(key)
                snap.pods[key] = obj
        except BadObject as exc:
            snap.problems[f"Pod {key}"] = str(exc)
    snap.running = _assign_gpus(snap.running, {n.name: n for n in snap.nodes})
    _taints_as_selectors(snap, members)
    for group, pods in members.items():
        try:
            snap.groups.append(_group(group, pods, podgroups, queue_names))
        except BadObject as exc:
            if group in snap.members:  # a group with pods to place: say why they wait
                snap.waiting[group] = str(exc)
    snap.groups.sort(key=lambda g: (-g.priority, g.created, g.name))
    return snap


def _requests_only(obj: Mapping[str, Any]) -> dict[str, Any]:
    """A pod's JSON without what only placement reads (annotations, node selector): its requests stay."""
    metadata = {**json_object(obj.get("metadata"), "metadata"), "annotations": {}}
    spec = {**json_object(obj.get("spec"), "spec"), "nodeSelector": {}}
    return {**obj, "metadata": metadata, "spec": spec}


def _taints_as_selectors(snap: Snapshot, members: dict[str, list[tuple[Pod, Mapping[str, Any]]]]) -> None:
    """Taints in the core's terms: the core knows only node selectors, so each set of tolerations that does
    not tolerate every tainted node gets a label of its own (``tolerations.pffs.io/N: "true"``) on the nodes
    it may use, and the pods with those tolerations select it. Nothing changes in a cluster without
    NoSchedule/NoExecute taints."""
    nodes = {n.name: n for n in snap.nodes}
    tainted = [name for name, obj in snap.node_objects.items() if not tolerates({}, obj)]
    if not tainted:
        return
    labels: dict[str, str] = {}  # tolerations (canonical JSON) -> label key, or "" if all nodes are fine
    for group, pods in members.items():
        for i, (pod, obj) in enumerate(pods):
            if pod.name not in snap.members.get(group, []):
                continue  # running: already placed
            spec = json_object(obj.get("spec"), "spec")
            canonical = json.dumps(spec.get("tolerations") or [], sort_keys=True)
            if canonical not in labels:
                allowed = [n for n in tainted if tolerates(obj, snap.node_objects[n])]
                key = "" if len(allowed) == len(tainted) else f"tolerations.pffs.io/{len(labels)}"
                if key:
                    for name, node in nodes.items():
                        if name not in tainted or name in allowed:
                            node.labels = {**node.labels, key: "true"}
                labels[canonical] = key
            if labels[canonical]:
                selector = {**pod.node_selector, labels[canonical]: "true"}
                pods[i] = (replace(pod, node_selector=selector), obj)


def _name_of(obj: Any) -> str:
    metadata = obj.get("metadata") if isinstance(obj, Mapping) else None
    name = metadata.get("name") if isinstance(metadata, Mapping) else None
    return name if isinstance(name, str) else "(no name)"


def _group_name(pod_key: str, labels: Mapping[str, str]) -> str:
    label = labels.get(POD_GROUP_LABEL)
    if not label:
        return single_group(pod_key)
    return f"podgroup:{pod_key.split('/', 1)[0]}/{label}"


@dataclass(frozen=True)
class _PodGroupSpec:
    min_member: int
    queue: str | None
    created: float


def _podgroups(objs: Iterable[Any], snap: Snapshot) -> dict[str, _PodGroupSpec]:
    out = {}
    for obj in objs:
        try:
            key = object_key(json_object(obj, "PodGroup"), "PodGroup")
            spec = json_object(obj.get("spec"), f"PodGroup {key}: spec")
            metadata = json_object(obj.get("metadata"), f"PodGroup {key}: metadata")
            labels = _str_map(metadata.get("labels"), f"PodGroup {key}: metadata.labels")
            minimum = spec.get("minMember", 1) or 1  # omitempty: an absent 0 means one
            if not isinstance(minimum, int) or isinstance(minimum, bool) or minimum < 1:
                raise BadObject(f"PodGroup {key}: spec.minMember must be a positive integer, not {minimum!r}")
            out[f"podgroup:{key}"] = _PodGroupSpec(
                minimum, labels.get(QUEUE_LABEL), _timestamp(metadata.get("creationTimestamp"))
            )
        except BadObject as exc:
            snap.problems[f"PodGroup {_name_of(obj)}"] = str(exc)
    return out


def _group(
    name: str,
    members: list[tuple[Pod, Mapping[str, Any]]],
    podgroups: Mapping[str, _PodGroupSpec],
    queue_names: set[str],
) -> PodGroup:
    """A group with all its pods, running and pending (the core counts running ones toward min member)."""
    objs = [obj for _, obj in members]
    labels = [json_object(obj.get("metadata"), "metadata").get("labels") or {} for obj in objs]
    queues = {lab.get(QUEUE_LABEL, DEFAULT_QUEUE) for lab in labels}
    created = min(
        _timestamp(json_object(obj.get("metadata"), "metadata").get("creationTimestamp")) for obj in objs
    )
    if name.startswith("podgroup:"):
        spec = podgroups.get(name)
        if spec is not None:
            minimum, created = spec.min_member, spec.created or created
            if spec.queue:
                queues = {spec.queue}
        else:
            declared = set()
            for obj in objs:
                raw = (json_object(obj.get("metadata"), "metadata").get("annotations") or {}).get(
                    MIN_MEMBER_ANNOTATION
                )
                if raw is not None:
                    if not str(raw).isdigit() or int(raw) < 1:
                        raise BadObject(
                            f"annotation {MIN_MEMBER_ANNOTATION} must be a positive integer, not {raw!r}"
                        )
                    declared.add(int(raw))
            if not declared:
                pg = name.removeprefix("podgroup:")
                raise BadObject(
                    f"PodGroup {pg} does not exist and its pods carry no {MIN_MEMBER_ANNOTATION} annotation: "
                    "create the PodGroup (scheduling.x-k8s.io/v1alpha1) or annotate the pods"
                )
            minimum = max(declared)  # pods that disagree: the larger gang is the safe one
    else:
        minimum = 1
    if len(queues) > 1:
        raise BadObject(f"the group's pods name different queues ({', '.join(sorted(queues))})")
    queue = queues.pop()
    if queue not in queue_names:
        raise BadObject(f"queue {queue!r} is not in the queues config ({', '.join(sorted(queue_names))})")
    return PodGroup(
        name=name,
        queue=queue,
        pods=[pod for pod, _ in members],
        min_member=minimum,
        priority=max(pod_priority(obj) for obj in objs),
        created=created,
    )


def _placement(pod: Pod, node: str, metadata: Mapping[str, Any]) -> Placement:
    raw = (metadata.get("annotations") or {}).get(GPUS_ANNOTATION)
    gpus: tuple[int, ...] = ()
    if isinstance(raw, str) and raw.strip() and pod.gpu_count:
        try:
            gpus = tuple(int(i) for i in raw.split(","))
        except ValueError:
            log.warning("pod %s: ignoring annotation %s=%r (not GPU indexes)", pod.name, GPUS_ANNOTATION, raw)
    return Placement(pod, node, gpus)


def _assign_gpus(placements: list[Placement], nodes: Mapping[str, Node]) -> list[Placement]:
    """Give every running GPU pod GPU indexes: those of its annotation if valid, else the first free ones."""
    free = {name: [MILLI] * len(node.gpus) for name, node in nodes.items()}
    out: list[Placement] = []
    later: list[Placement] = []
    for p in placements:
        left = free.get(p.node, [])
        valid = (
            len(p.gpus) == p.pod.gpu_count
            and len(set(p.gpus)) == len(p.gpus)
            and all(0 <= i < len(left) and left[i] >= p.pod.gpu_milli for i in p.gpus)
        )
        if p.pod.gpu_count == 0 or not valid:
            later.append(p if p.pod.gpu_count else Placement(p.pod, p.node, ()))
            continue
        for i in p.gpus:
            left[i] -= p.pod.gpu_milli
        out.append(p)
    for p in later:
        if p.pod.gpu_count == 0 or p.node not in free:
            out.append(p)  # on a node left out of the snapshot: only its queue usage matters
            continue
        left = free[p.node]
        # The fullest GPU that fits (packs shares); else the least used ones (an overcommitted node).
        order = sorted(range(len(left)), key=lambda i: (left[i] < p.pod.gpu_milli, left[i], i))
        chosen = tuple(sorted(order[: p.pod.gpu_count]))
        for i in chosen:
            left[i] -= p.pod.gpu_milli
        out.append(Placement(p.pod, p.node, chosen))
    return out


# ---------------------------------------------------------------------------------------------- the loop

RunSession = Callable[..., "SessionResult"]


@dataclass
class CycleReport:
    bound: list[tuple[str, str]] = field(default_factory=list)  # (pod key, node)
    evicted: list[str] = field(default_factory=list)
    pending: dict[str, str] = field(default_factory=dict)  # group -> why
    errors: list[str] = field(default_factory=list)


class Scheduler:
    """One scheduler: ``cycle()`` lists, decides and acts once; ``run()`` repeats until ``stop`` is set."""

    def __init__(
        self,
        api: RestCalls,
        queues: Sequence[Queue],
        *,
        weights: Weights | None = None,
        scheduler_name: str = SCHEDULER_NAME,
        run_session: RunSession | None = None,
        stats: SchedulerStats | None = None,
    ) -> None:
        self.api = api
        self.stats = stats or SchedulerStats()
        self.queues = list(queues)
        self.weights = weights
        self.scheduler_name = scheduler_name
        self._run_session = run_session
        self._reported: dict[str, str] = {}  # object -> last problem reported, so each is said once
        self._evicting: dict[str, set[str]] = {}  # group -> pods evicted for it, not gone yet
        self._podgroups_absent = False

    def cycle(self) -> CycleReport:
        report = CycleReport()
        nodes = self.api.list_items("/api/v1/nodes")
        pods = self.api.list_items("/api/v1/pods")
        snap = build_snapshot(nodes, pods, self._list_podgroups(), self.queues, self.scheduler_name)
        for what, problem in snap.problems.items():
            self._report_problem(what, problem)
        live = {object_key(p, "Pod") for p in pods if isinstance(p, Mapping) and _safe_key(p)}
        for name, victims in list(self._evicting.items()):
            victims &= live
            if not victims:
                del self._evicting[name]
        # A group whose victims are still terminating waits, so the freed room is not preempted twice.
        offered = []
        for group in snap.groups:
            if group.name in self._evicting:
                snap.waiting[group.name] = (
                    f"waiting for {len(self._evicting[group.name])} evicted pods to terminate"
                )
            else:
                offered.append(group)
        report.pending.update(snap.waiting)
        result = self._session()(snap.nodes, self.queues, offered, snap.running, self.weights)
        self._act(snap, offered, result, report)
        for name, why in report.pending.items():
            self._mark_pending(name, why, snap)
        return report

    def run(self, interval: float, stop: threading.Event) -> None:
        while not stop.is_set():
            started = time.monotonic()
            try:
                report = self.cycle()
                seconds = time.monotonic() - started
                self.stats.cycle_done(
                    len(report.bound),
                    len(report.evicted),
                    len(report.errors),
                    len(report.pending),
                    seconds,
                    time.time(),
                )
                log.log(
                    logging.INFO if report.bound or report.evicted else logging.DEBUG,
                    "cycle: %d bound, %d evicted, %d groups pending (%.2fs)",
                    len(report.bound),
                    len(report.evicted),
                    len(report.pending),
                    time.monotonic() - started,
                )
            except ApiError as exc:
                self.stats.cycle_failed(time.monotonic() - started)
                log.error("cycle failed: %s; retrying in %.0fs", exc, interval)
            except Exception:  # a bug must not stop scheduling: log it once per cycle and go on
                self.stats.cycle_failed(time.monotonic() - started)
                log.exception("cycle failed")
            stop.wait(max(0.0, interval - (time.monotonic() - started)))

    def _session(self) -> RunSession:
        if self._run_session is None:
            from pffs.scheduler.session import run_session

            self._run_session = run_session
        return self._run_session

    def _list_podgroups(self) -> list[Any]:
        try:
            items = self.api.list_items(PODGROUP_API)
        except ApiError as exc:
            if exc.status != 404:
                raise
            if not self._podgroups_absent:
                log.warning(
                    "the PodGroup CRD (scheduling.x-k8s.io/v1alpha1) is not installed: gangs take their "
                    "min member from the pod annotation %s",
                    MIN_MEMBER_ANNOTATION,
                )
            self._podgroups_absent = True
            return []
        self._podgroups_absent = False
        return items

    def _act(
        self, snap: Snapshot, offered: list[PodGroup], result: SessionResult, report: CycleReport
    ) -> None:
        report.pending.update(result.pending)
        by_group: dict[str, list[Placement]] = {}
        for placement in result.placements:
            by_group.setdefault(placement.pod.group, []).append(placement)
        evictions = [e for e in result.evictions if e.pod.name in snap.ours]
        refused = [e.pod.name for e in result.evictions if e.pod.name not in snap.ours]
        evicted_nodes = {e.node for e in evictions}
        if refused:
            # The core chose a pod this scheduler did not place: leave it, and hold back what needed the room.
            log.warning("not evicting pods of other schedulers: %s", ", ".join(sorted(refused)))
            evicted_nodes |= {e.node for e in result.evictions}
            evictions = []
        for eviction in evictions:
            self._evict(eviction, report)
        # Only pods actually evicted are waited for: one refused (429, a PodDisruptionBudget) stays running,
        # so waiting for it would hold the group forever; the group is offered again next cycle instead.
        evicted = set(report.evicted)
        for group, placements in by_group.items():
            why = self._hold_back(placements, snap, evicted_nodes)
            if why:
                report.pending[group] = why
                if evicted:
                    self._evicting.setdefault(group, set()).update(evicted)
                continue
            for placement in placements:
                self._bind(placement, report)
            self._reported.pop(group, None)  # if it waits again later, say so again

    def _hold_back(self, placements: list[Placement], snap: Snapshot, evicted_nodes: set[str]) -> str:
        """Why a group's placements must wait (empty: bind them). All or nothing, as the gang."""
        for p in placements:
            if p.node in evicted_nodes:
                return f"preempting pods on {p.node}; binds once they are gone"
            pod_obj, node_obj = snap.pods.get(p.pod.name), snap.node_objects.get(p.node)
            if pod_obj is None or node_obj is None:
                return f"pod {p.pod.name} or node {p.node} is not in the snapshot"
            if not tolerates(pod_obj, node_obj):
                return f"pod {p.pod.name} does not tolerate the taints of node {p.node}"
        return ""

    def _bind(self, placement: Placement, report: CycleReport) -> None:
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
        path = f"/api/v1/namespaces/{namespace}/pods/{name}/binding"
        try:
            self.api.request("POST", path, binding)
        except ApiError as exc:
            report.errors.append(str(exc))
            log.warning(
                "binding %s to %s failed: %s (retried next cycle)", placement.pod.name, placement.node, exc
            )
            return
        log.info(
            "bound %s to %s%s",
            placement.pod.name,
            placement.node,
            f" GPUs {placement.gpus}" * bool(placement.gpus),
        )
        report.bound.append((placement.pod.name, placement.node))

    def _evict(self, placement: Placement, report: CycleReport) -> None:
        namespace, name = placement.pod.name.split("/", 1)
        eviction = {
            "apiVersion": "policy/v1",
            "kind": "Eviction",
            "metadata": {"name": name, "namespace": namespace},
        }
        try:
            self.api.request("POST", f"/api/v1/namespaces/{namespace}/pods/{name}/eviction", eviction)
        except ApiError as exc:
            report.errors.append(str(exc))
            # 429: a PodDisruptionBudget forbids it now; 404: already gone.
            log.warning("evicting %s failed: %s", placement.pod.name, exc)
            return
        log.info("evicted %s from %s (preempted)", placement.pod.name, placement.node)
        report.evicted.append(placement.pod.name)

    def _mark_pending(self, group: str, why: str, snap: Snapshot) -> None:
        """Say once (per reason) why a group waits: a log line and PodScheduled=False on its pods."""
        if self._reported.get(group) == why:
            return
        self._reported[group] = why
        log.info("group %s waits: %s", group, why)
        for key in snap.members.get(group, []):
            namespace, name = key.split("/", 1)
            condition = {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": f"pffs-scheduler: {why}",
                "lastTransitionTime": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            }
            try:
                self.api.request(
                    "PATCH",
                    f"/api/v1/namespaces/{namespace}/pods/{name}/status",
                    {"status": {"conditions": [condition]}},
                    "application/strategic-merge-patch+json",
                )
            except ApiError as exc:
                log.debug("could not set PodScheduled on %s: %s", key, exc)

    def _report_problem(self, what: str, problem: str) -> None:
        if self._reported.get(what) == problem:
            return
        self._reported[what] = problem
        log.warning("skipping %s: %s", what, problem)
        if not what.startswith("Pod ") or "/" not in what:
            return
        namespace, name = what.removeprefix("Pod ").split("/", 1)
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{name}.", "namespace": namespace},
            "involvedObject": {"apiVersion": "v1", "kind": "Pod", "name": name, "namespace": namespace},
            "reason": "FailedScheduling",
            "message": f"pffs-scheduler cannot schedule this pod: {problem}",
            "type": "Warning",
            "source": {"component": self.scheduler_name},
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        try:
            self.api.request("POST", f"/api/v1/namespaces/{namespace}/events", event)
        except ApiError as exc:
            log.debug("could not post an Event for %s: %s", what, exc)


def _safe_key(obj: Mapping[str, Any]) -> bool:
    try:
        object_key(obj, "Pod")
    except BadObject:
        return False
    return True
