"""pffs over a real HDFS: Hadoop's MiniDFSCluster (one NameNode, two DataNodes, WebHDFS on; see
pffs.testing.hdfs_cluster), through the SDK (`hdfs://` with hdfs-native, `webhdfs://` with fsspec's
WebHDFS) and through the FUSE mount. Every byte is checked by sha256 against what was written into HDFS.

Marked `hdfs`: CI builds the cluster's jars (make setup) and runs these every time; a plain local pytest
without Java or the jars skips them, saying what is missing.
"""

from __future__ import annotations

import errno
import multiprocessing
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest
from helpers import pattern, require, sha256
from mounts import mounted, pffs
from test_csi import Plugin, staging_path, target_path

from pffs.testing.hdfs_cluster import MiniDfs, missing_pieces
from pffs.testing.s3_server import free_ports

pytestmark = [pytest.mark.hdfs, pytest.mark.timeout(300)]
BLOCK = 1 << 20  # pffs's cache block in these tests
TIMEOUT_S = 3.0
MARGIN_S = 4.0


@pytest.fixture(scope="module")
def hdfs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MiniDfs]:
    require(missing_pieces(), "a real HDFS (MiniDFSCluster)")
    with MiniDfs(tmp_path_factory.mktemp("minidfs")) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def raw(hdfs: MiniDfs) -> Any:
    """hdfs-native straight to the cluster, for putting data in place and checking what pffs wrote."""
    return fsspec.filesystem("hdfs", host="127.0.0.1", port=hdfs.rpc_port, skip_instance_cache=True)


def put(raw: Any, files: dict[str, bytes]) -> None:
    for path, data in files.items():
        with raw.open(path, "wb") as f:
            f.write(data)


SIZES = {"empty": 0, "tiny": 100, "one-block": BLOCK, "blocks": 3 * BLOCK + 12345}


@pytest.mark.parametrize("scheme", ["hdfs", "webhdfs"])
def test_sdk_reads_are_byte_exact_at_every_size_and_boundary(
    hdfs: MiniDfs, raw: Any, tmp_path: Path, scheme: str
) -> None:
    base = f"/sdk-{scheme}"
    files = {f"{base}/{name}.bin": pattern(size, seed=i) for i, (name, size) in enumerate(SIZES.items())}
    put(raw, files)
    url = hdfs.url if scheme == "hdfs" else hdfs.webhdfs_url
    extra = {"user": "root"} if scheme == "webhdfs" else {}
    fs = fsspec.filesystem(
        "pffs", target=f"{url}{base}", cache_dir=str(tmp_path / "cache"), block_size=BLOCK, **extra
    )
    assert sorted(fs.ls("", detail=False)) == sorted(p.rsplit("/", 1)[1] for p in files)
    for path, data in files.items():
        name = path.rsplit("/", 1)[1]
        assert sha256(fs.cat_file(name)) == sha256(data), name
        for start, end in ((BLOCK - 10, BLOCK + 10), (len(data) - 5, len(data) + 100), (len(data) + 7, None)):
            if start >= 0:
                assert fs.cat_file(name, start=start, end=end) == data[start:end], (name, start, end)
    assert sha256(fs.cat_file("blocks.bin")) == sha256(files[f"{base}/blocks.bin"])  # again, from the cache


def test_a_rewritten_file_is_never_a_mix_and_is_new_after_the_ttl(
    hdfs: MiniDfs, raw: Any, tmp_path: Path
) -> None:
    old, new = pattern(3 * BLOCK, seed=1), pattern(3 * BLOCK, seed=2)  # the same size: only mtime tells
    put(raw, {"/rewrite/f.bin": old})
    fs = fsspec.filesystem(
        "pffs", target=f"{hdfs.url}/rewrite", cache_dir=str(tmp_path / "cache"), block_size=BLOCK,
        metadata_ttl=1,
    )  # fmt: skip
    with fs.open("f.bin") as f:
        first = f.read(BLOCK)  # one block cached from the old version
        time.sleep(0.05)
        put(raw, {"/rewrite/f.bin": new})
        try:  # pinned at open: the old version's bytes, or ESTALE; never the new ones, never a mix
            assert first + f.read() == old
        except OSError as exc:
            assert exc.errno == errno.ESTALE, exc
    time.sleep(1.2)
    assert sha256(fs.cat_file("f.bin")) == sha256(new)


def test_mount_reads_writes_renames_and_removes_exactly(hdfs: MiniDfs, raw: Any, tmp_path: Path) -> None:
    data = pattern(2 * BLOCK + 77, seed=3)
    put(raw, {"/mnt/data/a.bin": data, "/mnt/data/sub/b.bin": b"b" * 1000})
    with mounted(f"{hdfs.url}/mnt", tmp_path, dict(os.environ), "--block-size", "1M") as mount:
        assert sha256((mount.path / "data" / "a.bin").read_bytes()) == sha256(data)
        assert sorted(os.listdir(mount.path / "data")) == ["a.bin", "sub"]
        written = pattern(BLOCK + 5, seed=4)
        (mount.path / "data" / "new.bin").write_bytes(written)
        assert sha256(raw.cat_file("/mnt/data/new.bin")) == sha256(written)  # visible in HDFS after close
        os.rename(mount.path / "data" / "new.bin", mount.path / "data" / "moved.bin")
        assert not raw.exists("/mnt/data/new.bin")
        assert sha256(raw.cat_file("/mnt/data/moved.bin")) == sha256(written)
        os.rename(mount.path / "data" / "sub", mount.path / "data" / "sub2")  # HDFS renames directories
        assert raw.cat_file("/mnt/data/sub2/b.bin") == b"b" * 1000 and not raw.exists("/mnt/data/sub")
        os.unlink(mount.path / "data" / "moved.bin")
        os.unlink(mount.path / "data" / "sub2" / "b.bin")
        os.rmdir(mount.path / "data" / "sub2")
        assert sorted(p.rsplit("/", 1)[1] for p in raw.ls("/mnt/data", detail=False)) == ["a.bin"]
        with pytest.raises(OSError) as caught:
            os.stat(mount.path / "data" / ("n" * 256))
        assert caught.value.errno == errno.ENAMETOOLONG


def warm_and_cold(
    hdfs: MiniDfs, raw: Any, tmp_path: Path, folder: str, seed: int
) -> tuple[Any, bytes, bytes]:
    """An SDK file system on `folder` with warm.bin read (cached) and apart/cold.bin only stat'ed (its size
    known: a read must reach the DataNodes), with the deadline of these tests."""
    warm, cold = pattern(BLOCK, seed=seed), pattern(BLOCK, seed=seed + 1)
    put(raw, {f"{folder}/warm.bin": warm, f"{folder}/apart/cold.bin": cold})
    fs = fsspec.filesystem(
        "pffs", target=f"{hdfs.url}{folder}", cache_dir=str(tmp_path / "cache"), block_size=BLOCK,
        backend_timeout=TIMEOUT_S,
    )  # fmt: skip
    assert sha256(fs.cat_file("warm.bin")) == sha256(warm)
    fs.info("apart/cold.bin")
    return fs, warm, cold


def assert_uncached_fails_in_time_and_cached_is_served(
    fs: Any, warm: bytes, error: type[BaseException]
) -> None:
    started = time.monotonic()
    with pytest.raises(error) as caught:
        fs.cat_file("apart/cold.bin")
    seconds = time.monotonic() - started
    assert seconds < TIMEOUT_S + MARGIN_S, f"an uncached read took {seconds:.1f} s to fail"
    assert "cold.bin" in str(caught.value)
    assert sha256(fs.cat_file("warm.bin")) == sha256(warm)  # cached: served meanwhile


def test_a_frozen_hdfs_fails_uncached_reads_in_time_and_serves_cached_ones(
    hdfs: MiniDfs, raw: Any, tmp_path: Path
) -> None:
    fs, warm, cold = warm_and_cold(hdfs, raw, tmp_path, "/frozen", seed=5)
    with hdfs.freeze():
        assert_uncached_fails_in_time_and_cached_is_served(fs, warm, TimeoutError)
    assert sha256(fs.cat_file("apart/cold.bin")) == sha256(cold)  # recovered


def test_a_stopped_datanode_leaves_every_byte_readable(hdfs: MiniDfs, raw: Any, tmp_path: Path) -> None:
    data = pattern(4 * BLOCK, seed=7)
    put(raw, {"/replicas/f.bin": data})  # replication 2: a copy on each DataNode
    hdfs.stop_datanode(0)
    try:
        fs = fsspec.filesystem(
            "pffs", target=f"{hdfs.url}/replicas", cache_dir=str(tmp_path / "cache"), block_size=BLOCK
        )
        assert sha256(fs.cat_file("f.bin")) == sha256(data)
    finally:
        hdfs.start_datanode()


def test_a_stopped_namenode_fails_uncached_reads_in_time_and_recovers(
    hdfs: MiniDfs, raw: Any, tmp_path: Path
) -> None:
    fs, warm, cold = warm_and_cold(hdfs, raw, tmp_path, "/nn-down", seed=8)
    hdfs.stop_namenode()
    try:  # refused: retried within the deadline, then given up
        assert_uncached_fails_in_time_and_cached_is_served(fs, warm, OSError)
    finally:
        hdfs.start_namenode()
    data = poll_read(fs, "apart/cold.bin")
    assert sha256(data) == sha256(cold)  # recovered once the NameNode is back


def poll_read(fs: Any, path: str, timeout_s: float = 60.0) -> bytes:
    """The file's bytes once the backend answers again (a restarted NameNode takes a few seconds)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return bytes(fs.cat_file(path))
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def test_bad_hdfs_urls_and_an_unreachable_namenode_are_one_clear_line(tmp_path: Path) -> None:
    nobody = f"hdfs://127.0.0.1:{free_ports(1)[0]}/data"  # no NameNode listens there
    env = dict(os.environ)
    cases = [
        (["cat", f"{nobody}/a.bin", "--backend-timeout", "2"], 1, nobody),
        (["cat", "hdfs://bad host:x/y"], 2, "not a usable hdfs URL"),
        (
            ["mount", nobody, str(tmp_path / "mnt"), "--backend-timeout", "2", "--cache-dir", str(tmp_path)],
            1,
            nobody,
        ),
    ]
    (tmp_path / "mnt").mkdir()
    for args, code, expected in cases:
        done = pffs(*args, env=env, timeout=60)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == code and len(lines) == 1 and expected in lines[0], (args, done.stderr)
        assert "Traceback" not in done.stderr and "internal error" not in done.stderr
    assert not os.path.ismount(tmp_path / "mnt")
    fs = fsspec.filesystem("pffs", target=nobody, cache_dir=str(tmp_path / "c"), backend_timeout=2)
    with pytest.raises(OSError) as caught:
        fs.cat_file("a.bin")
    assert f"{nobody}/a.bin" in str(caught.value)


def test_a_write_while_a_datanode_is_down_lands_exactly_or_stays_staged(
    hdfs: MiniDfs, raw: Any, tmp_path: Path
) -> None:
    written = pattern(2 * BLOCK + 3, seed=10)
    raw.mkdir("/dn-down")
    with mounted(f"{hdfs.url}/dn-down", tmp_path, dict(os.environ), "--block-size", "1M") as mount:
        hdfs.stop_datanode(0)
        try:
            try:
                (mount.path / "w.bin").write_bytes(written)
                landed = True
            except OSError:  # the upload failed: the file stays staged, uploaded at the next fsync
                landed = False
        finally:
            hdfs.start_datanode()
        if not landed:
            with open(mount.path / "w.bin", "r+b") as f:
                os.fsync(f.fileno())
        assert sha256(raw.cat_file("/dn-down/w.bin")) == sha256(written)


def test_a_directory_of_10000_files_is_listed_whole_in_one_listing(
    hdfs: MiniDfs, raw: Any, tmp_path: Path
) -> None:
    hdfs.make_files("/many/files", 10_000, 0)  # empty files: no blocks to write, so a few seconds
    names = [f"f{i:05d}" for i in range(10_000)]
    data = {f"/many/files/{names[i]}": pattern(1000 + i, seed=i) for i in (0, 4321, 9999)}
    put(raw, data)  # three with bytes, rewritten by a client
    with mounted(f"{hdfs.url}/many", tmp_path, dict(os.environ)) as mount:
        assert sorted(os.listdir(mount.path / "files")) == names
        for path, content in data.items():
            assert sha256((mount.path / path.removeprefix("/many/")).read_bytes()) == sha256(content)
        assert (mount.path / "files" / names[5]).read_bytes() == b""
        requests = mount.stats()["backend_requests"]
        assert requests["list"]["requests"] <= 3, requests  # the listing, not a request per file
        assert requests.get("head", {}).get("requests", 0) <= 2, requests


def test_a_csi_volume_with_an_hdfs_source_stages_publishes_and_reads_exactly(
    hdfs: MiniDfs, raw: Any, tmp_path: Path
) -> None:
    """The kubelet's calls on `pffs csi` (see test_csi.py) for a volume whose source is an hdfs:// path."""
    files = {"/csi/set/a.bin": pattern(2 * BLOCK + 9, seed=11), "/csi/set/sub/b.bin": pattern(500, seed=12)}
    put(raw, files)
    with Plugin(tmp_path) as plugin:  # stopped, and nothing it mounted left, even on failure
        staging, target = staging_path(tmp_path, "pv-hdfs"), target_path(tmp_path, "pod-1")
        plugin.stage("pv-hdfs", staging, {"source": f"{hdfs.url}/csi/set", "blockSize": "1M"}, {})
        plugin.publish("pv-hdfs", staging, target)
        for path, data in files.items():
            assert sha256((target / path.removeprefix("/csi/set/")).read_bytes()) == sha256(data)
        plugin.unpublish("pv-hdfs", target)
        plugin.unstage("pv-hdfs", staging)
        assert not os.path.ismount(staging) and not os.path.ismount(target)


def _read_in_child(fs: Any, name: str) -> str:
    return sha256(fs.cat_file(name))


def test_forked_workers_do_not_hang_after_the_parent_read_hdfs(
    hdfs: MiniDfs, raw: Any, tmp_path: Path
) -> None:
    """DataLoader workers fork after the parent has read through hdfs-native. A child used to hang for good
    as fsspec dropped its cached file systems at fork (an hdfs-native client freed in a forked child waits
    for threads fork did not copy): now every client the parent had is kept, never freed, in the child."""
    put(raw, {"/forked/a.bin": pattern(BLOCK, seed=20)})
    hdfs_fs = fsspec.filesystem("pffs", target=f"{hdfs.url}/forked", cache_dir=str(tmp_path / "c"))
    assert hdfs_fs.cat_file("a.bin") == pattern(BLOCK, seed=20)
    local = tmp_path / "local"
    local.mkdir()
    (local / "b.bin").write_bytes(pattern(5000, seed=21))
    local_fs = fsspec.filesystem("pffs", target=str(local), cache_dir=str(tmp_path / "c"))
    with multiprocessing.get_context("fork").Pool(2) as pool:
        got = pool.starmap_async(_read_in_child, [(local_fs, "b.bin")] * 2).get(timeout=60)
    assert got == [sha256(pattern(5000, seed=21))] * 2


def test_forked_workers_read_hdfs_after_the_parent_did(hdfs: MiniDfs, raw: Any, tmp_path: Path) -> None:
    """A child forked while the parent's hdfs-native client is live may find one of its runtime's locks held
    for good (1 child in 3 hung here): such a child reads through helper processes of its own instead.
    Several rounds of fresh workers, each reading files the parent never read, exactly."""
    files = {f"/forked2/f{i}.bin": pattern(BLOCK + i, seed=30 + i) for i in range(7)}
    put(raw, files)
    fs = fsspec.filesystem(
        "pffs", target=f"{hdfs.url}/forked2", cache_dir=str(tmp_path / "c"), block_size=BLOCK,
        backend_timeout=20,
    )  # fmt: skip
    names = [p.rsplit("/", 1)[1] for p in files]
    assert sha256(fs.cat_file(names[0])) == sha256(files["/forked2/f0.bin"])
    for round_ in range(3):
        fresh = [names[0], names[1 + 2 * round_], names[2 + 2 * round_]]
        raw.cat_file("/forked2/f0.bin", start=0, end=10)  # an hdfs-native client busy right before the fork
        with multiprocessing.get_context("fork").Pool(2) as pool:
            got = pool.starmap_async(_read_in_child, [(fs, n) for n in fresh]).get(timeout=60)
        assert got == [sha256(files[f"/forked2/{n}"]) for n in fresh], round_


def _read_in_child_timed(fs: Any, name: str) -> tuple[str, float]:
    started = time.monotonic()
    try:
        return sha256(fs.cat_file(name)), time.monotonic() - started
    except TimeoutError as exc:
        return f"TimeoutError: {exc}", time.monotonic() - started


def test_a_forked_worker_meets_the_deadline_on_a_frozen_hdfs_and_recovers(
    hdfs: MiniDfs, raw: Any, tmp_path: Path
) -> None:
    """The helper processes a forked child reads through are bound by the same backend deadline: with the
    whole HDFS frozen a worker's uncached read fails in time (its helper is killed, not waited for), a
    cached one is served, and after the thaw the worker reads exactly again."""
    files = {f"/forked3/f{i}.bin": pattern(BLOCK + 3 + i, seed=40 + i) for i in range(2)}
    put(raw, files)
    fs = fsspec.filesystem(
        "pffs", target=f"{hdfs.url}/forked3", cache_dir=str(tmp_path / "c"), block_size=BLOCK,
        backend_timeout=3,
    )  # fmt: skip
    assert sha256(fs.cat_file("f0.bin")) == sha256(files["/forked3/f0.bin"])
    with multiprocessing.get_context("fork").Pool(1) as pool:
        assert pool.apply_async(fs.ls, ("",)).get(timeout=60)  # the worker's helper has started
        with hdfs.freeze():
            cached = pool.apply_async(_read_in_child_timed, (fs, "f0.bin")).get(timeout=60)
            cold = pool.apply_async(_read_in_child_timed, (fs, "f1.bin")).get(timeout=60)
        # A fetch begun in the freeze may still be failing: a reader that joins it fails too, the next not.
        give_up = time.monotonic() + 30
        while (after := pool.apply_async(_read_in_child_timed, (fs, "f1.bin")).get(timeout=60))[0].startswith(
            "TimeoutError"
        ) and time.monotonic() < give_up:
            time.sleep(0.2)
    assert cached[0] == sha256(files["/forked3/f0.bin"])
    assert cold[0].startswith("TimeoutError") and "hdfs://" in cold[0], cold
    assert cold[1] < 3 + 5, cold  # the deadline plus a margin, never the client's own minutes
    assert after[0] == sha256(files["/forked3/f1.bin"]), after
