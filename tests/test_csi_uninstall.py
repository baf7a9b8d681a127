"""`pffs csi-uninstall` (the chart's post-delete hook) on a real API server: once the node plugin pods are
gone it removes the driver's Node annotations (and only those) and its controllers' Leases; it waits for
plugins still terminating, so none writes its report again after it; a second run finds nothing to do."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

import pytest

pytestmark = [pytest.mark.kube, pytest.mark.timeout(180)]

NAMESPACE = "pffs-uninstall"
REPORT = json.dumps({"datasets": {}, "updated_at": "2026-11-28T07:00:00Z"})


def uninstall(control_plane: Any, *args: str) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "pffs.cli.main", "csi-uninstall", "--namespace", NAMESPACE]
    command += ["--kubeconfig", str(control_plane.kubeconfig), *args]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_uninstall_removes_the_drivers_annotations_and_leases_once_its_plugins_are_gone(
    control_plane: Any,
) -> None:
    from kubernetes import client

    api = control_plane.api()
    core, coordination = client.CoreV1Api(api), client.CoordinationV1Api(api)
    core.create_namespace({"metadata": {"name": NAMESPACE}})
    annotated = {"pffs.io/cache": REPORT, "pffs.io/cache-group": "{}", "team.example/owner": "ml"}
    core.create_node({"metadata": {"name": "gpu-a", "annotations": annotated}})
    core.create_node({"metadata": {"name": "gpu-b", "annotations": {"team.example/owner": "ml"}}})
    for name in ("csi-pffs-io", "pffs-warmup-controller", "someone-elses"):
        coordination.create_namespaced_lease(NAMESPACE, {"metadata": {"name": name}, "spec": {}})
    plugin = {
        "metadata": {"name": "pffs-csi-node-x", "labels": {"app.kubernetes.io/name": "pffs-csi-node"}},
        "spec": {"containers": [{"name": "pffs-csi", "image": "pffs/csi:test"}]},
    }
    core.create_namespaced_pod(NAMESPACE, plugin)
    try:
        running = uninstall(control_plane, "--wait", "60")
        time.sleep(2)  # it waits for the plugin pod while it is there: nothing touched yet
        assert running.poll() is None
        assert "pffs.io/cache" in core.read_node("gpu-a").metadata.annotations
        core.delete_namespaced_pod("pffs-csi-node-x", NAMESPACE, grace_period_seconds=0)
        out, err = running.communicate(timeout=60)
        assert running.returncode == 0, err
        assert "nodes: gpu-a;" in out and "Leases deleted: csi-pffs-io, pffs-warmup-controller" in out
        assert core.read_node("gpu-a").metadata.annotations == {"team.example/owner": "ml"}
        assert core.read_node("gpu-b").metadata.annotations == {"team.example/owner": "ml"}
        left = [lease.metadata.name for lease in coordination.list_namespaced_lease(NAMESPACE).items]
        assert left == ["someone-elses"]

        again = uninstall(control_plane, "--wait", "0")
        out, err = again.communicate(timeout=60)
        assert again.returncode == 0, err
        assert out.strip() == (
            "pffs csi-uninstall: cache annotations removed from nodes: none; Leases deleted: none"
        )
    finally:
        for node in ("gpu-a", "gpu-b"):
            core.delete_node(node)
        core.delete_namespace(NAMESPACE)


def test_uninstall_deletes_the_crd_only_when_asked(control_plane: Any) -> None:
    from pathlib import Path

    import yaml
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    crd_file = Path(__file__).parents[1] / "deploy/helm/pffs-csi/crds/datasetwarmups.pffs.io.yaml"
    crds = client.ApiextensionsV1Api(control_plane.api())
    crds.create_custom_resource_definition(yaml.safe_load(crd_file.read_text()))
    try:
        kept = uninstall(control_plane, "--wait", "0")
        out, err = kept.communicate(timeout=60)
        assert kept.returncode == 0, err
        assert "CRD" not in out
        crds.read_custom_resource_definition("datasetwarmups.pffs.io")  # still there
        deleted = uninstall(control_plane, "--wait", "0", "--delete-crd")
        out, err = deleted.communicate(timeout=60)
        assert deleted.returncode == 0, err
        assert out.strip().endswith("; CRD datasetwarmups.pffs.io deleted")
    finally:
        try:
            crds.delete_custom_resource_definition("datasetwarmups.pffs.io")
        except ApiException as exc:
            assert exc.status == 404
