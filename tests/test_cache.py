"""The block cache on its own: tiers, bounds, checksums, single-flight, cross-process sharing, bad disks."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest
from helpers import pattern, sha256

from pffs.cache import BlockCache
from pffs.cache.block_format import CorruptBlockError, header_size, pack_block, unpack_block
from pffs.cache.memory_tier import MemoryTier
from pffs.cache.single_flight import SingleFlight
from pffs.cache.stats import CacheStats, read_totals
from pffs.testing.s3_server import SeaweedS3

KIB = 1024


def block_files(cache_dir: Path) -> list[Path]:
    return sorted((cache_dir / "blocks").rglob("*.blk"))


def test_memory_tier_is_bounded_and_evicts_least_recently_used() -> None:
    tier = MemoryTier(capacity_bytes=3 * KIB, stats=CacheStats())
    for name in "abc":
        tier.put(name, bytes(KIB))
    assert tier.get("a") is not None  # a is now the most recently used
    tier.put("d", bytes(KIB))
    assert tier.get("b") is None
    assert {k for k in "acd" if tier.get(k) is not None} == {"a", "c", "d"}
    assert tier.used_bytes == 3 * KIB
    assert tier.stats.snapshot()["memory_evictions"] == 1


def test_block_format_detects_truncation_and_bit_flips() -> None:
    stored = pack_block(b"x" * 1000)
    assert bytes(unpack_block(stored)) == b"x" * 1000
    with pytest.raises(CorruptBlockError, match="truncated"):
        unpack_block(stored[:-1])
    flipped = bytearray(stored)
    flipped[header_size(1000) + 500] ^= 1  # a payload byte (the header is padded to 4 KiB)
    with pytest.raises(CorruptBlockError, match="checksum"):
        unpack_block(bytes(flipped))
    with pytest.raises(CorruptBlockError):
        unpack_block(b"tiny")


def test_single_flight_runs_one_fetch_for_many_waiters() -> None:
    flight: SingleFlight[bytes] = SingleFlight()
    calls = []
    started = threading.Event()

    def slow_fetch() -> bytes:
        calls.append(1)
        started.set()
        time.sleep(0.2)
        return b"data"

    results: list[bytes] = []
    threads = [
        threading.Thread(target=lambda: results.append(flight.run("k", lambda publish: slow_fetch())))
        for _ in range(16)
    ]
    threads[0].start()
    started.wait(5)
    for t in threads[1:]:
        t.start()
    for t in threads:
        t.join(10)
    assert calls == [1]
    assert results == [b"data"] * 16


def test_single_flight_waiters_get_a_published_result_before_the_leader_finishes() -> None:
    flight: SingleFlight[bytes] = SingleFlight()
    published, leader_done = threading.Event(), threading.Event()

    def leader(publish: Callable[[bytes], None]) -> bytes:
        publish(b"early")
        published.set()
        time.sleep(0.5)  # e.g. writing the block to disk
        leader_done.set()
        return b"early"

    t = threading.Thread(target=flight.run, args=("k", leader))
    t.start()
    published.wait(5)
    assert flight.run("k", lambda publish: b"refetched") in (b"early", b"refetched")
    assert not leader_done.is_set()  # nobody waited for the leader's slow tail
    t.join(5)


def test_single_flight_passes_errors_to_every_waiter_and_forgets_them() -> None:
    flight: SingleFlight[bytes] = SingleFlight()

    def failing() -> bytes:
        raise OSError("backend down")

    with pytest.raises(OSError, match="backend down"):
        flight.run("k", lambda publish: failing())
    assert flight.run("k", lambda publish: b"ok") == b"ok"  # a failure is not cached


def test_blocks_survive_a_new_cache_object_and_count_tier_hits(tmp_path: Path) -> None:
    cache = BlockCache(tmp_path, disk_capacity_bytes=10 << 20, memory_capacity_bytes=1 << 20)
    assert cache.get("k", lambda: b"v" * 5000) == b"v" * 5000
    assert cache.get("k", lambda: pytest.fail("memory hit expected")) == b"v" * 5000
    cache.close()

    reopened = BlockCache(tmp_path, disk_capacity_bytes=10 << 20, memory_capacity_bytes=1 << 20)
    assert bytes(reopened.get("k", lambda: pytest.fail("disk hit expected"))) == b"v" * 5000
    counts = reopened.stats.snapshot()
    assert (counts["disk_hits"], counts["misses"]) == (1, 0)
    totals = reopened.machine_totals()
    assert (totals["misses"], totals["memory_hits"], totals["disk_hits"]) == (1, 1, 1)


def test_a_block_waiting_for_the_disk_writer_is_not_fetched_again(tmp_path: Path) -> None:
    """A block kept out of memory (read-ahead) is on its way to disk: asked for again before it is written
    (by the reader, or a cache-group member), it comes from the writer's queue, not from the backend."""
    cache = BlockCache(tmp_path / "cache", 64 << 20, 64 << 20)
    assert cache.disk is not None
    writing = threading.Event()
    stored = cache.disk._put_batch

    def slow_disk(blocks: Any) -> bool:
        writing.wait(10)
        return stored(blocks)

    cache.disk.writer._write_batch = slow_disk  # the disk takes its time
    fetches: list[int] = []
    data = pattern(300_000, seed=3)

    def fetch() -> bytes:
        fetches.append(1)
        return data

    try:
        assert bytes(cache.get("k-0", fetch, keep_in_memory=False)) == data
        assert bytes(cache.get("k-0", fetch, keep_in_memory=False)) == data  # still queued for the disk
        assert bytes(cache.get("k-0", fetch, length=len(data))) == data
        assert len(fetches) == 1
    finally:
        writing.set()
        cache.wait_for_disk()
    assert bytes(cache.get("k-0", fetch)) == data and len(fetches) == 1
    cache.close()


def test_a_merge_while_a_process_makes_its_counts_file_leaves_the_file_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each process that opens a cache (every DataLoader worker, as it starts) merges the counts of
    processes that ended: a counts file it can lock is one of those. Another process's merge that runs
    while this one makes its file must not find the file unlocked under its name, or it takes its zero
    counts, removes it, and every count made after is lost (a worker's 7 disk hits, in a CI run)."""
    from pffs.cache import stats as stats_module

    store = tmp_path / "stats.sqlite"
    counts = CacheStats(store)
    real_flock = stats_module.fcntl.flock
    merged: list[int] = []

    def flock_after_another_merge(fd: int, operation: int) -> None:
        if not merged:  # the new file's own lock: another process merges just before it is taken
            merged.append(operation)
            stats_module.merge_ended(store)
        real_flock(fd, operation)

    monkeypatch.setattr(stats_module.fcntl, "flock", flock_after_another_merge)
    counts.add("disk_hits", 7)
    assert merged, "the counts file was never locked"
    assert read_totals(store)["disk_hits"] == 7
    assert [p.name.endswith(".counts") for p in (tmp_path / "stats.live").iterdir()] == [True]


def test_corrupt_and_truncated_block_files_are_dropped_and_fetched_again(tmp_path: Path) -> None:
    cache = BlockCache(tmp_path, disk_capacity_bytes=10 << 20, memory_capacity_bytes=0)
    good = os.urandom(100 * KIB)
    cache.get("a", lambda: good)
    cache.get("b", lambda: good)
    cache.wait_for_disk()  # blocks are written behind the readers
    files = block_files(tmp_path)
    assert len(files) == 2
    data = bytearray(files[0].read_bytes())
    data[len(data) // 2] ^= 0xFF
    files[0].write_bytes(bytes(data))
    with files[1].open("r+b") as f:
        f.truncate(1000)

    refetched = []
    for key in "ab":
        assert bytes(cache.get(key, lambda: refetched.append(1) or good)) == good
    assert len(refetched) == 2
    assert cache.stats.snapshot()["corrupt_blocks"] == 2
    # and now they are good again on disk
    cache.wait_for_disk()
    assert bytes(cache.get("a", lambda: pytest.fail("should be cached again"))) == good


def test_range_reads_from_disk_verify_their_segments(tmp_path: Path) -> None:
    cache = BlockCache(tmp_path, disk_capacity_bytes=10 << 20, memory_capacity_bytes=0)
    good = os.urandom(1000 * KIB)  # 8 segments of 128 KiB
    cache.get("a", lambda: good)
    cache.wait_for_disk()
    rng = random.Random(2)
    for _ in range(200):
        start = rng.randrange(len(good))
        end = min(len(good), start + rng.randrange(1, 300 * KIB))
        assert bytes(cache.get_range_if_cached("a", start, end)) == good[start:end]
    assert cache.get_range_if_cached("missing", 0, 10) is None
    (path,) = block_files(tmp_path)
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF  # in the last segment only
    path.write_bytes(bytes(data))
    assert bytes(cache.get_range_if_cached("a", 0, 4096)) == good[:4096]  # its own segment is intact
    assert cache.get_range_if_cached("a", len(good) - 200, len(good)) is None  # caught: dropped
    assert cache.stats.snapshot()["corrupt_blocks"] == 1
    assert cache.get_range_if_cached("a", 0, 4096) is None  # the whole block went


def test_disk_tier_stays_within_its_byte_bound(tmp_path: Path) -> None:
    capacity = 4 << 20
    cache = BlockCache(tmp_path, disk_capacity_bytes=capacity, memory_capacity_bytes=0)
    for i in range(60):  # 15 MiB through a 4 MiB cache
        cache.get(f"k{i}", lambda: os.urandom(256 * KIB))
        cache.wait_for_disk()
        assert cache.disk is not None
        assert cache.disk.used_bytes() <= capacity
    assert cache.stats.snapshot()["disk_evictions"] > 40
    # least recently used went first: the newest block is still there
    assert cache.disk.contains("k59") and not cache.disk.contains("k0")


def test_memory_tier_bound_holds_under_a_larger_workload(tmp_path: Path) -> None:
    cache = BlockCache(tmp_path, disk_capacity_bytes=64 << 20, memory_capacity_bytes=1 << 20)
    for i in range(40):
        cache.get(f"k{i}", lambda: os.urandom(100 * KIB))
        assert cache.memory.used_bytes <= 1 << 20


def test_unusable_cache_directory_falls_back_to_memory(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("I am a file")
    with caplog.at_level(logging.WARNING):
        cache = BlockCache(not_a_dir, disk_capacity_bytes=1 << 20, memory_capacity_bytes=1 << 20)
    assert cache.disk is None
    assert cache.get("k", lambda: b"data") == b"data"
    assert "not usable" in caplog.text


@contextlib.contextmanager
def tmpfs(folder: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` mounted at `folder` (made) for the test, unmounted after."""
    folder.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)]
    result = subprocess.run(mount, capture_output=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {result.stderr.decode().strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs: a cache disk that fills up."""
    with tmpfs(tmp_path / "tiny", "1m") as folder:
        yield folder


def test_full_cache_disk_still_serves_reads_and_warns_once(
    tiny_tmpfs: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache = BlockCache(tiny_tmpfs, disk_capacity_bytes=100 << 20, memory_capacity_bytes=0)
    payloads = {f"k{i}": os.urandom(300 * KIB) for i in range(8)}
    with caplog.at_level(logging.WARNING):
        for key, payload in payloads.items():
            assert bytes(cache.get(key, lambda p=payload: p)) == payload
        cache.wait_for_disk()
    warnings = [r for r in caplog.records if "cannot write to the disk cache" in r.getMessage()]
    assert len(warnings) == 1
    assert cache.stats.snapshot()["disk_write_failures"] >= 1
    for key, payload in payloads.items():  # what did get cached is still correct
        assert bytes(cache.get(key, lambda p=payload: p)) == payload


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 16 MiB tmpfs: a small file system for the cache to share."""
    with tmpfs(tmp_path / "small", "16m") as folder:
        yield folder


def free_share(path: Path) -> float:
    fs = os.statvfs(path)
    return fs.f_bavail / fs.f_blocks


def test_the_disk_tier_keeps_its_file_systems_free_share(small_tmpfs: Path) -> None:
    cache = BlockCache(
        small_tmpfs, disk_capacity_bytes=10 << 30, memory_capacity_bytes=0, free_space_ratio=0.25
    )
    assert cache.disk is not None
    payloads = {f"k{i}": os.urandom(256 * KIB) for i in range(80)}  # 20 MiB through 16 MiB
    for key, payload in payloads.items():
        assert bytes(cache.get(key, lambda p=payload: p)) == payload
        cache.wait_for_disk()
        # 25% kept free, give or take the block being written and the index's pages
        assert free_share(small_tmpfs) >= 0.25 - 2 * 256 * KIB / (16 << 20), cache.usage()
    counts = cache.stats.snapshot()
    assert counts["disk_evictions"] > 20 and counts.get("disk_write_failures", 0) == 0
    usage = cache.usage()
    assert usage["disk_capacity_bytes"] == 10 << 30 and usage["disk_bound_bytes"] < 12 << 20
    # least recently used went first; what is held reads back exact, from the disk
    assert cache.disk.contains("k79") and not cache.disk.contains("k0")
    assert bytes(cache.get("k79", lambda: pytest.fail("fetched again"))) == payloads["k79"]


def test_a_disk_filled_by_others_still_serves_what_the_cache_holds(
    small_tmpfs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pffs.cache.block_disk import BlockStore

    monkeypatch.setattr(BlockStore, "TOUCH_FLUSH_S", 0.0)  # every read records its access at once
    cache = BlockCache(small_tmpfs, disk_capacity_bytes=10 << 30, memory_capacity_bytes=0)
    payloads = {f"k{i}": os.urandom(256 * KIB) for i in range(8)}
    for key, payload in payloads.items():
        cache.get(key, lambda p=payload: p)
    cache.wait_for_disk()
    fd = os.open(small_tmpfs / "someone-else.bin", os.O_WRONLY | os.O_CREAT)  # another program fills it
    with contextlib.suppress(OSError):
        while True:
            os.write(fd, b"x" * (64 * KIB))
    os.close(fd)
    assert os.statvfs(small_tmpfs).f_bavail == 0
    for key, payload in payloads.items():
        assert bytes(cache.get(key, lambda k=key: pytest.fail(f"{k} fetched again"))) == payload
    assert cache.stats.snapshot()["disk_hits"] == len(payloads)


def _fetch_in_child(
    cache_dir: str, log_path: str, keys: list[str], barrier: multiprocessing.synchronize.Barrier
) -> None:
    cache = BlockCache(cache_dir, disk_capacity_bytes=64 << 20, memory_capacity_bytes=0)

    def fetch(key: str) -> bytes:
        with open(log_path, "a") as log:
            log.write(f"{os.getpid()} {key}\n")
        time.sleep(0.05)  # a slow backend, so that the two processes really overlap
        return key.encode() * 1000

    barrier.wait()
    for key in keys:
        assert bytes(cache.get(key, lambda k=key: fetch(k))) == key.encode() * 1000
    cache.close()


def test_two_processes_fetch_each_block_once(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(2)
    log_path = tmp_path / "fetches.log"
    keys = [f"block-{i}" for i in range(12)]
    procs = [
        ctx.Process(target=_fetch_in_child, args=(str(tmp_path / "c"), str(log_path), keys, barrier))
        for _ in range(2)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    fetched = [line.split()[1] for line in log_path.read_text().splitlines()]
    assert sorted(fetched) == sorted(keys)  # each key fetched exactly once, by one of the two
    totals = read_totals(tmp_path / "c" / "stats.sqlite")
    assert totals["misses"] == len(keys)
    assert totals["disk_hits"] == len(keys)


WRITE_UNTIL_KILLED = """
import sys, hashlib
from pffs.cache import BlockCache
cache = BlockCache(sys.argv[1], disk_capacity_bytes=8 << 20, memory_capacity_bytes=0)
i = 0
while True:
    key = f"k{i % 64}-{i}"
    cache.get(key, lambda: hashlib.sha256(key.encode()).digest() * 4096)  # 128 KiB derived from the key
    if i == 20:
        print("writing", flush=True)
    i += 1
"""


def test_kill_9_mid_write_leaves_a_cache_that_serves_no_bad_byte(tmp_path: Path) -> None:
    import hashlib
    import signal
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-c", WRITE_UNTIL_KILLED, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "writing"
        time.sleep(0.5)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    cache = BlockCache(tmp_path, disk_capacity_bytes=8 << 20, memory_capacity_bytes=0)
    assert cache.disk is not None
    keys = list(cache.disk._cache.iterkeys())
    assert len(keys) > 10
    for key in keys:
        expected = hashlib.sha256(key.encode()).digest() * 4096
        assert bytes(cache.get(key, lambda k=key: hashlib.sha256(k.encode()).digest() * 4096)) == expected
    assert cache.disk.used_bytes() <= 8 << 20


FETCH_AND_EXIT = """
import sys
from pffs.cache import BlockCache
cache = BlockCache(sys.argv[1], disk_capacity_bytes=64 << 20, memory_capacity_bytes=64 << 20)
for i in range(20):
    cache.get(f"k{i}", lambda i=i: bytes([i]) * 300_000)
"""  # and exit at once: the blocks are still queued for the disk writer


def test_blocks_fetched_by_a_process_that_exits_at_once_are_on_disk(tmp_path: Path) -> None:
    import sys

    subprocess.run([sys.executable, "-c", FETCH_AND_EXIT, str(tmp_path)], check=True, timeout=60)
    cache = BlockCache(tmp_path, disk_capacity_bytes=64 << 20, memory_capacity_bytes=0)
    for i in range(20):
        assert bytes(cache.get(f"k{i}", lambda: pytest.fail("not on disk"))) == bytes([i]) * 300_000


def _write_in_forked_child(cache_dir: str, i: int) -> bytes | str:
    """The block read back from disk, or why not: the disk tier's own warnings (a forked child inherits
    pytest's log capture, so they would vanish) and counters."""
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("pffs").addHandler(handler)
    child = BlockCache(cache_dir, disk_capacity_bytes=64 << 20, memory_capacity_bytes=0)
    data = bytes([i]) * 50_000
    assert bytes(child.get(f"child-{i}", lambda: data)) == data
    child.close()
    missing = b"NOT ON DISK"  # what a fetch gives instead: the disk tier did not have the block
    got = child.get(f"child-{i}", lambda: missing)
    if bytes(got) == missing:
        counters = {k: v for k, v in child.stats.snapshot().items() if v}
        return f"child {i}: block not on disk (disk tier: {child.disk is not None}; {counters}; {records})"
    return bytes(got)


@pytest.mark.xfail(
    strict=False,
    reason="issue 15: a forked worker's block sometimes never reaches the disk tier while the parent "
    "commits (2 of 3 clean-clone CI runs on 2026-11-25, never in 200 rounds outside pytest); the "
    "failure message now carries the child's disk-tier warnings and counters",
)
def test_children_forked_while_the_disk_writer_commits_can_use_the_cache(tmp_path: Path) -> None:
    """SQLite state must not be inherited mid-transaction: a child forked then found the database locked."""
    cache = BlockCache(tmp_path, disk_capacity_bytes=64 << 20, memory_capacity_bytes=0)
    stop = threading.Event()

    def keep_writing() -> None:
        # Commits all the time, over a bounded set of keys (at most 20 MB): the cache never fills, so
        # eviction cannot take a child's block before it reads it back (on a loaded machine the parent
        # used to write 64 MB meanwhile, and LRU rightly evicted it).
        i = 0
        while not stop.is_set():
            key = f"parent-{i % 1000}"
            cache.discard(key)
            cache.get(key, lambda: os.urandom(20_000))
            i += 1

    writer = threading.Thread(target=keep_writing)
    writer.start()
    try:
        for round_ in range(40):
            with multiprocessing.get_context("fork").Pool(2) as pool:
                result = pool.starmap_async(
                    _write_in_forked_child, [(str(tmp_path), round_ * 2 + j) for j in (0, 1)]
                )
                got = result.get(timeout=30)
            problems = [g for g in got if isinstance(g, str)]
            assert not problems, problems
            assert got == [bytes([round_ * 2 + j]) * 50_000 for j in (0, 1)]
    finally:
        stop.set()
        writer.join()


# ------------------------------------------------------------------------------------------- hard bound


def test_processes_filling_one_small_cache_at_once_never_hold_more_than_its_bound(
    s3_server: SeaweedS3, raw_s3: Any, bucket: str, tmp_path: Path
) -> None:
    """Four `pffs warmup` processes write 48 MiB of blocks into one 16 MiB disk cache at once. The cache
    sits on a tmpfs of its own, whose used bytes (sampled every few ms, less SQLite's WAL files, which the
    bound does not count) must never exceed the bound; afterwards every file reads exactly."""
    bound = 16 << 20
    files = {
        f"{bucket}/p{p}/f{i}.bin": pattern((1 << 20) + 4096 * i, seed=10 * p + i)
        for p in range(4)
        for i in range(12)
    }
    raw_s3.pipe(files)
    cache = tmp_path / "cache"
    cache.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256m", "tmpfs", str(cache)], check=True)
    try:
        options = ["--cache-dir", str(cache), "--cache-size", "16M", "--block-size", "1M"]
        options += ["--endpoint-url", s3_server.endpoint_url]
        env = {
            **os.environ,
            "AWS_ACCESS_KEY_ID": s3_server.access_key,
            "AWS_SECRET_ACCESS_KEY": s3_server.secret_key,
        }
        samples: list[int] = []
        done = threading.Event()

        def wal_bytes() -> int:
            total = 0
            for path in (cache / "blocks").glob("cache.db-*"):
                with contextlib.suppress(FileNotFoundError):  # the last connection to close removes it
                    total += path.stat().st_size
            return total

        def sample() -> None:
            while not done.is_set():
                before = wal_bytes()
                fs = os.statvfs(cache)
                used = (fs.f_blocks - fs.f_bfree) * fs.f_frsize
                # Kept only when SQLite's WAL files held still around the reading: one that grows, is
                # checkpointed or is removed in between puts the reading off by up to its size (a CI run
                # read 16.3 MiB against the bound of 16).
                if wal_bytes() == before:
                    samples.append(used - before)
                time.sleep(0.002)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "pffs.cli.main", "warmup", f"s3://{bucket}/p{p}/", *options],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
            for p in range(4)
        ]
        try:
            results = [proc.communicate(timeout=240) for proc in procs]
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            done.set()
            sampler.join(5)
        assert all(proc.returncode == 0 for proc in procs), [err.decode()[-2000:] for _, err in results]
        assert len(samples) > 50, "too few samples to judge"
        assert max(samples) <= bound, f"the cache held {max(samples) / 2**20:.1f} MiB, bound 16 MiB"
        fs = fsspec.filesystem(
            "pffs",
            target=f"s3://{bucket}",
            cache_dir=str(cache),
            cache_size="16M",
            block_size="1M",
            **s3_server.storage_options(),
        )
        for path, data in files.items():
            assert sha256(fs.cat_file(path.split("/", 1)[1])) == sha256(data), path
    finally:
        subprocess.run(["umount", "-l", str(cache)], check=False)


def test_a_block_waiting_for_room_in_the_writers_queue_is_not_fetched_again(tmp_path: Path) -> None:
    """The writer's queue is full (a slow disk): the thread that fetched a block waits for room to queue
    it, after its single flight ended. Asked for meanwhile (a group member's request, found by
    bench/peers.py: 1-3% of the blocks fetched twice), the block comes from the queue, not the backend."""
    cache = BlockCache(tmp_path / "cache", 64 << 20, 64 << 20)
    assert cache.disk is not None
    writer = cache.disk.writer
    writer.max_pending_bytes = 100_000
    writing = threading.Event()
    stored = cache.disk._put_batch

    def slow_disk(blocks: Any) -> bool:
        writing.wait(10)
        return stored(blocks)

    writer._write_batch = slow_disk
    data = pattern(300_000, seed=5)
    fetches: list[str] = []

    def fetch(key: str) -> Callable[[], bytes]:
        return lambda: fetches.append(key) or data

    try:
        cache.get("k-0", fetch("k-0"), keep_in_memory=False)  # being written (the disk is slow)
        cache.get("k-1", fetch("k-1"), keep_in_memory=False)  # queued: the queue is full now
        leader = threading.Thread(
            target=cache.get, args=("k-2", fetch("k-2")), kwargs={"keep_in_memory": False}
        )
        leader.start()
        # Polled, not slept for: on a loaded machine the leader took longer than 0.2 s to get from its
        # fetch into the queue's wait, and the get below fetched again (a flaky failure, not a double fetch).
        deadline = time.monotonic() + 10
        while writer.pending("k-2") is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert writer.pending("k-2") is not None and leader.is_alive()  # waiting for room, readable
        assert bytes(cache.get("k-2", fetch("k-2"), keep_in_memory=False)) == data
        assert fetches.count("k-2") == 1
    finally:
        writing.set()
        leader.join(10)
        cache.wait_for_disk()
    assert bytes(cache.get("k-2", fetch("k-2"))) == data and fetches.count("k-2") == 1
    cache.close()


def test_a_block_queued_twice_in_one_batch_is_written_once_and_the_disk_tier_stays_on(tmp_path: Path) -> None:
    cache = BlockCache(tmp_path / "cache", 64 << 20, 1 << 20)
    assert cache.disk is not None
    data = pattern(200_000, seed=4)
    assert cache.disk._put_batch([("k-1", data), ("k-1", data), ("k-2", data)])
    assert bytes(cache.get("k-1", lambda: pytest.fail("on disk"))) == data
    assert bytes(cache.get("k-2", lambda: pytest.fail("on disk"))) == data
    assert cache.stats.snapshot()["disk_write_failures"] == 0
    cache.close()


HOLD_A_BLOCK_LOCK = """
import sys, time
from pffs.cache.file_lock import block_locks, StripedFileLocks
locks = block_locks(sys.argv[1]) if sys.argv[3] == "ofd" else StripedFileLocks(sys.argv[1])
locks.acquire(sys.argv[2])
print("holding", flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("kind", ["ofd", "striped"])
def test_a_reader_waits_for_a_stuck_process_s_fetch_no_longer_than_the_deadline(
    kind: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Another process holds a block's lock and never lets go (stopped, or hung in its fetch): a reader of
    that block waits for it the backend deadline at most, then fetches the block itself, bytes exact; once
    the holder is gone, its lock is free."""
    cache = BlockCache(tmp_path / "c", disk_capacity_bytes=64 << 20, memory_capacity_bytes=0)
    if kind == "striped":
        from pffs.cache.file_lock import StripedFileLocks

        cache.locks = StripedFileLocks(tmp_path / "c" / "locks")
    assert cache.locks is not None
    cache.lock_wait_s = 1.0
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_A_BLOCK_LOCK, str(tmp_path / "c" / "locks"), "stuck", kind],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
        assert cache.locks.acquire("stuck", wait_s=0.2) is None  # held elsewhere: the wait runs out
        started = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="pffs.cache.block_cache"):
            data = cache.get("stuck", lambda: pattern(300_000, seed=7))
        waited = time.monotonic() - started
        assert sha256(data) == sha256(pattern(300_000, seed=7))
        assert 1.0 <= waited < 10, waited
        assert "another process has been fetching it for more than 1 s" in caplog.text
        free = cache.locks.acquire("another-key", wait_s=0.2)
        assert free is not None
        free()
    finally:
        holder.kill()
        holder.wait(10)
    release = cache.locks.acquire("stuck", wait_s=5)  # the holder is gone: its lock with it
    assert release is not None
    release()
