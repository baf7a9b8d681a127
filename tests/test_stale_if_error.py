"""Cached data through an S3 outage (issue 43): with the store stopped after the metadata TTL has passed,
every cached file reads byte-exact through the SDK and a real FUSE mount, a mount starts over its warm
cache, `--stale-if-error 0` brings the errors back, and once the store answers again a changed object
is read as its new version, never mixed with the old one."""

from __future__ import annotations

import errno
import json
import os
import sqlite3
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest
import s3fs
from helpers import pattern, sha256
from mounts import Mount, drop_page_cache

from pffs.testing.s3_server import SeaweedS3

BLOCK = 64 << 10
TTL = 1.0
# 20 files in two folders: one block, several, a partial last block, empty.
FILES = {
    **{f"a/{i:02d}.bin": pattern(1000 + i * 5000, seed=i) for i in range(10)},
    **{f"b/{i:02d}.bin": pattern(BLOCK * (i % 3 + 1) + i, seed=100 + i) for i in range(9)},
    "b/empty.bin": b"",
}
pytestmark = [pytest.mark.s3, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedS3]:
    """A server of this module's own: the tests stop it."""
    with SeaweedS3(tmp_path_factory.mktemp("outage-server")) as s3:
        yield s3


@pytest.fixture
def dataset(server: SeaweedS3) -> Iterator[tuple[s3fs.S3FileSystem, str]]:
    if server.process is None:
        server.start()  # a test before this one failed with it stopped
    raw = s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False, **server.storage_options())
    bucket = f"stale-{uuid.uuid4().hex[:10]}"
    raw.mkdir(bucket)
    raw.pipe({f"{bucket}/ds/{key}": value for key, value in FILES.items()})
    yield raw, bucket
    if server.process is None:
        server.start()


def sdk(server: SeaweedS3, bucket: str, cache_dir: Path, **options: Any) -> Any:
    return fsspec.filesystem(
        "pffs",
        target=f"s3://{bucket}/ds",
        endpoint_url=server.endpoint_url,
        key=server.access_key,
        secret=server.secret_key,
        cache_dir=str(cache_dir),
        block_size="64K",
        skip_instance_cache=True,
        **{"metadata_ttl": TTL, "backend_timeout": 20, **options},
    )


def read_all_sdk(fs: Any) -> dict[str, str]:
    return {name: sha256(fs.cat_file(name)) for name in fs.find("")}


EXPECTED = {name: sha256(data) for name, data in FILES.items()}

# A process started while the store is down: a node restarted during the outage.
RESTARTED = """
import json, sys, hashlib, fsspec
fs = fsspec.filesystem("pffs", target=sys.argv[1], endpoint_url=sys.argv[2], key=sys.argv[3],
                       secret=sys.argv[4], cache_dir=sys.argv[5], block_size="64K", metadata_ttl=1,
                       backend_timeout=20, skip_instance_cache=True)
names = sorted(fs.ls("a", detail=False) + fs.ls("b", detail=False))
print(json.dumps({n: hashlib.sha256(fs.cat_file(n)).hexdigest() for n in names}))
"""


def test_sdk_reads_every_cached_file_through_an_outage(
    server: SeaweedS3, dataset: tuple[s3fs.S3FileSystem, str], tmp_path: Path
) -> None:
    raw, bucket = dataset
    cache = tmp_path / "cache"
    fs = sdk(server, bucket, cache)
    strict = sdk(server, bucket, cache, stale_if_error=0)
    assert read_all_sdk(fs) == EXPECTED
    assert read_all_sdk(strict) == EXPECTED
    assert sorted(fs.ls("", detail=False)) == ["a", "b"]
    for folder in ("a", "b"):
        fs.ls(folder)
    assert fs.vfs.kept is not None
    fs.vfs.kept.flush()
    time.sleep(TTL * 1.5)  # every stat and listing is past its TTL
    server.stop()

    assert read_all_sdk(fs) == EXPECTED
    for name, data in FILES.items():
        with fs.open(name) as f:
            assert sha256(f.read()) == EXPECTED[name]
        assert fs.info(name)["size"] == len(data)
    with pytest.raises(FileNotFoundError):
        fs.info("a/not-there.bin")  # not in the last listing of a/
    assert fs.cache_stats()["stale_metadata_served"] > 0
    shown = subprocess.run(
        [sys.executable, "-m", "pffs.cli.main", "stats", "--json", "--cache-dir", str(cache)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert json.loads(shown.stdout)["cache"]["stale_metadata_served"] > 0, shown.stderr
    # stale_if_error=0: the errors of before
    with pytest.raises((ConnectionError, TimeoutError)):
        strict.cat_file("a/00.bin")

    restarted = subprocess.run(
        [
            sys.executable,
            "-c",
            RESTARTED,
            f"s3://{bucket}/ds",
            server.endpoint_url,
            server.access_key,
            server.secret_key,
            str(cache),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert restarted.returncode == 0, restarted.stderr[-3000:]
    assert json.loads(restarted.stdout) == {n: h for n, h in EXPECTED.items()}

    server.start()
    new = pattern(3 * BLOCK + 11, seed=999)
    raw.pipe(f"{bucket}/ds/b/02.bin", new)  # another version, of another size
    deadline = time.monotonic() + 60
    while True:  # the old version whole until the store is asked again, then the new one: never a mix
        seen = fs.cat_file("b/02.bin")
        assert sha256(seen) in (EXPECTED["b/02.bin"], sha256(new))
        if seen == new:
            break
        assert time.monotonic() < deadline, "the new version never showed"
        time.sleep(0.2)
    assert sha256(strict.cat_file("a/00.bin")) == EXPECTED["a/00.bin"]


def env_for(server: SeaweedS3) -> dict[str, str]:
    return {
        **os.environ,
        "AWS_ACCESS_KEY_ID": server.access_key,
        "AWS_SECRET_ACCESS_KEY": server.secret_key,
        "AWS_DEFAULT_REGION": "us-east-1",
    }


def read_all_mount(root: Path) -> dict[str, str]:
    return {
        f"{folder}/{name}": sha256((root / folder / name).read_bytes())
        for folder in sorted(os.listdir(root))
        for name in sorted(os.listdir(root / folder))
    }


def wait_until(what: str, condition: Any, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def kept_listings(cache: Path, kind: str = "dir") -> int:
    path = cache / "metadata.sqlite"
    if not path.exists():
        return 0
    with sqlite3.connect(path) as con:
        return int(con.execute("SELECT COUNT(*) FROM listings WHERE kind = ?", (kind,)).fetchone()[0])


def test_mount_reads_through_an_outage_and_remounts_over_its_warm_cache(
    server: SeaweedS3, dataset: tuple[s3fs.S3FileSystem, str], tmp_path: Path
) -> None:
    raw, bucket = dataset
    cache = tmp_path / "cache"
    extra = (
        "--endpoint-url",
        server.endpoint_url,
        "--block-size",
        "64K",
        "--dir-ttl",
        str(TTL),
        "--attr-ttl",
        "0.5",
        "--read-only",
    )
    source = f"s3://{bucket}/ds"
    env = env_for(server)
    with Mount(source, tmp_path / "mnt", cache, env, *extra) as mount:
        assert read_all_mount(mount.path) == EXPECTED
        for name in FILES:  # every block on disk, for the remount below
            wait_until(
                f"{name} never reached the disk tier",
                lambda n=name: float(os.getxattr(mount.path / n, "user.pffs.cached")) >= 1.0,
            )
        wait_until("the listings were never kept", lambda: kept_listings(cache) >= 3)
        time.sleep(TTL * 1.5)  # every stat and listing is past its TTL
        server.stop()
        drop_page_cache()
        assert read_all_mount(mount.path) == EXPECTED
        with pytest.raises(FileNotFoundError):
            (mount.path / "a" / "not-there.bin").stat()
        assert mount.stats()["cache"]["stale_metadata_served"] > 0
        assert mount.log().count("cannot be reached") == 1  # one line per outage episode
        assert mount.umount().returncode == 0

    # A node restarted during the outage: a mount over the warm cache starts, saying so, and reads it all.
    with Mount(source, tmp_path / "mnt", cache, env, *extra) as again:
        assert "cannot be reached" in again.log()
        drop_page_cache()
        assert read_all_mount(again.path) == EXPECTED
        assert again.stats()["cache"]["misses"] == 0

        # --stale-if-error 0: as before, a mount cannot start while the store is down
        with pytest.raises(RuntimeError, match="pffs mount failed"):
            Mount(source, tmp_path / "strict", cache, env, *extra, "--stale-if-error", "0").start()

        server.start()
        new = pattern(2 * BLOCK + 5, seed=777)
        raw.pipe(f"{bucket}/ds/a/03.bin", new)
        deadline = time.monotonic() + 60
        while True:  # the old version whole, then the new one: never a mix
            try:
                seen = sha256((again.path / "a" / "03.bin").read_bytes())
            except OSError as exc:
                assert exc.errno == errno.ESTALE
                seen = None
            assert seen in (EXPECTED["a/03.bin"], sha256(new), None)
            if seen == sha256(new):
                break
            assert time.monotonic() < deadline, "the new version never showed"
            time.sleep(0.2)
        wait_until("the end of the outage was never logged", lambda: "answers again" in again.log())


def test_a_frozen_store_is_unreachable_once_its_deadline_passes(
    server: SeaweedS3, dataset: tuple[s3fs.S3FileSystem, str], tmp_path: Path
) -> None:
    """A store that accepts connections and never answers (SIGSTOP): a stat that reaches its deadline
    (BackendTimeoutError) is served as last seen, like a refused connection, and cached data reads on."""
    _, bucket = dataset
    fs = sdk(server, bucket, tmp_path / "cache", backend_timeout=3)
    assert read_all_sdk(fs) == EXPECTED
    time.sleep(TTL * 1.5)
    with server.freeze():
        assert read_all_sdk(fs) == EXPECTED
        served = fs.cache_stats()["stale_metadata_served"]
        assert served >= len(FILES)
        assert fs.vfs.outage.active


def test_kept_listings_stay_within_their_bound(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The listings kept on disk are bounded: the least recently listed go first; one too big is not
    kept, and an older one of the same folder does not stand for it."""
    from pffs.backends.backend import ObjectInfo
    from pffs.vfs import stale

    def listing(folder: str, count: int) -> list[ObjectInfo]:
        return [
            ObjectInfo(f"b/{folder}/{os.urandom(8).hex()}", i, False, f"etag:{os.urandom(16).hex()}")
            for i in range(count)
        ]

    monkeypatch.setattr(stale, "MAX_BYTES", 64 << 10)
    monkeypatch.setattr(stale, "MAX_LISTING_BYTES", 32 << 10)
    store = stale.MetadataStore(tmp_path / "metadata.sqlite", "s3://test")
    kept = {f"d{i}": listing(f"d{i}", 100) for i in range(20)}  # ~6 KiB compressed each
    for folder, entries in kept.items():
        store.save("dir", f"b/{folder}", entries)
        store.flush()
    with sqlite3.connect(tmp_path / "metadata.sqlite") as con:
        total = con.execute("SELECT SUM(size) FROM listings").fetchone()[0]
    assert total <= 64 << 10
    assert store.listing("dir", "b/d19", 60) == kept["d19"]
    assert store.listing("dir", "b/d0", 60) is None  # the oldest went
    assert store.listing("dir", "b/d19", -1) is None  # too old for the bound asked
    store.save("dir", "b/d19", listing("d19", 2000))  # too big to keep
    store.flush()
    assert store.listing("dir", "b/d19", 60) is None
    other = stale.MetadataStore(
        tmp_path / "metadata.sqlite", "s3://other"
    )  # one origin does not see another's
    assert other.listing("dir", "b/d18", 60) is None
    assert store.listing("dir", "b/d18", 60) == kept["d18"]


def test_a_mount_whose_root_was_never_listed_starts_during_an_outage(
    server: SeaweedS3, dataset: tuple[s3fs.S3FileSystem, str], tmp_path: Path
) -> None:
    """The mount keeps its root as the store gave it: a node restarted during an outage mounts, and reads
    the folders that were listed, though nobody listed the root itself."""
    _, bucket = dataset
    cache = tmp_path / "cache"
    extra = ("--endpoint-url", server.endpoint_url, "--block-size", "64K", "--dir-ttl", str(TTL))
    source, env = f"s3://{bucket}/ds", env_for(server)
    folder = sorted(n for n in FILES if n.startswith("b/"))
    with Mount(source, tmp_path / "mnt", cache, env, *extra) as mount:
        assert sorted(os.listdir(mount.path / "b")) == [n[2:] for n in folder]
        for name in folder:
            assert sha256((mount.path / name).read_bytes()) == EXPECTED[name]
            wait_until(
                f"{name} never reached the disk tier",
                lambda n=name: float(os.getxattr(mount.path / n, "user.pffs.cached")) >= 1.0,
            )
        wait_until("the root was never kept", lambda: kept_listings(cache, "stat") >= 1)
        wait_until("b/ was never kept", lambda: kept_listings(cache) >= 1)
        assert mount.umount().returncode == 0
    server.stop()
    with Mount(source, tmp_path / "mnt", cache, env, *extra) as again:
        assert "cannot be reached" in again.log()
        drop_page_cache()
        for name in folder:
            assert sha256((again.path / name).read_bytes()) == EXPECTED[name]


def test_an_answer_is_not_an_outage(
    server: SeaweedS3, dataset: tuple[s3fs.S3FileSystem, str], tmp_path: Path
) -> None:
    """A 404 is an answer: an object deleted in the store is gone once the TTL has passed, however long
    --stale-if-error is, and nothing is counted as served stale."""
    raw, bucket = dataset
    fs = sdk(server, bucket, tmp_path / "cache")
    assert read_all_sdk(fs) == EXPECTED
    raw.rm(f"{bucket}/ds/a/05.bin")
    time.sleep(TTL * 1.5)
    with pytest.raises(FileNotFoundError):
        fs.cat_file("a/05.bin")
    assert "a/05.bin" not in fs.find("")
    assert fs.cache_stats()["stale_metadata_served"] == 0
    assert not fs.vfs.outage.active
