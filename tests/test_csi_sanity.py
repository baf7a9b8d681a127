"""csi-sanity (kubernetes-csi/csi-test v5.6.0, the CSI conformance suite) against `pffs csi --mode all` on a
unix socket, volumes backed by the SeaweedFS fixture and mounted for real through /dev/fuse.

Every spec that applies to the capabilities pffs advertises must pass; every skip must be one csi-sanity
makes for a capability pffs does not advertise (listed below, and in the README with the reason).
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pffs.testing.csi_plugin import CsiPlugin
from pffs.testing.s3_server import SeaweedS3

REQUIRE_SERVERS = os.environ.get("PFFS_REQUIRE_SERVERS") == "1"
TOOLS_BIN = Path(os.environ.get("PFFS_TOOLS_BIN") or Path.home() / ".cache/pffs-tools/bin")

# What csi-sanity says when it skips a spec because the plugin does not advertise the capability it tests.
NOT_ADVERTISED = (
    "not supported",  # snapshots, expansion, ControllerPublish, ListVolumes, GetCapacity, modify, health
    "Service does not have single node multi writer capability",
)

pytestmark = [pytest.mark.s3, pytest.mark.timeout(600)]


def find_csi_sanity() -> str:
    path = TOOLS_BIN / "csi-sanity"
    if path.exists():
        return str(path)
    found = shutil.which("csi-sanity")
    if found:
        return found
    message = f"csi-sanity is not built ({path} missing); run `make setup`"
    if REQUIRE_SERVERS:
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture
def plugin_socket(tmp_path: Path) -> Iterator[Path]:
    """`pffs csi --mode all` on a unix socket; stopped, and whatever it left mounted detached, after."""
    if not os.path.exists("/dev/fuse") or os.geteuid() != 0:
        pytest.skip("csi-sanity mounts volumes: needs /dev/fuse and root")
    with CsiPlugin(tmp_path, "--cache-size", "1G") as plugin:
        yield plugin.socket


def test_csi_sanity_passes_every_spec_for_what_pffs_advertises(
    s3_server: SeaweedS3, raw_s3: object, bucket: str, plugin_socket: Path, tmp_path: Path
) -> None:
    sanity = find_csi_sanity()
    credentials = {"accessKeyId": s3_server.access_key, "secretAccessKey": s3_server.secret_key}
    secret_kinds = (
        "CreateVolumeSecret",
        "DeleteVolumeSecret",
        "ControllerValidateVolumeCapabilitiesSecret",
        "NodeStageVolumeSecret",
        "NodePublishVolumeSecret",
    )
    (tmp_path / "secrets.yaml").write_text(json.dumps({kind: credentials for kind in secret_kinds}))
    parameters = {
        "source": f"s3://{bucket}/volumes",
        "endpointUrl": s3_server.endpoint_url,
        "onDelete": "delete",
    }
    (tmp_path / "parameters.yaml").write_text(json.dumps(parameters))
    report = tmp_path / "report.json"
    started = time.monotonic()
    run = subprocess.run(
        [
            sanity,
            f"-csi.endpoint=unix://{plugin_socket}",
            f"-csi.testvolumeparameters={tmp_path / 'parameters.yaml'}",
            f"-csi.secrets={tmp_path / 'secrets.yaml'}",
            f"-csi.mountdir={tmp_path / 'sanity-mount'}",
            f"-csi.stagingdir={tmp_path / 'sanity-stage'}",
            f"--ginkgo.json-report={report}",
            "--ginkgo.no-color",
        ],
        capture_output=True,
        text=True,
        timeout=540,
    )
    elapsed = time.monotonic() - started
    specs = json.loads(report.read_text())[0]["SpecReports"]
    states = collections.Counter(spec["State"] for spec in specs)
    failed = [
        _name(s) + ": " + s.get("Failure", {}).get("Message", "")[:300]
        for s in specs
        if s["State"] not in ("passed", "skipped", "pending")
    ]
    assert not failed, "\n".join(failed) + "\n" + run.stdout[-3000:]
    assert run.returncode == 0, run.stdout[-3000:]
    unexpected_skips = [
        _name(s)
        for s in specs
        if s["State"] == "skipped"
        and not any(r in s.get("Failure", {}).get("Message", "") for r in NOT_ADVERTISED)
    ]
    assert not unexpected_skips, unexpected_skips
    # The specs of the services pffs serves ran: identity, controller create/delete/validate, node lifecycle.
    passed = {_name(s) for s in specs if s["State"] == "passed"}
    for must in (
        "Node Service :: should work",
        "Node Service :: should be idempotent",
        "NodeGetVolumeHealth :: should return health for a valid volume",
    ):
        assert any(must in name for name in passed), f"{must!r} did not run and pass"
    print(
        f"\ncsi-sanity: {states['passed']} passed, {len(failed)} failed, {states['skipped']} skipped, "
        f"{states['pending']} pending, in {elapsed:.1f} s"
    )


def _name(spec: dict[str, object]) -> str:
    hierarchy = spec.get("ContainerHierarchyTexts") or []
    assert isinstance(hierarchy, list)
    return " ".join(str(h) for h in hierarchy) + " :: " + str(spec.get("LeafNodeText"))
