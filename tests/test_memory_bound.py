"""The documented memory bound holds for any number of readers (issue 43): a mount with --memory-cache-size
64M, started in a memory cgroup limited to the bound docs/guides/memory.md gives for its options
(pffs.vfs.reader.memory_bound: 384 MiB), serves 16 readers of one 2 GiB object (its blocks on the disk tier)
at once, each starting at another offset (16 streams, each with its read-ahead), every byte exact; the
cgroup records no OOM kill and the mount lives on. Before the bound was kept, 16 readers took the mount to
1.4-1.5 GiB and a mount in such a cgroup was OOM-killed within a second."""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import s3fs
from helpers import pffs_fs
from mounts import PFFS, Mount, pffs
from test_mount import env_for, new_bucket

from pffs.config import CacheSettings
from pffs.testing.s3_server import SeaweedS3
from pffs.vfs.readahead import ByteBudget, ReadAheadState
from pffs.vfs.reader import memory_bound

SIZE = 2 << 30
CHUNK = 64 << 20  # the unit each reader checks (sha256 per chunk, against the one computed at upload)
READERS = 16
MEMORY_CACHE = 64 << 20
CGROUP_V1 = Path("/sys/fs/cgroup/memory")
CGROUP_V2 = Path("/sys/fs/cgroup/unified")

pytestmark = pytest.mark.timeout(900)


def pattern_chunk(start: int, size: int, seed: int = 43) -> bytes:
    """Bytes [start, start+size) of helpers.pattern(SIZE, seed), made a chunk at a time (start % 8 == 0)."""
    first = start // 8
    words = np.arange(first, first + (size + 7) // 8, dtype=np.uint64)
    return (words * np.uint64(2654435761) + np.uint64(seed * 97 + 1)).tobytes()[:size]


class MemoryCgroup:
    """A memory cgroup of our own (v1 where its controller is mounted, else v2), removed afterwards."""

    def __init__(self, limit: int) -> None:
        self.v1 = (CGROUP_V1 / "memory.limit_in_bytes").exists()
        root = CGROUP_V1 if self.v1 else CGROUP_V2
        self.path = root / f"pffs-memory-bound-{uuid.uuid4().hex[:8]}"
        self.path.mkdir()
        try:
            if self.v1:
                (self.path / "memory.limit_in_bytes").write_text(str(limit))
                with contextlib.suppress(OSError):  # no swap to hide in, where swap accounting exists
                    (self.path / "memory.memsw.limit_in_bytes").write_text(str(limit))
            else:
                (self.path / "memory.max").write_text(str(limit))
                with contextlib.suppress(OSError):
                    (self.path / "memory.swap.max").write_text("0")
        except BaseException:
            self.path.rmdir()
            raise

    def pids(self) -> list[int]:
        return [int(p) for p in (self.path / "cgroup.procs").read_text().split()]

    def oom_kills(self) -> int:
        text = (self.path / ("memory.oom_control" if self.v1 else "memory.events")).read_text()
        found = re.search(r"^oom_kill (\d+)", text, re.M)
        return int(found.group(1)) if found else 0

    def peak(self) -> int:
        name = "memory.max_usage_in_bytes" if self.v1 else "memory.peak"
        with contextlib.suppress(OSError):
            return int((self.path / name).read_text())
        return -1

    def failcnt(self) -> int:
        if self.v1:
            return int((self.path / "memory.failcnt").read_text())
        found = re.search(r"^max (\d+)", (self.path / "memory.events").read_text(), re.M)
        return int(found.group(1)) if found else 0

    def remove(self) -> None:
        """Moves whatever is left back to the parent (the mount is stopped before), then removes the group."""
        parent = self.path.parent / "cgroup.procs"
        for pid in self.pids():
            with contextlib.suppress(OSError):
                parent.write_text(str(pid))
        deadline = time.monotonic() + 10
        while True:
            try:
                self.path.rmdir()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)


def memory_cgroups_available() -> bool:
    if (CGROUP_V1 / "memory.limit_in_bytes").exists():
        return True
    controllers = CGROUP_V2 / "cgroup.controllers"
    return controllers.exists() and "memory" in controllers.read_text().split()


class MountInCgroup(Mount):
    """A mount whose process starts inside the cgroup (as a container's would): a process moved in later
    leaves the memory it has behind (this kernel no longer moves charges), so it would escape the limit.
    `pffs mount` moves itself in and starts the mount process, which inherits the group; the test
    process stays out."""

    def __init__(self, group: MemoryCgroup, *args: Any) -> None:
        super().__init__(*args)
        self.group = group

    def start(self) -> MountInCgroup:
        self.path.mkdir(parents=True, exist_ok=True)
        command = [*PFFS, "mount", self.source, str(self.path), "--cache-dir", str(self.cache_dir)]
        command += ["--log-file", str(self.log_file), *self.extra]
        procs = self.group.path / "cgroup.procs"
        result = subprocess.run(
            ["sh", "-c", f'echo $$ > "{procs}" && exec "$@"', "sh", *command],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        found = re.search(r"\(pid (\d+)", result.stderr)
        self.pid = int(found.group(1)) if found else None
        if result.returncode != 0:
            raise RuntimeError(f"pffs mount failed ({result.returncode}): {result.stderr}\n{self.log()}")
        assert os.path.ismount(self.path), "pffs mount returned before the mount was ready"
        return self


@pytest.fixture
def cgroup() -> Iterator[MemoryCgroup]:
    if os.geteuid() != 0 or not memory_cgroups_available():
        pytest.skip("needs root and the cgroup memory controller (to make a memory-limited cgroup)")
    group = MemoryCgroup(memory_bound(CacheSettings(memory_cache_size=MEMORY_CACHE)))
    try:
        yield group
    finally:
        group.remove()


def test_sixteen_readers_of_a_2_gib_file_in_a_cgroup_at_the_documented_bound(
    s3_server: SeaweedS3, raw_s3: s3fs.S3FileSystem, tmp_path: Path, cgroup: MemoryCgroup
) -> None:
    bucket = new_bucket(raw_s3)
    expected = []
    with raw_s3.open(f"{bucket}/large.bin", "wb", block_size=CHUNK) as f:
        for start in range(0, SIZE, CHUNK):
            chunk = pattern_chunk(start, min(CHUNK, SIZE - start))
            expected.append(hashlib.sha256(chunk).hexdigest())
            f.write(chunk)
    options = ("--memory-cache-size", str(MEMORY_CACHE), "--endpoint-url", s3_server.endpoint_url)
    source, env = f"s3://{bucket}", env_for(s3_server)
    # The disk tier warm first (outside the cgroup): blocks then come from local disk, faster than from
    # the server, so read-ahead windows fill fastest. That is the worst case for memory: before the bound
    # was kept, the mount held every reader's whole window of blocks read ahead and not read yet.
    warmed = pffs("warmup", f"{source}/large.bin", "--cache-dir", str(tmp_path / "cache"), *options, env=env)
    assert warmed.returncode == 0, warmed.stderr
    with MountInCgroup(cgroup, source, tmp_path / "mnt", tmp_path / "cache", env, *options) as mount:
        assert mount.pid is not None and mount.pid in cgroup.pids()
        wrong: list[str] = []

        def read(reader: int) -> None:
            """Reads the whole object from a chunk of its own on (then wraps), checking every chunk."""
            chunks = SIZE // CHUNK
            with open(mount.path / "large.bin", "rb", buffering=0) as f:
                for n in range(chunks):
                    index = (reader * chunks // READERS + n) % chunks
                    f.seek(index * CHUNK)
                    digest = hashlib.sha256()
                    left = CHUNK
                    while left:
                        got = f.read(min(1 << 20, left))
                        if not got:
                            break
                        digest.update(got)
                        left -= len(got)
                    if left or digest.hexdigest() != expected[index]:
                        wrong.append(f"reader {reader}: chunk {index} wrong ({left} bytes short)")

        def guarded(reader: int) -> None:
            try:
                read(reader)
            except OSError as exc:  # ENOTCONN when the mount is killed
                wrong.append(f"reader {reader}: {exc}")

        threads = [threading.Thread(target=guarded, args=(i,)) for i in range(READERS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        report = (
            f"cgroup limit {memory_bound(CacheSettings(memory_cache_size=MEMORY_CACHE)) >> 20} MiB, "
            f"peak {cgroup.peak() >> 20} MiB, failcnt {cgroup.failcnt()}, OOM kills {cgroup.oom_kills()}"
        )
        assert not wrong, f"{wrong[:5]}; {report}\n{mount.log()}"
        assert cgroup.oom_kills() == 0, f"{report}\n{mount.log()}"
        assert os.path.ismount(mount.path) and mount.pid in cgroup.pids(), f"{report}\n{mount.log()}"
        print(report)


# In process: the budgets themselves, over local files (fast; no server).


def watch_budgets(reader: Any, stop: threading.Event, seen: dict[str, int]) -> None:
    """Records the most bytes each budget of `reader` held, sampling until `stop`."""
    while not stop.is_set():
        seen["ahead"] = max(seen["ahead"], reader.budget.in_use)
        seen["reads"] = max(seen["reads"], reader.reads.in_use)
        time.sleep(0.0005)


def test_sixteen_readers_share_the_read_ahead_and_reads_budgets_and_give_them_back(tmp_path: Path) -> None:
    block = 256 << 10
    data = pattern_chunk(0, 48 * block + 1234)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "large.bin").write_bytes(data)
    fs = pffs_fs(
        str(tmp_path / "src"), tmp_path / "cache", readahead_size=str(8 * block), memory_cache_size="1M"
    )
    reader = fs.vfs.reader
    assert reader.budget.limit_bytes == 8 * block and reader.reads.limit_bytes == 16 * block
    stop, seen = threading.Event(), {"ahead": 0, "reads": 0}
    watcher = threading.Thread(target=watch_budgets, args=(reader, stop, seen))
    watcher.start()
    wrong: list[int] = []

    def read(n: int) -> None:
        handle = fs.vfs.open(fs._full("large.bin"))
        try:
            start = n * len(data) // 16 // 4096 * 4096
            got = bytearray()
            for begin, end in ((start, len(data)), (0, start)):
                position = begin
                while position < end:
                    part = handle.read(position, min(64 << 10, end - position))
                    got += part
                    position += len(part)
            if bytes(got) != data[start:] + data[:start]:
                wrong.append(n)
            # A seek back into blocks fetched ahead, then a large read (more blocks than one read may hold).
            assert handle.read(len(data) // 2, 4096) == data[len(data) // 2 : len(data) // 2 + 4096]
            assert handle.read(0, -1) == data
        finally:
            handle.close()

    try:
        threads = [threading.Thread(target=read, args=(n,)) for n in range(16)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        stop.set()
        watcher.join()
    assert not wrong
    assert 0 < seen["ahead"] <= 8 * block and 0 < seen["reads"] <= 16 * block, seen
    deadline = time.monotonic() + 30  # fetches cancelled at close end on the fetch threads
    while reader.budget.in_use and time.monotonic() < deadline:
        time.sleep(0.01)
    assert reader.budget.in_use == 0 and reader.reads.in_use == 0


def test_read_ahead_shrinks_to_the_budget_and_asks_again_when_it_has_room() -> None:
    budget = ByteBudget(4 << 20)
    state = ReadAheadState(16, slack_bytes=1 << 20, budget=budget)
    assert all(state.hold(i, 1 << 20) for i in range(4))
    assert not state.hold(4, 1 << 20)  # used up: no allocation past it
    other = ReadAheadState(16, budget=budget)
    assert not other.hold(0, 1 << 20)
    state.pending = {i: Future() for i in range(4)}
    for future in state.pending.values():
        future.set_result(b"")
    state.take(2, 2)  # the reader moved past blocks 0 and 1: their budget comes back
    assert budget.in_use == 2 << 20
    assert other.hold(0, 1 << 20)  # its share (half, two readers holding): one block more, not two
    assert not state.hold(4, 1 << 20)
    state.close()
    assert budget.in_use == 1 << 20
