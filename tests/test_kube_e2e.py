"""The whole path a user takes, for real: a pod with a pffs volume, placed by `pffs scheduler` on a real
kubelet (containerd + runc), which asks the pffs CSI plugin to stage and publish the volume; the container
reads the dataset from the SeaweedFS server and prints its sha256.

On one node of a real control plane (pffs.testing.kube_node): `pffs csi --mode all` runs beside the kubelet
as the DaemonSet would, and registers itself with the kubelet through its plugins_registry folder (the
node-driver-registrar sidecar is not on the Go module proxy; `--kubelet-registration-dir` does its job);
the CSIDriver object is deploy/csi's; csi-provisioner (built from the Go module proxy) provisions PVCs
through the plugin's controller service, and the controller-manager binds them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import poll, require, sha256

from pffs.testing.csi_plugin import CsiPlugin
from pffs.testing.kube_cluster import pffs_scheduler_command
from pffs.testing.kube_node import KubeNode, NodeControlPlane, missing_node_binaries
from pffs.testing.oci_image import BUSYBOX_IMAGE
from pffs.testing.s3_server import SeaweedS3

REPO = Path(__file__).resolve().parent.parent
TOOLS_BIN = Path(os.environ.get("PFFS_TOOLS_BIN") or Path.home() / ".cache/pffs-tools/bin")
NODE = "pffs-e2e-node"
BLOCK = 4 << 20

pytestmark = [pytest.mark.kube, pytest.mark.s3, pytest.mark.timeout(600)]


@dataclass
class World:
    cluster: NodeControlPlane
    node: KubeNode
    plugin: CsiPlugin
    s3: SeaweedS3
    core: Any
    logs: Callable[[], str]


@pytest.fixture(scope="module")
def world(s3_server: SeaweedS3, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    missing = missing_node_binaries() + [p for p in ("csi-provisioner",) if not (TOOLS_BIN / p).exists()]
    require(missing, "the end-to-end test")
    from kubernetes import client, dynamic

    root = tmp_path_factory.mktemp("e2e")
    with NodeControlPlane(root / "cp", node_names=[NODE]) as cluster:
        api = dynamic.DynamicClient(cluster.api())
        for obj in yaml.safe_load_all((REPO / "deploy/csi/csidriver.yaml").read_text()):
            if obj:
                api.resources.get(api_version=obj["apiVersion"], kind=obj["kind"]).create(body=obj)
        with KubeNode(root / "node", cluster, NODE) as node:
            # A short folder for the plugin's sockets (a unix socket path holds 108 bytes).
            plugin_root = Path(tempfile.mkdtemp(prefix="pffs-e2e-", dir="/run"))
            plugin = CsiPlugin(
                plugin_root,
                "--cache-size",
                "1G",
                "--kubelet-registration-dir",
                str(node.kubelet_root / "plugins_registry"),
                node_id=NODE,
            )
            processes: list[subprocess.Popen[bytes]] = []
            with plugin:
                logs_of = {"plugin": plugin.log, "kubelet": lambda: node.log("kubelet")}
                processes.append(
                    _start(
                        root / "provisioner.log",
                        [
                            str(TOOLS_BIN / "csi-provisioner"),
                            f"--csi-address={plugin.socket}",
                            f"--kubeconfig={cluster.kubeconfig}",
                            "--leader-election=false",
                            "--timeout=60s",
                            "--v=3",
                        ],
                    )
                )
                processes.append(
                    _start(
                        root / "pffs-scheduler.log",
                        pffs_scheduler_command(
                            cluster.kubeconfig, REPO / "deploy/scheduler/queues.yaml", "1", "-v"
                        ),
                    )
                )
                logs_of["provisioner"] = lambda: (root / "provisioner.log").read_text(errors="replace")
                logs_of["scheduler"] = lambda: (root / "pffs-scheduler.log").read_text(errors="replace")
                core = client.CoreV1Api(cluster.api())

                def logs() -> str:
                    return "\n".join(f"--- {name}\n{text()[-2500:]}" for name, text in logs_of.items())

                poll(
                    "the kubelet registers csi.pffs.io (CSINode)",
                    lambda: _csinode_has_driver(cluster),
                    timeout_s=60,
                    logs=logs,
                )
                try:
                    yield World(cluster, node, plugin, s3_server, core, logs)
                finally:
                    for process in processes:
                        process.send_signal(signal.SIGTERM)
                        process.wait(timeout=15)


def _start(log_path: Path, args: list[str]) -> subprocess.Popen[bytes]:
    with open(log_path, "ab") as log:
        return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)


def _csinode_has_driver(cluster: NodeControlPlane) -> bool:
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    try:
        csinode = client.StorageV1Api(cluster.api()).read_csi_node(NODE)
    except (ApiException, ValueError):  # not there yet, or there with no drivers (the client refuses null)
        return False
    return any(d.name == "csi.pffs.io" for d in csinode.spec.drivers or [])


def reader_pod(name: str, volume: dict[str, Any], path: str) -> dict[str, Any]:
    """A pod of pffs-scheduler that prints the sha256 of `path` in its pffs volume every second."""
    script = f"while true; do sha256sum /data/{path} || echo READ-FAILED; sleep 1; done"
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "schedulerName": "pffs-scheduler",
            "hostNetwork": True,
            "dnsPolicy": "Default",
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 5,
            "containers": [
                {
                    "name": "reader",
                    "image": BUSYBOX_IMAGE,
                    "imagePullPolicy": "Never",
                    "command": ["/bin/sh", "-c", script],
                    "volumeMounts": [
                        {
                            "name": "data",
                            "mountPath": "/data",
                            "readOnly": True,
                            "mountPropagation": "HostToContainer",
                        }
                    ],
                }
            ],
            "volumes": [{"name": "data", **volume}],
        },
    }


def printed_hashes(world: World, pod: str) -> list[str]:
    from kubernetes.client.exceptions import ApiException

    try:
        text = world.core.read_namespaced_pod_log(pod, "default")
    except ApiException:
        return []
    lines = (text or "").splitlines()  # None while the container has printed nothing
    return [line.split()[0] for line in lines if line.strip()]


def container_mounts(path: str) -> str:
    """What the reader containers' own mount namespaces hold at `path` (for a failure message)."""
    found = []
    for pid in subprocess.run(
        ["pgrep", "-f", "sha256sum /data"], capture_output=True, text=True
    ).stdout.split():
        try:
            lines = Path(f"/proc/{pid}/mountinfo").read_text().splitlines()
        except OSError:
            continue
        found += [f"{pid}: {line}" for line in lines if f" {path}" in line]
    return "\n".join(found) or "(no reader container found)"


def staged_volumes(world: World) -> dict[str, Any]:
    return world.plugin.staged()


def stats_of(staging_path: str) -> dict[str, Any]:
    return json.loads(os.getxattr(staging_path, "user.pffs.stats"))


def gets(staging_path: str) -> int:
    return int(stats_of(staging_path)["backend_requests"]["get"]["requests"])


def delete_pods(world: World, *names: str) -> None:
    from kubernetes.client.exceptions import ApiException

    for name in names:
        try:
            world.core.delete_namespaced_pod(name, "default", grace_period_seconds=1)
        except ApiException as exc:
            if exc.status != 404:
                raise

    def gone() -> bool:
        remaining = {p.metadata.name for p in world.core.list_namespaced_pod("default").items}
        return not remaining & set(names)

    poll("the pods are gone", gone, timeout_s=120, logs=world.logs)


def assert_nothing_mounted_or_running(world: World) -> None:
    poll("the plugin unstages everything", lambda: not staged_volumes(world), timeout_s=60, logs=world.logs)
    mounts = Path("/proc/self/mountinfo").read_text()
    assert "fuse.pffs" not in mounts, [line for line in mounts.splitlines() if "fuse.pffs" in line]
    leftover = subprocess.run(
        ["pgrep", "-f", "^pffs mount|pffs.cli.mount_daemon"], capture_output=True, text=True
    ).stdout
    assert not leftover.strip(), f"mount processes still running: {leftover}"


def test_pods_with_an_inline_volume_read_exact_bytes_share_one_mount_and_survive_a_mount_crash(
    world: World, raw_s3: Any, bucket: str
) -> None:
    from kubernetes import client

    data = os.urandom(2 * BLOCK + 12345)
    raw_s3.pipe_file(f"{bucket}/imagenet/train/shard-0", data)
    expected = sha256(data)
    world.core.create_namespaced_secret(
        "default",
        client.V1Secret(
            metadata=client.V1ObjectMeta(name=f"s3-{bucket}"),
            string_data={"accessKeyId": world.s3.access_key, "secretAccessKey": world.s3.secret_key},
        ),
    )
    volume = {
        "csi": {
            "driver": "csi.pffs.io",
            "readOnly": True,
            "volumeAttributes": {"source": f"s3://{bucket}/imagenet", "endpointUrl": world.s3.endpoint_url},
            "nodePublishSecretRef": {"name": f"s3-{bucket}"},
        }
    }
    world.core.create_namespaced_pod("default", reader_pod("inline-1", volume, "train/shard-0"))
    assert poll(
        "inline-1 prints the dataset's sha256",
        lambda: expected in printed_hashes(world, "inline-1"),
        logs=world.logs,
    )
    assert (
        world.core.read_namespaced_pod("inline-1", "default").spec.node_name == NODE
    )  # pffs scheduler bound it
    world.core.create_namespaced_pod("default", reader_pod("inline-2", volume, "train/shard-0"))
    poll(
        "inline-2 prints the dataset's sha256",
        lambda: expected in printed_hashes(world, "inline-2"),
        logs=world.logs,
    )

    # One mount for both pods (one staged record with two targets), one GET per block.
    [(staging_path, record)] = staged_volumes(world).items()
    assert record["inline_key"] and len(record["targets"]) == 2
    assert gets(staging_path) <= 3, stats_of(staging_path)

    # kill -9 of the mount: the pods read again without a restart.
    lines_before = len(printed_hashes(world, "inline-1"))
    os.kill(record["pid"], signal.SIGKILL)
    killed = time.monotonic()
    poll(
        "the mount is back",
        lambda: staged_volumes(world)[staging_path]["pid"] != record["pid"],
        timeout_s=30,
        logs=world.logs,
    )

    def read_again(pod: str) -> bool:
        after = printed_hashes(world, pod)[lines_before:]
        return bool(after) and after[-1] == expected

    poll(
        "inline-1 reads again after the mount was killed",
        lambda: read_again("inline-1"),
        timeout_s=30,
        logs=lambda: f"{printed_hashes(world, 'inline-1')[-5:]}\n{container_mounts('/data')}\n{world.logs()}",
    )
    print(f"\npods read again {time.monotonic() - killed:.1f} s after kill -9 of the mount process")
    for pod in ("inline-1", "inline-2"):
        status = world.core.read_namespaced_pod(pod, "default").status
        assert status.phase == "Running" and status.container_statuses[0].restart_count == 0

    delete_pods(world, "inline-1", "inline-2")
    assert_nothing_mounted_or_running(world)


def test_a_pvc_of_a_pffs_storage_class_is_provisioned_bound_staged_once_and_read_exactly(
    world: World, raw_s3: Any, bucket: str
) -> None:
    from kubernetes import client

    world.core.create_namespaced_secret(
        "default",
        client.V1Secret(
            metadata=client.V1ObjectMeta(name=f"pvc-s3-{bucket}"),
            string_data={"accessKeyId": world.s3.access_key, "secretAccessKey": world.s3.secret_key},
        ),
    )
    storage = client.StorageV1Api(world.cluster.api())
    secret = {"name": f"pvc-s3-{bucket}", "namespace": "default"}
    storage.create_storage_class(
        {
            "apiVersion": "storage.k8s.io/v1",
            "kind": "StorageClass",
            "metadata": {"name": f"pffs-{bucket}"},
            "provisioner": "csi.pffs.io",
            # Immediate: pffs scheduler binds pods itself and does not take part in delayed volume binding.
            "volumeBindingMode": "Immediate",
            "parameters": {
                "source": f"s3://{bucket}/volumes",
                "endpointUrl": world.s3.endpoint_url,
                "onDelete": "delete",
                "csi.storage.k8s.io/provisioner-secret-name": secret["name"],
                "csi.storage.k8s.io/provisioner-secret-namespace": secret["namespace"],
                "csi.storage.k8s.io/node-stage-secret-name": secret["name"],
                "csi.storage.k8s.io/node-stage-secret-namespace": secret["namespace"],
            },
        }
    )
    world.core.create_namespaced_persistent_volume_claim(
        "default",
        {
            "metadata": {"name": "scratch"},
            "spec": {
                "accessModes": ["ReadWriteMany"],
                "storageClassName": f"pffs-{bucket}",
                "resources": {"requests": {"storage": "1Gi"}},
            },
        },
    )

    def bound_volume() -> str | None:
        claim = world.core.read_namespaced_persistent_volume_claim("scratch", "default")
        return claim.spec.volume_name if claim.status.phase == "Bound" else None

    pv_name = poll("the PVC is provisioned and bound", bound_volume, logs=world.logs)
    handle = world.core.read_persistent_volume(pv_name).spec.csi.volume_handle
    volume_url = handle.split("#")[0]
    assert volume_url == f"s3://{bucket}/volumes/{pv_name}"
    data = os.urandom(BLOCK + 777)
    raw_s3.pipe_file(f"{volume_url.removeprefix('s3://')}/part-0", data)

    volume = {"persistentVolumeClaim": {"claimName": "scratch", "readOnly": True}}
    world.core.create_namespaced_pod("default", reader_pod("pvc-1", volume, "part-0"))
    world.core.create_namespaced_pod("default", reader_pod("pvc-2", volume, "part-0"))
    for pod in ("pvc-1", "pvc-2"):
        poll(
            f"{pod} prints the file's sha256",
            lambda pod=pod: sha256(data) in printed_hashes(world, pod),
            logs=world.logs,
        )
    [(staging_path, record)] = staged_volumes(world).items()
    assert record["volume_id"] == handle and len(record["targets"]) == 2 and not record["inline_key"]
    assert gets(staging_path) <= 2, stats_of(staging_path)

    delete_pods(world, "pvc-1", "pvc-2")
    assert_nothing_mounted_or_running(world)
    world.core.delete_namespaced_persistent_volume_claim("scratch", "default")

    def files_left() -> list[str]:
        found = raw_s3.find(volume_url.removeprefix("s3://"), detail=True, refresh=True)
        return [path for path, info in found.items() if info["type"] != "directory"]  # folders stay here

    poll(
        "DeleteVolume removes the volume's objects (onDelete: delete)",
        lambda: not files_left(),
        logs=world.logs,
    )
