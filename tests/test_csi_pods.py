"""Which pods hold pffs volumes (`pffs csi-pods`) and which of them see a mount made again after the
mounter's replacement: the pod lookups of csi/pods.py over the official client's own model objects, and the
Events a repair posts (PffsMountRepaired only where the pod sees it)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any

from kubernetes import client

from pffs.csi.identity import DRIVER_NAME
from pffs.csi.pods import PodRef, Pods, held_volumes, held_volumes_table


def pod(
    name: str, node: str | None, volume: client.V1Volume, propagation: str | None, ro: bool = False
) -> Any:
    mount = client.V1VolumeMount(
        name=volume.name, mount_path="/data", mount_propagation=propagation, read_only=ro
    )
    container = client.V1Container(name="main", image="x", volume_mounts=[mount])
    sidecar = client.V1Container(name="sidecar", image="x")
    return client.V1Pod(
        metadata=client.V1ObjectMeta(name=name, namespace="team-a", uid=f"uid-{name}"),
        spec=client.V1PodSpec(node_name=node, containers=[container, sidecar], volumes=[volume]),
    )


def inline(source: str) -> client.V1Volume:
    csi = client.V1CSIVolumeSource(driver=DRIVER_NAME, read_only=True, volume_attributes={"source": source})
    return client.V1Volume(name="data", csi=csi)


def claim(name: str) -> client.V1Volume:
    return client.V1Volume(
        name="data", persistent_volume_claim=client.V1PersistentVolumeClaimVolumeSource(claim_name=name)
    )


@dataclass
class FakeCore:
    """The CoreV1Api calls csi/pods.py makes, answered from lists (field selectors as the API applies)."""

    pods: list[Any] = field(default_factory=list)
    pvs: list[Any] = field(default_factory=list)
    pvcs: list[Any] = field(default_factory=list)
    events: list[Any] = field(default_factory=list)

    def list_persistent_volume(self, **_: Any) -> Any:
        return client.V1PersistentVolumeList(items=self.pvs)

    def list_persistent_volume_claim_for_all_namespaces(self, **_: Any) -> Any:
        return client.V1PersistentVolumeClaimList(items=self.pvcs)

    def list_pod_for_all_namespaces(self, field_selector: str, **_: Any) -> Any:
        node = dict(t.split("=", 1) for t in field_selector.split(",") if "!=" not in t).get("spec.nodeName")
        return client.V1PodList(items=[p for p in self.pods if node in (None, p.spec.node_name)])

    def read_namespaced_pod(self, name: str, namespace: str, **_: Any) -> Any:
        return next(p for p in self.pods if (p.metadata.name, p.metadata.namespace) == (name, namespace))

    def read_namespaced_persistent_volume_claim(self, name: str, namespace: str, **_: Any) -> Any:
        return next(c for c in self.pvcs if (c.metadata.name, c.metadata.namespace) == (name, namespace))

    def create_namespaced_event(self, namespace: str, event: Any, **_: Any) -> None:
        self.events.append(event)


def world() -> FakeCore:
    pv = client.V1PersistentVolume(
        metadata=client.V1ObjectMeta(name="pv-imagenet"),
        spec=client.V1PersistentVolumeSpec(
            csi=client.V1CSIPersistentVolumeSource(
                driver=DRIVER_NAME,
                volume_handle="s3://b/imagenet#x",
                volume_attributes={"source": "s3://b/imagenet"},
            )
        ),
    )
    other = client.V1PersistentVolume(
        metadata=client.V1ObjectMeta(name="pv-other"),
        spec=client.V1PersistentVolumeSpec(
            csi=client.V1CSIPersistentVolumeSource(driver="ebs.csi.aws.com", volume_handle="vol-1")
        ),
    )
    pvcs = [
        client.V1PersistentVolumeClaim(
            metadata=client.V1ObjectMeta(name=name, namespace="team-a"),
            spec=client.V1PersistentVolumeClaimSpec(volume_name=pv_name),
        )
        for name, pv_name in (("imagenet", "pv-imagenet"), ("scratch", "pv-other"))
    ]
    pods = [
        pod("trainer-0", "gpu-1", claim("imagenet"), "HostToContainer"),
        pod("trainer-1", "gpu-2", claim("imagenet"), None, ro=True),
        pod("eval", "gpu-1", inline("s3://b/val"), "HostToContainer"),
        pod("db", "gpu-1", claim("scratch"), None),  # not pffs
        pod("pending", None, inline("s3://b/val"), None),  # not scheduled: holds nothing yet
    ]
    return FakeCore(pods=pods, pvs=[pv, other], pvcs=pvcs)


def test_the_pods_holding_pffs_volumes_are_listed_by_node_with_whether_they_see_a_repair() -> None:
    held = held_volumes(world(), DRIVER_NAME)
    assert [(h.node, h.pod, h.kind, h.source, h.sees_repair) for h in held] == [
        ("gpu-1", "eval", "inline", "s3://b/val", True),
        ("gpu-1", "trainer-0", "pv", "s3://b/imagenet", True),
        ("gpu-2", "trainer-1", "pv", "s3://b/imagenet", False),
    ]
    assert held[2].containers_without_propagation == ["main"] and held[2].read_only
    assert held[1].persistent_volume == "pv-imagenet" and not held[1].read_only
    assert [h.pod for h in held_volumes(world(), DRIVER_NAME, node="gpu-2")] == ["trainer-1"]
    table = held_volumes_table(held)
    lines = table.splitlines()
    assert lines[0].split() == [
        "NODE",
        "NAMESPACE/POD",
        "VOLUME",
        "SOURCE",
        "MODE",
        "AFTER",
        "A",
        "MOUNTER",
        "REPLACEMENT",
    ]
    assert lines[1].startswith("gpu-1 ") and lines[2].startswith(" ")  # the node once per group
    assert "team-a/trainer-1" in lines[3] and "restart the pod (main: no HostToContainer)" in lines[3]
    assert "3 pod volume(s) on 2 node(s)" in table and "Drain the node first" in table
    assert held_volumes_table([]) == "no running pod uses a pffs volume\n"


def test_a_repair_tells_each_pod_the_truth_about_what_it_sees() -> None:
    core = world()
    pods = Pods(core, "gpu-1")
    try:
        sees = PodRef(namespace="team-a", name="trainer-0", uid="uid-trainer-0")
        blind = PodRef(namespace="team-a", name="trainer-1", uid="uid-trainer-1")
        target = "/var/lib/kubelet/pods/{}/volumes/kubernetes.io~csi/pv-imagenet/mount"
        pods._post_repaired(sees, target.format(sees.uid), "s3://b/imagenet", "killed by SIGKILL", None)
        pods._post_repaired(blind, target.format(blind.uid), "s3://b/imagenet", "killed by SIGKILL", None)
    finally:
        pods.close()
    by_pod = {e.involved_object.name: e for e in core.events}
    assert by_pod["trainer-0"].reason == "PffsMountRepaired"
    assert by_pod["trainer-1"].reason == "PffsMountRepairNotSeen" and by_pod["trainer-1"].type == "Warning"
    message = by_pod["trainer-1"].message
    assert "container(s) main mount volume data without mountPropagation: HostToContainer" in message
    assert "until the pod is restarted" in message and "add mountPropagation: HostToContainer" in message


def test_pffs_csi_pods_without_a_reachable_api_says_so_in_one_line(tmp_path: Any) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:9"}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    command = [sys.executable, "-m", "pffs.cli.main", "csi-pods", "--kubeconfig", str(kubeconfig)]
    answer = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert answer.returncode == 1
    assert answer.stderr.startswith("pffs csi-pods: could not read the API at https://127.0.0.1:9")
    assert len(answer.stderr.strip().splitlines()) == 1 and "Traceback" not in answer.stderr
