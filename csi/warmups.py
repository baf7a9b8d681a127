"""DatasetWarmup resources (pffs.io/v1alpha1): what the controller and the node plugins share.

The CRD is deploy/helm/pffs-csi/crds/datasetwarmups.pffs.io.yaml. The controller (warmup_controller.py)
writes into a warm-up's status the dataset resolved into volume attributes (`status.resolved`) and the
nodes it chose (`status.nodes.<node>`); each node plugin (warmup_node.py) warms its own node and writes only
its own entry. Both write with JSON merge patches of the status subresource, so they never conflict.
"""

from __future__ import annotations

import base64
import datetime
import logging
from collections.abc import Callable
from typing import Any

from pffs.csi.list_watch import ListWatch

log = logging.getLogger(__name__)

GROUP, VERSION, PLURAL, KIND = "pffs.io", "v1alpha1", "datasetwarmups", "DatasetWarmup"
GATE = "pffs.io/warmup"  # a pod's scheduling gate, removed when the warm-up its label names has ended
LABEL = "pffs.io/warmup"  # on a pod: the name of the DatasetWarmup (same namespace) it waits for
PENDING, RUNNING, SUCCEEDED, FAILED = "Pending", "Running", "Succeeded", "Failed"
ENDED = (SUCCEEDED, FAILED)
MERGE_PATCH = "application/merge-patch+json"


def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def patch_status(custom: Any, namespace: str, name: str, status: dict[str, Any]) -> None:
    """A merge patch of the warm-up's status: only the keys given change."""
    custom.patch_namespaced_custom_object_status(
        GROUP,
        VERSION,
        namespace,
        PLURAL,
        name,
        {"status": status},
        _request_timeout=10,
        _content_type=MERGE_PATCH,
    )


def secret_values(core: Any, namespace: str, name: str) -> dict[str, str]:
    """A Secret's keys and decoded values (credentials: never logged). A Secret that cannot be read is a
    ValueError in one line that says what to do (not the client's dump of the answer's headers)."""
    from kubernetes.client.exceptions import ApiException

    try:
        secret = core.read_namespaced_secret(name, namespace, _request_timeout=10)
    except ApiException as exc:
        where = f"Secret {namespace}/{name} (spec.secretName)"
        if exc.status == 404:
            raise ValueError(
                f"{where} does not exist: a warm-up's Secret must be in the pffs CSI driver's namespace "
                f"({namespace}), with the keys accessKeyId and secretAccessKey"
            ) from None
        if exc.status == 403:
            raise ValueError(
                f"{where}: the pffs node plugin may not read it (its Role pffs-csi-node-warmup-secrets "
                f"grants get on Secrets of {namespace} when warmups.enabled)"
            ) from None
        raise ValueError(f"{where} could not be read: HTTP {exc.status} {exc.reason}") from None
    return {k: base64.b64decode(v).decode() for k, v in (secret.data or {}).items()}


def own_namespace() -> str | None:
    """The namespace of the pod this runs in (its service account's), if it runs in one."""
    try:
        with open("/var/run/secrets/kubernetes.io/serviceaccount/namespace") as f:
            return f.read().strip() or None
    except OSError:
        return None


def warmup_watch(
    custom: Any, seen: Callable[[dict[str, Any]], None], gone: Callable[[dict[str, Any]], None]
) -> ListWatch:
    """Follows every DatasetWarmup: `seen` for each one listed, added or changed, `gone` for each deleted."""

    def changed(kind: str, item: dict[str, Any]) -> None:
        (gone if kind == "DELETED" else seen)(item)

    def listed(items: list[dict[str, Any]]) -> None:
        for item in items:
            seen(item)

    return ListWatch(
        "DatasetWarmups", custom.list_cluster_custom_object, (GROUP, VERSION, PLURAL), listed, changed
    )
