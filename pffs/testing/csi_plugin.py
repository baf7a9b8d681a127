"""`pffs csi` in a process of its own, for tests and benchmarks: started on a unix socket in a folder of
the caller's, ready once the socket answers, and on stop (also after a failure) terminated with every
mount process it started stopped and everything mounted under the folder detached.

    with CsiPlugin(tmp_path, "--cache-size", "1G") as plugin:
        plugin.node.NodeStageVolume(...)

The plugin's environment has no AWS_* or PFFS_* variable: credentials reach it only through CSI secrets.
`start` may be called again after `kill` or `stop`: a restart on the same state dir (as the kubelet's node
sees after a crash), logging on into the same file, with a new metrics port.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import grpc
from prometheus_client.parser import text_string_to_metric_families

from pffs.csi import csi_pb2, csi_pb2_grpc
from pffs.csi.identity import DRIVER_NAME
from pffs.csi.mounts import is_mount_process, mounted_paths, unmount_all
from pffs.processes import is_alive
from pffs.testing.s3_server import free_ports

# A restarted plugin is reached within ~0.2 s, not after gRPC's default backoff of up to two minutes.
FAST_RECONNECT = [
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.min_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 200),
]


class CsiPlugin:
    identity: csi_pb2_grpc.IdentityStub
    controller: csi_pb2_grpc.ControllerStub
    node: csi_pb2_grpc.NodeStub

    def __init__(
        self,
        root: Path,
        *args: str,
        node_id: str = "test-node",
        mode: str = "all",
        cache_dir: Path | None = None,
        metrics: bool = False,
        verbosity: str = "-v",
    ) -> None:
        """`args` go to `pffs csi` as they are; `metrics` serves /metrics on a free port (`metric`)."""
        self.root = root
        self.socket = root / "csi.sock"
        if len(os.fsencode(self.socket)) > 100:  # sun_path holds 108 bytes
            raise ValueError(f"socket path too long for a unix socket: {self.socket}")
        self.state_dir = root / "state"
        self.cache_dir = cache_dir
        self.log_path = root / "plugin.log"
        self.args = [*args, verbosity]
        self.node_id = node_id
        self.mode = mode
        self.metrics = metrics
        self.metrics_port = 0
        self.process: subprocess.Popen[bytes] | None = None
        self.channel: grpc.Channel | None = None

    def start(self, timeout_s: float = 30.0) -> Self:
        command = [sys.executable, "-m", "pffs.cli.main", "csi", "--endpoint", f"unix://{self.socket}"]
        command += ["--node-id", self.node_id, "--mode", self.mode, "--state-dir", str(self.state_dir)]
        if self.cache_dir is not None:
            command += ["--cache-dir", str(self.cache_dir)]
        if self.metrics:
            self.metrics_port = free_ports(1)[0]
            command += ["--metrics-port", str(self.metrics_port)]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "PFFS_"))}
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [*command, *self.args],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                env=env,
                cwd=self.root,
            )
        self.channel = grpc.insecure_channel(f"unix://{self.socket}", options=FAST_RECONNECT)
        self.identity = csi_pb2_grpc.IdentityStub(self.channel)
        self.controller = csi_pb2_grpc.ControllerStub(self.channel)
        self.node = csi_pb2_grpc.NodeStub(self.channel)
        self._wait_for_ready(self.process, timeout_s)
        return self

    def _wait_for_ready(self, process: subprocess.Popen[bytes], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"pffs csi exited with {process.returncode}:\n{self.log()[-4000:]}")
            try:
                request = csi_pb2.GetPluginInfoRequest()
                info = self.identity.GetPluginInfo(request, timeout=0.5, wait_for_ready=True)
            except grpc.RpcError:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"pffs csi did not answer within {timeout_s:.0f} s:\n{self.log()[-4000:]}"
                    ) from None
                continue
            if info.name != DRIVER_NAME:
                raise RuntimeError(f"{self.socket} answers as {info.name!r}, not {DRIVER_NAME!r}")
            return

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def staged(self) -> dict[str, dict[str, Any]]:
        """The plugin's state file: staged volumes by staging path ({} before there is one)."""
        path = self.state_dir / "state.json"
        return json.loads(path.read_text())["staged"] if path.exists() else {}

    def metric(self, name: str) -> float:
        """The sum of a sample's values on the plugin's /metrics (e.g. pffs_csi_recoveries_total); 0 when
        absent. Needs `metrics=True`."""
        if not self.metrics_port:
            raise RuntimeError("the plugin serves no /metrics: start it with metrics=True")
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        text = urllib.request.urlopen(url, timeout=5).read().decode()
        return sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == name
        )

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """SIGKILL (by default), as an OOM or a crash would: the mounts stay as they are."""
        self._end(sig, wait_s=15)

    def stop(self) -> None:
        """SIGTERM: the plugin stops serving and leaves its mounts running."""
        self._end(signal.SIGTERM, wait_s=30)

    def _end(self, sig: int, wait_s: float) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)

    def clean_up(self) -> None:
        """After `stop` or `kill`: stops every mount process the plugin recorded and every process holding
        a file under root open (mount processes log there) with SIGTERM (a mount uploads what is pending and
        unmounts), SIGKILL after 10 s; then detaches everything still mounted under root, deepest first."""
        pids = processes_with_files_under(self.root)
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError, AttributeError):
            pids |= {s["pid"] for s in self.staged().values() if is_mount_process(s.get("pid"))}
        signal_all(pids, signal.SIGTERM)
        signal_all(wait_gone(pids, 10), signal.SIGKILL)
        wait_gone(pids, 10)
        prefix = str(self.root).rstrip("/") + "/"
        for _ in range(5):  # a lazy unmount of a parent can leave what was stacked under it
            left = sorted((p for p in mounted_paths() if p.startswith(prefix)), key=len, reverse=True)
            if not left:
                break
            for path in left:
                with contextlib.suppress(OSError):
                    unmount_all(path)

    def __enter__(self) -> Self:
        try:
            return self.start()
        except BaseException:
            self.stop()
            self.clean_up()
            raise

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
        self.clean_up()


def holds_files_under(pid: int, prefix: str) -> bool:
    """True if process `pid` has a file open whose path starts with `prefix`."""
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(prefix):
                    return True
    except OSError:
        pass
    return False


def processes_with_files_under(root: Path) -> set[int]:
    """The processes but this one holding a file under `root` open: plugins and their mount processes."""
    prefix = str(root).rstrip("/") + "/"
    return {
        int(p)
        for p in os.listdir("/proc")
        if p.isdigit() and int(p) != os.getpid() and holds_files_under(int(p), prefix)
    }


def signal_all(pids: set[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def wait_gone(pids: set[int], timeout_s: float) -> set[int]:
    """Waits up to `timeout_s` for the processes to end; those still alive."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(is_alive(p) for p in pids):
        time.sleep(0.05)
    return {p for p in pids if is_alive(p)}


class FakeKubelet:
    """What the plugin knows a live kubelet by: a unix socket listening at ROOT/pod-resources/kubelet.sock
    (bound through the folder's descriptor, so ROOT may be longer than a socket address)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.listener: socket.socket | None = None

    def __enter__(self) -> FakeKubelet:
        folder = self.root / "pod-resources"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "kubelet.sock").unlink(missing_ok=True)
        dir_fd = os.open(folder, os.O_PATH | os.O_DIRECTORY)
        try:
            self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.listener.bind(f"/proc/self/fd/{dir_fd}/kubelet.sock")
            self.listener.listen(16)
        finally:
            os.close(dir_fd)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.listener is not None:
            self.listener.close()  # the socket file stays, as a dead kubelet's does
            self.listener = None
