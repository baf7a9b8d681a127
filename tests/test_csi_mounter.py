"""The node plugin with `pffs csi-mounter`, on this machine without Kubernetes: the mounts run in the mounter
and outlive the plugin, a pod's view of its volume (its own mount namespace holding a slave copy of the
target, as runc makes for `mountPropagation: HostToContainer`) sees the volume read-only from the first
publish, and a mount that died with its mounter is replaced by one the pod sees without a restart (one pffs
mount per target while the mounter lives). Byte-exact against the S3 server throughout.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import s3fs
from helpers import poll, sha256

from pffs.csi import csi_pb2
from pffs.csi.mounts import mount_stack, unmount_all
from pffs.processes import is_alive
from pffs.testing.csi_plugin import CsiPlugin, FakeKubelet
from pffs.testing.s3_server import SeaweedS3, free_ports

pytestmark = [
    pytest.mark.s3,
    pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="needs /dev/fuse (FUSE) on this machine"),
    pytest.mark.skipif(os.geteuid() != 0, reason="the node plugin mounts and bind-mounts: needs root"),
]

AccessMode = csi_pb2.VolumeCapability.AccessMode
SIZE = 5 << 20

# A pod's container, as runc makes it: a mount namespace of its own, the target bound recursively at /data
# (here: `view`) and made a slave, so mounts made on the host on top of the target reach it. Prints one
# JSON line of running totals per pass (a descriptor held open, and one opened anew, each checked).
POD = r"""
import ctypes, errno, hashlib, json, os, sys, time
target, view, expected = sys.argv[1:4]
libc = ctypes.CDLL(None, use_errno=True)
MS_BIND, MS_REC, MS_SLAVE = 4096, 16384, 1 << 19
assert libc.unshare(0x00020000) == 0  # CLONE_NEWNS
assert libc.mount(None, b"/", None, MS_REC | MS_SLAVE, None) == 0
assert libc.mount(target.encode(), view.encode(), None, MS_BIND | MS_REC, None) == 0
assert libc.mount(None, view.encode(), None, MS_REC | MS_SLAVE, None) == 0
path = os.path.join(view, "file.bin")
held = os.open(path, os.O_RDONLY)
stats = {"held_ok": 0, "held_fail": 0, "reopen_ok": 0, "reopen_fail": 0, "writes_ok": 0, "write_errors": {}}

def whole(fd):
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    digest, offset = hashlib.sha256(), 0
    while chunk := os.pread(fd, 1 << 20, offset):
        digest.update(chunk)
        offset += len(chunk)
    if digest.hexdigest() != expected:
        raise ValueError("wrong bytes")

def reopened():
    fd = os.open(path, os.O_RDONLY)
    try:
        whole(fd)
    finally:
        os.close(fd)

while True:
    for kind, read in (("held", lambda: whole(held)), ("reopen", reopened)):
        try:
            read()
            stats[kind + "_ok"] += 1
        except Exception as exc:
            stats[kind + "_fail"] += 1
            stats["last_error"] = f"{kind}: {exc!r}"
    try:
        with open(os.path.join(view, ".probe"), "w") as probe:
            probe.write("x")
        stats["writes_ok"] += 1
    except OSError as exc:
        code = errno.errorcode.get(exc.errno, str(exc.errno))
        stats["write_errors"][code] = stats["write_errors"].get(code, 0) + 1
    print(json.dumps(stats), flush=True)
    time.sleep(0.05)
"""


class Pod:
    def __init__(self, root: Path, target: str, expected: str) -> None:
        self.view = root / "view"
        self.view.mkdir()
        self.output = root / "pod.out"
        with open(self.output, "wb") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-c", POD, target, str(self.view), expected], stdout=out, stderr=out
            )

    def report(self) -> dict[str, object]:
        lines = self.output.read_text(errors="replace").splitlines()
        for line in reversed(lines):
            with contextlib.suppress(ValueError):
                report = json.loads(line)
                assert isinstance(report, dict)
                return report
        return {"output": "\n".join(lines[-5:])}

    def passes_after(self, kind: str, count: int) -> bool:
        report = self.report()
        assert self.process.poll() is None, report
        return int(report.get(kind + "_ok", 0)) > count  # type: ignore[call-overload]

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Path]:
    """A kubelet dir as the kubelet makes it: a shared mount (what the plugin's check asks of it)."""
    kubelet = tmp_path / "kubelet"
    kubelet.mkdir()
    subprocess.run(["mount", "--bind", str(kubelet), str(kubelet)], check=True)
    subprocess.run(["mount", "--make-shared", str(kubelet)], check=True)
    try:
        with FakeKubelet(kubelet):  # a kubelet serves there: the plugin takes the node's mounts up
            yield kubelet
    finally:
        for line in reversed(Path("/proc/self/mountinfo").read_text().splitlines()):
            point = line.split()[4]
            if point.startswith(str(kubelet) + "/"):
                unmount_all(point)
        unmount_all(str(kubelet))


class Mounter:
    def __init__(self, socket: Path, log: Path) -> None:
        self.socket, self.log = socket, log
        self.metrics_port = free_ports(1)[0]
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, *prefix: str) -> None:
        """`prefix`: a command to run it under (unshare, for a mount namespace of its own)."""
        command = [
            *prefix,
            sys.executable,
            "-m",
            "pffs.cli.main",
            "csi-mounter",
            "--socket",
            str(self.socket),
        ]
        command += ["--metrics-port", str(self.metrics_port), "--mount-metrics-ports", "29820-29899", "-v"]
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=log)
        poll("the mounter listens", self.socket.exists, 30, self.text)

    def text(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def metrics(self) -> str:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as answer:
            return str(answer.read().decode())

    def kill(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()


def test_mounts_run_in_the_mounter_outlive_the_plugin_and_are_swapped_under_a_pod_when_the_mounter_dies(
    node: Path, s3_server: SeaweedS3, raw_s3: s3fs.S3FileSystem, bucket: str, tmp_path: Path
) -> None:
    payload = os.urandom(SIZE)
    raw_s3.pipe(f"{bucket}/set/file.bin", payload)
    short = Path(tempfile.mkdtemp(prefix="pffs-mounter-", dir="/run"))  # unix socket paths are short
    mounter = Mounter(short / "mounter.sock", tmp_path / "mounter.log")
    mounter.start()
    plugin = CsiPlugin(
        short,
        "--mounter",
        f"unix://{mounter.socket}",
        "--kubelet-dir",
        str(node),
        "--cache-size",
        "1G",
        metrics=True,
    )
    pod: Pod | None = None
    try:
        plugin.start()
        staging = node / "plugins/kubernetes.io/csi/pffs/vol/globalmount"
        target = node / "pods/uid-1/volumes/kubernetes.io~csi/vol/mount"
        capability = csi_pb2.VolumeCapability(
            mount=csi_pb2.VolumeCapability.MountVolume(),
            access_mode=AccessMode(mode=AccessMode.MULTI_NODE_READER_ONLY),
        )
        context = {"source": f"s3://{bucket}/set", "endpointUrl": s3_server.endpoint_url}
        secrets = {"accessKeyId": s3_server.access_key, "secretAccessKey": s3_server.secret_key}
        plugin.node.NodeStageVolume(
            csi_pb2.NodeStageVolumeRequest(
                volume_id="vol",
                staging_target_path=str(staging),
                volume_capability=capability,
                volume_context=context,
                secrets=secrets,
            ),
            timeout=60,
        )
        plugin.node.NodePublishVolume(
            csi_pb2.NodePublishVolumeRequest(
                volume_id="vol",
                staging_target_path=str(staging),
                target_path=str(target),
                volume_capability=capability,
                volume_context=context,
                readonly=True,
            ),
            timeout=60,
        )
        first_pid = plugin.staged()[str(staging)]["pid"]
        assert len(mount_stack(str(target))) == 1 and mount_stack(str(target))[0].startswith("fuse")
        pod = Pod(tmp_path, str(target), sha256(payload))
        poll("the pod reads its file", lambda: pod.passes_after("reopen", 2), 30, pod.output.read_text)

        # The plugin dies (as its container does in a rollout) and comes back: the mount never stops.
        plugin.kill()
        count = int(pod.report()["reopen_ok"])  # type: ignore[call-overload]
        plugin.start()
        poll("the pod reads on", lambda: pod.passes_after("reopen", count + 5), 30, pod.output.read_text)
        report = pod.report()
        assert report["held_fail"] == 0 and report["reopen_fail"] == 0, report
        assert plugin.staged()[str(staging)]["pid"] == first_pid
        assert report["writes_ok"] == 0 and set(report["write_errors"]) == {"EROFS"}, report  # type: ignore[arg-type]

        # Every mount's metrics through the mounter's one endpoint, labelled with its volume; its log lines
        # on the mounter's own output, the volume named.
        metrics = mounter.metrics()
        assert 'pffs_cache_bytes_fetched_total{volume="vol"}' in metrics, metrics[-2000:]
        assert "pffs_csi_mounter_mounts 1.0" in metrics
        poll(
            "the mount's log reaches the mounter's output", lambda: "mount[volume=vol]" in mounter.text(), 10
        )
        with urllib.request.urlopen(f"http://127.0.0.1:{plugin.metrics_port}/healthz", timeout=5) as answer:
            assert answer.status == 200

        # The mounter dies with its mounts (its pod replaced): the plugin mounts the volume again through
        # the next mounter and swaps the dead mount on the pod's target for the live one.
        mounter.kill()
        os.kill(first_pid, 9)
        poll("the mount process is gone", lambda: not is_alive(first_pid), 10)
        mounter.start()
        count = int(pod.report()["reopen_ok"])  # type: ignore[call-overload]
        poll(
            "the pod reads again through the new mount",
            lambda: pod.passes_after("reopen", count + 5),
            60,
            lambda: plugin.log() + mounter.text(),
        )
        assert plugin.staged()[str(staging)]["pid"] != first_pid
        # The dead mount stays under the live one: the only place a running pod's copy of the target can
        # receive a mount (volumes.py, _mount_again).
        stack = mount_stack(str(target))
        assert len(stack) == 2 and all(fs.startswith("fuse") for fs in stack), stack
        before = dict(pod.report()["write_errors"])  # type: ignore[call-overload]
        poll(
            "writes fail again as read-only",
            lambda: pod.report()["write_errors"]["EROFS"] > before["EROFS"],
            10,
        )
        assert pod.report()["writes_ok"] == 0
        assert not [key for key in raw_s3.find(bucket) if ".probe" in key]
    finally:
        if pod is not None:
            pod.stop()
        plugin.stop()
        mounter.kill()
        plugin.clean_up()
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            if str(short) in line.split()[4]:
                unmount_all(line.split()[4])
        subprocess.run(["rm", "-rf", str(short)], check=False)


def test_a_path_the_host_would_not_see_fails_with_failed_precondition_naming_the_setting(
    tmp_path: Path,
) -> None:
    """The plugin's kubelet dir not shared with the host (or a path outside it): NodeStageVolume and
    NodePublishVolume refuse, naming node.kubeletPath, instead of mounting where no pod would see it."""
    import grpc

    kubelet = tmp_path / "kubelet"  # a plain folder: not a mount shared with the host
    kubelet.mkdir()
    short = Path(tempfile.mkdtemp(prefix="pffs-precondition-", dir="/run"))
    fake_kubelet = FakeKubelet(kubelet).__enter__()
    capability = csi_pb2.VolumeCapability(
        mount=csi_pb2.VolumeCapability.MountVolume(),
        access_mode=AccessMode(mode=AccessMode.MULTI_NODE_READER_ONLY),
    )
    try:
        with CsiPlugin(
            short, "--kubelet-dir", str(kubelet), "--mounter", f"unix://{short}/none.sock"
        ) as plugin:
            for staging, words in (
                (kubelet / "plugins/kubernetes.io/csi/pffs/v/globalmount", "not on a mount"),
                (tmp_path / "elsewhere/globalmount", "outside the plugin's --kubelet-dir"),
            ):
                with pytest.raises(grpc.RpcError) as caught:
                    plugin.node.NodeStageVolume(
                        csi_pb2.NodeStageVolumeRequest(
                            volume_id="v",
                            staging_target_path=str(staging),
                            volume_capability=capability,
                            volume_context={"source": "s3://bucket/set"},
                        ),
                        timeout=30,
                    )
                assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                assert words in caught.value.details() and "node.kubeletPath" in caught.value.details()
                assert not staging.exists() or not os.listdir(staging)
    finally:
        fake_kubelet.__exit__()
        subprocess.run(["rm", "-rf", str(short)], check=False)


def test_a_credentials_error_names_the_volumes_secret_and_its_keys() -> None:
    from pffs.csi.rpc import with_secret_hint

    shell = (
        "s3://b/p: access denied (Forbidden); check the credentials (AWS_ACCESS_KEY_ID/"
        "AWS_SECRET_ACCESS_KEY, AWS_PROFILE or the credentials file) and the bucket policy"
    )
    hinted = with_secret_hint(shell)
    assert "AWS_" not in hinted and hinted.startswith(
        "s3://b/p: access denied (Forbidden); check the volume's Secret"
    )
    assert "accessKeyId" in hinted and "secretAccessKey" in hinted and "nodeStageSecretRef" in hinted
    missing = (
        "s3://b/p: no usable S3 credentials (x): set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE"
    )
    assert "AWS_" not in with_secret_hint(missing + " or a credentials file; --anonymous for a public bucket")
    assert with_secret_hint("s3://b/p: no such file or object") == "s3://b/p: no such file or object"


def test_mounts_started_at_once_never_share_a_metrics_port_nor_take_one_in_use() -> None:
    """Two volumes staged 150 ms apart once got one port (the second mount then failed to start): the
    runner reserves each port until its mount runs, and skips ports another process holds."""
    import socket

    from pffs.csi.mount_runner import MountRunner

    first = free_ports(1)[0]
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", first + 1))  # someone else's
        runner = MountRunner((first, first + 4))
        try:
            reserved = [runner._reserve_port() for _ in range(4)]
        finally:
            runner.close()
    given = [port for port in reserved if port is not None]
    assert len(given) >= 3 and len(set(given)) == len(given), reserved  # distinct, each held till started
    assert first + 1 not in given and all(first <= port <= first + 4 for port in given)


def test_a_mounter_older_than_the_plugin_names_the_option_it_lacks_and_what_to_do(tmp_path: Path) -> None:
    """The mounter is updated only when its pod is deleted, so it may run older code than the plugin: an
    option it does not know is refused with that said (FAILED_PRECONDITION at the plugin), and options the
    volume leaves at their defaults are not sent at all, so a newer plugin's new fields cost nothing."""
    from pffs.csi.mounter import MounterClient
    from pffs.fuse.launch import options_with_credentials
    from pffs.fuse.options import MountOptions

    short = Path(tempfile.mkdtemp(prefix="pffs-skew-", dir="/run"))
    mounter = Mounter(short / "mounter.sock", tmp_path / "mounter.log")
    mounter.start()
    try:
        client = MounterClient(mounter.socket)
        assert client.ping()
        options = {"mountpoint": str(tmp_path / "m"), "source": "s3://bucket/prefix", "brand_new_option": 1}
        answer = client._call({"op": "start", "volume": "v", "options": options}, 30)
        assert answer.get("too_old") is True and answer["exit_code"] == 2, answer
        assert "brand_new_option" in answer["error"] and "delete the pffs-csi-mounter pod" in answer["error"]
        sent = json.loads(
            options_with_credentials(MountOptions(mountpoint=tmp_path / "m", source="s3://b/p"), True)
        )
        assert set(sent) <= {"mountpoint", "source", "cache"}, sent
    finally:
        mounter.kill()
        subprocess.run(["rm", "-rf", str(short)], check=False)


def test_a_mount_the_plugin_cannot_see_is_never_stopped_as_if_dead(
    node: Path, s3_server: SeaweedS3, raw_s3: s3fs.S3FileSystem, bucket: str, tmp_path: Path
) -> None:
    """A mounter whose mounts do not reach the plugin (here: its own private mount namespace; on a node, a
    plugin whose kubelet dir is not the mounter's) serves a volume the plugin cannot see. Its process is
    alive and its path mounted where it runs: the plugin must leave it alone (logged once), not take it
    for dead and stop it, which is what ended running pods' mounts on an upgrade with a wrong kubelet path."""
    raw_s3.pipe(f"{bucket}/set/file.bin", os.urandom(1 << 20))
    short = Path(tempfile.mkdtemp(prefix="pffs-unseen-", dir="/run"))
    mounter = Mounter(short / "mounter.sock", tmp_path / "mounter.log")
    mounter.start("unshare", "--mount", "--propagation", "private")
    plugin = CsiPlugin(short, "--mounter", f"unix://{mounter.socket}", "--kubelet-dir", str(node),
                       "--check-interval", "0.1", "--cache-size", "1G", metrics=True)  # fmt: skip
    try:
        plugin.start()
        staging = node / "plugins/kubernetes.io/csi/pffs/vol/globalmount"
        capability = csi_pb2.VolumeCapability(
            mount=csi_pb2.VolumeCapability.MountVolume(),
            access_mode=AccessMode(mode=AccessMode.MULTI_NODE_READER_ONLY),
        )
        request = csi_pb2.NodeStageVolumeRequest(
            volume_id="vol",
            staging_target_path=str(staging),
            volume_capability=capability,
            volume_context={"source": f"s3://{bucket}/set", "endpointUrl": s3_server.endpoint_url},
            secrets={"accessKeyId": s3_server.access_key, "secretAccessKey": s3_server.secret_key},
        )
        plugin.node.NodeStageVolume(request, timeout=60)
        pid = plugin.staged()[str(staging)]["pid"]
        assert str(staging) not in mount_stack_paths(), "the mount reached the plugin's namespace"
        poll(
            "the plugin says it leaves the unseen mount alone",
            lambda: f"the mount process {pid} serves {staging} in its own mount namespace" in plugin.log(),
            30,
            plugin.log,
        )
        # The kubelet's retry of NodeStageVolume finds it "dead" too: refused, not repaired.
        with pytest.raises(grpc.RpcError) as caught:
            plugin.node.NodeStageVolume(request, timeout=60)
        assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION, caught.value.details()
        assert is_alive(pid) and plugin.staged()[str(staging)]["pid"] == pid
        assert "mounting it again" not in plugin.log() and plugin.metric("pffs_csi_recoveries_total") == 0
        assert plugin.log().count("in its own mount namespace") == 1, "logged once, not every round"
    finally:
        plugin.stop()
        mounter.kill()
        plugin.clean_up()
        subprocess.run(["rm", "-rf", str(short)], check=False)


def mount_stack_paths() -> set[str]:
    return {line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()}
