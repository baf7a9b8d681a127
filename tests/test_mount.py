"""The FUSE mount, for real: `pffs mount` through /dev/fuse over the SeaweedFS S3 server, checked byte for
byte (sha256) against what is stored in S3."""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import s3fs
from helpers import check_readers_in_threads_and_processes, pattern, read_until_the_new_version, sha256
from mounts import Mount, drop_page_cache, mounted, pffs

from pffs.testing.s3_server import SeaweedS3, free_ports

BLOCK = 64 << 10  # small blocks: multi-block files stay small
pytestmark = [
    pytest.mark.s3,
    pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="needs /dev/fuse (FUSE) on this machine"),
]


def env_for(server: SeaweedS3) -> dict[str, str]:
    return {
        **os.environ,
        "AWS_ACCESS_KEY_ID": server.access_key,
        "AWS_SECRET_ACCESS_KEY": server.secret_key,
        "AWS_DEFAULT_REGION": "us-east-1",
    }


def new_bucket(raw: s3fs.S3FileSystem) -> str:
    name = f"mnt-{uuid.uuid4().hex[:12]}"
    raw.mkdir(name)
    return name


SIZES = [0, 1, 4095, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK, 5 * BLOCK + 17, (3 << 20) + 5]


@pytest.fixture(scope="module")
def dataset(s3_server: SeaweedS3) -> dict[str, Any]:
    raw = s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False, **s3_server.storage_options())
    bucket = new_bucket(raw)
    files = {f"data/size-{size}.bin": pattern(size, seed=size) for size in SIZES}
    files.update({f"data/small/{i:04d}.txt": pattern(1000 + i, seed=i) for i in range(64)})
    raw.pipe({f"{bucket}/{key}": value for key, value in files.items()})
    raw.pipe(f"{bucket}/data/fresh/unread.txt", b"read by one test only")
    return {"raw": raw, "bucket": bucket, "files": files}


@pytest.fixture(scope="module")
def ro_mount(
    dataset: dict[str, Any], s3_server: SeaweedS3, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Mount]:
    """One mount of the read-only dataset for the read tests."""
    tmp = tmp_path_factory.mktemp("ro")
    extra = ("--endpoint-url", s3_server.endpoint_url, "--block-size", "64K", "--read-only")
    with mounted(f"s3://{dataset['bucket']}/data", tmp, env_for(s3_server), *extra) as mount:
        yield mount


@pytest.fixture
def rw(s3_server: SeaweedS3, raw_s3: s3fs.S3FileSystem, tmp_path: Path) -> Iterator[tuple[Mount, str]]:
    """A read-write mount of a fresh bucket: (mount, bucket)."""
    bucket = new_bucket(raw_s3)
    extra = ("--endpoint-url", s3_server.endpoint_url, "--block-size", "64K", "--dir-ttl", "1")
    with mounted(f"s3://{bucket}", tmp_path, env_for(s3_server), *extra) as mount:
        yield mount, bucket


# Reads


def test_reads_are_byte_exact_at_every_size(ro_mount: Mount, dataset: dict[str, Any]) -> None:
    for key, data in dataset["files"].items():
        local = ro_mount.path / key.removeprefix("data/")
        assert os.path.getsize(local) == len(data), key
        assert sha256(local.read_bytes()) == sha256(data), key


def test_ranged_reads_at_block_boundaries_and_past_eof(ro_mount: Mount, dataset: dict[str, Any]) -> None:
    data = dataset["files"][f"data/size-{5 * BLOCK + 17}.bin"]
    rng = random.Random(7)
    offsets = [0, BLOCK - 1, BLOCK, 2 * BLOCK - 3, len(data) - 1, len(data), len(data) + 100]
    offsets += [rng.randrange(len(data)) for _ in range(60)]
    fd = os.open(ro_mount.path / f"size-{5 * BLOCK + 17}.bin", os.O_RDONLY)
    try:
        for offset in offsets:
            for length in (1, 100, BLOCK, 2 * BLOCK + 5, 1 << 20):
                assert os.pread(fd, length, offset) == data[offset : offset + length], (offset, length)
    finally:
        os.close(fd)


def test_listing_sizes_and_stat_come_from_one_list(ro_mount: Mount, dataset: dict[str, Any]) -> None:
    names = sorted(os.listdir(ro_mount.path / "small"))
    assert names == [f"{i:04d}.txt" for i in range(64)]
    before = ro_mount.stats()["backend_requests"]
    for name in names:
        assert (ro_mount.path / "small" / name).stat().st_size == len(dataset["files"][f"data/small/{name}"])
    after = ro_mount.stats()["backend_requests"]
    assert after["head"]["requests"] == before["head"]["requests"], "a stat after a listing sent a HEAD"
    entries = {e.name: e for e in os.scandir(ro_mount.path)}
    assert entries["small"].is_dir() and entries[f"size-{BLOCK}.bin"].is_file()
    assert entries["small"].stat().st_mtime > 1.5e9, "an S3 prefix dated 1970"  # the mount's start instead


def test_concurrent_readers_in_threads_and_processes(ro_mount: Mount, dataset: dict[str, Any]) -> None:
    check_readers_in_threads_and_processes(ro_mount.path, dataset["files"], "data/")


def test_kernel_page_cache_kept_for_unchanged_objects(ro_mount: Mount, dataset: dict[str, Any]) -> None:
    path = ro_mount.path / f"size-{3 * BLOCK}.bin"
    path.read_bytes()
    before = ro_mount.stats()["cache"]
    for _ in range(5):
        assert sha256(path.read_bytes()) == sha256(dataset["files"][f"data/size-{3 * BLOCK}.bin"])
    after = ro_mount.stats()["cache"]
    # Re-opens are served by the kernel's page cache: pffs sees no reads at all.
    assert after["memory_hits"] == before["memory_hits"] and after["misses"] == before["misses"]


def test_xattrs_statfs_and_read_only(ro_mount: Mount, dataset: dict[str, Any]) -> None:
    path = ro_mount.path / "fresh" / "unread.txt"
    names = os.listxattr(path)
    assert "user.pffs.cached" in names and "user.pffs.etag" in names
    assert float(os.getxattr(path, "user.pffs.cached")) == 0.0
    path.read_bytes()
    assert float(os.getxattr(path, "user.pffs.cached")) == 1.0
    assert os.getxattr(path, "user.pffs.url").decode().endswith("/data/fresh/unread.txt")
    with pytest.raises(OSError) as exc:
        os.getxattr(path, "user.other")
    assert exc.value.errno == errno.ENODATA
    st = os.statvfs(ro_mount.path)
    assert st.f_blocks * st.f_frsize >= 1 << 50 and st.f_bavail * st.f_frsize > 0
    for change in (
        lambda: (ro_mount.path / "new.txt").write_bytes(b"x"),
        lambda: os.mkdir(ro_mount.path / "newdir"),
        lambda: os.unlink(path),
    ):
        with pytest.raises(OSError) as exc:
            change()
        assert exc.value.errno == errno.EROFS


def test_directory_with_10000_entries(
    s3_server: SeaweedS3, raw_s3: s3fs.S3FileSystem, tmp_path: Path
) -> None:
    bucket = new_bucket(raw_s3)
    names = [f"f{i:05d}" for i in range(10_000)]
    raw_s3.pipe({f"{bucket}/many/{n}": n.encode() for n in names})
    extra = ("--endpoint-url", s3_server.endpoint_url, "--fixed-modes")  # stored modes: a HEAD per file
    with mounted(f"s3://{bucket}", tmp_path, env_for(s3_server), *extra) as mount:
        assert sorted(os.listdir(mount.path / "many")) == names
        for name in random.Random(1).sample(names, 50):
            assert (mount.path / "many" / name).read_bytes() == name.encode()
        requests = mount.stats()["backend_requests"]
        assert requests["head"]["requests"] <= 2, requests  # names, sizes and ETags came from the LIST


def test_many_small_files_looked_up_without_listing_first(
    s3_server: SeaweedS3, raw_s3: s3fs.S3FileSystem, tmp_path: Path
) -> None:
    bucket = new_bucket(raw_s3)
    files = {f"s/{i:04d}": pattern(300 + i, seed=i) for i in range(300)}
    raw_s3.pipe({f"{bucket}/{k}": v for k, v in files.items()})
    extra = ("--endpoint-url", s3_server.endpoint_url, "--fixed-modes")  # stored modes: a HEAD per file
    with mounted(f"s3://{bucket}", tmp_path, env_for(s3_server), *extra) as mount:
        keys = list(files)
        random.Random(5).shuffle(keys)
        with ThreadPoolExecutor(8) as pool:
            digests = list(pool.map(lambda k: sha256((mount.path / k).read_bytes()), keys))
        assert digests == [sha256(files[k]) for k in keys]
        # After a few HEADs the directory is listed once, and the rest are answered from the listing.
        assert mount.stats()["backend_requests"]["head"]["requests"] < 100


@pytest.mark.parametrize("prefetch", [True, False])
def test_small_files_of_a_directory_being_read_are_fetched_ahead(
    s3_server: SeaweedS3, raw_s3: s3fs.S3FileSystem, tmp_path: Path, prefetch: bool
) -> None:
    bucket = new_bucket(raw_s3)
    files = {f"{i:04d}.bin": pattern(20_000 + i, seed=i) for i in range(120)}
    raw_s3.pipe({f"{bucket}/epoch/{k}": v for k, v in files.items()})
    extra = ["--endpoint-url", s3_server.endpoint_url] + ([] if prefetch else ["--no-prefetch-dirs"])
    with mounted(f"s3://{bucket}", tmp_path, env_for(s3_server), *extra) as mount:
        names = sorted(os.listdir(mount.path / "epoch"))
        random.Random(9).shuffle(names)  # an epoch in a shuffled order, one file at a time
        for name in names:
            assert sha256((mount.path / "epoch" / name).read_bytes()) == sha256(files[name]), name
        stats = mount.stats()
        cold = json.loads(pffs("stats", str(mount.path), "--json").stdout)["cache"]
        drop_page_cache()
        for name in names:  # a second epoch: everything was in the cache before it asked
            assert sha256((mount.path / "epoch" / name).read_bytes()) == sha256(files[name]), name
        warm = json.loads(pffs("stats", str(mount.path), "--json").stdout)["cache"]
    assert stats["backend_requests"]["get"]["requests"] == len(files)  # each file fetched once, either way
    # A cold epoch has a hit ratio of 0, however much was fetched ahead of its reads
    assert cold["hit_ratio"] == 0.0 and cold["memory_hits"] + cold["disk_hits"] == 0, json.dumps(cold)
    if prefetch:
        assert stats["files_prefetched"] > 50
        assert cold["prefetches"] > 50 and cold["prefetch_hits"] > 50  # fetched ahead, then read from memory
        assert cold["misses"] + cold["prefetches"] == len(files)
    else:
        assert stats["files_prefetched"] == 0
        assert cold["prefetches"] == cold["prefetch_hits"] == 0 and cold["misses"] == len(files)
    hits = warm["memory_hits"] + warm["disk_hits"]
    assert hits == len(files) and warm["misses"] == cold["misses"], warm  # the warm epoch: all hits
    assert warm["hit_ratio"] == round(hits / (hits + warm["misses"] + warm["prefetch_hits"]), 4)


# Writes


def test_write_create_overwrite_append_truncate(rw: tuple[Mount, str], raw_s3: s3fs.S3FileSystem) -> None:
    mount, bucket = rw
    data = pattern(300_000, seed=11)
    (mount.path / "a.bin").write_bytes(data)
    assert sha256(raw_s3.cat(f"{bucket}/a.bin")) == sha256(data)  # close returned after the upload
    assert sha256((mount.path / "a.bin").read_bytes()) == sha256(data)
    uploads = mount.stats()["uploads_done"]
    with open(mount.path / "a.bin", "r+b") as f:  # opened for writing, only read: nothing staged or uploaded
        assert sha256(f.read()) == sha256(data)
    assert mount.stats()["uploads_done"] == uploads
    assert not list((mount.cache_dir / "staging").glob("*.data"))
    with open(mount.path / "a.bin", "ab") as f:
        f.write(b"tail")
    assert raw_s3.cat(f"{bucket}/a.bin") == data + b"tail"
    with open(mount.path / "a.bin", "r+b") as f:
        f.seek(1000)
        f.write(b"XYZ")
    expected = data[:1000] + b"XYZ" + data[1003:] + b"tail"
    assert raw_s3.cat(f"{bucket}/a.bin") == expected
    os.truncate(mount.path / "a.bin", 5000)
    assert raw_s3.cat(f"{bucket}/a.bin") == expected[:5000]
    assert (mount.path / "a.bin").read_bytes() == expected[:5000]
    (mount.path / "a.bin").write_bytes(b"short")  # O_TRUNC
    assert raw_s3.cat(f"{bucket}/a.bin") == b"short"
    (mount.path / "empty").touch()
    assert raw_s3.cat(f"{bucket}/empty") == b""
    os.utime(mount.path / "empty", (1_000_000_000, 1_000_000_000))  # accepted


def test_large_write_is_uploaded_exactly(rw: tuple[Mount, str], raw_s3: s3fs.S3FileSystem) -> None:
    mount, bucket = rw
    data = os.urandom(70 << 20)  # above s3fs's multipart threshold
    with open(mount.path / "big.bin", "wb") as f:
        for start in range(0, len(data), 1 << 20):
            f.write(data[start : start + (1 << 20)])
        f.flush()
        os.fsync(f.fileno())
        assert raw_s3.info(f"{bucket}/big.bin")["size"] == len(data)  # fsync uploaded it
    assert sha256(raw_s3.cat(f"{bucket}/big.bin")) == sha256(data)


def test_directories_rename_and_unlink(rw: tuple[Mount, str], raw_s3: s3fs.S3FileSystem) -> None:
    mount, bucket = rw
    os.mkdir(mount.path / "d")
    assert (mount.path / "d").is_dir() and os.listdir(mount.path / "d") == []
    (mount.path / "d" / "x.txt").write_bytes(b"x")
    with pytest.raises(OSError) as exc:
        os.rmdir(mount.path / "d")
    assert exc.value.errno == errno.ENOTEMPTY
    os.rename(mount.path / "d" / "x.txt", mount.path / "d" / "y.txt")
    assert raw_s3.cat(f"{bucket}/d/y.txt") == b"x" and not raw_s3.exists(f"{bucket}/d/x.txt")
    assert os.listdir(mount.path / "d") == ["y.txt"]
    (mount.path / "z.txt").write_bytes(b"z")
    os.replace(mount.path / "z.txt", mount.path / "d" / "y.txt")  # over an existing file
    assert raw_s3.cat(f"{bucket}/d/y.txt") == b"z"
    os.unlink(mount.path / "d" / "y.txt")
    assert not raw_s3.exists(f"{bucket}/d/y.txt")
    assert not (mount.path / "d" / "y.txt").exists()
    os.mkdir(mount.path / "e")
    os.rename(mount.path / "e", mount.path / "f")  # an empty directory made here
    assert (mount.path / "f").is_dir()
    os.rmdir(mount.path / "f")
    assert not (mount.path / "f").exists()
    (mount.path / "g").mkdir()
    (mount.path / "g" / "obj").write_bytes(b"1")
    with pytest.raises(OSError) as exc:
        os.rename(mount.path / "g", mount.path / "h")
    assert exc.value.errno == errno.EXDEV  # documented: mv then copies file by file


def test_unsupported_operations_give_the_documented_errno(rw: tuple[Mount, str]) -> None:
    mount, _ = rw
    (mount.path / "f").write_bytes(b"1")
    cases = [
        (lambda: os.link(mount.path / "f", mount.path / "hard"), errno.ENOTSUP),
        (lambda: os.setxattr(mount.path / "f", "user.x", b"1"), errno.ENOTSUP),
    ]  # chmod, chown, symlinks and FIFOs: tests/test_mount_posix.py
    for operation, expected in cases:
        with pytest.raises(OSError) as exc:
            operation()
        assert exc.value.errno == expected, operation


def test_names_the_backend_cannot_store_are_refused_with_enametoolong(
    rw: tuple[Mount, str], raw_s3: s3fs.S3FileSystem
) -> None:
    mount, bucket = rw
    assert os.statvfs(mount.path).f_namemax == 255
    longest = "n" * 255
    data = pattern(5000, seed=9)
    (mount.path / longest).write_bytes(data)  # 255 bytes: stored, exactly
    assert sha256(raw_s3.cat_file(f"{bucket}/{longest}")) == sha256(data)
    (mount.path / "d").mkdir()
    deep = mount.path / "d"
    for level in range(3):  # three 255-byte names of directories: the key is still under S3's 1,024
        deep = deep / f"{level}{'x' * 254}"
        deep.mkdir()
    too_long = "y" * 256
    cases = [
        lambda: (mount.path / too_long).write_bytes(b"x"),  # create
        lambda: os.stat(mount.path / too_long),  # lookup: ENAMETOOLONG, not ENOENT
        lambda: os.mkdir(mount.path / too_long),
        lambda: os.rename(mount.path / longest, mount.path / too_long),
        lambda: (deep / ("z" * 255)).write_bytes(b"x"),  # each name fits, the whole key (1,026) does not
        lambda: os.mkdir(deep / ("z" * 255)),
    ]
    for operation in cases:
        with pytest.raises(OSError) as exc:
            operation()
        assert exc.value.errno == errno.ENAMETOOLONG, operation
    assert sha256((mount.path / longest).read_bytes()) == sha256(data)  # the refused rename left it


def test_failed_upload_is_an_error_and_keeps_the_data(tmp_path: Path) -> None:
    with SeaweedS3(tmp_path / "own-server") as server:
        raw = s3fs.S3FileSystem(
            skip_instance_cache=True, use_listings_cache=False, **server.storage_options()
        )
        raw.mkdir("uploads")
        extra = ("--endpoint-url", server.endpoint_url)
        with mounted("s3://uploads", tmp_path, env_for(server), *extra) as mount:
            os.listdir(mount.path)
            server.stop()  # every upload now fails
            data = pattern(100_000, seed=5)
            with pytest.raises(OSError) as exc, open(mount.path / "kept.bin", "wb") as f:
                f.write(data)
            assert exc.value.errno == errno.EIO
            assert mount.stats()["uploads_pending"] == 1
            staged = list((tmp_path / "cache" / "staging").glob("*.data"))
            assert [p.read_bytes() for p in staged] == [data]  # not lost
            assert (mount.path / "kept.bin").read_bytes() == data  # and still served
            server.start()
            result = mount.umount()  # uploads what is pending, then unmounts
            assert result.returncode == 0, result.stderr
            assert sha256(raw.cat("uploads/kept.bin")) == sha256(data)


# Consistency, failures, restarts


def test_overwritten_object_is_never_mixed_and_new_after_ttl(
    s3_server: SeaweedS3, raw_s3: s3fs.S3FileSystem, tmp_path: Path
) -> None:
    bucket = new_bucket(raw_s3)
    old, new = pattern(6 * BLOCK, seed=1), pattern(6 * BLOCK, seed=2)
    raw_s3.pipe(f"{bucket}/f.bin", old)
    extra = (
        "--endpoint-url",
        s3_server.endpoint_url,
        "--block-size",
        "64K",
        "--dir-ttl",
        "1",
        "--attr-ttl",
        "0.5",
        "--memory-cache-size",
        "64K",
    )
    with mounted(f"s3://{bucket}", tmp_path, env_for(s3_server), *extra) as mount:
        with open(mount.path / "f.bin", "rb") as f:
            head = f.read(BLOCK)
            raw_s3.pipe(f"{bucket}/f.bin", new)
            try:
                rest = f.read()
            except OSError as exc:
                assert exc.errno in (errno.ESTALE, errno.EIO)
            else:
                assert head + rest == old  # the version pinned at open, never a mix
        assert head == old[:BLOCK]
        # A new open within the TTL may still pin the old version: it then reads old bytes or ESTALE (and
        # drops what it knew, so the next open sees the new one); after the TTL, the new bytes.
        read_until_the_new_version(mount.path / "f.bin", old, new)


def test_backend_outage_and_recovery(raw_s3: s3fs.S3FileSystem, tmp_path: Path) -> None:
    with SeaweedS3(tmp_path / "own-server") as server:
        raw = s3fs.S3FileSystem(
            skip_instance_cache=True, use_listings_cache=False, **server.storage_options()
        )
        raw.mkdir("outage")
        cached, uncached = pattern(5 * BLOCK, seed=3), pattern(5 * BLOCK, seed=4)
        raw.pipe({"outage/cached.bin": cached, "outage/uncached.bin": uncached})
        extra = ("--endpoint-url", server.endpoint_url, "--block-size", "64K")
        with mounted("s3://outage", tmp_path, env_for(server), *extra) as mount:
            assert sorted(os.listdir(mount.path)) == ["cached.bin", "uncached.bin"]
            assert (mount.path / "cached.bin").read_bytes() == cached
            server.stop()
            drop_page_cache()
            assert sha256((mount.path / "cached.bin").read_bytes()) == sha256(cached)
            started = time.monotonic()
            with pytest.raises(OSError) as exc:
                (mount.path / "uncached.bin").read_bytes()
            assert exc.value.errno == errno.EIO
            assert time.monotonic() - started < 30
            server.start()
            assert sha256((mount.path / "uncached.bin").read_bytes()) == sha256(uncached)


def test_kill_9_then_remount_uses_the_cache(
    s3_server: SeaweedS3, raw_s3: s3fs.S3FileSystem, tmp_path: Path
) -> None:
    bucket = new_bucket(raw_s3)
    data = pattern(20 * BLOCK + 3, seed=9)
    raw_s3.pipe(f"{bucket}/d.bin", data)
    extra = ("--endpoint-url", s3_server.endpoint_url, "--block-size", "64K")
    first = Mount(f"s3://{bucket}", tmp_path / "mnt", tmp_path / "cache", env_for(s3_server), *extra).start()
    try:
        assert (first.path / "d.bin").read_bytes() == data
        # A read returns once its block is in memory; the disk write follows. Kill only once every block
        # is on disk, so the remount below must not fetch anything.
        deadline = time.monotonic() + 10
        while float(os.getxattr(first.path / "d.bin", "user.pffs.cached")) < 1.0:
            assert time.monotonic() < deadline, "the blocks never reached the disk tier"
            time.sleep(0.05)
        assert first.pid is not None
        os.kill(first.pid, 9)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.stat(first.path)
            except OSError as exc:
                assert exc.errno == errno.ENOTCONN
                break
            time.sleep(0.05)
        with Mount(
            f"s3://{bucket}", tmp_path / "mnt", tmp_path / "cache", env_for(s3_server), *extra
        ) as again:
            drop_page_cache()
            assert sha256((again.path / "d.bin").read_bytes()) == sha256(data)
            cache = again.stats()["cache"]
            assert cache["misses"] == 0 and cache["disk_hits"] > 0
    finally:
        first.kill()


def test_umount_detaches_a_dead_mount(
    s3_server: SeaweedS3, raw_s3: s3fs.S3FileSystem, tmp_path: Path
) -> None:
    bucket = new_bucket(raw_s3)
    extra = ("--endpoint-url", s3_server.endpoint_url)
    with mounted(f"s3://{bucket}", tmp_path, env_for(s3_server), *extra) as mount:
        assert mount.pid is not None
        os.kill(mount.pid, 9)
        deadline = time.monotonic() + 10
        while True:
            try:
                os.stat(mount.path)
            except OSError as exc:
                assert exc.errno == errno.ENOTCONN
                break
            assert time.monotonic() < deadline
            time.sleep(0.05)
        result = mount.umount()
        assert result.returncode == 0 and "dead mount" in result.stderr, result.stderr
        assert not os.path.ismount(mount.path) and os.listdir(mount.path) == []


def test_fio_verify_through_the_mount(rw: tuple[Mount, str], raw_s3: s3fs.S3FileSystem) -> None:
    fio = shutil.which("fio")
    if fio is None:
        pytest.skip("needs fio (apt-get install fio, or `make setup`)")
    mount, bucket = rw
    job = [
        "--name=verify",
        f"--filename={mount.path / 'fio.bin'}",
        "--size=8M",
        "--bs=128k",
        "--ioengine=psync",
        "--verify=crc32c",
        "--verify_fatal=1",
    ]
    run = {"capture_output": True, "text": True, "timeout": 120, "cwd": mount.path.parent}
    written = subprocess.run([fio, *job, "--rw=write", "--do_verify=1"], **run)
    assert written.returncode == 0, written.stdout + written.stderr
    assert raw_s3.info(f"{bucket}/fio.bin")["size"] == 8 << 20
    drop_page_cache()
    checked = subprocess.run([fio, *job, "--rw=read", "--verify_only=1"], **run)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "verify" in checked.stdout and "err= 0" in checked.stdout


def test_metrics_endpoint(s3_server: SeaweedS3, raw_s3: s3fs.S3FileSystem, tmp_path: Path) -> None:
    bucket = new_bucket(raw_s3)
    raw_s3.pipe(f"{bucket}/m", b"metrics")
    port = free_ports(1)[0]
    extra = ("--endpoint-url", s3_server.endpoint_url, "--metrics-port", str(port))
    with mounted(f"s3://{bucket}", tmp_path, env_for(s3_server), *extra) as mount:
        assert (mount.path / "m").read_bytes() == b"metrics"
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert "pffs_cache_misses_total 1.0" in text
        assert 'pffs_backend_requests_total{kind="get"}' in text
        assert "pffs_files_prefetched_total 0.0" in text
        assert not (mount.path / "no-such-name").exists()  # a lookup answered 404: not an error
        stats = json.loads(pffs("stats", str(mount.path), "--json").stdout)
        assert stats["scope"] == "mount" and stats["cache"]["misses"] == 1
        assert stats["cache"]["hit_ratio"] == 0.0
        head = stats["backend_requests"]["head"]
        assert head["not_found"] >= 1 and head["errors"] == 0, head
        table = pffs("stats", str(mount.path))
        assert "backend requests" in table.stdout and "uploads pending" in table.stdout
        assert "files fetched ahead" in table.stdout and "not found" in table.stdout
        # the cache directory's stats (every process reading through it): the same counters, same keys
        folder = json.loads(pffs("stats", "--json", "--cache-dir", str(mount.cache_dir)).stdout)
        assert folder["scope"] == "cache_dir"
        assert folder["cache"].keys() == stats["cache"].keys()
        assert folder["cache"]["misses"] == 1 and folder["cache"]["bytes_fetched"] == len(b"metrics")
        assert folder["backend_requests"].keys() == stats["backend_requests"].keys()
        for kind, row in folder["backend_requests"].items():  # the mount is the only reader here
            mine = stats["backend_requests"][kind]
            assert row == {k: mine[k] for k in ("requests", "errors", "not_found")}, kind


def test_a_read_write_mount_of_a_prefix_that_does_not_exist_starts_empty_and_the_first_write_makes_it(
    s3_server: SeaweedS3, raw_s3: s3fs.S3FileSystem, tmp_path: Path
) -> None:
    bucket = new_bucket(raw_s3)
    env = env_for(s3_server)
    url = ("--endpoint-url", s3_server.endpoint_url)
    result = pffs("mount", f"s3://{bucket}/runs/exp-new", str(tmp_path), "--read-only", *url, env=env)
    assert result.returncode == 1 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "runs/exp-new does not exist (nothing to read; a read-write mount of it starts empty)" in (
        result.stderr
    )
    data = pattern(300_000, seed=3)
    with mounted(f"s3://{bucket}/runs/exp-new", tmp_path, env, *url) as mount:
        assert os.listdir(mount.path) == [] and mount.path.is_dir()
        assert not raw_s3.exists(f"{bucket}/runs/exp-new")  # nothing made by mounting alone
        (mount.path / "ckpt").mkdir()
        (mount.path / "ckpt" / "step-1.pt").write_bytes(data)
        (mount.path / "log.txt").write_text("epoch 1\n")
        assert sorted(os.listdir(mount.path)) == ["ckpt", "log.txt"]
    assert sha256(raw_s3.cat(f"{bucket}/runs/exp-new/ckpt/step-1.pt")) == sha256(data)
    assert raw_s3.cat(f"{bucket}/runs/exp-new/log.txt") == b"epoch 1\n"


# The command line


def test_mount_errors_are_one_clear_line(
    s3_server: SeaweedS3, raw_s3: s3fs.S3FileSystem, tmp_path: Path
) -> None:
    bucket = new_bucket(raw_s3)
    env = env_for(s3_server)
    url = s3_server.endpoint_url
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    cache = ["--cache-dir", str(tmp_path / "cache")]
    cases = [
        (["mount", f"s3://{bucket}", str(tmp_path / "missing"), "--endpoint-url", url], 1, "does not exist"),
        (
            ["mount", f"s3://{bucket}", str(mnt), "--endpoint-url", url, "--cache-size", "lots"],
            2,
            "not a size",
        ),
        (["mount", f"s3://{bucket}", str(mnt), "--endpoint-url", url, "--file-mode", "999"], 2, "octal"),
        (["mount", f"nope://{bucket}", str(mnt)], 2, "unknown URL scheme"),
        (["mount", "s3://no-such-bucket-here", str(mnt), "--endpoint-url", url], 1, "no-such-bucket-here"),
        (
            ["mount", f"s3://{bucket}", str(mnt), "--endpoint-url", f"http://127.0.0.1:{free_ports(1)[0]}"],
            1,
            "unavailable",
        ),
        (["umount", str(mnt)], 2, "not a mount point"),
    ]
    for args, code, text in cases:
        result = pffs(*args, *cache, env=env)
        assert result.returncode == code, (args, result.stderr)
        assert text in result.stderr, (args, result.stderr)
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert not os.path.ismount(mnt)
    bad_env = {**env, "AWS_SECRET_ACCESS_KEY": "wrong-secret-value"}
    result = pffs("mount", f"s3://{bucket}", str(mnt), "--endpoint-url", url, *cache, env=bad_env)
    assert result.returncode == 1 and "access denied" in result.stderr
    assert "wrong-secret-value" not in result.stderr
    with mounted(f"s3://{bucket}", tmp_path, env, "--endpoint-url", url, name="busy") as mount:
        result = pffs("mount", f"s3://{bucket}", str(mount.path), "--endpoint-url", url, *cache, env=env)
        assert result.returncode == 1 and "busy" in result.stderr
    # Over a folder with files in it: allowed (as mount(8)), with a warning that they are out of sight.
    full = tmp_path / "full"
    full.mkdir()
    (full / "old.txt").write_text("hidden meanwhile")
    try:
        result = pffs("mount", f"s3://{bucket}", str(full), "--endpoint-url", url, *cache, env=env)
        assert result.returncode == 0 and "is not empty: its 1 entries are hidden" in result.stderr, (
            result.stderr
        )
    finally:
        pffs("umount", str(full), env=env)
        subprocess.run(["fusermount3", "-u", "-z", str(full)], capture_output=True)
    assert (full / "old.txt").read_text() == "hidden meanwhile"


def test_sigterm_unmounts_cleanly(s3_server: SeaweedS3, raw_s3: s3fs.S3FileSystem, tmp_path: Path) -> None:
    bucket = new_bucket(raw_s3)
    with mounted(
        f"s3://{bucket}", tmp_path, env_for(s3_server), "--endpoint-url", s3_server.endpoint_url
    ) as mount:
        (mount.path / "w").write_bytes(b"done")
        assert mount.pid is not None
        os.kill(mount.pid, 15)
        deadline = time.monotonic() + 20
        while os.path.ismount(mount.path):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert raw_s3.cat(f"{bucket}/w") == b"done"


def test_help_explains_mount() -> None:
    result = pffs("mount", "--help")
    assert result.returncode == 0
    for option in ("--attr-ttl", "--dir-ttl", "--read-only", "--metrics-port", "--foreground", "--file-mode"):
        assert option in result.stdout
