"""What `helm uninstall` cannot remove by itself, removed by the chart's post-delete hook (`pffs
csi-uninstall`, a Job): what the driver wrote at run time, which no release object holds.

- the Node annotations its node plugins wrote: `pffs.io/cache` (the cache report, which `pffs scheduler` and
  `pffs extender` read) and `pffs.io/cache-group`; removed from every Node that has one, by a merge patch
  of that key alone (a Node's other annotations, and a Node without them, are not touched);
- the Leases of its controllers in the release's namespace: csi-provisioner's leader election
  (`csi-pffs-io`) and the warm-up controller's (`pffs-warmup-controller`).

With `delete_crd` (the chart's uninstall.deleteCrd, off by default), also the CRD datasetwarmups.pffs.io,
and with it every DatasetWarmup of the cluster.

It first waits (up to `wait_s`) until the chart's node plugin pods are gone, so that none writes its report
again after the clean-up. Each step is idempotent: a second run finds nothing to do. What stays on purpose
(by default the CRD and its DatasetWarmups; each node's state dir with its disk cache) is listed in
docs/operations.md, "Uninstalling".
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from pffs.csi.cache_group import GROUP_ANNOTATION
from pffs.scheduler.kube.locality import CACHE_ANNOTATION

log = logging.getLogger(__name__)

NODE_ANNOTATIONS = (CACHE_ANNOTATION, GROUP_ANNOTATION)
LEASES = ("csi-pffs-io", "pffs-warmup-controller")
NODE_PLUGIN_PODS = "app.kubernetes.io/name=pffs-csi-node"
CRD = "datasetwarmups.pffs.io"
TIMEOUT = 30


@dataclass
class Cleaned:
    nodes: list[str] = field(default_factory=list)  # Nodes whose annotations were removed
    leases: list[str] = field(default_factory=list)
    crd: bool = False  # the CRD was deleted
    plugins_left: int = 0  # node plugin pods still there when the wait ended


def clean_up(
    api_client: Any, namespace: str, wait_s: float = 120.0, poll_s: float = 1.0, delete_crd: bool = False
) -> Cleaned:
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    core: Any = client.CoreV1Api(api_client)
    leases: Any = client.CoordinationV1Api(api_client)
    done = Cleaned()
    deadline = time.monotonic() + wait_s
    while True:
        pods = core.list_namespaced_pod(namespace, label_selector=NODE_PLUGIN_PODS, _request_timeout=TIMEOUT)
        done.plugins_left = len(pods.items)
        if not pods.items or time.monotonic() >= deadline:
            break
        time.sleep(poll_s)
    if done.plugins_left:
        log.warning(
            "%d pffs node plugin pod(s) still in %s after %.0f s; cleaning up anyway",
            done.plugins_left,
            namespace,
            wait_s,
        )
    for node in core.list_node(_request_timeout=TIMEOUT).items:
        present = [key for key in NODE_ANNOTATIONS if key in (node.metadata.annotations or {})]
        if not present:
            continue
        body = {"metadata": {"annotations": dict.fromkeys(present)}}  # null removes a key
        core.patch_node(
            node.metadata.name,
            body,
            _request_timeout=TIMEOUT,
            _content_type="application/merge-patch+json",
        )
        done.nodes.append(node.metadata.name)
        log.info("Node %s: removed %s", node.metadata.name, ", ".join(present))
    for name in LEASES:
        try:
            leases.delete_namespaced_lease(name, namespace, _request_timeout=TIMEOUT)
        except ApiException as exc:
            if exc.status == 404:
                continue
            raise
        done.leases.append(name)
        log.info("Lease %s/%s deleted", namespace, name)
    if delete_crd:
        crds: Any = client.ApiextensionsV1Api(api_client)
        try:
            crds.delete_custom_resource_definition(CRD, _request_timeout=TIMEOUT)
            done.crd = True
            log.info("CRD %s deleted, with every DatasetWarmup", CRD)
        except ApiException as exc:
            if exc.status != 404:
                raise
    return done
