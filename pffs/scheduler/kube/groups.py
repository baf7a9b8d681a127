"""Gangs: which pods run together (the scheduler-plugins PodGroup, or the pod annotation without one), their
min member, queue, priority and arrival, as the core's ``PodGroup``."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from pffs.scheduler.core.objects import Pod, PodGroup
from pffs.scheduler.kube.json_fields import BadObject, json_object, name_of, object_key, str_map
from pffs.scheduler.kube.names import DEFAULT_QUEUE, MIN_MEMBER_ANNOTATION, POD_GROUP_LABEL, QUEUE_LABEL
from pffs.scheduler.kube.pods import pod_priority, single_group


def _timestamp(value: Any) -> float:
    if not isinstance(value, str):
        return 0.0
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return 0.0


def group_name(pod_key: str, labels: Mapping[str, str]) -> str:
    """The gang a pod of ours belongs to: its PodGroup label's group, else a group of its own."""
    label = labels.get(POD_GROUP_LABEL)
    if not label:
        return single_group(pod_key)
    return f"podgroup:{pod_key.split('/', 1)[0]}/{label}"


@dataclass(frozen=True)
class PodGroupSpec:
    """What a PodGroup object says of its gang."""

    min_member: int
    queue: str | None
    created: float


def read_podgroups(objs: Iterable[Any], problems: dict[str, str]) -> dict[str, PodGroupSpec]:
    """PodGroup objects by group name; a malformed one lands in ``problems`` and is left out."""
    out = {}
    for obj in objs:
        try:
            key = object_key(json_object(obj, "PodGroup"), "PodGroup")
            spec = json_object(obj.get("spec"), f"PodGroup {key}: spec")
            metadata = json_object(obj.get("metadata"), f"PodGroup {key}: metadata")
            labels = str_map(metadata.get("labels"), f"PodGroup {key}: metadata.labels")
            minimum = spec.get("minMember", 1) or 1  # omitempty: an absent 0 means one
            if not isinstance(minimum, int) or isinstance(minimum, bool) or minimum < 1:
                raise BadObject(f"PodGroup {key}: spec.minMember must be a positive integer, not {minimum!r}")
            out[f"podgroup:{key}"] = PodGroupSpec(
                minimum, labels.get(QUEUE_LABEL), _timestamp(metadata.get("creationTimestamp"))
            )
        except BadObject as exc:
            problems[f"PodGroup {name_of(obj)}"] = str(exc)
    return out


def build_group(
    name: str,
    members: list[tuple[Pod, Mapping[str, Any]]],
    podgroups: Mapping[str, PodGroupSpec],
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
