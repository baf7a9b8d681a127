"""The SDK over local and in-memory backends: byte-exact reads, listings, writes, forked workers."""

from __future__ import annotations

import multiprocessing
import os
import threading
from pathlib import Path
from typing import Any

import fsspec
import pytest
from helpers import pattern, pffs_fs, sha256
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pffs

BLOCK = 256 * 1024
SIZES = [0, 1, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 7]


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    root = tmp_path / "data"
    (root / "sub").mkdir(parents=True)
    for i, size in enumerate(SIZES):
        (root / f"f{size}.bin").write_bytes(pattern(size, seed=i))
    (root / "sub" / "nested.bin").write_bytes(pattern(1000, seed=99))
    return root


def test_whole_reads_are_byte_exact_at_every_size(dataset: Path, cache_dir: Path) -> None:
    fs = pffs_fs(str(dataset), cache_dir)
    for i, size in enumerate(SIZES):
        expected = pattern(size, seed=i)
        assert sha256(fs.cat_file(f"f{size}.bin")) == sha256(expected)
        with fs.open(f"f{size}.bin") as f:
            assert sha256(f.read()) == sha256(expected)
        # second time from the cache, still exact
        assert sha256(fs.cat_file(f"f{size}.bin")) == sha256(expected)


def test_a_small_file_read_twice_comes_from_memory_the_second_time(dataset: Path, cache_dir: Path) -> None:
    fs = pffs_fs(str(dataset), cache_dir)
    name, expected = f"f{BLOCK - 1}.bin", pattern(BLOCK - 1, seed=SIZES.index(BLOCK - 1))
    assert fs.cat_file(name) == expected
    before = fs.cache_stats()
    assert fs.cat_file(name) == expected
    after = fs.cache_stats()
    assert (after["memory_hits"] - before["memory_hits"], after["disk_hits"] - before["disk_hits"]) == (1, 0)


def test_reads_at_block_boundaries_and_past_eof(dataset: Path, cache_dir: Path) -> None:
    fs = pffs_fs(str(dataset), cache_dir)
    size = 3 * BLOCK + 7
    expected = pattern(size, seed=SIZES.index(size))
    with fs.open(f"f{size}.bin") as f:
        for offset in [0, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK - 3, 3 * BLOCK, size - 1]:
            for length in [1, 2, BLOCK, BLOCK + 2, 2 * BLOCK + 1]:
                f.seek(offset)
                assert f.read(length) == expected[offset : offset + length], (offset, length)
        f.seek(size)
        assert f.read(10) == b""
        f.seek(size + 100)
        assert f.read(10) == b""
    assert fs.cat_file(f"f{size}.bin", start=size - 3, end=size + 50) == expected[-3:]
    assert fs.cat_file(f"f{size}.bin", start=-5) == expected[-5:]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    reads=st.lists(
        st.tuples(st.integers(0, 3 * BLOCK + 50), st.integers(0, 2 * BLOCK)), min_size=1, max_size=8
    )
)
def test_random_ranges_match_the_source(dataset: Path, cache_dir: Path, reads: list[tuple[int, int]]) -> None:
    size = 3 * BLOCK + 7
    expected = pattern(size, seed=SIZES.index(size))
    fs = pffs_fs(str(dataset), cache_dir)
    with fs.open(f"f{size}.bin") as f:
        for offset, length in reads:
            f.seek(offset)
            assert f.read(length) == expected[offset : offset + length]
    assert fs.cat_ranges([f"f{size}.bin"] * len(reads), [o for o, _ in reads], [o + n for o, n in reads]) == [
        expected[o : o + n] for o, n in reads
    ]


def test_listing_find_and_info(dataset: Path, cache_dir: Path) -> None:
    fs = pffs_fs(str(dataset), cache_dir)
    names = {e["name"]: e for e in fs.ls("")}
    assert set(names) == {f"f{s}.bin" for s in SIZES} | {"sub"}
    assert names["sub"]["type"] == "directory"
    assert names[f"f{BLOCK}.bin"]["size"] == BLOCK
    assert "sub/nested.bin" in fs.find("")
    assert fs.info("sub/nested.bin")["size"] == 1000
    assert fs.exists("f0.bin") and not fs.exists("missing.bin")
    with pytest.raises(FileNotFoundError, match=r"missing\.bin"):
        fs.cat_file("missing.bin")
    with pytest.raises(IsADirectoryError):
        fs.open("sub")


def test_changed_local_file_is_read_new_after_the_ttl(tmp_path: Path, cache_dir: Path) -> None:
    path = tmp_path / "x.bin"
    path.write_bytes(pattern(BLOCK * 2, seed=1))
    fs = pffs_fs(str(tmp_path), cache_dir, metadata_ttl=0)
    assert fs.cat_file("x.bin") == pattern(BLOCK * 2, seed=1)
    path.write_bytes(pattern(BLOCK * 2 + 5, seed=2))
    os.utime(path, ns=(1, 2_000_000_000))  # a different mtime, even on coarse-clock filesystems
    assert fs.cat_file("x.bin") == pattern(BLOCK * 2 + 5, seed=2)


def test_writes_go_to_the_backend_and_are_read_back_new(cache_dir: Path) -> None:
    target = f"memory://pffs-test-{os.getpid()}-writes"
    fs = pffs_fs(target, cache_dir, metadata_ttl=3600)
    fs.pipe_file("a.bin", b"first version")
    assert fs.cat_file("a.bin") == b"first version"
    with fs.open("a.bin", "wb") as f:
        f.write(b"second, longer version")
    assert fs.cat_file("a.bin") == b"second, longer version"  # no stale size or blocks despite the long TTL
    with fs.open("notes.txt", "w") as f:
        f.write("text mode works")
    with fs.open("notes.txt", "r") as f:
        assert f.read() == "text mode works"
    fs.rm("a.bin")
    assert not fs.exists("a.bin")


def test_chained_url_and_one_line_open(dataset: Path, cache_dir: Path) -> None:
    expected = pattern(BLOCK + 1, seed=SIZES.index(BLOCK + 1))
    url = f"pffs::file://{dataset}/f{BLOCK + 1}.bin"
    with fsspec.open(url, "rb", pffs={"cache_dir": str(cache_dir)}) as f:
        assert f.read() == expected
    with pffs.open(str(dataset / f"f{BLOCK + 1}.bin"), cache_dir=str(cache_dir)) as f:
        assert f.read() == expected


def test_threads_reading_at_once_get_correct_bytes(dataset: Path, cache_dir: Path) -> None:
    size = 3 * BLOCK + 7
    expected = pattern(size, seed=SIZES.index(size))
    fs = pffs_fs(str(dataset), cache_dir, memory_cache_size="512K")
    errors: list[str] = []

    def reader(seed: int) -> None:
        import random

        rnd = random.Random(seed)
        with fs.open(f"f{size}.bin") as f:
            for _ in range(50):
                offset, length = rnd.randrange(size), rnd.randrange(2 * BLOCK)
                f.seek(offset)
                if f.read(length) != expected[offset : offset + length]:
                    errors.append(f"thread {seed}: bad bytes at {offset}+{length}")

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []


def _read_in_worker(fs: Any, name: str) -> str:
    return sha256(fs.cat_file(name))


def test_forked_workers_like_a_dataloader(dataset: Path, cache_dir: Path) -> None:
    """DataLoader workers fork after the parent has read: no lock, thread or loop may carry over."""
    fs = pffs_fs(str(dataset), cache_dir)
    names = [f"f{s}.bin" for s in SIZES]
    parent = [sha256(fs.cat_file(n)) for n in names]  # parent threads and caches are warm before the fork
    with multiprocessing.get_context("fork").Pool(3) as pool:
        forked = pool.starmap(_read_in_worker, [(fs, n) for n in names])
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        spawned = pool.starmap(_read_in_worker, [(fs, n) for n in names])  # the filesystem pickles
    assert forked == parent == spawned == [sha256(pattern(s, seed=i)) for i, s in enumerate(SIZES)]
