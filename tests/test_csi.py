"""The CSI plugin for real: `pffs csi` in a subprocess on a unix socket, called through its gRPC API as the
kubelet and the external-provisioner call it, mounting through /dev/fuse over the SeaweedFS S3 server.
Every data path is checked byte for byte (sha256) against what is stored in S3.

Each test's plugin (pffs.testing.csi_plugin.CsiPlugin) has its own state dir and cache dir under the
test's tmp dir. Teardown stops the plugin, stops every mount process it recorded (or that logs under the
tmp dir) and unmounts everything mounted under the tmp dir, whatever state the test left.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import re
import signal
import stat
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import s3fs
from helpers import FakeHttpServer, JsonHandler, sha256
from mounts import drop_page_cache
from prometheus_client.parser import text_string_to_metric_families

from pffs.csi import csi_pb2
from pffs.processes import is_alive, is_mount_process
from pffs.scheduler.kube.locality import CACHE_ANNOTATION, node_cache
from pffs.testing.csi_plugin import (
    CsiPlugin,
    FakeKubelet,
    holds_files_under,
    processes_with_files_under,
    wait_gone,
)
from pffs.testing.kubeconfig import token_kubeconfig
from pffs.testing.s3_server import SeaweedS3, free_ports

pytestmark = [
    pytest.mark.s3,
    pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="needs /dev/fuse (FUSE) on this machine"),
    pytest.mark.skipif(os.geteuid() != 0, reason="the node plugin mounts and bind-mounts: needs root"),
]

MiB = 1 << 20
BLOCK = 4 * MiB  # the plugin's default block size
BIG = 9 * MiB + 12_345  # three blocks, the last one partial
RPC_TIMEOUT = 30.0
RECOVERY_DEADLINE_S = 10.0
MARKER = "SECRET-MARKER-123456"

Code = grpc.StatusCode
AccessMode = csi_pb2.VolumeCapability.AccessMode


def capability(
    mode: int = AccessMode.MULTI_NODE_MULTI_WRITER, block: bool = False
) -> csi_pb2.VolumeCapability:
    if block:
        return csi_pb2.VolumeCapability(
            block=csi_pb2.VolumeCapability.BlockVolume(), access_mode=AccessMode(mode=mode)
        )
    return csi_pb2.VolumeCapability(
        mount=csi_pb2.VolumeCapability.MountVolume(), access_mode=AccessMode(mode=mode)
    )


# Test data


@dataclass
class Dataset:
    bucket: str
    prefix: str
    files: dict[str, bytes]  # relative path -> bytes
    endpoint_url: str
    secrets: dict[str, str]

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"

    @property
    def size(self) -> int:
        return sum(len(v) for v in self.files.values())

    @property
    def context(self) -> dict[str, str]:
        return {"source": self.url, "endpointUrl": self.endpoint_url}

    def hashes(self) -> dict[str, str]:
        return {name: sha256(data) for name, data in self.files.items()}


def s3_secrets(server: SeaweedS3) -> dict[str, str]:
    return {"accessKeyId": server.access_key, "secretAccessKey": server.secret_key}


@pytest.fixture
def dataset(s3_server: SeaweedS3, raw_s3: s3fs.S3FileSystem, bucket: str) -> Dataset:
    """Random bytes in the bucket: a file spanning three blocks, one of exactly one block, small ones, an
    empty one, one in a subfolder."""
    files = {
        "big.bin": os.urandom(BIG),
        "block.bin": os.urandom(BLOCK),
        "small-0.bin": os.urandom(1000),
        "small-1.bin": os.urandom(65_537),
        "empty.bin": b"",
        "sub/nested.bin": os.urandom(300_000),
    }
    raw_s3.pipe({f"{bucket}/set/{name}": data for name, data in files.items()})
    return Dataset(bucket, "set", files, s3_server.endpoint_url, s3_secrets(s3_server))


def read_all(root: Path, ds: Dataset) -> dict[str, str]:
    return {name: sha256((root / name).read_bytes()) for name in ds.files}


def assert_exact(root: Path, ds: Dataset) -> None:
    got = read_all(root, ds)
    bad = [name for name, digest in ds.hashes().items() if got[name] != digest]
    assert not bad, f"{root}: these files differ from S3: {bad}"


# What the kernel has mounted


@dataclass(frozen=True)
class MountEntry:
    path: str
    fstype: str
    device: str  # major:minor: bind mounts of one FUSE mount share it


def mountinfo() -> list[MountEntry]:
    entries = []
    with open("/proc/self/mountinfo") as table:
        for line in table:
            fields = line.split()
            dash = fields.index("-")
            path = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
            entries.append(MountEntry(path, fields[dash + 1], fields[2]))
    return entries


def mounts_under(root: Path) -> list[MountEntry]:
    prefix = str(root).rstrip("/") + "/"
    return [m for m in mountinfo() if m.path.startswith(prefix)]


def mount_stats(path: Path | str) -> dict[str, Any]:
    """What `pffs stats MOUNTPOINT --json` prints (the same xattr), without a process start."""
    return json.loads(os.getxattr(path, "user.pffs.stats"))


def gets(stats: dict[str, Any]) -> int:
    return int(stats["backend_requests"]["get"]["requests"])


def wait_for(what: str, check: Callable[[], Any], timeout_s: float, interval_s: float = 0.05) -> Any:
    """Polls `check` until it returns something true (exceptions count as not yet); its last value."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while True:
        try:
            last = check()
            if last:
                return last
        except Exception as exc:
            last = exc
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s} s (last: {last!r})")
        time.sleep(interval_s)


def wait_cached(path: Path, timeout_s: float = 15) -> None:
    """Until every block of the file is on the node's disk tier (the write-behind thread has caught up)."""
    wait_for(f"{path} on disk", lambda: os.getxattr(path, "user.pffs.cached") == b"1.0000", timeout_s)


# The plugin process


class Plugin(CsiPlugin):
    """`pffs csi --mode all` with its cache dir and /metrics, and the kubelet's calls with its deadline."""

    def __init__(self, root: Path, *args: str, verbosity: str = "-v") -> None:
        super().__init__(
            root,
            "--cache-size",
            "1G",
            *args,
            node_id="n1",
            cache_dir=root / "cache",
            metrics=True,
            verbosity=verbosity,
        )

    def stage(
        self, volume_id: str, staging: Path, context: dict[str, str], secrets: dict[str, str], **kw: Any
    ) -> None:
        self.node.NodeStageVolume(
            csi_pb2.NodeStageVolumeRequest(
                volume_id=volume_id,
                staging_target_path=str(staging),
                volume_capability=kw.pop("cap", capability()),
                volume_context=context,
                secrets=secrets,
                **kw,
            ),
            timeout=RPC_TIMEOUT,
        )

    def publish(self, volume_id: str, staging: Path, target: Path, readonly: bool = False, **kw: Any) -> None:
        self.node.NodePublishVolume(
            csi_pb2.NodePublishVolumeRequest(
                volume_id=volume_id,
                staging_target_path=str(staging),
                target_path=str(target),
                volume_capability=kw.pop("cap", capability()),
                readonly=readonly,
                **kw,
            ),
            timeout=RPC_TIMEOUT,
        )

    def publish_inline(
        self,
        volume_id: str,
        target: Path,
        context: dict[str, str],
        secrets: dict[str, str],
        pod: str,
        readonly: bool = False,
    ) -> None:
        context = {
            **context,
            "csi.storage.k8s.io/ephemeral": "true",
            "csi.storage.k8s.io/pod.name": pod,
            "csi.storage.k8s.io/pod.namespace": "team-a",
            "csi.storage.k8s.io/pod.uid": f"uid-{pod}",
            "csi.storage.k8s.io/serviceAccount.name": "default",
        }
        self.node.NodePublishVolume(
            csi_pb2.NodePublishVolumeRequest(
                volume_id=volume_id,
                target_path=str(target),
                volume_capability=capability(AccessMode.SINGLE_NODE_WRITER),
                volume_context=context,
                secrets=secrets,
                readonly=readonly,
            ),
            timeout=RPC_TIMEOUT,
        )

    def unpublish(self, volume_id: str, target: Path) -> None:
        self.node.NodeUnpublishVolume(
            csi_pb2.NodeUnpublishVolumeRequest(volume_id=volume_id, target_path=str(target)),
            timeout=RPC_TIMEOUT,
        )

    def unstage(self, volume_id: str, staging: Path) -> None:
        self.node.NodeUnstageVolume(
            csi_pb2.NodeUnstageVolumeRequest(volume_id=volume_id, staging_target_path=str(staging)),
            timeout=RPC_TIMEOUT,
        )


@pytest.fixture
def start_plugin(tmp_path: Path) -> Iterator[Callable[..., Plugin]]:
    """Starts the test's plugin (one at a time: a restart is `kill`, then `start` again); at the end nothing
    it started is left running or mounted under the test's tmp dir."""
    with contextlib.ExitStack() as started:

        def start(*args: str, verbosity: str = "-v") -> Plugin:
            return started.enter_context(Plugin(tmp_path, *args, verbosity=verbosity))

        yield start


@pytest.fixture
def plugin(start_plugin: Callable[..., Plugin]) -> Plugin:
    return start_plugin()


def staging_path(root: Path, name: str) -> Path:
    """Where the kubelet stages: it makes the directory, the plugin mounts on it."""
    path = root / "kubelet" / "pv" / name / "globalmount"
    path.mkdir(parents=True)
    return path


def target_path(root: Path, pod: str, name: str = "vol") -> Path:
    """A pod's target: the kubelet makes its parent, the plugin the directory itself."""
    path = root / "kubelet" / "pods" / pod / "volumes" / name / "mount"
    path.parent.mkdir(parents=True)
    return path


def fuse_mounts(root: Path) -> list[MountEntry]:
    return [m for m in mounts_under(root) if m.fstype == "fuse.pffs"]


def mount_processes(plugin: Plugin) -> set[int]:
    """The pffs mount processes logging into this plugin's state dir (alive)."""
    logs = str(plugin.state_dir / "logs") + "/"
    found = set()
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        if is_mount_process(int(p)) and holds_files_under(int(p), logs):
            found.add(int(p))
    return found


# 1. One mount per volume, shared by its targets


@pytest.mark.timeout(90)
def test_stage_once_publish_twice_is_one_mount_and_one_get_per_block(
    plugin: Plugin, dataset: Dataset, tmp_path: Path
) -> None:
    staging = staging_path(tmp_path, "pv-1")
    a, b = target_path(tmp_path, "pod-a"), target_path(tmp_path, "pod-b")
    plugin.stage("pv-1", staging, dataset.context, dataset.secrets)
    plugin.publish("pv-1", staging, a)
    plugin.publish("pv-1", staging, b)

    staged = plugin.staged()
    assert list(staged) == [str(staging)], staged
    record = staged[str(staging)]
    assert set(record["targets"]) == {str(a), str(b)}
    assert is_alive(record["pid"])
    assert mount_processes(plugin) == {record["pid"]}
    at_staging = [m for m in fuse_mounts(tmp_path) if m.path == str(staging)]
    assert len(at_staging) == 1, mountinfo()
    # the targets are binds of that one mount (same device), not mounts of their own
    by_path = {m.path: m for m in mounts_under(tmp_path)}
    assert by_path[str(a)].device == by_path[str(b)].device == at_staging[0].device
    assert mount_stats(a)["pid"] == mount_stats(b)["pid"] == record["pid"]

    blocks = math.ceil(BIG / BLOCK)
    assert sha256((a / "big.bin").read_bytes()) == sha256(dataset.files["big.bin"])
    stats = json.loads(
        subprocess.run(
            [sys.executable, "-m", "pffs.cli.main", "stats", str(staging), "--json"],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout
    )
    assert stats["pid"] == record["pid"]
    assert gets(stats) == blocks, stats["backend_requests"]
    assert sha256((b / "big.bin").read_bytes()) == sha256(dataset.files["big.bin"])
    assert gets(mount_stats(staging)) == blocks, "the second target's read went to S3 again"

    assert_exact(a, dataset)
    assert_exact(b, dataset)
    assert_exact(staging, dataset)

    # a repeated stage and publish (the kubelet retries) change nothing
    plugin.stage("pv-1", staging, dataset.context, dataset.secrets)
    plugin.publish("pv-1", staging, a)
    assert plugin.staged()[str(staging)]["pid"] == record["pid"]
    assert len([m for m in mounts_under(tmp_path) if m.path == str(a)]) == 1

    plugin.unpublish("pv-1", a)
    plugin.unpublish("pv-1", a)  # idempotent
    assert not a.exists()
    assert_exact(b, dataset)
    plugin.unpublish("pv-1", b)
    plugin.unstage("pv-1", staging)
    plugin.unstage("pv-1", staging)  # idempotent
    assert plugin.staged() == {}
    assert mounts_under(tmp_path) == []
    assert wait_gone({record["pid"]}, 10) == set()


# 2. Read-only targets


@pytest.mark.timeout(90)
def test_read_only_target_refuses_writes_and_read_write_target_uploads(
    plugin: Plugin, dataset: Dataset, raw_s3: s3fs.S3FileSystem, tmp_path: Path
) -> None:
    staging = staging_path(tmp_path, "pv-rw")
    rw, ro = target_path(tmp_path, "writer"), target_path(tmp_path, "reader")
    plugin.stage("pv-rw", staging, dataset.context, dataset.secrets)
    plugin.publish("pv-rw", staging, rw)
    plugin.publish("pv-rw", staging, ro, readonly=True)

    for attempt in (
        lambda: (ro / "new.bin").write_bytes(b"no"),
        lambda: open(ro / "small-0.bin", "r+b").close(),
        lambda: (ro / "newdir").mkdir(),
        lambda: (ro / "small-0.bin").unlink(),
    ):
        with pytest.raises(OSError) as caught:
            attempt()
        assert caught.value.errno == errno.EROFS, caught.value
    assert_exact(ro, dataset)

    data = os.urandom(5 * MiB + 3)
    (rw / "out").mkdir()
    with open(rw / "out" / "written.bin", "wb") as f:
        f.write(data)
    assert sha256(raw_s3.cat(f"{dataset.bucket}/set/out/written.bin")) == sha256(data)
    assert sha256((ro / "out" / "written.bin").read_bytes()) == sha256(data)
    assert not raw_s3.exists(f"{dataset.bucket}/set/new.bin")

    # a volume staged with a read-only access mode is read-only in every target
    staging_ro = staging_path(tmp_path, "pv-ro")
    target = target_path(tmp_path, "reader-2")
    reader = capability(AccessMode.MULTI_NODE_READER_ONLY)
    plugin.stage("pv-ro", staging_ro, dataset.context, dataset.secrets, cap=reader)
    plugin.publish("pv-ro", staging_ro, target, cap=reader)
    with pytest.raises(OSError) as caught:
        (target / "new.bin").write_bytes(b"no")
    assert caught.value.errno == errno.EROFS
    assert_exact(target, dataset)


@pytest.mark.timeout(120)
def test_a_volume_every_pod_reads_is_read_only_on_the_host_until_one_writes(
    plugin: Plugin, dataset: Dataset, raw_s3: s3fs.S3FileSystem, tmp_path: Path
) -> None:
    before = {key: sha256(raw_s3.cat(key)) for key in raw_s3.find(f"{dataset.bucket}/set")}
    staging = staging_path(tmp_path, "pv-host")
    reader, writer = target_path(tmp_path, "reader"), target_path(tmp_path, "writer")
    plugin.stage("pv-host", staging, dataset.context, dataset.secrets)  # a read-write access mode

    def host_refuses_writes() -> None:
        for attempt in (
            lambda: (staging / "host.bin").write_bytes(b"no"),
            lambda: (staging / "small-0.bin").unlink(),
            lambda: (staging / "hostdir").mkdir(),
        ):
            with pytest.raises(OSError) as caught:
                attempt()
            assert caught.value.errno == errno.EROFS, caught.value

    host_refuses_writes()  # staged, no pod yet
    plugin.publish("pv-host", staging, reader, readonly=True)
    host_refuses_writes()  # every pod reads: the file system itself is read-only, not only the bind
    assert_exact(reader, dataset)

    plugin.publish("pv-host", staging, writer)  # one pod writes: writable, logged
    (writer / "from-writer.bin").write_bytes(b"written")
    assert raw_s3.cat(f"{dataset.bucket}/set/from-writer.bin") == b"written"
    with pytest.raises(OSError) as caught:
        (reader / "from-reader.bin").write_bytes(b"no")
    assert caught.value.errno == errno.EROFS  # the reading pod's bind stays read-only
    assert "is read-write on this node now" in plugin.log()

    plugin.unpublish("pv-host", writer)  # the last writer leaves: read-only again
    host_refuses_writes()
    assert_exact(reader, dataset)
    raw_s3.invalidate_cache()
    after = {key: sha256(raw_s3.cat(key)) for key in raw_s3.find(f"{dataset.bucket}/set")}
    assert after == {**before, f"{dataset.bucket}/set/from-writer.bin": sha256(b"written")}
    plugin.unpublish("pv-host", reader)
    plugin.unstage("pv-host", staging)


# 3. Inline volumes


@pytest.mark.timeout(90)
def test_inline_volumes_of_one_source_share_one_mount_until_the_last_pod_leaves(
    plugin: Plugin, dataset: Dataset, tmp_path: Path
) -> None:
    t1, t2 = target_path(tmp_path, "p1", "data"), target_path(tmp_path, "p2", "data")
    plugin.publish_inline("csi-aaaa1111", t1, dataset.context, dataset.secrets, "p1")
    plugin.publish_inline("csi-bbbb2222", t2, dataset.context, dataset.secrets, "p2")
    assert_exact(t1, dataset)
    assert_exact(t2, dataset)

    staged = plugin.staged()
    assert len(staged) == 1, staged
    ((path, record),) = staged.items()
    assert record["inline_key"]
    assert {t: v["volume_id"] for t, v in record["targets"].items()} == {
        str(t1): "csi-aaaa1111",
        str(t2): "csi-bbbb2222",
    }
    pid = record["pid"]
    assert mount_processes(plugin) == {pid}
    assert len([m for m in fuse_mounts(tmp_path) if m.path == path]) == 1
    assert mount_stats(t1)["pid"] == mount_stats(t2)["pid"] == pid

    plugin.unpublish("csi-aaaa1111", t1)
    assert not t1.exists()
    assert is_alive(pid)
    assert list(plugin.staged()) == [path]
    assert_exact(t2, dataset)

    plugin.unpublish("csi-bbbb2222", t2)
    assert plugin.staged() == {}
    assert wait_gone({pid}, 10) == set(), "the shared mount's process outlived its last pod"
    assert mounts_under(tmp_path) == [], mounts_under(tmp_path)
    assert not Path(path).exists()
    assert list((plugin.state_dir / "secrets").iterdir()) == []


@pytest.mark.timeout(90)
def test_read_only_inline_volumes_are_read_only_on_the_host_and_read_write_ones_get_their_own_mount(
    plugin: Plugin, dataset: Dataset, raw_s3: s3fs.S3FileSystem, tmp_path: Path
) -> None:
    before = {key: sha256(raw_s3.cat(key)) for key in raw_s3.find(f"{dataset.bucket}/set")}
    reader = target_path(tmp_path, "reader", "data")
    plugin.publish_inline("csi-r0000001", reader, dataset.context, dataset.secrets, "reader", readonly=True)
    ((ro_path, ro_record),) = plugin.staged().items()
    assert ro_record["read_only"] is True
    # The staging mount itself, on the host (not only the pod's bind), refuses writes.
    for attempt in (
        lambda: (Path(ro_path) / "host.bin").write_bytes(b"no"),
        lambda: (Path(ro_path) / "small-0.bin").unlink(),
        lambda: (Path(ro_path) / "hostdir").mkdir(),
    ):
        with pytest.raises(OSError) as caught:
            attempt()
        assert caught.value.errno == errno.EROFS, caught.value
    assert_exact(reader, dataset)

    writer = target_path(tmp_path, "writer", "data")
    plugin.publish_inline("csi-w0000001", writer, dataset.context, dataset.secrets, "writer")
    staged = plugin.staged()
    assert len(staged) == 2 and staged[ro_path]["read_only"] is True, staged
    [rw_record] = [r for p, r in staged.items() if p != ro_path]
    assert rw_record["read_only"] is False and rw_record["pid"] != ro_record["pid"]
    (writer / "from-writer.bin").write_bytes(b"written")
    assert raw_s3.cat(f"{dataset.bucket}/set/from-writer.bin") == b"written"
    raw_s3.invalidate_cache()
    after = {key: sha256(raw_s3.cat(key)) for key in raw_s3.find(f"{dataset.bucket}/set")}
    assert after == {**before, f"{dataset.bucket}/set/from-writer.bin": sha256(b"written")}

    plugin.unpublish("csi-r0000001", reader)
    plugin.unpublish("csi-w0000001", writer)
    assert plugin.staged() == {}


# 4. A mount that dies is mounted again in place


@pytest.mark.timeout(90)
def test_kill_9_of_the_mount_process_recovers_within_10_s(
    plugin: Plugin, dataset: Dataset, tmp_path: Path
) -> None:
    staging = staging_path(tmp_path, "pv-rec")
    a, b = target_path(tmp_path, "pod-a"), target_path(tmp_path, "pod-b")
    plugin.stage("pv-rec", staging, dataset.context, dataset.secrets)
    plugin.publish("pv-rec", staging, a)
    plugin.publish("pv-rec", staging, b, readonly=True)
    assert_exact(a, dataset)
    for name in dataset.files:
        if dataset.files[name]:
            wait_cached(staging / name)
    old_pid = plugin.staged()[str(staging)]["pid"]

    os.kill(old_pid, signal.SIGKILL)
    killed = time.monotonic()
    assert wait_gone({old_pid}, 5) == set()

    def all_serve() -> bool:
        for root in (staging, a, b):
            assert_exact(root, dataset)
        return True

    wait_for("the volume to serve again", all_serve, RECOVERY_DEADLINE_S, interval_s=0.02)
    recovery_s = time.monotonic() - killed
    print(f"\nrecovery after kill -9 of the mount process: {recovery_s:.2f} s")
    (tmp_path / "recovery.json").write_text(json.dumps({"recovery_s": recovery_s}))
    assert recovery_s < RECOVERY_DEADLINE_S

    new_pid = plugin.staged()[str(staging)]["pid"]
    assert new_pid != old_pid and is_alive(new_pid)
    assert mount_stats(a)["pid"] == mount_stats(b)["pid"] == new_pid
    assert gets(mount_stats(staging)) == 0, "the new mount fetched from S3 what the node's disk cache held"
    with pytest.raises(OSError) as caught:
        (b / "x").write_bytes(b"no")
    assert caught.value.errno == errno.EROFS, "the read-only target came back read-write"
    wait_for("one recovery counted", lambda: plugin.metric("pffs_csi_recoveries_total") == 1, 5)
    assert plugin.metric("pffs_csi_recovery_failures_total") == 0
    assert len(re.findall(r"mounted \S+ again at", plugin.log())) == 1
    # how it ended, from the record its supervisor wrote (pffs.fuse.mount_record)
    assert f"is dead (pid {old_pid}: killed by SIGKILL" in plugin.log(), plugin.log()
    health = plugin.node.NodeGetVolumeHealth(
        csi_pb2.NodeGetVolumeHealthRequest(volume_id="pv-rec", volume_publish_path=str(a)),
        timeout=RPC_TIMEOUT,
    )
    assert list(health.volume_health.health_statuses) == []


# 5. The plugin itself dies


@pytest.mark.timeout(120)
def test_plugin_sigkill_restart_adopts_healthy_mounts_and_repairs_broken_ones(
    plugin: Plugin, dataset: Dataset, tmp_path: Path
) -> None:
    good, bad = staging_path(tmp_path, "pv-good"), staging_path(tmp_path, "pv-bad")
    good_target, bad_target = target_path(tmp_path, "pod-good"), target_path(tmp_path, "pod-bad")
    plugin.stage("pv-good", good, dataset.context, dataset.secrets)
    plugin.publish("pv-good", good, good_target)
    plugin.stage("pv-bad", bad, dataset.context, dataset.secrets)
    plugin.publish("pv-bad", bad, bad_target)
    assert_exact(good_target, dataset)
    assert_exact(bad_target, dataset)
    wait_cached(good / "big.bin")
    before = plugin.staged()
    good_pid, bad_pid = before[str(good)]["pid"], before[str(bad)]["pid"]
    good_gets = gets(mount_stats(good))
    assert good_gets >= math.ceil(BIG / BLOCK)

    plugin.kill()
    os.kill(bad_pid, signal.SIGKILL)  # while no plugin watches
    assert wait_gone({bad_pid}, 5) == set()
    assert is_alive(good_pid)

    plugin.start()  # on the same state dir
    after = plugin.staged()
    assert after[str(good)]["pid"] == good_pid, "the healthy mount was replaced"
    assert mount_stats(good)["pid"] == good_pid
    drop_page_cache()  # the re-read must reach the mount, not just the kernel's pages
    assert sha256((good_target / "big.bin").read_bytes()) == sha256(dataset.files["big.bin"])
    assert gets(mount_stats(good)) == good_gets, "re-reading cached data went to S3: a remount?"
    assert_exact(good_target, dataset)
    assert "adopted the running mount" in plugin.log()

    def bad_serves() -> bool:
        assert_exact(bad, dataset)
        assert_exact(bad_target, dataset)
        return True

    wait_for("the broken volume to be repaired", bad_serves, RECOVERY_DEADLINE_S)
    new_bad = plugin.staged()[str(bad)]["pid"]
    assert new_bad != bad_pid and is_alive(new_bad)
    assert plugin.staged()[str(good)]["pid"] == good_pid
    wait_for("one recovery counted", lambda: plugin.metric("pffs_csi_recoveries_total") == 1, 5)
    assert mount_processes(plugin) == {good_pid, new_bad}

    # the restarted plugin still owns both volumes: unpublish and unstage work
    for vid, staging, target in (("pv-good", good, good_target), ("pv-bad", bad, bad_target)):
        plugin.unpublish(vid, target)
        plugin.unstage(vid, staging)
    assert plugin.staged() == {}
    assert wait_gone({good_pid, new_bad}, 10) == set()
    assert mounts_under(tmp_path) == []


# 6. Secrets


def _proc_hits(needle: bytes) -> dict[int, list[str]]:
    hits: dict[int, list[str]] = {}
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        for what in ("cmdline", "environ"):
            try:
                data = Path(f"/proc/{p}/{what}").read_bytes()
            except OSError:
                continue
            if needle in data:
                hits.setdefault(int(p), []).append(what)
    return hits


@pytest.mark.timeout(120)
def test_secrets_never_reach_argv_environ_logs_or_errors(
    start_plugin: Callable[..., Plugin], dataset: Dataset, s3_server: SeaweedS3, tmp_path: Path
) -> None:
    plugin = start_plugin(verbosity="-vv")  # debug: every request is logged (secrets stripped)
    secret = s3_server.secret_key
    errors: list[grpc.RpcError] = []

    def refused(call: Callable[[], Any], code: grpc.StatusCode, names: str | None = None) -> None:
        with pytest.raises(grpc.RpcError) as caught:
            call()
        errors.append(caught.value)
        assert caught.value.code() == code, caught.value.details()
        if names:
            assert names in caught.value.details()

    # provisioning with the real secret, then with a wrong one
    params = {"source": f"{dataset.url}/vols", "endpointUrl": dataset.endpoint_url}
    plugin.controller.CreateVolume(
        csi_pb2.CreateVolumeRequest(
            name="pvc-s", volume_capabilities=[capability()], parameters=params, secrets=dataset.secrets
        ),
        timeout=RPC_TIMEOUT,
    )
    wrong = {"accessKeyId": s3_server.access_key, "secretAccessKey": MARKER}
    refused(
        lambda: plugin.controller.CreateVolume(
            csi_pb2.CreateVolumeRequest(
                name="pvc-x", volume_capabilities=[capability()], parameters=params, secrets=wrong
            ),
            timeout=RPC_TIMEOUT,
        ),
        Code.PERMISSION_DENIED,
    )

    staging = staging_path(tmp_path, "pv-s")
    target = target_path(tmp_path, "pod-s")
    plugin.stage("pv-s", staging, dataset.context, dataset.secrets)
    plugin.publish("pv-s", staging, target)
    assert_exact(target, dataset)
    refused(
        lambda: plugin.stage("pv-w", staging_path(tmp_path, "pv-w"), dataset.context, wrong),
        Code.PERMISSION_DENIED,
    )
    refused(
        lambda: plugin.stage("pv-u", staging_path(tmp_path, "pv-u"), dataset.context, {"tokenX": MARKER}),
        Code.INVALID_ARGUMENT,
        "tokenX",
    )
    refused(
        lambda: plugin.publish_inline("csi-x", target_path(tmp_path, "pod-x"), dataset.context, wrong, "px"),
        Code.PERMISSION_DENIED,
    )
    refused(
        lambda: plugin.stage(
            "pv-v", staging_path(tmp_path, "pv-v"), {**dataset.context, "cacheSise": "1G"}, {"tokenY": MARKER}
        ),
        Code.INVALID_ARGUMENT,
    )

    # the recorded credentials: 0600 in a 0700 folder, and they are the real ones
    secrets_dir = plugin.state_dir / "secrets"
    assert stat.S_IMODE(secrets_dir.stat().st_mode) == 0o700
    files = list(secrets_dir.iterdir())
    assert len(files) == 1, files
    assert stat.S_IMODE(files[0].stat().st_mode) == 0o600
    assert json.loads(files[0].read_text())["secretAccessKey"] == secret

    # a repair mounts again with the recorded credentials (through the pipe, as the first mount)
    old_pid = plugin.staged()[str(staging)]["pid"]
    os.kill(old_pid, signal.SIGKILL)
    wait_for("the repaired mount", lambda: assert_exact(target, dataset) is None, RECOVERY_DEADLINE_S)
    assert plugin.staged()[str(staging)]["pid"] != old_pid

    ours = processes_with_files_under(tmp_path) | {os.getpid()}
    assert mount_processes(plugin) <= ours and plugin.process is not None and plugin.process.pid in ours
    for needle in (secret, MARKER):
        hits = _proc_hits(needle.encode())
        leaks = {pid: where for pid, where in hits.items() if pid in ours or needle == MARKER}
        assert not leaks, f"{needle!r} in /proc/PID/(cmdline|environ) of {leaks}"
        others = set(hits) - set(leaks)
        if others:
            print(f"\nnote: processes not started by this test carry the S3 secret: {sorted(others)}")
        for log in [plugin.log_path, *sorted((plugin.state_dir / "logs").glob("*.log"))]:
            assert needle not in log.read_text(errors="replace"), f"{needle!r} in {log}"
        assert needle not in (plugin.state_dir / "state.json").read_text()
        for error in errors:
            assert needle not in (error.details() or ""), error.details()
            assert needle not in str(error)
    assert "***stripped***" in plugin.log(), "requests were not logged: the log check proves nothing"
    assert list((plugin.state_dir / "logs").glob("*.log")), "no mount log to check"

    plugin.unpublish("pv-s", target)
    plugin.unstage("pv-s", staging)
    assert list(secrets_dir.iterdir()) == []


# 7. Malformed requests


@dataclass
class Shared:
    plugin: Plugin
    root: Path
    endpoint_url: str
    secrets: dict[str, str]
    bucket: str

    @property
    def context(self) -> dict[str, str]:
        return {"source": f"s3://{self.bucket}/set", "endpointUrl": self.endpoint_url}

    def path(self, name: str) -> str:
        return str(self.root / "paths" / name)


@pytest.fixture(scope="module")
def shared(s3_server: SeaweedS3, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shared]:
    """One plugin for the calls that must be refused (none of them should mount anything)."""
    root = tmp_path_factory.mktemp("csi-shared")
    raw = s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False, **s3_server.storage_options())
    bucket = f"csi-shared-{os.urandom(4).hex()}"
    raw.mkdir(bucket)
    raw.pipe(f"{bucket}/set/a.bin", b"a" * 100)
    try:
        with Plugin(root) as plugin:
            yield Shared(plugin, root, s3_server.endpoint_url, s3_secrets(s3_server), bucket)
    finally:
        with contextlib.suppress(OSError):
            raw.rm(bucket, recursive=True)


Case = tuple[str, Callable[[Shared], tuple[str, Any]], grpc.StatusCode, str]


def _request(
    method: str, kind: type[Any], fields: dict[str, Any], changes: dict[str, Any]
) -> tuple[str, Any]:
    """A call of `method` with `fields` as `changes` change them (None leaves a field out)."""
    fields = {**fields, **changes}
    return method, kind(**{k: v for k, v in fields.items() if v is not None})


def _stage(s: Shared, **changes: Any) -> tuple[str, Any]:
    fields = {
        "volume_id": "pv-m",
        "staging_target_path": s.path("stage"),
        "volume_capability": capability(),
        "volume_context": s.context,
        "secrets": s.secrets,
    }
    return _request("NodeStageVolume", csi_pb2.NodeStageVolumeRequest, fields, changes)


def _publish(s: Shared, **changes: Any) -> tuple[str, Any]:
    fields = {
        "volume_id": "pv-m",
        "staging_target_path": s.path("stage-never"),
        "target_path": s.path("target"),
        "volume_capability": capability(),
    }
    return _request("NodePublishVolume", csi_pb2.NodePublishVolumeRequest, fields, changes)


def _create(s: Shared, **changes: Any) -> tuple[str, Any]:
    fields = {
        "name": "pvc-m",
        "volume_capabilities": [capability()],
        "parameters": {"source": f"s3://{s.bucket}/vols", "endpointUrl": s.endpoint_url},
        "secrets": s.secrets,
    }
    return _request("CreateVolume", csi_pb2.CreateVolumeRequest, fields, changes)


def _mounting_cases(call: str, build: Callable[..., tuple[str, Any]], path: str, noun: str) -> list[Case]:
    """What NodeStageVolume and NodePublishVolume both refuse: a missing or unsafe volume id, a missing or
    block capability or one without an access mode, and a missing, `..`, relative or NUL-holding path where
    they mount (`path`)."""
    bad, unknown_mode = Code.INVALID_ARGUMENT, capability(AccessMode.UNKNOWN)
    return [
        (f"{call}-no-volume-id", lambda s: build(s, volume_id=None), bad, "volume_id"),
        (f"{call}-volume-id-dotdot", lambda s: build(s, volume_id="../x"), bad, "volume_id"),
        (f"{call}-volume-id-absolute", lambda s: build(s, volume_id="/abs"), bad, "volume_id"),
        (f"{call}-no-capability", lambda s: build(s, volume_capability=None), bad, "volume_capability"),
        (f"{call}-no-access-mode", lambda s: build(s, volume_capability=unknown_mode), bad, "access_mode"),
        (f"{call}-block", lambda s: build(s, volume_capability=capability(block=True)), bad, "block"),
        (f"{call}-no-{noun}", lambda s: build(s, **{path: None}), bad, path),
        (f"{call}-dotdot-{noun}", lambda s: build(s, **{path: "/tmp/../etc"}), bad, path),
        (f"{call}-relative-{noun}", lambda s: build(s, **{path: "a/b"}), bad, path),
        (f"{call}-nul-{noun}", lambda s: build(s, **{path: s.path("x\0y")}), bad, path),
    ]


def _ctx(s: Shared, **changes: str) -> dict[str, str]:
    return {**s.context, **changes}


MALFORMED: list[Case] = [
    *_mounting_cases("stage", _stage, "staging_target_path", "staging-path"),
    (
        "stage-ftp-source",
        lambda s: _stage(s, volume_context=_ctx(s, source="ftp://x")),
        Code.INVALID_ARGUMENT,
        "source",
    ),
    (
        "stage-empty-s3-source",
        lambda s: _stage(s, volume_context=_ctx(s, source="s3://")),
        Code.INVALID_ARGUMENT,
        "source",
    ),
    (
        "stage-dotdot-source",
        lambda s: _stage(s, volume_context=_ctx(s, source=f"s3://{s.bucket}/../x")),
        Code.INVALID_ARGUMENT,
        "source",
    ),
    (
        "stage-no-source",
        lambda s: _stage(s, volume_context={"endpointUrl": s.endpoint_url}),
        Code.INVALID_ARGUMENT,
        "source",
    ),
    (
        "stage-unknown-attribute",
        lambda s: _stage(s, volume_context=_ctx(s, cacheSise="1G")),
        Code.INVALID_ARGUMENT,
        "cacheSise",
    ),
    (
        "stage-bad-endpoint",
        lambda s: _stage(s, volume_context=_ctx(s, endpointUrl="ftp://h")),
        Code.INVALID_ARGUMENT,
        "endpointUrl",
    ),
    (
        "stage-negative-stale-if-error",
        lambda s: _stage(s, volume_context=_ctx(s, staleIfError="-1")),
        Code.INVALID_ARGUMENT,
        "staleIfError",
    ),
    (
        "stage-bad-size",
        lambda s: _stage(s, volume_context=_ctx(s, blockSize="lots")),
        Code.INVALID_ARGUMENT,
        "blockSize",
    ),
    (
        "stage-half-key-pair",
        lambda s: _stage(s, secrets={"accessKeyId": "k"}),
        Code.INVALID_ARGUMENT,
        "secretAccessKey",
    ),
    (
        "stage-missing-prefix",
        lambda s: _stage(s, volume_context=_ctx(s, source=f"s3://{s.bucket}/nope")),
        Code.NOT_FOUND,
        "nope",
    ),
    (
        "stage-missing-bucket",
        lambda s: _stage(s, volume_context=_ctx(s, source="s3://pffs-no-such-bucket-4711/x")),
        Code.NOT_FOUND,
        "pffs-no-such-bucket-4711",
    ),
    (
        "stage-object-not-prefix",
        lambda s: _stage(s, volume_context=_ctx(s, source=f"s3://{s.bucket}/set/a.bin")),
        Code.INVALID_ARGUMENT,
        "a.bin",
    ),
    *_mounting_cases("publish", _publish, "target_path", "target"),
    (
        "publish-no-staging-path",
        lambda s: _publish(s, staging_target_path=None),
        Code.FAILED_PRECONDITION,
        "staging_target_path",
    ),
    ("publish-not-staged", lambda s: _publish(s), Code.FAILED_PRECONDITION, "NodeStageVolume"),
    (
        "publish-inline-ftp-source",
        lambda s: _publish(
            s,
            staging_target_path=None,
            volume_context={"source": "ftp://x", "csi.storage.k8s.io/ephemeral": "true"},
        ),
        Code.INVALID_ARGUMENT,
        "source",
    ),
    (
        "unpublish-no-target",
        lambda s: ("NodeUnpublishVolume", csi_pb2.NodeUnpublishVolumeRequest(volume_id="pv-m")),
        Code.INVALID_ARGUMENT,
        "target_path",
    ),
    (
        "unpublish-no-volume-id",
        lambda s: ("NodeUnpublishVolume", csi_pb2.NodeUnpublishVolumeRequest(target_path=s.path("t"))),
        Code.INVALID_ARGUMENT,
        "volume_id",
    ),
    (
        "unstage-no-staging-path",
        lambda s: ("NodeUnstageVolume", csi_pb2.NodeUnstageVolumeRequest(volume_id="pv-m")),
        Code.INVALID_ARGUMENT,
        "staging_target_path",
    ),
    (
        "unstage-dotdot-path",
        lambda s: (
            "NodeUnstageVolume",
            csi_pb2.NodeUnstageVolumeRequest(volume_id="pv-m", staging_target_path="/var/../etc"),
        ),
        Code.INVALID_ARGUMENT,
        "staging_target_path",
    ),
    ("create-no-name", lambda s: _create(s, name=None), Code.INVALID_ARGUMENT, "name"),
    ("create-slash-name", lambda s: _create(s, name="a/b"), Code.INVALID_ARGUMENT, "name"),
    ("create-dotdot-name", lambda s: _create(s, name=".."), Code.INVALID_ARGUMENT, "name"),
    (
        "create-no-capabilities",
        lambda s: _create(s, volume_capabilities=None),
        Code.INVALID_ARGUMENT,
        "volume_capabilities",
    ),
    (
        "create-block",
        lambda s: _create(s, volume_capabilities=[capability(block=True)]),
        Code.INVALID_ARGUMENT,
        "block",
    ),
    (
        "create-unknown-parameter",
        lambda s: _create(s, parameters={"source": f"s3://{s.bucket}/v", "cacheSise": "1G"}),
        Code.INVALID_ARGUMENT,
        "cacheSise",
    ),
    (
        "create-bad-source",
        lambda s: _create(s, parameters={"source": "ftp://x"}),
        Code.INVALID_ARGUMENT,
        "source",
    ),
    (
        "delete-no-volume-id",
        lambda s: ("DeleteVolume", csi_pb2.DeleteVolumeRequest()),
        Code.INVALID_ARGUMENT,
        "volume_id",
    ),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("build", "code", "names"), [c[1:] for c in MALFORMED], ids=[c[0] for c in MALFORMED]
)
def test_malformed_request_gets_its_code_and_names_the_field(
    shared: Shared, build: Callable[[Shared], tuple[str, Any]], code: grpc.StatusCode, names: str
) -> None:
    method, request = build(shared)
    stub = shared.plugin.controller if method in ("CreateVolume", "DeleteVolume") else shared.plugin.node
    with pytest.raises(grpc.RpcError) as caught:
        getattr(stub, method)(request, timeout=RPC_TIMEOUT)
    error = caught.value
    assert error.code() == code, f"{error.code()}: {error.details()}"
    assert names in (error.details() or ""), error.details()
    assert fuse_mounts(shared.root) == [], "a refused call left a mount"
    if (shared.plugin.state_dir / "state.json").exists():
        assert shared.plugin.staged() == {}


# 8. Controller


@pytest.mark.timeout(90)
def test_controller_create_is_idempotent_and_delete_follows_on_delete(
    plugin: Plugin, dataset: Dataset, raw_s3: s3fs.S3FileSystem, tmp_path: Path
) -> None:
    base = f"{dataset.bucket}/vols"
    params = {"source": f"s3://{base}", "endpointUrl": dataset.endpoint_url}

    def create(name: str, capacity: int, **extra: str) -> csi_pb2.Volume:
        return plugin.controller.CreateVolume(
            csi_pb2.CreateVolumeRequest(
                name=name,
                capacity_range=csi_pb2.CapacityRange(required_bytes=capacity),
                volume_capabilities=[capability()],
                parameters={**params, **extra},
                secrets=dataset.secrets,
            ),
            timeout=RPC_TIMEOUT,
        ).volume

    def delete(volume_id: str) -> None:
        plugin.controller.DeleteVolume(
            csi_pb2.DeleteVolumeRequest(volume_id=volume_id, secrets=dataset.secrets), timeout=RPC_TIMEOUT
        )

    # onDelete: delete, through the whole life of a volume
    doomed = create("pvc-del", 1 << 30, onDelete="delete")
    again = create("pvc-del", 1 << 30, onDelete="delete")
    assert again.volume_id == doomed.volume_id and again.volume_context == doomed.volume_context
    assert doomed.capacity_bytes == 1 << 30
    assert doomed.volume_context["source"] == f"s3://{base}/pvc-del"
    with pytest.raises(grpc.RpcError) as caught:
        create("pvc-del", 2 << 30, onDelete="delete")
    assert caught.value.code() == Code.ALREADY_EXISTS, caught.value.details()
    assert "pvc-del" in caught.value.details()

    staging, target = staging_path(tmp_path, "pvc-del"), target_path(tmp_path, "pod-del")
    plugin.stage(doomed.volume_id, staging, dict(doomed.volume_context), dataset.secrets)
    plugin.publish(doomed.volume_id, staging, target)
    data = os.urandom(MiB + 1)
    (target / "model.ckpt").write_bytes(data)
    (target / "logs").mkdir()
    (target / "logs" / "run.txt").write_bytes(b"epoch 1\n")
    assert sha256(raw_s3.cat(f"{base}/pvc-del/model.ckpt")) == sha256(data)
    plugin.unpublish(doomed.volume_id, target)
    plugin.unstage(doomed.volume_id, staging)
    delete(doomed.volume_id)
    raw_s3.invalidate_cache()
    # SeaweedFS's filer keeps an emptied folder as a prefix; no object may be left in it
    left = raw_s3.find(f"{base}/pvc-del", detail=True)
    assert [k for k, v in left.items() if v["type"] != "directory"] == []
    delete(doomed.volume_id)  # idempotent

    # default: retain
    kept = create("pvc-keep", 0)
    raw_s3.pipe(f"{base}/pvc-keep/x.bin", data)
    delete(kept.volume_id)
    assert sha256(raw_s3.cat(f"{base}/pvc-keep/x.bin")) == sha256(data)
    assert raw_s3.exists(f"{base}/pvc-keep/.pffs-volume.json")

    # ids this driver did not make, or prefixes it did not provision: OK, nothing removed
    raw_s3.pipe(f"{base}/foreign/y.bin", data)
    foreign_id = doomed.volume_id.replace("pvc-del", "foreign")
    assert foreign_id != doomed.volume_id
    delete(foreign_id)
    assert raw_s3.cat(f"{base}/foreign/y.bin") == data
    delete("not-a-pffs-volume")
    delete(doomed.volume_id.replace("pvc-del", "never-created"))
    assert sha256(dataset.files["big.bin"]) == sha256(raw_s3.cat(f"{dataset.bucket}/set/big.bin"))


# 9. The node's cache report


class FakeApiServer(FakeHttpServer):
    """The two Node endpoints the plugin uses, over real HTTP as the API server speaks them: GET a Node, and
    PATCH it with a merge patch (a JSON Patch must be a list). Records every request."""

    TOKEN = "csi-test-token"

    def __init__(self, node_name: str) -> None:
        self.node = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": node_name,
                "labels": {"topology.kubernetes.io/zone": "zone-a", "pffs.io/tor": "tor-7"},
                "annotations": {},
            },
        }
        self.requests: list[tuple[str, str, str, Any]] = []  # method, path, content type, body
        super().__init__(_ApiHandler)

    def annotations(self) -> list[str]:
        """The cache annotation of each accepted PATCH, in order."""
        with self.lock:
            return [
                body["metadata"]["annotations"][CACHE_ANNOTATION]
                for method, _, ctype, body in self.requests
                if method == "PATCH" and ctype.endswith("merge-patch+json")
            ]


class _ApiHandler(JsonHandler):
    api: FakeApiServer

    def _status(self, code: int, reason: str) -> None:
        self._send(
            code, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": reason, "code": code}
        )

    def _handle(self, method: str) -> None:
        body = self._body()
        ctype = self.headers.get("Content-Type", "")
        api = self.api
        with api.lock:
            api.requests.append((method, self.path, ctype, body))
            if self.headers.get("Authorization") != f"Bearer {api.TOKEN}":
                return self._status(401, "Unauthorized")
            name = api.node["metadata"]["name"]
            if self.path.split("?")[0] != f"/api/v1/nodes/{name}":
                return self._status(404, "NotFound")
            if method == "GET":
                return self._send(200, api.node)
            if ctype == "application/json-patch+json" and not isinstance(body, list):
                return self._status(400, "BadRequest")
            if not ctype.endswith("merge-patch+json") or not isinstance(body, dict):
                return self._status(415, "UnsupportedMediaType")
            api.node["metadata"]["annotations"].update(body.get("metadata", {}).get("annotations", {}))
            return self._send(200, api.node)


@pytest.fixture
def apiserver() -> Iterator[FakeApiServer]:
    with FakeApiServer("n1") as api:
        yield api


@pytest.mark.timeout(90)
def test_cache_report_reaches_the_node_annotation_fake_apiserver(
    start_plugin: Callable[..., Plugin], apiserver: FakeApiServer, dataset: Dataset, tmp_path: Path
) -> None:
    kubeconfig = token_kubeconfig(tmp_path / "kubeconfig", apiserver.url, apiserver.TOKEN)
    plugin = start_plugin("--kubeconfig", str(kubeconfig), "--report-interval", "1")
    info = plugin.node.NodeGetInfo(csi_pb2.NodeGetInfoRequest(), timeout=RPC_TIMEOUT)
    assert info.node_id == "n1"
    assert dict(info.accessible_topology.segments) == {
        "topology.pffs.io/node": "n1",
        "topology.pffs.io/zone": "zone-a",  # from the Node's labels
        "topology.pffs.io/tor": "tor-7",
    }

    staging, target = staging_path(tmp_path, "pv-rep"), target_path(tmp_path, "pod-rep")
    plugin.stage("pv-rep", staging, {**dataset.context, "prefetchDirs": "false"}, dataset.secrets)
    plugin.publish("pv-rep", staging, target)
    read = ["big.bin", "small-1.bin"]
    for name in read:
        assert sha256((target / name).read_bytes()) == sha256(dataset.files[name])
    expected_cached = sum(len(dataset.files[n]) for n in read)

    def reported() -> Any:
        for value in reversed(apiserver.annotations()):
            entry = (node_cache({"metadata": {"annotations": {CACHE_ANNOTATION: value}}}) or {}).get(
                dataset.url
            )
            if entry is not None and entry.cached_bytes == expected_cached:
                return entry
        return None

    entry = wait_for("the cache report with what was read", reported, 20, interval_s=0.2)
    assert entry.total_bytes == dataset.size
    with apiserver.lock:
        patches = [(path, ctype) for method, path, ctype, _ in apiserver.requests if method == "PATCH"]
    assert {path for path, _ in patches} == {"/api/v1/nodes/n1"}
    report = json.loads(apiserver.annotations()[-1])
    assert report["capacity_bytes"] == 1 << 30
    assert report["used_bytes"] >= expected_cached
    assert plugin.metric("pffs_csi_cache_report_failures_total") == 0


@pytest.mark.timeout(90)
def test_unreachable_api_server_never_holds_csi_calls_and_is_logged_once(
    start_plugin: Callable[..., Plugin], dataset: Dataset, tmp_path: Path
) -> None:
    closed = free_ports(1)[0]  # nothing listens there
    kubeconfig = token_kubeconfig(tmp_path / "kubeconfig", f"http://127.0.0.1:{closed}", "t")
    started = time.monotonic()
    plugin = start_plugin("--kubeconfig", str(kubeconfig), "--report-interval", "1")
    assert time.monotonic() - started < 15, "startup waited on the API server"

    staging, target = staging_path(tmp_path, "pv-down"), target_path(tmp_path, "pod-down")
    for call in (
        lambda: plugin.stage("pv-down", staging, dataset.context, dataset.secrets),
        lambda: plugin.publish("pv-down", staging, target),
        lambda: plugin.node.NodeGetInfo(csi_pb2.NodeGetInfoRequest(), timeout=RPC_TIMEOUT),
    ):
        t0 = time.monotonic()
        call()
        assert time.monotonic() - t0 < 5
    assert_exact(target, dataset)
    wait_for(
        "two failed reports", lambda: plugin.metric("pffs_csi_cache_report_failures_total") >= 2, 30, 0.2
    )
    t0 = time.monotonic()
    plugin.node.NodeGetVolumeStats(
        csi_pb2.NodeGetVolumeStatsRequest(volume_id="pv-down", volume_path=str(target)), timeout=RPC_TIMEOUT
    )
    assert time.monotonic() - t0 < 2
    failures = [line for line in plugin.log().splitlines() if "cache report: could not write it" in line]
    assert len(failures) == 1, failures


def test_an_unchanged_cache_report_is_written_again_each_heartbeat(monkeypatch: pytest.MonkeyPatch) -> None:
    """The report's `updated_at` is the plugin's heartbeat (readers ignore a report older than
    REPORT_MAX_AGE_S): an unchanged report is not written each round, but again once a heartbeat passed."""
    from pffs.csi import cache_report
    from pffs.csi.metrics import PluginMetrics
    from pffs.scheduler.kube.locality import REPORT_HEARTBEAT_S, REPORT_MAX_AGE_S

    assert REPORT_MAX_AGE_S >= 3 * REPORT_HEARTBEAT_S  # a reader forgives two missed heartbeats
    report = {"datasets": {"s3://b/ds": {"cached_bytes": 1, "total_bytes": 2}}, "capacity_bytes": 9}
    monkeypatch.setattr(cache_report, "build_report", lambda manager: report)
    written: list[str] = []
    reporter = cache_report.CacheReporter(
        None, written.append, PluginMetrics(), interval_s=0.01, where="a test", heartbeat_s=0.3
    )  # type: ignore[arg-type]
    reporter.report_once()
    reporter.report_once()
    assert len(written) == 1  # unchanged within the heartbeat: not written again
    wait_for("the heartbeat", lambda: reporter.report_once() is not None and len(written) == 2, 10, 0.05)
    first, second = (json.loads(w) for w in written)
    assert first["datasets"] == second["datasets"] == report["datasets"]
    assert node_cache({"metadata": {"annotations": {CACHE_ANNOTATION: written[-1]}}}) == node_cache(
        {"metadata": {"annotations": {CACHE_ANNOTATION: json.dumps(report)}}}
    )


@pytest.mark.timeout(120)
def test_metrics_say_which_pv_or_pod_each_mounts_volume_label_is(
    start_plugin: Callable[..., Plugin], dataset: Dataset, tmp_path: Path
) -> None:
    """A mount's series carry `volume` (the CSI volume id: `csi-<sha256>` for an inline volume); the node
    plugin's info series name it: the PV and the source per mount, the pods using it (namespace/name and
    their volume's name for inline volumes). Joined on `volume` as a PromQL `group_left` would."""
    first, last = free_ports(2)
    plugin = start_plugin("--mount-metrics-ports", f"{min(first, last)}-{max(first, last)}")
    pod = {
        "csi.storage.k8s.io/pod.name": "trainer-0",
        "csi.storage.k8s.io/pod.namespace": "team-b",
        "csi.storage.k8s.io/pod.uid": "uid-trainer-0",
    }
    staging = staging_path(tmp_path, "9f86d081884c7d65")  # the kubelet names it by a hash of the handle
    plugin.stage("imagenet-handle", staging, dataset.context, dataset.secrets)
    pv_target = target_path(tmp_path, "uid-trainer-0", "pv-imagenet")
    plugin.publish("imagenet-handle", staging, pv_target, volume_context={**dataset.context, **pod})
    inline = [target_path(tmp_path, f"uid-p{i}", "data") for i in (1, 2)]
    plugin.publish_inline("csi-5d41402abc4b2a76", inline[0], dataset.context, dataset.secrets, "p1")
    plugin.publish_inline("csi-7d793037a0760186", inline[1], dataset.context, dataset.secrets, "p2")
    for target in (pv_target, *inline):
        assert_exact(target, dataset)

    def samples(name: str) -> list[dict[str, str]]:
        text = urllib.request.urlopen(f"http://127.0.0.1:{plugin.metrics_port}/metrics", timeout=5).read()
        return [
            s.labels
            for family in text_string_to_metric_families(text.decode())
            for s in family.samples
            if s.name == name
        ]

    info = {s["volume"]: s for s in samples("pffs_csi_volume_info")}
    mounts = wait_for(
        "both mounts' series", lambda: {s["volume"] for s in samples("pffs_open_files")} or None, 20
    )
    assert (
        mounts == set(info) == {"imagenet-handle", "csi-5d41402abc4b2a76"}
    )  # the shared mount: its first pod's
    assert info["imagenet-handle"] == {
        "volume": "imagenet-handle",
        "persistentvolume": "pv-imagenet",
        "source": dataset.url,
        "read_only": "false",
    }
    assert info["csi-5d41402abc4b2a76"]["persistentvolume"] == ""
    pods = sorted(
        (s["volume"], s["pod_namespace"], s["pod_name"], s["pod_volume"], s["persistentvolume"])
        for s in samples("pffs_csi_volume_pod_info")
    )
    assert pods == [
        ("csi-5d41402abc4b2a76", "team-a", "p1", "data", ""),
        ("csi-5d41402abc4b2a76", "team-a", "p2", "data", ""),
        ("imagenet-handle", "team-b", "trainer-0", "", "pv-imagenet"),
    ]
    # Each mount's share of the mounter's one memory limit, by the same `volume` label.
    memory = {s["volume"]: s for s in samples("pffs_csi_mount_memory_bytes")}
    assert set(memory) == set(info)
    text = (
        urllib.request.urlopen(f"http://127.0.0.1:{plugin.metrics_port}/metrics", timeout=5).read().decode()
    )
    rss = {
        s.labels["volume"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "pffs_csi_mount_memory_bytes"
    }
    assert all(20 << 20 < value < 2 << 30 for value in rss.values()), rss
    plugin.unpublish("csi-5d41402abc4b2a76", inline[0])
    plugin.unpublish("csi-7d793037a0760186", inline[1])
    assert {s["volume"] for s in samples("pffs_csi_volume_info")} == {"imagenet-handle"}
    assert [s["pod_name"] for s in samples("pffs_csi_volume_pod_info")] == ["trainer-0"]


# Races and odd paths (each of these found a bug; see the messages)


def retry_aborted(call: Callable[..., Any], *args: Any, timeout_s: float = 20) -> Any:
    """As the kubelet does: ABORTED (another operation on the volume is in progress) is retried."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return call(*args)
        except grpc.RpcError as exc:
            if exc.code() != Code.ABORTED or time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def log_count(plugin: Plugin, text: str) -> int:
    return plugin.log().count(text)


def _not_aborted(call: Callable[[], Any]) -> bool:
    try:
        call()
    except grpc.RpcError as exc:
        if exc.code() != grpc.StatusCode.ABORTED:
            raise
        return False
    return True


@pytest.mark.timeout(90)
def test_publish_onto_a_dead_mount_repairs_it_once_not_twice(
    start_plugin: Callable[..., Plugin], dataset: Dataset, tmp_path: Path
) -> None:
    """NodePublishVolume finds the mount dead and repairs it while the supervisor (every 50 ms here) does
    too: there must still be one mount process and one FUSE mount at the staging path."""
    plugin = start_plugin("--check-interval", "0.05")
    staging = staging_path(tmp_path, "pv-race")
    plugin.stage("pv-race", staging, dataset.context, dataset.secrets)
    for i in range(2):
        old = plugin.staged()[str(staging)]["pid"]
        os.kill(old, signal.SIGKILL)
        target = target_path(tmp_path, f"pod-{i}")
        # ABORTED ("in progress; retry") while the supervisor holds the lock: retried, as the kubelet does
        wait_for(
            "NodePublishVolume done",
            lambda target=target: _not_aborted(lambda: plugin.publish("pv-race", staging, target)),
            10,
        )

        def one_mount() -> bool:
            pid = plugin.staged()[str(staging)]["pid"]
            at_staging = [m for m in fuse_mounts(tmp_path) if m.path == str(staging)]
            return mount_processes(plugin) == {pid} and len(at_staging) == 1

        try:
            wait_for("one mount process and one mount at the staging path", one_mount, 10)
        except AssertionError:
            pytest.fail(
                f"round {i}: mount processes {sorted(mount_processes(plugin))} (recorded: "
                f"{plugin.staged()[str(staging)]['pid']}), FUSE mounts at the staging path: "
                f"{len([m for m in fuse_mounts(tmp_path) if m.path == str(staging)])}; repairs started "
                f"{log_count(plugin, 'mounting it again')}: NodePublishVolume repaired the dead mount "
                "without the staging path's lock, concurrently with the supervisor"
            )
        deadline = time.monotonic() + 1.0  # and it stays so for 20 supervisor rounds
        while time.monotonic() < deadline:
            assert one_mount()
            time.sleep(0.05)
        assert_exact(target, dataset)
    for i in range(2):
        plugin.unpublish("pv-race", tmp_path / "kubelet" / "pods" / f"pod-{i}" / "volumes" / "vol" / "mount")
    plugin.unstage("pv-race", staging)
    assert wait_for("no mount process left", lambda: not mount_processes(plugin), 10)


@pytest.mark.timeout(90)
def test_last_inline_unpublish_does_not_race_the_supervisor(
    start_plugin: Callable[..., Plugin], dataset: Dataset, tmp_path: Path
) -> None:
    """The last pod's NodeUnpublishVolume stops the shared inline mount; the supervisor (every 50 ms here)
    must not take the stopping mount for a dead one and start it again meanwhile."""
    plugin = start_plugin("--check-interval", "0.05")
    for i in range(3):
        target = target_path(tmp_path, f"p{i}", "data")
        retry_aborted(
            plugin.publish_inline, f"csi-{i:08d}", target, dataset.context, dataset.secrets, f"p{i}"
        )
        assert_exact(target, dataset)
        plugin.unpublish(f"csi-{i:08d}", target)
        assert plugin.staged() == {}
    assert wait_for("no mount process left", lambda: not mount_processes(plugin), 10)
    assert mounts_under(tmp_path) == []
    repairs = [line for line in plugin.log().splitlines() if "mounting it again" in line]
    assert repairs == [], "the supervisor repaired an inline mount that its last unpublish was stopping"
    assert plugin.metric("pffs_csi_recovery_failures_total") == 0


@pytest.mark.timeout(90)
def test_a_repair_that_fails_is_logged_with_its_reason(
    plugin: Plugin, dataset: Dataset, raw_s3: s3fs.S3FileSystem, tmp_path: Path
) -> None:
    """The source is gone (bucket deleted) when the mount dies: every repair fails. The operator must find
    why in the plugin's log, and the volume reports INACCESSIBLE."""
    staging = staging_path(tmp_path, "pv-gone")
    target = target_path(tmp_path, "pod-gone")
    plugin.stage("pv-gone", staging, dataset.context, dataset.secrets)
    plugin.publish("pv-gone", staging, target)
    assert_exact(target, dataset)
    raw_s3.rm(dataset.bucket, recursive=True)
    os.kill(plugin.staged()[str(staging)]["pid"], signal.SIGKILL)
    wait_for("a failed repair", lambda: plugin.metric("pffs_csi_recovery_failures_total") >= 1, 15, 0.1)
    health = plugin.node.NodeGetVolumeHealth(
        csi_pb2.NodeGetVolumeHealthRequest(volume_id="pv-gone", volume_publish_path=str(target)),
        timeout=RPC_TIMEOUT,
    )
    assert [s.status for s in health.volume_health.health_statuses] == [csi_pb2.INACCESSIBLE]
    try:
        wait_for(
            "the reason of the failed repair in the plugin's log",
            lambda: f"could not repair the mount at {staging}" in plugin.log(),
            5,
            0.1,
        )
    except AssertionError:
        tail = "\n".join(plugin.log().splitlines()[-6:])
        pytest.fail(f"no line says why the remount failed; the log ends:\n{tail}")


@pytest.mark.timeout(60)
def test_paths_with_spaces_and_non_ascii_letters_stay_mounted(
    plugin: Plugin, dataset: Dataset, tmp_path: Path
) -> None:
    """/proc/self/mountinfo writes a space as \\040 and a non-ASCII letter as its UTF-8 bytes: a path with
    both must still be recognized as mounted, or the supervisor remounts a healthy volume every round."""
    staging = tmp_path / "kubelet" / "pv" / "données brutes" / "globalmount"
    staging.mkdir(parents=True)
    target = tmp_path / "kubelet" / "pods" / "pod é 1" / "vol" / "mount"
    target.parent.mkdir(parents=True)
    plugin.stage("pv-utf8", staging, dataset.context, dataset.secrets)
    plugin.publish("pv-utf8", staging, target)
    assert_exact(target, dataset)
    pid = plugin.staged()[str(staging)]["pid"]
    deadline = time.monotonic() + 3.0  # three supervisor rounds
    while time.monotonic() < deadline:
        now = plugin.staged()[str(staging)]["pid"]
        assert now == pid, (
            f"the healthy mount (pid {pid}) was mounted again (pid {now}): the plugin does not see the "
            "path in /proc/self/mountinfo; repairs so far: "
            f"{plugin.log().count('mounting it again')}"
        )
        time.sleep(0.1)
    assert plugin.metric("pffs_csi_recoveries_total") == 0
    plugin.node.NodeGetVolumeStats(
        csi_pb2.NodeGetVolumeStatsRequest(volume_id="pv-utf8", volume_path=str(target)), timeout=RPC_TIMEOUT
    )
    assert_exact(target, dataset)


@pytest.mark.timeout(60)
def test_unstage_after_the_state_file_was_lost_stops_the_mount_and_forgets_its_credentials(
    plugin: Plugin, dataset: Dataset, tmp_path: Path
) -> None:
    """A plugin that finds its state file unreadable starts empty; the kubelet's unpublish and unstage must
    still leave nothing mounted, no mount process, and no credentials file behind."""
    staging, target = staging_path(tmp_path, "pv-lost"), target_path(tmp_path, "pod-lost")
    plugin.stage("pv-lost", staging, dataset.context, dataset.secrets)
    plugin.publish("pv-lost", staging, target)
    pid = plugin.staged()[str(staging)]["pid"]
    plugin.kill()
    (plugin.state_dir / "state.json").write_text("{not json")

    plugin.start()
    assert (plugin.state_dir / "state.broken").exists()
    assert_exact(target, dataset)  # the mount still serves
    plugin.unpublish("pv-lost", target)
    plugin.unstage("pv-lost", staging)
    assert wait_gone({pid}, 10) == set()
    assert mounts_under(tmp_path) == []
    left = list((plugin.state_dir / "secrets").iterdir())
    assert left == [], f"credentials of an unstaged volume kept on disk: {left}"


# 8. A kubelet dir that is not the kubelet's


def test_the_kubelet_is_found_by_its_sockets_and_a_wrong_path_is_named(tmp_path: Path) -> None:
    from pffs.csi.kubelet import kubelet_answers, kubelet_problem, kubelet_process_roots

    real = tmp_path / ("a-kubelet-root-whose-path-is-longer-than-a-unix-socket-address-may-be" * 2)
    with FakeKubelet(real):
        assert len(os.fsencode(real / "pod-resources/kubelet.sock")) > 108
        assert kubelet_answers(real) and kubelet_problem(real) is None
    assert not kubelet_answers(real), "a socket file nobody listens on is no kubelet"
    # The host's unix sockets (pid 1's network namespace), as the plugin reads them with hostPID.
    proc = tmp_path / "proc"
    (proc / "1" / "net").mkdir(parents=True)
    (proc / "1" / "net" / "unix").write_text(
        "Num       RefCount Protocol Flags    Type St Inode Path\n"
        # bound as a temporary name, then renamed to kubelet.sock (cri-client's CreateListener)
        "0000000000000000: 00000002 00000000 00010000 0001 01 1001 /srv/kubelet/pod-resources/2071845\n"
        "0000000000000000: 00000003 00000000 00000000 0001 03 1002 /old/kubelet/pod-resources/kubelet.sock\n"
    )
    problem = kubelet_problem(tmp_path / "wrong", proc=proc)
    assert problem is not None
    assert f"node.kubeletPath is {tmp_path / 'wrong'}" in problem
    assert "the kubelet on this node uses /srv/kubelet" in problem and "/old/kubelet" not in problem
    # Without a listening socket to go by: a kubelet process's --root-dir, or its default.
    (proc / "1" / "net" / "unix").write_text("Num       RefCount Protocol Flags    Type St Inode Path\n")
    for pid, argv in (("7", b"/usr/bin/kubelet\0--root-dir=/data/kubelet\0"), ("8", b"bash\0kubelet\0")):
        (proc / pid).mkdir()
        (proc / pid / "cmdline").write_bytes(argv)
    assert kubelet_process_roots(proc) == ["/data/kubelet"]
    assert "uses /data/kubelet (its --root-dir)" in str(kubelet_problem("/x", proc))


@contextlib.contextmanager
def shared_mount(path: Path) -> Iterator[Path]:
    """`path` as a shared mount of itself, as the kubelet makes its root dir (mounts the plugin makes under
    it reach the host: the plugin's --kubelet-dir check)."""
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "--bind", str(path), str(path)], check=True)
    try:
        subprocess.run(["mount", "--make-shared", str(path)], check=True)
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.mark.timeout(120)
def test_a_plugin_that_cannot_find_its_kubelet_is_unready_and_touches_no_mount_until_it_does(
    start_plugin: Callable[..., Plugin], dataset: Dataset, tmp_path: Path
) -> None:
    """A restarted plugin whose --kubelet-dir has no kubelet (node.kubeletPath wrong, or the kubelet not up
    yet) sees its records' mounts through the wrong window: it must not adopt, repair, move or stop any of
    them, must say why in its readiness, and must take them up once the kubelet answers there."""
    kubelet = tmp_path / "kubelet"
    ready_file = tmp_path / "ready"
    with shared_mount(kubelet), FakeKubelet(kubelet) as fake:
        args = ("--kubelet-dir", str(kubelet), "--ready-file", str(ready_file), "--check-interval", "0.1")
        plugin = start_plugin(*args)
        wait_for("the plugin ready", lambda: ready_file.read_text() == "ok\n", 10)
        staging = staging_path(tmp_path, "pv-a")
        plugin.stage("pv-a", staging, dataset.context, dataset.secrets)
        plugin.publish("pv-a", staging, target_path(tmp_path, "pod-a"))
        plugin.publish_inline(
            "inline-b", target_path(tmp_path, "pod-b"), dataset.context, dataset.secrets, "b"
        )
        before = plugin.staged()
        inline_path = next(path for path in before if path != str(staging))
        assert inline_path.startswith(str(kubelet) + "/")
        plugin.kill()

        fake.__exit__()  # the kubelet's sockets stop answering
        os.kill(before[str(staging)]["pid"], signal.SIGKILL)  # a mount a working plugin would repair
        assert wait_gone({before[str(staging)]["pid"]}, 5) == set()
        plugin.start()  # (it answers on its socket just before it writes its readiness: wait for that)
        wait_for("the plugin unready", lambda: ready_file.read_text() != "ok\n", 10)
        text = ready_file.read_text()
        assert f"node.kubeletPath is {kubelet}, but no kubelet serves there" in text, text
        assert "stays unready" in text
        assert plugin.staged() == before, "records moved or changed without a kubelet"
        assert is_alive(before[inline_path]["pid"])
        assert "mounting it again" not in plugin.log() and "adopted the running mount" not in plugin.log()

        fake.__enter__()  # the kubelet answers: the plugin takes its mounts up
        wait_for("the plugin ready", lambda: ready_file.read_text() == "ok\n", 10)
        wait_for(
            "the dead mount repaired",
            lambda: plugin.staged()[str(staging)]["pid"] != before[str(staging)]["pid"],
            RECOVERY_DEADLINE_S,
        )
        assert plugin.staged()[inline_path]["pid"] == before[inline_path]["pid"], "a healthy mount replaced"
        assert_exact(target_path_of(tmp_path, "pod-a"), dataset)
        assert_exact(target_path_of(tmp_path, "pod-b"), dataset)
        plugin.unpublish("pv-a", target_path_of(tmp_path, "pod-a"))
        plugin.unstage("pv-a", staging)
        plugin.unpublish("inline-b", target_path_of(tmp_path, "pod-b"))
        plugin.stop()
        plugin.clean_up()


def target_path_of(root: Path, pod: str, name: str = "vol") -> Path:
    return root / "kubelet" / "pods" / pod / "volumes" / name / "mount"


def test_a_mount_is_judged_in_its_own_process_mount_namespace() -> None:
    from pffs.csi.mounts import mounted_in_namespace_of

    assert mounted_in_namespace_of(os.getpid(), "/proc")
    assert not mounted_in_namespace_of(os.getpid(), "/proc/self/no-mount-here")
    assert mounted_in_namespace_of(2**22 + 1, "/anything"), "unknown: never a reason to stop a mount"


def test_stale_if_error_from_the_volume_reaches_its_mount(tmp_path: Path) -> None:
    from pffs.config import CacheSettings
    from pffs.csi.attributes import Credentials, cache_settings, mount_options, parse_attributes

    def options(context: dict[str, str]) -> float:
        attributes = parse_attributes({"source": "s3://bucket/set", **context}, "volume attributes")
        cache = cache_settings(attributes, CacheSettings(cache_dir=tmp_path), tmp_path)
        built = mount_options(attributes, Credentials(), tmp_path / "m", cache, False, tmp_path / "log", 0)
        return built.cache.stale_if_error

    assert options({"staleIfError": "0"}) == 0  # an outage fails reads at once, as asked
    assert options({"staleIfError": "3600"}) == 3600
    assert options({}) == CacheSettings().stale_if_error  # the mount's own default: a day
