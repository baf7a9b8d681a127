"""pffs over a real S3 server (SeaweedFS on loopback): exact bytes, versions, sharing, failures."""

from __future__ import annotations

import errno
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import fsspec
import pytest
from helpers import pattern, pffs_fs, server_options, sha256

import pffs
from pffs.backends import BackendUnavailableError, ObjectChangedError
from pffs.testing.s3_server import SeaweedS3

BLOCK = 256 * 1024
SIZES = [0, 1, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 7]


def test_reads_are_byte_exact_cold_and_warm(
    raw_s3: Any, bucket: str, s3_options: dict[str, Any], cache_dir: Path
) -> None:
    for i, size in enumerate(SIZES):
        raw_s3.pipe(f"{bucket}/obj{size}", pattern(size, seed=i))
    fs = pffs_fs(f"s3://{bucket}", cache_dir, **s3_options)
    for _ in ("cold", "warm"):
        for i, size in enumerate(SIZES):
            expected = pattern(size, seed=i)
            assert sha256(fs.cat_file(f"obj{size}")) == sha256(expected)
            with fs.open(f"obj{size}") as f:
                f.seek(max(0, size - BLOCK - 3))
                assert f.read(BLOCK + 10) == expected[max(0, size - BLOCK - 3) :][: BLOCK + 10]
                assert f.read(5) == expected[max(0, size - BLOCK - 3) + BLOCK + 10 :][:5]
    stats = fs.cache_stats()
    nonempty_blocks = sum(-(-s // BLOCK) for s in SIZES)
    assert stats["misses"] == nonempty_blocks  # every block fetched once, then served from the cache


def test_listing_fills_metadata_so_reads_need_no_head(
    raw_s3: Any, bucket: str, s3_options: dict[str, Any], cache_dir: Path
) -> None:
    for i in range(20):
        raw_s3.pipe(f"{bucket}/ds/part-{i:03d}", pattern(1000 + i, seed=i))
    fs = pffs_fs(f"s3://{bucket}/ds", cache_dir, **s3_options)
    names = fs.find("")
    assert names == [f"part-{i:03d}" for i in range(20)]
    backend = fs.vfs.backend
    stats_before = backend.fs.info  # replace the stat path to prove it is not used
    backend.fs.info = lambda *a, **k: pytest.fail("HEAD issued for a listed object")
    try:
        for i, name in enumerate(names):
            assert fs.cat_file(name) == pattern(1000 + i, seed=i)
    finally:
        backend.fs.info = stats_before


def test_chained_url_and_pffs_open(raw_s3: Any, bucket: str, s3_server: SeaweedS3, cache_dir: Path) -> None:
    data = pattern(BLOCK * 2 + 3, seed=5)
    raw_s3.pipe(f"{bucket}/k.bin", data)
    with fsspec.open(
        f"pffs::s3://{bucket}/k.bin", "rb", pffs={"cache_dir": str(cache_dir)}, s3=s3_server.storage_options()
    ) as f:
        assert sha256(f.read()) == sha256(data)
    with pffs.open(
        f"s3://{bucket}/k.bin",
        cache_dir=str(cache_dir),
        endpoint_url=s3_server.endpoint_url,
        key=s3_server.access_key,
        secret=s3_server.secret_key,
    ) as f:
        assert sha256(f.read()) == sha256(data)
    # fsspec.open's style of options, per layer, works for pffs.open too
    with pffs.open(
        f"s3://{bucket}/k.bin", s3=s3_server.storage_options(), pffs={"cache_dir": str(cache_dir)}
    ) as f:
        assert sha256(f.read()) == sha256(data)


def test_a_mistyped_option_is_refused_at_once_by_name(s3_server: SeaweedS3, cache_dir: Path) -> None:
    """Not built and then failed inside aiobotocore at the first read."""
    with pytest.raises(ValueError, match=r"unknown option 'endpont_url' \(did you mean 'endpoint_url'\?\)"):
        fsspec.filesystem(
            "pffs", target="s3://bkt/p", endpont_url=s3_server.endpoint_url, cache_dir=str(cache_dir)
        )
    with pytest.raises(ValueError, match=r"unknown option 'cache_sise' \(did you mean 'cache_size'\?\)"):
        pffs.open(str(cache_dir), cache_sise="1G")


def test_overwritten_object_is_never_a_mix_and_is_new_after_the_ttl(
    raw_s3: Any, bucket: str, s3_options: dict[str, Any], cache_dir: Path
) -> None:
    old, new = pattern(4 * BLOCK, seed=1), pattern(4 * BLOCK, seed=2)
    raw_s3.pipe(f"{bucket}/v", old)
    fs = pffs_fs(f"s3://{bucket}", cache_dir, metadata_ttl=1.0, **s3_options)
    with fs.open("v") as f:
        assert f.read(BLOCK) == old[:BLOCK]  # block 0 (and read-ahead of block 1) of the old version
        raw_s3.pipe(f"{bucket}/v", new)
        # The handle is pinned to the old version: it returns old bytes or refuses, never new ones.
        f.seek(3 * BLOCK)
        with pytest.raises(ObjectChangedError) as err:
            f.read(BLOCK)
        assert err.value.errno == errno.ESTALE
        f.seek(0)
        assert f.read(BLOCK) == old[:BLOCK]
    deadline = time.monotonic() + 10
    while fs.cat_file("v") != new:  # within the TTL the old version may still be served, whole
        assert fs.cat_file("v") in (old, new)
        assert time.monotonic() < deadline, "new content not served after the metadata TTL"
        time.sleep(0.2)
    assert sha256(fs.cat_file("v")) == sha256(new)


def test_cat_of_an_object_changing_underneath_starts_over_on_the_new_version(
    raw_s3: Any, bucket: str, s3_options: dict[str, Any], cache_dir: Path
) -> None:
    old, new = pattern(3 * BLOCK, seed=3), pattern(3 * BLOCK + 1, seed=4)
    raw_s3.pipe(f"{bucket}/w", old)
    fs = pffs_fs(f"s3://{bucket}", cache_dir, metadata_ttl=3600, **s3_options)
    fs.info("w")  # the old version's metadata is cached for an hour
    raw_s3.pipe(f"{bucket}/w", new)
    assert fs.cat_file("w") == new  # If-Match fails on the old ETag; the read restarts on the new version


def child_args(target: str, cache_dir: Path, server: SeaweedS3) -> list[str]:
    """argv for a child process that opens pffs on the test server (see the scripts below)."""
    return [target, str(cache_dir), server.endpoint_url, server.access_key, server.secret_key]


READ_IN_CHILD = """
import json, sys, fsspec, hashlib
fs = fsspec.filesystem("pffs", target=sys.argv[1], cache_dir=sys.argv[2], block_size="256K",
                       endpoint_url=sys.argv[3], key=sys.argv[4], secret=sys.argv[5])
print("ready", flush=True)
sys.stdin.readline()  # both processes start reading at the same moment
digest = hashlib.sha256(fs.cat_file("big")).hexdigest()
print(json.dumps({"sha256": digest, **fs.cache_stats()}), flush=True)
"""


def test_two_processes_reading_one_object_fetch_each_block_once(
    raw_s3: Any, bucket: str, s3_server: SeaweedS3, cache_dir: Path
) -> None:
    data = pattern(12 * BLOCK + 11, seed=8)
    raw_s3.pipe(f"{bucket}/big", data)
    args = child_args(f"s3://{bucket}", cache_dir, s3_server)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", READ_IN_CHILD, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        results = [json.loads(p.communicate(timeout=120)[0].splitlines()[-1]) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [r["sha256"] for r in results] == [sha256(data)] * 2
    assert sum(r["misses"] for r in results) == 13  # 13 blocks, each one GET, across both processes
    assert sum(r["bytes_fetched"] for r in results) == len(data)


def test_concurrent_threads_and_processes_read_correct_bytes(
    raw_s3: Any, bucket: str, s3_server: SeaweedS3, s3_options: dict[str, Any], cache_dir: Path
) -> None:
    objects = {f"c{i}": pattern(BLOCK * (i + 1) + i, seed=20 + i) for i in range(4)}
    for name, data in objects.items():
        raw_s3.pipe(f"{bucket}/{name}", data)
    fs = pffs_fs(f"s3://{bucket}", cache_dir, memory_cache_size="1M", **s3_options)
    errors: list[str] = []

    def reader(seed: int) -> None:
        import random

        rnd = random.Random(seed)
        for _ in range(30):
            name = rnd.choice(list(objects))
            data = objects[name]
            offset, length = rnd.randrange(len(data)), rnd.randrange(BLOCK * 2)
            if fs.cat_file(name, offset, offset + length) != data[offset : offset + length]:
                errors.append(f"{name} {offset}+{length}")

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(8)]
    script = (
        "import sys, fsspec, hashlib\n"
        "fs = fsspec.filesystem('pffs', target=sys.argv[1], cache_dir=sys.argv[2], block_size='256K', "
        "endpoint_url=sys.argv[3], key=sys.argv[4], secret=sys.argv[5])\n"
        "for n in sys.argv[6:]: print(n, hashlib.sha256(fs.cat_file(n)).hexdigest())\n"
    )
    args = child_args(f"s3://{bucket}", cache_dir, s3_server)
    procs = [
        subprocess.Popen([sys.executable, "-c", script, *args, *objects], stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert errors == []
    for out in outputs:
        assert dict(line.split() for line in out.splitlines()) == {n: sha256(d) for n, d in objects.items()}


def test_bad_credentials_and_unknown_bucket_give_clear_errors(
    raw_s3: Any, bucket: str, s3_server: SeaweedS3, cache_dir: Path
) -> None:
    raw_s3.pipe(f"{bucket}/k", b"data")
    bad = pffs_fs(
        f"s3://{bucket}",
        cache_dir,
        endpoint_url=s3_server.endpoint_url,
        key="nobody",
        secret="wrong-secret-123",
    )
    with pytest.raises(PermissionError) as err:
        bad.cat_file("k")
    assert f"s3://{bucket}/k" in str(err.value) and "access denied" in str(err.value)
    assert "wrong-secret-123" not in str(err.value)

    good = pffs_fs(
        "s3://no-such-bucket-pffs",
        cache_dir,
        endpoint_url=s3_server.endpoint_url,
        key=s3_server.access_key,
        secret=s3_server.secret_key,
    )
    with pytest.raises(FileNotFoundError, match="no-such-bucket-pffs"):
        good.cat_file("k")


def test_backend_down_cached_data_reads_uncached_fails_clearly(tmp_path: Path, cache_dir: Path) -> None:
    import s3fs

    with SeaweedS3(tmp_path / "own-server") as server:
        raw = s3fs.S3FileSystem(skip_instance_cache=True, **server.storage_options())
        raw.mkdir("outage")
        warm, cold = pattern(3 * BLOCK, seed=30), pattern(2 * BLOCK, seed=31)
        raw.pipe("outage/warm", warm)
        raw.pipe("outage/cold", cold)
        options = server_options(server)
        fs = pffs_fs("s3://outage", cache_dir, metadata_ttl=3600, **options)
        assert fs.cat_file("warm") == warm
        fs.info("cold")
        server.stop()

        assert sha256(fs.cat_file("warm")) == sha256(warm)  # from the cache
        fresh = pffs_fs("s3://outage", cache_dir, metadata_ttl=3600, memory_cache_size=0, **options)
        fresh.vfs.metadata.put(fs.vfs.stat("outage/warm"))
        assert sha256(fresh.cat_file("warm")) == sha256(warm)  # from the disk tier, another process' view
        started = time.monotonic()
        with pytest.raises(BackendUnavailableError, match=r"s3://outage/cold: backend unavailable"):
            fs.cat_file("cold")
        assert time.monotonic() - started < 30


def test_listings_are_trusted_for_the_ttl_and_dropped_by_writes(
    raw_s3: Any, bucket: str, s3_options: dict[str, Any], cache_dir: Path
) -> None:
    raw_s3.pipe(f"{bucket}/d/a", b"a")
    fs = pffs_fs(f"s3://{bucket}", cache_dir, metadata_ttl=3600, **s3_options)
    assert fs.find("d") == ["d/a"] and [e["name"] for e in fs.ls("d")] == ["d/a"]
    raw_s3.pipe(f"{bucket}/d/b", b"b")  # behind pffs's back: not seen within the TTL
    assert fs.find("d") == ["d/a"] and [e["name"] for e in fs.ls("d")] == ["d/a"]
    fs.pipe_file("d/c", b"c")  # through pffs: listings are dropped
    assert fs.find("d") == ["d/a", "d/b", "d/c"]
    short = pffs_fs(f"s3://{bucket}", cache_dir, metadata_ttl=0.2, **s3_options)
    assert short.find("d") == ["d/a", "d/b", "d/c"]
    raw_s3.rm(f"{bucket}/d/a")
    time.sleep(0.3)
    assert short.find("d") == ["d/b", "d/c"]
