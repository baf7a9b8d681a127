"""Benchmark of pffs over HDFS: the pffs SDK and the pffs FUSE mount against the plain hdfs-native client.

    .venv/bin/python bench/hdfs.py                                       # 1 GiB file, 2000 x 128 KiB files
    .venv/bin/python bench/hdfs.py --large-size 256M --small-count 500   # quick run

Run as root (the page cache is dropped before every phase; the mount needs /dev/fuse). A real HDFS on
loopback (pffs.testing.hdfs_cluster.MiniDfs: Hadoop's MiniDFSCluster, one NameNode and two DataNodes,
replication 2, in one JVM) holds the dataset under /ds: one large file (large.bin, --large-size, the same
bytes as bench/sdk.py's) and --small-count small files (small/NNNNN.bin, --small-size), written once per
run through hdfs-native (16 writers: creating a file costs HDFS tens of milliseconds), then every file is
read three times outside any clock so that the JVM has compiled the DataNodes' read path before the first
phase.
Every phase runs in its own process, after the page cache is dropped and the DataNodes' block files are
read back into it, so HDFS always serves from RAM: "cold" means "the client's cache is cold". Every byte
read is checked against its sha256 after the clock stops.

Clients:
    hdfs-native  the plain fsspec HDFS client (hdfs_native, protocol "hdfs"), no cache: the large file in
                 sequential 4 MiB reads of fs.open(), the small files by cat_file one after another (one
                 thread, as a plain loop reads them). It has no cache, so cold and warm are the same read:
                 each phase reads twice and both runs count for its figure ("direct").
    ceiling      the same client in parallel, the most it gets out of this HDFS: the large file in 8 MiB
                 cat_file ranges, 8 threads; the small files whole, 8 threads.
    local-disk   the same bytes from local files (written just before, page cache dropped), read as the
                 mount reads: the large file in 4 MiB reads, the small files whole by 8 threads. Not a
                 target's reference: what a read served by this machine's disk can reach at most.
    pffs-sdk     fsspec.filesystem("pffs", target="hdfs://127.0.0.1:PORT/ds", memory_cache_size="512M",
                 cache_size="4G", block_size="4M"): the large file in sequential 4 MiB reads, the small
                 files by cat_file from 8 threads.
    pffs-mount   pffs mount hdfs://127.0.0.1:PORT/ds MNT --cache-size 8G --memory-cache-size 512M
                 --attr-ttl 1 --dir-ttl 60: the large file in sequential 4 MiB reads, the small files read
                 whole by 8 threads in a shuffled order (bench/mounts.py's phases).

pffs's variants:
    cold       first read, empty cache directory (SDK: a fresh process; mount: a fresh mount)
    warm_disk  its disk tier: a fresh process (SDK) or a remount (mount), with the page cache dropped
    warm       a second read right after, in the same process (SDK: its memory tier; mount: the kernel's
               page cache, as the mount caches what it serves there)
The small files are read after one listing, outside the clock. Large: MB/s (10^6 B/s); small: files/s.

Targets (issue 14), each as a ratio in this run, for the SDK and the mount:
    large cold >= 0.8 x ceiling; large warm_disk >= 5 x hdfs-native; small warm_disk >= 5 x hdfs-native;
    small cold >= 2 x hdfs-native (one thread: the plain client as a loop uses it; the 8-thread ceiling is
    shown beside it).

Each phase runs --repeats times (rounds, interleaved) and the median is reported. Per measurement the JSON
also keeps the CPU seconds of the reader (on the clock), of the mount process and the HDFS JVM (while it
ran, sha256 checks included: they are idle then) and of the whole machine (the reader's plus every other
process's), and for pffs which tier served the reads: on this machine's few cores, shared by all of them,
these say what bounds a figure.

Exit code 1 if any read did not match its sha256 or a phase failed; a missed target is reported, exit 0.
Writes bench/results/hdfs.json and bench/results/hdfs.png (--out-dir), and prints a table.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sdk: Any = importlib.import_module("sdk")  # bench/sdk.py and bench/mounts.py: the shared helpers, unchanged
mounts: Any = importlib.import_module("mounts")

MB = sdk.MB
GIB = 1 << 30
CHUNK = sdk.CHUNK  # 4 MiB sequential reads
RANGE = sdk.RANGE  # ceiling: 8 MiB ranges ...
PARALLEL_READS = sdk.PARALLEL_GETS  # ... 8 in flight
THREADS = sdk.THREADS  # small files: 8 threads
SEED = sdk.SEED
MALLOC_ENV = sdk.MALLOC_ENV
ROOT = "/ds"
LARGE_NAME = mounts.LARGE_NAME  # "large.bin"
SMALL_DIR = mounts.SMALL_DIR  # "small"
WRITERS = 16  # threads writing the small files into HDFS
WARM_UP_PASSES = 3  # reads of every file before the first phase (see warm_up_jvm)
SDK_OPTIONS = sdk.PFFS_OPTIONS
MOUNT_OPTIONS = mounts.PFFS_OPTIONS
PHASE_TIMEOUT_S = 300.0
RESULT_MARKER = "BENCH_RESULT "
BIN = Path(sys.executable).parent
CLIENTS = ("hdfs-native", "ceiling", "local-disk", "pffs-sdk", "pffs-mount")
VARIANTS = {  # the reference clients' one variant per dataset
    "ceiling": {"large": f"{PARALLEL_READS}x{RANGE >> 20}MiB ranges", "small": "whole files"},
    "local-disk": {"large": "4MiB reads", "small": "whole files"},
}
REFERENCE_PHASES = (
    "ceiling.large",
    "ceiling.small",
    "plain.large",
    "plain.small",
    "disk.large",
    "disk.small",
)
SDK_PHASES = ("sdk.large.cold", "sdk.large.warm_disk", "sdk.small.cold", "sdk.small.warm_disk")
# (dataset, pffs variant, reference client, threshold); each for the SDK and for the mount.
TARGETS = (
    ("large", "cold", "ceiling", 0.8),
    ("large", "warm_disk", "hdfs-native", 5.0),
    ("small", "warm_disk", "hdfs-native", 5.0),
    ("small", "cold", "hdfs-native", 2.0),
)
Result = dict[str, Any]


def log(message: str) -> None:
    print(f"[hdfs {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


class PhaseFailed(RuntimeError):
    pass


@dataclass
class Spec:
    """What every phase process needs: where HDFS is, whose CPU to count, what the data must hash to."""

    host: str
    port: int
    jvm_pid: int  # the MiniDFSCluster's JVM: NameNode and both DataNodes
    large_size: int
    large_sha256: str
    small_size: int
    small: dict[str, str]  # "small/00000.bin" -> sha256 (bench/sdk.py's naming)
    cache_root: str  # one SDK cache directory per dataset below this
    local_root: str  # the same files on the local disk (large.bin, small/), for the disk ceilings

    @classmethod
    def load(cls, path: str) -> Spec:
        return cls(**json.loads(Path(path).read_text()))

    @property
    def url(self) -> str:
        return f"hdfs://{self.host}:{self.port}{ROOT}"

    def cache_dir(self, dataset: str) -> Path:
        return Path(self.cache_root) / f"sdk-{dataset}"

    def mount_view(self) -> Any:
        """The spec as bench/mounts.py's phases read it: small files named without their folder."""
        small = {name.removeprefix(f"{SMALL_DIR}/"): h for name, h in self.small.items()}
        return SimpleNamespace(**{**asdict(self), "small": small})


# -- reading (phase process side) ---------------------------------------------------------------------------
@dataclass
class Where:
    """Where a phase reads (a mountpoint, or the local copy when empty) and whose CPU it counts."""

    spec: Spec
    root: str = ""  # the mountpoint, for the mount's phases
    mount_pid: int = 0


def accounted(where: Where, measure: Callable[[], Result]) -> Result:
    """measure()'s result, with the CPU seconds the mount, the HDFS JVM and every other process of the
    machine used meanwhile (the reader's own, on the clock, are in the result already). The window is a
    little wider than the clock: it includes the sha256 checks, during which the others are idle."""
    mount = mounts.tree_pids(where.mount_pid) if where.mount_pid else []
    jvm = [where.spec.jvm_pid]
    before = (mounts.cpu_of(mount), mounts.cpu_of(jvm), mounts.busy_cpu_seconds() - sum(mounts.cpu_now()))
    result = measure()
    others = mounts.busy_cpu_seconds() - sum(mounts.cpu_now()) - before[2]
    result["mount_cpu_seconds"] = round(mounts.cpu_of(mount) - before[0], 3) if mount else 0.0
    result["hdfs_cpu_seconds"] = round(mounts.cpu_of(jvm) - before[1], 3)
    result["other_cpu_seconds"] = round(others, 3)
    return result


def with_machine_cpu(row: Result) -> Result:
    """The machine's CPU seconds while the clock ran: the reader's own plus every other process's."""
    return {**row, "machine_cpu_seconds": round(row["cpu_seconds"] + row.pop("other_cpu_seconds"), 3)}


def plain_client(spec: Spec, name: str) -> Any:
    import fsspec

    fs = fsspec.filesystem("hdfs", host=spec.host, port=spec.port, skip_instance_cache=True)
    return sdk.Client(name, fs, f"{ROOT}/")


def sdk_client(spec: Spec, dataset: str) -> Any:
    import fsspec

    fs = fsspec.filesystem(
        "pffs",
        target=spec.url,
        cache_dir=str(spec.cache_dir(dataset)),
        skip_instance_cache=True,
        **SDK_OPTIONS,
    )
    return sdk.Client("pffs", fs, "")  # named "pffs" so that bench/sdk.py counts its cache tiers


def phase_plain(dataset: str, where: Where) -> list[Result]:
    spec = where.spec
    client = plain_client(spec, "hdfs-native")
    client.warm_up()
    if dataset == "large":
        return [accounted(where, lambda: sdk.read_large(client, "direct", spec)) for _ in range(2)]
    return [accounted(where, lambda: sdk.read_small(client, "direct", spec, 1)) for _ in range(2)]


def parallel_ranged_reads(fs: Any, path: str, size: int) -> list[bytes]:
    def read(start: int) -> bytes:
        return bytes(fs.cat_file(path, start=start, end=min(start + RANGE, size)))

    with ThreadPoolExecutor(PARALLEL_READS) as pool:
        return list(pool.map(read, range(0, size, RANGE)))


def phase_ceiling(dataset: str, where: Where) -> list[Result]:
    spec = where.spec
    client = plain_client(spec, "ceiling")
    client.warm_up()
    variant = VARIANTS["ceiling"][dataset]
    if dataset == "small":
        return [accounted(where, lambda: sdk.read_small(client, variant, spec, THREADS))]

    def measure() -> Result:
        read = partial(parallel_ranged_reads, client.fs, f"{ROOT}/{LARGE_NAME}", spec.large_size)
        parts, wall, cpu = sdk.timed(read)
        return {**sdk.large_result(client.name, variant, parts, wall, cpu, spec), "threads": PARALLEL_READS}

    return [accounted(where, measure)]


def phase_sdk(dataset: str, stage: str, where: Where) -> list[Result]:
    """A first pass ("cold": empty cache; "warm_disk": a filled one), then a "warm" second pass."""
    spec = where.spec
    client = sdk_client(spec, dataset)
    client.warm_up()

    def measure(variant: str) -> Result:
        if dataset == "large":
            read = partial(sdk.read_large, client, variant, spec)
        else:
            read = partial(sdk.read_small, client, variant, spec, THREADS)
        return {**accounted(where, lambda: sdk.with_tier_counts(client, read)), "client": "pffs-sdk"}

    return [measure(stage), measure("warm")]


def phase_files_large(client: str, variants: tuple[str, ...], where: Where) -> list[Result]:
    """The large file read through a file system (the mount, or the local disk where `root` is local)."""
    spec = where.spec
    buf = mounts.touched_buffer(spec.large_size)  # no page faults on the clock
    path = os.path.join(where.root or spec.local_root, LARGE_NAME)
    rows = []
    for variant in variants:
        run = accounted(where, lambda: mounts.sequential(path, buf, spec.large_size, spec.large_sha256))
        verified = run.pop("ok")
        rows.append(
            {"client": client, "dataset": "large", "variant": variant, "threads": 1, **run,
             "verified": verified}
        )  # fmt: skip
    return rows


def phase_files_small(client: str, variant: str, where: Where) -> list[Result]:
    """The small files read through a file system by 8 threads, shuffled (bench/mounts.py's phase)."""
    root = where.root or where.spec.local_root
    result = accounted(where, lambda: mounts.phase_small(where.spec.mount_view(), root, variant))
    details = result.pop("details")
    return [
        {
            "client": client,
            "dataset": "small",
            "variant": variant,
            **details,
            **{k: v for k, v in result.items() if k.endswith("_cpu_seconds")},
            "files_per_s": next(iter(result["figures"].values())),
            "verified": result["verified"],
        }
    ]


PHASES: dict[str, Callable[[Where], list[Result]]] = {
    "ceiling.large": partial(phase_ceiling, "large"),
    "ceiling.small": partial(phase_ceiling, "small"),
    "plain.large": partial(phase_plain, "large"),
    "plain.small": partial(phase_plain, "small"),
    **{
        f"sdk.{dataset}.{stage}": partial(phase_sdk, dataset, stage)
        for dataset in ("large", "small")
        for stage in ("cold", "warm_disk")
    },
    "disk.large": partial(phase_files_large, "local-disk", (VARIANTS["local-disk"]["large"],)),
    "disk.small": partial(phase_files_small, "local-disk", VARIANTS["local-disk"]["small"]),
    "mount.large.cold": partial(phase_files_large, "pffs-mount", ("cold",)),
    "mount.small.cold": partial(phase_files_small, "pffs-mount", "cold"),
    "mount.large.warm_disk": partial(phase_files_large, "pffs-mount", ("warm_disk", "warm")),
    "mount.small.warm_disk": partial(phase_files_small, "pffs-mount", "warm_disk"),
}


def run_phase_here(name: str, spec_path: str, root: str, mount_pid: int) -> int:
    """Phase process side: one phase, its results as one JSON line on stdout."""
    spec = Spec.load(spec_path)
    if name.startswith(("plain.", "ceiling.", "sdk.")):  # as bench/sdk.py: what the phase keeps, and more
        kept = spec.large_size if ".large" in name else spec.small_size * len(spec.small)
        sdk.prefault(2 * kept + (512 << 20))
    results = [with_machine_cpu(r) for r in PHASES[name](Where(spec, root, mount_pid))]
    print(RESULT_MARKER + json.dumps(results), flush=True)
    return 0


# -- the run (parent side) ----------------------------------------------------------------------------------
@dataclass
class HdfsMount(mounts.Mount):
    """pffs mounting the dataset in HDFS; starting, waiting, unmounting and forcing are bench/mounts.py's."""

    source: str = ""

    def command(self) -> tuple[list[str], dict[str, str]]:
        mnt, cache = str(self.mountpoint), str(self.cache_dir)
        cmd = [str(BIN / "pffs"), "mount", self.source, mnt, "--cache-dir", cache, *MOUNT_OPTIONS]
        return [*cmd, "--log-file", str(self.log_path())], dict(os.environ)


def run_child(name: str, spec_path: Path, mount: HdfsMount | None) -> list[Result]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--phase", name, "--spec", str(spec_path)]
    if mount is not None:
        cmd += ["--root", str(mount.root), "--mount-pid", str(mount.pid)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, **MALLOC_ENV})
    try:
        out, _ = proc.communicate(timeout=PHASE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        log(f"  phase {name} did not finish within {PHASE_TIMEOUT_S}s: aborting it")
        if mount is not None and mount.pid:  # where the mount is stuck, for the bug report
            dump = subprocess.run(
                [str(BIN / "py-spy"), "dump", "--pid", str(mount.pid)],
                capture_output=True, text=True, timeout=60, check=False,
            )  # fmt: skip
            log(f"  py-spy dump of the pffs mount:\n{dump.stdout}{dump.stderr}")
            mounts.force_unmount(mount.mountpoint)
        proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.communicate(timeout=30)
        raise PhaseFailed(f"phase {name} timed out after {PHASE_TIMEOUT_S}s") from None
    except BaseException:  # interrupted (SIGTERM, ^C): no reader outlives the run
        proc.kill()
        raise
    lines = [ln for ln in out.splitlines() if ln.startswith(RESULT_MARKER)]
    if proc.returncode != 0 or not lines:
        raise PhaseFailed(f"phase {name} failed (exit code {proc.returncode})")
    results: list[Result] = json.loads(lines[-1].removeprefix(RESULT_MARKER))
    return results


@dataclass
class Run:
    """The parent's state: the spec, where HDFS keeps its blocks, what was measured."""

    workdir: Path
    spec: Spec
    spec_path: Path
    hdfs_data: Path
    rows: list[Result] = field(default_factory=list)
    failures: list[Result] = field(default_factory=list)
    mount_command: str = ""

    def phase(self, name: str, repeat: int, mount: HdfsMount | None = None) -> None:
        log(f"phase {name} (repeat {repeat + 1})")
        if name.startswith("sdk.") and name.endswith(".cold"):  # a cold phase starts from an empty cache
            shutil.rmtree(self.spec.cache_dir(name.split(".")[1]), ignore_errors=True)
        if name.startswith("disk."):
            write_local_copy(self.spec, name.split(".")[1])
        dropped = sdk.drop_page_cache()
        if not name.startswith("disk."):
            sdk.rewarm_server(self.hdfs_data)  # HDFS serves from RAM, in every phase that reads it
        counters = mount.counters() if mount is not None else {}
        load = os.getloadavg()[0]
        try:
            rows = run_child(name, self.spec_path, mount)
        except PhaseFailed as exc:
            self.failures.append({"phase": name, "repeat": repeat, "error": str(exc)})
            if mount is not None:
                log(mount.tail())
            raise
        if mount is not None:  # the mount's own counters over the phase: which tier served it
            after = mount.counters()
            delta = {
                k: v - counters.get(k, 0)
                for k, v in after.items()
                if isinstance(v, int | float) and v != counters.get(k, 0)
            }
            for r in rows:
                r["mount_counters"] = delta
        for r in rows:
            r.update(
                phase=name, repeat=repeat, page_cache_dropped=dropped, loadavg_1min_before=round(load, 2)
            )
            speed = (
                f"{r['files_per_s']:.0f} files/s" if r["dataset"] == "small" else f"{r['mb_per_s']:.0f} MB/s"
            )
            cpu = f"cpu reader {r['cpu_seconds']:.2f}, mount {r['mount_cpu_seconds']:.2f}, "
            cpu += f"hdfs {r['hdfs_cpu_seconds']:.2f}, machine {r['machine_cpu_seconds']:.2f} s"
            ok = "ok" if r["verified"] else "SHA256 MISMATCH"
            log(
                f"  {r['client']} {r['dataset']} {r['variant']}: {speed} in {r['seconds']:.2f}s ({cpu}; {ok})"
            )
        self.rows += rows

    def standalone(self, names: tuple[str, ...], repeat: int) -> None:
        """Phases without a mount: one that fails is recorded, and the others still run."""
        for name in names:
            with contextlib.suppress(PhaseFailed):
                self.phase(name, repeat)

    def mount_phases(self, repeat: int) -> None:
        """Mount on an empty cache: cold phases; unmount, mount again on the same cache: warm ones."""
        cache = self.workdir / "caches" / f"mount-r{repeat}"
        shutil.rmtree(cache, ignore_errors=True)
        ctx = mounts.Context("", "", "", self.workdir)  # its logs folder; no S3 here
        mount = HdfsMount("pffs", ctx, cache, self.workdir / "mnt" / "pffs", source=self.spec.url)
        try:
            mount.start()
            for name in ("mount.large.cold", "mount.small.cold"):
                self.phase(name, repeat, mount)
            mount.stop()  # `pffs umount`: waits for the mount process to end, its blocks written
            mount.start()
            for name in ("mount.large.warm_disk", "mount.small.warm_disk"):
                self.phase(name, repeat, mount)
        except (PhaseFailed, OSError, subprocess.SubprocessError) as exc:
            log(f"  pffs mount FAILED: {exc}")
            if not any(f["repeat"] == repeat and f["phase"].startswith("mount") for f in self.failures):
                self.failures.append({"phase": "mount", "repeat": repeat, "error": str(exc)})
        finally:
            mount.stop()
            if mount.commands and not self.mount_command:
                self.mount_command = mount.commands[0].replace(str(self.workdir), "$WORKDIR")
            shutil.rmtree(cache, ignore_errors=True)


def write_local_copy(spec: Spec, dataset: str) -> None:
    """The dataset's bytes in local files, for the disk ceiling, written just before they are read as
    pffs's cache files are by its cold phases: this VM's disk reads data written a while ago several times
    slower than data written just before (see bench/sdk.py)."""
    root = Path(spec.local_root)
    if dataset == "large":
        sdk.write_local_large(root / LARGE_NAME, spec.large_size)
        return
    shutil.rmtree(root / SMALL_DIR, ignore_errors=True)
    (root / SMALL_DIR).mkdir(parents=True)
    for name, data in mounts.small_files(len(spec.small), spec.small_size, SEED + 1):
        (root / SMALL_DIR / name).write_bytes(data)
    os.sync()


def write_dataset(hdfs: Any, workdir: Path, args: argparse.Namespace) -> Spec:
    import fsspec
    import numpy as np

    log(f"writing a {args.large_size} B file and {args.small_count} x {args.small_size} B files into HDFS")
    started = time.monotonic()
    fs = fsspec.filesystem("hdfs", host="127.0.0.1", port=hdfs.rpc_port, skip_instance_cache=True)
    fs.makedirs(f"{ROOT}/{SMALL_DIR}", exist_ok=True)
    rng, digest = np.random.default_rng(SEED), hashlib.sha256()  # bench/sdk.py's large object's bytes
    with fs.open(f"{ROOT}/{LARGE_NAME}", "wb") as f:
        for start in range(0, args.large_size, 64 << 20):
            block = rng.bytes(min(64 << 20, args.large_size - start))
            digest.update(block)
            f.write(block)
    small: dict[str, str] = {}

    def put(item: tuple[str, bytes]) -> None:
        fs.pipe_file(f"{ROOT}/{SMALL_DIR}/{item[0]}", item[1])

    with ThreadPoolExecutor(WRITERS) as pool:
        for batch in mounts.batched(mounts.small_files(args.small_count, args.small_size, SEED + 1), 250):
            list(pool.map(put, batch))
            small.update({f"{SMALL_DIR}/{name}": hashlib.sha256(data).hexdigest() for name, data in batch})
    log(f"dataset written in {time.monotonic() - started:.1f}s")
    warm_up_jvm(fs, args)
    return Spec(
        host="127.0.0.1",
        port=hdfs.rpc_port,
        jvm_pid=hdfs.process.pid,
        large_size=args.large_size,
        large_sha256=digest.hexdigest(),
        small_size=args.small_size,
        small=small,
        cache_root=str(workdir / "caches"),
        local_root=str(workdir / "local"),
    )


def warm_up_jvm(fs: Any, args: argparse.Namespace) -> None:
    """Every file read WARM_UP_PASSES times, outside any clock, so that the JVM's JIT has compiled the
    DataNodes' read path before the first phase (right after start, the first 1,000 small-file reads ran
    at 450 files/s here, later ones at 650-780 from one thread): the first phase is not penalized."""
    started = time.monotonic()
    paths = fs.find(f"{ROOT}/{SMALL_DIR}")
    with ThreadPoolExecutor(THREADS) as pool:
        for _ in range(WARM_UP_PASSES):
            list(pool.map(fs.cat_file, paths))
            parallel_ranged_reads(fs, f"{ROOT}/{LARGE_NAME}", args.large_size)
    seconds = time.monotonic() - started
    log(f"HDFS's read path warmed up ({WARM_UP_PASSES} reads of every file) in {seconds:.1f}s")


def run_all(args: argparse.Namespace, workdir: Path) -> Run:
    from pffs.testing.hdfs_cluster import MiniDfs, missing_pieces

    missing = missing_pieces()
    if missing:
        raise SystemExit(f"cannot start HDFS: missing {', '.join(missing)}; run `make setup`")
    log(f"starting HDFS (MiniDFSCluster) in {workdir}")
    with MiniDfs(workdir / "dfs") as hdfs:
        spec = write_dataset(hdfs, workdir, args)
        spec_path = workdir / "spec.json"
        spec_path.write_text(json.dumps(asdict(spec)))
        run = Run(workdir, spec, spec_path, workdir / "dfs" / "data")
        for repeat in range(args.repeats):
            run.standalone(REFERENCE_PHASES, repeat)
            run.standalone(SDK_PHASES, repeat)
            run.mount_phases(repeat)
        return run


# -- report -------------------------------------------------------------------------------------------------
def find(rows: list[Result], client: str, dataset: str, variant: str) -> Result | None:
    return next(
        (r for r in rows if (r["client"], r["dataset"], r["variant"]) == (client, dataset, variant)), None
    )


def reference(rows: list[Result], client: str, dataset: str) -> Result | None:
    variant = VARIANTS[client][dataset] if client in VARIANTS else "direct"
    return find(rows, client, dataset, variant)


def add_ratios(rows: list[Result]) -> None:
    """Each row over the plain client, the ceiling and the local disk (same dataset), and the CPU seconds per
    GiB read."""
    for r in rows:
        key = sdk.metric(r)
        for name, client in (
            ("vs_plain", "hdfs-native"),
            ("vs_ceiling", "ceiling"),
            ("vs_disk", "local-disk"),
        ):
            ref = reference(rows, client, r["dataset"])
            r[name] = round(r[key] / ref[key], 3) if ref and ref[key] else None
        gib = r["bytes"] / GIB
        r["cpu_seconds_per_gib"] = {
            who: round(r[name] / gib, 2) if gib else None
            for who, name in (
                ("reader", "cpu_seconds"),
                ("mount", "mount_cpu_seconds"),
                ("hdfs", "hdfs_cpu_seconds"),
                ("machine", "machine_cpu_seconds"),
            )
        }
        # Kernel threads and whatever else ran on the machine meanwhile (other work skews every figure).
        rest = r["machine_cpu_seconds"] - r["cpu_seconds"] - r["mount_cpu_seconds"] - r["hdfs_cpu_seconds"]
        r["cpu_seconds_per_gib"]["rest"] = round(rest / gib, 2) if gib else None


def compute_targets(rows: list[Result]) -> list[Result]:
    out = []
    for client in ("pffs-sdk", "pffs-mount"):
        for dataset, variant, ref_client, threshold in TARGETS:
            name = f"{client} {dataset} {variant} >= {threshold:g} x {ref_client}"
            num, den = find(rows, client, dataset, variant), reference(rows, ref_client, dataset)
            if num is None or den is None:
                out.append({"target": name, "pass": None, "note": "not measured"})
                continue
            key = sdk.metric(num)
            ratio = num[key] / den[key]
            target = {
                "target": name,
                "measured": f"{num[key]:.0f} / {den[key]:.0f} {key.replace('_per_s', '/s')}",
                "ratio": round(ratio, 3),
                "threshold": threshold,
                "pass": ratio >= threshold,
            }
            disk = reference(rows, "local-disk", dataset)
            if variant == "warm_disk" and disk is not None:  # what a read from this disk can reach at most
                target["local_disk_over_reference"] = round(disk[key] / den[key], 3)
            out.append(target)
    return out


def tool_version(cmd: list[str]) -> str:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unavailable ({exc})"
    text = (done.stdout or done.stderr).strip().splitlines()
    return text[0].strip() if text else "unknown"


def build_report(args: argparse.Namespace, run: Run, seconds: float) -> Result:
    from pffs.testing.hdfs_cluster import HADOOP_VERSION

    order = {c: i for i, c in enumerate(CLIENTS)}
    rows = sorted(sdk.aggregate(run.rows), key=lambda r: (r["dataset"], order[r["client"]]))
    add_ratios(rows)
    return {
        "command": " ".join([shlex.quote(sys.executable), *map(shlex.quote, sys.argv)]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "total_seconds": round(seconds, 1),
        "machine": {
            **sdk.machine_info(),
            "loadavg_at_start": args.loadavg,
            "loadavg_at_end": os.getloadavg(),
        },
        "versions": {
            "hdfs-native": sdk.package_version("hdfs-native"),
            "hadoop (MiniDFSCluster)": HADOOP_VERSION,
            "java": tool_version(["java", "-version"]),
        },
        "config": {
            "large_size": args.large_size,
            "small_count": args.small_count,
            "small_size": args.small_size,
            "repeats": args.repeats,
            "read_chunk": CHUNK,
            "ceiling": {"parallel": PARALLEL_READS, "range": RANGE, "small_threads": THREADS},
            "small_threads": THREADS,
            "sdk_options": SDK_OPTIONS,
            "mount_command": run.mount_command,
            "phase_env": MALLOC_ENV,
            "mb": MB,
        },
        "verified": all(r["verified"] for r in rows) and bool(rows),
        "failures": run.failures,
        "targets": compute_targets(rows),
        "results": rows,
    }


def fmt(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}" if value >= 10 else f"{value:.2f}"


def tiers(r: Result) -> str:
    stats = r.get("cache_stats") or r.get("mount_counters")
    if not stats:
        return ""
    return "{}/{}/{}".format(*(int(stats.get(k, 0)) for k in ("memory_hits", "disk_hits", "misses")))


def print_table(report: Result) -> None:
    header = ("client", "data", "variant", "thr", "runs", "secs", "MB/s", "files/s", "range", "x plain",
              "x ceil", "x disk", "cpu s/GiB rdr/mnt/hdfs/all", "ok", "pffs mem/disk/miss")  # fmt: skip
    rows = [header]
    for r in report["results"]:
        key = sdk.metric(r)
        per_gib = r["cpu_seconds_per_gib"]
        rows.append(
            (
                r["client"],
                r["dataset"],
                r["variant"],
                str(r["threads"]),
                str(r["runs"]),
                f"{r['seconds']:.2f}",
                fmt(r["mb_per_s"]),
                fmt(r["files_per_s"]) if key == "files_per_s" else "",
                f"{fmt(r['min'])}-{fmt(r['max'])}",
                fmt(r["vs_plain"]),
                fmt(r["vs_ceiling"]),
                fmt(r["vs_disk"]),
                "/".join(fmt(per_gib[w]) for w in ("reader", "mount", "hdfs", "machine")),
                "yes" if r["verified"] else "NO",
                tiers(r),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    print()
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    print(
        "figures: median of the runs (secs, cpu, tiers: of the median run); range: min-max of the figure\n"
        "x plain / x ceil / x disk: over hdfs-native direct (1 thread) / the ceiling (8 threads) / the local "
        "disk (page cache dropped), same dataset\n"
        "cpu s/GiB: CPU seconds per GiB read of the reader process, the pffs mount, the HDFS JVM and the "
        "whole machine\n"
    )
    for t in report["targets"]:
        status = {True: "MET   ", False: "MISSED", None: "N/A   "}[t["pass"]]
        detail = f"{t['ratio']:.2f} ({t['measured']})" if t["pass"] is not None else t["note"]
        if "local_disk_over_reference" in t:
            detail += f"; the local disk itself: {t['local_disk_over_reference']:.2f}"
        print(f"{status} {t['target']}: {detail}")
    for f in report["failures"]:
        print(f"FAILED {f['phase']} (repeat {f['repeat'] + 1}): {f['error'][:300]}")
    print(f"\ncommand: {report['command']}")
    print(f"all reads verified (sha256): {'yes' if report['verified'] else 'NO'}; "
          f"pffs at {report['machine']['pffs_git']}")  # fmt: skip
    print(f"total time: {report['total_seconds']}s")


def plot(report: Result, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"hdfs-native": "tab:gray", "pffs-sdk": "tab:green", "pffs-mount": "tab:olive"}
    results, cfg = report["results"], report["config"]
    fig, axes = plt.subplots(2, 1, figsize=(12, 9))
    titles = {
        "large": f"one {cfg['large_size'] >> 20} MiB file, sequential 4 MiB reads: MB/s (10^6 B/s)",
        "small": f"{cfg['small_count']} files x {cfg['small_size'] >> 10} KiB, after one listing: files/s "
        f"(hdfs-native: 1 thread; pffs: {THREADS} threads)",
    }
    for ax, dataset in zip(axes, ("large", "small"), strict=True):
        rows = [r for r in results if r["dataset"] == dataset and r["client"] not in VARIANTS]
        if not rows:
            continue
        key = sdk.metric(rows[0])
        values = [r[key] for r in rows]
        spread = [[v - r["min"] for v, r in zip(values, rows, strict=True)],
                  [r["max"] - v for v, r in zip(values, rows, strict=True)]]  # fmt: skip
        xs = list(range(len(rows)))
        bars = ax.bar(xs, values, yerr=spread, capsize=2, color=[colors[r["client"]] for r in rows])
        ax.bar_label(bars, labels=[fmt(v) for v in values], fontsize=8)
        ax.set_xticks(xs, [f"{r['client']}\n{r['variant']}" for r in rows], fontsize=8)
        for client, style, what in (
            ("ceiling", "--", "ceiling: hdfs-native, {variant}, {threads} threads"),
            ("local-disk", ":", "local disk, page cache dropped: {variant}, {threads} thread(s)"),
        ):
            ref = reference(results, client, dataset)
            if ref is not None:
                label = what.format(**ref) + f": {fmt(ref[key])}"
                ax.axhline(ref[key], color="black", linestyle=style, linewidth=1, label=label)
        ax.legend(loc="upper left", fontsize=8)
        ax.set_yscale("log")  # warm and cold figures differ by orders of magnitude
        ax.grid(axis="y", which="major", alpha=0.3)
        ax.set_title(titles[dataset] + f" (median of {cfg['repeats']}, min-max)", fontsize=10)
    fig.suptitle(
        f"pffs over HDFS (MiniDFSCluster on loopback) vs the plain hdfs-native client, "
        f"{report['machine']['nproc']} cores, {report['date'][:10]}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# -- main ---------------------------------------------------------------------------------------------------
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
        "--repeats", type=int, default=3, help="runs of every phase, median reported (default 3)"
    )
    parser.add_argument("--workdir", help="where HDFS's data, the caches and the mount go (default /tmp)")
    parser.add_argument("--out-dir", default=str(Path(__file__).parent / "results"), help="output folder")
    parser.add_argument("--phase", help=argparse.SUPPRESS)  # internal: run one phase (subprocess side)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    parser.add_argument("--root", default="", help=argparse.SUPPRESS)
    parser.add_argument("--mount-pid", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.small_count < 1 or args.large_size < 1 or args.small_size < 1:
        parser.error("--repeats, --small-count, --large-size and --small-size must be positive")
    return args


def run_benchmark(args: argparse.Namespace) -> int:
    if os.geteuid() != 0:
        log("not root: the page cache cannot be dropped, and mounting may fail; run as root")
    signal.signal(signal.SIGTERM, mounts._terminate)  # unwinds every finally: unmounted, HDFS stopped
    started = time.monotonic()
    args.loadavg = os.getloadavg()  # other work on this machine skews every figure: recorded
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if args.workdir:
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="pffs-hdfs-bench-", dir=args.workdir))
    try:
        run = run_all(args, workdir)
    finally:
        for mnt in (workdir / "mnt").glob("*"):  # nothing may stay mounted, whatever happened
            if mounts.mount_entry(mnt) is not None:
                log(f"left mounted: {mnt}; detaching it")
                mounts.force_unmount(mnt)
        shutil.rmtree(workdir, ignore_errors=True)
    report = build_report(args, run, time.monotonic() - started)
    (out / "hdfs.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(report, out / "hdfs.png")
    print_table(report)
    log(f"wrote {out / 'hdfs.json'} and {out / 'hdfs.png'}")
    return 0 if report["verified"] and not report["failures"] else 1


def main() -> int:
    args = parse_args()
    if args.phase:
        return run_phase_here(args.phase, args.spec, args.root, args.mount_pid)
    return run_benchmark(args)


if __name__ == "__main__":
    sys.exit(main())
