"""Node objects as the core's ``Node``: allocatable CPU, memory and GPUs, GPU model, ToR switch, GPU
topology, what the node's pffs cache holds, and whether the node takes pods (Ready and not cordoned)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from pffs.scheduler.core.objects import MILLI, Gpu, Node
from pffs.scheduler.kube.json_fields import BadObject, json_list, json_object, object_key, str_map
from pffs.scheduler.kube.locality import node_cache
from pffs.scheduler.kube.names import GPU_PRODUCT_LABEL, GPU_RESOURCE, TOPOLOGY_ANNOTATION, TOR_LABEL
from pffs.scheduler.kube.quantity import MIB, amount


def node_from_json(obj: Mapping[str, Any]) -> Node:
    """A Node object as the core's Node (``schedulable`` False if cordoned or not Ready)."""
    name = object_key(obj, "Node")
    what = f"Node {name}"
    metadata = json_object(obj.get("metadata"), f"{what}: metadata")
    labels = str_map(metadata.get("labels"), f"{what}: metadata.labels")
    annotations = str_map(metadata.get("annotations"), f"{what}: metadata.annotations")
    spec = json_object(obj.get("spec"), f"{what}: spec")
    status = json_object(obj.get("status"), f"{what}: status")
    allocatable = json_object(status.get("allocatable"), f"{what}: status.allocatable")
    for key in ("cpu", "memory"):
        if key not in allocatable:
            raise BadObject(f"{what}: status.allocatable has no {key}")
    cpu = math.floor(amount(allocatable["cpu"], f"{what}: allocatable cpu") * MILLI)
    memory = math.floor(amount(allocatable["memory"], f"{what}: allocatable memory") / MIB)
    gpus = amount(allocatable.get(GPU_RESOURCE, "0"), f"{what}: allocatable {GPU_RESOURCE}")
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
