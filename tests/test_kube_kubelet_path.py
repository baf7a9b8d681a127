"""A wrong `node.kubeletPath`, on a real node with `helm` itself (install, upgrade, rollback), as an operator
would make the mistake: the chart as shipped, only what this machine forces overridden (test_kube_shipped's
values).

- A fresh `helm install --wait` with a kubelet path that is not the kubelet's fails, and what Helm prints
  names node.kubeletPath and the path the kubelet really uses (the chart's preflight hook).
- With a pod reading a file it holds open: `helm upgrade --wait` to a wrong path fails the same way and
  changes nothing; forced past the hook (`--no-hooks`, as `helm template | kubectl apply` would), the new
  node plugin is never Ready, says why in its readiness probe's Event, and leaves every mount alone;
  `helm rollback` brings registration back. The pod reads throughout: 0 failed reads.
- Then the mounter's replacement, planned with `pffs csi-pods`: the pod with HostToContainer gets
  PffsMountRepaired and reads again; one without gets PffsMountRepairNotSeen (and fails, as it says).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import s3fs
import yaml
from helpers import poll, require, sha256
from test_kube_shipped import (
    CHART,
    NAMESPACE,
    NODE,
    TOOLS_BIN,
    apply,
    csinode_has_driver,
    daemonset_pods,
    last_report,
    missing_tools,
    reader_pod,
    shipped_values,
)

from pffs.testing.kube_node import KubeNode, NodeControlPlane
from pffs.testing.s3_server import SeaweedS3

REPO = Path(__file__).resolve().parent.parent
RELEASE = "pffs-csi"
READER_POD = "held-reader"
BLIND_POD = "reader-without-propagation"  # mounts its volume without mountPropagation: HostToContainer

pytestmark = [pytest.mark.kube, pytest.mark.s3, pytest.mark.timeout(900)]


@dataclass
class Cluster:
    cluster: NodeControlPlane
    node: KubeNode
    s3: SeaweedS3
    core: Any
    apps: Any
    dynamic: Any
    root: Path
    values: Path
    wrong: Path  # a kubelet path that is not the kubelet's, on a shared mount (as /var/lib on systemd hosts)
    source: str
    expected: str

    def helm(self, *args: str, check: bool = False) -> subprocess.CompletedProcess[str]:
        env = {
            **os.environ,
            "KUBECONFIG": str(self.cluster.kubeconfig),
            "HELM_CACHE_HOME": str(self.root / "helm" / "cache"),
            "HELM_CONFIG_HOME": str(self.root / "helm" / "config"),
            "HELM_DATA_HOME": str(self.root / "helm" / "data"),
        }
        command = [str(TOOLS_BIN / "helm"), *args, "-n", NAMESPACE]
        answer = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600, check=False)
        if check and answer.returncode != 0:
            raise AssertionError(f"{' '.join(args)} failed:\n{answer.stderr}\n{self.logs()}")
        return answer

    def logs(self) -> str:
        parts = [f"--- kubelet\n{self.node.log('kubelet')[-3000:]}"]
        for pod in self.core.list_namespaced_pod(NAMESPACE).items:
            for container in pod.spec.containers:
                try:
                    text = self.core.read_namespaced_pod_log(
                        pod.metadata.name, NAMESPACE, container=container.name, tail_lines=40
                    )
                except Exception as exc:
                    text = f"(no log: {exc})"
                parts.append(f"--- {pod.metadata.name}/{container.name}\n{text}")
        return "\n".join(parts)


@contextlib.contextmanager
def shared_mount(path: Path) -> Iterator[Path]:
    """A folder that is a shared mount of itself: a hostPath there with Bidirectional propagation starts
    (containerd refuses one on a private mount), as a wrong path under /var/lib does on a systemd host."""
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "--bind", str(path), str(path)], check=True)
    try:
        subprocess.run(["mount", "--make-shared", str(path)], check=True)
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.fixture(scope="module")
def cluster(s3_server: SeaweedS3, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    require(missing_tools(), "the kubelet-path test")
    from kubernetes import client, dynamic

    from pffs.testing.csi_image import csi_image_archives

    archives = csi_image_archives()
    root = tmp_path_factory.mktemp("kubelet-path")
    payload = os.urandom(3 << 20)
    raw = s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False, **s3_server.storage_options())
    bucket = f"pffs-kubelet-path-{uuid.uuid4().hex[:8]}"
    raw.mkdir(bucket)
    raw.pipe(f"{bucket}/data/file.bin", payload)
    with (
        NodeControlPlane(root / "cp", node_names=[NODE], workloads=True) as control_plane,
        KubeNode(root / "node", control_plane, NODE) as node,
        shared_mount(root / "wrong-kubelet") as wrong,
    ):
        for archive in archives:
            node.ctr("images", "import", str(archive), timeout=300)
        values = root / "values.yaml"
        values.write_text(shipped_values(node, control_plane, root))
        api = control_plane.api()
        world = Cluster(
            control_plane,
            node,
            s3_server,
            client.CoreV1Api(api),
            client.AppsV1Api(api),
            dynamic.DynamicClient(api),
            root,
            values,
            wrong,
            f"s3://{bucket}/data",
            sha256(payload),
        )
        apply(world.dynamic, yaml.safe_load((REPO / "deploy/csi/namespace.yaml").read_text()))
        try:
            yield world
        finally:
            for name in (READER_POD, BLIND_POD):
                with contextlib.suppress(Exception):
                    world.core.delete_namespaced_pod(name, "default", grace_period_seconds=1)
            with contextlib.suppress(Exception):
                poll("the reader is gone", lambda: not reader_exists(world), 60)
                poll("its volume unpublished", lambda: not pffs_mounts(world), 60)
            world.helm("uninstall", RELEASE, "--wait", "--timeout", "1m")


def reader_exists(world: Cluster) -> bool:
    names = {p.metadata.name for p in world.core.list_namespaced_pod("default").items}
    return bool(names & {READER_POD, BLIND_POD})


def pffs_mounts(world: Cluster) -> list[str]:
    lines = Path("/proc/self/mountinfo").read_text().splitlines()
    return [line for line in lines if "fuse.pffs" in line and str(world.root) in line]


def plugin_ready(world: Cluster) -> bool:
    pods = daemonset_pods(world, "pffs-csi-node")
    return len(pods) == 1 and any(
        c.type == "Ready" and c.status == "True" for c in pods[0].status.conditions or []
    )


def test_a_fresh_install_with_a_wrong_kubelet_path_fails_naming_the_value_and_the_real_path(
    cluster: Cluster,
) -> None:
    wrong = "/var/lib/kubelet-of-another-distribution"
    started = time.monotonic()
    answer = cluster.helm(
        "install", RELEASE, str(CHART), "-f", str(cluster.values), "--set", f"node.kubeletPath={wrong}",
        "--wait", "--timeout", "3m",
    )  # fmt: skip
    took = time.monotonic() - started
    assert answer.returncode != 0, answer.stdout
    assert f"node.kubeletPath is {wrong}, but no kubelet serves there" in answer.stderr, answer.stderr
    assert f"the kubelet on this node uses {cluster.node.kubelet_root}" in answer.stderr, answer.stderr
    assert f"set node.kubeletPath={cluster.node.kubelet_root}" in answer.stderr, answer.stderr
    assert "from the sockets it listens on" in answer.stderr, "the pod-resources socket was not found"
    # Nothing of the chart was made: no plugin anywhere looks for the kubelet in the wrong place.
    assert not cluster.apps.list_namespaced_daemon_set(NAMESPACE).items
    print(f"install with a wrong node.kubeletPath: failed in {took:.1f} s, saying:\n{answer.stderr.strip()}")
    cluster.helm("uninstall", RELEASE, check=True)  # the failed release's record


def test_an_upgrade_to_a_wrong_kubelet_path_and_a_rollback_cost_a_pod_holding_a_file_nothing(
    cluster: Cluster,
) -> None:
    world = cluster
    started = time.monotonic()
    world.helm(
        "install", RELEASE, str(CHART), "-f", str(world.values), "--wait", "--timeout", "5m", check=True
    )
    poll("the kubelet registers csi.pffs.io", lambda: csinode_has_driver(world), 60, world.logs)
    print(f"helm install --wait (preflight hook included): {time.monotonic() - started:.1f} s")
    start_reader(world)
    listed = pffs_csi_pods(world, "--json")
    rows = [(r["node"], r["pod"], r["kind"], r["read_only"], r["sees_repair"]) for r in json.loads(listed)]
    assert rows == [(NODE, READER_POD, "inline", True, True)], listed
    print(f"pffs csi-pods:\n{pffs_csi_pods(world)}")
    plugin_uid = daemonset_pods(world, "pffs-csi-node")[0].metadata.uid

    # 1. The upgrade: the preflight hook stops it before anything changes.
    answer = world.helm(
        "upgrade", RELEASE, str(CHART), "--reuse-values", "--set", f"node.kubeletPath={world.wrong}",
        "--wait", "--timeout", "3m",
    )  # fmt: skip
    assert answer.returncode != 0
    assert f"node.kubeletPath is {world.wrong}, but no kubelet serves there" in answer.stderr, answer.stderr
    assert f"uses {world.node.kubelet_root}" in answer.stderr, answer.stderr
    assert daemonset_pods(world, "pffs-csi-node")[0].metadata.uid == plugin_uid
    reads_on(world, "the refused upgrade")

    # 2. Forced past the hook: the new plugin is never Ready, says why, and leaves the mounts alone. (Helm
    # 3's --wait would pass here: it lets a DaemonSet have maxUnavailable pods unready, 1 of 1 on this
    # node; `kubectl rollout status` would not. The hook is what stops Helm.)
    before = last_report(world, READER_POD) or {}
    answer = world.helm(
        "upgrade", RELEASE, str(CHART), "--reuse-values", "--set", f"node.kubeletPath={world.wrong}",
        "--no-hooks",
    )  # fmt: skip
    assert answer.returncode == 0, answer.stderr
    pod = poll(
        "the new node plugin's pod",
        lambda: next(
            (p for p in daemonset_pods(world, "pffs-csi-node") if p.metadata.uid != plugin_uid), None
        ),
        60,
        world.logs,
    )
    message = poll(
        "the readiness probe's Event", lambda: probe_message(world, pod.metadata.name), 60, world.logs
    )
    pods = daemonset_pods(world, "pffs-csi-node")
    assert [p.metadata.uid for p in pods] == [pod.metadata.uid] and not plugin_ready(world)
    assert world.apps.read_namespaced_daemon_set("pffs-csi-node", NAMESPACE).status.number_ready == 0
    assert f"node.kubeletPath is {world.wrong}" in message and str(world.node.kubelet_root) in message, (
        message
    )
    reads_on(world, "the upgrade to a wrong kubelet path")
    assert (last_report(world, READER_POD) or {}).get("held_ok", 0) > before.get("held_ok", 0)
    log = world.core.read_namespaced_pod_log(pod.metadata.name, NAMESPACE, container="pffs-csi")
    assert "mounting it again" not in log and "moves from" not in log, log

    # 3. The rollback: registered again, Ready, and the pod never noticed.
    started = time.monotonic()
    world.helm("rollback", RELEASE, "1", "--wait", "--timeout", "3m", check=True)
    poll("the kubelet registers csi.pffs.io again", lambda: csinode_has_driver(world), 60, world.logs)
    poll("the node plugin Ready", lambda: plugin_ready(world), 60, world.logs)
    print(f"helm rollback --wait to registered: {time.monotonic() - started:.1f} s")
    report = reads_on(world, "the rollback")
    print(f"held-file reader through upgrade to a wrong path and rollback: {report}")


def test_a_mounter_replaced_tells_each_pod_whether_it_sees_the_repair(cluster: Cluster) -> None:
    """The one operation that ends mounts, planned with `pffs csi-pods`: it says which pod would read on
    and which must be restarted; after the mounter's pod is replaced, the first gets PffsMountRepaired and
    reads files it opens anew, the other gets PffsMountRepairNotSeen (what to change) and no
    PffsMountRepaired."""
    world = cluster
    if not reader_exists(world):
        pytest.skip("needs the installed release and reader of the test before")
    inline = {
        "csi": {
            "driver": "csi.pffs.io",
            "readOnly": True,
            "volumeAttributes": {"source": world.source, "endpointUrl": world.s3.endpoint_url},
            "nodePublishSecretRef": {"name": "pffs-s3-credentials"},
        }
    }
    blind = reader_pod(BLIND_POD, inline, False, world.expected)
    del blind["spec"]["containers"][0]["volumeMounts"][0]["mountPropagation"]
    apply(world.dynamic, blind)
    poll("the second reader reads", lambda: (last_report(world, BLIND_POD) or {}).get("reopen_ok"), 120)
    rows = {r["pod"]: r for r in json.loads(pffs_csi_pods(world, "--json"))}
    assert rows[READER_POD]["sees_repair"] and not rows[BLIND_POD]["sees_repair"]
    assert rows[BLIND_POD]["containers_without_propagation"] == ["reader"]
    table = pffs_csi_pods(world, "--node", NODE)
    assert "restart the pod (reader: no HostToContainer)" in table, table
    print(f"pffs csi-pods before the mounter's replacement:\n{table}")

    old = daemonset_pods(world, "pffs-csi-mounter")[0]
    before = last_report(world, READER_POD) or {}
    world.core.delete_namespaced_pod(old.metadata.name, NAMESPACE)
    poll(
        "the reader with HostToContainer reads files it opens anew again",
        lambda: (
            (last_report(world, READER_POD) or {}).get("reopen_ok", 0) > before.get("reopen_ok", 0) + 3
            and (last_report(world, READER_POD) or {}).get("reopen_fail", 0) > 0
        ),
        120,
        world.logs,
    )

    def reasons(pod: str) -> list[str]:
        events = world.core.list_namespaced_event("default", field_selector=f"involvedObject.name={pod}")
        return [e.reason for e in events.items]

    poll("PffsMountRepaired on the reader", lambda: "PffsMountRepaired" in reasons(READER_POD), 60)
    poll("PffsMountRepairNotSeen on the other", lambda: "PffsMountRepairNotSeen" in reasons(BLIND_POD), 60)
    assert "PffsMountRepaired" not in reasons(BLIND_POD)
    events = world.core.list_namespaced_event("default", field_selector=f"involvedObject.name={BLIND_POD}")
    message = next(e.message for e in events.items if e.reason == "PffsMountRepairNotSeen")
    assert "add mountPropagation: HostToContainer" in message and "container(s) reader" in message, message
    print(f"PffsMountRepairNotSeen: {message}")
    # What it says is so: that pod's files opened anew fail while the other's read.
    failed = (last_report(world, BLIND_POD) or {}).get("reopen_fail", 0)
    poll(
        "the pod without HostToContainer fails on",
        lambda: (last_report(world, BLIND_POD) or {}).get("reopen_fail", 0) > failed,
        30,
    )
    # On the host, the target of the pod that cannot see the repair holds one mount, the live one (the
    # dead one is gone, not stacked under it); the other's live one is on top, over the dead one that
    # its container's copy receives it through.
    blind_target = target_of(world, BLIND_POD)
    assert len(mounts_at(blind_target)) == 1, mounts_at(blind_target)
    assert os.listdir(blind_target), f"{blind_target} does not show the volume"
    stacked = mounts_at(target_of(world, READER_POD))
    print(f"mounts at the targets after the repair: {len(stacked)} (HostToContainer), 1 (without)")
    assert len(stacked) >= 2


def target_of(world: Cluster, pod: str) -> str:
    """The kubelet's target path of the pod's one pffs volume."""
    uid = world.core.read_namespaced_pod(pod, "default").metadata.uid
    (target,) = (world.node.kubelet_root / "pods" / uid / "volumes" / "kubernetes.io~csi").glob("*/mount")
    return str(target)


def mounts_at(path: str) -> list[str]:
    """The mountinfo lines of the mounts stacked at `path`, bottom first."""
    with open("/proc/self/mountinfo") as table:
        return [line for line in table if line.split()[4] == path]


def pffs_csi_pods(world: Cluster, *args: str) -> str:
    command = [
        sys.executable,
        "-m",
        "pffs.cli.main",
        "csi-pods",
        "--kubeconfig",
        str(world.cluster.kubeconfig),
    ]
    answer = subprocess.run([*command, *args], capture_output=True, text=True, timeout=60, check=False)
    assert answer.returncode == 0, answer.stderr
    return answer.stdout


def start_reader(world: Cluster) -> None:
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "pffs-s3-credentials", "namespace": "default"},
        "stringData": {"accessKeyId": world.s3.access_key, "secretAccessKey": world.s3.secret_key},
    }
    apply(world.dynamic, secret)
    inline = {
        "csi": {
            "driver": "csi.pffs.io",
            "readOnly": True,
            "volumeAttributes": {"source": world.source, "endpointUrl": world.s3.endpoint_url},
            "nodePublishSecretRef": {"name": "pffs-s3-credentials"},
        }
    }
    apply(world.dynamic, reader_pod(READER_POD, inline, False, world.expected))
    poll(
        "the reader reads its file",
        lambda: (last_report(world, READER_POD) or {}).get("reopen_ok"),
        120,
        world.logs,
    )


def reads_on(world: Cluster, after: str) -> dict[str, Any]:
    """The reader has read its held file and a reopened one a few times more since now, and no read of
    either ever failed."""
    before = last_report(world, READER_POD) or {}
    poll(
        f"the reader reads on after {after}",
        lambda: (last_report(world, READER_POD) or {}).get("held_ok", 0) > before.get("held_ok", 0) + 3,
        60,
        world.logs,
    )
    report = last_report(world, READER_POD)
    assert report is not None
    assert report["held_fail"] == 0 and report["reopen_fail"] == 0, (after, report)
    return report


def probe_message(world: Cluster, pod: str) -> str:
    events = world.core.list_namespaced_event(NAMESPACE, field_selector=f"involvedObject.name={pod}").items
    said = [e.message for e in events if e.reason == "Unhealthy" and "Readiness" in e.message]
    return next((m for m in said if "node.kubeletPath" in m), "")  # not "starting", before the check
