"""pffs against a real Kubernetes control plane (etcd, kube-apiserver, kube-controller-manager and
kube-scheduler v1.37.2 on loopback; pffs.testing.kube_cluster): the manifests of deploy/ pass the API
server's own validation (server-side dry run), the CSI node plugin publishes its cache report with the
service account and RBAC that deploy/ gives it — and nothing more — and kube-scheduler with `pffs extender`
places pods next to their warm cache.

Marked `kube`: CI builds the binaries (make setup) and runs these every time; a plain local pytest without
them skips, saying which binary is missing.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import poll, require, sha256

from pffs.csi import csi_pb2
from pffs.scheduler.kube.locality import CACHE_ANNOTATION, node_cache
from pffs.testing.csi_plugin import CsiPlugin
from pffs.testing.kube_cluster import KubeControlPlane, add_node, missing_binaries, pffs_scheduler_command
from pffs.testing.s3_server import SeaweedS3, free_ports

REPO = Path(__file__).resolve().parent.parent
TOOLS_BIN = Path(os.environ.get("PFFS_TOOLS_BIN") or Path.home() / ".cache/pffs-tools/bin")

pytestmark = [pytest.mark.kube, pytest.mark.timeout(300)]


def require_control_plane() -> None:
    require(missing_binaries(), "a real control plane")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeControlPlane]:
    require_control_plane()
    with KubeControlPlane(tmp_path_factory.mktemp("kube")) as control_plane:
        yield control_plane


def rendered(folder: str) -> list[dict[str, Any]]:
    """The objects of a deploy/ folder: `kustomize build` where it has a kustomization, else its files."""
    path = REPO / "deploy" / folder
    if (path / "kustomization.yaml").exists():
        kustomize = TOOLS_BIN / "kustomize"
        text = subprocess.run(
            [str(kustomize), "build", str(path)], check=True, capture_output=True, text=True
        ).stdout
    else:
        text = "\n---\n".join(p.read_text() for p in sorted(path.glob("*.yaml")))
    objects = [doc for doc in yaml.safe_load_all(text) if doc]
    # Kubernetes objects only (queues.yaml, KubeSchedulerConfiguration are files for a program, not the API).
    return [o for o in objects if "metadata" in o and not o["kind"].startswith("KubeScheduler")]


def make_node(
    api: Any,
    name: str,
    cpu: str = "8",
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
    gpus: int = 0,
) -> None:
    resources = {"cpu": cpu, "memory": "32Gi", "pods": "110"} | (
        {"nvidia.com/gpu": str(gpus)} if gpus else {}
    )
    add_node(api, name, resources, labels, annotations)


# 4. Every manifest applies (server-side dry run)


def test_every_manifest_in_deploy_passes_a_server_side_dry_run(cluster: KubeControlPlane) -> None:
    from kubernetes import dynamic
    from kubernetes.client.exceptions import ApiException

    api = dynamic.DynamicClient(cluster.api())
    objects = rendered("csi") + rendered("csi/examples") + rendered("scheduler")
    kinds = {(o["apiVersion"], o["kind"]) for o in objects}
    assert ("storage.k8s.io/v1", "CSIDriver") in kinds and ("apps/v1", "DaemonSet") in kinds
    # Namespaces first, for real: a dry-run object cannot live in a namespace that a dry run made.
    for obj in objects:
        if obj["kind"] == "Namespace":
            resource = api.resources.get(api_version="v1", kind="Namespace")
            resource.server_side_apply(body=obj, field_manager="pffs-test", dry_run="All")
            resource.server_side_apply(body=obj, field_manager="pffs-test")
    refused = []
    for obj in objects:
        resource = api.resources.get(api_version=obj["apiVersion"], kind=obj["kind"])
        namespace = obj["metadata"].get("namespace") if resource.namespaced else None
        try:
            resource.server_side_apply(
                body=obj, namespace=namespace, field_manager="pffs-test", dry_run="All"
            )
        except ApiException as exc:
            refused.append(f"{obj['kind']} {obj['metadata']['name']}: {exc.status} {exc.body}")
    # A dry run stores nothing: the CSIDriver (not applied for real) is not there.
    from kubernetes.dynamic.exceptions import NotFoundError

    with pytest.raises(NotFoundError):
        api.resources.get(api_version="storage.k8s.io/v1", kind="CSIDriver").get(name="csi.pffs.io")
    assert not refused, "\n".join(refused)


# 3. The CSI node plugin's cache report, with deploy/'s service account and RBAC only


def apply_node_rbac(cluster: KubeControlPlane) -> None:
    from kubernetes import dynamic
    from kubernetes.client.exceptions import ApiException

    api = dynamic.DynamicClient(cluster.api())
    for obj in rendered("csi"):
        name = obj["metadata"]["name"]
        if obj["kind"] == "Namespace" or name in ("pffs-csi-node",):
            if obj["kind"] not in ("Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding"):
                continue
            resource = api.resources.get(api_version=obj["apiVersion"], kind=obj["kind"])
            namespace = obj["metadata"].get("namespace") if resource.namespaced else None
            with contextlib.suppress(ApiException):  # already there (another test made it)
                resource.create(body=obj, namespace=namespace)


def service_account_kubeconfig(cluster: KubeControlPlane, path: Path, namespace: str, name: str) -> Path:
    """A kubeconfig with a token of the service account (the TokenRequest API, as a pod's projected token)."""
    from kubernetes import client

    request = {"spec": {"expirationSeconds": 3600, "audiences": ["https://kubernetes.default.svc"]}}
    token = client.CoreV1Api(cluster.api()).create_namespaced_service_account_token(name, namespace, request)
    return cluster.kubeconfig_for_token(path, token.status.token, name)


@pytest.mark.s3
def test_the_csi_node_plugin_reports_its_cache_with_deploys_rbac_and_is_refused_the_rest(
    cluster: KubeControlPlane, s3_server: SeaweedS3, raw_s3: Any, bucket: str, tmp_path: Path
) -> None:
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    apply_node_rbac(cluster)
    node_name = "csi-node-1"
    make_node(
        cluster.api(), node_name, labels={"topology.kubernetes.io/zone": "zone-a", "pffs.io/tor": "tor-7"}
    )
    kubeconfig = service_account_kubeconfig(
        cluster, tmp_path / "node.kubeconfig", "pffs-system", "pffs-csi-node"
    )

    # What the RBAC of deploy/csi does not grant, the API server refuses to this account.
    as_node_plugin = client.CoreV1Api(_api_from(kubeconfig))
    for what, call in {
        "list nodes": lambda: as_node_plugin.list_node(),
        "list pods": lambda: as_node_plugin.list_pod_for_all_namespaces(),
        "read a secret": lambda: as_node_plugin.read_namespaced_secret("pffs-s3-credentials", "pffs-system"),
        "delete a node": lambda: as_node_plugin.delete_node(node_name),
    }.items():
        with pytest.raises(ApiException) as refused:
            call()
        assert refused.value.status == 403, what

    data = os.urandom(5 << 20)
    raw_s3.pipe_file(f"{bucket}/dataset/part-0", data)
    source = f"s3://{bucket}/dataset"
    root = tmp_path / "plugin"
    root.mkdir()
    with CsiPlugin(
        root,
        "--cache-size",
        "1G",
        "--kubeconfig",
        str(kubeconfig),
        "--report-interval",
        "1",
        node_id=node_name,
    ) as plugin:
        info = plugin.node.NodeGetInfo(csi_pb2.NodeGetInfoRequest())
        segments = dict(info.accessible_topology.segments)
        assert segments["topology.pffs.io/zone"] == "zone-a" and segments["topology.pffs.io/tor"] == "tor-7"
        capability = csi_pb2.VolumeCapability(
            mount=csi_pb2.VolumeCapability.MountVolume(),
            access_mode=csi_pb2.VolumeCapability.AccessMode(
                mode=csi_pb2.VolumeCapability.AccessMode.MULTI_NODE_READER_ONLY
            ),
        )
        staging, target = root / "staging", root / "target"
        staging.mkdir()
        secrets = {"accessKeyId": s3_server.access_key, "secretAccessKey": s3_server.secret_key}
        context = {"source": source, "endpointUrl": s3_server.endpoint_url}
        plugin.node.NodeStageVolume(
            csi_pb2.NodeStageVolumeRequest(
                volume_id="dataset",
                staging_target_path=str(staging),
                volume_capability=capability,
                volume_context=context,
                secrets=secrets,
            )
        )
        plugin.node.NodePublishVolume(
            csi_pb2.NodePublishVolumeRequest(
                volume_id="dataset",
                staging_target_path=str(staging),
                target_path=str(target),
                volume_capability=capability,
                readonly=True,
            )
        )
        assert sha256((target / "part-0").read_bytes()) == sha256(data)

        core = client.CoreV1Api(cluster.api())

        def reported() -> Any:
            annotations = core.read_node(node_name).metadata.annotations or {}
            cache = node_cache({"metadata": {"annotations": annotations}})
            entry = (cache or {}).get(source)
            return entry if entry and entry.cached_bytes == len(data) else None

        entry = poll("the cache report on the Node", reported, timeout_s=30)
        assert entry.total_bytes == len(data)
        report = json.loads(core.read_node(node_name).metadata.annotations[CACHE_ANNOTATION])
        assert report["capacity_bytes"] == 1 << 30 and report["updated_at"].endswith("Z")
        plugin.node.NodeUnpublishVolume(
            csi_pb2.NodeUnpublishVolumeRequest(volume_id="dataset", target_path=str(target))
        )
        plugin.node.NodeUnstageVolume(
            csi_pb2.NodeUnstageVolumeRequest(volume_id="dataset", staging_target_path=str(staging))
        )
        assert "could not write it" not in plugin.log()


def _api_from(kubeconfig: Path) -> Any:
    from kubernetes import client, config

    configuration = client.Configuration()
    config.load_kube_config(config_file=str(kubeconfig), client_configuration=configuration)
    return client.ApiClient(configuration)


# 1. kube-scheduler with pffs extender


@pytest.fixture
def extender(cluster: KubeControlPlane, tmp_path: Path) -> Iterator[tuple[int, subprocess.Popen[bytes]]]:
    port = free_ports(1)[0]
    with open(tmp_path / "extender.log", "ab") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "pffs.cli.main", "extender", "--port", str(port), "-v"], stderr=log
        )
    try:
        poll("pffs extender", lambda: _answers(f"http://127.0.0.1:{port}/healthz"), timeout_s=30)
        yield port, process
    finally:
        process.terminate()
        process.wait(timeout=10)


def _answers(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=1) as answer:
            return answer.status == 200
    except OSError:
        return False


def test_kube_scheduler_with_pffs_extender_places_pods_by_cache_locality(
    cluster: KubeControlPlane, extender: tuple[int, subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    """deploy/scheduler/extender-config.yaml, pointed at this extender, in a second kube-scheduler
    (schedulerName pffs-locality): warm node first, another when the warm one is full, and on without
    the extender when it is down (ignorable)."""
    from kubernetes import client

    port, extender_process = extender
    config = yaml.safe_load((REPO / "deploy/scheduler/extender-config.yaml").read_text())
    config["clientConnection"]["kubeconfig"] = str(cluster.kubeconfig)
    config["profiles"] = [{"schedulerName": "pffs-locality"}]
    config["extenders"][0]["urlPrefix"] = f"http://127.0.0.1:{port}/"
    config["extenders"][0]["httpTimeout"] = "2s"
    config["leaderElection"] = {"leaderElect": False}
    config_path = tmp_path / "scheduler.yaml"
    config_path.write_text(yaml.safe_dump(config))
    args = [str(cluster.bin / "kube-scheduler"), "--config", str(config_path), "--bind-address", "127.0.0.1"]
    with open(tmp_path / "scheduler.log", "ab") as log:
        scheduler = subprocess.Popen(
            [*args, "--secure-port", str(free_ports(1)[0])], stdout=log, stderr=subprocess.STDOUT
        )
    try:
        dataset = "s3://warm/imagenet"
        warm = json.dumps({"datasets": {dataset: {"cached_bytes": 100, "total_bytes": 100}}})
        cold = json.dumps({"datasets": {}})
        # Three nodes with pffs; the warm one is first by name, so a locality-blind tie could pick it
        # too: make it the last alphabetically and give the cold ones more room (a better plain score).
        make_node(cluster.api(), "loc-a-cold", cpu="16", annotations={CACHE_ANNOTATION: cold})
        make_node(cluster.api(), "loc-b-cold", cpu="16", annotations={CACHE_ANNOTATION: cold})
        make_node(cluster.api(), "loc-z-warm", cpu="2", annotations={CACHE_ANNOTATION: warm})
        core = client.CoreV1Api(cluster.api())

        def pod(name: str, cpu: str) -> dict[str, Any]:
            return {
                "metadata": {"name": name, "annotations": {"pffs.io/datasets": dataset}},
                "spec": {
                    "schedulerName": "pffs-locality",
                    "containers": [
                        {"name": "c", "image": "busybox:1.36", "resources": {"requests": {"cpu": cpu}}}
                    ],
                },
            }

        def node_of(name: str) -> str | None:
            return core.read_namespaced_pod(name, "default").spec.node_name

        core.create_namespaced_pod("default", pod("reader-1", "1"))
        assert poll("reader-1 scheduled", lambda: node_of("reader-1")) == "loc-z-warm"
        core.create_namespaced_pod("default", pod("reader-2", "1500m"))  # no longer fits on the warm node
        assert poll("reader-2 scheduled", lambda: node_of("reader-2")) in ("loc-a-cold", "loc-b-cold")
        extender_process.terminate()
        extender_process.wait(timeout=10)
        core.create_namespaced_pod("default", pod("reader-3", "1"))
        assert poll("reader-3 scheduled without the extender", lambda: node_of("reader-3"))
    finally:
        scheduler.terminate()
        scheduler.wait(timeout=15)


# 5. A kubeconfig with an exec credential plugin (what EKS, GKE and AKS hand out)


def test_pffs_scheduler_signs_in_through_an_exec_credential_plugin(
    cluster: KubeControlPlane, tmp_path: Path
) -> None:
    from kubernetes import client

    calls = tmp_path / "plugin-calls"
    plugin = tmp_path / "credential-plugin"
    credential = {
        "apiVersion": "client.authentication.k8s.io/v1",
        "kind": "ExecCredential",
        "status": {"token": cluster.token},
    }
    plugin.write_text(f"#!/bin/sh\necho called >> {calls}\ncat <<'END'\n{json.dumps(credential)}\nEND\n")
    plugin.chmod(0o755)
    kubeconfig = tmp_path / "exec.kubeconfig"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "exec",
                "clusters": [
                    {
                        "name": "c",
                        "cluster": {"server": cluster.url, "certificate-authority": str(cluster.ca_file)},
                    }
                ],
                "contexts": [{"name": "exec", "context": {"cluster": "c", "user": "plugin"}}],
                "users": [
                    {
                        "name": "plugin",
                        "user": {
                            "exec": {
                                "apiVersion": "client.authentication.k8s.io/v1",
                                "command": str(plugin),
                                "interactiveMode": "Never",
                            }
                        },
                    }
                ],
            }
        )
    )
    make_node(cluster.api(), "exec-node")
    core = client.CoreV1Api(cluster.api())
    core.create_namespaced_pod(
        "default",
        {
            "metadata": {"name": "exec-placed"},
            "spec": {
                "schedulerName": "pffs-scheduler",
                "containers": [
                    {"name": "c", "image": "busybox:1.36", "resources": {"requests": {"cpu": "1"}}}
                ],
            },
        },
    )
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pffs.cli.main",
            "scheduler",
            "--kubeconfig",
            str(kubeconfig),
            "--queues",
            str(REPO / "deploy/scheduler/queues.yaml"),
            "--once",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert calls.read_text().count("called") >= 1  # the plugin gave the token
    assert cluster.token not in run.stdout + run.stderr
    assert core.read_namespaced_pod("exec-placed", "default").spec.node_name, run.stdout[-2000:]


# 2. pffs scheduler: gangs whole, ToR and warm-cache preferences, quotas, and why a group waits


def test_pffs_scheduler_binds_gangs_whole_prefers_one_tor_and_warm_nodes_and_says_why_groups_wait(
    cluster: KubeControlPlane, tmp_path: Path
) -> None:
    from kubernetes import client

    dataset = "s3://warm/coco"
    warm = json.dumps({"datasets": {dataset: {"cached_bytes": 10, "total_bytes": 10}}})
    cold = json.dumps({"datasets": {}})
    for name, tor, report in (
        ("g1", "tor-a", cold),
        ("g2", "tor-a", cold),
        ("g3", "tor-b", warm),
        ("g4", "tor-b", cold),
    ):
        make_node(
            cluster.api(),
            f"gang-{name}",
            cpu="64",
            gpus=4,
            labels={"pffs.io/tor": tor},
            annotations={CACHE_ANNOTATION: report},
        )
    queues = tmp_path / "queues.yaml"
    queues.write_text(
        yaml.safe_dump(
            {
                "queues": [
                    {"name": "default", "weight": 1, "capability": {"nvidia.com/gpu": 64}},
                    {"name": "small", "weight": 1, "capability": {"nvidia.com/gpu": 2}, "overcommit": False},
                ]
            }
        )
    )
    core = client.CoreV1Api(cluster.api())

    def node_of(name: str) -> str | None:
        return core.read_namespaced_pod(name, "default").spec.node_name

    def waiting_reason(name: str) -> str | None:
        for condition in core.read_namespaced_pod(name, "default").status.conditions or []:
            if condition.type == "PodScheduled" and condition.status == "False":
                return f"{condition.reason}: {condition.message}"
        return None

    with pffs_scheduler(cluster, queues, tmp_path / "pffs-scheduler.log"):
        # Locality: one GPU for a pod that reads the dataset goes to the node that holds it.
        core.create_namespaced_pod(
            "default", gang_pod("warm-reader", "warm", 1, 1, annotations={"pffs.io/datasets": dataset})
        )
        assert poll("warm-reader bound", lambda: node_of("warm-reader")) == "gang-g3"
        # A pair of 4-GPU workers: two whole nodes under one ToR switch (g1 + g2), not split across two.
        for i in range(2):
            core.create_namespaced_pod("default", gang_pod(f"pair-{i}", "pair", 2, 4))
        placed = {poll(f"pair-{i} bound", lambda i=i: node_of(f"pair-{i}")) for i in range(2)}
        assert placed == {"gang-g1", "gang-g2"}
        # A gang of three 4-GPU workers: only g4 has 4 GPUs free now: none is bound, each says why.
        for i in range(3):
            core.create_namespaced_pod("default", gang_pod(f"big-{i}", "big", 3, 4))
        reasons = [
            poll(f"big-{i} marked unschedulable", lambda i=i: waiting_reason(f"big-{i}")) for i in range(3)
        ]
        assert all(node_of(f"big-{i}") is None for i in range(3)), "part of a gang was bound"
        assert all(reason and "Unschedulable" in reason for reason in reasons), reasons
        # A queue's quota: 4 GPUs in a queue capped at 2 wait, saying so.
        core.create_namespaced_pod(
            "default", gang_pod("greedy", "greedy", 1, 4, labels={"pffs.io/queue": "small"})
        )
        reason = poll("greedy marked unschedulable", lambda: waiting_reason("greedy"))
        assert node_of("greedy") is None and "gpu" in reason.lower(), reason


def gang_pod(name: str, group: str, size: int, gpus: int, **extra: Any) -> dict[str, Any]:
    """A pod for `pffs scheduler` in gang `group` of `size`; `labels`, `annotations` and `spec` add to it."""
    labels = {"scheduling.x-k8s.io/pod-group": group} | extra.get("labels", {})
    annotations = {"pffs.io/min-member": str(size)} | extra.get("annotations", {})
    return {
        "metadata": {"name": name, "labels": labels, "annotations": annotations},
        "spec": {
            "schedulerName": "pffs-scheduler",
            "containers": [
                {
                    "name": "c",
                    "image": "busybox:1.36",
                    "resources": {"limits": {"nvidia.com/gpu": str(gpus)}, "requests": {"cpu": "1"}},
                }
            ],
        }
        | extra.get("spec", {}),
    }


@contextlib.contextmanager
def pffs_scheduler(cluster: KubeControlPlane, queues: Path, log_path: Path) -> Iterator[None]:
    """`pffs scheduler` against the cluster, cycling every second, stopped after (also on failure)."""
    with open(log_path, "ab") as log:
        scheduler = subprocess.Popen(
            pffs_scheduler_command(cluster.kubeconfig, queues, "1", "-v"), stderr=log
        )
    try:
        yield
    finally:
        scheduler.terminate()
        scheduler.wait(timeout=15)


def test_pffs_scheduler_preempts_a_lower_priority_gang_whole_through_the_eviction_api(
    cluster: KubeControlPlane, tmp_path: Path
) -> None:
    """Two 4-GPU nodes full with a low-priority gang; a high-priority gang of the same queue needs both.
    Every pod of the low gang is evicted through the Eviction API (the API server marks it for graceful
    deletion), the high gang waits, bound in no part, until they are gone (here no kubelet runs on these
    Nodes, so the test deletes the terminating pods as a kubelet would), then binds whole."""
    from kubernetes import client

    model = "PREEMPT-TEST-GPU"  # a GPU model of these nodes only: the other tests' nodes stay out of it
    for name in ("preempt-1", "preempt-2"):
        make_node(cluster.api(), name, cpu="16", gpus=4, labels={"nvidia.com/gpu.product": model})
    scheduling = client.SchedulingV1Api(cluster.api())
    for name, value in (("pffs-test-low", 10), ("pffs-test-high", 1000)):
        scheduling.create_priority_class({"metadata": {"name": name}, "value": value})
    queues = tmp_path / "queues.yaml"
    queues.write_text(yaml.safe_dump({"queues": [{"name": "default", "weight": 1}]}))
    core = client.CoreV1Api(cluster.api())

    def pod(name: str, group: str, priority: str) -> dict[str, Any]:
        spec = {"priorityClassName": priority, "nodeSelector": {"nvidia.com/gpu.product": model}}
        return gang_pod(name, group, 2, 4, spec=spec)

    def read(name: str) -> Any:
        try:
            return core.read_namespaced_pod(name, "default")
        except client.ApiException as exc:
            if exc.status == 404:
                return None
            raise

    with pffs_scheduler(cluster, queues, tmp_path / "pffs-scheduler.log"):
        for i in range(2):
            core.create_namespaced_pod("default", pod(f"low-{i}", "low", "pffs-test-low"))
        nodes = {poll(f"low-{i} bound", lambda i=i: read(f"low-{i}").spec.node_name) for i in range(2)}
        assert nodes == {"preempt-1", "preempt-2"}
        for i in range(2):
            core.create_namespaced_pod("default", pod(f"high-{i}", "high", "pffs-test-high"))
        for i in range(2):
            poll(f"low-{i} evicted", lambda i=i: read(f"low-{i}").metadata.deletion_timestamp)
        assert all(read(f"high-{i}").spec.node_name is None for i in range(2)), "bound before room was free"
        for i in range(2):  # what the kubelet does once the containers have stopped
            core.delete_namespaced_pod(f"low-{i}", "default", grace_period_seconds=0)
        placed = {poll(f"high-{i} bound", lambda i=i: read(f"high-{i}").spec.node_name) for i in range(2)}
        assert placed == {"preempt-1", "preempt-2"}


# The scheduler's and extender's view: listed once, then watched (no list per cycle)


def test_an_informer_follows_nodes_through_a_watch_and_lists_again_after_410_gone(
    cluster: KubeControlPlane,
) -> None:
    from kubernetes import client

    from pffs.scheduler.kube.api_client import kubeconfig_api
    from pffs.scheduler.kube.informer import Informer

    seen: dict[str, Any] = {}
    informer = Informer(
        kubeconfig_api(cluster.kubeconfig),
        "/api/v1/nodes",
        listener=lambda key, obj: seen.__setitem__(key, obj),
        backoff=0.2,
    )
    try:
        before = {n["metadata"]["name"] for n in informer.items()}  # listed, and the watch starts
        poll("the watch connected", informer.watching.is_set)
        make_node(cluster.api(), "watched-1", annotations={"note": "first"})
        poll("watched-1 arrives by the watch", lambda: "watched-1" in names(informer))
        core = client.CoreV1Api(cluster.api())
        core.patch_node("watched-1", {"metadata": {"annotations": {"note": "second"}}})
        poll(
            "the change arrives",
            lambda: (
                (seen.get("watched-1") or {}).get("metadata", {}).get("annotations", {}).get("note")
                == "second"
            ),
        )
        core.delete_node("watched-1")
        poll("the deletion arrives", lambda: seen.get("watched-1", 0) is None)
        assert names(informer) == before and informer.relists == 0
    finally:
        informer.stop()
    # A watch from a version the server no longer keeps: 410 Gone, a fresh list, and the watch goes on from
    # there. (The test API server watches ConfigMaps from etcd itself, which compacts every 10 s.)
    api = kubeconfig_api(cluster.kubeconfig)
    configmaps = "/api/v1/namespaces/default/configmaps"

    def first_event_from_version_1() -> Any:
        events = api.watch(configmaps, "1", seconds=1)
        try:
            return next(iter(events), {"type": "none"})
        finally:
            events.close()

    core.create_namespaced_config_map("default", {"metadata": {"name": "before-gone"}})
    poll("version 1 compacted away", lambda: first_event_from_version_1()["type"] == "ERROR")
    stale = Informer(api, configmaps, backoff=0.2)
    stale.resource_version = "1"
    threading.Thread(target=stale._run, daemon=True).start()  # the watch loop, without the first list
    try:
        poll("a list after 410 Gone", lambda: stale.relists >= 1)
        assert "before-gone" in names(stale)  # the list's objects
        core.create_namespaced_config_map("default", {"metadata": {"name": "after-gone"}})
        poll("the watch goes on after the new list", lambda: "after-gone" in names(stale))
        assert stale.watching.is_set()
    finally:
        stale.stop()


def names(informer: Any) -> set[str]:
    return {n["metadata"]["name"] for n in informer.items()}  # watched: no request
