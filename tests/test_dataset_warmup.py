"""DatasetWarmup (pffs.io/v1alpha1) on a real API server: the CRD refuses a bad spec with its own message;
the controller (`pffs csi --mode controller --warmups`) resolves the dataset and the nodes; node plugins
(`pffs csi --mode node --warmups`, processes standing in for nodes, each with its own disk cache) warm their
own cache; progress moves in steps a watcher sees, up to 100%, with exact bytes in each node's cache and the
dataset in each node's cache report; a plugin killed mid-warm-up goes on, when started again, without
fetching again what it had; a pod held by the scheduling gate `pffs.io/warmup` is ungated once its warm-up
ended.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest
import s3fs
import yaml
from helpers import pattern, sha256

from pffs.config import CacheSettings
from pffs.scheduler.core.objects import Queue
from pffs.scheduler.kube.api_client import kubeconfig_api
from pffs.scheduler.kube.loop import Scheduler
from pffs.testing.csi_plugin import CsiPlugin
from pffs.testing.s3_server import SeaweedS3
from pffs.vfs import shared_block_cache

pytestmark = [pytest.mark.kube, pytest.mark.s3, pytest.mark.timeout(300)]

CRD = Path(__file__).parents[1] / "deploy" / "helm" / "pffs-csi" / "crds" / "datasetwarmups.pffs.io.yaml"
SYSTEM = "pffs-system"
BLOCK = 256 << 10
G, V, P = "pffs.io", "v1alpha1", "datasetwarmups"


@pytest.fixture(scope="module")
def api_server(control_plane: Any) -> Any:
    """The control plane with the DatasetWarmup CRD served and the driver's namespace."""
    from kubernetes import client

    api = control_plane.api()
    client.ApiextensionsV1Api(api).create_custom_resource_definition(yaml.safe_load(CRD.read_text()))
    client.CoreV1Api(api).create_namespace({"metadata": {"name": SYSTEM}})
    wait_for("the CRD served", lambda: _lists(api), 30)
    return control_plane


def _lists(api: Any) -> bool:
    from kubernetes import client

    try:
        client.CustomObjectsApi(api).list_namespaced_custom_object(G, V, "default", P)
        return True
    except Exception:
        return False


def wait_for(what: str, check: Callable[[], Any], timeout_s: float, interval_s: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except Exception as exc:
            last = exc
        if last and not isinstance(last, Exception):
            return last
        time.sleep(interval_s)
    raise AssertionError(f"{what}: not within {timeout_s} s (last: {last!r})")


def warmup(name: str, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": f"{G}/{V}", "kind": "DatasetWarmup", "metadata": {"name": name}, "spec": spec}


# -- the CRD's own checks ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"source": "s3://b/ds"}, "spec.nodes: Required value"),
        ({"source": "s3://b/ds", "storageClass": "x", "nodes": {"names": ["a"]}}, "name the dataset once"),
        ({"source": "ftp://b/ds", "nodes": {"names": ["a"]}}, "source must be s3://bucket/prefix"),
        ({"source": "s3://b/ds", "paths": ["../up"], "nodes": {"names": ["a"]}}, "do not climb with .."),
        ({"source": "s3://b/ds", "nodes": {"names": ["a"], "selector": {"a": "b"}}}, "choose the nodes once"),
        ({"source": "s3://b/ds", "nodes": {"names": ["a"], "podGroup": "g"}}, "choose the nodes once"),
        ({"source": "s3://b/ds", "nodes": {"names": ["a"]}, "bytesPerSecond": 0}, "bytesPerSecond"),
        (
            {"source": "s3://b/ds", "nodes": {"names": ["a"]}, "schedule": "daily"},
            "schedule takes five fields",
        ),
    ],
    ids=[
        "no-nodes",
        "two-datasets",
        "bad-scheme",
        "climbing-path",
        "two-node-choices",
        "names-and-group",
        "zero-rate",
        "bad-schedule",
    ],
)
def test_a_bad_spec_is_refused_by_the_api_server_with_its_message(
    api_server: Any, spec: dict[str, Any], message: str
) -> None:
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    custom = client.CustomObjectsApi(api_server.api())
    with pytest.raises(ApiException) as refused:
        custom.create_namespaced_custom_object(G, V, "default", P, warmup("bad", **spec))
    assert refused.value.status == 422
    assert message in json.loads(refused.value.body)["message"]


# -- warming, on plugins standing in for nodes ---------------------------------------------------------------
class Cluster:
    def __init__(self, api_server: Any, root: Path, stack: contextlib.ExitStack) -> None:
        from kubernetes import client

        self.api = api_server.api()
        self.kubeconfig = api_server.kubeconfig
        self.core = client.CoreV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)
        self.root = root
        self.stack = stack
        self.plugins: dict[str, CsiPlugin] = {}

    def controller(self) -> CsiPlugin:
        root = self.root / "controller"
        root.mkdir()
        plugin = CsiPlugin(
            root, "--kubeconfig", str(self.kubeconfig), "--warmups", "--namespace", SYSTEM,
            node_id="controller", mode="controller",
        )  # fmt: skip
        return self.stack.enter_context(plugin)

    def node(self, name: str, labels: dict[str, str]) -> CsiPlugin:
        if name not in {n.metadata.name for n in self.core.list_node().items}:
            self.core.create_node({"metadata": {"name": name, "labels": labels}})
        root = self.root / name
        root.mkdir(exist_ok=True)
        plugin = CsiPlugin(
            root, "--kubeconfig", str(self.kubeconfig), "--warmups", "--namespace", SYSTEM,
            "--report-interval", "1", "--cache-size", "1G",
            node_id=name, mode="node", cache_dir=root / "cache",
        )  # fmt: skip
        self.plugins[name] = self.stack.enter_context(plugin)
        return plugin

    def delete_pods(self, names: list[str]) -> None:
        for name in names:
            with contextlib.suppress(Exception):
                self.core.delete_namespaced_pod(name, "default", grace_period_seconds=0)

    def schedulable(self, name: str, cpu: str = "4") -> None:
        """Gives a Node the status a kubelet would (room, Ready), creating it if it has no plugin."""
        if name not in {n.metadata.name for n in self.core.list_node().items}:
            self.core.create_node({"metadata": {"name": name}})
            self.stack.callback(lambda: self.core.delete_node(name))
        room = {"cpu": cpu, "memory": "16Gi", "pods": "110"}
        ready = {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "test"}
        self.core.patch_node_status(
            name, {"status": {"capacity": room, "allocatable": room, "conditions": [ready]}}
        )

    def scheduler(self) -> Scheduler:
        """`pffs scheduler` against this API server, cycling every 0.2 s until the test ends."""
        sched = Scheduler(kubeconfig_api(self.kubeconfig), [Queue("default")])
        stop = threading.Event()
        thread = threading.Thread(target=sched.run, args=(0.2, stop), daemon=True)
        thread.start()
        self.stack.callback(thread.join, 10)
        self.stack.callback(stop.set)
        return sched

    def status(self, name: str) -> dict[str, Any]:
        return dict(self.custom.get_namespaced_custom_object(G, V, "default", P, name).get("status") or {})

    def cache_report(self, node: str) -> dict[str, Any]:
        annotations = self.core.read_node(node).metadata.annotations or {}
        return dict(json.loads(annotations.get("pffs.io/cache", "{}")))


@pytest.fixture
def cluster(api_server: Any, tmp_path: Path) -> Iterator[Cluster]:
    with contextlib.ExitStack() as stack:
        made = Cluster(api_server, tmp_path, stack)
        try:
            yield made
        finally:
            stack.close()
            for item in made.custom.list_namespaced_custom_object(G, V, "default", P)["items"]:
                with contextlib.suppress(Exception):
                    made.custom.delete_namespaced_custom_object(G, V, "default", P, item["metadata"]["name"])
            for node in made.plugins:
                with contextlib.suppress(Exception):
                    made.core.delete_node(node)


@pytest.fixture
def dataset(
    raw_s3: s3fs.S3FileSystem, bucket: str, s3_server: SeaweedS3, api_server: Any
) -> dict[str, bytes]:
    from kubernetes import client

    files = {f"train/{i:02d}.bin": pattern(200_000 + i, seed=i) for i in range(8)}
    files["train/large.bin"] = pattern(5 * BLOCK + 99, seed=77)
    files["val/skip.bin"] = pattern(50_000, seed=5)  # outside the warm-up's paths
    raw_s3.pipe({f"{bucket}/ds/{name}": data for name, data in files.items()})
    core = client.CoreV1Api(api_server.api())
    secret = {
        "metadata": {"name": "s3-credentials"},
        "stringData": {"accessKeyId": s3_server.access_key, "secretAccessKey": s3_server.secret_key},
    }
    with contextlib.suppress(Exception):
        core.delete_namespaced_secret("s3-credentials", SYSTEM)
    core.create_namespaced_secret(SYSTEM, secret)
    return {k: v for k, v in files.items() if k.startswith("train/")}


def spec_for(bucket: str, s3_server: SeaweedS3, **extra: Any) -> dict[str, Any]:
    return {
        "source": f"s3://{bucket}/ds",
        "endpointUrl": s3_server.endpoint_url,
        "blockSize": str(BLOCK),
        "secretName": "s3-credentials",
        "paths": ["train"],
        **extra,
    }


def cached_exactly(cache_dir: Path, bucket: str, s3_server: SeaweedS3, files: dict[str, bytes]) -> bool:
    """Every file read through a filesystem over `cache_dir` alone is exact, with no GET."""
    fs = fsspec.filesystem(
        "pffs", target=f"s3://{bucket}/ds", cache_dir=str(cache_dir), block_size=BLOCK,
        skip_instance_cache=True, **s3_server.storage_options(),
    )  # fmt: skip
    for name, data in files.items():
        assert sha256(fs.cat(name)) == sha256(data), name
    return int(fs.vfs.backend.requests.snapshot()["get"]["requests"]) == 0


def test_a_warmup_reaches_100_percent_on_its_nodes_in_steps_and_their_reports_say_so(
    cluster: Cluster, s3_server: SeaweedS3, bucket: str, dataset: dict[str, bytes]
) -> None:
    cluster.controller()
    nodes = [cluster.node(f"gpu-{i}", {"pool": "gpu"}) for i in range(2)]
    cluster.node("cpu-0", {"pool": "cpu"})  # not chosen
    total = sum(len(d) for d in dataset.values())
    spec = spec_for(bucket, s3_server, nodes={"selector": {"pool": "gpu"}}, bytesPerSecond=total // 2)
    cluster.custom.create_namespaced_custom_object(G, V, "default", P, warmup("imagenet", **spec))
    seen: list[str] = []

    def done() -> bool:
        status = cluster.status("imagenet")
        if status.get("progress") and (not seen or seen[-1] != status["progress"]):
            seen.append(status["progress"])
        return status.get("phase") == "Succeeded"

    wait_for("the warm-up to succeed", done, 60, interval_s=0.05)
    status = cluster.status("imagenet")
    assert sorted(status["nodes"]) == ["gpu-0", "gpu-1"]
    assert status["nodesDone"] == "2/2" and status["progress"] == "100%"
    assert status["bytesDone"] == status["bytesTotal"] == 2 * total
    assert status["filesDone"] == status["filesTotal"] == 2 * len(dataset)
    assert len([p for p in seen if p not in ("0%", "100%")]) >= 2, seen  # steps a watcher sees
    assert [int(p.rstrip("%")) for p in seen] == sorted(int(p.rstrip("%")) for p in seen), seen
    for node in nodes:
        assert cached_exactly(node.cache_dir, bucket, s3_server, dataset)  # type: ignore[arg-type]
    url = f"s3://{bucket}/ds"
    for name in ("gpu-0", "gpu-1"):
        report = wait_for(
            f"{name}'s report", lambda n=name: cluster.cache_report(n).get("datasets", {}).get(url), 15
        )
        assert report["cached_bytes"] == report["total_bytes"] == total
    assert url not in cluster.cache_report("cpu-0").get("datasets", {})
    events = cluster.core.list_namespaced_event("default").items
    assert any(e.reason == "Succeeded" and e.involved_object.name == "imagenet" for e in events)
    # the node's cache evicts: its report no longer says the dataset is whole (the scheduler binds on it)
    subprocess.run(
        [str(Path(sys.executable).parent / "pffs"), "cache", "--cache-dir", str(nodes[0].cache_dir),
         "--cache-size", str(total // 3), "gc"],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip

    def shrunk() -> dict[str, int] | None:
        report = cluster.cache_report("gpu-0")["datasets"][url]
        return report if report["cached_bytes"] < total else None

    report = wait_for("gpu-0's report after eviction", shrunk, 15)
    assert report["cached_bytes"] <= total // 3 and report["total_bytes"] == total
    assert cluster.cache_report("gpu-1")["datasets"][url]["cached_bytes"] == total


def test_a_plugin_killed_mid_warmup_goes_on_without_fetching_again_what_it_had(
    cluster: Cluster, s3_server: SeaweedS3, bucket: str, dataset: dict[str, bytes]
) -> None:
    cluster.controller()
    node = cluster.node("gpu-9", {"pool": "solo"})
    total = sum(len(d) for d in dataset.values())
    spec = spec_for(bucket, s3_server, nodes={"names": ["gpu-9"]}, bytesPerSecond=total // 4)
    cluster.custom.create_namespaced_custom_object(G, V, "default", P, warmup("resume", **spec))

    def halfway() -> bool:
        entry = cluster.status("resume").get("nodes", {}).get("gpu-9", {})
        return total // 4 < entry.get("bytesDone", 0) < total * 3 // 4

    wait_for("the warm-up halfway", halfway, 30, interval_s=0.05)
    node.kill()
    had = shared_block_cache(CacheSettings(cache_dir=node.cache_dir)).machine_totals()["bytes_fetched"]
    assert 0 < had < total
    node.start()
    wait_for("the warm-up to succeed", lambda: cluster.status("resume").get("phase") == "Succeeded", 60)
    fetched = shared_block_cache(CacheSettings(cache_dir=node.cache_dir)).machine_totals()["bytes_fetched"]
    # What was on disk is not fetched again; at most the blocks in flight when it was killed (8 workers).
    assert total <= fetched <= total + 8 * BLOCK, (had, fetched, total)
    assert cluster.status("resume")["nodes"]["gpu-9"]["bytesFetched"] <= total - had + 8 * BLOCK
    assert cached_exactly(node.cache_dir, bucket, s3_server, dataset)  # type: ignore[arg-type]


def test_a_gated_pod_is_ungated_when_its_warmup_ended(
    cluster: Cluster, s3_server: SeaweedS3, bucket: str, dataset: dict[str, bytes]
) -> None:
    cluster.controller()
    cluster.node("gpu-5", {"pool": "gate"})
    pod = {
        "metadata": {"name": "trainer", "labels": {"pffs.io/warmup": "before-training"}},
        "spec": {
            "schedulingGates": [{"name": "pffs.io/warmup"}, {"name": "example.com/quota"}],
            "containers": [{"name": "train", "image": "busybox"}],
        },
    }
    cluster.core.create_namespaced_pod("default", pod)
    try:
        spec = spec_for(bucket, s3_server, nodes={"names": ["gpu-5"]})
        cluster.custom.create_namespaced_custom_object(G, V, "default", P, warmup("before-training", **spec))

        def gates() -> list[str]:
            found = cluster.core.read_namespaced_pod("trainer", "default").spec.scheduling_gates or []
            return [g.name for g in found]

        assert "pffs.io/warmup" in gates()
        wait_for("the pod ungated", lambda: gates() == ["example.com/quota"], 60)
        assert cluster.status("before-training")["phase"] == "Succeeded"  # not before it ended
        # ... nor before the node's cache report (what the extender scores) holds the dataset whole
        report = cluster.cache_report("gpu-5")["datasets"][f"s3://{bucket}/ds"]
        assert report["cached_bytes"] == report["total_bytes"] > 0
    finally:
        cluster.core.delete_namespaced_pod("trainer", "default", grace_period_seconds=0)


def test_a_warmup_of_a_claim_resolves_its_volume_and_a_missing_one_fails_with_its_name(
    cluster: Cluster, s3_server: SeaweedS3, bucket: str, dataset: dict[str, bytes]
) -> None:
    cluster.controller()
    cluster.node("gpu-7", {"pool": "claim"})
    attributes = {
        "source": f"s3://{bucket}/ds",
        "endpointUrl": s3_server.endpoint_url,
        "blockSize": str(BLOCK),
    }
    cluster.core.create_persistent_volume(
        {
            "metadata": {"name": "ds-volume"},
            "spec": {
                "capacity": {"storage": "1Gi"},
                "accessModes": ["ReadOnlyMany"],
                "storageClassName": "",
                "csi": {"driver": "csi.pffs.io", "volumeHandle": "ds", "volumeAttributes": attributes},
            },
        }
    )
    cluster.core.create_namespaced_persistent_volume_claim(
        "default",
        {
            "metadata": {"name": "ds"},
            "spec": {
                "accessModes": ["ReadOnlyMany"],
                "storageClassName": "",
                "volumeName": "ds-volume",
                "resources": {"requests": {"storage": "1Gi"}},
            },
        },
    )
    try:
        wait_for(
            "the claim bound",
            lambda: (
                cluster.core.read_namespaced_persistent_volume_claim("ds", "default").status.phase == "Bound"
            ),
            60,
        )
        spec = {
            "volumeClaim": "ds",
            "secretName": "s3-credentials",
            "paths": ["train"],
            "nodes": {"names": ["gpu-7"]},
        }
        cluster.custom.create_namespaced_custom_object(G, V, "default", P, warmup("by-claim", **spec))
        wait_for("by-claim to succeed", lambda: cluster.status("by-claim").get("phase") == "Succeeded", 60)
        assert cluster.status("by-claim")["resolved"] == attributes
        missing = {"volumeClaim": "nope", "nodes": {"names": ["gpu-7"]}}
        cluster.custom.create_namespaced_custom_object(G, V, "default", P, warmup("no-claim", **missing))
        wait_for("no-claim to fail", lambda: cluster.status("no-claim").get("phase") == "Failed", 30)
        assert "volumeClaim nope" in cluster.status("no-claim")["lastError"]
    finally:
        with contextlib.suppress(Exception):
            cluster.core.delete_namespaced_persistent_volume_claim("ds", "default")
        with contextlib.suppress(Exception):
            cluster.core.delete_persistent_volume("ds-volume")


def test_a_warmup_that_cannot_start_fails_with_one_readable_message(
    cluster: Cluster, s3_server: SeaweedS3, bucket: str, dataset: dict[str, bytes]
) -> None:
    """A missing Secret, a node that does not exist, a selector no node matches: each warm-up fails at
    once with one line saying what is wrong and where to look (not the client's HTTP dump, not Pending)."""
    cluster.controller()
    cluster.node("gpu-5", {"pool": "errors"})
    cases = {
        "no-secret": (
            spec_for(bucket, s3_server, nodes={"names": ["gpu-5"]}, secretName="not-there"),
            f"gpu-5: Secret {SYSTEM}/not-there (spec.secretName) does not exist: a warm-up's Secret must be "
            f"in the pffs CSI driver's namespace ({SYSTEM}), with the keys accessKeyId and secretAccessKey",
        ),
        "no-node": (
            spec_for(bucket, s3_server, nodes={"names": ["gpu-5", "gpu-typo"]}),
            "nodes.names: no node named gpu-typo in the cluster (its nodes: ",
        ),
        "no-match": (
            spec_for(bucket, s3_server, nodes={"selector": {"pool": "nowhere"}}),
            "nodes.selector: no node has the labels pool=nowhere",
        ),
    }
    for name, (spec, _) in cases.items():
        cluster.custom.create_namespaced_custom_object(G, V, "default", P, warmup(name, **spec))
    for name, (_, message) in cases.items():
        status = wait_for(f"{name} to fail", lambda n=name: cluster.status(n).get("phase") == "Failed", 60)
        error = cluster.status(name)["lastError"]
        assert status and error.startswith(message), error
        assert "HTTPHeaderDict" not in error and "\n" not in error


def test_a_warmup_no_node_plugin_takes_up_says_so_while_it_waits(api_server: Any) -> None:
    """A chosen node where no pffs plugin warms (none runs there, or without warmups.enabled): after the
    pick-up grace the warm-up, still Pending, names the nodes and what to check; the message goes once the
    node has started."""
    from kubernetes import client

    from pffs.csi.warmup_controller import WarmupController

    api = api_server.api()
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    core.create_node({"metadata": {"name": "no-plugin-node"}})
    controller = WarmupController(api, SYSTEM)  # reconciled here, without its watch and Lease

    def item() -> dict[str, Any]:
        return dict(custom.get_namespaced_custom_object(G, V, "default", P, "idle"))

    spec = {"source": "s3://b/ds", "nodes": {"names": ["no-plugin-node"]}}
    custom.create_namespaced_custom_object(G, V, "default", P, warmup("idle", **spec))
    try:
        controller.reconcile(item())  # resolved: the node chosen, Pending
        controller.reconcile(item())
        assert item()["status"]["phase"] == "Pending" and "lastError" not in item()["status"]
        controller.pickup_grace_s = 0
        controller.reconcile(item())
        status = item()["status"]
        assert status["phase"] == "Pending"
        assert status["lastError"] == (
            "not taken up after 0 s on no-plugin-node: is a pffs-csi-node pod running there, with "
            "warmups.enabled (the plugin's --warmups)?"
        )
        started = {"phase": "Running", "startTime": status["startTime"]}
        custom.patch_namespaced_custom_object_status(
            G, V, "default", P, "idle", {"status": {"nodes": {"no-plugin-node": started}}},
            _content_type="application/merge-patch+json",
        )  # fmt: skip
        controller.reconcile(item())
        assert item()["status"]["phase"] == "Running" and "lastError" not in item()["status"]
    finally:
        custom.delete_namespaced_custom_object(G, V, "default", P, "idle")
        core.delete_node("no-plugin-node")


def test_a_finished_warmup_is_deleted_after_its_ttl(
    cluster: Cluster, s3_server: SeaweedS3, bucket: str, dataset: dict[str, bytes]
) -> None:
    from kubernetes.client.exceptions import ApiException

    cluster.controller()
    cluster.node("gpu-3", {"pool": "ttl"})
    spec = spec_for(bucket, s3_server, nodes={"names": ["gpu-3"]}, ttlSecondsAfterFinished=0)
    cluster.custom.create_namespaced_custom_object(G, V, "default", P, warmup("short-lived", **spec))

    def gone() -> bool:
        try:
            cluster.status("short-lived")
        except ApiException as exc:
            return exc.status == 404
        return False

    wait_for("the warm-up deleted", gone, 60)
    assert cached_exactly(cluster.plugins["gpu-3"].cache_dir, bucket, s3_server, dataset)  # type: ignore[arg-type]


def test_a_warmup_of_a_podgroup_waits_for_its_pods_nodes_then_warms_those_only(
    cluster: Cluster, s3_server: SeaweedS3, bucket: str, dataset: dict[str, bytes]
) -> None:
    cluster.controller()
    members = [cluster.node(f"gang-{i}", {"pool": "gang"}) for i in range(2)]
    cluster.node("gang-other", {"pool": "gang"})  # same labels, no pod of the group

    def pod(name: str, node: str | None) -> dict[str, Any]:
        spec: dict[str, Any] = {"containers": [{"name": "train", "image": "busybox"}]}
        if node:
            spec["nodeName"] = node
        return {
            "metadata": {"name": name, "labels": {"scheduling.x-k8s.io/pod-group": "job-1"}},
            "spec": spec,
        }

    created = ["job-1-0", "job-1-1"]
    try:
        cluster.core.create_namespaced_pod("default", pod("job-1-0", None))  # not bound yet
        spec = spec_for(bucket, s3_server, nodes={"podGroup": "job-1"})
        cluster.custom.create_namespaced_custom_object(G, V, "default", P, warmup("gang", **spec))
        waiting = wait_for("the warm-up waiting", lambda: cluster.status("gang").get("lastError"), 30)
        assert "no pod of PodGroup job-1 is bound" in waiting
        assert cluster.status("gang")["phase"] == "Pending"
        cluster.core.delete_namespaced_pod("job-1-0", "default", grace_period_seconds=0)
        wait_for(
            "the unbound pod gone",
            lambda: (
                "job-1-0" not in {p.metadata.name for p in cluster.core.list_namespaced_pod("default").items}
            ),
            30,
        )
        for name, node in zip(created, ("gang-0", "gang-1"), strict=True):
            cluster.core.create_namespaced_pod("default", pod(name, node))
        wait_for("the warm-up to succeed", lambda: cluster.status("gang").get("phase") == "Succeeded", 90)
        assert sorted(cluster.status("gang")["nodes"]) == ["gang-0", "gang-1"]
        assert "lastError" not in cluster.status("gang")
        for node in members:
            assert cached_exactly(node.cache_dir, bucket, s3_server, dataset)  # type: ignore[arg-type]
    finally:
        cluster.delete_pods(created)


def test_a_scheduled_warmup_runs_again_when_its_schedule_fires_and_a_bad_schedule_fails_with_its_field(
    cluster: Cluster, s3_server: SeaweedS3, bucket: str, dataset: dict[str, bytes]
) -> None:
    cluster.controller()
    node = cluster.node("cron-0", {"pool": "cron"})
    spec = spec_for(bucket, s3_server, nodes={"names": ["cron-0"]}, schedule="* * * * *")
    cluster.custom.create_namespaced_custom_object(G, V, "default", P, warmup("every-minute", **spec))
    wait_for("the first run", lambda: cluster.status("every-minute").get("phase") == "Succeeded", 60)
    first = cluster.status("every-minute")["nodes"]["cron-0"]
    assert first["bytesFetched"] == sum(len(d) for d in dataset.values())

    def second_run_done() -> bool:
        status = cluster.status("every-minute")
        return status.get("runs") == 2 and status.get("phase") == "Succeeded"

    wait_for("the second run, after the next minute", second_run_done, 150, interval_s=0.5)
    again = cluster.status("every-minute")["nodes"]["cron-0"]
    assert again["bytesFetched"] == 0 and again["bytesDone"] == again["bytesTotal"]  # all cached already
    assert again["startTime"] > first["startTime"]
    assert cached_exactly(node.cache_dir, bucket, s3_server, dataset)  # type: ignore[arg-type]

    bad = spec_for(bucket, s3_server, nodes={"names": ["cron-0"]}, schedule="61 * * * *")
    cluster.custom.create_namespaced_custom_object(G, V, "default", P, warmup("bad-schedule", **bad))
    wait_for("the bad schedule to fail", lambda: cluster.status("bad-schedule").get("phase") == "Failed", 30)
    assert "minute: '61' is outside 0-59" in cluster.status("bad-schedule")["lastError"]


# -- warm before bind: `pffs scheduler` holds a gang until its nodes report the dataset ----------------------
def gang_pod(name: str, bucket: str, s3_server: SeaweedS3, deadline: str) -> dict[str, Any]:
    volume = {
        "driver": "csi.pffs.io",
        "volumeAttributes": {
            "source": f"s3://{bucket}/ds", "endpointUrl": s3_server.endpoint_url, "blockSize": str(BLOCK),
        },
    }  # fmt: skip
    return {
        "metadata": {
            "name": name,
            "labels": {"scheduling.x-k8s.io/pod-group": name.rsplit("-", 1)[0]},
            "annotations": {
                "pffs.io/min-member": "2",
                "pffs.io/warm-before-bind": deadline,
                "pffs.io/warm-secret": "s3-credentials",
            },
        },
        "spec": {
            "schedulerName": "pffs-scheduler",
            "containers": [{"name": "train", "image": "busybox", "resources": {"requests": {"cpu": "3"}}}],
            "volumes": [{"name": "data", "csi": volume}],
            # the API server taints a new Node not-ready; no kubelet here will clear it
            "tolerations": [
                {"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoSchedule"}
            ],
        },
    }


def bound_to(cluster: Cluster, names: list[str]) -> dict[str, str]:
    pods = {p.metadata.name: p for p in cluster.core.list_namespaced_pod("default").items}
    return {n: pods[n].spec.node_name for n in names if n in pods and pods[n].spec.node_name}


def pod_events(cluster: Cluster, reason: str) -> list[Any]:
    return [e for e in cluster.core.list_namespaced_event("default").items if e.reason == reason]


def test_a_warm_before_bind_gang_binds_only_once_its_nodes_report_the_dataset(
    cluster: Cluster, s3_server: SeaweedS3, bucket: str, dataset: dict[str, bytes]
) -> None:
    cluster.controller()
    nodes = {name: cluster.node(name, {"pool": "wbb"}) for name in ("wbb-0", "wbb-1")}
    for name in nodes:
        cluster.schedulable(name)
    url = f"s3://{bucket}/ds"
    assert not any(url in cluster.cache_report(n).get("datasets", {}) for n in nodes)
    names = ["job-0", "job-1"]
    try:
        for name in names:
            cluster.core.create_namespaced_pod("default", gang_pod(name, bucket, s3_server, "120s"))
        cluster.scheduler()
        made = wait_for("the scheduler's warm-up", lambda: cluster.custom.list_namespaced_custom_object(
            G, V, "default", P, label_selector="pffs.io/pod-group=job")["items"], 30)  # fmt: skip
        (warm,) = made
        assert sorted(warm["spec"]["nodes"]["names"]) == sorted(nodes)
        assert warm["spec"]["source"] == url and warm["spec"]["secretName"] == "s3-credentials"
        reports_when_bound: list[dict[str, Any]] = []

        def bound() -> dict[str, str]:
            found = bound_to(cluster, names)
            if not found:
                return {}
            reports_when_bound.extend(cluster.cache_report(n).get("datasets", {}).get(url, {}) for n in nodes)
            return found if len(found) == 2 else {}

        placed = wait_for("the gang bound", bound, 90, interval_s=0.05)
        assert sorted(placed.values()) == sorted(nodes)
        for report in reports_when_bound:  # both nodes said the whole dataset was there before either bind
            assert report["cached_bytes"] == report["total_bytes"] > 0, reports_when_bound
        (status,) = [cluster.status(w["metadata"]["name"]) for w in made]
        assert status["phase"] == "Succeeded"
        events = pod_events(cluster, "WarmBeforeBind")
        assert len(events) == 2 and all(f"{url} warm on wbb-0, wbb-1 after" in e.message for e in events)
        for node in nodes.values():
            assert cached_exactly(node.cache_dir, bucket, s3_server, dataset)  # type: ignore[arg-type]
    finally:
        cluster.delete_pods(names)


def test_a_warm_before_bind_gang_binds_cold_at_its_deadline_when_a_node_cannot_warm(
    cluster: Cluster, s3_server: SeaweedS3, bucket: str, dataset: dict[str, bytes]
) -> None:
    cluster.controller()
    cluster.node("late-0", {"pool": "late"})
    cluster.schedulable("late-0")
    cluster.schedulable("late-1")  # a Node whose plugin is down: its part of the warm-up never runs
    names = ["slow-0", "slow-1"]
    try:
        for name in names:
            cluster.core.create_namespaced_pod("default", gang_pod(name, bucket, s3_server, "12s"))
        cluster.scheduler()
        started = time.monotonic()
        placed = wait_for("the gang bound", lambda: (b := bound_to(cluster, names)) and len(b) == 2 and b, 60)
        waited = time.monotonic() - started
        assert sorted(placed.values()) == ["late-0", "late-1"]
        assert 12 <= waited < 30, waited  # at the deadline, not before, and soon after it
        events = pod_events(cluster, "WarmBeforeBindDeadline")
        assert len(events) == 2 and events[0].type == "Warning"
        assert (
            events[0].message == "deadline of 12 s passed with late-1 not warm: bound cold to late-0, late-1"
        )
    finally:
        cluster.delete_pods(names)


def test_a_stopped_leader_hands_its_lease_to_the_next_at_once(api_server: Any) -> None:
    """A controller replaced (a rollout, a test's next controller) must not leave warm-ups unattended for
    the Lease's whole duration: the leader that stops hands the Lease back, and the waiting candidate
    leads at its next look, well before the old one would have expired."""
    from pffs.csi.leader import LEASE_S, RENEW_S, LeaseLeader

    api = api_server.api()
    first = LeaseLeader(api, SYSTEM, "pffs-test-handover", "first")
    first.start()
    wait_for("the first candidate leading", first.is_leader, 15)
    second = LeaseLeader(api, SYSTEM, "pffs-test-handover", "second")
    second.start()
    try:
        time.sleep(RENEW_S + 1)
        assert not second.is_leader()  # the Lease is held
        stopped = time.monotonic()
        first.stop()
        assert not first.is_leader()
        wait_for("the second candidate leading", second.is_leader, RENEW_S + 5)
        assert time.monotonic() - stopped < LEASE_S
    finally:
        first.stop()
        second.stop()
