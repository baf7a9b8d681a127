"""The Kubernetes manifests in deploy/ are what the API server accepts and what an operator means to apply.

Each folder is rendered as `kubectl apply -k` would (`kustomize build`; deploy/scheduler has no
kustomization, so its files are read as they are) and every object is checked field by field against the
API types of the `kubernetes` Python client: no cluster and no schema download, so a misspelt or misplaced
field (`volumeMount` for `volumeMounts`) or a value of the wrong type fails here rather than at apply time.
Then what a platform engineer checks by eye: pinned images, the node plugin's and mounter's FUSE
privileges and their RBAC, the registration and health wiring, one driver name everywhere, the example
pods' mount propagation, the volume attribute names. deploy/csi is rendered from the Helm chart
deploy/helm/pffs-csi: tests/test_helm_chart.py runs the `assert_*` checks here over the chart rendered with
other values too, and checks that deploy/csi is the chart's render.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes.client import models

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"
CSI_DIR = DEPLOY / "csi"
EXAMPLES_DIR = CSI_DIR / "examples"
SCHEDULER_DIR = DEPLOY / "scheduler"
FOLDERS = {"csi": CSI_DIR, "csi/examples": EXAMPLES_DIR, "scheduler": SCHEDULER_DIR}
DRIVER = "csi.pffs.io"
NAMESPACE = "pffs-system"
# The names pffs reads from a StorageClass's parameters, a PV's volumeAttributes and an inline volume.
VOLUME_ATTRIBUTES = {
    "source",
    "endpointUrl",
    "region",
    "cacheSize",
    "memoryCacheSize",
    "blockSize",
    "dirTTL",
    "attrTTL",
    "staleIfError",
    "readOnly",
    "prefetchDirs",
    "uid",
    "gid",
    "fileMode",
    "dirMode",
    "onDelete",
}
# Parameters for the CO itself (secret references, fsType), not for the driver.
CO_PARAMETER_PREFIX = "csi.storage.k8s.io/"
# CI sets this so that a missing kustomize fails the run instead of skipping the rendered checks.
REQUIRE_SERVERS = os.environ.get("PFFS_REQUIRE_SERVERS") == "1"

# apiVersion -> kinds with a model in the client (class name: the version, capitalised, then the kind).
# These API versions are served by every Kubernetes API server: a kind of theirs missing here is reported,
# so that a misspelt kind cannot pass as "some other API". Objects of other API versions (CRDs such as the
# scheduler-plugins PodGroup, component configs such as KubeSchedulerConfiguration) have no model in the
# client: for them only apiVersion, kind and metadata are checked.
KINDS = {
    "v1": [
        "ConfigMap",
        "LimitRange",
        "Namespace",
        "PersistentVolume",
        "PersistentVolumeClaim",
        "Pod",
        "ResourceQuota",
        "Secret",
        "Service",
        "ServiceAccount",
    ],
    "apps/v1": ["DaemonSet", "Deployment", "ReplicaSet", "StatefulSet"],
    "batch/v1": ["CronJob", "Job"],
    "coordination.k8s.io/v1": ["Lease"],
    "networking.k8s.io/v1": ["Ingress", "NetworkPolicy"],
    "policy/v1": ["PodDisruptionBudget"],
    "rbac.authorization.k8s.io/v1": ["ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"],
    "scheduling.k8s.io/v1": ["PriorityClass"],
    "storage.k8s.io/v1": ["CSIDriver", "CSINode", "StorageClass", "VolumeAttachment"],
    "apiextensions.k8s.io/v1": ["CustomResourceDefinition"],
}
CLUSTER_SCOPED = {
    "ClusterRole",
    "ClusterRoleBinding",
    "CSIDriver",
    "CSINode",
    "CustomResourceDefinition",
    "Namespace",
    "PersistentVolume",
    "PriorityClass",
    "StorageClass",
    "VolumeAttachment",
}


def model_name(api_version: str, kind: str) -> str:
    return api_version.rsplit("/", 1)[-1].capitalize() + kind


# ------------------------------------------------------------------ the schema check


_LIST = re.compile(r"List\[(.+)\]$")
_DICT = re.compile(r"Dict\[str, (.+)\]$")
# The client's scalar type names -> the Python types YAML gives for them. Quantities are `str` in the
# client (write them quoted); IntOrString fields are `object` and take anything.
_SCALARS: dict[str, tuple[type, ...]] = {
    "str": (str,),
    "bytes": (str,),  # base64 in JSON
    "datetime": (str, datetime.date),
    "int": (int,),
    "float": (int, float),
    "bool": (bool,),
}


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "list"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def _at(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _check_value(value: Any, type_name: str, path: str, errors: list[str]) -> None:
    if type_name == "object":
        return
    if match := _LIST.match(type_name):
        if not isinstance(value, list):
            errors.append(f"{path}: expected a list ({type_name}), got {_json_type(value)}")
            return
        for index, item in enumerate(value):
            _check_value(item, match[1], f"{path}[{index}]", errors)
        return
    if match := _DICT.match(type_name):
        if not isinstance(value, dict):
            errors.append(f"{path}: expected a map ({type_name}), got {_json_type(value)}")
            return
        for key, item in value.items():
            if not isinstance(key, str):
                errors.append(f"{path}: key {key!r} is not a string")
            _check_value(item, match[1], f"{path}[{key}]", errors)
        return
    if type_name in _SCALARS:
        wrong_bool = isinstance(value, bool) and type_name != "bool"
        if wrong_bool or not isinstance(value, _SCALARS[type_name]):
            errors.append(f"{path}: expected {type_name}, got {_json_type(value)} {value!r}")
        return
    check_model(value, type_name, path, errors)


def check_model(value: Any, name: str, path: str, errors: list[str]) -> None:
    """Appends to `errors` what in `value` does not fit the client's model `name`: unknown fields, values of
    the wrong JSON type, required fields missing. Paths are JSON paths from the object's root."""
    cls = getattr(models, name)
    if not isinstance(value, dict):
        errors.append(f"{path or '<root>'}: expected an object ({name}), got {_json_type(value)}")
        return
    attr_by_key = {key: attr for attr, key in cls.attribute_map.items()}
    for key, item in value.items():
        attr = attr_by_key.get(key)
        if attr is None:
            errors.append(f"{_at(path, str(key))}: unknown field (not in {name})")
        elif item is not None:  # an explicit null is an unset optional field
            _check_value(item, cls.openapi_types[attr], _at(path, key), errors)
    for attr, field in cls.model_fields.items():
        if field.is_required() and value.get(cls.attribute_map[attr]) is None:
            errors.append(f"{_at(path, cls.attribute_map[attr])}: required field missing (in {name})")


def label(obj: Any) -> str:
    if not isinstance(obj, dict):
        return repr(obj)[:60]
    name = (obj.get("metadata") or {}).get("name", "<no name>")
    return f"{obj.get('kind', '<no kind>')} {name}"


def schema_errors(obj: Any) -> list[str]:
    """What the API server would refuse in `obj` for its shape, each as 'Kind name: path: problem'."""
    if not isinstance(obj, dict):
        return [f"{label(obj)}: a manifest must be a map"]
    api_version, kind = obj.get("apiVersion"), obj.get("kind")
    if not isinstance(api_version, str) or not isinstance(kind, str):
        return [f"{label(obj)}: apiVersion and kind must both be strings"]
    errors: list[str] = []
    if api_version in KINDS:
        if kind not in KINDS[api_version]:
            return [f"{label(obj)}: {api_version} has no kind {kind} known to this test"]
        name = model_name(api_version, kind)
        check_model(obj, name, "", errors)
        if not errors:
            # Cross-check: the client's own (pydantic) validation, which the walk above mirrors.
            try:
                getattr(models, name).from_dict(obj)
            except (ValueError, TypeError, AttributeError) as exc:
                errors.append(f"the client's {name} refuses it: {exc}")
    else:
        # No model in the client: the common envelope only.
        if "metadata" in obj:
            check_model(obj["metadata"], "V1ObjectMeta", "metadata", errors)
    return [f"{label(obj)}: {error}" for error in errors]


# ------------------------------------------------------------------ rendering


def find_tool(name: str) -> str | None:
    """$PFFS_TOOLS_BIN/NAME, then ~/.cache/pffs-tools/bin/NAME (where `make setup` puts it), then PATH."""
    candidates = []
    if tools_bin := os.environ.get("PFFS_TOOLS_BIN"):
        candidates.append(Path(tools_bin) / name)
    candidates.append(Path.home() / ".cache" / "pffs-tools" / "bin" / name)
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return shutil.which(name)


def is_manifest(document: Any) -> bool:
    """A Kubernetes object, as opposed to a plain data file kept beside the manifests (queues.yaml)."""
    return isinstance(document, dict) and ("apiVersion" in document or "kind" in document)


@functools.cache
def _render(directory: Path) -> tuple[Any, ...]:
    if (directory / "kustomization.yaml").is_file():
        kustomize = find_tool("kustomize")
        if kustomize is None:
            reason = (
                "needs the kustomize binary (not in $PFFS_TOOLS_BIN, ~/.cache/pffs-tools/bin or PATH); "
                "run make setup"
            )
            if REQUIRE_SERVERS:
                pytest.fail(reason)
            pytest.skip(reason)
        answer = subprocess.run(
            [kustomize, "build", str(directory)], capture_output=True, text=True, timeout=60, check=False
        )
        assert answer.returncode == 0, f"kustomize build {directory} failed:\n{answer.stderr}"
        documents = list(yaml.safe_load_all(answer.stdout))
    else:
        documents = []
        for path in sorted(directory.glob("*.yaml")):
            documents += yaml.safe_load_all(path.read_text())
    return tuple(document for document in documents if is_manifest(document))


def render(folder: str) -> list[dict[str, Any]]:
    """The objects of deploy/FOLDER (rendered once per run: treat them as read-only)."""
    return list(_render(FOLDERS[folder]))


def one(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def pod_specs(objects: list[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(object, pod spec) for every object that runs pods."""
    for obj in objects:
        spec = obj.get("spec") or {}
        if obj["kind"] == "Pod":
            yield obj, spec
        elif obj["kind"] == "CronJob":
            yield obj, spec["jobTemplate"]["spec"]["template"]["spec"]
        elif "template" in spec:
            yield obj, spec["template"]["spec"]


def containers(pod_spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [*pod_spec.get("initContainers", []), *pod_spec["containers"]]


def container(pod_spec: dict[str, Any], name: str) -> dict[str, Any]:
    found = [c for c in pod_spec["containers"] if c["name"] == name]
    assert len(found) == 1, f"expected one container {name}"
    return found[0]


def arg_value(args: list[str], flag: str) -> str:
    """The value of `--flag=value` or `--flag value` in a container's args."""
    for index, arg in enumerate(args):
        if arg.startswith(f"{flag}="):
            return arg.split("=", 1)[1]
        if arg == flag:
            return args[index + 1]
    raise AssertionError(f"{flag} not in {args}")


# ------------------------------------------------------------------ the check itself


def test_kinds_map_to_client_models() -> None:
    for api_version, kinds in KINDS.items():
        for kind in kinds:
            assert hasattr(models, model_name(api_version, kind)), (api_version, kind)


def daemonset() -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": "broken", "namespace": NAMESPACE},
        "spec": {
            "selector": {"matchLabels": {"app": "broken"}},
            "template": {
                "metadata": {"labels": {"app": "broken"}},
                "spec": {
                    "containers": [
                        {
                            "name": "c",
                            "image": "busybox:1.36",
                            "volumeMounts": [{"name": "v", "mountPath": "/v"}],
                            "ports": [{"containerPort": 80}],
                        }
                    ],
                    "volumes": [{"name": "v", "emptyDir": {}}],
                },
            },
        },
    }


def test_the_check_accepts_a_correct_object_and_names_each_mistake() -> None:
    assert schema_errors(daemonset()) == []

    broken = daemonset()
    pod = broken["spec"]["template"]["spec"]
    pod["hostNetwork"] = "false"  # a string where the API wants a boolean
    first = pod["containers"][0]
    first["volumeMount"] = first.pop("volumeMounts")  # the singular: not a field
    first["ports"][0]["containerPort"] = "80"  # a string where the API wants an integer
    del first["name"]  # required
    pod["tolerations"] = {"operator": "Exists"}  # a map where the API wants a list
    broken["spec"]["updateStrategy"] = {"rollingUpdate": {"maxUnavailable": 1}, "typo": 1}
    pod_path = "DaemonSet broken: spec.template.spec"
    expected = [
        f"{pod_path}.hostNetwork: expected bool, got string 'false'",
        f"{pod_path}.containers[0].volumeMount: unknown field (not in V1Container)",
        f"{pod_path}.containers[0].ports[0].containerPort: expected int, got string '80'",
        f"{pod_path}.containers[0].name: required field missing (in V1Container)",
        f"{pod_path}.tolerations: expected a list (List[V1Toleration]), got object",
        "DaemonSet broken: spec.updateStrategy.typo: unknown field (not in V1DaemonSetUpdateStrategy)",
    ]
    assert sorted(schema_errors(broken)) == sorted(expected)

    assert schema_errors({**daemonset(), "kind": "Daemonset"}) == [
        "Daemonset broken: apps/v1 has no kind Daemonset known to this test"
    ]
    # A kind without a model: its metadata is still checked.
    podgroup = {"apiVersion": "scheduling.x-k8s.io/v1alpha1", "kind": "PodGroup", "metadata": {"nam": "x"}}
    unknown = "metadata.nam: unknown field (not in V1ObjectMeta)"
    assert schema_errors(podgroup) == [f"PodGroup <no name>: {unknown}"]


# ------------------------------------------------------------------ the manifests


@pytest.mark.parametrize("folder", sorted(FOLDERS))
def test_every_object_fits_the_api_types(folder: str) -> None:
    objects = render(folder)
    assert objects, f"deploy/{folder} renders nothing"
    errors = [error for obj in objects for error in schema_errors(obj)]
    assert errors == [], "\n".join(errors)


@pytest.mark.parametrize(("folder", "namespace"), [("csi", NAMESPACE), ("csi/examples", "default")])
def test_namespaced_objects_name_their_namespace(folder: str, namespace: str) -> None:
    """Applied unchanged, nothing may land in whatever namespace the operator's context happens to use."""
    for obj in render(folder):
        got = obj["metadata"].get("namespace")
        assert got == (None if obj["kind"] in CLUSTER_SCOPED else namespace), label(obj)


@pytest.mark.parametrize("folder", ["csi", "csi/examples"])
def test_every_image_is_pinned_to_a_version(folder: str) -> None:
    # deploy/scheduler is left out: its Deployment says to replace `pffs:latest` with the published image.
    seen = 0
    for obj, spec in pod_specs(render(folder)):
        for c in containers(spec):
            image = c.get("image", "")
            seen += 1
            if "@sha256:" in image:
                continue
            name, _, tag = image.rpartition(":")
            assert name and "/" not in tag, f"{label(obj)}: image {image!r} of {c['name']} has no tag"
            assert tag != "latest", f"{label(obj)}: image {image!r} of {c['name']} is :latest"
            assert re.search(r"\d", tag), f"{label(obj)}: image tag of {image!r} is not a version"
    assert seen


def test_the_csi_folder_holds_the_driver_and_no_examples() -> None:
    kinds = {(o["kind"], o["metadata"]["name"]) for o in render("csi")}
    assert {
        ("Namespace", NAMESPACE),
        ("CSIDriver", DRIVER),
        ("DaemonSet", "pffs-csi-node"),
        ("DaemonSet", "pffs-csi-mounter"),
        ("Deployment", "pffs-csi-controller"),
    } <= kinds
    # No Secret (a placeholder would reset real keys at every apply) and no StorageClass (its source and
    # endpoint are the user's: deploy/csi/examples has one).
    forbidden = {"Pod", "PersistentVolume", "PersistentVolumeClaim", "Secret", "StorageClass"}
    assert not {kind for kind, _ in kinds} & forbidden


def test_csidriver() -> None:
    driver = one(render("csi"), "CSIDriver", DRIVER)
    assert driver["spec"] == {
        "attachRequired": False,
        "podInfoOnMount": True,
        "volumeLifecycleModes": ["Persistent", "Ephemeral"],
        "fsGroupPolicy": "None",
        "requiresRepublish": False,
    }


# The checks below take the objects (and the kubelet's root dir they were made for), so that
# tests/test_helm_chart.py runs them over the chart rendered with other values too.

NODE_DAEMONSETS = {"pffs-csi-node": "pffs-csi", "pffs-csi-mounter": "pffs-mounter"}  # -> the pffs container
STATE_DIR = "/var/lib/pffs-csi"


def assert_node_pods_have_what_fuse_needs(objects: list[dict[str, Any]], kubelet: str) -> None:
    """Both node DaemonSets: privileged, /dev/fuse, the kubelet dir at the host's own path with Bidirectional
    propagation (and nothing else propagating back to the host), the state dir, the host's pid namespace."""
    for daemonset, name in NODE_DAEMONSETS.items():
        spec = one(objects, "DaemonSet", daemonset)["spec"]["template"]["spec"]
        plugin = container(spec, name)
        host_paths = {v["name"]: v["hostPath"] for v in spec["volumes"] if "hostPath" in v}
        mounts = {m["mountPath"]: m for m in plugin["volumeMounts"]}

        fuse = mounts["/dev/fuse"]
        assert host_paths[fuse["name"]] == {"path": "/dev/fuse", "type": "CharDevice"}, daemonset
        kubelet_mount = mounts[kubelet]
        assert host_paths[kubelet_mount["name"]] == {"path": kubelet, "type": "Directory"}, daemonset
        assert kubelet_mount["mountPropagation"] == "Bidirectional", daemonset
        assert host_paths[mounts[STATE_DIR]["name"]]["type"] == "DirectoryOrCreate", daemonset
        # Kubernetes accepts Bidirectional only in a privileged container.
        assert plugin["securityContext"]["privileged"] is True, daemonset
        assert "SYS_ADMIN" in plugin["securityContext"]["capabilities"]["add"], daemonset
        # The plugin checks and signals the mount processes, which run in the mounter's pod, by pid.
        assert spec["hostPID"] is True, daemonset
        for c in containers(spec):
            for m in c.get("volumeMounts", []):
                if m.get("mountPropagation") == "Bidirectional":
                    assert (c["name"], m["mountPath"]) == (name, kubelet), daemonset
        assert spec["tolerations"] == [{"operator": "Exists"}], daemonset
        assert spec["priorityClassName"] == "system-node-critical", daemonset
        assert spec["dnsPolicy"] == ("ClusterFirstWithHostNet" if spec["hostNetwork"] else "ClusterFirst")
        assert "cpu" not in plugin["resources"].get("limits", {}), f"{daemonset}: a CPU limit stalls readers"


def assert_plugin_and_mounter_share_their_paths(objects: list[dict[str, Any]]) -> None:
    """The plugin reaches the mounter at its socket, and a mount started by the mounter finds the cache dir
    and credential files at the paths the plugin gave it: both pods mount each shared path alike."""
    node = one(objects, "DaemonSet", "pffs-csi-node")["spec"]["template"]["spec"]
    mounter = one(objects, "DaemonSet", "pffs-csi-mounter")["spec"]["template"]["spec"]
    plugin, runner = container(node, "pffs-csi"), container(mounter, "pffs-mounter")

    def host_mounts(spec: dict[str, Any], c: dict[str, Any]) -> dict[str, str]:
        sources = {
            v["name"]: v["hostPath"]["path"] if "hostPath" in v else f"secret {v['secret']['secretName']}"
            for v in spec["volumes"]
            if "hostPath" in v or "secret" in v
        }
        return {m["mountPath"]: sources[m["name"]] for m in c["volumeMounts"] if m["name"] in sources}

    assert host_mounts(node, plugin) == host_mounts(mounter, runner)
    token_file = (
        arg_value(plugin["args"], "--cache-group-token-file")
        if "--cache-group-token-file" in plugin["args"]
        else None
    )
    if token_file is not None:  # the mounts read the token (and TLS files) at the paths the plugin names
        assert any(token_file.startswith(f"{path}/") for path in host_mounts(mounter, runner))
        if "--cache-group-tls-dir" in plugin["args"]:
            assert arg_value(plugin["args"], "--cache-group-tls-dir") in host_mounts(mounter, runner)
    socket = arg_value(runner["args"], "--socket")
    assert arg_value(plugin["args"], "--mounter") == f"unix://{socket}"
    assert arg_value(plugin["args"], "--state-dir") == STATE_DIR
    assert socket.startswith(f"{STATE_DIR}/")
    cache = arg_value(plugin["args"], "--cache-dir")
    assert any(cache == path or cache.startswith(f"{path}/") for path in host_mounts(node, plugin))
    assert arg_value(plugin["args"], "--kubelet-dir") in host_mounts(mounter, runner)


def assert_probe_port(c: dict[str, Any], served_by: dict[str, Any] | None = None) -> None:
    """The container's livenessProbe asks /healthz on a port it names and declares: the port its own
    --metrics-port serves, or with `served_by` (a livenessprobe sidecar) the sidecar's --health-port."""
    port_name = c["livenessProbe"]["httpGet"]["port"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert isinstance(port_name, str) and port_name in ports, f"{c['name']}: probe port {port_name!r}"
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    if served_by is None:
        assert port_name == "metrics"
        assert str(ports[port_name]) == arg_value(c["args"], "--metrics-port")
        assert arg_value(c["args"], "--metrics-address") == "0.0.0.0"  # the kubelet probes the pod's IP
    else:
        assert str(ports[port_name]) == arg_value(served_by["args"], "--health-port")


def assert_registration_and_health_line_up(objects: list[dict[str, Any]], kubelet: str) -> None:
    """The plugin's socket is where the kubelet looks (KUBELET/plugins/csi.pffs.io), and the kubelet learns
    it from the plugin itself (default) or from node-driver-registrar (node.sidecars.enabled); each probe
    asks a port that is declared and served."""
    node = one(objects, "DaemonSet", "pffs-csi-node")["spec"]["template"]["spec"]
    plugin = container(node, "pffs-csi")
    socket_dir = f"{kubelet}/plugins/{DRIVER}"
    assert arg_value(plugin["args"], "--endpoint") == f"unix://{socket_dir}/csi.sock"
    names = {c["name"] for c in containers(node)}
    if "node-driver-registrar" in names:
        assert "--kubelet-registration-dir" not in plugin["args"]
        registrar = container(node, "node-driver-registrar")
        probe = container(node, "liveness-probe")
        host_paths = {v["name"]: v["hostPath"]["path"] for v in node["volumes"] if "hostPath" in v}
        for sidecar in (registrar, probe):
            assert arg_value(sidecar["args"], "--csi-address") == "/csi/csi.sock"
            socket_volume = {m["mountPath"]: m["name"] for m in sidecar["volumeMounts"]}["/csi"]
            assert host_paths[socket_volume] == socket_dir
        assert arg_value(registrar["args"], "--kubelet-registration-path") == f"{socket_dir}/csi.sock"
        registration = {m["mountPath"]: m["name"] for m in registrar["volumeMounts"]}["/registration"]
        assert host_paths[registration] == f"{kubelet}/plugins_registry"
        assert_probe_port(plugin, probe)
    else:
        assert names == {"pffs-csi"}
        assert arg_value(plugin["args"], "--kubelet-registration-dir") == f"{kubelet}/plugins_registry"
        assert_probe_port(plugin)
    assert_probe_port(
        container(one(objects, "DaemonSet", "pffs-csi-mounter")["spec"]["template"]["spec"], "pffs-mounter")
    )
    controllers = [
        o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == "pffs-csi-controller"
    ]
    for controller in controllers:
        spec = controller["spec"]["template"]["spec"]
        sidecar = [c for c in spec["containers"] if c["name"] == "liveness-probe"]
        assert_probe_port(container(spec, "pffs-csi"), sidecar[0] if sidecar else None)


def assert_args_follow_the_image_entrypoint(objects: list[dict[str, Any]]) -> None:
    """The image's ENTRYPOINT is `tini -s -- pffs`: the manifests give only args, the command first."""
    entrypoint = next(
        line for line in (DEPLOY / "Dockerfile").read_text().splitlines() if line.startswith("ENTRYPOINT")
    )
    assert json.loads(entrypoint.removeprefix("ENTRYPOINT")) == ["/usr/bin/tini", "-s", "--", "pffs"]
    commands = {
        ("DaemonSet", "pffs-csi-node"): ["csi", "--mode", "node"],
        ("DaemonSet", "pffs-csi-mounter"): ["csi-mounter"],
        ("Deployment", "pffs-csi-controller"): ["csi", "--mode", "controller"],
        ("Job", "pffs-csi-preflight"): ["csi-preflight", "--kubelet-dir"],
        ("Job", "pffs-csi-uninstall"): ["csi-uninstall", "--in-cluster"],
    }
    seen = set()
    for obj, spec in pod_specs(objects):
        for c in containers(spec):
            if c["image"].rpartition(":")[0].endswith("pffs/csi"):
                key = (obj["kind"], obj["metadata"]["name"])
                seen.add(key)
                assert "command" not in c, label(obj)
                assert c["args"][: len(commands[key])] == commands[key], label(obj)
                if commands[key][0] == "csi":
                    assert arg_value(c["args"], "--node-id") == "$(NODE_ID)"
                    env = {e["name"]: e for e in c["env"]}
                    assert env["NODE_ID"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert seen >= set(list(commands)[:2])


def test_node_pods_have_what_fuse_needs() -> None:
    assert_node_pods_have_what_fuse_needs(render("csi"), "/var/lib/kubelet")
    spec = one(render("csi"), "DaemonSet", "pffs-csi-node")["spec"]["template"]["spec"]
    assert spec["hostNetwork"] is False


def test_plugin_and_mounter_share_their_paths() -> None:
    assert_plugin_and_mounter_share_their_paths(render("csi"))


def test_registration_and_health_line_up() -> None:
    assert_registration_and_health_line_up(render("csi"), "/var/lib/kubelet")


def test_plugin_args_follow_the_image_entrypoint() -> None:
    assert_args_follow_the_image_entrypoint(render("csi"))


def test_the_mounter_is_replaced_only_when_an_operator_deletes_it() -> None:
    """A mounter pod replaced ends every mount it runs: no rollout may do that on its own."""
    objects = render("csi")
    assert one(objects, "DaemonSet", "pffs-csi-mounter")["spec"]["updateStrategy"] == {"type": "OnDelete"}
    node = one(objects, "DaemonSet", "pffs-csi-node")["spec"]["updateStrategy"]
    assert node == {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}}


def test_controller_is_unprivileged() -> None:
    spec = one(render("csi"), "Deployment", "pffs-csi-controller")["spec"]["template"]["spec"]
    for c in containers(spec):
        context = c["securityContext"]
        assert context.get("privileged") is not True, c["name"]
        assert context["allowPrivilegeEscalation"] is False, c["name"]
        assert context["capabilities"]["drop"] == ["ALL"], c["name"]
        assert context["readOnlyRootFilesystem"] is True, c["name"]
    assert not any("hostPath" in v for v in spec["volumes"])
    assert {c["name"] for c in containers(spec)} == {"pffs-csi", "csi-provisioner"}
    provisioner = container(spec, "csi-provisioner")["image"]
    assert provisioner == "registry.k8s.io/sig-storage/csi-provisioner:v6.3.0"


def rules_of(objects: list[dict[str, Any]], service_account: str) -> set[tuple[str, str, str]]:
    """(api group, resource, verb) granted to the ServiceAccount through any (Cluster)RoleBinding."""
    roles = {(o["kind"], o["metadata"]["name"]): o for o in objects if o["kind"] in ("Role", "ClusterRole")}
    granted = set()
    for binding in objects:
        if binding["kind"] not in ("RoleBinding", "ClusterRoleBinding"):
            continue
        subjects = binding.get("subjects", [])
        if not any(s["kind"] == "ServiceAccount" and s["name"] == service_account for s in subjects):
            continue
        role = roles[(binding["roleRef"]["kind"], binding["roleRef"]["name"])]
        for rule in role["rules"]:
            for group in rule.get("apiGroups", []):
                for resource in rule.get("resources", []):
                    granted |= {(group, resource, verb) for verb in rule["verbs"]}
    return granted


def assert_node_rbac(objects: list[dict[str, Any]]) -> None:
    """The plugin: its Node (topology labels, cache report), Events on the pods whose mount died or was
    repaired, and the pod (and claim) a volume is published for, read-only (whether every container mounts
    it readOnly); with a cache group, the list and watch of the Nodes where the plugins publish their
    volumes' group addresses. The mounter: nothing, not even a token."""
    node = one(objects, "DaemonSet", "pffs-csi-node")["spec"]["template"]["spec"]
    in_group = "--cache-group-token-file" in container(node, "pffs-csi")["args"]
    warms = "--warmups" in container(node, "pffs-csi")["args"]
    assert rules_of(objects, node["serviceAccountName"]) == {
        ("", "nodes", "get"),
        ("", "nodes", "patch"),
        ("", "events", "create"),
        ("", "events", "patch"),
        ("", "pods", "get"),
        ("", "persistentvolumeclaims", "get"),
    } | ({("", "nodes", "list"), ("", "nodes", "watch")} if in_group else set()) | (
        {
            ("pffs.io", "datasetwarmups", "get"),
            ("pffs.io", "datasetwarmups", "list"),
            ("pffs.io", "datasetwarmups", "watch"),
            ("pffs.io", "datasetwarmups/status", "patch"),
            ("", "secrets", "get"),  # a Role: in its own namespace only
        }
        if warms
        else set()
    )
    mounter = one(objects, "DaemonSet", "pffs-csi-mounter")["spec"]["template"]["spec"]
    account = mounter["serviceAccountName"]
    assert account != node["serviceAccountName"]
    assert rules_of(objects, account) == set()
    assert mounter["automountServiceAccountToken"] is False
    assert one(objects, "ServiceAccount", account)["automountServiceAccountToken"] is False


def test_node_plugin_and_mounter_rbac() -> None:
    assert_node_rbac(render("csi"))


def test_controller_may_provision_and_elect_a_leader() -> None:
    objects = render("csi")
    spec = one(objects, "Deployment", "pffs-csi-controller")["spec"]["template"]["spec"]
    granted = rules_of(objects, spec["serviceAccountName"])
    for verb in ("get", "list", "watch", "create", "patch", "delete"):
        assert ("", "persistentvolumes", verb) in granted
    assert ("", "persistentvolumeclaims", "update") in granted
    assert ("", "secrets", "get") in granted
    assert ("coordination.k8s.io", "leases", "update") in granted
    assert not {verb for group, resource, verb in granted if resource == "secrets"} - {"get"}


def example_secrets() -> set[tuple[str, str]]:
    """(namespace, name) of the Secrets deploy/csi/examples/create-credentials.sh makes (the examples ship
    no Secret object: a placeholder applied later would reset real keys)."""
    script = (EXAMPLES_DIR / "create-credentials.sh").read_text()
    namespaces = re.search(r"^for namespace in ([^;]+);", script, re.MULTILINE)
    names = re.findall(r"create secret generic (\S+)", script)
    assert namespaces and names, "create-credentials.sh: no `for namespace in` or `create secret generic`"
    assert "--from-literal=accessKeyId=" in script and "--from-literal=secretAccessKey=" in script
    return {(namespace, name) for namespace in namespaces[1].split() for name in names}


def test_storage_class_speaks_pffs() -> None:
    storage_class = one(render("csi/examples"), "StorageClass", "pffs-s3")
    assert storage_class["provisioner"] == DRIVER
    parameters = storage_class["parameters"]
    driver_keys = {key for key in parameters if not key.startswith(CO_PARAMETER_PREFIX)}
    assert driver_keys <= VOLUME_ATTRIBUTES, driver_keys - VOLUME_ATTRIBUTES
    # Each secret it names is one the examples' script creates.
    for use in ("provisioner", "node-stage"):
        name = parameters[f"{CO_PARAMETER_PREFIX}{use}-secret-name"]
        namespace = parameters[f"{CO_PARAMETER_PREFIX}{use}-secret-namespace"]
        assert (namespace, name) in example_secrets()


def pffs_volumes(objects: list[dict[str, Any]], classes: set[str]) -> dict[tuple[str, str], set[str]]:
    """(pod kind, name) -> names of its volumes served by pffs: inline CSI volumes of the driver, and PVCs of
    a pffs StorageClass or bound to a pffs PV."""
    pvs = {o["metadata"]["name"] for o in objects if o["kind"] == "PersistentVolume"}
    pffs_pvs = {
        o["metadata"]["name"]
        for o in objects
        if o["kind"] == "PersistentVolume" and o["spec"].get("csi", {}).get("driver") == DRIVER
    }
    assert pvs == pffs_pvs
    pffs_claims = {
        o["metadata"]["name"]
        for o in objects
        if o["kind"] == "PersistentVolumeClaim"
        and (o["spec"].get("storageClassName") in classes or o["spec"].get("volumeName") in pffs_pvs)
    }
    found = {}
    for obj, spec in pod_specs(objects):
        names = set()
        for volume in spec.get("volumes", []):
            inline = volume.get("csi", {}).get("driver") == DRIVER
            if inline or volume.get("persistentVolumeClaim", {}).get("claimName") in pffs_claims:
                names.add(volume["name"])
        found[(obj["kind"], obj["metadata"]["name"])] = names
    return found


def test_example_pods_see_repaired_mounts() -> None:
    """HostToContainer: when the node plugin remounts a dead volume, the pod sees it without a restart."""
    objects = render("csi/examples")
    classes = {o["metadata"]["name"] for o in objects if o["kind"] == "StorageClass"}
    volumes = pffs_volumes(objects, classes)
    assert len([pod for pod, names in volumes.items() if names]) >= 3  # dynamic, static, inline
    for obj, spec in pod_specs(objects):
        for c in containers(spec):
            for m in c.get("volumeMounts", []):
                if m["name"] in volumes[(obj["kind"], obj["metadata"]["name"])]:
                    assert m.get("mountPropagation") == "HostToContainer", f"{label(obj)}: {m}"


def test_example_volumes_speak_pffs() -> None:
    objects = render("csi/examples")
    assert not [o for o in objects if o["kind"] == "Secret"], "the examples must not ship a Secret"
    secrets = example_secrets()
    attributes = []
    for pv in (o for o in objects if o["kind"] == "PersistentVolume"):
        csi = pv["spec"]["csi"]
        attributes.append(csi["volumeAttributes"])
        ref = csi["nodeStageSecretRef"]
        assert (ref["namespace"], ref["name"]) in secrets, label(pv)
    for obj, spec in pod_specs(objects):
        for volume in spec.get("volumes", []):
            if "csi" in volume:
                assert volume["csi"]["driver"] == DRIVER
                attributes.append(volume["csi"]["volumeAttributes"])
                # An inline volume's secret is read from the pod's own namespace.
                ref = volume["csi"]["nodePublishSecretRef"]
                assert (obj["metadata"]["namespace"], ref["name"]) in secrets, label(obj)
    assert len(attributes) >= 2
    for names in attributes:
        assert set(names) <= VOLUME_ATTRIBUTES, set(names) - VOLUME_ATTRIBUTES
        assert "source" in names


def test_every_python_package_of_the_repository_is_installed() -> None:
    """pyproject.toml lists its packages: a new folder left out of the list imports in the repository's
    editable install but not in the CSI image (pffs.peers was, at first)."""
    import tomllib

    root = Path(__file__).resolve().parents[1]
    config = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {name: root / path for name, path in config["package-dir"].items()}
    found = set()
    for name, folder in folders.items():
        for init in folder.rglob("__init__.py"):
            relative = init.parent.relative_to(folder)
            found.add(".".join([name, *relative.parts]))
    assert found - set(config["packages"]) == set()
