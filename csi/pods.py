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


class Pods:
    def __init__(self, api: Any | None, node_id: str) -> None:
        self.api = api
        self.node_id = node_id
        self._events = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="events")

    def mounts_read_only(self, pod: PodRef | None, target_path: str) -> bool:
        """True when every container of the pod that mounts this volume mounts it readOnly (the kubelet
        passes that to the runtime, not to CSI: without this, the host's bind would be writable, and so
        would a repaired mount bound over the pod's read-only one). False when unknown."""
        if self.api is None or pod is None:
            return False
        name = volume_name_of(target_path)
        try:
            spec = self.api.read_namespaced_pod(pod.name, pod.namespace, _request_timeout=API_TIMEOUT_S).spec
            volumes = {v.name: v for v in spec.volumes or []}
            if volumes.get(name) is None or volumes[name].csi is None:  # a PV's name: find its claim's volume
                name = ""
                for volume in volumes.values():
                    claim = volume.persistent_volume_claim
                    if claim is None:
                        continue
                    pvc = self.api.read_namespaced_persistent_volume_claim(
                        claim.claim_name, pod.namespace, _request_timeout=API_TIMEOUT_S
                    )
                    if pvc.spec.volume_name == volume_name_of(target_path):
                        name = volume.name
                        break
            containers = [*(spec.init_containers or []), *(spec.containers or [])]
            mounts = [m for c in containers for m in c.volume_mounts or [] if m.name == name]
        except Exception as exc:
            log.warning("could not read pod %s/%s's volume mounts (%s)", pod.namespace, pod.name, exc)
            return False
        return bool(mounts) and all(m.read_only for m in mounts)

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
