"""The mount's memory under a container's limit: `pffs mount` started inside a memory cgroup limited to twice
its configured memory cache plus the documented overhead (pffs.fuse.mount.MEMORY_OVERHEAD_BYTES) reads a
large file cold, small files with 8 threads and the large file again, exactly, without being OOM-killed;
and its own peak resident size stays within the memory cache plus that overhead."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import s3fs
from helpers import pattern, sha256
from mounts import pffs
from test_mount import env_for

from pffs.fuse.mount import MEMORY_OVERHEAD_BYTES
from pffs.testing.s3_server import SeaweedS3

MEMORY_CACHE = 64 << 20
CGROUP_V1 = Path("/sys/fs/cgroup/memory")
CGROUP_V2 = Path("/sys/fs/cgroup")

pytestmark = pytest.mark.timeout(600)


class MemoryCgroup:
    """A memory cgroup of our own (v1 or v2), removed afterwards."""

    def __init__(self, limit: int) -> None:
        name = f"pffs-test-{uuid.uuid4().hex[:8]}"
        self.v1 = (CGROUP_V1 / "memory.limit_in_bytes").exists()
        self.path = (CGROUP_V1 if self.v1 else CGROUP_V2) / name
        self.path.mkdir()
        (self.path / ("memory.limit_in_bytes" if self.v1 else "memory.max")).write_text(str(limit))
        if self.v1:  # no swap to hide in: the limit is on memory and swap together, where swap exists
            with contextlib.suppress(OSError):
                (self.path / "memory.memsw.limit_in_bytes").write_text(str(limit))

    def oom_kills(self) -> int:
        text = (self.path / ("memory.oom_control" if self.v1 else "memory.events")).read_text()
        found = re.search(r"^oom_kill (\d+)", text, re.M)
        return int(found.group(1)) if found else 0

    def pids(self) -> list[int]:
        return [int(p) for p in (self.path / "cgroup.procs").read_text().split()]

    def remove(self) -> None:
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while self.pids() and time.monotonic() < deadline:
            time.sleep(0.05)
        self.path.rmdir()


def memory_cgroups_available() -> bool:
    if (CGROUP_V1 / "memory.limit_in_bytes").exists():
        return True
    return "memory" in (CGROUP_V2 / "cgroup.subtree_control").read_text() if CGROUP_V2.exists() else False


@pytest.fixture
def cgroup() -> Iterator[MemoryCgroup]:
    if os.geteuid() != 0 or not memory_cgroups_available():
        pytest.skip("needs root and the cgroup memory controller (to make a memory-limited cgroup)")
    group = MemoryCgroup(2 * (MEMORY_CACHE + MEMORY_OVERHEAD_BYTES))
    try:
        yield group
    finally:
        group.remove()


def peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM for pid {pid}")


def test_a_mount_in_a_memory_limited_cgroup_reads_everything_exactly_and_stays_in_its_bound(
    s3_server: SeaweedS3, raw_s3: s3fs.S3FileSystem, bucket: str, tmp_path: Path, cgroup: MemoryCgroup
) -> None:
    large = pattern(512 << 20, seed=21)
    small = {f"small/{i:04d}.bin": pattern(128 << 10, seed=i) for i in range(500)}
    raw_s3.pipe({f"{bucket}/large.bin": large, **{f"{bucket}/{k}": v for k, v in small.items()}})
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    command = [
        sys.executable, "-m", "pffs.cli.main", "mount", f"s3://{bucket}", str(mountpoint),
        "--cache-dir", str(tmp_path / "cache"), "--memory-cache-size", str(MEMORY_CACHE),
        "--endpoint-url", s3_server.endpoint_url, "--log-file", str(tmp_path / "mount.log"),
    ]  # fmt: skip
    # The mount starts inside the cgroup (its daemon inherits it): everything it allocates is charged there.
    started = subprocess.run(
        ["sh", "-c", f'echo $$ > {cgroup.path / "cgroup.procs"} && exec "$@"', "sh", *command],
        env=env_for(s3_server),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert started.returncode == 0, started.stderr
    pid = int(re.search(r"\(pid (\d+)", started.stderr).group(1))  # type: ignore[union-attr]
    try:
        assert pid in cgroup.pids()
        large_sha = sha256(large)
        with open(mountpoint / "large.bin", "rb") as f:
            assert sha256(f.read()) == large_sha  # cold

        def read(name: str) -> bool:
            with open(mountpoint / name, "rb") as f:
                return sha256(f.read()) == sha256(small[name])

        with ThreadPoolExecutor(8) as pool:
            assert all(pool.map(read, sorted(small)))
        with open(mountpoint / "large.bin", "rb") as f:
            assert sha256(f.read()) == large_sha  # again: memory tier, disk tier
        assert cgroup.oom_kills() == 0 and os.path.ismount(mountpoint), (tmp_path / "mount.log").read_text()
        bound = MEMORY_CACHE + MEMORY_OVERHEAD_BYTES
        assert peak_rss(pid) <= bound, f"peak RSS {peak_rss(pid) >> 20} MiB, bound {bound >> 20} MiB"
    finally:
        pffs("umount", str(mountpoint))
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], capture_output=True)
