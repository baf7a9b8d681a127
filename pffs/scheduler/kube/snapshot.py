"""One cycle's view of the cluster in the core's terms (``build_snapshot``): listed Nodes, Pods and PodGroups
translated into nodes, gangs and running placements, with what could not be translated and why.

NoSchedule/NoExecute taints are honoured (as synthetic node selectors, see ``_taints_as_selectors``); node
affinity and pod (anti-)affinity are not modelled.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from pffs.scheduler.core.objects import MILLI, Node, Placement, Pod, PodGroup, Queue
from pffs.scheduler.kube.groups import build_group, group_name, read_podgroups
from pffs.scheduler.kube.json_fields import BadObject, json_object, name_of, object_key, str_map
from pffs.scheduler.kube.names import GPUS_ANNOTATION, SCHEDULER_NAME
from pffs.scheduler.kube.nodes import node_from_json
from pffs.scheduler.kube.pods import is_terminal, pod_from_json, single_group
from pffs.scheduler.kube.taints import tolerates

log = logging.getLogger(__name__)


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
            snap.problems[f"Node {name_of(obj)}"] = str(exc)
            continue
        snap.nodes.append(node)  # cordoned and NotReady ones too: the core places nothing there
        snap.node_objects[node.name] = obj
    podgroups = read_podgroups(podgroup_objs, snap.problems)
    queue_names = {q.name for q in queues}
    members: dict[str, list[tuple[Pod, Mapping[str, Any]]]] = {}  # group -> its running and pending pods
    for obj in pod_objs:
        try:
            key = object_key(json_object(obj, "Pod"), "Pod")
        except BadObject as exc:
            snap.problems[f"Pod {name_of(obj)}"] = str(exc)
            continue
        try:
            if is_terminal(obj):
                continue
            spec = json_object(obj.get("spec"), f"Pod {key}: spec")
            metadata = json_object(obj.get("metadata"), f"Pod {key}: metadata")
            labels = str_map(metadata.get("labels"), f"Pod {key}: metadata.labels")
            mine = spec.get("schedulerName") == scheduler_name
            group = group_name(key, labels) if mine else single_group(key)
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
            snap.groups.append(build_group(group, pods, podgroups, queue_names))
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
