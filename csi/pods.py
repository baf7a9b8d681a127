"""The pods behind a node's targets, through the API server: whether a pod mounts its volume only read-only
(so the bind is read-only on the host too, and stays so after a repair), and Events on the pods whose volume
died or was mounted again (so `kubectl describe pod` says what happened to its files).

The kubelet names the pod in NodePublishVolume's volume context (CSIDriver `podInfoOnMount: true`).
"""

from __future__ import annotations

import concurrent.futures
import datetime
import logging
import os
from typing import Any

from pydantic import BaseModel

log = logging.getLogger(__name__)

POD_NAME = "csi.storage.k8s.io/pod.name"
POD_NAMESPACE = "csi.storage.k8s.io/pod.namespace"
POD_UID = "csi.storage.k8s.io/pod.uid"
API_TIMEOUT_S = 5.0
COMPONENT = "pffs-csi-node"


class PodRef(BaseModel):
    namespace: str
    name: str
    uid: str


def pod_of(context: dict[str, str]) -> PodRef | None:
    if not all(context.get(key) for key in (POD_NAME, POD_NAMESPACE, POD_UID)):
        return None
    return PodRef(namespace=context[POD_NAMESPACE], name=context[POD_NAME], uid=context[POD_UID])


def volume_name_of(target_path: str) -> str:
    """The kubelet's target is .../pods/UID/volumes/kubernetes.io~csi/NAME/mount: NAME is the pod's volume
    (inline) or the PV's name."""
    return os.path.basename(os.path.dirname(os.path.normpath(target_path)))


class Blind(BaseModel):
    """A pod's volume as a repair reaches it: `containers` mount it without HostToContainer."""

    volume: str
    containers: list[str]


class Pods:
    def __init__(self, api: Any | None, node_id: str) -> None:
        self.api = api
        self.node_id = node_id
        self._events = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="events")

    def mounts_read_only(self, pod: PodRef | None, target_path: str) -> bool:
        """True when every container of the pod that mounts this volume mounts it readOnly (the kubelet
        passes that to the runtime, not to CSI: without this, the host's bind would be writable, and so
        would a repaired mount bound over the pod's read-only one). False when unknown."""
        found = self._pod_volume_if_known(pod, target_path)
        if found is None:
            return False
        spec, name = found
        mounts = [m for _, m in volume_mounts(spec, name)]
        return bool(mounts) and all(m.read_only for m in mounts)

    def _pod_volume_if_known(self, pod: PodRef | None, target_path: str) -> tuple[Any, str] | None:
        """_pod_volume, or None (logged) when there is no API, no pod named, or the API did not answer."""
        if self.api is None or pod is None:
            return None
        try:
            return self._pod_volume(pod, target_path)
        except Exception as exc:
            log.warning("could not read pod %s/%s's volume mounts (%s)", pod.namespace, pod.name, exc)
            return None

    def _pod_volume(self, pod: PodRef, target_path: str) -> tuple[Any, str]:
        """The pod's spec and the name of its volume published at `target_path` ("" if none matches)."""
        assert self.api is not None
        name = volume_name_of(target_path)
        spec = self.api.read_namespaced_pod(pod.name, pod.namespace, _request_timeout=API_TIMEOUT_S).spec
        volumes = {v.name: v for v in spec.volumes or []}
        if volumes.get(name) is not None and volumes[name].csi is not None:
            return spec, name
        for volume in volumes.values():  # a PV's name: find its claim's volume
            claim = volume.persistent_volume_claim
            if claim is None:
                continue
            pvc = self.api.read_namespaced_persistent_volume_claim(
                claim.claim_name, pod.namespace, _request_timeout=API_TIMEOUT_S
            )
            if pvc.spec.volume_name == name:
                return spec, volume.name
        return spec, ""

    def blind_containers(self, pod: PodRef | None, target_path: str) -> Blind | None:
        """The pod's containers that mount the volume at `target_path` without HostToContainer (they keep a
        dead mount after a repair), with the pod's name for the volume. None when unknown (no API, no pod
        named, or the API did not answer)."""
        found = self._pod_volume_if_known(pod, target_path)
        if found is None:
            return None
        spec, name = found
        return Blind(volume=name or volume_name_of(target_path), containers=without_propagation(spec, name))

    def post_repaired(
        self, pod: PodRef, target_path: str, source: str, ended: str, blind: Blind | None
    ) -> None:
        """After a dead mount was mounted again: PffsMountRepaired where every container mounting the
        volume sees the new mount (HostToContainer), else PffsMountRepairNotSeen, which says the pod keeps
        the dead mount and what to change (both Warnings). `blind`: blind_containers(), read again if
        None. In the background, as every Event."""
        if self.api is None:
            return
        try:
            self._events.submit(self._post_repaired, pod, target_path, source, ended, blind)
        except RuntimeError:
            log.info("not posting a repair Event on pod %s/%s: stopping", pod.namespace, pod.name)

    def _post_repaired(
        self, pod: PodRef, target_path: str, source: str, ended: str, blind: Blind | None
    ) -> None:
        if blind is None:
            blind = self.blind_containers(pod, target_path)
        if blind is None or not blind.containers:
            self._post(
                pod,
                "Warning",
                "PffsMountRepaired",
                f"the pffs mount of {source} died ({ended}) and was mounted again; files opened before then "
                "fail with ENOTCONN and must be opened again",
            )
            return
        self._post(
            pod,
            "Warning",
            "PffsMountRepairNotSeen",
            f"the pffs mount of {source} died ({ended}) and was mounted again on the node, but container(s) "
            f"{', '.join(blind.containers)} mount volume {blind.volume} without mountPropagation: "
            "HostToContainer, so they keep the dead mount: every read of it fails (ENOTCONN) until the pod "
            "is restarted. Restart the pod now, and add mountPropagation: HostToContainer to that "
            "volumeMount so that a repair reaches it",
        )

    def post_event(self, pod: PodRef, kind: str, reason: str, message: str) -> None:
        """An Event on the pod, sent in the background (an API server that does not answer must not hold
        a repair)."""
        if self.api is not None:
            try:
                self._events.submit(self._post, pod, kind, reason, message)
            except RuntimeError:  # closed: the plugin is stopping
                log.info("not posting Event %s on pod %s/%s: stopping", reason, pod.namespace, pod.name)

    def _post(self, pod: PodRef, kind: str, reason: str, message: str) -> None:
        from kubernetes import client

        now = datetime.datetime.now(datetime.UTC)
        event = client.CoreV1Event(
            metadata=client.V1ObjectMeta(generate_name=f"{pod.name}.pffs-", namespace=pod.namespace),
            involved_object=client.V1ObjectReference(
                api_version="v1", kind="Pod", namespace=pod.namespace, name=pod.name, uid=pod.uid
            ),
            type=kind,
            reason=reason,
            message=message[:1000],
            source=client.V1EventSource(component=COMPONENT, host=self.node_id),
            reporting_component=f"csi.pffs.io/{COMPONENT}",
            reporting_instance=self.node_id,
            first_timestamp=now,
            last_timestamp=now,
            count=1,
        )
        assert self.api is not None
        try:
            self.api.create_namespaced_event(pod.namespace, event, _request_timeout=API_TIMEOUT_S)
        except Exception as exc:
            log.warning("could not post Event %s on pod %s/%s: %s", reason, pod.namespace, pod.name, exc)

    def close(self) -> None:
        self._events.shutdown(wait=False, cancel_futures=True)


# Which pods hold pffs volumes (`pffs csi-pods`), and which of them see a repaired mount

PROPAGATING = ("HostToContainer", "Bidirectional")
LIST_TIMEOUT_S = 30.0


class HeldVolume(BaseModel):
    """One pod's pffs volume: where it runs, what it reads, and whether its containers see a mount made
    again after the mounter's replacement (mountPropagation HostToContainer or Bidirectional)."""

    node: str
    namespace: str
    pod: str
    volume: str  # the pod's volume name
    kind: str  # "inline", or "pv" for a PersistentVolume through its claim
    persistent_volume: str | None = None
    source: str
    read_only: bool
    sees_repair: bool
    containers_without_propagation: list[str]


def volume_mounts(spec: Any, volume: str) -> list[tuple[str, Any]]:
    """(container name, volumeMount) for every container and init container of `spec` mounting `volume`."""
    containers = [*(spec.init_containers or []), *(spec.containers or [])]
    return [(c.name, m) for c in containers for m in c.volume_mounts or [] if m.name == volume]


def without_propagation(spec: Any, volume: str) -> list[str]:
    """The containers that mount `volume` without HostToContainer (or Bidirectional) propagation: they keep
    the mount they started with, and never see one made again at the target."""
    return sorted(
        {name for name, mount in volume_mounts(spec, volume) if mount.mount_propagation not in PROPAGATING}
    )


def held_volumes(core: Any, driver: str, node: str | None = None) -> list[HeldVolume]:
    """Every pod scheduled to a node (or to `node`) that is not finished and uses a volume of `driver`, inline
    or through a claim bound to one of its PersistentVolumes; by node, namespace and pod."""
    pvs = {
        pv.metadata.name: pv
        for pv in core.list_persistent_volume(_request_timeout=LIST_TIMEOUT_S).items
        if pv.spec.csi is not None and pv.spec.csi.driver == driver
    }
    claims = {
        (pvc.metadata.namespace, pvc.metadata.name): pvc.spec.volume_name
        for pvc in core.list_persistent_volume_claim_for_all_namespaces(_request_timeout=LIST_TIMEOUT_S).items
        if pvc.spec.volume_name in pvs
    }
    selector = "status.phase!=Succeeded,status.phase!=Failed"
    if node:
        selector += f",spec.nodeName={node}"
    held = []
    pods = core.list_pod_for_all_namespaces(field_selector=selector, _request_timeout=LIST_TIMEOUT_S)
    for pod in pods.items:
        spec, meta = pod.spec, pod.metadata
        if not spec.node_name:
            continue
        for volume in spec.volumes or []:
            pv_name = None
            if volume.csi is not None and volume.csi.driver == driver:
                kind, source = "inline", (volume.csi.volume_attributes or {}).get("source", "")
                read_only = bool(volume.csi.read_only)
            elif volume.persistent_volume_claim is not None:
                pv_name = claims.get((meta.namespace, volume.persistent_volume_claim.claim_name))
                if pv_name is None:
                    continue
                csi = pvs[pv_name].spec.csi
                kind = "pv"
                source = (csi.volume_attributes or {}).get("source") or csi.volume_handle.split("#")[0]
                read_only = bool(csi.read_only or volume.persistent_volume_claim.read_only)
            else:
                continue
            mounts = volume_mounts(spec, volume.name)
            read_only = read_only or (bool(mounts) and all(m.read_only for _, m in mounts))
            blind = without_propagation(spec, volume.name)
            held.append(
                HeldVolume(
                    node=spec.node_name,
                    namespace=meta.namespace,
                    pod=meta.name,
                    volume=volume.name,
                    kind=kind,
                    persistent_volume=pv_name,
                    source=source,
                    read_only=read_only,
                    sees_repair=not blind,
                    containers_without_propagation=blind,
                )
            )
    return sorted(held, key=lambda h: (h.node, h.namespace, h.pod, h.volume))


def held_volumes_table(held: list[HeldVolume]) -> str:
    """`pffs csi-pods`'s table: one line per pod volume, grouped by node."""
    if not held:
        return "no running pod uses a pffs volume\n"
    rows = [("NODE", "NAMESPACE/POD", "VOLUME", "SOURCE", "MODE", "AFTER A MOUNTER REPLACEMENT")]
    for h in held:
        volume = f"{h.volume} (pv {h.persistent_volume})" if h.persistent_volume else f"{h.volume} (inline)"
        after = (
            "reopens read again"
            if h.sees_repair
            else "restart the pod (" + ", ".join(h.containers_without_propagation) + ": no HostToContainer)"
        )
        rows.append(
            (h.node, f"{h.namespace}/{h.pod}", volume, h.source, "ro" if h.read_only else "rw", after)
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    lines = []
    previous = None
    for row in rows:
        node = row[0] if row[0] != previous else ""
        previous = row[0]
        cells = [node.ljust(widths[0])] + [cell.ljust(widths[i]) for i, cell in enumerate(row[1:-1], 1)]
        lines.append("  ".join([*cells, row[-1]]).rstrip())
    nodes = sorted({h.node for h in held})
    lines.append("")
    lines.append(
        f"{len(held)} pod volume(s) on {len(nodes)} node(s). Replacing a node's mounter ends its mounts: "
        "files these pods hold open fail (ENOTCONN) for good. Drain the node first (docs/operations.md)."
    )
    return "\n".join(lines) + "\n"
