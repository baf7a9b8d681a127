"""`pffs csi` in a process of its own, for tests and benchmarks: started on a unix socket in a folder of
the caller's, ready once the socket answers, and on stop (also after a failure) terminated with every
mount it made detached and every mount process it started killed.

    with CsiPlugin(tmp_path, "--cache-size", "1G") as plugin:
        plugin.node.NodeStageVolume(...)
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

import grpc

from pffs.csi import csi_pb2, csi_pb2_grpc


class CsiPlugin:
    def __init__(self, root: Path, *args: str, node_id: str = "test-node", mode: str = "all") -> None:
        self.root = root
        self.socket = root / "csi.sock"
        self.state_dir = root / "state"
        self.log_path = root / "plugin.log"
        self.args = list(args)
        self.node_id = node_id
        self.mode = mode
        self.process: subprocess.Popen[bytes] | None = None
        self.channel: grpc.Channel | None = None

    def start(self, timeout_s: float = 30.0) -> CsiPlugin:
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "pffs.cli.main",
                    "csi",
                    "--endpoint",
                    f"unix://{self.socket}",
                    "--node-id",
                    self.node_id,
                    "--mode",
                    self.mode,
                    "--state-dir",
                    str(self.state_dir),
                    "-v",
                    *self.args,
                ],
                stderr=log,
            )
        self.channel = grpc.insecure_channel(f"unix://{self.socket}")
        self.identity = csi_pb2_grpc.IdentityStub(self.channel)
        self.controller = csi_pb2_grpc.ControllerStub(self.channel)
        self.node = csi_pb2_grpc.NodeStub(self.channel)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"pffs csi exited: {self.log()[-2000:]}")
            try:
                self.identity.GetPluginInfo(csi_pb2.GetPluginInfoRequest(), timeout=1)
                return self
            except grpc.RpcError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"pffs csi did not answer within {timeout_s:.0f} s") from None
                time.sleep(0.05)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def records(self) -> dict[str, dict[str, object]]:
        """The plugin's state file: staged volumes by staging path."""
        path = self.state_dir / "state.json"
        return json.loads(path.read_text())["staged"] if path.exists() else {}

    def kill(self) -> None:
        """SIGKILL, as an OOM or a crash would: the mounts stay as they are."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)
        if self.channel is not None:
            self.channel.close()

    def stop(self) -> None:
        """SIGTERM: the plugin stops serving and leaves its mounts running."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        if self.channel is not None:
            self.channel.close()

    def clean_up(self) -> None:
        """Kills every mount process the plugin recorded and detaches everything mounted under root."""
        from pffs.csi.mounts import mounted_paths, unmount_all

        for staged in self.records().values():
            pid = staged.get("pid")
            if isinstance(pid, int):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for path in sorted(mounted_paths(), key=len, reverse=True):
            if path.startswith(str(self.root)):
                unmount_all(path)

    def __enter__(self) -> CsiPlugin:
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
