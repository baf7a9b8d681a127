"""Taints and tolerations: whether a pod may go to a node despite its NoSchedule/NoExecute taints."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pffs.scheduler.kube.json_fields import json_list, json_object


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
