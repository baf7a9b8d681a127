"""Random reads fetch about what they read, through the SDK and a real mount (issue 34), on real S3.

A random read fetches its bytes rounded out to pages (what FUSE asks for): 64 KiB pieces where it fills one,
pages at its ends; it starts no read-ahead (not even when the kernel sends it as several requests), and the
kernel reads it as it is. Two readers of one missing piece share one fetch. Byte counts, not timings.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import pattern, pffs_fs, sha256
from mounts import mounted

from pffs.vfs.byte_ranges import covered_bytes
from pffs.vfs.pieces import PAGE_PIECE_SIZE, PIECE_SIZE

pytestmark = pytest.mark.timeout(180)

MiB = 1 << 20
SIZE = 96 * MiB + 1000  # as the issue's: the kernel reads ahead of reads landing next to cached pages
READS = {4 << 10: 200, 64 << 10: 60, MiB: 8}  # read size -> reads
LIMIT = 1.25


def offsets(length: int, reads: int, align: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(o) // align * align for o in rng.integers(0, SIZE - length, reads)]


def gets(fs: Any) -> int:
    return int(fs.vfs.backend.requests.snapshot().get("get", {}).get("requests", 0))


def cases() -> list[tuple[int, int]]:
    """(read size, offset alignment): 4 KiB reads at page offsets (an unaligned one spans two pages, which
    the kernel reads whole), bigger ones at any offset."""
    return [(4 << 10, PAGE_PIECE_SIZE), (64 << 10, 1), (MiB, 1)]


@pytest.fixture
def data(raw_s3: Any, bucket: str) -> bytes:
    data = pattern(SIZE, seed=34)
    raw_s3.pipe(f"{bucket}/obj", data)
    return data


@pytest.mark.parametrize(("length", "align"), cases())
def test_sdk_random_reads_fetch_at_most_a_quarter_more_than_they_read(
    data: bytes, bucket: str, s3_options: dict[str, Any], cache_dir: Path, length: int, align: int
) -> None:
    fs = pffs_fs(f"s3://{bucket}", cache_dir, block_size="4M", **s3_options)
    where = offsets(length, READS[length], align, seed=length)
    with fs.open("obj", "rb") as f:
        for offset in where:
            f.seek(offset)
            assert f.read(length) == data[offset : offset + length], offset
    read = covered_bytes([(o, o + length) for o in where])
    fetched = fs.cache_stats()["bytes_fetched"]
    assert fetched <= LIMIT * read, f"fetched {fetched} for {read} bytes read ({fetched / read:.2f}x)"
    assert gets(fs) <= len(where) + 1  # one GET per read (two for the odd one across a block boundary)

    # Again, from the cache: byte-exact, nothing fetched.
    with fs.open("obj", "rb") as f:
        got = []
        for offset in where:
            f.seek(offset)
            got.append(f.read(length))
    assert sha256(b"".join(got)) == sha256(b"".join(data[o : o + length] for o in where))
    assert fs.cache_stats()["bytes_fetched"] == fetched


# At page offsets: a read at any offset makes the kernel read one more page, and, landing next to pages an
# earlier read left in the page cache, sometimes read ahead of it (64 KiB at any offset: 1.27x on 96 MiB,
# 1.5x on a 24 MiB one, where that is more frequent; issue 34, left open).
@pytest.mark.parametrize("length", list(READS))
def test_mount_random_reads_fetch_at_most_a_quarter_more_than_they_read(
    data: bytes, bucket: str, s3_server: Any, s3_env: dict[str, str], tmp_path: Path, length: int
) -> None:
    extra = ("--endpoint-url", s3_server.endpoint_url, "--read-only")
    where = offsets(length, READS[length], PAGE_PIECE_SIZE, seed=length + 1)
    with mounted(f"s3://{bucket}", tmp_path, s3_env, *extra) as mount:
        before = mount.stats()["cache"]["bytes_fetched"]
        fd = os.open(mount.path / "obj", os.O_RDONLY)
        try:
            for offset in where:
                assert os.pread(fd, length, offset) == data[offset : offset + length], offset
        finally:
            os.close(fd)
        fetched = mount.stats()["cache"]["bytes_fetched"] - before
    read = covered_bytes([(o, o + length) for o in where])
    assert fetched <= LIMIT * read, f"fetched {fetched} for {read} bytes read ({fetched / read:.2f}x)"


def test_two_readers_of_one_piece_fetch_it_once(
    data: bytes, bucket: str, s3_options: dict[str, Any], cache_dir: Path
) -> None:
    fs = pffs_fs(f"s3://{bucket}", cache_dir, block_size="4M", **s3_options)
    info = fs.vfs.stat(f"{bucket}/obj")
    backend, flight = fs.vfs.backend, fs.vfs.cache._flight
    followers = threading.Semaphore(0)
    calls: list[tuple[int, int]] = []
    read_range, claim = backend.read_range, flight.claim

    def counted_claim(key: str) -> Any:
        future, leader = claim(key)
        if not leader:
            followers.release()
        return future, leader

    def read_range_once_followed(info: Any, start: int, end: int, **kwargs: Any) -> Any:
        calls.append((start, end))
        assert followers.acquire(timeout=20), "the second reader never waited for this fetch"
        return read_range(info, start, end, **kwargs)

    flight.claim = counted_claim  # type: ignore[method-assign]
    backend.read_range = read_range_once_followed  # type: ignore[method-assign]
    offset = 5 * MiB + 3 * PIECE_SIZE + 100  # a 64 KiB piece and a page: both readers want both
    results: list[bytes] = [b"", b""]

    def reader(n: int) -> None:
        handle = fs.vfs.open_version(info)  # a handle's first read away from 0: a random one
        results[n] = handle.read(offset, PIECE_SIZE)
        handle.close()

    threads = [threading.Thread(target=reader, args=(n,)) for n in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert results == [data[offset : offset + PIECE_SIZE]] * 2
    assert calls == [(5 * MiB + 3 * PIECE_SIZE, 5 * MiB + 4 * PIECE_SIZE + PAGE_PIECE_SIZE)]  # one GET
    stats = fs.cache_stats()
    assert (stats["misses"], stats["bytes_fetched"]) == (2, PIECE_SIZE + PAGE_PIECE_SIZE)


def test_a_sequential_read_still_reads_ahead_in_whole_blocks(
    data: bytes, bucket: str, s3_options: dict[str, Any], cache_dir: Path
) -> None:
    fs = pffs_fs(f"s3://{bucket}", cache_dir, block_size="1M", **s3_options)
    with fs.open("obj", "rb") as f:
        digest = sha256(b"".join(iter(lambda: f.read(256 << 10), b"")))
    assert digest == sha256(data)
    blocks = -(-SIZE // MiB)
    assert fs.cache_stats()["bytes_fetched"] == SIZE  # each byte once
    assert gets(fs) == blocks  # in whole blocks: one GET per block, none for pieces
    stats = fs.cache_stats()
    assert stats["misses"] + stats["prefetches"] == blocks  # fetched for the reader, or ahead of it


def test_a_stream_after_a_seek_is_a_stream_again_past_a_few_mib(
    data: bytes, bucket: str, s3_options: dict[str, Any], cache_dir: Path
) -> None:
    fs = pffs_fs(f"s3://{bucket}", cache_dir, block_size="1M", **s3_options)
    start = 3 * MiB + 4096
    with fs.open("obj", "rb") as f:
        f.seek(start)
        got = b"".join(iter(lambda: f.read(MiB), b""))
    assert got == data[start:]
    fetched = fs.cache_stats()["bytes_fetched"]
    assert fetched <= (SIZE - start) + 4 * MiB  # the first MiB fetched twice at most: pieces, then blocks
    assert gets(fs) <= 4 + -(-SIZE // MiB)  # then whole blocks with read-ahead
