"""Benchmark of the pffs FUSE mount against rclone, s3fs-fuse, JuiceFS and Mountpoint for S3, all over one
local SeaweedFS.

    .venv/bin/python bench/mounts.py                                       # 1 GiB file, 2000 x 128 KiB files
    .venv/bin/python bench/mounts.py --large-size 256M --small-count 500   # quick run
    .venv/bin/python bench/mounts.py --only pffs,rclone --repeats 3        # some clients, median of 3

Run as root (the page cache is dropped between phases, /dev/fuse is needed). One SeaweedFS S3 server
holds the dataset under s3://bench-data/ds/: one large file (large.bin, --large-size), --small-count small
files (small/NNNNN.bin, --small-size) and 200 probe files (probe/NNNNN.bin, same size). Each client mounts
that prefix:

    pffs      pffs mount s3://bench-data/ds MNT --cache-dir DIR --cache-size 8G --memory-cache-size 512M
              --attr-ttl 1 --dir-ttl 60 (read-write, the default: modes stored with each object)
    pffs-ro   the same with --read-only (fixed modes, no HEAD per file): what the read-write default costs
    pffs-native  the same with --read-only --engine native (the native engine: several threads, no Python
              per request; the same disk tier)
    pffs-noprefetch   pffs with --no-prefetch-dirs, for the small-file phases only (first_read,
              small_cold, small_warm): what directory prefetch adds. Not a peer, no target.
    rclone    rclone mount (S3 remote from RCLONE_CONFIG_BENCH_* env vars, provider Other)
              --vfs-cache-mode full --cache-dir DIR --vfs-cache-max-size 8G
    s3fs      s3fs bench-data:/ds MNT -f -o url=..,use_path_request_style,passwd_file=..,use_cache=DIR
    juicefs   juicefs mount sqlite3://jfs.db MNT --cache-dir DIR --cache-size 8192 (a volume formatted on
              s3://jfsbucket of the same server; JuiceFS keeps data in its own format, so the same bytes
              are first written into it through a mount of its own, with another cache directory)
    mountpoint  mount-s3 bench-data MNT --prefix ds/ --endpoint-url .. --force-path-style --region us-east-1
              --read-only --cache DIR --max-cache-size 8192 --foreground (Mountpoint for S3, --mount-s3;
              default ../shared/tools/mount-s3 beside the repository; skipped, with a note in the JSON and
              the table, where the binary is absent. It empties its cache directory when it mounts, so its
              "warm" phases after a remount read from the server again.)

Every client starts from an empty cache directory. Before every phase the page cache (and dentries and
inodes) is dropped, then the server's data files are read back into the page cache, so the server serves
from RAM: "cold" means "the client's cache is cold". Every phase's reads run in a subprocess; every byte
read is checked against its sha256 after the clock stops. Per client, in order:

    mount (empty cache)
      first_read   open + read 4 KiB of each of the 200 never-read probe files, one at a time, by path
                   (no listing first): latency of each open+read, p50 and p99 in ms
      large_cold   the large file read sequentially (4 MiB reads), MB/s (10^6 B/s)
      small_cold   the small files read whole by 8 threads in a shuffled order, files/s (one directory
                   listing before, outside the clock)
    pause 6 s (rclone records what it cached ~5 s after a file's last close: an unmount sooner loses it),
    unmount, mount again with the same cache directory (the client's memory is cold, its disk cache warm)
      large_warm   the large file again: warm_disk (from the client's disk cache; page cache dropped),
                   then warm_again (a second read right after, page cache kept)
      small_warm   the small files again, 8 threads, another shuffled order: files/s
      stat         os.stat of every small file, one at a time, no listing first (dentries dropped; the
                   client's own metadata cache is whatever it kept): stats/s
    pause 6 s, unmount, mount again with the same cache directory
      random_warm  1,000 preads of 128 KiB at random 4 KiB-aligned offsets of the large file, one at a
                   time: reads/s, and p50/p99 latency in ms
    for pffs, JuiceFS, s3fs and rclone (--scaling-clients), for 1, 2, 4 and 8 readers, each after a remount:
      scaling_rN   the small files from the client's disk cache by N threads: files/s, the mount's CPU
                   seconds per wall second (cores kept busy: is it capped by one?) and its CPU-ms per file

Ceilings, measured in the same run: ceiling_local_disk (the large file's bytes from a local file, page
cache dropped, 4 MiB reads), ceiling_local_random (the random phase's 1,000 preads on that local file,
page cache dropped: what the disk allows a client serving from a local cache file) and ceiling_ranged_gets
(8 parallel 8 MiB ranged GETs of the large object, straight from the server with s3fs, as bench/sdk.py
does).

Mount CPU: for first_read, large_cold, large_warm (each read), small_cold and small_warm, the user +
system CPU seconds of the mount's processes (the process tree the bench started, or pffs's serving
process and its children; all threads), read from /proc/PID/stat by the phase subprocess right before and
after its clock (the small-file phases: from before their directory listing, which is off the clock),
per 1,000 files or per GiB read (mount_cpu_* figures, lower is better).

For pffs and pffs-ro, each figure is compared with the best peer (rclone, s3fs, JuiceFS, Mountpoint) on
it; issue 31's targets are small cold >= 1.5x the best peer; mount CPU per cold small file <= 0.7x the
best (lowest) peer's; large cold >= 1.3x the best peer and >= 0.8x ceiling_native_gets; random reads
>= 1.5x the best peer; large warm_disk >= 0.9x ceiling_local_disk; and pffs (read-write) >= 0.9x
pffs-ro on small cold. Each phase runs once by default; --repeats N runs the whole sequence N times (a
fresh cache each time) and reports medians.

Per phase, the JSON also keeps the CPU seconds of the mount's processes and of the whole machine (other
work on this 2-core machine skews every figure: compare it with the reader's and the mount's), the
1-minute load average before the phase, the loopback bytes received (machine-wide too, so only an
indicator of how much came from the server: about twice the bytes fetched, as SeaweedFS's gateway itself
talks to its volume server over loopback) and, for pffs and JuiceFS, their own cache counters.

Exit code 1 if a read did not match its sha256 or a phase failed; a missed target is reported, exit 0.
Writes bench/results/mounts.json and bench/results/mounts.png (--out-dir), and prints a table.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import json
import math
import os
import random
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sdk: Any = importlib.import_module("sdk")  # bench/sdk.py: the shared helpers, used unchanged

MB = sdk.MB
CHUNK = sdk.CHUNK  # 4 MiB sequential reads
RANGE = sdk.RANGE
PARALLEL_GETS = sdk.PARALLEL_GETS
SEED = sdk.SEED
MALLOC_ENV = sdk.MALLOC_ENV
THREADS = 8
BUCKET = "bench-data"
PREFIX = "ds"
JFS_BUCKET = "jfsbucket"
LARGE_NAME = "large.bin"
SMALL_DIR = "small"
PROBE_DIR = "probe"
PROBE_COUNT = 200
PROBE_READ = 4096
RANDOM_READS = 1000
RANDOM_SIZE = 128 << 10
# pffs-noprefetch: pffs with --no-prefetch-dirs, for the phases where directory prefetch counts (the
# small-file ones), so the table shows what prefetch adds and what pffs does without it. Not a peer.
# pffs-ro: pffs with --read-only (fixed modes, no HEAD per file): what the read-write default costs.
# mountpoint: Mountpoint for S3 (mount-s3), a peer where its binary is found (--mount-s3), skipped otherwise.
# pffs-native: pffs --read-only --engine native (issue 44's native engine: several threads, no Python per
# request, the same disk tier).
CLIENTS = ("pffs", "pffs-ro", "pffs-native", "pffs-noprefetch", "rclone", "s3fs", "juicefs", "mountpoint")
PFFS_CLIENTS = ("pffs", "pffs-ro", "pffs-native", "pffs-noprefetch")
PEERS = ("rclone", "s3fs", "juicefs", "mountpoint")
CACHE_SIZE = "8G"
# Readers of warm data (each count after a remount: the client's disk cache, its memory and the page
# cache cold): does the mount use more than one core? Clients whose cache survives a remount.
SCALING_READERS = (1, 2, 4, 8)
SCALING_CLIENTS = ("pffs", "juicefs", "s3fs", "rclone")
# pffs as `pffs mount` runs by default (read-write: modes, owners and times stored with each object, one
# HEAD per file), with the same cache bounds as the peers.
PFFS_MOUNT_OPTIONS = f"--cache-size {CACHE_SIZE} --memory-cache-size 512M --attr-ttl 1 --dir-ttl 60".split()
# bench/hdfs.py's mount options (it imports them): --fixed-modes, as this bench mounted pffs before.
PFFS_OPTIONS = [*PFFS_MOUNT_OPTIONS, "--fixed-modes"]
# Mountpoint for S3, built from its published crates (../shared/tools/README.md); never needed by CI.
MOUNT_S3 = Path(__file__).resolve().parents[2] / "shared" / "tools" / "mount-s3"
PHASE_TIMEOUT_S = 300.0
MOUNT_TIMEOUT_S = 90.0
# Before a remount: rclone records which ranges of a file it has cached about 5 s after the file's last
# close, and an unmount before that loses them (the next mount downloads again); JuiceFS writes its cache
# blocks in the background. Every client gets the same pause.
SETTLE_S = 6.0
RESULT_MARKER = "BENCH_RESULT "
BIN = Path(sys.executable).parent
Result = dict[str, Any]

# figure -> (label, unit, which way is better)
FIGURES: dict[str, tuple[str, str, str]] = {
    "first_read_p50_ms": ("first read p50 (open+4KiB)", "ms", "lower"),
    "first_read_p99_ms": ("first read p99 (open+4KiB)", "ms", "lower"),
    "large_cold_mb_s": ("large cold", "MB/s", "higher"),
    "large_warm_disk_mb_s": ("large warm_disk (remount)", "MB/s", "higher"),
    "large_warm_again_mb_s": ("large warm_again", "MB/s", "higher"),
    "small_cold_files_s": ("small cold, 8 threads", "files/s", "higher"),
    "small_warm_files_s": ("small warm (remount), 8 thr", "files/s", "higher"),
    "random_warm_ops_s": ("random 128KiB preads warm", "reads/s", "higher"),
    "random_warm_p50_ms": ("random pread p50", "ms", "lower"),
    "random_warm_p99_ms": ("random pread p99", "ms", "lower"),
    "stat_per_s": ("stat (dentries dropped)", "stats/s", "higher"),
    # CPU (user + system) of the mount's own processes while the phase's clock ran (see mount_cpu_now)
    "mount_cpu_first_read_s_per_kfile": ("mount CPU, first read", "CPU-s/1000 files", "lower"),
    "mount_cpu_large_cold_s_per_gib": ("mount CPU, large cold", "CPU-s/GiB", "lower"),
    "mount_cpu_large_warm_disk_s_per_gib": ("mount CPU, large warm_disk", "CPU-s/GiB", "lower"),
    "mount_cpu_large_warm_again_s_per_gib": ("mount CPU, large warm_again", "CPU-s/GiB", "lower"),
    "mount_cpu_small_cold_s_per_kfile": ("mount CPU, small cold", "CPU-s/1000 files", "lower"),
    "mount_cpu_small_warm_s_per_kfile": ("mount CPU, small warm", "CPU-s/1000 files", "lower"),
    # Readers of warm data (SCALING_READERS): files/s, and the cores the mount kept busy ("info": more is
    # neither better nor worse, it says whether the mount is capped by one core).
    **{
        name: entry
        for n in SCALING_READERS
        for name, entry in (
            (f"scaling_r{n}_files_s", (f"small from disk cache, {n} readers", "files/s", "higher")),
            (f"scaling_r{n}_mount_cores", (f"mount cores busy, {n} readers", "CPU-s/s", "info")),
        )
    },
}
CEILINGS = {
    "ceiling_ranged_gets_mb_s": f"ceiling: {PARALLEL_GETS}x{RANGE >> 20}MiB ranged GETs (s3fs)",
    "ceiling_native_gets_mb_s": f"ceiling: {PARALLEL_GETS}x{RANGE >> 20}MiB ranged GETs (pffs's client)",
    "ceiling_native_small_gets_files_s": f"ceiling: small files, {THREADS} threads of GETs (pffs's client)",
    "ceiling_local_disk_mb_s": "ceiling: local disk, 4MiB reads",
    "ceiling_local_random_ops_s": "ceiling: local disk, random 128KiB preads",
}
LARGE_CEILINGS = ("ceiling_native_gets_mb_s", "ceiling_ranged_gets_mb_s", "ceiling_local_disk_mb_s")
# Issue 31's targets: (figure, threshold, "best_peer", a ceiling figure or a client); figures where lower
# is better (latencies, CPU) must be <= threshold x, the rest >=.
TARGETS = (
    ("small_cold_files_s", 1.5, "best_peer"),
    ("mount_cpu_small_cold_s_per_kfile", 0.7, "best_peer"),
    ("large_cold_mb_s", 1.3, "best_peer"),
    ("large_cold_mb_s", 0.8, "ceiling_native_gets_mb_s"),
    ("random_warm_ops_s", 1.5, "best_peer"),
    ("large_warm_disk_mb_s", 0.9, "ceiling_local_disk_mb_s"),
    ("small_cold_files_s", 0.9, "pffs-ro"),  # the read-write default costs no HEAD per file
)


def log(message: str) -> None:
    print(f"[mounts {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


class PhaseFailed(RuntimeError):
    pass


@dataclass
class Spec:
    """What every phase subprocess needs: the server, and what the data must hash to."""

    endpoint_url: str
    key: str
    secret: str
    large_size: int
    large_sha256: str
    local_large: str  # the same bytes as the large file, in a local file (disk ceiling, random reads)
    small_size: int
    small: dict[str, str]  # "00000.bin" -> sha256 of the whole file
    probe: dict[str, str]  # "00000.bin" -> sha256 of its first PROBE_READ bytes

    @classmethod
    def load(cls, path: str) -> Spec:
        return cls(**json.loads(Path(path).read_text()))


# -- reading (phase subprocess side) ------------------------------------------------------------------------
def touched_buffer(size: int) -> bytearray:
    """A buffer whose every page is touched before the clock starts: reads into it cost no page faults."""
    buf = bytearray(size)
    buf[::4096] = b"\1" * len(range(0, size, 4096))
    return buf


# The mount's processes (set from --mount-pids in a phase subprocess; none for the ceilings).
MOUNT_PIDS: list[int] = []
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def mount_cpu_now() -> float:
    """User + system CPU seconds of the mount's processes so far (all their threads), from /proc/PID/stat."""
    total = 0
    for pid in MOUNT_PIDS:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of proc(5))
    return total / CLOCK_TICKS


def cpu_now() -> tuple[float, float, float]:
    """The reader's user and system CPU seconds, and the mount's (mount_cpu_now)."""
    t = os.times()
    return t.user, t.system, mount_cpu_now()


def cpu_since(start: tuple[float, float, float]) -> Result:
    user, system, mount = cpu_now()
    out = {
        "cpu_seconds": round(user - start[0] + system - start[1], 3),
        "sys_seconds": round(system - start[1], 3),
    }
    if MOUNT_PIDS:
        out["mount_cpu_seconds"] = round(mount - start[2], 3)
    return out


def mount_cpu_figure(name: str, run: Result, per: float) -> dict[str, float]:
    """{name: the mount's CPU seconds on run's clock / per} (per: thousands of files, or GiB), if measured."""
    if "mount_cpu_seconds" not in run or per <= 0:
        return {}
    return {name: round(run["mount_cpu_seconds"] / per, 3)}


def read_whole(path: str, view: memoryview) -> tuple[int, bool]:
    """Reads path into view, in CHUNK reads; (bytes read, whether the file ended exactly there)."""
    filled = 0
    with open(path, "rb", buffering=0) as f:
        while filled < len(view):
            n = f.readinto(view[filled : filled + CHUNK])
            if not n:
                return filled, True
            filled += n
        return filled, f.read(1) == b""


def sequential(path: str, buf: bytearray, size: int, expect: str) -> Result:
    view = memoryview(buf)[:size]
    cpu, wall = cpu_now(), time.perf_counter()
    got, at_end = read_whole(path, view)
    wall = time.perf_counter() - wall
    out = cpu_since(cpu)
    verified = got == size and at_end and hashlib.sha256(view).hexdigest() == expect
    return {
        "bytes": got,
        "seconds": round(wall, 4),
        "mb_per_s": round(got / MB / wall, 1),
        **out,
        "ok": verified,
    }


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def phase_first_read(spec: Spec, root: str) -> Result:
    latencies, ok = [], True
    cpu = cpu_now()
    for name in sorted(spec.probe):
        path = os.path.join(root, PROBE_DIR, name)
        start = time.perf_counter()
        fd = os.open(path, os.O_RDONLY)
        data = os.read(fd, PROBE_READ)
        latencies.append(time.perf_counter() - start)
        os.close(fd)
        ok = ok and hashlib.sha256(data).hexdigest() == spec.probe[name]
    cpu_used = cpu_since(cpu)
    ms = [s * 1000 for s in latencies]
    return {
        "figures": {
            "first_read_p50_ms": round(statistics.median(ms), 3),
            "first_read_p99_ms": round(percentile(ms, 0.99), 3),
            **mount_cpu_figure("mount_cpu_first_read_s_per_kfile", cpu_used, len(ms) / 1000),
        },
        "details": {
            "files": len(ms),
            "mean_ms": round(statistics.fmean(ms), 3),
            "max_ms": round(max(ms), 3),
            "first_ms": round(ms[0], 3),
            "seconds": round(sum(latencies), 4),
            **cpu_used,
        },
        "verified": ok and len(ms) == len(spec.probe),
    }


def phase_large(spec: Spec, root: str, variants: tuple[str, ...]) -> Result:
    buf = touched_buffer(spec.large_size)
    path = os.path.join(root, LARGE_NAME)
    runs = {v: sequential(path, buf, spec.large_size, spec.large_sha256) for v in variants}
    cpu = {
        name: value
        for v, r in runs.items()
        for name, value in mount_cpu_figure(f"mount_cpu_large_{v}_s_per_gib", r, r["bytes"] / 2**30).items()
    }
    return {
        "figures": {**{f"large_{v}_mb_s": r["mb_per_s"] for v, r in runs.items()}, **cpu},
        "details": runs,
        "verified": all(r["ok"] for r in runs.values()),
    }


def phase_ceiling_local_disk(spec: Spec, root: str) -> Result:
    buf = touched_buffer(spec.large_size)
    run = sequential(spec.local_large, buf, spec.large_size, spec.large_sha256)
    return {"figures": {"ceiling_local_disk_mb_s": run["mb_per_s"]}, "details": run, "verified": run["ok"]}


def phase_ceiling_ranged_gets(spec: Spec, root: str) -> Result:
    import s3fs
    from fsspec.asyn import sync

    sdk.prefault(2 * spec.large_size)
    fs = s3fs.S3FileSystem(
        key=spec.key,
        secret=spec.secret,
        client_kwargs={"endpoint_url": spec.endpoint_url},
        skip_instance_cache=True,
    )
    fs.ls(BUCKET)  # a connected session, outside the clock
    key = f"{BUCKET}/{PREFIX}/{LARGE_NAME}"
    cpu, wall = cpu_now(), time.perf_counter()
    parts = sync(fs.loop, sdk.parallel_ranged_gets, fs, key, spec.large_size)
    wall = time.perf_counter() - wall
    out = cpu_since(cpu)
    digest, total = sdk.sha256_of(parts)
    run = {"bytes": total, "seconds": round(wall, 4), "mb_per_s": round(total / MB / wall, 1), **out}
    ok = total == spec.large_size and digest == spec.large_sha256
    return {"figures": {"ceiling_ranged_gets_mb_s": run["mb_per_s"]}, "details": run, "verified": ok}


def phase_ceiling_native_gets(spec: Spec, root: str) -> Result:
    """The large object in 8 MiB ranged GETs, 8 at a time, through pffs's own S3 client (no cache)."""
    getter = sdk.native_getter(spec.endpoint_url, spec.key, spec.secret)
    key = f"{PREFIX}/{LARGE_NAME}"
    buffer = memoryview(touched_buffer(spec.large_size))  # no page faults on the clock
    cpu, wall = cpu_now(), time.perf_counter()
    parts = sdk.native_ranged_gets(getter, BUCKET, key, buffer)
    wall = time.perf_counter() - wall
    out = cpu_since(cpu)
    digest, total = sdk.sha256_of(parts)  # type: ignore[arg-type]
    run = {"bytes": total, "seconds": round(wall, 4), "mb_per_s": round(total / MB / wall, 1), **out}
    ok = total == spec.large_size and digest == spec.large_sha256
    return {"figures": {"ceiling_native_gets_mb_s": run["mb_per_s"]}, "details": run, "verified": ok}


def phase_ceiling_native_small_gets(spec: Spec, root: str) -> Result:
    """Every small file in one GET each, 8 threads, through pffs's own S3 client (no cache, no FUSE)."""
    getter = sdk.native_getter(spec.endpoint_url, spec.key, spec.secret)
    names = sorted(spec.small)
    keys = [f"{PREFIX}/{SMALL_DIR}/{name}" for name in names]
    buffer = memoryview(touched_buffer(spec.small_size * len(keys)))
    cpu, wall = cpu_now(), time.perf_counter()
    parts = sdk.native_whole_gets(getter, BUCKET, keys, buffer, spec.small_size)
    wall = time.perf_counter() - wall
    out = cpu_since(cpu)
    ok = all(hashlib.sha256(p).hexdigest() == spec.small[n] for p, n in zip(parts, names, strict=True))
    files_s = round(len(names) / wall, 1)
    run = {"files": len(names), "threads": THREADS, "seconds": round(wall, 4), **out}
    return {"figures": {"ceiling_native_small_gets_files_s": files_s}, "details": run, "verified": ok}


def phase_small(spec: Spec, root: str, variant: str, threads: int = THREADS) -> Result:
    names = sorted(spec.small)
    size = spec.small_size
    buf = touched_buffer(size * len(names))
    view = memoryview(buf)
    directory = os.path.join(root, SMALL_DIR)
    # The mount's CPU for the phase counts the listing too (off the clock): what a reader that lists the
    # dataset first costs the mount per file, wherever the mount does that work (a HEAD per file, say).
    cpu_with_listing = cpu_now()
    start = time.perf_counter()
    listed = sorted(os.listdir(directory))
    list_seconds = time.perf_counter() - start
    order = list(range(len(names)))
    random.Random(f"{SEED}-{variant}").shuffle(order)

    def read(i: int) -> tuple[int, bool]:
        return read_whole(os.path.join(directory, names[i]), view[i * size : (i + 1) * size])

    with ThreadPoolExecutor(threads) as pool:
        cpu, wall = cpu_now(), time.perf_counter()
        got = list(pool.map(read, order))
        wall = time.perf_counter() - wall
        out = cpu_since(cpu)
        with_listing = cpu_since(cpu_with_listing)
    if "mount_cpu_seconds" in with_listing:
        out["mount_cpu_seconds_with_listing"] = with_listing["mount_cpu_seconds"]
    verified = listed == names and all(n == size and end for n, end in got)
    verified = verified and all(
        hashlib.sha256(view[i * size : (i + 1) * size]).hexdigest() == spec.small[name]
        for i, name in enumerate(names)
    )
    total = sum(n for n, _ in got)
    return {
        "figures": {
            f"small_{variant}_files_s": round(len(names) / wall, 1),
            **mount_cpu_figure(f"mount_cpu_small_{variant}_s_per_kfile", with_listing, len(names) / 1000),
        },
        "details": {
            "files": len(names),
            "threads": threads,
            "bytes": total,
            "seconds": round(wall, 4),
            "mb_per_s": round(total / MB / wall, 1),
            "list_seconds": round(list_seconds, 4),
            **out,
        },
        "verified": verified,
    }


def phase_scaling(spec: Spec, root: str, readers: int) -> Result:
    """The small files from the client's disk cache (memory cold after a remount, page cache dropped) by
    `readers` threads: files/s, and how many cores the mount kept busy (its CPU-s per wall second)."""
    result = phase_small(spec, root, f"warm_r{readers}", readers)
    details = result["details"]
    figures = {f"scaling_r{readers}_files_s": result["figures"][f"small_warm_r{readers}_files_s"]}
    if "mount_cpu_seconds" in details:
        cores = details["mount_cpu_seconds"] / details["seconds"]
        figures[f"scaling_r{readers}_mount_cores"] = round(cores, 3)
        figures[f"scaling_r{readers}_mount_cpu_ms_per_file"] = round(
            details["mount_cpu_seconds"] * 1000 / details["files"], 3
        )
    return {**result, "figures": figures}


def phase_stat(spec: Spec, root: str) -> Result:
    paths = [os.path.join(root, SMALL_DIR, name) for name in sorted(spec.small)]
    cpu, wall = cpu_now(), time.perf_counter()
    sizes = [os.stat(p).st_size for p in paths]
    wall = time.perf_counter() - wall
    out = cpu_since(cpu)
    return {
        "figures": {"stat_per_s": round(len(paths) / wall, 1)},
        "details": {"files": len(paths), "seconds": round(wall, 4), **out},
        "verified": all(s == spec.small_size for s in sizes),
    }


def phase_ceiling_local_random(spec: Spec) -> Result:
    """The random phase on the local copy of the large file (page cache dropped): what the disk allows."""
    result = phase_random(spec, os.path.dirname(spec.local_large))
    ops = result["figures"]["random_warm_ops_s"]
    return {"figures": {"ceiling_local_random_ops_s": ops}, "details": result, "verified": result["verified"]}


def phase_random(spec: Spec, root: str) -> Result:
    rng = random.Random(SEED)
    blocks = (spec.large_size - RANDOM_SIZE) // 4096
    offsets = [rng.randint(0, blocks) * 4096 for _ in range(RANDOM_READS)]
    buf = touched_buffer(RANDOM_SIZE * RANDOM_READS)
    view = memoryview(buf)
    latencies, sizes = [], []
    fd = os.open(os.path.join(root, LARGE_NAME), os.O_RDONLY)
    try:
        cpu = cpu_now()
        for i, offset in enumerate(offsets):
            start = time.perf_counter()
            sizes.append(os.preadv(fd, [view[i * RANDOM_SIZE : (i + 1) * RANDOM_SIZE]], offset))
            latencies.append(time.perf_counter() - start)
        out = cpu_since(cpu)
    finally:
        os.close(fd)
    # After the clock: the same ranges of the local copy must hash the same.
    with open(spec.local_large, "rb") as local:
        verified = all(
            n == RANDOM_SIZE
            and hashlib.sha256(view[i * RANDOM_SIZE : (i + 1) * RANDOM_SIZE]).digest()
            == hashlib.sha256(os.pread(local.fileno(), RANDOM_SIZE, offset)).digest()
            for i, (n, offset) in enumerate(zip(sizes, offsets, strict=True))
        )
    wall = sum(latencies)
    ms = [s * 1000 for s in latencies]
    return {
        "figures": {
            "random_warm_ops_s": round(len(ms) / wall, 1),
            "random_warm_p50_ms": round(statistics.median(ms), 3),
            "random_warm_p99_ms": round(percentile(ms, 0.99), 3),
        },
        "details": {
            "reads": len(ms),
            "read_size": RANDOM_SIZE,
            "seconds": round(wall, 4),
            "mb_per_s": round(sum(sizes) / MB / wall, 1),
            **out,
        },
        "verified": verified,
    }


PHASES: dict[str, Callable[[Spec, str], Result]] = {
    "first_read": phase_first_read,
    "large_cold": lambda spec, root: phase_large(spec, root, ("cold",)),
    "small_cold": lambda spec, root: phase_small(spec, root, "cold"),
    "large_warm": lambda spec, root: phase_large(spec, root, ("warm_disk", "warm_again")),
    "small_warm": lambda spec, root: phase_small(spec, root, "warm"),
    "stat": phase_stat,
    "random_warm": phase_random,
    **{
        f"scaling_r{n}": (lambda spec, root, n=n: phase_scaling(spec, root, n))  # type: ignore[misc]
        for n in (1, 2, 4, 8)
    },
    "ceiling_local_disk": phase_ceiling_local_disk,
    "ceiling_local_random": lambda spec, root: phase_ceiling_local_random(spec),
    "ceiling_ranged_gets": phase_ceiling_ranged_gets,
    "ceiling_native_gets": phase_ceiling_native_gets,
    "ceiling_native_small_gets": phase_ceiling_native_small_gets,
}


def run_phase_here(name: str, spec_path: str, root: str, mount_pids: str | None = None) -> int:
    """Subprocess side: one phase, its result as one JSON line on stdout."""
    MOUNT_PIDS[:] = [int(p) for p in (mount_pids or "").split(",") if p]
    result = PHASES[name](Spec.load(spec_path), root)
    print(RESULT_MARKER + json.dumps(result), flush=True)
    return 0


# -- mounts (parent side) -----------------------------------------------------------------------------------
def mount_entry(path: Path) -> list[str] | None:
    """The /proc/self/mountinfo fields of what is mounted at path (the last one), if anything."""
    target, found = str(path), None
    with open("/proc/self/mountinfo") as mounts:
        for line in mounts:
            fields = line.split()
            if fields[4] == target:
                found = fields
    return found


def force_unmount(path: Path) -> None:
    """Last resort: abort the FUSE connection (if fusectl is mounted) and detach the mount lazily."""
    entry = mount_entry(path)
    if entry is None:
        return
    abort = Path(f"/sys/fs/fuse/connections/{entry[2].split(':')[1]}/abort")
    if abort.exists():
        with contextlib.suppress(OSError):
            abort.write_text("1")
    for cmd in (["fusermount3", "-uz", str(path)], ["umount", "-l", str(path)]):
        if mount_entry(path) is None:
            return
        subprocess.run(cmd, capture_output=True, timeout=30, check=False)


def tree_pids(pid: int) -> list[int]:
    import psutil

    try:
        proc = psutil.Process(pid)
        return [pid, *(c.pid for c in proc.children(recursive=True))]
    except psutil.NoSuchProcess:
        return []


def cpu_of(pids: list[int]) -> float:
    import psutil

    total = 0.0
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            t = psutil.Process(pid).cpu_times()
            total += t.user + t.system
    return total


def reset_peak_rss(pids: list[int]) -> None:
    """Starts each process's peak resident size (VmHWM) again from its current size (Linux clear_refs 5)."""
    for pid in pids:
        with contextlib.suppress(OSError):
            Path(f"/proc/{pid}/clear_refs").write_text("5")


def peak_rss(pids: list[int]) -> int:
    """The sum of the processes' peak resident sizes since reset_peak_rss, in bytes."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1]) * 1024
    return total


@dataclass
class Context:
    """What every mount needs: the server, the tools, the working folder."""

    endpoint_url: str
    key: str
    secret: str
    workdir: Path
    jfs_meta: str = ""
    mount_s3: Path = MOUNT_S3

    @property
    def logs(self) -> Path:
        return self.workdir / "logs"


@dataclass
class Mount:
    """One client's mount: start() mounts (empty or filled cache directory: the caller decides), stop()
    unmounts and waits for its processes; stop() is safe to call at any time, more than once."""

    client: str
    ctx: Context
    cache_dir: Path
    mountpoint: Path
    generation: int = 0
    proc: subprocess.Popen[bytes] | None = None
    pid: int | None = None  # the serving process (pffs: read from the mount)
    commands: list[str] = field(default_factory=list)

    @property
    def root(self) -> Path:
        return self.mountpoint  # every client mounts the dataset's folder itself

    def log_path(self) -> Path:
        return self.ctx.logs / f"{self.client}-{self.cache_dir.name}-{self.generation}.log"

    def start(self) -> None:
        self.generation += 1
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        self.ctx.logs.mkdir(parents=True, exist_ok=True)
        if mount_entry(self.mountpoint) is not None:
            raise PhaseFailed(f"{self.mountpoint} is already mounted")
        cmd, env = self.command()
        self.commands.append(shlex.join(cmd))
        started = time.monotonic()
        if self.client in PFFS_CLIENTS:
            done = subprocess.run(
                cmd, env=env, capture_output=True, text=True, timeout=MOUNT_TIMEOUT_S + 30, check=False
            )
            if done.returncode != 0:
                raise PhaseFailed(f"pffs mount exited {done.returncode}: {done.stderr.strip()[-2000:]}")
        else:
            with self.log_path().open("ab") as log_file:
                self.proc = subprocess.Popen(
                    cmd, env=env, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )  # fmt: skip
        self._wait_mounted(started)
        if self.client in PFFS_CLIENTS:
            self.pid = int(os.getxattr(self.mountpoint, "user.pffs.pid"))
        else:
            assert self.proc is not None
            self.pid = self.proc.pid
        self._check_answers()
        log(f"  {self.client} mounted in {time.monotonic() - started:.1f}s (pid {self.pid})")

    def _check_answers(self, timeout: float = 30.0) -> None:
        """A listing of the root, in a thread: a mount that hangs fails the phase instead of the run."""
        done: list[BaseException | None] = []

        def listing() -> None:
            try:
                os.listdir(self.root)
                done.append(None)
            except OSError as exc:
                done.append(exc)

        thread = threading.Thread(target=listing, daemon=True)
        thread.start()
        thread.join(timeout)
        if not done:
            raise PhaseFailed(f"{self.client}: listing {self.root} did not answer within {timeout}s")
        if done[0] is not None:
            raise PhaseFailed(f"{self.client}: listing {self.root} failed: {done[0]}")

    def _wait_mounted(self, started: float) -> None:
        while mount_entry(self.mountpoint) is None:
            if self.proc is not None and self.proc.poll() is not None:
                raise PhaseFailed(f"{self.client} exited {self.proc.returncode}; see {self.tail()}")
            if time.monotonic() - started > MOUNT_TIMEOUT_S:
                raise PhaseFailed(f"{self.client} did not mount within {MOUNT_TIMEOUT_S}s; {self.tail()}")
            time.sleep(0.05)

    def tail(self, lines: int = 15) -> str:
        path = self.log_path()
        try:
            text = path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return f"(no log at {path})"
        return f"last lines of {path}:\n" + "\n".join(text)

    def command(self) -> tuple[list[str], dict[str, str]]:
        ctx, mnt, cache = self.ctx, str(self.mountpoint), str(self.cache_dir)
        env = dict(os.environ)
        if self.client in PFFS_CLIENTS:
            env.update(AWS_ACCESS_KEY_ID=ctx.key, AWS_SECRET_ACCESS_KEY=ctx.secret)
            cmd = [
                str(BIN / "pffs"),
                "mount",
                f"s3://{BUCKET}/{PREFIX}",
                mnt,
                "--endpoint-url",
                ctx.endpoint_url,
            ]
            if self.client == "pffs-noprefetch":
                cmd.append("--no-prefetch-dirs")
            if self.client == "pffs-ro":
                cmd.append("--read-only")
            if self.client == "pffs-native":
                cmd += ["--read-only", "--engine", "native"]
            pffs_options = [*PFFS_MOUNT_OPTIONS, "--log-file", str(self.log_path())]
            return [*cmd, "--cache-dir", cache, *pffs_options], env
        if self.client == "rclone":
            env.update(
                RCLONE_CONFIG_BENCH_TYPE="s3",
                RCLONE_CONFIG_BENCH_PROVIDER="Other",
                RCLONE_CONFIG_BENCH_ENDPOINT=ctx.endpoint_url,
                RCLONE_CONFIG_BENCH_ACCESS_KEY_ID=ctx.key,
                RCLONE_CONFIG_BENCH_SECRET_ACCESS_KEY=ctx.secret,
                RCLONE_CONFIG_BENCH_FORCE_PATH_STYLE="true",
            )
            empty_config = ctx.workdir / "rclone.conf"
            empty_config.touch()
            return [
                str(BIN / "rclone"), "mount", f"bench:{BUCKET}/{PREFIX}", mnt, "--config", str(empty_config),
                "--vfs-cache-mode", "full", "--cache-dir", cache, "--vfs-cache-max-size", CACHE_SIZE,
            ], env  # fmt: skip
        if self.client == "s3fs":
            passwd = ctx.workdir / "s3fs.passwd"
            if not passwd.exists():
                passwd.touch(mode=0o600)
                passwd.write_text(f"{ctx.key}:{ctx.secret}\n")
            passwd.chmod(0o600)
            options = f"url={ctx.endpoint_url},use_path_request_style,passwd_file={passwd},use_cache={cache}"
            return ["s3fs", f"{BUCKET}:/{PREFIX}", mnt, "-f", "-o", options], env
        if self.client == "juicefs":
            return [
                str(BIN / "juicefs"), "mount", ctx.jfs_meta, mnt, "--cache-dir", cache,
                "--cache-size", "8192", "--no-usage-report", "--backup-meta", "0", "--no-bgjob",
                "--no-syslog",
            ], env  # fmt: skip
        if self.client == "mountpoint":
            # Read-only, as a dataset is mounted (and as ../shared/tools/README.md runs it); the prefix ends
            # in "/" so the mount shows the dataset's folder, as every other client's does. -f: the process
            # started here is the mount (no daemon), so its CPU and its end are this bench's to see.
            env.update(AWS_ACCESS_KEY_ID=ctx.key, AWS_SECRET_ACCESS_KEY=ctx.secret)
            log_dir = ctx.logs / f"mountpoint-{self.cache_dir.name}-{self.generation}"
            return [
                str(ctx.mount_s3), BUCKET, mnt, "--prefix", f"{PREFIX}/", "--endpoint-url", ctx.endpoint_url,
                "--force-path-style", "--region", "us-east-1", "--read-only", "--cache", cache,
                "--max-cache-size", "8192", "--foreground", "--log-directory", str(log_dir),
            ], env  # fmt: skip
        raise ValueError(self.client)

    def stop(self) -> None:
        """Unmounts the client's way, then makes sure: the mount gone, its processes ended."""
        try:
            if mount_entry(self.mountpoint) is not None:
                if self.client in PFFS_CLIENTS:
                    cmd = [str(BIN / "pffs"), "umount", str(self.mountpoint), "--timeout", "60"]
                else:
                    cmd = ["fusermount3", "-u", str(self.mountpoint)]
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=90, check=False)
                if done.returncode != 0:
                    log(f"  {shlex.join(cmd)} exited {done.returncode}: {done.stderr.strip()[-500:]}")
            self._wait_exit(30.0)
        except subprocess.TimeoutExpired:
            log(f"  unmounting {self.client} timed out")
        finally:
            if mount_entry(self.mountpoint) is not None:
                log(f"  {self.client}: forcing the unmount of {self.mountpoint}")
                force_unmount(self.mountpoint)
            self._kill()
            self.proc, self.pid = None, None

    def _wait_exit(self, timeout: float) -> None:
        import psutil

        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=timeout)
        elif self.pid is not None:
            with contextlib.suppress(psutil.NoSuchProcess, psutil.TimeoutExpired):
                psutil.Process(self.pid).wait(timeout=timeout)

    def _kill(self) -> None:
        import psutil

        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)  # the group this mount started in
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=15)
        elif self.proc is None and self.pid is not None:
            with contextlib.suppress(psutil.NoSuchProcess, psutil.TimeoutExpired):
                proc = psutil.Process(self.pid)
                if "pffs" in " ".join(proc.cmdline()):
                    proc.kill()
                    proc.wait(timeout=15)

    def remount(self) -> None:
        time.sleep(SETTLE_S)
        self.stop()
        self.start()

    def counters(self) -> Result:
        """The client's own cache counters, where it has some to give (pffs, JuiceFS)."""
        try:
            if self.client in PFFS_CLIENTS:
                report = json.loads(os.getxattr(self.mountpoint, "user.pffs.stats"))
                return {k: v for k, v in report.get("cache", {}).items() if isinstance(v, int | float)}
            if self.client == "juicefs":
                wanted = (
                    "juicefs_blockcache_hits",
                    "juicefs_blockcache_miss",
                    "juicefs_blockcache_hit_bytes",
                )
                out: Result = {}
                for line in (self.mountpoint / ".stats").read_text().splitlines():
                    name, _, value = line.partition(" ")
                    if name in wanted:
                        out[name] = float(value)
                return out
        except (OSError, ValueError) as exc:
            return {"error": str(exc)}
        return {}


def du(path: Path) -> int:
    """Bytes allocated on disk under path."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
    return total


def busy_cpu_seconds() -> float:
    """CPU seconds every process of this machine has used since boot (user, nice, system, irq, softirq)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq = (int(f) for f in fields[:7])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def loopback_rx_bytes() -> int:
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name.strip() == "lo":
            return int(rest.split()[0])
    return 0


def rewarm_server(data_dir: Path) -> None:
    sdk.rewarm_server(data_dir)


def run_child(phase: str, spec_path: Path, root: str, mount: Mount | None) -> Result:
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--phase",
        phase,
        "--spec",
        str(spec_path),
        "--root",
        root,
    ]
    if mount is not None and mount.pid:
        cmd += ["--mount-pids", ",".join(map(str, tree_pids(mount.pid)))]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, **MALLOC_ENV})
    try:
        out, _ = proc.communicate(timeout=PHASE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        log(f"  phase {phase} did not finish within {PHASE_TIMEOUT_S}s: aborting it")
        if mount is not None:
            if mount.client in PFFS_CLIENTS and mount.pid:  # where the mount is stuck, for the bug report
                dump = subprocess.run(
                    [str(BIN / "py-spy"), "dump", "--pid", str(mount.pid)],
                    capture_output=True, text=True, timeout=60, check=False,
                )  # fmt: skip
                log(f"  py-spy dump of the pffs mount:\n{dump.stdout}{dump.stderr}")
            force_unmount(mount.mountpoint)
        proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.communicate(timeout=30)
        raise PhaseFailed(f"phase {phase} timed out after {PHASE_TIMEOUT_S}s") from None
    except BaseException:  # interrupted (SIGTERM, ^C): no reader outlives the run
        proc.kill()
        raise
    lines = [ln for ln in out.splitlines() if ln.startswith(RESULT_MARKER)]
    if proc.returncode != 0 or not lines:
        raise PhaseFailed(f"phase {phase} failed (exit code {proc.returncode})")
    result: Result = json.loads(lines[-1].removeprefix(RESULT_MARKER))
    return result


@dataclass
class Run:
    """The parent's state: the spec, where the server keeps its data, what was measured."""

    args: argparse.Namespace
    ctx: Context
    spec: Spec
    spec_path: Path
    server_data: Path
    phases: list[Result] = field(default_factory=list)
    failures: list[Result] = field(default_factory=list)
    skipped: list[Result] = field(default_factory=list)  # clients not measured here, and why
    mounts: dict[str, list[str]] = field(default_factory=dict)
    cache_bytes: dict[str, list[int]] = field(default_factory=dict)  # each cache directory at the end

    def phase(self, client: str, phase: str, repeat: int, mount: Mount | None = None) -> Result:
        dropped = sdk.drop_page_cache()
        rewarm_server(self.server_data)
        before = None
        if mount is not None:
            before = (mount.counters(), cpu_of(tree_pids(mount.pid)) if mount.pid else 0.0)
            reset_peak_rss(tree_pids(mount.pid) if mount.pid else [])
        rx, busy, load = loopback_rx_bytes(), busy_cpu_seconds(), os.getloadavg()[0]
        started = time.monotonic()
        try:
            root = str(mount.root) if mount else ""
            result = run_child(phase, self.spec_path, root, mount)
        except PhaseFailed as exc:
            self.failures.append({"client": client, "phase": phase, "repeat": repeat, "error": str(exc)})
            if mount is not None:
                log(mount.tail())
            raise
        result.update(client=client, phase=phase, repeat=repeat, page_cache_dropped=dropped)
        result["wall_seconds"] = round(time.monotonic() - started, 2)
        result["loopback_rx_mb"] = round((loopback_rx_bytes() - rx) / MB, 1)
        # Whatever else ran meanwhile shows here: machine CPU beyond the reader's and the mount's.
        result["machine_busy_cpu_seconds"] = round(busy_cpu_seconds() - busy, 2)
        result["loadavg_1min_before"] = round(load, 2)
        if mount is not None and before is not None:
            pids = tree_pids(mount.pid) if mount.pid else []
            result["mount_cpu_seconds"] = round(cpu_of(pids) - before[1], 3)
            result["mount_peak_rss_mb"] = round(peak_rss(pids) / MB, 1)
            after = mount.counters()
            result["mount_counters"] = {
                k: round(after[k] - before[0].get(k, 0), 1)
                for k in after
                if isinstance(after[k], int | float) and after[k] != before[0].get(k, 0)
            }
        self.phases.append(result)
        figures = ", ".join(f"{k}={v}" for k, v in result["figures"].items())
        ok = "ok" if result["verified"] else "SHA256 MISMATCH"
        log(f"  {client} {phase}: {figures} ({ok}; loopback {result['loopback_rx_mb']} MB)")
        return result

    def ceilings(self, repeat: int) -> None:
        for name in (
            "ceiling_local_disk",
            "ceiling_local_random",
            "ceiling_ranged_gets",
            "ceiling_native_gets",
            "ceiling_native_small_gets",
        ):
            if name == "ceiling_local_disk":
                # Written just before it is read, as every cache's files are (see bench/sdk.py).
                sdk.write_local_large(Path(self.spec.local_large), self.spec.large_size)
            with contextlib.suppress(PhaseFailed):
                self.phase("ceiling", name, repeat)

    def client(self, client: str, repeat: int) -> None:
        cache = self.ctx.workdir / "caches" / f"{client}-r{repeat}"
        shutil.rmtree(cache, ignore_errors=True)
        mount = Mount(client, self.ctx, cache, self.ctx.workdir / "mnt" / client)
        log(f"{client} (repeat {repeat + 1}/{self.args.repeats})")
        small_only = client == "pffs-noprefetch"
        try:
            mount.start()
            for phase in (
                ("first_read", "small_cold") if small_only else ("first_read", "large_cold", "small_cold")
            ):
                self.phase(client, phase, repeat, mount)
            mount.remount()
            for phase in ("small_warm",) if small_only else ("large_warm", "small_warm", "stat"):
                self.phase(client, phase, repeat, mount)
            if not small_only:
                mount.remount()
                self.phase(client, "random_warm", repeat, mount)
            if client in self.args.scaling_clients:
                for readers in SCALING_READERS:  # each from the disk cache: the memory tier emptied
                    mount.remount()
                    self.phase(client, f"scaling_r{readers}", repeat, mount)
        except (PhaseFailed, OSError, subprocess.SubprocessError) as exc:
            log(f"  {client} FAILED: {exc}")
            if not any(f["client"] == client and f["repeat"] == repeat for f in self.failures):
                self.failures.append(
                    {"client": client, "phase": "mount", "repeat": repeat, "error": str(exc)}
                )
        finally:
            mount.stop()
            self.cache_bytes.setdefault(client, []).append(du(cache))
            if mount.commands and client not in self.mounts:  # the first mount's; remounts repeat it
                self.mounts[client] = [mount.commands[0].replace(str(self.ctx.workdir), "$WORKDIR")]
            shutil.rmtree(cache, ignore_errors=True)


# -- the dataset --------------------------------------------------------------------------------------------
def small_files(count: int, size: int, seed: int) -> Iterator[tuple[str, bytes]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    for i in range(count):
        yield f"{i:05d}.bin", rng.bytes(size)


def batched(items: Iterator[tuple[str, bytes]], n: int) -> Iterator[list[tuple[str, bytes]]]:
    batch: list[tuple[str, bytes]] = []
    for item in items:
        batch.append(item)
        if len(batch) == n:
            yield batch
            batch = []
    if batch:
        yield batch


def datasets(args: argparse.Namespace) -> Iterator[tuple[str, Iterator[tuple[str, bytes]]]]:
    yield SMALL_DIR, small_files(args.small_count, args.small_size, SEED + 1)
    yield PROBE_DIR, small_files(PROBE_COUNT, args.small_size, SEED + 2)


def write_dataset(s3: Any, workdir: Path, args: argparse.Namespace) -> Spec:
    import s3fs

    log(f"writing a {args.large_size} B file, {args.small_count} + {PROBE_COUNT} x {args.small_size} B files")
    fs = s3fs.S3FileSystem(**s3.storage_options(), skip_instance_cache=True)
    fs.mkdir(BUCKET)
    local = workdir / "local" / LARGE_NAME
    large_sha = sdk.write_local_large(local, args.large_size)
    fs.put_file(str(local), f"{BUCKET}/{PREFIX}/{LARGE_NAME}")
    hashes: dict[str, dict[str, str]] = {SMALL_DIR: {}, PROBE_DIR: {}}
    for folder, files in datasets(args):
        for batch in batched(files, 250):  # bounded memory, concurrent PUTs
            fs.pipe({f"{BUCKET}/{PREFIX}/{folder}/{name}": data for name, data in batch})
            for name, data in batch:
                hashes[folder][name] = hashlib.sha256(
                    data if folder == SMALL_DIR else data[:PROBE_READ]
                ).hexdigest()
    return Spec(
        endpoint_url=s3.endpoint_url,
        key=s3.access_key,
        secret=s3.secret_key,
        large_size=args.large_size,
        large_sha256=large_sha,
        local_large=str(local),
        small_size=args.small_size,
        small=hashes[SMALL_DIR],
        probe=hashes[PROBE_DIR],
    )


def format_juicefs(ctx: Context) -> list[str]:
    """Formats a JuiceFS volume (SQLite metadata in WORKDIR/juicefs, data in s3://jfsbucket of the same
    server) and points ctx.jfs_meta at it; returns the format command (bench/pjdfstest.py uses it too)."""
    jfs_dir = ctx.workdir / "juicefs"
    jfs_dir.mkdir(parents=True, exist_ok=True)
    ctx.jfs_meta = f"sqlite3://{jfs_dir / 'jfs.db'}"
    env = {**os.environ, "ACCESS_KEY": ctx.key, "SECRET_KEY": ctx.secret}
    fmt = [str(BIN / "juicefs"), "format", "--storage", "s3", "--bucket", f"{ctx.endpoint_url}/{JFS_BUCKET}"]
    fmt += [ctx.jfs_meta, "benchjfs"]
    done = subprocess.run(fmt, env=env, capture_output=True, text=True, timeout=120, check=False)
    if done.returncode != 0:
        raise PhaseFailed(f"juicefs format exited {done.returncode}: {done.stderr.strip()[-1500:]}")
    return fmt


def prepare_juicefs(ctx: Context, args: argparse.Namespace, spec: Spec) -> list[str]:
    """Formats a JuiceFS volume (format_juicefs) and writes the same dataset into it through a mount of its
    own, whose cache is then thrown away."""
    log("juicefs: formatting, then writing the dataset into it")
    fmt = format_juicefs(ctx)
    jfs_dir = ctx.workdir / "juicefs"
    writer = Mount("juicefs", ctx, jfs_dir / "write-cache", ctx.workdir / "mnt" / "juicefs-write")
    started = time.monotonic()
    try:
        writer.start()
        shutil.copyfile(spec.local_large, writer.root / LARGE_NAME)
        for folder, files in datasets(args):
            (writer.root / folder).mkdir()
            for name, data in files:
                (writer.root / folder / name).write_bytes(data)
    finally:
        writer.stop()
        shutil.rmtree(writer.cache_dir, ignore_errors=True)
    log(f"juicefs: dataset written in {time.monotonic() - started:.1f}s")
    return [c.replace(str(ctx.workdir), "$WORKDIR") for c in (shlex.join(fmt), *writer.commands)]


def run_all(args: argparse.Namespace, workdir: Path) -> tuple[Run, dict[str, list[str]]]:
    from pffs.testing.s3_server import SeaweedS3

    log(f"starting SeaweedFS in {workdir}")
    with SeaweedS3(workdir / "s3") as s3:
        spec = write_dataset(s3, workdir, args)
        spec_path = workdir / "spec.json"
        spec_path.touch(mode=0o600)
        spec_path.write_text(json.dumps(asdict(spec)))  # it holds the (throwaway) server credentials
        ctx = Context(s3.endpoint_url, s3.access_key, s3.secret_key, workdir, mount_s3=Path(args.mount_s3))
        run = Run(args, ctx, spec, spec_path, workdir / "s3" / "data")
        setup: dict[str, list[str]] = {}
        clients = list(args.only)
        if "mountpoint" in clients and not os.access(ctx.mount_s3, os.X_OK):
            note = f"Mountpoint for S3 not measured: no executable {ctx.mount_s3} (--mount-s3)"
            log(f"mountpoint: skipped; {note}")
            run.skipped.append({"client": "mountpoint", "reason": note})
            clients.remove("mountpoint")
        if "juicefs" in clients:
            try:
                setup["juicefs"] = prepare_juicefs(ctx, args, spec)
            except (PhaseFailed, OSError) as exc:
                log(f"juicefs: could not be prepared: {exc}")
                run.failures.append({"client": "juicefs", "phase": "prepare", "repeat": 0, "error": str(exc)})
                clients.remove("juicefs")
        for repeat in range(args.repeats):
            run.ceilings(repeat)
            for client in clients:
                run.client(client, repeat)
        return run, setup


# -- report -------------------------------------------------------------------------------------------------
def aggregate(phases: list[Result]) -> dict[str, dict[str, Result]]:
    """figure -> client -> median over repeats, min, max, runs, verified."""
    values: dict[str, dict[str, list[tuple[float, bool]]]] = {}
    for p in phases:
        for fig, value in p["figures"].items():
            values.setdefault(fig, {}).setdefault(p["client"], []).append((value, p["verified"]))
    out: dict[str, dict[str, Result]] = {}
    for fig, by_client in values.items():
        out[fig] = {
            client: {
                "value": round(statistics.median(v for v, _ in runs), 3),
                "min": min(v for v, _ in runs),
                "max": max(v for v, _ in runs),
                "runs": len(runs),
                "verified": all(ok for _, ok in runs),
            }
            for client, runs in by_client.items()
        }
    return out


def compare(figures: dict[str, dict[str, Result]]) -> dict[str, Result]:
    """For every figure: the best peer, and pffs's ratio to it (pffs / best; latencies: lower is better)."""
    out: dict[str, Result] = {}
    for fig, (_, _, better) in FIGURES.items():
        by_client = figures.get(fig, {})
        peers = {c: r["value"] for c, r in by_client.items() if c in PEERS}
        if not peers or better == "info":
            continue
        pick = min if better == "lower" else max
        best = pick(peers, key=lambda c: peers[c])
        entry: Result = {"best_peer": best, "best_peer_value": peers[best], "better": better}
        for client in ("pffs", "pffs-ro", "pffs-native"):
            if client in by_client and peers[best] > 0:
                entry[client] = by_client[client]["value"]
                entry[f"{client}_over_best_peer"] = round(by_client[client]["value"] / peers[best], 3)
        out[fig] = entry
    return out


def targets(figures: dict[str, dict[str, Result]], comparison: dict[str, Result]) -> list[Result]:
    out = []
    for fig, threshold, reference in TARGETS:
        label, unit, better = FIGURES[fig]
        pffs = figures.get(fig, {}).get("pffs")
        if reference == "best_peer":
            ref_name = comparison.get(fig, {}).get("best_peer")
            ref = figures[fig][ref_name]["value"] if ref_name else None
        elif reference in CLIENTS:
            ref_name = reference
            found = figures.get(fig, {}).get(reference)
            ref = found["value"] if found else None
        else:
            ref_name = reference
            found = figures.get(reference, {}).get("ceiling")
            ref = found["value"] if found else None
        op = "<=" if better == "lower" else ">="
        name = f"pffs {label} {op} {threshold:g} x {ref_name or reference}"
        if pffs is None or not ref:
            out.append({"target": name, "figure": fig, "pass": None, "note": "not measured"})
            continue
        ratio = pffs["value"] / ref
        met = ratio <= threshold if better == "lower" else ratio >= threshold
        out.append(
            {
                "target": name,
                "figure": fig,
                "reference": ref_name,
                "measured": f"{pffs['value']:g} / {ref:g} {unit}",
                "ratio": round(ratio, 3),
                "threshold": threshold,
                "pass": met,
            }
        )
    return out


def tool_version(cmd: list[str]) -> str:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unavailable ({exc})"
    text = (done.stdout or done.stderr).strip().splitlines()
    return text[0].strip() if text else "unknown"


def versions(mount_s3: Path = MOUNT_S3) -> Result:
    return {
        "pffs": tool_version([str(BIN / "pffs"), "--version"]),
        "rclone": tool_version([str(BIN / "rclone"), "version"]),
        "s3fs-fuse": tool_version(["s3fs", "--version"]),
        "juicefs": tool_version([str(BIN / "juicefs"), "version"]),
        "seaweedfs (weed)": tool_version([str(BIN / "weed"), "version"]),
        "fusermount3": tool_version(["fusermount3", "--version"]),
        "mount-s3": tool_version([str(mount_s3), "--version"]) if mount_s3.is_file() else "absent",
    }


def build_report(args: argparse.Namespace, run: Run, setup: dict[str, list[str]], seconds: float) -> Result:
    figures = aggregate(run.phases)
    comparison = compare(figures)
    verified = all(p["verified"] for p in run.phases)
    return {
        "command": " ".join([shlex.quote(sys.executable), *map(shlex.quote, sys.argv)]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "total_seconds": round(seconds, 1),
        "machine": {
            **sdk.machine_info(),
            "loadavg_at_start": args.loadavg,
            "loadavg_at_end": os.getloadavg(),
        },
        "versions": versions(Path(args.mount_s3)),
        "config": {
            "clients": [c for c in args.only if c not in {s["client"] for s in run.skipped}],
            "large_size": args.large_size,
            "small_count": args.small_count,
            "small_size": args.small_size,
            "probe_count": PROBE_COUNT,
            "probe_read": PROBE_READ,
            "random_reads": RANDOM_READS,
            "random_read_size": RANDOM_SIZE,
            "threads": THREADS,
            "repeats": args.repeats,
            "read_chunk": CHUNK,
            "ranged_gets": {"parallel": PARALLEL_GETS, "range": RANGE},
            "phase_env": MALLOC_ENV,
            "mb": MB,
            "settle_seconds_before_remount": SETTLE_S,
            "phase_timeout_seconds": PHASE_TIMEOUT_S,
            "pffs_options": PFFS_MOUNT_OPTIONS,
        },
        "mount_commands": {**{f"{k} (setup)": v for k, v in setup.items()}, **run.mounts},
        "verified": verified,
        "cache_dir_bytes_at_end": run.cache_bytes,
        "mount_peak_rss_mb": peak_rss_table(run.phases),
        "failures": run.failures,
        "skipped": run.skipped,
        "figures": figures,
        "comparison": comparison,
        "targets": targets(figures, comparison),
        "phases": run.phases,
    }


def peak_rss_table(phases: list[Result]) -> dict[str, dict[str, float]]:
    """Client -> phase -> the mount's largest peak resident size (MB) over the repeats."""
    table: dict[str, dict[str, float]] = {}
    for r in phases:
        if "mount_peak_rss_mb" in r:
            row = table.setdefault(r["client"], {})
            row[r["phase"]] = max(row.get(r["phase"], 0.0), r["mount_peak_rss_mb"])
    return table


def fmt(value: float) -> str:
    if value >= 100:
        return f"{value:.0f}"
    return f"{value:.1f}" if value >= 10 else f"{value:.2f}"


def print_table(report: Result) -> None:
    figures, comparison = report["figures"], report["comparison"]
    clients = [c for c in CLIENTS if c in report["config"]["clients"]]
    header = ("figure", "unit", *clients, "best peer", "pffs/best", "pffs-ro/best", "native/best")
    rows = [header]
    for fig, (label, unit, better) in FIGURES.items():
        by_client = figures.get(fig, {})
        cells = []
        for c in clients:
            r = by_client.get(c)
            cell = "-" if r is None else fmt(r["value"]) + ("" if r["verified"] else " BAD")
            if r is not None and r["runs"] > 1:
                cell += f" ({fmt(r['min'])}-{fmt(r['max'])})"
            cells.append(cell)
        comp = comparison.get(fig, {})
        ratios = [
            f"{comp[f'{c}_over_best_peer']:.2f}" if f"{c}_over_best_peer" in comp else "-"
            for c in ("pffs", "pffs-ro", "pffs-native")
        ]
        rows.append(
            (
                label,
                unit + (" (lower=better)" if better == "lower" else ""),
                *cells,
                comp.get("best_peer", "-"),
                *ratios,
            )
        )
    for fig, label in CEILINGS.items():
        r = figures.get(fig, {}).get("ceiling")
        unit = "reads/s" if fig.endswith("_ops_s") else "files/s" if fig.endswith("_files_s") else "MB/s"
        cells = [""] * (len(clients) + 4)  # the clients' columns, best peer, the three ratios
        cells[0] = fmt(r["value"]) if r else "-"
        rows.append((label, unit, *cells))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    print()
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    print()
    for t in report["targets"]:
        status = {True: "MET   ", False: "MISSED", None: "N/A   "}[t["pass"]]
        detail = f"{t['ratio']:.2f} ({t['measured']})" if t["pass"] is not None else t["note"]
        print(f"{status} {t['target']}: {detail}")
    rss = report.get("mount_peak_rss_mb", {})
    if rss:
        phases = sorted({ph for row in rss.values() for ph in row})
        print("\nmount peak resident memory (MB) per phase: " + ", ".join(phases))
        for client, row in rss.items():
            print(f"  {client:16} " + "  ".join(f"{fmt(row[ph]) if ph in row else '-':>6}" for ph in phases))
    for s in report.get("skipped", []):
        print(f"SKIPPED {s['client']}: {s['reason']}")
    for f in report["failures"]:
        print(f"FAILED {f['client']} {f['phase']} (repeat {f['repeat'] + 1}): {f['error'][:300]}")
    print(f"\ncommand: {report['command']}")
    print(f"all reads verified (sha256): {'yes' if report['verified'] else 'NO'}; "
          f"pffs at {report['machine']['pffs_git']}")  # fmt: skip
    print(f"total time: {report['total_seconds']}s")


def plot(report: Result, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {
        "pffs": "tab:green",
        "pffs-ro": "tab:cyan",
        "pffs-native": "tab:brown",
        "pffs-noprefetch": "tab:olive",
        "rclone": "tab:blue",
        "s3fs": "tab:orange",
        "juicefs": "tab:purple",
        "mountpoint": "tab:red",
    }
    figures = report["figures"]
    shown = [f for f in FIGURES if f in figures]
    cols = 4
    rows = max(1, math.ceil(len(shown) / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.6 * rows), squeeze=False)
    for ax, name in zip(axes.flat, shown, strict=False):
        label, unit, better = FIGURES[name]
        by_client = figures[name]
        clients = [c for c in CLIENTS if c in by_client]
        values = [by_client[c]["value"] for c in clients]
        errors = [
            [v - by_client[c]["min"] for v, c in zip(values, clients, strict=True)],
            [by_client[c]["max"] - v for v, c in zip(values, clients, strict=True)],
        ]
        bars = ax.bar(clients, values, yerr=errors, capsize=2, color=[colors[c] for c in clients])
        ax.bar_label(bars, labels=[fmt(v) for v in values], fontsize=7)
        if name == "random_warm_ops_s" and (
            r := figures.get("ceiling_local_random_ops_s", {}).get("ceiling")
        ):
            ax.axhline(r["value"], color="black", linestyle=":", linewidth=1)
            ax.text(0, r["value"], f"local disk: {fmt(r['value'])}", fontsize=6, va="bottom")
        if name.startswith("large_"):
            for ceiling, style in zip(LARGE_CEILINGS, ("-", "--", ":"), strict=True):
                r = figures.get(ceiling, {}).get("ceiling")
                if r:
                    ax.axhline(
                        r["value"],
                        color="black",
                        linestyle=style,
                        linewidth=1,
                        label=f"{CEILINGS[ceiling]}: {fmt(r['value'])}",
                    )
            ax.legend(fontsize=6, loc="best", framealpha=0.6)
        which = "" if better == "info" else f", {better} is better"
        ax.set_title(f"{label}\n{unit}{which}", fontsize=9)
        ax.tick_params(axis="both", labelsize=7)
        ax.tick_params(axis="x", labelrotation=30)
        ax.grid(axis="y", alpha=0.3)
    for ax in list(axes.flat)[len(shown) :]:
        ax.axis("off")
    cfg = report["config"]
    fig.suptitle(
        f"FUSE mounts over one local SeaweedFS: {cfg['large_size'] >> 20} MiB file, {cfg['small_count']} x "
        f"{cfg['small_size'] >> 10} KiB files; {report['machine']['nproc']} cores; "
        f"median of {cfg['repeats']}",
        fontsize=11,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    fig.savefig(path, dpi=100)
    plt.close(fig)


# -- main ---------------------------------------------------------------------------------------------------
def clients_arg_of(known: Sequence[str]) -> Callable[[str], list[str]]:
    """An argparse type for `--clients a,b`: the chosen ones of `known`, in its order."""

    def clients_arg(value: str) -> list[str]:
        chosen = [c.strip() for c in value.split(",") if c.strip()]
        unknown = [c for c in chosen if c not in known]
        if unknown or not chosen:
            raise argparse.ArgumentTypeError(f"unknown client(s) {unknown}; choose among {','.join(known)}")
        return [c for c in known if c in chosen]

    return clients_arg


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Exit codes: 0 done (targets may be missed: see the report), 1 a read did not match its "
        "sha256 or a phase failed. Run as root.",
    )
    parser.add_argument(
        "--large-size", type=sdk.size_arg, default=1 << 30, help="large file size (default 1G)"
    )
    parser.add_argument("--small-count", type=int, default=2000, help="number of small files (default 2000)")
    parser.add_argument(
        "--small-size", type=sdk.size_arg, default=128 << 10, help="small file size (default 128K)"
    )
    parser.add_argument(
        "--repeats", type=int, default=1, help="runs of every phase, median reported (default 1)"
    )
    parser.add_argument(
        "--only",
        type=clients_arg_of(CLIENTS),
        default=list(CLIENTS),
        help=f"clients, comma-separated (default {','.join(CLIENTS)})",
    )
    parser.add_argument(
        "--workdir", help="where the server data, caches and mounts go, in a temp dir (default /tmp)"
    )
    parser.add_argument(
        "--mount-s3",
        default=str(MOUNT_S3),
        help=f"Mountpoint for S3's binary; that client is skipped where it is absent (default {MOUNT_S3})",
    )
    parser.add_argument(
        "--scaling-clients",
        type=clients_arg_of(CLIENTS),
        default=list(SCALING_CLIENTS),
        help="clients whose warm small-file reads are measured with 1, 2, 4 and 8 readers, each after a "
        f"remount (default {','.join(SCALING_CLIENTS)})",
    )
    parser.add_argument("--out-dir", default=str(Path(__file__).parent / "results"), help="output folder")
    parser.add_argument("--phase", help=argparse.SUPPRESS)  # internal: run one phase (subprocess side)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    parser.add_argument("--mount-pids", help=argparse.SUPPRESS)  # the mount's processes, comma-separated
    args = parser.parse_args(argv)
    if (
        args.repeats < 1
        or args.small_count < 1
        or args.large_size < RANDOM_SIZE
        or args.small_size < PROBE_READ
    ):
        parser.error("--repeats and --small-count must be positive, --large-size >= 128K, --small-size >= 4K")
    return args


def _terminate(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds every finally: mounts unmounted, server stopped


def run_benchmark(args: argparse.Namespace) -> int:
    if os.geteuid() != 0:
        log("not root: the page cache cannot be dropped; run as root")
    signal.signal(signal.SIGTERM, _terminate)
    started = time.monotonic()
    args.loadavg = os.getloadavg()  # other work on this machine skews every figure: recorded
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if args.workdir:
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="pffs-mounts-", dir=args.workdir))
    try:
        run, setup = run_all(args, workdir)
    finally:
        for mnt in (workdir / "mnt").glob("*"):  # nothing may stay mounted, whatever happened
            if mount_entry(mnt) is not None:
                log(f"left mounted: {mnt}; detaching it")
                force_unmount(mnt)
        shutil.rmtree(workdir, ignore_errors=True)
    report = build_report(args, run, setup, time.monotonic() - started)
    (out / "mounts.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(report, out / "mounts.png")
    print_table(report)
    log(f"wrote {out / 'mounts.json'} and {out / 'mounts.png'}")
    return 0 if report["verified"] and not report["failures"] else 1


def main() -> int:
    args = parse_args()
    if args.phase:
        return run_phase_here(args.phase, args.spec, args.root, args.mount_pids)
    return run_benchmark(args)


if __name__ == "__main__":
    sys.exit(main())
