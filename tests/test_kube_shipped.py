"""The CSI driver as shipped, on a real node: the Helm chart's objects (deploy/helm/pffs-csi) applied to a
real control plane and kubelet, with the images made here (pffs.testing.csi_image) imported into the node's
containerd, and only what this machine forces overridden (the values file below: the kubelet's root dir is
a test folder, pods use the host's network as there is no CNI, and the API server's address is given as
there is no kube-proxy).

Three pods read one object of the dataset in a loop, each through one kind of read-only volume (a static PV
with `readOnly`, an inline volume with `readOnly`, a dynamically provisioned PVC mounted `readOnly` in the
container): each pass reads the file through a descriptor opened once (its page cache dropped, so the read
reaches the mount) and through one opened anew, checks the sha256, and tries to write. The node plugin is
then restarted, upgraded to a new image tag, rolled back and deleted: through all of it, no read fails, no
write succeeds, every target is one read-only pffs mount on the host, and nothing reaches the bucket.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import s3fs
import yaml
from helpers import poll, require, sha256

from pffs.testing.kube_node import KubeNode, NodeControlPlane, missing_node_binaries
from pffs.testing.s3_server import SeaweedS3

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "deploy/helm/pffs-csi"
TOOLS_BIN = Path(os.environ.get("PFFS_TOOLS_BIN") or Path.home() / ".cache/pffs-tools/bin")
NODE = "pffs-shipped-node"
NAMESPACE = "pffs-system"
IMAGE = "pffs/csi"
TAG, NEXT_TAG = "0.1.0", "0.1.0-next"
FILE_SIZE = 3 << 20

pytestmark = [pytest.mark.kube, pytest.mark.s3, pytest.mark.timeout(900)]

# Runs in each reader pod (the pffs image has python3): one JSON line of running totals per pass.
READER = r"""
import errno, hashlib, json, os, sys, time
path, expected, name = sys.argv[1:4]
held = os.open(path, os.O_RDONLY)
stats = {"held_ok": 0, "held_fail": 0, "reopen_ok": 0, "reopen_fail": 0, "held_gap": 0.0,
         "reopen_gap": 0.0, "writes_ok": 0, "write_errors": {}, "last_error": ""}
last = {"held": time.monotonic(), "reopen": time.monotonic()}

def whole(fd):
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # so the read reaches the mount
    digest, offset = hashlib.sha256(), 0
    while chunk := os.pread(fd, 1 << 20, offset):
        digest.update(chunk)
        offset += len(chunk)
    return digest.hexdigest()

def reopened():
    fd = os.open(path, os.O_RDONLY)
    try:
        return whole(fd)
    finally:
        os.close(fd)

def attempt(kind, read):
    try:
        if read() != expected:
            raise ValueError("wrong bytes")
    except Exception as exc:
        stats[kind + "_fail"] += 1
        stats["last_error"] = f"{kind}: {exc!r}"
        return
    now = time.monotonic()
    stats[kind + "_gap"] = round(max(stats[kind + "_gap"], now - last[kind]), 3)
    last[kind] = now
    stats[kind + "_ok"] += 1

while True:
    attempt("held", lambda: whole(held))
    attempt("reopen", reopened)
    try:
        with open(os.path.join(os.path.dirname(path), ".probe-" + name), "w") as probe:
            probe.write("x")
        stats["writes_ok"] += 1
    except OSError as exc:
        code = errno.errorcode.get(exc.errno, str(exc.errno))
        stats["write_errors"][code] = stats["write_errors"].get(code, 0) + 1
    print(json.dumps(stats), flush=True)
    time.sleep(0.1)
"""


@dataclass
class Shipped:
    cluster: NodeControlPlane
    node: KubeNode
    s3: SeaweedS3
    raw: Any  # s3fs on the server, to put and list objects past pffs
    bucket: str
    core: Any
    apps: Any
    dynamic: Any
    root: Path
    values: Path
    objects: list[dict[str, Any]]
    expected: str
    install_s: float
    figures: dict[str, Any] = field(default_factory=dict)

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


def helm_template(values: Path, *sets: str) -> list[dict[str, Any]]:
    command = [
        str(TOOLS_BIN / "helm"),
        "template",
        "pffs-csi",
        str(CHART),
        "-n",
        NAMESPACE,
        "-f",
        str(values),
        "--include-crds",
        "--no-hooks",  # the preflight hook is Helm's (test_kube_kubelet_path runs it through helm)
    ]
    for item in sets:
        command += ["--set", item]
    rendered = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    return [obj for obj in yaml.safe_load_all(rendered) if obj]


def apply(dynamic: Any, obj: dict[str, Any]) -> None:
    """Server-side apply, as `kubectl apply --server-side` does."""
    resource = dynamic.resources.get(api_version=obj["apiVersion"], kind=obj["kind"])
    namespace = obj["metadata"].get("namespace") if resource.namespaced else None
    resource.server_side_apply(
        body=obj,
        name=obj["metadata"]["name"],
        namespace=namespace,
        field_manager="pffs-test",
        force_conflicts=True,
    )


def missing_tools() -> list[str]:
    from pffs.testing.csi_image import missing_image_tools

    missing = missing_node_binaries() + missing_image_tools()
    return missing + [tool for tool in ("helm", "csi-provisioner") if not (TOOLS_BIN / tool).exists()]


@pytest.fixture(scope="module")
def shipped(s3_server: SeaweedS3, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shipped]:
    require(missing_tools(), "the shipped-DaemonSet test")
    from kubernetes import client, dynamic

    from pffs.testing.csi_image import csi_image_archives

    archives = csi_image_archives()
    root = tmp_path_factory.mktemp("shipped")
    payload = os.urandom(FILE_SIZE)
    raw = s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False, **s3_server.storage_options())
    bucket = f"pffs-shipped-{uuid.uuid4().hex[:8]}"
    raw.mkdir(bucket)
    raw.pipe(f"{bucket}/shipped/data/file.bin", payload)
    with (
        NodeControlPlane(root / "cp", node_names=[NODE], workloads=True) as cluster,
        KubeNode(root / "node", cluster, NODE) as node,
    ):
        for archive in archives:
            node.ctr("images", "import", str(archive), timeout=300)
        values = root / "values.yaml"
        values.write_text(shipped_values(node, cluster, root))
        objects = helm_template(values)
        api = cluster.api()
        dyn = dynamic.DynamicClient(api)
        core, apps = client.CoreV1Api(api), client.AppsV1Api(api)
        namespace = yaml.safe_load((REPO / "deploy/csi/namespace.yaml").read_text())
        apply(dyn, namespace)
        started = time.monotonic()
        for obj in objects:
            apply(dyn, obj)
        world = Shipped(
            cluster,
            node,
            s3_server,
            raw,
            bucket,
            core,
            apps,
            dyn,
            root,
            values,
            objects,
            sha256(payload),
            0.0,
        )
        wait_rolled_out(world, "pffs-csi-node")
        wait_rolled_out(world, "pffs-csi-mounter")
        poll(
            "the kubelet registers csi.pffs.io (CSINode)",
            lambda: csinode_has_driver(world),
            90,
            world.logs,
        )
        poll(
            "the controller Deployment is available",
            lambda: (
                (
                    apps.read_namespaced_deployment(
                        "pffs-csi-controller", NAMESPACE
                    ).status.available_replicas
                    or 0
                )
                >= 1
            ),
            120,
            world.logs,
        )
        world.install_s = time.monotonic() - started
        try:
            yield world
        finally:
            for obj in reversed(objects):
                delete(dyn, obj)


def shipped_values(node: KubeNode, cluster: NodeControlPlane, root: Path) -> str:
    """Every value this machine forces: nothing else differs from the chart's defaults."""
    return yaml.safe_dump(
        {
            "image": {"repository": IMAGE, "tag": TAG},
            # the kubelet's --root-dir here is a test folder; the node's state too, not /var/lib/pffs-csi
            "node": {
                "kubeletPath": str(node.kubelet_root),
                "stateDir": str(root / "node-state"),
                "cacheDir": str(root / "node-state" / "cache"),
                "cacheSize": "1G",
            },
            # no CNI plugin: pods use the host's network
            "hostNetwork": True,
            "warmups": {"enabled": True},
            # no kube-proxy: the API server's own address instead of the `kubernetes` Service's
            "extraEnv": [
                {"name": "KUBERNETES_SERVICE_HOST", "value": "127.0.0.1"},
                {"name": "KUBERNETES_SERVICE_PORT", "value": str(cluster.api_port)},
            ],
        }
    )


def delete(dyn: Any, obj: dict[str, Any]) -> None:
    from kubernetes.client.exceptions import ApiException

    resource = dyn.resources.get(api_version=obj["apiVersion"], kind=obj["kind"])
    namespace = obj["metadata"].get("namespace") if resource.namespaced else None
    try:
        resource.delete(name=obj["metadata"]["name"], namespace=namespace)
    except ApiException as exc:
        if exc.status != 404:
            raise


def csinode_has_driver(world: Shipped) -> bool:
    from kubernetes.client.exceptions import ApiException

    csinodes = world.dynamic.resources.get(api_version="storage.k8s.io/v1", kind="CSINode")
    try:
        drivers = csinodes.get(name=NODE).to_dict()["spec"].get("drivers") or []
    except ApiException:
        return False
    return any(driver["name"] == "csi.pffs.io" for driver in drivers)


def daemonset_pods(world: Shipped, name: str) -> list[Any]:
    return [
        pod
        for pod in world.core.list_namespaced_pod(
            NAMESPACE, label_selector=f"app.kubernetes.io/name={name}"
        ).items
        if pod.metadata.deletion_timestamp is None
    ]


def wait_rolled_out(world: Shipped, name: str, not_uid: str | None = None) -> Any:
    """The DaemonSet's one pod on the node is of its current template, Running and ready (and is not the
    pod `not_uid`)."""

    def ready() -> Any:
        ds = world.apps.read_namespaced_daemon_set(name, NAMESPACE)
        status = ds.status
        if (status.observed_generation or 0) < ds.metadata.generation:
            return None
        if status.updated_number_scheduled != 1 or status.number_ready != 1:
            return None
        pods = daemonset_pods(world, name)
        if len(pods) != 1 or pods[0].metadata.uid == not_uid:
            return None
        conditions = {c.type: c.status for c in pods[0].status.conditions or []}
        return pods[0] if conditions.get("Ready") == "True" else None

    return poll(f"DaemonSet {name} rolled out", ready, 180, world.logs)


def reader_pod(name: str, volume: dict[str, Any], read_only_mount: bool, expected: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "hostNetwork": True,
            "dnsPolicy": "Default",
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 2,
            "containers": [
                {
                    "name": "reader",
                    "image": f"{IMAGE}:{TAG}",
                    "imagePullPolicy": "Never",
                    "command": ["python3", "-c", READER, "/data/file.bin", expected, name],
                    "volumeMounts": [
                        {
                            "name": "data",
                            "mountPath": "/data",
                            "readOnly": read_only_mount,
                            "mountPropagation": "HostToContainer",
                        }
                    ],
                }
            ],
            "volumes": [{"name": "data", **volume}],
        },
    }


def last_report(world: Shipped, pod: str) -> dict[str, Any] | None:
    from kubernetes.client.exceptions import ApiException

    try:
        text = world.core.read_namespaced_pod_log(pod, "default", tail_lines=1) or ""
    except ApiException:
        return None
    try:
        return json.loads(text.strip().splitlines()[-1]) if text.strip() else None
    except ValueError:
        return None


READERS = ("ro-static-pv", "ro-inline", "ro-volume-mount")


def start_readers(world: Shipped) -> None:
    s3 = world.s3
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "pffs-s3-credentials", "namespace": "default"},
        "stringData": {"accessKeyId": s3.access_key, "secretAccessKey": s3.secret_key},
    }
    source = f"s3://{world.bucket}/shipped/data"
    attributes = {"source": source, "endpointUrl": s3.endpoint_url}
    static_pv = {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": "shipped-static"},
        "spec": {
            "capacity": {"storage": "1Gi"},
            "accessModes": ["ReadOnlyMany"],
            "persistentVolumeReclaimPolicy": "Retain",
            "storageClassName": "",
            "csi": {
                "driver": "csi.pffs.io",
                "volumeHandle": source,
                "readOnly": True,
                "volumeAttributes": attributes,
                "nodeStageSecretRef": {"name": "pffs-s3-credentials", "namespace": "default"},
            },
        },
    }
    static_pvc = claim("shipped-static", "", "ReadOnlyMany", volume_name="shipped-static")
    storage_class = {
        "apiVersion": "storage.k8s.io/v1",
        "kind": "StorageClass",
        "metadata": {"name": "shipped-pffs"},
        "provisioner": "csi.pffs.io",
        "volumeBindingMode": "Immediate",
        "parameters": {
            "source": f"s3://{world.bucket}/shipped/pvc",
            "endpointUrl": s3.endpoint_url,
            "csi.storage.k8s.io/provisioner-secret-name": "pffs-s3-credentials",
            "csi.storage.k8s.io/provisioner-secret-namespace": "default",
            "csi.storage.k8s.io/node-stage-secret-name": "pffs-s3-credentials",
            "csi.storage.k8s.io/node-stage-secret-namespace": "default",
        },
    }
    dynamic_pvc = claim("shipped-dynamic", "shipped-pffs", "ReadWriteMany")
    for obj in (secret, static_pv, static_pvc, storage_class, dynamic_pvc):
        apply(world.dynamic, obj)
    # The provisioned prefix starts empty: the reader's file goes there once the PV exists.
    pv_name = poll(
        "the PVC is provisioned and bound",
        lambda: (
            world.core.read_namespaced_persistent_volume_claim("shipped-dynamic", "default").spec.volume_name
        ),
        120,
        world.logs,
    )
    handle = world.core.read_persistent_volume(pv_name).spec.csi.volume_handle
    payload = world.raw.cat(f"{world.bucket}/shipped/data/file.bin")
    prefix = handle.split("#")[0].removeprefix("s3://").rstrip("/")  # the handle: URL#attributes
    world.raw.pipe(f"{prefix}/file.bin", payload)
    inline = {
        "csi": {
            "driver": "csi.pffs.io",
            "readOnly": True,
            "volumeAttributes": attributes,
            "nodePublishSecretRef": {"name": "pffs-s3-credentials"},
        }
    }
    pods = (
        reader_pod(
            "ro-static-pv",
            {"persistentVolumeClaim": {"claimName": "shipped-static", "readOnly": True}},
            False,
            world.expected,
        ),
        reader_pod("ro-inline", inline, False, world.expected),
        reader_pod(
            "ro-volume-mount",
            {"persistentVolumeClaim": {"claimName": "shipped-dynamic"}},
            True,
            world.expected,
        ),
    )
    for pod in pods:
        apply(world.dynamic, pod)
    for name in READERS:
        poll(
            f"pod {name} reads its file",
            lambda n=name: (last_report(world, n) or {}).get("reopen_ok"),
            120,
            world.logs,
        )


def claim(name: str, storage_class: str, mode: str, volume_name: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "accessModes": [mode],
        "storageClassName": storage_class,
        "resources": {"requests": {"storage": "1Gi"}},
    }
    if volume_name:
        spec["volumeName"] = volume_name
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": name, "namespace": "default"},
        "spec": spec,
    }


def targets_on_host(world: Shipped) -> dict[str, list[tuple[str, bool]]]:
    """Each pod target under the kubelet dir → its mounts on the host, bottom first: (fs type, read-only)."""
    stacks: dict[str, list[tuple[str, bool]]] = {}
    prefix = str(world.node.kubelet_root / "pods") + "/"
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        point = fields[4]
        if point.startswith(prefix) and "kubernetes.io~csi" in point:
            fstype = fields[fields.index("-") + 1]
            stacks.setdefault(point, []).append((fstype, "ro" in fields[5].split(",")))
    return stacks


def check_readers(world: Shipped, after: str) -> dict[str, dict[str, Any]]:
    """Every reader has read since `after` began, with no failed read and no write that went through;
    every target is one read-only pffs mount on the host; nothing was written to the bucket."""
    reports = {}
    for name in READERS:
        before = last_report(world, name) or {}
        poll(
            f"{name} reads again after {after}",
            lambda n=name, b=before: (
                (last_report(world, n) or {}).get("reopen_ok", 0) > b.get("reopen_ok", 0) + 3
            ),
            60,
            world.logs,
        )
        report = last_report(world, name)
        assert report is not None
        assert report["held_fail"] == 0 and report["reopen_fail"] == 0, (after, name, report)
        assert report["writes_ok"] == 0 and set(report["write_errors"]) == {"EROFS"}, (after, name, report)
        reports[name] = report
    stacks = targets_on_host(world)
    assert len(stacks) == len(READERS), stacks
    for target, stack in stacks.items():
        fuse = [entry for entry in stack if entry[0].startswith("fuse")]
        assert len(fuse) == 1, (after, target, stack)
        assert all(read_only for _, read_only in stack), (after, target, stack)
    written = [key for key in world.raw.find(world.bucket) if ".probe-" in key]
    assert not written, f"{after}: writes reached the bucket: {written}"
    return reports


def node_plugin_uid(world: Shipped) -> str:
    return daemonset_pods(world, "pffs-csi-node")[0].metadata.uid


def patch_node_plugin(world: Shipped, patch: dict[str, Any]) -> None:
    world.apps.patch_namespaced_daemon_set("pffs-csi-node", NAMESPACE, patch)


def rollout_undo(world: Shipped) -> None:
    """What `kubectl rollout undo daemonset/pffs-csi-node` does: the template of the revision before the
    current one, from its ControllerRevision."""
    ds = world.apps.read_namespaced_daemon_set("pffs-csi-node", NAMESPACE)
    revisions = [
        r
        for r in world.apps.list_namespaced_controller_revision(NAMESPACE).items
        if any(o.uid == ds.metadata.uid for o in r.metadata.owner_references or [])
    ]
    revisions.sort(key=lambda r: r.revision)
    previous = revisions[-2]
    patch_node_plugin(world, previous.data)


def test_the_chart_installs_and_its_pods_read_exact_bytes_through_read_only_volumes(shipped: Shipped) -> None:
    start_readers(shipped)
    reports = check_readers(shipped, "the install")
    mounts = [fs for stack in targets_on_host(shipped).values() for fs, _ in stack]
    assert mounts.count("fuse.pffs") + mounts.count("fuse") == len(READERS)
    print(
        f"install: the chart's pods Running and the driver registered {shipped.install_s:.1f} s after apply"
    )
    assert reports


@pytest.mark.parametrize(
    "operation", ["rollout restart", "upgrade to a new tag", "rollout undo", "delete the plugin pod"]
)
def test_a_node_plugin_operation_costs_the_readers_nothing(shipped: Shipped, operation: str) -> None:
    if not all(last_report(shipped, name) for name in READERS):
        start_readers(shipped)
    old = node_plugin_uid(shipped)
    started = time.monotonic()
    if operation == "rollout restart":
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        patch_node_plugin(
            shipped,
            {
                "spec": {
                    "template": {"metadata": {"annotations": {"kubectl.kubernetes.io/restartedAt": stamp}}}
                }
            },
        )
    elif operation == "upgrade to a new tag":
        patch_node_plugin(
            shipped,
            {
                "spec": {
                    "template": {
                        "spec": {"containers": [{"name": "pffs-csi", "image": f"{IMAGE}:{NEXT_TAG}"}]}
                    }
                }
            },
        )
    elif operation == "rollout undo":
        rollout_undo(shipped)
    else:
        shipped.core.delete_namespaced_pod(
            daemonset_pods(shipped, "pffs-csi-node")[0].metadata.name, NAMESPACE
        )
    new = wait_rolled_out(shipped, "pffs-csi-node", not_uid=old)
    took = time.monotonic() - started
    if operation == "upgrade to a new tag":
        assert new.spec.containers[0].image == f"{IMAGE}:{NEXT_TAG}"
    if operation == "rollout undo":
        assert new.spec.containers[0].image == f"{IMAGE}:{TAG}"
    reports = check_readers(shipped, operation)
    pause = max(max(r["held_gap"], r["reopen_gap"]) for r in reports.values())
    print(f"{operation}: new plugin ready in {took:.1f} s; longest pause of a reader so far {pause:.2f} s")


def test_a_mounter_replaced_takes_its_mounts_but_the_plugin_mounts_them_again_and_tells_the_pods(
    shipped: Shipped,
) -> None:
    """The one operation that ends mounts: the mounter's pod replaced (it is updated only OnDelete). Files
    opened before fail from then on (the FUSE connection died with its process); files opened after the
    repair read exact bytes again, read-only still, without a pod restart; each pod gets an Event."""
    if not all(last_report(shipped, name) for name in READERS):
        start_readers(shipped)
    old = daemonset_pods(shipped, "pffs-csi-mounter")[0]
    before = {name: last_report(shipped, name) or {} for name in READERS}
    started = time.monotonic()
    shipped.core.delete_namespaced_pod(old.metadata.name, NAMESPACE)
    wait_rolled_out(shipped, "pffs-csi-mounter", not_uid=old.metadata.uid)
    for name in READERS:
        poll(
            f"{name} reads files it opens anew again",
            lambda n=name: (
                (last_report(shipped, n) or {}).get("reopen_ok", 0) > before[n]["reopen_ok"] + 3
                and (last_report(shipped, n) or {}).get("reopen_fail", 0) > 0
            ),
            120,
            shipped.logs,
        )
    recovered_s = time.monotonic() - started
    for name in READERS:
        report = last_report(shipped, name)
        assert report is not None and report["writes_ok"] == 0, report

        def reasons(pod: str = name) -> list[str]:
            selector = f"involvedObject.name={pod}"
            return [
                e.reason for e in shipped.core.list_namespaced_event("default", field_selector=selector).items
            ]

        # Posted in the background after the repair: it may follow the reads by a moment.
        poll(
            f"{name} gets a PffsMountRepaired Event",
            lambda r=reasons: "PffsMountRepaired" in r(),
            60,
            lambda r=reasons: str(r()),
        )
    for target, stack in targets_on_host(shipped).items():
        assert all(read_only for _, read_only in stack), (target, stack)
        assert [fs for fs, _ in stack] == ["fuse.pffs", "fuse.pffs"], (target, stack)  # dead, then live
    print(f"mounter replaced: files opened anew read again within {recovered_s:.1f} s")


def test_a_datasetwarmup_warms_the_node_and_its_gated_pod_then_reads_from_the_cache(shipped: Shipped) -> None:
    """The chart with warmups.enabled on the real kubelet: a DatasetWarmup reaches Succeeded, the node's
    report holds the dataset, and a pod gated on it is ungated, started by the kubelet and reads exact
    bytes from the node's cache through an inline volume."""
    world, s3 = shipped, shipped.s3
    files = {f"shipped/warm/{i}.bin": os.urandom((1 << 20) + i) for i in range(3)}
    world.raw.pipe({f"{world.bucket}/{k}": v for k, v in files.items()})
    source = f"s3://{world.bucket}/shipped/warm"
    keys = {"accessKeyId": s3.access_key, "secretAccessKey": s3.secret_key}
    for namespace in (NAMESPACE, "default"):  # the warm-up reads its Secret in the driver's namespace
        secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "pffs-s3-credentials"}}
        apply(
            world.dynamic,
            {**secret, "metadata": {**secret["metadata"], "namespace": namespace}, "stringData": keys},
        )
    warmup = {
        "apiVersion": "pffs.io/v1alpha1",
        "kind": "DatasetWarmup",
        "metadata": {"name": "shipped-warm", "namespace": "default"},
        "spec": {
            "source": source, "endpointUrl": s3.endpoint_url, "secretName": "pffs-s3-credentials",
            "nodes": {"names": [NODE]},
        },
    }  # fmt: skip
    name = next(iter(files)).rsplit("/", 1)[1]
    pod = reader_pod("warm-reader", {"csi": {}}, False, "")
    pod["metadata"]["labels"] = {"pffs.io/warmup": "shipped-warm"}
    pod["spec"]["schedulingGates"] = [{"name": "pffs.io/warmup"}]
    pod["spec"]["volumes"] = [{"name": "data", "csi": {
        "driver": "csi.pffs.io", "readOnly": True, "nodePublishSecretRef": {"name": "pffs-s3-credentials"},
        "volumeAttributes": {"source": source, "endpointUrl": s3.endpoint_url},
    }}]  # fmt: skip
    read = "import hashlib,sys; print(hashlib.sha256(open(sys.argv[1], 'rb').read()).hexdigest())"
    pod["spec"]["containers"][0]["command"] = ["python3", "-c", read, f"/data/{name}"]
    apply(world.dynamic, pod)
    started = time.monotonic()
    apply(world.dynamic, warmup)
    custom = world.dynamic.resources.get(api_version="pffs.io/v1alpha1", kind="DatasetWarmup")

    def status() -> dict[str, Any]:
        found = custom.get(name="shipped-warm", namespace="default").to_dict()
        return dict(found.get("status") or {})

    assert world.core.read_namespaced_pod("warm-reader", "default").spec.scheduling_gates
    poll("the warm-up succeeds", lambda: status().get("phase") == "Succeeded", 120, world.logs)
    warm_s = time.monotonic() - started
    assert status()["progress"] == "100%" and status()["bytesDone"] == sum(map(len, files.values()))
    report = json.loads(world.core.read_node(NODE).metadata.annotations["pffs.io/cache"])["datasets"][source]
    assert report["cached_bytes"] == report["total_bytes"] == sum(map(len, files.values()))
    poll(
        "the pod ungated, run and done",
        lambda: world.core.read_namespaced_pod("warm-reader", "default").status.phase == "Succeeded",
        120,
        world.logs,
    )
    printed = world.core.read_namespaced_pod_log("warm-reader", "default").strip()
    assert printed == sha256(next(iter(files.values())))
    print(f"warm-up on the shipped chart: apply to Succeeded {warm_s:.1f} s")
    world.core.delete_namespaced_pod("warm-reader", "default", grace_period_seconds=1)
    custom.delete(name="shipped-warm", namespace="default")


def working_set_mib(container_id: str) -> float | None:
    """A container's memory working set (usage less inactive file pages, as the kubelet counts it) from its
    cgroup v1 memory controller on this host (the cgroupfs driver's kubepods tree); None if not found."""
    found = list(Path("/sys/fs/cgroup/memory").glob(f"kubepods*/**/{container_id}"))
    if not found:
        return None
    usage = int((found[0] / "memory.usage_in_bytes").read_text())
    stats = dict(line.split() for line in (found[0] / "memory.stat").read_text().splitlines())
    return (usage - int(stats.get("total_inactive_file", 0))) / (1 << 20)


def test_the_chart_pods_memory_in_use_is_within_their_limits(shipped: Shipped) -> None:
    """What each pffs container uses with the readers running (printed: the figures behind the chart's
    requests), within its limit."""
    if not all(last_report(shipped, name) for name in READERS):
        start_readers(shipped)
    measured = {}
    for pod in shipped.core.list_namespaced_pod(NAMESPACE).items:
        limits = {c.name: c.resources.limits or {} for c in pod.spec.containers}
        for status in pod.status.container_statuses or []:
            if not status.container_id or not status.name.startswith("pffs"):
                continue
            mib = working_set_mib(status.container_id.rpartition("/")[2])
            if mib is None:
                continue
            limit = limits[status.name].get("memory", "")
            measured[f"{pod.metadata.labels['app.kubernetes.io/name']}/{status.name}"] = (mib, limit)
            assert limit.endswith("Gi") or limit.endswith("Mi"), limit
            bound = float(limit[:-2]) * (1024 if limit.endswith("Gi") else 1)
            assert mib < bound, (pod.metadata.name, status.name, mib, limit)
    assert {"pffs-csi-node/pffs-csi", "pffs-csi-mounter/pffs-mounter", "pffs-csi-controller/pffs-csi"} <= set(
        measured
    ), measured
    for name, (mib, limit) in sorted(measured.items()):
        print(f"memory: {name} {mib:.0f} MiB in use (limit {limit})")


def test_the_controller_rolls_out_on_a_one_node_cluster(shipped: Shipped) -> None:
    """With hostNetwork (as here: no CNI) a surge controller pod would want the metrics port the old one
    holds on the only node and never schedule; the chart's maxSurge 0 replaces the old pod first."""
    apps = shipped.apps
    before = {p.metadata.uid for p in shipped.core.list_namespaced_pod(NAMESPACE).items}
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    patch = {
        "spec": {"template": {"metadata": {"annotations": {"kubectl.kubernetes.io/restartedAt": stamp}}}}
    }
    started = time.monotonic()
    apps.patch_namespaced_deployment("pffs-csi-controller", NAMESPACE, patch)

    def rolled_out() -> bool:
        d = apps.read_namespaced_deployment("pffs-csi-controller", NAMESPACE)
        status = d.status
        if (status.observed_generation or 0) < d.metadata.generation:
            return False
        if (status.updated_replicas or 0) != 1 or (status.available_replicas or 0) != 1:
            return False
        pods = [
            p
            for p in shipped.core.list_namespaced_pod(
                NAMESPACE, label_selector="app.kubernetes.io/name=pffs-csi-controller"
            ).items
            if p.metadata.deletion_timestamp is None
        ]
        return len(pods) == 1 and pods[0].metadata.uid not in before and status.replicas == 1

    poll("the controller rolled out", rolled_out, 180, shipped.logs)
    print(f"controller rollout on one node (hostNetwork): {time.monotonic() - started:.1f} s")


def post_delete_hooks(world: Shipped) -> list[dict[str, Any]]:
    """The chart's post-delete hook objects (what `helm uninstall` creates after deleting the release's),
    in Helm's order: by hook weight."""
    command = [str(TOOLS_BIN / "helm"), "template", "pffs-csi", str(CHART), "-n", NAMESPACE]
    command += ["-f", str(world.values), "--show-only", "templates/uninstall-hook.yaml"]
    rendered = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    hooks = [obj for obj in yaml.safe_load_all(rendered) if obj]
    return sorted(hooks, key=lambda o: int(o["metadata"]["annotations"].get("helm.sh/hook-weight", "0")))


def test_uninstall_after_the_pods_leaves_nothing_mounted_or_running(shipped: Shipped) -> None:
    from kubernetes.client.exceptions import ApiException

    for name in READERS:
        with contextlib.suppress(ApiException):
            shipped.core.delete_namespaced_pod(name, "default", grace_period_seconds=1)
    poll(
        "the readers are gone",
        lambda: (
            not {p.metadata.name for p in shipped.core.list_namespaced_pod("default").items} & set(READERS)
        ),
        120,
        shipped.logs,
    )
    poll(
        "the kubelet unpublishes and unstages every volume",
        lambda: not pffs_mounts(shipped),
        60,
        lambda: "\n".join(pffs_mounts(shipped)) + "\n" + shipped.logs(),
    )
    started = time.monotonic()
    for obj in reversed(shipped.objects):
        delete(shipped.dynamic, obj)
    poll("the chart's pods are gone", lambda: not shipped.core.list_namespaced_pod(NAMESPACE).items, 180)
    print(f"uninstall: the chart's pods gone in {time.monotonic() - started:.1f} s")
    assert not mount_processes(shipped)
    assert not pffs_mounts(shipped)

    # Then the post-delete hook, as `helm uninstall` runs it: what the driver wrote at run time goes.
    from kubernetes import client

    leases = client.CoordinationV1Api(shipped.cluster.api())
    written = {lease.metadata.name for lease in leases.list_namespaced_lease(NAMESPACE).items}
    assert "pffs.io/cache" in (shipped.core.read_node(NODE).metadata.annotations or {})
    assert "pffs-warmup-controller" in written, written
    hooks = post_delete_hooks(shipped)
    started = time.monotonic()
    for obj in hooks:
        apply(shipped.dynamic, obj)
    batch = client.BatchV1Api(shipped.cluster.api())
    poll(
        "the uninstall hook Job succeeds",
        lambda: (batch.read_namespaced_job("pffs-csi-uninstall", NAMESPACE).status.succeeded or 0) >= 1,
        180,
        shipped.logs,
    )
    print(f"uninstall hook: done in {time.monotonic() - started:.1f} s (Leases before: {sorted(written)})")
    annotations = shipped.core.read_node(NODE).metadata.annotations or {}
    assert not {"pffs.io/cache", "pffs.io/cache-group"} & set(annotations), annotations
    left = {lease.metadata.name for lease in leases.list_namespaced_lease(NAMESPACE).items}
    assert not left & {"csi-pffs-io", "pffs-warmup-controller"}, left
    for obj in reversed(hooks):  # helm.sh/hook-delete-policy: hook-succeeded
        delete(shipped.dynamic, obj)


def pffs_mounts(world: Shipped) -> list[str]:
    """This test's pffs mounts (other tests may run mounts of their own on this machine)."""
    lines = Path("/proc/self/mountinfo").read_text().splitlines()
    return [line for line in lines if "fuse.pffs" in line and str(world.root) in line]


def mount_processes(world: Shipped) -> list[str]:
    found = subprocess.run(
        ["pgrep", "-f", "pffs.cli.mount_daemon|^pffs mount"], capture_output=True, text=True
    )
    commands = []
    for pid in found.stdout.split():
        with contextlib.suppress(OSError):
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if str(world.root) in command:
                commands.append(f"{pid}: {command}")
    return commands
