"""`pffs scheduler`: Kubernetes quantities, the translation of Node/Pod/PodGroup JSON into the core's objects,
the queues YAML, and the scheduling loop end to end.

The loop tests (`test_..._fake_apiserver`) run against an in-process HTTP server that speaks the Kubernetes
REST wire format for the few endpoints the scheduler uses (paged lists of Nodes, Pods and PodGroups, the
pods/binding and pods/eviction subresources, a strategic-merge PATCH of pods/status, Events), with
bearer-token auth and Status error bodies. A real kube-apiserver cannot run on this machine yet (a later
issue builds one): these tests stand in for it and should move to it then.
"""

from __future__ import annotations

import copy
import json
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from fractions import Fraction
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import FakeHttpServer, JsonHandler

from pffs.cli.main import main
from pffs.scheduler.core.objects import MILLI, UNLIMITED, Gpu, Queue, Resources
from pffs.scheduler.kube.api_client import ApiError, KubeApi, kubeconfig_api
from pffs.scheduler.kube.json_fields import BadObject
from pffs.scheduler.kube.loop import Scheduler
from pffs.scheduler.kube.nodes import node_from_json
from pffs.scheduler.kube.pods import pod_from_json, pod_requests
from pffs.scheduler.kube.quantity import parse_quantity
from pffs.scheduler.kube.queues_config import QueuesConfigError, load_queues, parse_queues
from pffs.scheduler.kube.snapshot import build_snapshot
from pffs.scheduler.kube.taints import tolerates
from pffs.testing.kubeconfig import token_kubeconfig
from pffs.testing.s3_server import free_ports

GIB_MIB = 1024
TOKEN = "test-token-0123456789"

# ------------------------------------------------------------------------------------------- objects


def make_node(
    name: str,
    cpu: str = "8",
    memory: str = "32Gi",
    gpus: int = 0,
    *,
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
    ready: bool = True,
    unschedulable: bool = False,
    taints: list[dict[str, str]] | None = None,
) -> dict[str, Any]:
    """A Node as `kubectl get node -o json` shows it (trimmed of fields the scheduler does not read)."""
    allocatable = {"cpu": cpu, "memory": memory, "pods": "110", "ephemeral-storage": "95551679124"}
    if gpus:
        allocatable["nvidia.com/gpu"] = str(gpus)
    spec: dict[str, Any] = {"podCIDR": "10.244.1.0/24"}
    if unschedulable:
        spec["unschedulable"] = True
    if taints:
        spec["taints"] = taints
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "uid": f"uid-{name}",
            "resourceVersion": "4711",
            "creationTimestamp": "2025-11-01T10:00:00Z",
            "labels": {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux", **(labels or {})},
            "annotations": {"node.alpha.kubernetes.io/ttl": "0", **(annotations or {})},
        },
        "spec": spec,
        "status": {
            "capacity": dict(allocatable),
            "allocatable": allocatable,
            "conditions": [
                {"type": "MemoryPressure", "status": "False", "reason": "KubeletHasSufficientMemory"},
                {"type": "Ready", "status": "True" if ready else "False", "reason": "KubeletReady"},
            ],
        },
    }


def make_pod(
    name: str,
    cpu: str = "1",
    memory: str = "1Gi",
    gpus: int = 0,
    *,
    namespace: str = "team-a",
    scheduler: str = "pffs-scheduler",
    node: str | None = None,
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
    priority: int | None = None,
    phase: str | None = None,
    created: str = "2025-11-24T08:00:00Z",
) -> dict[str, Any]:
    """A Pod as the API serves it after admission (defaults filled in, requests as given)."""
    requests: dict[str, str] = {"cpu": cpu, "memory": memory}
    limits: dict[str, str] = {}
    if gpus:
        limits["nvidia.com/gpu"] = str(gpus)
        requests["nvidia.com/gpu"] = str(gpus)
    spec: dict[str, Any] = {
        "schedulerName": scheduler,
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": 30,
        "dnsPolicy": "ClusterFirst",
        "serviceAccountName": "default",
        "containers": [
            {
                "name": "train",
                "image": "pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime",
                "resources": {"requests": requests, "limits": limits},
            }
        ],
        "tolerations": [
            {"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute"},
        ],
        "priority": 0 if priority is None else priority,
    }
    if node:
        spec["nodeName"] = node
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": f"uid-{namespace}-{name}",
            "resourceVersion": "100",
            "creationTimestamp": created,
            "labels": labels or {},
            "annotations": annotations or {},
        },
        "spec": spec,
        "status": {"phase": phase or ("Running" if node else "Pending"), "qosClass": "Burstable"},
    }


def make_podgroup(name: str, min_member: int, namespace: str = "team-a", **labels: str) -> dict[str, Any]:
    return {
        "apiVersion": "scheduling.x-k8s.io/v1alpha1",
        "kind": "PodGroup",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "creationTimestamp": "2025-11-24T07:00:00Z",
            "labels": labels,
        },
        "spec": {"minMember": min_member, "scheduleTimeoutSeconds": 60},
        "status": {"phase": "Pending"},
    }


def gang(name: str, size: int, **kw: Any) -> list[dict[str, Any]]:
    labels = {"scheduling.x-k8s.io/pod-group": name, **kw.pop("labels", {})}
    return [make_pod(f"{name}-{i}", labels=labels, **kw) for i in range(size)]


# ------------------------------------------------------------------------------------------- quantities


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("4", 4),
        ("500m", Fraction(1, 2)),
        ("16Gi", 16 * 2**30),
        ("1e3", 1000),
        ("1E3", 1000),
        ("2e-3", Fraction(2, 1000)),
        ("1E", 10**18),  # a lone E is exa, not an exponent
        ("1.5G", 1_500_000_000),
        ("100Mi", 100 * 2**20),
        ("63461188Ki", 63461188 * 1024),
        ("7910m", Fraction(791, 100)),
        ("2k", 2000),
        ("0.1", Fraction(1, 10)),
        (".5", Fraction(1, 2)),
        ("250u", Fraction(1, 4000)),
        ("3n", Fraction(3, 10**9)),
        ("+1", 1),
        ("-1", -1),
        ("1Ei", 2**60),
    ],
)
def test_quantity_parser_accepts_kubernetes_quantities(text: str, value: Fraction | int) -> None:
    assert parse_quantity(text) == value


@pytest.mark.parametrize(
    "text",
    ["", "1K", "abc", "1.2.3", "1e", "Gi", "Mi", "1 Gi", "1mi", "1Gb", "--1", "1e99", ".", "+", "9" * 5000],
)
def test_quantity_parser_rejects_what_kubernetes_rejects(text: str) -> None:
    with pytest.raises(BadObject, match=r"quantit|exponent"):
        parse_quantity(text)


# ------------------------------------------------------------------------------------------- nodes

DGX = make_node(
    "dgx-01",
    cpu="223900m",
    memory="2063210068Ki",
    gpus=8,
    labels={"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB", "pffs.io/tor": "tor-3"},
    annotations={
        "pffs.io/gpu-topology": json.dumps(
            {"nvlink_groups": [[0, 1, 2, 3], [4, 5, 6, 7]], "numa": [0, 0, 0, 0, 1, 1, 1, 1]}
        ),
        "pffs.io/cache": json.dumps(
            {"datasets": {"s3://datasets/imagenet/": {"cached_bytes": 3, "total_bytes": 4}}}
        ),
    },
)


def test_node_translation_reads_capacity_model_tor_topology_and_cache() -> None:
    node = node_from_json(DGX)
    assert node.name == "dgx-01"
    assert node.cpu_milli == 223_900
    assert node.memory_mib == 2063210068 // 1024  # Ki -> Mi, rounded down: never promise more than there is
    assert node.gpus == tuple(Gpu(i, i // 4, i // 4) for i in range(8))
    assert node.gpu_model == "NVIDIA-A100-SXM4-80GB"
    assert node.tor == "tor-3"
    assert node.labels["kubernetes.io/hostname"] == "dgx-01"
    assert node.cached == {"s3://datasets/imagenet": 0.75}
    assert node.schedulable


def test_node_without_topology_annotation_has_plain_gpus_and_cordoned_or_notready_is_unschedulable() -> None:
    plain = node_from_json(make_node("n1", gpus=2))
    assert plain.gpus == (Gpu(0), Gpu(1)) and plain.tor == "" and plain.gpu_model == ""
    assert not node_from_json(make_node("n2", unschedulable=True)).schedulable
    assert not node_from_json(make_node("n3", ready=False)).schedulable
    no_conditions = make_node("n4")
    del no_conditions["status"]["conditions"]
    assert not node_from_json(no_conditions).schedulable  # readiness unknown: not a place to bind to


def _broken_node(change: Any) -> dict[str, Any]:
    node = copy.deepcopy(DGX)
    change(node)
    return node


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda n: n["status"]["allocatable"].pop("memory"), "Node dgx-01: status.allocatable has no memory"),
        (
            lambda n: n["status"]["allocatable"].update(cpu="lots"),
            "Node dgx-01: allocatable cpu: 'lots' is not",
        ),
        (
            lambda n: n["status"]["allocatable"].update({"nvidia.com/gpu": "1500m"}),
            "must be a whole number",
        ),
        (
            lambda n: n["metadata"]["annotations"].update({"pffs.io/gpu-topology": "{nvlink"}),
            "annotation pffs.io/gpu-topology is not JSON",
        ),
        (
            lambda n: n["metadata"]["annotations"].update(
                {"pffs.io/gpu-topology": '{"nvlink_groups": [[0, 1, 8]]}'}
            ),
            "GPU index 8 is not one of the node's 8 GPUs",
        ),
        (
            lambda n: n["metadata"]["annotations"].update({"pffs.io/gpu-topology": '{"numa": [0, 1]}'}),
            "numa must list one NUMA domain",
        ),
        (lambda n: n["metadata"].update(labels=["a"]), "metadata.labels must be an object"),
        (lambda n: n["metadata"].pop("name"), "a Node has no metadata.name"),
    ],
)
def test_malformed_node_is_one_clear_error(change: Any, message: str) -> None:
    with pytest.raises(BadObject) as caught:
        node_from_json(_broken_node(change))
    assert message in str(caught.value)


# ------------------------------------------------------------------------------------------- pods


def test_pod_requests_sum_containers_against_init_containers_with_sidecars_and_overhead() -> None:
    pod = make_pod("p", cpu="500m", memory="1Gi")
    spec = pod["spec"]
    spec["containers"].append({"name": "log", "resources": {"requests": {"cpu": "250m", "memory": "256Mi"}}})
    spec["initContainers"] = [
        {"name": "fetch", "resources": {"requests": {"cpu": "2", "memory": "512Mi"}}},
        {
            "name": "mesh",
            "restartPolicy": "Always",
            "resources": {"requests": {"cpu": "100m", "memory": "1Gi"}},
        },
        {"name": "late", "resources": {"requests": {"cpu": "1", "memory": "64Mi"}}},
    ]
    spec["overhead"] = {"cpu": "50m"}
    requests = pod_requests(pod)
    # cpu: containers 750m + sidecar 100m = 850m < first init 2000m  -> 2000m, + 50m overhead
    assert requests["cpu"] == Fraction(2050, 1000)
    # memory: containers 1280Mi + sidecar 1024Mi = 2304Mi > late init 64Mi + sidecar 1024Mi
    assert requests["memory"] == 2304 * 2**20


def test_pod_translation_reads_gpus_models_datasets_selector_and_priority() -> None:
    pod_json = make_pod(
        "train-0",
        cpu="7500m",
        memory="60Gi",
        gpus=4,
        annotations={"pffs.io/datasets": "s3a://datasets/imagenet/, s3://datasets/coco"},
        priority=1000,
    )
    pod_json["spec"]["nodeSelector"] = {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    # The API server copies an extended resource's limit to its request; an object without it still counts.
    del pod_json["spec"]["containers"][0]["resources"]["requests"]["nvidia.com/gpu"]
    pod = pod_from_json(pod_json, "podgroup:team-a/train")
    assert pod.name == "team-a/train-0" and pod.group == "podgroup:team-a/train"
    assert (pod.cpu_milli, pod.memory_mib, pod.gpu_count, pod.gpu_milli) == (7500, 60 * GIB_MIB, 4, MILLI)
    assert pod.gpu_models == frozenset({"NVIDIA-H100-80GB-HBM3"})
    assert pod.node_selector == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert pod.datasets == ("s3://datasets/imagenet", "s3://datasets/coco")
    assert pod_from_json(make_pod("solo")).group == "pod:team-a/solo"


def test_fractional_gpu_and_model_list_from_annotations() -> None:
    share = pod_from_json(
        make_pod(
            "infer",
            cpu="100m",
            memory="100Mi",
            annotations={"pffs.io/gpu-milli": "250", "pffs.io/gpu-models": "A10, L4"},
        )
    )
    assert (share.gpu_count, share.gpu_milli, share.request.gpu_milli) == (1, 250, 250)
    assert share.gpu_models == frozenset({"A10", "L4"})
    assert share.cpu_milli == 100 and share.memory_mib == 100


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda p: p["metadata"]["annotations"].update({"pffs.io/gpu-milli": "250"}),
            "drop the nvidia.com/gpu request",
        ),
        (lambda p: p["metadata"]["annotations"].update({"pffs.io/gpu-milli": "1500"}), "must be 1-1000"),
        (
            lambda p: p["spec"]["containers"][0]["resources"]["requests"].update(cpu="2 cores"),
            "spec.containers[0] request cpu: '2 cores' is not a Kubernetes quantity",
        ),
        (
            lambda p: p["spec"]["containers"][0]["resources"]["requests"].update({"nvidia.com/gpu": "500m"}),
            "nvidia.com/gpu must be a whole number",
        ),
        (lambda p: p["spec"].update(containers={"name": "x"}), "spec.containers must be a list"),
        (lambda p: p["metadata"]["labels"].update(team=3), "metadata.labels['team'] must be a string"),
        (lambda p: p["spec"].update(priority="high"), "spec.priority must be an integer"),
        (
            lambda p: (
                p["spec"].update(nodeSelector={"nvidia.com/gpu.product": "T4"}),
                p["metadata"]["annotations"].update({"pffs.io/gpu-models": "A100"}),
            ),
            "no node can match both",
        ),
    ],
)
def test_malformed_pod_is_one_clear_error(change: Any, message: str) -> None:
    pod = make_pod("bad", gpus=1)
    change(pod)
    with pytest.raises(BadObject) as caught:
        pod_from_json(pod)
    assert str(caught.value).startswith("Pod team-a/bad: ")
    assert message in str(caught.value)


def test_tolerations_against_taints() -> None:
    gpu_taint = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
    tainted = make_node("g", taints=[gpu_taint, {"key": "x", "effect": "PreferNoSchedule"}])
    pod = make_pod("p")
    assert not tolerates(pod, tainted)
    pod["spec"]["tolerations"].append({"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"})
    assert tolerates(pod, tainted)
    wrong_value = make_pod("q")
    wrong_value["spec"]["tolerations"].append({"key": "nvidia.com/gpu", "value": "absent"})
    assert not tolerates(wrong_value, tainted)
    assert tolerates(make_pod("r"), make_node("plain"))


# ------------------------------------------------------------------------------------------- snapshot

QUEUES = [Queue("default"), Queue("research", weight=2)]


def test_snapshot_groups_from_podgroup_objects_annotations_and_singletons() -> None:
    pods = [
        *gang("train", 3, labels={"pffs.io/queue": "research"}, priority=10),
        *gang("etl", 2, annotations={"pffs.io/min-member": "2"}),
        make_pod("solo"),
        make_pod("other", scheduler="default-scheduler"),
    ]
    snap = build_snapshot([make_node("n1")], pods, [make_podgroup("train", 3)], QUEUES)
    groups = {g.name: g for g in snap.groups}
    assert set(groups) == {"podgroup:team-a/train", "podgroup:team-a/etl", "pod:team-a/solo"}
    train = groups["podgroup:team-a/train"]
    assert (train.min_member, train.queue, train.priority, len(train.pods)) == (3, "research", 10, 3)
    assert train.created < groups["podgroup:team-a/etl"].created  # the PodGroup's own creation time
    assert groups["podgroup:team-a/etl"].min_member == 2
    assert groups["pod:team-a/solo"].min_member == 1 and groups["pod:team-a/solo"].queue == "default"
    assert snap.running == [] and snap.problems == {}


def test_snapshot_reports_groups_that_cannot_be_offered() -> None:
    pods = [
        *gang("nopg", 2),  # neither a PodGroup nor the annotation
        make_pod("lost", labels={"pffs.io/queue": "nope"}),
        make_pod("torn-0", labels={"scheduling.x-k8s.io/pod-group": "torn", "pffs.io/queue": "research"}),
        make_pod("torn-1", labels={"scheduling.x-k8s.io/pod-group": "torn"}),
        make_pod("broken", cpu="1.5 cores"),
    ]
    snap = build_snapshot([make_node("n1")], pods, [make_podgroup("torn", 2)], QUEUES)
    assert snap.groups == []
    assert "PodGroup team-a/nopg does not exist" in snap.waiting["podgroup:team-a/nopg"]
    assert "queue 'nope' is not in the queues config" in snap.waiting["pod:team-a/lost"]
    assert "different queues (default, research)" in snap.waiting["podgroup:team-a/torn"]
    assert "'1.5 cores' is not a Kubernetes quantity" in snap.problems["Pod team-a/broken"]


def test_running_pods_become_placements_with_annotated_or_first_free_gpus() -> None:
    node = make_node("g1", gpus=4)
    pods = [
        make_pod("a", gpus=2, node="g1", annotations={"pffs.io/gpus": "2,3"}),
        make_pod("b", gpus=1, node="g1"),  # no annotation: the first free GPU
        make_pod("c", node="g1", annotations={"pffs.io/gpu-milli": "300"}),  # a share, tightest GPU
        make_pod("d", node="g1", scheduler="default-scheduler"),
        make_pod("done", node="g1", phase="Succeeded", gpus=4),
    ]
    snap = build_snapshot([node], pods, [], QUEUES)
    gpus = {p.pod.name: p.gpus for p in snap.running}
    assert gpus == {"team-a/a": (2, 3), "team-a/b": (0,), "team-a/c": (1,), "team-a/d": ()}
    assert snap.ours == {"team-a/a", "team-a/b", "team-a/c"}  # only these may ever be evicted
    # Running pods of ours are in their groups (the core counts them against their queue).
    assert {g.name for g in snap.groups} == {"pod:team-a/a", "pod:team-a/b", "pod:team-a/c"}


# ------------------------------------------------------------------------------------------- queues


def test_queues_yaml_good(tmp_path: Path) -> None:
    path = tmp_path / "queues.yaml"
    path.write_text(
        """
queues:
  - name: default
  - name: research
    weight: 3
    guaranteed: {cpu: "16", memory: 64Gi, nvidia.com/gpu: 4}
    capability: {cpu: 64, memory: 256Gi, nvidia.com/gpu: "16"}
    overcommit: true
    reclaimable: false
weights: {locality: 2.5, tor: 0}
"""
    )
    queues, weights = load_queues(path)
    assert queues[0] == Queue("default")
    research = queues[1]
    assert research.weight == 3 and research.overcommit and not research.reclaimable
    assert research.guaranteed == Resources(16_000, 64 * GIB_MIB, 4 * MILLI)
    assert research.capability == Resources(64_000, 256 * GIB_MIB, 16 * MILLI)
    assert weights == {"binpack": 0.0, "fragmentation": 1.0, "topology": 1.0, "tor": 0.0, "locality": 2.5}
    # a capability naming some resources leaves the others unlimited; a bare list works too
    partial, none = parse_queues([{"name": "q", "capability": {"nvidia.com/gpu": 2}}])
    assert partial[0].capability == Resources(UNLIMITED.cpu_milli, UNLIMITED.memory_mib, 2 * MILLI)
    assert none is None
    assert load_queues(None) == ([Queue("default")], None)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("queues:\n  - name: a\n    capability: {cpu: 4x}\n", "queues[0].capability.cpu: Value error, '4x'"),
        ("queues:\n  - name: a\n    wieght: 2\n", "queues[0].wieght: Extra inputs are not permitted"),
        (
            "queues:\n  - name: a\n    weight: 0\n",
            "queues[0].weight: Input should be greater than or equal to 1",
        ),
        ("queues:\n  - weight: 2\n", "queues[0].name: Field required"),
        ("queues:\n  - name: a\n  - name: a\n", "queue 'a' is defined twice"),
        (
            "queues:\n  - name: a\n    guaranteed: {nvidia.com/gpu: 4}\n"
            "    capability: {nvidia.com/gpu: 2}\n",
            "queues[0] (a): guaranteed is more than capability",
        ),
        ("queues:\n  - name: a\n    capability: {gpu: 2}\n", "queues[0].capability.gpu: Extra inputs"),
        ("queues: [\n", "not valid YAML at line"),
        ("queues: []\n", "queues: List should have at least 1 item"),
        ("42\n", "expected a mapping with a 'queues' list"),
        ("queues:\n  - name: a\n    capability: {memory: -1Gi}\n", "must not be negative"),
    ],
)
def test_queues_yaml_bad_is_one_message_with_path_and_field(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "queues.yaml"
    path.write_text(text)
    with pytest.raises(QueuesConfigError) as caught:
        load_queues(path)
    assert str(caught.value).startswith(f"{path}: ")
    assert message in str(caught.value)


def test_queues_file_missing(tmp_path: Path) -> None:
    with pytest.raises(QueuesConfigError, match="cannot read the queues file"):
        load_queues(tmp_path / "absent.yaml")


# ------------------------------------------------------------------------------------------- fake API server


class FakeApiServer(FakeHttpServer):
    """The Kubernetes REST endpoints the scheduler uses, over real HTTP, with the API server's semantics for
    them: lists page by page (at most `page` items, `continue` tokens), a Binding sets nodeName and copies
    its annotations onto the pod (409 if already bound), an Eviction deletes the pod, unknown resources are
    404 Status objects, and a request without the bearer token is 401. It cannot watch (405, as some proxies
    answer): the scheduler lists at every cycle, which keeps these tests' cycles exact; watch attempts are
    kept apart in `watches`. Watching is tested against the real API server (test_kube_real.py)."""

    def __init__(self, page: int = 2) -> None:
        self.nodes: list[dict[str, Any]] = []
        self.pods: list[dict[str, Any]] = []
        self.podgroups: list[dict[str, Any]] | None = []  # None: the CRD is not installed
        self.pdb_blocked: set[str] = set()  # pod keys a PodDisruptionBudget protects: eviction is 429
        self.page = page
        self.requests: list[tuple[str, str, Any, str]] = []  # method, path, body, content type
        self.watches: list[str] = []  # paths a watch was asked for
        self.warmups: list[dict[str, Any]] = []  # DatasetWarmups made (POSTed)
        super().__init__(_FakeHandler)

    def posts(self, suffix: str) -> list[tuple[str, Any]]:
        with self.lock:
            return [(p, b) for m, p, b, _ in self.requests if m == "POST" and p.endswith(suffix)]

    def pod(self, key: str) -> dict[str, Any] | None:
        namespace, name = key.split("/")
        for pod in self.pods:
            if pod["metadata"]["namespace"] == namespace and pod["metadata"]["name"] == name:
                return pod
        return None


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Success" if code < 400 else "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


class _FakeHandler(JsonHandler):
    api: FakeApiServer

    def _handle(self, method: str) -> None:
        body = self._body()
        url = urllib.parse.urlsplit(self.path)
        query = dict(urllib.parse.parse_qsl(url.query))
        with self.api.lock:
            if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                self.api.requests.append((method, url.path, body, self.headers.get("Content-Type", "")))
                self._send(401, _status(401, "Unauthorized", "Unauthorized"))
                return
            if query.get("watch") in ("1", "true"):
                self.api.watches.append(url.path)
                self._send(405, _status(405, "MethodNotAllowed", "watch is not supported here"))
                return
            self.api.requests.append((method, url.path, body, self.headers.get("Content-Type", "")))
            code, payload = self._route(method, url.path, query, body)
        self._send(code, payload)

    def _route(self, method: str, path: str, query: dict[str, str], body: Any) -> tuple[int, Any]:
        api = self.api
        lists = {
            "/api/v1/nodes": ("v1", "NodeList", api.nodes),
            "/api/v1/pods": ("v1", "PodList", api.pods),
            "/apis/scheduling.x-k8s.io/v1alpha1/podgroups": (
                "scheduling.x-k8s.io/v1alpha1",
                "PodGroupList",
                api.podgroups,
            ),
        }
        if method == "GET" and path in lists:
            version, kind, items = lists[path]
            if items is None:
                return 404, _status(404, "NotFound", "the server could not find the requested resource")
            start = int(query.get("continue") or 0)
            size = min(int(query.get("limit") or 10**9), api.page)
            meta: dict[str, Any] = {"resourceVersion": "12345"}
            if start + size < len(items):
                meta["continue"] = str(start + size)
            return 200, {
                "apiVersion": version,
                "kind": kind,
                "metadata": meta,
                "items": copy.deepcopy(items[start : start + size]),
            }
        parts = path.strip("/").split("/")
        # api v1 namespaces NS pods NAME SUB
        if len(parts) == 7 and parts[:3] == ["api", "v1", "namespaces"] and parts[4] == "pods":
            namespace, name, sub = parts[3], parts[5], parts[6]
            pod = api.pod(f"{namespace}/{name}")
            if pod is None:
                return 404, _status(404, "NotFound", f'pods "{name}" not found')
            if method == "POST" and sub == "binding":
                if body.get("kind") != "Binding" or body["target"].get("kind") != "Node":
                    return 400, _status(400, "BadRequest", "not a Binding to a Node")
                if pod["spec"].get("nodeName"):
                    return 409, _status(409, "Conflict", f"pod {name} is already assigned to a node")
                pod["spec"]["nodeName"] = body["target"]["name"]
                pod["metadata"]["annotations"].update(body["metadata"].get("annotations") or {})
                pod["status"]["phase"] = "Running"
                return 201, _status(201, "", "")
            if method == "POST" and sub == "eviction":
                if body.get("kind") != "Eviction" or body.get("apiVersion") != "policy/v1":
                    return 400, _status(400, "BadRequest", "not a policy/v1 Eviction")
                if f"{namespace}/{name}" in api.pdb_blocked:
                    message = "Cannot evict pod as it would violate the pod's disruption budget."
                    return 429, _status(429, "TooManyRequests", message)
                api.pods.remove(pod)
                return 201, _status(201, "", "")
            if method == "PATCH" and sub == "status":
                if self.headers.get("Content-Type") != "application/strategic-merge-patch+json":
                    return 415, _status(415, "UnsupportedMediaType", "unsupported patch type")
                by_type = {c["type"]: c for c in pod["status"].get("conditions", [])}
                by_type.update({c["type"]: c for c in body["status"]["conditions"]})
                pod["status"]["conditions"] = list(by_type.values())
                return 200, pod
        if len(parts) == 5 and parts[4] == "events" and method == "POST":
            return 201, body
        if len(parts) == 6 and parts[5] == "datasetwarmups" and method == "POST":
            made = {**body, "metadata": {**body["metadata"], "name": body["metadata"]["generateName"] + "x1"}}
            api.warmups.append(made)
            return 201, made
        return 404, _status(404, "NotFound", "the server could not find the requested resource")


@pytest.fixture
def apiserver() -> Iterator[FakeApiServer]:
    with FakeApiServer() as api:
        yield api


@pytest.fixture
def kubeconfig(tmp_path: Path, apiserver: FakeApiServer) -> Path:
    return token_kubeconfig(tmp_path / "kubeconfig", apiserver.url, TOKEN)


def scheduler_for(kubeconfig: Path, queues: list[Queue] | None = None) -> Scheduler:
    return Scheduler(kubeconfig_api(kubeconfig), queues or [Queue("default")])


def binding(namespace: str, name: str, node: str, gpus: str | None = None) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name, "namespace": namespace}
    if gpus is not None:
        metadata["annotations"] = {"pffs.io/gpus": gpus}
    return {
        "apiVersion": "v1",
        "kind": "Binding",
        "metadata": metadata,
        "target": {"apiVersion": "v1", "kind": "Node", "name": node},
    }


def test_binds_pods_with_exact_binding_bodies_and_ignores_other_schedulers_fake_apiserver(
    apiserver: FakeApiServer, kubeconfig: Path
) -> None:
    apiserver.nodes = [
        make_node("cpu-1", cpu="4"),
        make_node("gpu-1", gpus=4),
        make_node("cordoned", unschedulable=True),
    ]
    apiserver.pods = [
        make_pod("web", cpu="2", namespace="team-b"),
        make_pod("train", gpus=2, cpu="2"),
        make_pod("theirs", cpu="1", scheduler="default-scheduler"),
        make_pod("done", phase="Succeeded"),
    ]
    report = scheduler_for(kubeconfig).cycle()
    bindings = dict(apiserver.posts("/binding"))
    assert set(bindings) == {
        "/api/v1/namespaces/team-b/pods/web/binding",
        "/api/v1/namespaces/team-a/pods/train/binding",
    }
    assert bindings["/api/v1/namespaces/team-a/pods/train/binding"] == binding(
        "team-a", "train", "gpu-1", "0,1"
    )
    web = bindings["/api/v1/namespaces/team-b/pods/web/binding"]
    assert web["metadata"] == {"name": "web", "namespace": "team-b"}  # no GPUs: no annotation
    assert web["target"]["name"] in {"cpu-1", "gpu-1"}
    assert sorted(report.bound) == sorted([("team-b/web", web["target"]["name"]), ("team-a/train", "gpu-1")])
    assert apiserver.pod("team-a/train")["metadata"]["annotations"]["pffs.io/gpus"] == "0,1"  # type: ignore[index]
    assert apiserver.pod("team-a/theirs")["spec"].get("nodeName") is None  # type: ignore[index]
    # the lists were read page by page (2 items a page)
    pod_lists = [p for m, p, _, _ in apiserver.requests if m == "GET" and p == "/api/v1/pods"]
    assert len(pod_lists) == 2
    # a second cycle sees them running and binds nothing again
    again = scheduler_for(kubeconfig).cycle()
    assert again.bound == [] and again.errors == []
    assert len(apiserver.posts("/binding")) == 2


def test_gang_of_three_with_room_for_two_binds_nothing_fake_apiserver(
    apiserver: FakeApiServer, kubeconfig: Path
) -> None:
    apiserver.nodes = [make_node("gpu-1", gpus=1, cpu="16"), make_node("gpu-2", gpus=1, cpu="16")]
    apiserver.pods = gang("train", 3, gpus=1)
    apiserver.podgroups = [make_podgroup("train", 3)]
    sched = scheduler_for(kubeconfig)
    report = sched.cycle()
    assert apiserver.posts("/binding") == []
    assert "no fit: 2 of the 3 pods" in report.pending["podgroup:team-a/train"]
    for i in range(3):
        pod = apiserver.pod(f"team-a/train-{i}")
        assert pod is not None and pod["spec"].get("nodeName") is None
        (condition,) = pod["status"]["conditions"]
        assert condition["type"] == "PodScheduled" and condition["status"] == "False"
        assert condition["reason"] == "Unschedulable" and "no fit" in condition["message"]
    # the same reason is not patched again every cycle
    patches = len([r for r in apiserver.requests if r[0] == "PATCH"])
    sched.cycle()
    assert len([r for r in apiserver.requests if r[0] == "PATCH"]) == patches
    # a third GPU arrives: the whole gang binds, one pod per node
    apiserver.nodes.append(make_node("gpu-3", gpus=1, cpu="16"))
    report = sched.cycle()
    assert sorted(node for _, node in report.bound) == ["gpu-1", "gpu-2", "gpu-3"]


def test_min_member_from_annotation_without_podgroup_crd_fake_apiserver(
    apiserver: FakeApiServer, kubeconfig: Path
) -> None:
    apiserver.podgroups = None  # the CRD is not installed: 404
    apiserver.nodes = [make_node("n1", cpu="4")]
    apiserver.pods = [
        *gang("pair", 2, cpu="2", annotations={"pffs.io/min-member": "2"}),
        *gang("trio", 3, cpu="1"),  # no annotation and no PodGroup: waits, with the reason
    ]
    report = scheduler_for(kubeconfig).cycle()
    assert sorted(report.bound) == [("team-a/pair-0", "n1"), ("team-a/pair-1", "n1")]
    assert "PodGroup team-a/trio does not exist" in report.pending["podgroup:team-a/trio"]
    message = apiserver.pod("team-a/trio-0")["status"]["conditions"][0]["message"]  # type: ignore[index]
    assert "pffs.io/min-member" in message


def test_malformed_pod_gets_an_event_and_the_others_still_bind_fake_apiserver(
    apiserver: FakeApiServer, kubeconfig: Path
) -> None:
    apiserver.nodes = [make_node("n1"), {"kind": "Node", "metadata": {"name": "broken"}}]
    apiserver.pods = [make_pod("bad", cpu="one"), make_pod("good")]
    report = scheduler_for(kubeconfig).cycle()
    assert report.bound == [("team-a/good", "n1")]
    ((path, event),) = apiserver.posts("/events")
    assert path == "/api/v1/namespaces/team-a/events"
    assert event["involvedObject"] == {
        "apiVersion": "v1",
        "kind": "Pod",
        "name": "bad",
        "namespace": "team-a",
    }
    assert event["type"] == "Warning" and event["reason"] == "FailedScheduling"
    assert "'one' is not a Kubernetes quantity" in event["message"]


def two_full_nodes_running_a_low_priority_gang(apiserver: FakeApiServer) -> list[dict[str, Any]]:
    """Two 2-GPU nodes, each running one pod of the priority-1 gang 'low' (its pods returned)."""
    apiserver.nodes = [make_node("gpu-1", gpus=2, cpu="16"), make_node("gpu-2", gpus=2, cpu="16")]
    low = gang("low", 2, gpus=2, priority=1)
    for i, pod in enumerate(low):
        pod["spec"]["nodeName"] = f"gpu-{i + 1}"
        pod["status"]["phase"] = "Running"
    return low


def test_preemption_evicts_the_whole_lower_priority_gang_then_binds_fake_apiserver(
    apiserver: FakeApiServer, kubeconfig: Path
) -> None:
    low = two_full_nodes_running_a_low_priority_gang(apiserver)
    other = make_pod("system", node="gpu-1", scheduler="default-scheduler", cpu="100m")
    apiserver.pods = [*low, other, *gang("high", 2, gpus=2, priority=100)]
    apiserver.podgroups = [make_podgroup("low", 2), make_podgroup("high", 2)]
    sched = scheduler_for(kubeconfig)
    report = sched.cycle()
    evictions = apiserver.posts("/eviction")
    assert sorted(p for p, _ in evictions) == [
        "/api/v1/namespaces/team-a/pods/low-0/eviction",
        "/api/v1/namespaces/team-a/pods/low-1/eviction",
    ]
    assert evictions[0][1]["apiVersion"] == "policy/v1" and evictions[0][1]["kind"] == "Eviction"
    # the room is not free until the victims are gone: nothing binds in the same cycle
    assert report.bound == [] and apiserver.posts("/binding") == []
    assert apiserver.pod("team-a/system") is not None  # another scheduler's pod is never evicted
    report = sched.cycle()  # the fake API server deleted the victims
    assert sorted(node for _, node in report.bound) == ["gpu-1", "gpu-2"]


def test_cli_once_and_sigterm_fake_apiserver(
    apiserver: FakeApiServer, kubeconfig: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    apiserver.nodes = [make_node("n1")]
    apiserver.pods = [make_pod("a", labels={"pffs.io/queue": "research"})]
    queues = tmp_path / "queues.yaml"
    queues.write_text("queues:\n  - name: research\n    capability: {cpu: 2}\n")
    assert main(["scheduler", "--kubeconfig", str(kubeconfig), "--queues", str(queues), "--once"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["bound"] == [["team-a/a", "n1"]] and out["errors"] == []

    bad = tmp_path / "bad.yaml"
    bad.write_text("queues:\n  - name: x\n    capability: {cpu: lots}\n")
    assert main(["scheduler", "--kubeconfig", str(kubeconfig), "--queues", str(bad), "--once"]) == 2
    assert f"{bad}: queues[0].capability.cpu" in capsys.readouterr().err

    # the long-running loop: cycles until SIGTERM, then exits 0, counting what it did in /metrics
    apiserver.pods.append(make_pod("b"))
    metrics_port = free_ports(1)[0]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pffs.cli.main",
            "scheduler",
            "--kubeconfig",
            str(kubeconfig),
            "--interval",
            "0.1",
            "--metrics-port",
            str(metrics_port),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 30
        while not apiserver.posts("/pods/b/binding") and time.monotonic() < deadline:
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
            time.sleep(0.05)
        assert apiserver.posts("/pods/b/binding"), "the scheduler did not bind within 30 s"
        # Prometheus: the bind is counted once the cycle ends
        metrics: dict[str, float] = {}
        while metrics.get("pffs_scheduler_pods_bound_total") != 1.0:
            assert time.monotonic() < deadline, f"no bind in /metrics: {metrics}"
            with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as response:
                text = response.read().decode()
            metrics = {
                line.split()[0]: float(line.split()[1])
                for line in text.splitlines()
                if line.startswith("pffs_scheduler_")
            }
        assert (
            metrics["pffs_scheduler_cycles_total"] >= 1 and metrics["pffs_scheduler_failed_cycles_total"] == 0
        )
        assert metrics["pffs_scheduler_last_success_timestamp_seconds"] > time.time() - 60
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        _, err = proc.communicate(timeout=5)
        assert TOKEN.encode() not in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_wrong_token_is_a_clear_error_without_the_token_fake_apiserver(apiserver: FakeApiServer) -> None:
    api = KubeApi(apiserver.url, token="not-the-token")
    with pytest.raises(Exception) as caught:
        Scheduler(api, [Queue("default")]).cycle()
    assert "401" in str(caught.value) and "credentials are not accepted" in str(caught.value)
    assert "not-the-token" not in str(caught.value) and "not-the-token" not in repr(api)


DEPLOY = Path(__file__).resolve().parent.parent / "deploy" / "scheduler"


def _rbac_rule(method: str, path: str) -> tuple[str, str, str]:
    """(API group, resource, verb) that a request needs, as the API server's authorizer derives them."""
    parts = path.strip("/").split("/")
    group = "" if parts[0] == "api" else parts[1]
    rest = parts[2:] if parts[0] == "api" else parts[3:]
    if rest[0] == "namespaces":
        rest = rest[2:]
    resource = "/".join([rest[0], rest[2]]) if len(rest) == 3 else rest[0]
    verb = {"GET": "list" if len(rest) == 1 else "get", "POST": "create", "PATCH": "patch"}[method]
    return group, resource, verb


def test_deploy_manifest_grants_exactly_what_the_scheduler_uses_fake_apiserver(
    apiserver: FakeApiServer, kubeconfig: Path
) -> None:
    docs = {d["kind"]: d for d in yaml.safe_load_all((DEPLOY / "pffs-scheduler.yaml").read_text())}
    # the ConfigMap carries the sample queues file, and both parse
    sample = (DEPLOY / "queues.yaml").read_text()
    assert yaml.safe_load(docs["ConfigMap"]["data"]["queues.yaml"]) == yaml.safe_load(sample)
    assert [q.name for q in parse_queues(yaml.safe_load(sample))[0]] == ["default", "research", "batch"]
    container = docs["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert container["command"][:3] == ["pffs", "scheduler", "--in-cluster"]
    granted = {
        (group, resource, verb)
        for rule in docs["ClusterRole"]["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    # a cycle that lists, binds, evicts, marks a pending gang and reports a malformed pod
    apiserver.nodes = [make_node("gpu-1", gpus=2)]
    victim = make_pod("low", gpus=2, node="gpu-1", priority=1)
    apiserver.nodes.append(make_node("cpu-1", cpu="4"))
    warm_first = make_pod("w", cpu="3", annotations={"pffs.io/warm-before-bind": "60s", **DATASET})
    apiserver.pods = [
        victim, make_pod("high", gpus=2, priority=9), make_pod("bad", cpu="x"), *gang("g", 2), warm_first,
    ]  # fmt: skip
    sched = scheduler_for(kubeconfig)
    sched.cycle()
    sched.cycle()
    used = {_rbac_rule(method, path) for method, path, _, _ in apiserver.requests}
    watched = map(partial(_rbac_rule, "GET"), apiserver.watches)
    used |= {(group, resource, "watch") for group, resource, _ in watched}
    assert ("", "pods/eviction", "create") in used and ("", "pods/binding", "create") in used
    assert ("", "pods/status", "patch") in used and ("", "events", "create") in used
    assert ("pffs.io", "datasetwarmups", "create") in used and ("", "pods", "watch") in used
    assert used == granted  # all that is used is granted, and nothing more is


DATASET = {"pffs.io/datasets": "s3://data/imagenet"}


def warm_report(cached: int, total: int = 1000) -> dict[str, str]:
    """A node annotation: the cache report holding `cached` of imagenet's `total` bytes."""
    report = {"datasets": {"s3://data/imagenet": {"cached_bytes": cached, "total_bytes": total}}}
    return {"pffs.io/cache": json.dumps(report)}


def inline_volume(source: str, secret: str | None = None) -> dict[str, Any]:
    csi: dict[str, Any] = {
        "driver": "csi.pffs.io",
        "volumeAttributes": {"source": source, "endpointUrl": "http://s3.local:8333", "blockSize": "1Mi"},
    }
    if secret:
        csi["nodePublishSecretRef"] = {"name": secret}
    return {"name": "data", "csi": csi}


def test_a_warm_before_bind_gang_is_held_warmed_on_its_nodes_bound_when_their_reports_say_so_fake_apiserver(
    apiserver: FakeApiServer, kubeconfig: Path
) -> None:
    apiserver.nodes = [make_node("gpu-1", gpus=1), make_node("gpu-2", gpus=1, annotations=warm_report(400))]
    apiserver.pods = gang("train", 2, gpus=1, annotations={"pffs.io/warm-before-bind": "10m"})
    for pod in apiserver.pods:
        pod["spec"]["volumes"] = [inline_volume("s3://data/imagenet/", secret="s3-keys")]
    apiserver.podgroups = [make_podgroup("train", 2)]
    sched = scheduler_for(kubeconfig)
    report = sched.cycle()
    assert report.bound == [] and apiserver.posts("/binding") == []
    why = report.pending["podgroup:team-a/train"]
    assert why.startswith("warming s3://data/imagenet on gpu-1, gpu-2 before binding"), why
    (made,) = apiserver.warmups  # one dataset, one warm-up, on exactly the gang's nodes
    assert (
        apiserver.posts("/datasetwarmups")[0][0] == "/apis/pffs.io/v1alpha1/namespaces/team-a/datasetwarmups"
    )
    assert made["metadata"]["generateName"] == "train-warm-"
    assert made["metadata"]["labels"] == {"pffs.io/pod-group": "train"}
    assert made["spec"] == {
        "source": "s3://data/imagenet",
        "endpointUrl": "http://s3.local:8333",
        "blockSize": "1Mi",
        "secretName": "s3-keys",
        "nodes": {"names": ["gpu-1", "gpu-2"]},
        "ttlSecondsAfterFinished": 3600,
    }
    for i in range(2):
        (condition,) = apiserver.pod(f"team-a/train-{i}")["status"]["conditions"]  # type: ignore[index]
        assert condition["reason"] == "Unschedulable" and "warming s3://data/imagenet" in condition["message"]
    # the room is held: a pod that would fit only there waits; no second warm-up is made
    apiserver.pods.append(make_pod("other", gpus=1))
    assert sched.cycle().bound == [] and len(apiserver.warmups) == 1
    # one node warm: still held
    apiserver.nodes[0]["metadata"]["annotations"].update(warm_report(1000))
    assert sched.cycle().bound == []
    # both: the gang binds (with the GPUs it was given), and its pods get an Event saying so
    apiserver.nodes[1]["metadata"]["annotations"].update(warm_report(1000))
    report = sched.cycle()
    assert sorted(report.bound) == [("team-a/train-0", "gpu-1"), ("team-a/train-1", "gpu-2")] or sorted(
        report.bound
    ) == [("team-a/train-0", "gpu-2"), ("team-a/train-1", "gpu-1")]
    events = [b for _, b in apiserver.posts("/events") if b["reason"] == "WarmBeforeBind"]
    assert len(events) == 2 and events[0]["type"] == "Normal"
    assert "s3://data/imagenet warm on gpu-1, gpu-2 after" in events[0]["message"]
    assert apiserver.pod("team-a/other")["spec"].get("nodeName") is None  # type: ignore[index]


def test_a_warm_before_bind_gang_binds_cold_at_its_deadline_with_a_warning_fake_apiserver(
    apiserver: FakeApiServer, kubeconfig: Path
) -> None:
    apiserver.nodes = [make_node("n1", cpu="4")]
    apiserver.pods = [make_pod("job", cpu="2", annotations={"pffs.io/warm-before-bind": "0.5s", **DATASET})]
    sched = scheduler_for(kubeconfig)
    assert sched.cycle().bound == [] and len(apiserver.warmups) == 1
    assert apiserver.warmups[0]["spec"]["source"] == "s3://data/imagenet"  # from the annotation alone
    assert "secretName" not in apiserver.warmups[0]["spec"]
    time.sleep(0.6)
    assert sched.cycle().bound == [("team-a/job", "n1")]
    (event,) = [b for _, b in apiserver.posts("/events") if b["reason"] == "WarmBeforeBindDeadline"]
    assert event["type"] == "Warning"
    assert event["message"] == "deadline of 0.5 s passed with n1 not warm: bound cold to n1"


def test_warm_before_bind_on_warm_nodes_binds_at_once_and_a_bad_deadline_is_said_fake_apiserver(
    apiserver: FakeApiServer, kubeconfig: Path
) -> None:
    apiserver.nodes = [make_node("n1", cpu="4", annotations=warm_report(1000))]
    apiserver.pods = [
        make_pod("warm", cpu="1", annotations={"pffs.io/warm-before-bind": "5m", **DATASET}),
        make_pod("typo", cpu="1", annotations={"pffs.io/warm-before-bind": "five minutes", **DATASET}),
        make_pod("no-data", cpu="1", annotations={"pffs.io/warm-before-bind": "5m"}),
    ]
    report = scheduler_for(kubeconfig).cycle()
    assert sorted(report.bound) == [("team-a/no-data", "n1"), ("team-a/warm", "n1")]
    assert apiserver.warmups == []
    assert report.pending["pod:team-a/typo"] == (
        "annotation pffs.io/warm-before-bind: 'five minutes' is not a deadline (e.g. 300s, 5m, 1h)"
    )


def test_warm_before_bind_without_the_crd_binds_cold_and_says_why_fake_apiserver(
    apiserver: FakeApiServer, kubeconfig: Path
) -> None:
    apiserver.nodes = [make_node("n1", cpu="4")]
    apiserver.pods = [make_pod("job", cpu="1", annotations={"pffs.io/warm-before-bind": "5m", **DATASET})]
    real_route = _FakeHandler._route

    def no_crd(
        self: _FakeHandler, method: str, path: str, query: dict[str, str], body: Any
    ) -> tuple[int, Any]:
        if path.endswith("/datasetwarmups"):
            return 404, _status(404, "NotFound", "the server could not find the requested resource")
        return real_route(self, method, path, query, body)

    _FakeHandler._route = no_crd  # type: ignore[method-assign]
    try:
        report = scheduler_for(kubeconfig).cycle()
    finally:
        _FakeHandler._route = real_route  # type: ignore[method-assign]
    assert report.bound == [("team-a/job", "n1")]
    (event,) = [b for _, b in apiserver.posts("/events") if b["reason"] == "WarmBeforeBind"]
    assert event["type"] == "Warning" and event["message"].startswith("cannot warm first, binding: ")
    assert "could not find the requested resource" in event["message"]


def test_a_pod_bound_before_the_watch_shows_it_keeps_its_room_stale_watch_imitated_fake_apiserver(
    apiserver: FakeApiServer, kubeconfig: Path
) -> None:
    """Between a Binding and its watch event the watched copy still shows the pod unbound: the scheduler
    counts it on its node meanwhile (an assumed pod), so the room is neither bound twice nor given away.
    (The lag is imitated by handing the cycle an old copy of the pods.)"""
    apiserver.nodes = [make_node("gpu-1", gpus=4)]
    apiserver.pods = [make_pod("first", gpus=4)]
    stale = copy.deepcopy(apiserver.pods)  # 'first' unbound, as a lagging watch still shows it
    sched = scheduler_for(kubeconfig)
    assert sched.cycle().bound == [("team-a/first", "gpu-1")]
    apiserver.pods.append(make_pod("second", gpus=4))
    sched._pods.items = lambda: [*copy.deepcopy(stale), copy.deepcopy(apiserver.pods[-1])]  # type: ignore[method-assign]
    report = sched.cycle()
    assert report.bound == [] and "no fit" in report.pending["pod:team-a/second"]
    assert len(apiserver.posts("/binding")) == 1  # 'first' was not bound again
    # the watch catches up: the pod's own nodeName and GPUs count, the assumption is dropped
    sched._pods.items = lambda: copy.deepcopy(apiserver.pods)  # type: ignore[method-assign]
    assert sched.cycle().bound == [] and sched._assumed == {}
    apiserver.pods = [p for p in apiserver.pods if p["metadata"]["name"] != "first"]  # it finished
    assert sched.cycle().bound == [("team-a/second", "gpu-1")]


def test_taints_keep_pods_without_tolerations_off_fake_apiserver(
    apiserver: FakeApiServer, kubeconfig: Path
) -> None:
    gpu_taint = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
    apiserver.nodes = [make_node("tainted", gpus=4, taints=[gpu_taint]), make_node("plain", gpus=1)]
    tolerant = make_pod("tolerant", gpus=2)
    tolerant["spec"]["tolerations"].append({"key": "nvidia.com/gpu", "operator": "Exists"})
    apiserver.pods = [make_pod("first", gpus=1), tolerant]
    sched = scheduler_for(kubeconfig)
    report = sched.cycle()
    assert sorted(report.bound) == [("team-a/first", "plain"), ("team-a/tolerant", "tainted")]
    # two GPUs are free on the tainted node, none where an untolerating pod may go: it waits
    apiserver.pods.append(make_pod("late", gpus=1))
    report = sched.cycle()
    assert report.bound == [] and "no fit" in report.pending["pod:team-a/late"]


def test_kubeconfig_errors_are_clear_and_in_cluster_needs_a_pod(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "config"
    base = {
        "current-context": "c",
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}],
        "clusters": [
            {"name": "k", "cluster": {"server": "https://10.0.0.1:6443", "insecure-skip-tls-verify": True}}
        ],
        "users": [{"name": "u", "user": {"tokenFile": "token"}}],
    }
    path.write_text(yaml.safe_dump(base))
    (tmp_path / "token").write_text("secret-from-file\n")
    api = kubeconfig_api(path)
    assert api.server == "https://10.0.0.1:6443" and "secret" not in repr(api)
    base["users"] = [{"name": "u", "user": {"exec": {"command": "aws"}}}]
    path.write_text(yaml.safe_dump(base))
    with pytest.raises(BadObject, match="credential plugin failed"):  # no `aws` here: one clear line
        kubeconfig_api(path)
    with pytest.raises(BadObject, match="no context named 'other'"):
        kubeconfig_api(path, "other")
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    assert main(["scheduler", "--in-cluster", "--once"]) == 2


# ------------------------------------------------------------------------------------------- robustness


def test_an_eviction_a_disruption_budget_refuses_is_retried_not_waited_on_forever_fake_apiserver(
    apiserver: FakeApiServer, kubeconfig: Path
) -> None:
    low = two_full_nodes_running_a_low_priority_gang(apiserver)
    apiserver.pods = [*low, *gang("high", 2, gpus=2, priority=100)]
    apiserver.podgroups = [make_podgroup("low", 2), make_podgroup("high", 2)]
    apiserver.pdb_blocked = {"team-a/low-0"}
    sched = scheduler_for(kubeconfig)
    report = sched.cycle()  # 429 is "not now": reported, not raised
    assert report.evicted == ["team-a/low-1"] and any("429" in e for e in report.errors)
    assert apiserver.pod("team-a/low-0") is not None
    apiserver.pdb_blocked = set()  # the budget allows it now: the next cycles evict, then bind
    bound: list[tuple[str, str]] = []
    for _ in range(3):
        bound += sched.cycle().bound
    assert apiserver.pod("team-a/low-0") is None
    assert sorted(node for _, node in bound) == ["gpu-1", "gpu-2"]


def test_a_node_with_an_absurd_cache_report_does_not_stop_the_snapshot() -> None:
    absurd = [
        '{"datasets": {"s3://d": {"cached_bytes": 1e400, "total_bytes": 1}}}',  # int(inf): OverflowError
        "[" * 100_000,  # RecursionError in the JSON decoder
        '{"datasets": {"s3://d": {"cached_bytes": -5, "total_bytes": 10}}}',
    ]
    nodes = [make_node(f"n{i}", annotations={"pffs.io/cache": raw}) for i, raw in enumerate(absurd)]
    snap = build_snapshot(nodes, [make_pod("a")], [], [Queue("default")])
    assert [n.name for n in snap.nodes] == ["n0", "n1", "n2"]
    assert all(0.0 <= f <= 1.0 for n in snap.nodes for f in n.cached.values())


@pytest.mark.parametrize("token", [f"{TOKEN}\n", f"  {TOKEN}\r\n"])
def test_a_token_with_surrounding_whitespace_is_stripped_fake_apiserver(
    apiserver: FakeApiServer, token: str
) -> None:
    # a kubeconfig's `token: |` block keeps the newline; http.client would refuse the header
    assert KubeApi(apiserver.url, token=token).list_items("/api/v1/nodes") == []


def test_a_token_unfit_for_a_header_is_an_api_error_without_the_token(
    apiserver: FakeApiServer, tmp_path: Path
) -> None:
    api = KubeApi(apiserver.url, token="secret-part-one\nsecret-part-two")
    with pytest.raises(ApiError) as caught:
        api.request("GET", "/api/v1/nodes")
    assert "secret-part" not in str(caught.value)
    missing = KubeApi(apiserver.url, token_file=str(tmp_path / "no-such-token"))
    with pytest.raises(ApiError, match="token"):
        missing.request("GET", "/api/v1/nodes")


def _raw_server(answer: bytes | None) -> tuple[str, Any]:
    """A TCP server that answers every connection with ``answer`` (None: never answers) and a stop()."""
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    conns: list[socket.socket] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            conns.append(conn)
            conn.recv(65536)
            if answer is not None:
                conn.sendall(answer)
                conn.close()

    threading.Thread(target=serve, daemon=True).start()

    def stop() -> None:
        listener.close()
        for conn in conns:
            conn.close()

    return f"http://127.0.0.1:{listener.getsockname()[1]}", stop


@pytest.mark.parametrize(
    "answer",
    [
        b"HELLO\r\n\r\n",  # not HTTP: http.client.BadStatusLine
        b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{}",  # cut short: IncompleteRead
        b"HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nContent-Length: 13\r\n\r\n<html></html>",
    ],
)
def test_a_broken_answer_is_an_api_error(answer: bytes) -> None:
    url, stop = _raw_server(answer)
    try:
        with pytest.raises(ApiError):
            KubeApi(url, timeout=5).request("GET", "/api/v1/nodes")
    finally:
        stop()


def test_a_hung_api_server_times_out() -> None:
    url, stop = _raw_server(None)
    try:
        started = time.monotonic()
        with pytest.raises(ApiError, match="timed out"):
            KubeApi(url, timeout=0.5).request("GET", "/api/v1/nodes")
        assert time.monotonic() - started < 5
    finally:
        stop()


def _https_kubeconfig(path: Path, cluster: dict[str, Any]) -> Path:
    config = {
        "current-context": "c",
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}],
        "clusters": [{"name": "k", "cluster": {"server": "https://10.0.0.1:6443", **cluster}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
    }
    path.write_text(yaml.safe_dump(config))
    return path


def test_the_kubeconfig_ca_is_the_only_one_trusted(tmp_path: Path) -> None:
    import base64
    import ssl

    certifi = pytest.importorskip("certifi")
    bundle = Path(certifi.where()).read_text()
    first = bundle[bundle.index("-----BEGIN CERTIFICATE-----") :]
    first = first[: first.index("-----END CERTIFICATE-----") + len("-----END CERTIFICATE-----")] + "\n"
    data = base64.b64encode(first.encode()).decode()
    api = kubeconfig_api(_https_kubeconfig(tmp_path / "a", {"certificate-authority-data": data}))
    assert api._context is not None and len(api._context.get_ca_certs()) == 1
    assert api._context.verify_mode == ssl.CERT_REQUIRED and api._context.check_hostname
    (tmp_path / "ca.crt").write_text(first)
    api = kubeconfig_api(_https_kubeconfig(tmp_path / "b", {"certificate-authority": "ca.crt"}))
    assert api._context is not None and len(api._context.get_ca_certs()) == 1
    # without a CA: the system's; insecure-skip-tls-verify only when set true
    api = kubeconfig_api(_https_kubeconfig(tmp_path / "c", {"insecure-skip-tls-verify": False}))
    assert api._context is not None and api._context.verify_mode == ssl.CERT_REQUIRED
    api = kubeconfig_api(_https_kubeconfig(tmp_path / "d", {"insecure-skip-tls-verify": True}))
    assert api._context is not None and api._context.verify_mode == ssl.CERT_NONE


@pytest.mark.parametrize(
    ("cluster", "message"),
    [
        ({"certificate-authority-data": "not base64!"}, "certificate-authority-data"),
        ({"certificate-authority-data": "bm90IGEgY2VydA=="}, "certificate-authority-data"),
        ({"certificate-authority": "absent.crt"}, "absent.crt"),
    ],
)
def test_a_bad_kubeconfig_ca_is_one_clear_error(
    tmp_path: Path, cluster: dict[str, Any], message: str
) -> None:
    with pytest.raises(BadObject, match=message):
        kubeconfig_api(_https_kubeconfig(tmp_path / "config", cluster))


def test_a_bad_client_key_is_one_clear_error_without_the_key(tmp_path: Path) -> None:
    import base64

    path = _https_kubeconfig(tmp_path / "config", {})
    config = yaml.safe_load(path.read_text())
    key = base64.b64encode(b"secret-key-bytes").decode()
    config["users"][0]["user"] = {"client-certificate-data": key, "client-key-data": key}
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(BadObject, match="unusable client certificate or key") as caught:
        kubeconfig_api(path)
    assert "secret-key-bytes" not in str(caught.value) and key not in str(caught.value)


def test_a_running_pod_with_bad_pffs_annotations_still_uses_its_room() -> None:
    # annotations can be edited on a running pod, and other schedulers' pods may carry anything: what the
    # pod uses must count, or the node looks free and gets over-allocated
    running = make_pod("other", cpu="6", gpus=1, node="n1", scheduler="default-scheduler")
    running["metadata"]["annotations"]["pffs.io/gpu-milli"] = "lots"
    mine = make_pod("mine", cpu="6", gpus=1, node="n1")
    mine["metadata"]["annotations"]["pffs.io/gpu-models"] = "H100"
    mine["spec"]["nodeSelector"] = {"nvidia.com/gpu.product": "A100"}
    snap = build_snapshot([make_node("n1", cpu="16", gpus=2)], [running, mine], [], [Queue("default")])
    assert sorted(p.pod.name for p in snap.running) == ["team-a/mine", "team-a/other"]
    assert sum(p.pod.cpu_milli for p in snap.running) == 12_000
    assert sorted(len(p.gpus) for p in snap.running) == [1, 1]
    assert snap.problems == {}  # a running pod is not one this scheduler "cannot schedule"


def test_which_pods_use_room_and_gangs_are_namespaced() -> None:
    deleting = make_pod("deleting", cpu="1", node="n1")
    deleting["metadata"]["deletionTimestamp"] = "2025-11-24T09:00:00Z"  # still running until it is gone
    failed = make_pod("failed", cpu="4", node="n1", phase="Failed")
    foreign = make_pod("foreign", cpu="2", node="n1", scheduler="default-scheduler")
    pending_foreign = make_pod("pending-foreign", scheduler="default-scheduler")
    pods = [deleting, failed, foreign, pending_foreign]
    pods += gang("train", 2) + gang("train", 2, namespace="team-b")
    snap = build_snapshot([make_node("n1")], pods, [make_podgroup("train", 2)], [Queue("default")])
    assert sorted(p.pod.name for p in snap.running) == ["team-a/deleting", "team-a/foreign"]
    gangs = [g for g in snap.groups if g.name.startswith("podgroup:")]
    assert [g.name for g in gangs] == ["podgroup:team-a/train"]  # team-b has no PodGroup "train"
    assert [p.name for p in gangs[0].pods] == ["team-a/train-0", "team-a/train-1"]
    assert "PodGroup team-b/train does not exist" in snap.waiting["podgroup:team-b/train"]


def test_pod_level_resources_replace_the_containers_cpu_and_memory() -> None:
    # PodLevelResources (beta, on by default since 1.34): spec.resources counts for cpu and memory
    pod = make_pod("p", cpu="100m", memory="64Mi", gpus=1)
    pod["spec"]["resources"] = {"requests": {"cpu": "4"}, "limits": {"cpu": "8", "memory": "8Gi"}}
    pod["spec"]["overhead"] = {"cpu": "50m"}
    requests = pod_requests(pod)
    assert requests["cpu"] == Fraction(4050, 1000)
    assert requests["memory"] == 8 * 2**30  # the pod-level request defaults to its limit
    assert requests["nvidia.com/gpu"] == 1  # not a pod-level resource: from the containers


def test_extender_lists_node_reports_for_names_only_requests_fake_apiserver(
    apiserver: FakeApiServer, kubeconfig: Path
) -> None:
    """With nodeCacheCapable: true kube-scheduler sends node names only; `pffs extender --kubeconfig` reads
    the Nodes' cache reports from the API server (a fake one: no kube-apiserver runs here yet) and follows
    their changes."""

    def cache(cached: int) -> dict[str, str]:
        report = {"datasets": {"s3://data/imagenet": {"cached_bytes": cached, "total_bytes": 100}}}
        return {"pffs.io/cache": json.dumps(report)}

    apiserver.nodes = [make_node("warm", annotations=cache(100)), make_node("cold", annotations=cache(0))]
    apiserver.nodes.append(make_node("plain"))  # no pffs on it
    port = free_ports(1)[0]
    argv = [sys.executable, "-m", "pffs.cli.main", "extender", "--port", str(port)]
    proc = subprocess.Popen(
        [*argv, "--kubeconfig", str(kubeconfig), "--node-refresh", "0.2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    body = {
        "Pod": {"metadata": {"name": "p", "annotations": {"pffs.io/datasets": "s3://data/imagenet"}}},
        "NodeNames": ["warm", "cold", "plain"],
    }

    def ask(verb: str) -> Any:
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/{verb}", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=5) as response:
            return json.loads(response.read())

    def scores() -> dict[str, int]:
        return {s["Host"]: s["Score"] for s in ask("prioritize")}

    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if scores() == {"warm": 10, "cold": 0, "plain": 0}:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, "no scores from the listed Nodes"
            time.sleep(0.1)
        filtered = ask("filter")
        assert filtered["NodeNames"] == ["warm", "cold"]
        assert set(filtered["FailedAndUnresolvableNodes"]) == {"plain"}
        with apiserver.lock:
            apiserver.nodes[1] = make_node("cold", annotations=cache(50))  # the cold node warms up
        while scores()["cold"] != 5:
            assert time.monotonic() < deadline, "the extender did not follow the Node's new report"
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
        assert TOKEN not in proc.stdout.read() + proc.stderr.read()  # type: ignore[union-attr]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_in_cluster_without_a_readable_ca_is_one_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pffs.scheduler.kube import api_client as kube_api

    monkeypatch.setattr(kube_api, "SERVICE_ACCOUNT_DIR", tmp_path)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    with pytest.raises(BadObject, match="not running in a pod"):
        kube_api.in_cluster_api()
    (tmp_path / "token").write_text(TOKEN)
    with pytest.raises(BadObject, match=r"ca\.crt: cannot load the cluster's CA") as caught:
        kube_api.in_cluster_api()
    assert TOKEN not in str(caught.value)
    (tmp_path / "ca.crt").write_text("not a certificate")
    with pytest.raises(BadObject, match=r"ca\.crt: cannot load the cluster's CA"):
        kube_api.in_cluster_api()
