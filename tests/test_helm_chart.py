"""The Helm chart deploy/helm/pffs-csi, the one source of the CSI driver's manifests, and the dashboard and
alert rules that watch the driver.

The chart is linted and rendered with several sets of values (defaults, the CSI sidecars, the host's
network, JSON logs, prometheus-operator objects, a kubelet elsewhere than /var/lib/kubelet, a
StorageClass); every render passes tests/test_deploy.py's checks of the API types and of the design (FUSE
privileges, registration and health wiring, RBAC), and a real API server's server-side dry run. deploy/csi
must be the chart's render with its default values (scripts/render_manifests.sh), byte for byte.

The dashboard's and the alerts' PromQL may name only metrics pffs exports: the names are taken from the
registries themselves (the plugin's, the mounter's and a mount's collector), as a scrape would list them.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import require
from test_deploy import (
    CLUSTER_SCOPED,
    CSI_DIR,
    NODE_DAEMONSETS,
    arg_value,
    assert_args_follow_the_image_entrypoint,
    assert_node_pods_have_what_fuse_needs,
    assert_node_rbac,
    assert_plugin_and_mounter_share_their_paths,
    assert_registration_and_health_line_up,
    container,
    containers,
    find_tool,
    label,
    one,
    pod_specs,
    schema_errors,
)

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "deploy" / "helm" / "pffs-csi"
MONITORING = REPO / "deploy" / "monitoring"
RELEASE = "pffs-csi"
NAMESPACE = "pffs-system"
DEFAULT_KUBELET = "/var/lib/kubelet"
# Kinds of prometheus-operator's CRDs: no model in the kubernetes client, no CRD in a bare API server.
MONITORING_KINDS = {"PodMonitor", "PrometheusRule"}

# name -> values (as `helm template -f` takes them). Each set is rendered, linted and checked.
VALUE_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "sidecars": {"node": {"sidecars": {"enabled": True}}, "controller": {"sidecars": {"enabled": True}}},
    "host-network": {
        "hostNetwork": True,
        "extraEnv": [{"name": "KUBERNETES_SERVICE_HOST", "value": "127.0.0.1"}],
    },
    "json-logs": {"logFormat": "json", "logLevel": 2},
    "monitoring": {
        "podMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
        "prometheusRule": {"enabled": True},
        "dashboard": {"enabled": True},
    },
    "k0s": {"node": {"kubeletPath": "/var/lib/k0s/kubelet", "cacheDir": "/mnt/nvme/pffs-cache"}},
    "storage-class": {
        "storageClass": {
            "enabled": True,
            "source": "s3://datasets/pvc",
            "endpointUrl": "http://s3.example.internal:8333",
            "parameters": {"blockSize": "8M", "readOnly": False},
        },
        "image": {"registry": "registry.example.internal/mirror", "tag": "0.1.1"},
        "imagePullSecrets": [{"name": "registry-credentials"}],
        "controller": {
            "serviceAccount": {"annotations": {"eks.amazonaws.com/role-arn": "arn:aws:iam::1:role/x"}}
        },
        "mounter": {
            "serviceAccount": {"annotations": {"eks.amazonaws.com/role-arn": "arn:aws:iam::1:role/y"}}
        },
    },
    "no-controller": {"controller": {"enabled": False}, "metrics": {"enabled": False}, "logLevel": 0},
    "warmups": {"warmups": {"enabled": True}},
    "cache-group": {
        "hostNetwork": True,
        "cacheGroup": {"enabled": True, "ports": "9900-9909", "tlsSecret": "pffs-cache-group-tls"},
        "storageClass": {
            "enabled": True,
            "source": "s3://datasets/pvc",
            "parameters": {"cacheGroup": "share"},
        },
    },
}


def kubelet_of(values: dict[str, Any]) -> str:
    return str(values.get("node", {}).get("kubeletPath", DEFAULT_KUBELET))


# ------------------------------------------------------------------ helm


def helm() -> str:
    path = find_tool("helm")
    if path is None:
        require(["helm (not in $PFFS_TOOLS_BIN, ~/.cache/pffs-tools/bin or PATH)"], "the Helm chart's tests")
    assert path is not None
    return path


def run_helm(*args: str, values: dict[str, Any] | None = None) -> subprocess.CompletedProcess[str]:
    """helm ARGS, with `values` given as a values file on stdin (JSON is YAML)."""
    command = [helm(), *args]
    if values is not None:
        command += ["--values", "-"]
    return subprocess.run(
        command, input=json.dumps(values or {}), capture_output=True, text=True, timeout=120, check=False
    )


@functools.cache
def _template(values_json: str) -> tuple[Any, ...]:
    answer = run_helm(
        "template",
        RELEASE,
        str(CHART),
        "--namespace",
        NAMESPACE,
        "--include-crds",
        values=json.loads(values_json),
    )
    assert answer.returncode == 0, f"helm template failed:\n{answer.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(answer.stdout) if doc)


def template(values: dict[str, Any]) -> list[dict[str, Any]]:
    """The objects `helm template pffs-csi deploy/helm/pffs-csi -n pffs-system --include-crds -f VALUES`
    renders, the CRDs `helm install` applies first included (once per run: treat them as read-only)."""
    return list(_template(json.dumps(values, sort_keys=True)))


value_sets = pytest.mark.parametrize("values", list(VALUE_SETS.values()), ids=list(VALUE_SETS))


@value_sets
def test_helm_lint_passes(values: dict[str, Any]) -> None:
    answer = run_helm("lint", "--strict", str(CHART), "--namespace", NAMESPACE, values=values)
    assert answer.returncode == 0, answer.stdout + answer.stderr


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"logLevel": 3}, "logLevel 3: 0, 1 or 2"),
        ({"logFormat": "xml"}, 'logFormat "xml": text or json'),
        ({"image": {"tag": "latest"}}, "image.tag: name a version, not latest"),
        ({"node": {"kubeletPath": "var/lib/kubelet"}}, "node.kubeletPath"),
        ({"storageClass": {"enabled": True}}, "storageClass.source"),
        ({"cacheGroup": {"enabled": True}}, "cacheGroup.enabled needs hostNetwork: true"),
    ],
)
def test_a_bad_value_fails_the_render_with_its_name(values: dict[str, Any], message: str) -> None:
    answer = run_helm("template", RELEASE, str(CHART), "--namespace", NAMESPACE, values=values)
    assert answer.returncode != 0
    assert message in answer.stderr


@value_sets
def test_every_object_fits_the_api_types(values: dict[str, Any]) -> None:
    objects = template(values)
    errors = [error for obj in objects for error in schema_errors(obj)]
    assert errors == [], "\n".join(errors)
    for obj in objects:
        namespace = obj["metadata"].get("namespace")
        assert namespace == (None if obj["kind"] in CLUSTER_SCOPED else NAMESPACE), label(obj)


@value_sets
def test_the_design_holds(values: dict[str, Any]) -> None:
    """tests/test_deploy.py's checks of deploy/csi, over this render."""
    objects = template(values)
    kubelet = kubelet_of(values)
    assert_node_pods_have_what_fuse_needs(objects, kubelet)
    assert_plugin_and_mounter_share_their_paths(objects)
    assert_registration_and_health_line_up(objects, kubelet)
    assert_args_follow_the_image_entrypoint(objects)
    assert_node_rbac(objects)
    assert one(objects, "DaemonSet", "pffs-csi-mounter")["spec"]["updateStrategy"] == {"type": "OnDelete"}
    assert not [o for o in objects if o["kind"] == "Secret"], "the chart must not make a Secret"


@value_sets
def test_the_pffs_command_takes_every_rendered_args(
    values: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    """Each pffs container's args parse with the `pffs` command's own parser (the image's entrypoint runs
    `pffs ARGS`): a flag the command does not know would crash-loop the pod."""
    from pffs.cli.main import build_parser

    seen = 0
    for obj, spec in pod_specs(template(values)):
        for c in containers(spec):
            if "pffs/csi:" not in c["image"]:
                continue
            args = [arg.replace("$(NODE_ID)", "node-1") for arg in c["args"]]
            try:
                build_parser().parse_args(args)
            except SystemExit:
                pytest.fail(f"{label(obj)} {c['name']}: `pffs {' '.join(args)}`: {capsys.readouterr().err}")
            seen += 1
    assert seen >= 2


@value_sets
def test_every_image_is_pinned(values: dict[str, Any]) -> None:
    images = [c["image"] for _, spec in pod_specs(template(values)) for c in containers(spec)]
    assert images
    for image in images:
        name, _, tag = image.rpartition(":")
        assert name and "/" not in tag and tag != "latest" and re.search(r"\d", tag), image


def strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from strings(item)


@pytest.mark.parametrize("sidecars", [False, True])
def test_every_kubelet_path_follows_the_value(sidecars: bool) -> None:
    kubelet = "/var/lib/k0s/kubelet"
    values = {**VALUE_SETS["k0s"], **(VALUE_SETS["sidecars"] if sidecars else {})}
    values["node"] = {**VALUE_SETS["k0s"]["node"], "sidecars": {"enabled": sidecars}}
    objects = template(values)
    assert_node_pods_have_what_fuse_needs(objects, kubelet)
    assert_registration_and_health_line_up(objects, kubelet)
    seen = 0
    for daemonset in NODE_DAEMONSETS:
        spec = one(objects, "DaemonSet", daemonset)["spec"]["template"]["spec"]
        paths = [v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v]
        for c in containers(spec):
            paths += [m["mountPath"] for m in c.get("volumeMounts", [])] + list(strings(c.get("args", [])))
        for path in paths:
            if "kubelet" in path and "/" in path:
                seen += 1
                assert kubelet in path, f"{daemonset}: {path}"
    assert seen >= (9 if sidecars else 7)
    # Nowhere in the render, comments aside, is the default path left.
    assert not [s for obj in objects for s in strings(obj) if DEFAULT_KUBELET in s]
    # The preflight hook checks that path before Helm changes anything, and prints why when it fails.
    job = one(objects, "Job", "pffs-csi-preflight")
    hooks = job["metadata"]["annotations"]
    assert set(hooks["helm.sh/hook"].split(",")) == {"pre-install", "pre-upgrade", "pre-rollback"}
    assert hooks["helm.sh/hook-output-log-policy"] == "hook-failed"
    pod = job["spec"]["template"]["spec"]
    assert pod["hostPID"] is True and job["spec"]["backoffLimit"] == 0
    assert arg_value(pod["containers"][0]["args"], "--kubelet-dir") == kubelet
    # The node plugin is Ready only when its --ready-file says ok.
    plugin = container(one(objects, "DaemonSet", "pffs-csi-node")["spec"]["template"]["spec"], "pffs-csi")
    ready_file = arg_value(plugin["args"], "--ready-file")
    assert f"grep -qx ok {ready_file}" in plugin["readinessProbe"]["exec"]["command"][-1]
    off = {**values, "node": {**values["node"], "preflight": {"enabled": False}}}
    assert not [o for o in template(off) if o["metadata"]["name"] == "pffs-csi-preflight"]


def test_values_reach_the_pods() -> None:
    host = template(VALUE_SETS["host-network"])
    for _, spec in pod_specs(host):
        assert spec["hostNetwork"] is True and spec["dnsPolicy"] == "ClusterFirstWithHostNet"
        for c in spec["containers"]:
            if "pffs/csi:" in c["image"]:
                assert {"name": "KUBERNETES_SERVICE_HOST", "value": "127.0.0.1"} in c["env"], c["name"]
    logs = template(VALUE_SETS["json-logs"])
    quiet = template(VALUE_SETS["no-controller"])
    for daemonset, name in NODE_DAEMONSETS.items():
        args = container(one(logs, "DaemonSet", daemonset)["spec"]["template"]["spec"], name)["args"]
        assert args[-3:] == ["-vv", "--log-format", "json"]
        args = container(one(quiet, "DaemonSet", daemonset)["spec"]["template"]["spec"], name)["args"]
        assert not {"-v", "-vv", "--log-format"} & set(args)
    assert not [o for o in quiet if o["metadata"]["name"] in ("pffs-csi-controller", "pffs-csi-provisioner")]
    for _, spec in pod_specs(quiet):
        assert "prometheus.io/scrape" not in str(spec)

    custom = template(VALUE_SETS["storage-class"])
    for _, spec in pod_specs(custom):
        assert spec["imagePullSecrets"] == [{"name": "registry-credentials"}]
        pffs = [c for c in spec["containers"] if "pffs/csi" in c["image"]]
        assert [c["image"] for c in pffs] == ["registry.example.internal/mirror/pffs/csi:0.1.1"]
    mounter = one(custom, "ServiceAccount", "pffs-csi-mounter")
    assert mounter["metadata"]["annotations"] == {"eks.amazonaws.com/role-arn": "arn:aws:iam::1:role/y"}
    storage_class = one(custom, "StorageClass", "pffs-s3")
    assert (
        storage_class["parameters"]["blockSize"] == "8M"
        and storage_class["parameters"]["readOnly"] == "false"
    )
    assert storage_class["parameters"]["csi.storage.k8s.io/node-stage-secret-namespace"] == NAMESPACE
    assert not [o for o in template({}) if o["kind"] == "StorageClass"]


@pytest.mark.parametrize("sidecars", [False, True])
def test_pods_on_one_node_never_claim_one_host_port(sidecars: bool) -> None:
    """With hostNetwork, the node plugin, the mounter and a controller pod on the same node bind the node's
    ports: each port the chart declares or serves is claimed once."""
    switch = {"sidecars": {"enabled": sidecars}}
    objects = template({"hostNetwork": True, "node": switch, "controller": switch})
    claimed: list[int] = []
    for _, spec in pod_specs(objects):
        for c in spec["containers"]:
            claimed += [p["containerPort"] for p in c.get("ports", [])]
            if c["name"] == "liveness-probe":
                claimed.append(int(arg_value(c["args"], "--health-port")))
    assert len(claimed) >= 3
    # A port the probed container declares for its sidecar is the sidecar's port, counted once.
    probes = {
        p["containerPort"]
        for _, spec in pod_specs(objects)
        for c in spec["containers"]
        for p in c.get("ports", [])
        if p["name"] == "healthz"
    }
    ports = [port for port in claimed if port not in probes] + sorted(probes)
    assert len(ports) == len(set(ports)), sorted(claimed)
    assert len(probes) == (2 if sidecars else 0)


def test_the_controller_rolls_out_without_a_surge_pod_wanting_the_old_ones_host_port() -> None:
    """With hostNetwork a second controller pod cannot start on the node of the first (the metrics port):
    a rollout must remove the old pod first, or a one-node cluster never finishes it."""
    for values in ({}, {"hostNetwork": True}, {"controller": {"replicas": 2}}):
        (deployment,) = [o for o in template(values) if o["kind"] == "Deployment"]
        assert deployment["spec"]["strategy"] == {
            "type": "RollingUpdate",
            "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1},
        }


def test_uninstall_runs_a_post_delete_hook_with_just_the_rules_it_needs() -> None:
    """`helm uninstall` then removes what the driver wrote at run time (the Nodes' annotations, the
    Leases): a post-delete Job with its own ServiceAccount and rules, all hooks (the release's own are gone
    by then), all removed once it succeeded; uninstall.cleanup: false renders none of them."""
    hooks = [
        o for o in template({}) if o["metadata"].get("annotations", {}).get("helm.sh/hook") == "post-delete"
    ]
    assert {(o["kind"], o["metadata"]["name"]) for o in hooks} == {
        (kind, "pffs-csi-uninstall")
        for kind in ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding", "Job")
    }
    for o in hooks:
        policy = o["metadata"]["annotations"]["helm.sh/hook-delete-policy"]
        assert policy == "before-hook-creation,hook-succeeded", o["kind"]
        weight = int(o["metadata"]["annotations"].get("helm.sh/hook-weight", "0"))
        assert weight < 0 if o["kind"] != "Job" else weight == 0, o["kind"]  # its rules exist first
    (job,) = [o for o in hooks if o["kind"] == "Job"]
    pod = job["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "pffs-csi-uninstall"
    assert pod["containers"][0]["args"][:4] == ["csi-uninstall", "--in-cluster", "--namespace", NAMESPACE]
    rules = {
        (kind, resource, verb)
        for o in hooks
        if o["kind"] in ("ClusterRole", "Role")
        for rule in o["rules"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
        for kind in [o["kind"]]
    }
    assert rules == {
        ("ClusterRole", "nodes", "list"),
        ("ClusterRole", "nodes", "patch"),
        ("Role", "pods", "list"),
        ("Role", "leases", "delete"),
    }
    assert "--delete-crd" not in pod["containers"][0]["args"]
    off = template({"uninstall": {"cleanup": False}})
    assert not [o for o in off if o["metadata"]["name"] == "pffs-csi-uninstall"]
    # uninstall.deleteCrd: the Job deletes the CRD too, allowed that one CRD alone.
    crd = template({"uninstall": {"deleteCrd": True}})
    (job,) = [o for o in crd if o["kind"] == "Job" and o["metadata"]["name"] == "pffs-csi-uninstall"]
    assert "--delete-crd" in job["spec"]["template"]["spec"]["containers"][0]["args"]
    (role,) = [o for o in crd if o["kind"] == "ClusterRole" and o["metadata"]["name"] == "pffs-csi-uninstall"]
    assert {
        "apiGroups": ["apiextensions.k8s.io"],
        "resources": ["customresourcedefinitions"],
        "resourceNames": ["datasetwarmups.pffs.io"],
        "verbs": ["delete"],
    } in role["rules"]


def test_every_top_level_value_is_documented() -> None:
    """values.yaml is the chart's manual: a comment above each top-level value."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    undocumented = []
    for index, line in enumerate(lines):
        if re.match(r"^[A-Za-z]\w*:", line):
            above = lines[index - 1] if index else ""
            if not above.startswith("#"):
                undocumented.append(line.split(":")[0])
    assert not undocumented
    assert set(yaml.safe_load((CHART / "values.yaml").read_text())) >= {
        "image",
        "imagePullSecrets",
        "logLevel",
        "logFormat",
        "hostNetwork",
        "metrics",
        "podMonitor",
        "prometheusRule",
        "dashboard",
        "node",
        "mounter",
        "controller",
        "sidecars",
        "storageClass",
    }


def test_the_monitoring_objects_select_what_serves_metrics() -> None:
    objects = template(VALUE_SETS["monitoring"])
    monitor = one(objects, "PodMonitor", "pffs-csi")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    spec = monitor["spec"]
    assert spec["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    (expression,) = spec["selector"]["matchExpressions"]
    endpoints = spec["podMetricsEndpoints"]
    assert [e["port"] for e in endpoints] == ["metrics"] and endpoints[0]["path"] == "/metrics"
    assert {"sourceLabels": ["__meta_kubernetes_pod_node_name"], "targetLabel": "node"} in endpoints[0][
        "relabelings"
    ]
    selected = []
    for obj, pod in pod_specs(objects):
        labels = obj["spec"]["template"]["metadata"]["labels"]
        if expression["operator"] == "In" and labels.get(expression["key"]) in expression["values"]:
            selected.append(obj["metadata"]["name"])
            ports = [p for c in pod["containers"] for p in c.get("ports", []) if p.get("name") == "metrics"]
            assert len(ports) == 1, label(obj)
    assert sorted(selected) == ["pffs-csi-controller", "pffs-csi-mounter", "pffs-csi-node"]

    rule = one(objects, "PrometheusRule", "pffs-csi")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["spec"] == alerts()["spec"]
    dashboard = one(objects, "ConfigMap", "pffs-csi-dashboard")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["pffs-csi.json"]) == json.loads(
        (MONITORING / "grafana-dashboard.json").read_text()
    )
    assert not {o["kind"] for o in template({})} & MONITORING_KINDS


# ------------------------------------------------------------------ deploy/csi is the chart's render


def test_deploy_csi_is_the_charts_render(tmp_path: Path) -> None:
    helm()  # skips, naming helm, where it is missing
    answer = subprocess.run(
        ["bash", str(REPO / "scripts" / "render_manifests.sh"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert answer.returncode == 0, answer.stderr
    generated = sorted(path.name for path in tmp_path.iterdir())
    assert generated == ["csidriver.yaml", "pffs-csi.yaml"]
    stale = [name for name in generated if (tmp_path / name).read_text() != (CSI_DIR / name).read_text()]
    assert not stale, f"deploy/csi/{stale} differ from the chart: run scripts/render_manifests.sh"
    kustomization = yaml.safe_load((CSI_DIR / "kustomization.yaml").read_text())
    assert kustomization["resources"] == ["namespace.yaml", *generated]
    # The render of the files equals the chart's objects.
    from_files = [
        doc for name in generated for doc in yaml.safe_load_all((CSI_DIR / name).read_text()) if doc
    ]
    key = json.dumps  # objects are dicts: compare them as sorted JSON
    # Hooks (the preflight Job) are Helm's alone: `kubectl apply` has no use for them.
    chart = [o for o in template({}) if "helm.sh/hook" not in o["metadata"].get("annotations", {})]
    assert sorted(map(key, from_files)) == sorted(map(key, chart))


# ------------------------------------------------------------------ a real API server's dry run


@pytest.fixture(scope="module")
def api_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from pffs.testing.kube_cluster import KubeControlPlane, missing_binaries

    helm()
    require(missing_binaries(), "the server-side dry run of the chart")
    with KubeControlPlane(tmp_path_factory.mktemp("kube")) as control_plane:
        yield control_plane


@pytest.mark.kube
@pytest.mark.timeout(300)
def test_every_render_passes_a_server_side_dry_run(api_server: Any) -> None:
    from kubernetes import dynamic
    from kubernetes.client.exceptions import ApiException

    api = dynamic.DynamicClient(api_server.api())
    # The namespace for real (a dry-run object cannot live in a namespace a dry run made), with the Pod
    # Security labels the privileged pods need.
    namespace = yaml.safe_load((CSI_DIR / "namespace.yaml").read_text())
    with contextlib.suppress(ApiException):
        api.resources.get(api_version="v1", kind="Namespace").create(body=namespace)
    refused = []
    for name, values in VALUE_SETS.items():
        objects = [o for o in template(values) if o["kind"] not in MONITORING_KINDS]
        for obj in objects:
            resource = api.resources.get(api_version=obj["apiVersion"], kind=obj["kind"])
            try:
                resource.create(
                    body=obj,
                    namespace=obj["metadata"].get("namespace") if resource.namespaced else None,
                    dry_run="All",
                )
            except ApiException as exc:
                refused.append(f"[{name}] {label(obj)}: {exc.status} {exc.body}")
    assert not refused, "\n".join(refused)


# ------------------------------------------------------------------ dashboard and alerts


def alerts() -> dict[str, Any]:
    document = yaml.safe_load((MONITORING / "alerts.yaml").read_text())
    assert isinstance(document, dict)
    return document


def exported_metric_names() -> set[str]:
    """Every sample name pffs's registries give a scrape: the node plugin's and controller's (PluginMetrics),
    the mounter's own (MounterMetrics), and a mount's (MountCollector), which the mounter passes on with a
    `volume` label and the same names (a mount in a cache group). Labelled metrics get one child each, so
    that they have samples."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.metrics import MetricWrapperBase

    from pffs.csi.metrics import MounterMetrics, PluginMetrics
    from pffs.csi.state import Staged, Target
    from pffs.fuse.metrics import MountCollector
    from pffs.peers.group import COUNTERS

    report = {
        "cache": {},
        "cache_usage": {"memory_bytes": 1, "disk_bytes": 2},
        "backend_requests": {
            "get": {"requests": 3, "errors": 1, "p50_ms": 1.0, "p90_ms": 2.0, "p99_ms": 3.0}
        },
        "uploads_pending": 0,
        "uploads_done": 0,
        "upload_failures": 0,
        "open_files": 0,
        "peers": dict.fromkeys(COUNTERS, 0),  # a mount in a cache group
        "peer_members": 3,
    }
    mount = CollectorRegistry()
    mount.register(MountCollector(lambda: report))
    registries = [mount]
    plugin = PluginMetrics()
    # One mount (this process standing in for its mount process) and the pod using it, as the records say.
    target = Target(volume_id="pv-1", pod={"namespace": "ns", "name": "pod", "uid": "u"})
    plugin.show_volumes(
        [
            Staged(
                volume_id="pv-1",
                staging_path="/kubelet/plugins/x/globalmount",
                attributes={"source": "s3://b/p"},
                capability="mount",
                pid=os.getpid(),
                targets={"/kubelet/pods/u/volumes/kubernetes.io~csi/pv-1/mount": target},
            )
        ]
    )
    for metrics in (plugin, MounterMetrics()):
        for wrapper in vars(metrics).values():
            labelnames = getattr(wrapper, "_labelnames", ())
            if isinstance(wrapper, MetricWrapperBase) and labelnames:
                wrapper.labels(*["x"] * len(labelnames))
        registries.append(metrics.registry)
    return {
        sample.name for registry in registries for family in registry.collect() for sample in family.samples
    }


def test_exported_names_are_what_a_scrape_shows() -> None:
    names = exported_metric_names()
    # prometheus_client's suffixes: _total on counters, _bucket/_sum/_count on histograms.
    assert {"pffs_csi_rpc_total", "pffs_csi_rpc_duration_seconds_bucket", "pffs_csi_volumes_staged"} <= names
    assert {
        "pffs_csi_mounter_mount_exits_total",
        "pffs_cache_misses_total",
        "pffs_backend_errors_total",
    } <= names
    assert "pffs_csi_rpc" not in names
    assert {"pffs_csi_volume_info", "pffs_csi_volume_pod_info", "pffs_csi_mount_memory_bytes"} <= names


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])  # a collapsed row holds its panels


def dashboard_expressions() -> list[tuple[str, str]]:
    """(where, PromQL) of every query of the dashboard: panels' targets and template variables."""
    dashboard = json.loads((MONITORING / "grafana-dashboard.json").read_text())
    found = []
    for panel in panels(dashboard):
        for target in panel.get("targets", []):
            found.append((f"panel {panel['title']!r}", target["expr"]))
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            found.append(
                (f"variable {variable['name']}", query["query"] if isinstance(query, dict) else query)
            )
    return found


def alert_expressions() -> list[tuple[str, str]]:
    return [
        (f"alert {rule['alert']}", rule["expr"])
        for group in alerts()["spec"]["groups"]
        for rule in group["rules"]
    ]


METRIC = re.compile(r"\bpffs_[a-z0-9_]+")
UP = re.compile(r"\bup\b\s*[{=!<>]")


def test_every_expression_names_only_exported_metrics() -> None:
    exported = exported_metric_names()
    expressions = dashboard_expressions() + alert_expressions()
    assert len(expressions) >= 30
    unknown = []
    used = set()
    for where, expression in expressions:
        names = set(METRIC.findall(expression))
        assert names or UP.search(expression), f"{where}: names no metric: {expression}"
        used |= names
        unknown += [f"{where}: {name}" for name in sorted(names - exported)]
    assert not unknown, "not exported by pffs:\n" + "\n".join(unknown)
    # What the dashboard was asked to show, all there.
    for wanted in (
        "pffs_cache_misses_total",
        "pffs_cache_bytes_fetched_total",
        "pffs_backend_latency_seconds",
        "pffs_uploads_pending",
        "pffs_upload_failures_total",
        "pffs_open_files",
        "pffs_csi_rpc_duration_seconds_bucket",
        "pffs_csi_recoveries_total",
        "pffs_csi_mounter_mounts",
        "pffs_csi_mounter_mount_exits_total",
    ):
        assert wanted in used, wanted


def test_the_extractor_finds_a_misspelt_metric() -> None:
    assert set(METRIC.findall('sum(rate(pffs_csi_rpc{code!="OK"}[5m])) / pffs_open_files')) == {
        "pffs_csi_rpc",
        "pffs_open_files",
    }
    assert "pffs_csi_rpc" not in exported_metric_names()


def test_every_panel_has_a_title_and_a_place() -> None:
    dashboard = json.loads((MONITORING / "grafana-dashboard.json").read_text())
    assert dashboard["uid"] and dashboard["title"]
    ids = [panel["id"] for panel in panels(dashboard)]
    assert len(ids) == len(set(ids))
    for panel in panels(dashboard):
        assert panel.get("title", "").strip(), panel
        assert {"h", "w", "x", "y"} <= set(panel["gridPos"]), panel["title"]
        if panel["type"] != "row":
            assert panel["targets"], panel["title"]
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]


def test_every_alert_says_what_and_how_bad() -> None:
    document = alerts()
    assert (document["apiVersion"], document["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    names = []
    for group in document["spec"]["groups"]:
        assert group["name"] and group["rules"]
        for rule in group["rules"]:
            assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule["alert"]
            assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
            assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]
            names.append(rule["alert"])
    assert len(names) == len(set(names))
    exprs = " ".join(expression for _, expression in alert_expressions())
    for metric in (
        "pffs_csi_mounter_mount_exits_total",
        "pffs_csi_recovery_failures_total",
        "pffs_backend_errors_total",
        "pffs_upload_failures_total",
        "pffs_csi_cache_report_failures_total",
    ):
        assert metric in exprs, metric
    assert UP.search(exprs), "no alert for a pffs pod down"
