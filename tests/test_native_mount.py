"""`pffs mount --engine native`: the mount served by the native core (fuser, several threads, no Python per
request), against a real SeaweedFS and a real FUSE mount. Byte-exact against the source everywhere."""

from __future__ import annotations

import errno
import json
import os
import random
import stat
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import s3fs
from helpers import check_readers_in_threads_and_processes, pattern, read_until_the_new_version, sha256
from mounts import Mount, drop_page_cache, mounted, pffs

from pffs.testing.s3_server import SeaweedS3

BLOCK = 64 << 10
NATIVE = ("--engine", "native", "--read-only", "--block-size", "64K")
pytestmark = [
    pytest.mark.s3,
    pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="needs /dev/fuse (FUSE) on this machine"),
]
SIZES = [0, 1, 4095, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK, 5 * BLOCK + 17, (3 << 20) + 5]


def env_for(server: SeaweedS3) -> dict[str, str]:
    return {
        **os.environ,
        "AWS_ACCESS_KEY_ID": server.access_key,
        "AWS_SECRET_ACCESS_KEY": server.secret_key,
        "AWS_DEFAULT_REGION": "us-east-1",
    }


def raw_for(server: SeaweedS3) -> s3fs.S3FileSystem:
    return s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False, **server.storage_options())


def fresh_bucket(server: SeaweedS3) -> tuple[s3fs.S3FileSystem, str]:
    """A new, empty bucket on `server`, and plain s3fs to put test data in it (not through pffs)."""
    raw = raw_for(server)
    bucket = f"native-{uuid.uuid4().hex[:12]}"
    raw.mkdir(bucket)
    return raw, bucket


@pytest.fixture(scope="module")
def dataset(s3_server: SeaweedS3) -> dict[str, Any]:
    raw, bucket = fresh_bucket(s3_server)
    files = {f"data/size-{size}.bin": pattern(size, seed=size) for size in SIZES}
    files.update({f"data/small/{i:04d}.txt": pattern(1000 + i, seed=i) for i in range(64)})
    files["data/deep/er/still/x.bin"] = pattern(BLOCK * 2 + 9, seed=77)
    raw.pipe({f"{bucket}/{key}": value for key, value in files.items()})
    # A key beside keys under it: the directory hides it (Mountpoint's rule, and the Python engine's).
    raw.pipe(f"{bucket}/data/shadow/in.txt", b"shown")
    raw.pipe(f"{bucket}/data/shadow", b"hidden by the directory")
    return {"raw": raw, "bucket": bucket, "files": files}


@pytest.fixture(scope="module")
def native(
    dataset: dict[str, Any], s3_server: SeaweedS3, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Mount]:
    tmp = tmp_path_factory.mktemp("native")
    extra = ("--endpoint-url", s3_server.endpoint_url, *NATIVE, "--threads", "8")
    with mounted(f"s3://{dataset['bucket']}/data", tmp, env_for(s3_server), *extra) as mount:
        yield mount


def test_every_file_reads_byte_exact_and_lists_as_the_bucket_says(
    native: Mount, dataset: dict[str, Any]
) -> None:
    assert sorted(os.listdir(native.path)) == sorted(
        ["deep", "shadow", "small", *(f"size-{size}.bin" for size in SIZES)]
    )
    assert sorted(os.listdir(native.path / "small")) == [f"{i:04d}.txt" for i in range(64)]
    for key, data in dataset["files"].items():
        local = native.path / key.removeprefix("data/")
        assert os.path.getsize(local) == len(data), key
        assert sha256(local.read_bytes()) == sha256(data), key
    shadow = native.path / "shadow"
    assert stat.S_ISDIR(os.stat(shadow).st_mode), (
        os.stat(shadow),
        dataset["raw"].ls(f"{dataset['bucket']}/data"),
    )
    assert (shadow / "in.txt").read_bytes() == b"shown"
    report = native.stats()
    assert report["engine"] == "native" and report["pid"] == native.pid
    assert report["backend_requests"]["get"]["errors"] == 0
    assert report["cache"]["bytes_fetched"] >= sum(len(v) for v in dataset["files"].values())


def test_ranged_reads_at_block_boundaries_and_past_the_end(native: Mount, dataset: dict[str, Any]) -> None:
    data = dataset["files"][f"data/size-{5 * BLOCK + 17}.bin"]
    rng = random.Random(7)
    offsets = [0, BLOCK - 1, BLOCK, 2 * BLOCK - 3, len(data) - 1, len(data), len(data) + 100]
    offsets += [rng.randrange(len(data)) for _ in range(40)]
    fd = os.open(native.path / f"size-{5 * BLOCK + 17}.bin", os.O_RDONLY | os.O_DIRECT)
    try:
        for offset in offsets:
            for length in (1, 100, BLOCK, 2 * BLOCK + 5, 1 << 20):
                assert os.pread(fd, length, offset) == data[offset : offset + length], (offset, length)
    finally:
        os.close(fd)


def test_readers_in_threads_and_processes_are_served_by_several_native_threads(
    native: Mount, dataset: dict[str, Any]
) -> None:
    drop_page_cache()
    check_readers_in_threads_and_processes(native.path, dataset["files"], "data/")
    assert native.pid is not None
    # The FUSE connection is read by the 8 threads asked for (fuser names them), not one Python loop.
    names = [
        Path(f"/proc/{native.pid}/task/{t}/comm").read_text().strip()
        for t in os.listdir(f"/proc/{native.pid}/task")
    ]
    assert sum(1 for n in names if n.startswith("fuser")) >= 8, names


def test_read_only_everywhere_and_the_documented_errnos(native: Mount) -> None:
    for change in (
        lambda: (native.path / "new.txt").write_bytes(b"x"),
        lambda: os.mkdir(native.path / "newdir"),
        lambda: os.unlink(native.path / "size-1.bin"),
        lambda: open(native.path / "size-1.bin", "r+b"),  # noqa: SIM115
    ):
        with pytest.raises(OSError) as exc:
            change()
        assert exc.value.errno == errno.EROFS
    for missing, code in (("nope.bin", errno.ENOENT), ("size-1.bin/x", errno.ENOTDIR)):
        with pytest.raises(OSError) as exc:
            os.stat(native.path / missing)
        assert exc.value.errno == code
    st = os.statvfs(native.path)
    assert st.f_bavail > 0 and st.f_flag & os.ST_RDONLY
    assert (
        os.getxattr(native.path / "small" / "0001.txt", "user.pffs.url")
        .decode()
        .endswith("/data/small/0001.txt")
    )
    (native.path / "small" / "0002.txt").read_bytes()
    assert float(os.getxattr(native.path / "small" / "0002.txt", "user.pffs.cached")) == 1.0


def test_pffs_stats_reads_the_native_report(native: Mount, s3_server: SeaweedS3) -> None:
    result = pffs("stats", str(native.path), "--json", env=env_for(s3_server))
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["scope"] == "mount" and report["engine"] == "native"
    assert report["cache"]["block_reads"] > 0
    table = pffs("stats", str(native.path), env=env_for(s3_server))
    assert table.returncode == 0 and "prefetch hit ratio" in table.stdout, table.stderr


def test_a_changed_object_is_never_mixed_and_shows_after_the_ttl(
    s3_server: SeaweedS3, tmp_path: Path
) -> None:
    raw, bucket = fresh_bucket(s3_server)
    old, new = pattern(6 * BLOCK, seed=1), pattern(6 * BLOCK, seed=2)
    raw.pipe(f"{bucket}/f.bin", old)
    extra = ("--endpoint-url", s3_server.endpoint_url, *NATIVE, "--dir-ttl", "1", "--attr-ttl", "0.5")
    with mounted(
        f"s3://{bucket}", tmp_path, env_for(s3_server), *extra, "--memory-cache-size", "64K"
    ) as mount:
        with open(mount.path / "f.bin", "rb", buffering=0) as f:
            head = f.read(BLOCK)
            raw.pipe(f"{bucket}/f.bin", new)
            try:
                rest = f.read()
            except OSError as exc:
                assert exc.errno == errno.ESTALE
            else:
                assert head + rest == old  # the version pinned at open, never a mix
        assert head == old[:BLOCK]
        read_until_the_new_version(mount.path / "f.bin", old, new)


def test_memory_stays_within_its_bound_and_bytes_stay_exact(s3_server: SeaweedS3, tmp_path: Path) -> None:
    raw, bucket = fresh_bucket(s3_server)
    data = pattern(48 * BLOCK + 5, seed=5)
    raw.pipe(f"{bucket}/big.bin", data)
    extra = ("--endpoint-url", s3_server.endpoint_url, *NATIVE, "--memory-cache-size", "256K")
    with mounted(f"s3://{bucket}", tmp_path, env_for(s3_server), *extra) as mount:
        for _ in range(2):
            drop_page_cache()
            assert sha256((mount.path / "big.bin").read_bytes()) == sha256(data)
        report = mount.stats()
        assert report["cache_usage"]["memory_bytes"] <= 256 << 10
        assert report["cache"]["memory_evictions"] > 0


def test_cached_data_reads_through_an_outage_and_the_rest_fails_by_the_deadline(tmp_path: Path) -> None:
    with SeaweedS3(tmp_path / "own-server") as server:
        raw = raw_for(server)
        raw.mkdir("outage")
        cached, uncached = pattern(5 * BLOCK, seed=3), pattern(5 * BLOCK, seed=4)
        raw.pipe({"outage/cached.bin": cached, "outage/uncached.bin": uncached})
        extra = ("--endpoint-url", server.endpoint_url, *NATIVE, "--dir-ttl", "1", "--backend-timeout", "5")
        with mounted("s3://outage", tmp_path, env_for(server), *extra) as mount:
            assert sorted(os.listdir(mount.path)) == ["cached.bin", "uncached.bin"]
            assert (mount.path / "cached.bin").read_bytes() == cached
            server.stop()
            time.sleep(1.5)  # the listing is past its TTL: stale-if-error answers the lookups
            drop_page_cache()
            assert sha256((mount.path / "cached.bin").read_bytes()) == sha256(cached)
            started = time.monotonic()
            with pytest.raises(OSError) as exc:
                (mount.path / "uncached.bin").read_bytes()
            assert exc.value.errno in (errno.ECONNREFUSED, errno.ETIMEDOUT, errno.EIO)
            assert time.monotonic() - started < 30  # the 5 s deadline, with room for a loaded machine
            assert mount.stats()["cache"]["stale_metadata_served"] > 0
            server.start()
            assert sha256((mount.path / "uncached.bin").read_bytes()) == sha256(uncached)
        assert "serving it as last seen (stale-if-error)" in mount.log_file.read_text()


def test_what_the_native_engine_does_not_serve_yet_is_refused_in_one_line(
    s3_server: SeaweedS3, dataset: dict[str, Any], tmp_path: Path
) -> None:
    env = env_for(s3_server)
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    base = ("mount", "--endpoint-url", s3_server.endpoint_url, "--cache-dir", str(tmp_path / "cache"))
    writable = pffs(*base, f"s3://{dataset['bucket']}/data", str(mountpoint), "--engine", "native", env=env)
    assert writable.returncode == 2, writable.stderr
    assert "--read-only" in writable.stderr and len(writable.stderr.strip().splitlines()) == 1, (
        writable.stderr
    )
    local = pffs("mount", str(tmp_path), str(mountpoint), "--engine", "native", "--read-only", env=env)
    assert local.returncode != 0 and "S3 sources only" in local.stderr, local.stderr
    missing = pffs(*base, f"s3://{dataset['bucket']}/dat", str(mountpoint), *NATIVE, env=env)
    assert missing.returncode != 0 and "did you mean" in missing.stderr, missing.stderr
    assert not os.path.ismount(mountpoint)


def test_unmounted_from_outside_the_mount_ends_saying_so(
    s3_server: SeaweedS3, dataset: dict[str, Any], tmp_path: Path
) -> None:
    extra = ("--endpoint-url", s3_server.endpoint_url, *NATIVE)
    mount = Mount(
        f"s3://{dataset['bucket']}/data", tmp_path / "mnt", tmp_path / "cache", env_for(s3_server), *extra
    )
    with mount:
        assert mount.pid is not None
        subprocess.run(["fusermount3", "-u", str(mount.path)], check=True)
        deadline = time.monotonic() + 15
        while _alive(mount.pid):
            assert time.monotonic() < deadline, "the mount process outlived its mount"
            time.sleep(0.05)
    assert "unmounted from outside" in mount.log_file.read_text()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def test_the_disk_tier_is_the_nodes_one_shared_with_the_python_engine(
    s3_server: SeaweedS3, tmp_path: Path
) -> None:
    raw, bucket = fresh_bucket(s3_server)
    files = {f"d/{i}.bin": pattern(BLOCK * (i % 4) + 1000 * i + 1, seed=i) for i in range(12)}
    raw.pipe({f"{bucket}/{k}": v for k, v in files.items()})
    cache = tmp_path / "cache"
    common = ("--endpoint-url", s3_server.endpoint_url, "--read-only", "--block-size", "64K")
    python_half, native_half = sorted(files)[:6], sorted(files)[6:]

    def read_all(mount: Mount, keys: list[str]) -> None:
        drop_page_cache()
        for key in keys:
            assert sha256((mount.path / key).read_bytes()) == sha256(files[key]), key

    # The Python engine warms half the files, the native one the other half: each tier's blocks are the
    # other's (one format, one set of keys, one index).
    with Mount(f"s3://{bucket}", tmp_path / "py", cache, env_for(s3_server), *common) as mount:
        read_all(mount, python_half)
    with Mount(
        f"s3://{bucket}", tmp_path / "nat", cache, env_for(s3_server), *common, "--engine", "native"
    ) as mount:
        read_all(mount, python_half)
        report = mount.stats()["cache"]
        assert report["misses"] == 0 and report["disk_hits"] > 0, report
        read_all(mount, native_half)
        assert mount.stats()["cache"]["misses"] > 0
    with Mount(f"s3://{bucket}", tmp_path / "py2", cache, env_for(s3_server), *common) as mount:
        read_all(mount, native_half)
        assert mount.stats()["cache"]["misses"] == 0, "the native engine's blocks never reached the disk tier"
    with Mount(
        f"s3://{bucket}", tmp_path / "nat2", cache, env_for(s3_server), *common, "--engine", "native"
    ) as mount:
        # A damaged block file is dropped and fetched again, never served.
        damaged = next((cache / "blocks").glob("*/*.blk"))
        data = bytearray(damaged.read_bytes())
        data[-1] ^= 0xFF
        damaged.write_bytes(bytes(data))
        read_all(mount, sorted(files))
        report = mount.stats()
        assert report["cache"]["corrupt_blocks"] == 1 and report["cache"]["misses"] == 1, report["cache"]
        assert report["cache_usage"]["disk_bytes"] > 0


def test_random_reads_of_blocks_on_disk_read_only_what_they_need(
    native: Mount, dataset: dict[str, Any], s3_server: SeaweedS3, tmp_path: Path
) -> None:
    name = f"size-{(3 << 20) + 5}.bin"
    data = dataset["files"][f"data/{name}"]
    assert sha256((native.path / name).read_bytes()) == sha256(data)  # every block on disk
    extra = ("--endpoint-url", s3_server.endpoint_url, *NATIVE, "--block-size", "1M")
    big_blocks = Mount(
        f"s3://{dataset['bucket']}/data", tmp_path / "again", native.cache_dir, env_for(s3_server), *extra
    )
    with big_blocks:  # 1 MiB blocks: other keys than the 64 KiB ones, fetched once, then on disk
        assert sha256((big_blocks.path / name).read_bytes()) == sha256(data)
    with Mount(
        f"s3://{dataset['bucket']}/data", tmp_path / "third", native.cache_dir, env_for(s3_server), *extra
    ) as mount:
        rng = random.Random(11)
        fd = os.open(mount.path / name, os.O_RDONLY | os.O_DIRECT)
        try:
            for _ in range(50):
                offset = rng.randrange(1, len(data) - 1) // 4096 * 4096 or 4096
                assert os.pread(fd, 128 << 10, offset) == data[offset : offset + (128 << 10)], offset
        finally:
            os.close(fd)
        report = mount.stats()
        assert report["cache"]["misses"] == 0 and report["cache"]["disk_hits"] >= 50, report["cache"]
        # Only the segments the reads touched came from disk, not whole 1 MiB blocks.
        assert report["cache"]["bytes_from_disk"] < 50 * (128 << 10) * 2, report["cache"]
        assert report["cache_usage"]["memory_bytes"] < 2 << 20, report["cache_usage"]
