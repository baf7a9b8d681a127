"""Cache groups through the CSI path: node plugins find each other through the Kubernetes API.

A real API server (etcd + kube-apiserver), one SeaweedFS, and three `pffs csi --mode node` processes standing
in for three nodes (Node objects n0..n2, node addresses 127.0.0.2..4 on loopback, each plugin with its own
state dir and disk cache). Each stages one volume with `cacheGroup: share`: the plugins publish where their
mounts serve on their Node (annotation pffs.io/cache-group), watch the Nodes, and write each mount's members
file. Reading the dataset through the three mounts (mutual TLS, a certificate per node from one CA) fetches
every block from S3 once for all three, byte for byte; a fourth plugin's `cacheGroup: consume` volume reads
it all from the group; a volume that leaves, or a Node deleted, leaves the others' members within seconds
(the watch, not a poll).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import s3fs
from helpers import make_ca, member_tls, pattern, sha256

from pffs.csi import csi_pb2
from pffs.csi.cache_group import GROUP_ANNOTATION
from pffs.testing.csi_plugin import CsiPlugin
from pffs.testing.s3_server import SeaweedS3, free_ports

pytestmark = [pytest.mark.kube, pytest.mark.s3, pytest.mark.timeout(300)]

BLOCK = 256 << 10
TOKEN = "a-token-of-this-group-0123456789"
AccessMode = csi_pb2.VolumeCapability.AccessMode


@pytest.fixture
def dataset(raw_s3: s3fs.S3FileSystem, bucket: str) -> dict[str, bytes]:
    files = {f"small/{i:02d}.bin": pattern(90_000 + i, seed=i) for i in range(10)}
    files["large.bin"] = pattern(4 * BLOCK + 777, seed=7)
    raw_s3.pipe({f"{bucket}/ds/{name}": data for name, data in files.items()})
    return files


def blocks_of(files: dict[str, bytes]) -> int:
    return sum(-(-len(data) // BLOCK) for data in files.values())


class NodePlugin(CsiPlugin):
    """`pffs csi --mode node` for one stand-in node: its Node name, its address, its own cache."""

    def __init__(
        self, root: Path, node: str, ip: str | None, kubeconfig: Path, token_file: Path, tls: Path
    ) -> None:
        first = free_ports(1)[0]
        group = [] if ip is None else ["--cache-group-token-file", str(token_file), "--node-ip", ip]
        group += [] if ip is None else ["--cache-group-tls-dir", str(tls)]
        super().__init__(
            root,
            "--cache-size", "1G", "--kubeconfig", str(kubeconfig), "--cache-group-ports", f"{first}-{first}",
            "--cache-group-timeout", "2", *group,
            node_id=node, mode="node", cache_dir=root / "cache",
        )  # fmt: skip
        self.staging = root / "kubelet" / "pv" / "ds" / "globalmount"
        self.staging.mkdir(parents=True)

    def stage(self, context: dict[str, str], secrets: dict[str, str]) -> None:
        self.node.NodeStageVolume(
            csi_pb2.NodeStageVolumeRequest(
                volume_id="ds",
                staging_target_path=str(self.staging),
                volume_capability=csi_pb2.VolumeCapability(
                    mount=csi_pb2.VolumeCapability.MountVolume(),
                    access_mode=csi_pb2.VolumeCapability.AccessMode(mode=AccessMode.MULTI_NODE_READER_ONLY),
                ),
                volume_context=context,
                secrets=secrets,
            ),
            timeout=60,
        )

    def unstage(self) -> None:
        self.node.NodeUnstageVolume(
            csi_pb2.NodeUnstageVolumeRequest(volume_id="ds", staging_target_path=str(self.staging)),
            timeout=60,
        )

    def members(self) -> list[str]:
        files = list((self.state_dir / "cache-groups").glob("*.members"))
        if len(files) != 1:
            return []
        lines = files[0].read_text().splitlines()
        return [line for line in lines if line and not line.startswith("#")]

    def stats(self) -> dict[str, Any]:
        return dict(json.loads(os.getxattr(self.staging, "user.pffs.stats")))

    def gets(self) -> int:
        return int(self.stats()["backend_requests"].get("get", {}).get("requests", 0))


def wait_for(what: str, check: Callable[[], Any], timeout_s: float = 20) -> Any:
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(0.1)
    raise AssertionError(f"{what}: not within {timeout_s} s (last: {last!r})")


@pytest.fixture
def cluster(control_plane: Any, tmp_path: Path) -> Iterator[Callable[[str, str | None], NodePlugin]]:
    """Starts a stand-in node (its Node object and its plugin); at the end every plugin is stopped with its
    mounts and every Node deleted."""
    from kubernetes import client

    core = client.CoreV1Api(control_plane.api())
    token_file = tmp_path / "group-token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)
    ca = make_ca(tmp_path / "ca")
    names: list[str] = []
    with contextlib.ExitStack() as started:

        def start(node: str, ip: str | None) -> NodePlugin:
            core.create_node(client.V1Node(metadata=client.V1ObjectMeta(name=node)))
            names.append(node)
            root = tmp_path / node
            root.mkdir()
            tls = member_tls(ca, root / "tls", node)  # mutual TLS between the mounts, a certificate each
            return started.enter_context(
                NodePlugin(root, node, ip, control_plane.kubeconfig, token_file, tls)
            )

        try:
            yield start
        finally:
            started.close()
            for node in names:
                with contextlib.suppress(Exception):
                    core.delete_node(node)


def test_node_plugins_find_each_other_through_the_api_and_fetch_each_block_once(
    control_plane: Any,
    cluster: Callable[[str, str | None], NodePlugin],
    s3_server: SeaweedS3,
    bucket: str,
    dataset: dict[str, bytes],
) -> None:
    from kubernetes import client

    core = client.CoreV1Api(control_plane.api())
    context = {
        "source": f"s3://{bucket}/ds",
        "endpointUrl": s3_server.endpoint_url,
        "blockSize": str(BLOCK),
        "cacheGroup": "share",
    }
    secrets = {"accessKeyId": s3_server.access_key, "secretAccessKey": s3_server.secret_key}
    nodes = [cluster(f"n{i}", f"127.0.0.{i + 2}") for i in range(3)]
    for plugin in nodes:
        plugin.stage(context, secrets)
    # Each plugin publishes where its mount serves, and each mount's members file lists all three.
    addresses = sorted(plugin.members()[0] for plugin in nodes if plugin.members())
    wait_for("three members in every file", lambda: all(len(p.members()) == 3 for p in nodes))
    published = {
        n.metadata.name: json.loads(n.metadata.annotations[GROUP_ANNOTATION])
        for n in core.list_node().items
        if n.metadata.annotations and GROUP_ANNOTATION in n.metadata.annotations
    }
    assert sorted(published) == ["n0", "n1", "n2"], published
    assert {a for groups in published.values() for a in groups.values()} == set(nodes[0].members())
    assert addresses  # the files were there from the stage on

    for plugin in nodes:
        for name, data in dataset.items():
            assert sha256((plugin.staging / name).read_bytes()) == sha256(data), name
    assert sum(p.gets() for p in nodes) == blocks_of(dataset)
    served = sum(p.stats()["peers"]["served_blocks"] for p in nodes)
    assert served == 2 * blocks_of(dataset)

    # A consume-only volume (an ephemeral job's) reads everything from the group, serves nothing, and is
    # not published.
    reader = cluster("n3", "127.0.0.5")
    reader.stage({**context, "cacheGroup": "consume"}, secrets)
    wait_for("the reader's members file", lambda: len(reader.members()) == 3)
    for name, data in dataset.items():
        assert sha256((reader.staging / name).read_bytes()) == sha256(data), name
    assert reader.gets() == 0
    assert reader.stats()["peers"]["fetched_blocks"] == blocks_of(dataset)
    assert json.loads(core.read_node("n3").metadata.annotations[GROUP_ANNOTATION]) == {}

    # A volume that leaves the node, and a Node that goes away: the others' files follow the watch.
    nodes[2].unstage()
    wait_for("n2 gone from the others' files", lambda: len(nodes[0].members()) == 2, timeout_s=10)
    core.delete_node("n1")
    wait_for(
        "n1 gone from the others' files",
        lambda: len(nodes[0].members()) == 1 and len(reader.members()) == 1,  # each follows its own watch
        timeout_s=10,
    )
    assert reader.members() == nodes[0].members()


def test_a_volume_asking_for_a_group_on_a_plugin_without_one_is_refused(
    cluster: Callable[[str, str | None], NodePlugin],
    s3_server: SeaweedS3,
    bucket: str,
    dataset: dict[str, bytes],
) -> None:
    plugin = cluster("lone", None)
    context = {"source": f"s3://{bucket}/ds", "endpointUrl": s3_server.endpoint_url, "cacheGroup": "share"}
    secrets = {"accessKeyId": s3_server.access_key, "secretAccessKey": s3_server.secret_key}
    with pytest.raises(grpc.RpcError) as refused:
        plugin.stage(context, secrets)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "cacheGroup.enabled" in str(refused.value.details())
    with pytest.raises(grpc.RpcError) as bad:
        plugin.stage({**context, "cacheGroup": "yes"}, secrets)
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "cacheGroup" in str(bad.value.details())
