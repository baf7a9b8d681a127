"""A real one-node Kubernetes cluster on loopback (pffs.testing.kube_node): Debian's containerd and kubelet
v1.37.2 registered with the control plane of pffs.testing.kube_cluster, signing in as system:node:NAME.
The Node becomes Ready, runs a hostNetwork pod of the registry-less test image to completion (its log read
through the API server, which fetches it from the kubelet), stops a running pod's container when the pod is
deleted, lets a privileged pod's Bidirectional mount reach the host (as a CSI node plugin needs), and leaves
no process, mount, cgroup, host folder or kernel setting behind.

Marked `kube`: skipped, saying what is missing, unless PFFS_REQUIRE_SERVERS=1 (then a failure).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import poll, require

from pffs.testing.kube_cluster import missing_binaries
from pffs.testing.kube_node import KERNEL_SETTINGS, KubeNode, NodeControlPlane, missing_node_binaries
from pffs.testing.oci_image import BUSYBOX_IMAGE, TEST_CONTENT, TEST_FILE

NODE = "pffs-node-1"

pytestmark = [pytest.mark.kube, pytest.mark.timeout(300)]


def require_node() -> None:
    require(missing_binaries() + missing_node_binaries(), "a real node")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeControlPlane]:
    require_node()
    with NodeControlPlane(tmp_path_factory.mktemp("kube"), node_names=[NODE]) as control_plane:
        yield control_plane


@pytest.fixture(scope="module")
def node(cluster: NodeControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeNode]:
    with KubeNode(tmp_path_factory.mktemp("node"), cluster, NODE) as kube_node:
        yield kube_node
    assert_nothing_left(kube_node)


def assert_nothing_left(node: KubeNode) -> None:
    assert node.leftover_processes() == []
    assert node.leftover_mounts() == []
    assert node.leftover_paths() == []
    ours = [
        line
        for line in _all_processes()
        if str(node.workdir) in line or str(node.socket) in line or str(node.runc_root) in line
    ]
    assert ours == []


def _all_processes() -> list[str]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                found.append(Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode())
    return found


def kernel_settings() -> dict[str, str]:
    return {key: (Path("/proc/sys") / key).read_text() for key in KERNEL_SETTINGS}


def pod_manifest(name: str, script: str, node_name: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "hostNetwork": True,
        "dnsPolicy": "Default",
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": 10,
        "containers": [
            {
                "name": "main",
                "image": BUSYBOX_IMAGE,
                "imagePullPolicy": "Never",
                "command": ["/bin/sh", "-c", script],
            }
        ],
    }
    if node_name is not None:
        spec["nodeName"] = node_name
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def phase(core: Any, name: str) -> str | None:
    from kubernetes.client.exceptions import ApiException

    try:
        return str(core.read_namespaced_pod(name, "default").status.phase)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


# First, before the module's node starts (one node per machine at a time): a node of its own, stopped with a
# pod running.


def pod_log(core: Any, name: str) -> str:
    """The pod's log through the API server (from the kubelet), "" while its container has not started."""
    from kubernetes.client.exceptions import ApiException

    try:
        return str(core.read_namespaced_pod_log(name, "default"))
    except ApiException as exc:
        if exc.status == 400:  # container "main" in pod ... is waiting to start / is not available
            return ""
        raise


def test_a_node_stopped_with_a_pod_running_leaves_no_process_mount_cgroup_or_folder(
    cluster: NodeControlPlane, tmp_path: Path
) -> None:
    from kubernetes import client

    before = kernel_settings()
    with KubeNode(tmp_path / "node", cluster, NODE) as kube_node:
        core = client.CoreV1Api(kube_node.api())
        name = f"left-running-{uuid.uuid4().hex[:6]}"
        core.create_namespaced_pod("default", pod_manifest(name, "sleep 3600", node_name=NODE))
        poll(f"pod {name} to run", lambda: phase(core, name) == "Running", logs=kube_node.logs)
        assert kube_node.leftover_mounts(), "a running pod has mounts (its rootfs, the kubelet's root)"
        assert [p for p in kube_node.leftover_processes() if "sleep 3600" in p]
        assert kube_node.leftover_paths(), "the kubelet made its kubepods cgroups"
    assert_nothing_left(kube_node)
    assert kernel_settings() == before
    # The Node and its pods are gone from the API too: the next node registers afresh.
    assert [n.metadata.name for n in core.list_node().items] == []
    assert core.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={NODE}").items == []


def test_the_node_registers_ready_untainted_as_system_node(node: KubeNode) -> None:
    from kubernetes import client

    found = client.CoreV1Api(node.api()).read_node(NODE)
    conditions = {c.type: c.status for c in found.status.conditions}
    assert conditions["Ready"] == "True", conditions
    assert not found.spec.taints
    assert [(a.type, a.address) for a in found.status.addresses] == [("InternalIP", "127.0.0.1")]
    assert found.status.node_info.kubelet_version == "v1.37.2"
    assert found.status.node_info.container_runtime_version.startswith("containerd://1.")
    # Its Lease was renewed by the kubelet in person (the Node authorizer let it, as system:node:NAME).
    coordination = client.CoordinationV1Api(node.api())

    def lease() -> Any:
        found = coordination.list_namespaced_lease("kube-node-lease").items
        return [item for item in found if item.metadata.name == NODE]

    assert poll("the node's Lease", lease, 20, node.logs)[0].spec.holder_identity == NODE
    assert "system:node:" + NODE in (node.workdir / "kubelet.kubeconfig").read_text()


def test_a_scheduled_pod_runs_to_completion_and_its_log_comes_through_the_api(node: KubeNode) -> None:
    from kubernetes import client

    core = client.CoreV1Api(node.api())
    name = f"hello-{uuid.uuid4().hex[:6]}"
    # No nodeName: kube-scheduler places it on the one Ready, untainted node.
    core.create_namespaced_pod("default", pod_manifest(name, f"echo hello; sha256sum {TEST_FILE}"))
    try:
        final = poll(
            f"pod {name} to finish", lambda: phase(core, name) in ("Succeeded", "Failed"), logs=node.logs
        )
        pod = core.read_namespaced_pod(name, "default")
        log = core.read_namespaced_pod_log(name, "default", container="main")
        assert final and pod.status.phase == "Succeeded", (pod.status, log, node.logs())
        assert pod.spec.node_name == NODE
        assert log == f"hello\n{hashlib.sha256(TEST_CONTENT).hexdigest()}  {TEST_FILE}\n"
        assert pod.status.container_statuses[0].state.terminated.exit_code == 0
    finally:
        core.delete_namespaced_pod(name, "default", grace_period_seconds=0)


def test_deleting_a_running_pod_stops_its_container(node: KubeNode) -> None:
    from kubernetes import client

    core = client.CoreV1Api(node.api())
    name = f"sleeper-{uuid.uuid4().hex[:6]}"
    # sh as PID 1 ignores SIGTERM without a trap: with one, it ends as soon as it is asked to.
    script = "trap 'exit 0' TERM; echo started; sleep 3600 & wait"
    core.create_namespaced_pod("default", pod_manifest(name, script, node_name=NODE))

    def running_container() -> str | None:
        pod = core.read_namespaced_pod(name, "default")
        statuses = pod.status.container_statuses or []
        if statuses and statuses[0].state.running and statuses[0].container_id:
            return str(statuses[0].container_id).removeprefix("containerd://")
        return None

    container_id = poll(f"pod {name} to run", running_container, logs=node.logs)
    poll("its log", lambda: "started" in pod_log(core, name), 20, node.logs)
    tasks = node.ctr("tasks", "ls")
    assert any(line.split()[:1] == [container_id] and "RUNNING" in line for line in tasks.splitlines())
    pid = next(int(line.split()[1]) for line in tasks.splitlines() if line.split()[:1] == [container_id])
    assert Path(f"/proc/{pid}").exists()

    started = time.monotonic()
    core.delete_namespaced_pod(name, "default")  # graceful: SIGTERM, then the kubelet confirms the delete
    poll(f"pod {name} to be gone", lambda: phase(core, name) is None, 40, node.logs)
    # Well within the grace period (10 s, then SIGKILL): the container got SIGTERM and its trap ended it.
    assert time.monotonic() - started < 8
    assert not any(
        line.split()[:1] == [container_id] and "RUNNING" in line
        for line in node.ctr("tasks", "ls").splitlines()
    )
    poll(f"process {pid} to end", lambda: not Path(f"/proc/{pid}").exists(), 10, node.logs)


def test_a_privileged_pods_bidirectional_mount_reaches_the_host(node: KubeNode) -> None:
    """What a CSI node plugin relies on: a mount made inside the container, under a hostPath in the kubelet's
    (shared) root folder, is seen on the host; KubeNode unmounts it at exit if nobody else does."""
    from kubernetes import client

    core = client.CoreV1Api(node.api())
    name = f"mounter-{uuid.uuid4().hex[:6]}"
    shared = node.kubelet_root / "pffs-test-shared"
    manifest = pod_manifest(
        name,
        "mkdir -p /host/inner && mount -t tmpfs tmpfs /host/inner && echo from-pod > /host/inner/f"
        " && echo mounted && sleep 3600",
        node_name=NODE,
    )
    container = manifest["spec"]["containers"][0]
    container["securityContext"] = {"privileged": True}
    container["volumeMounts"] = [{"name": "host", "mountPath": "/host", "mountPropagation": "Bidirectional"}]
    manifest["spec"]["volumes"] = [
        {"name": "host", "hostPath": {"path": str(shared), "type": "DirectoryOrCreate"}}
    ]
    core.create_namespaced_pod("default", manifest)
    try:
        poll("the pod's mount", lambda: "mounted" in pod_log(core, name), logs=node.logs)
        assert os.path.ismount(shared / "inner")
        assert (shared / "inner" / "f").read_text() == "from-pod\n"
    finally:
        core.delete_namespaced_pod(name, "default", grace_period_seconds=0)
