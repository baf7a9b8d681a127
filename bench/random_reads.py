"""How many bytes random reads through a pffs mount and the pffs SDK fetch from S3, against how many they
read (issue 34); and a sequential read of the whole object through both, to check that it is no slower.

    .venv/bin/python bench/random_reads.py --label after          # about two minutes
    .venv/bin/python bench/random_reads.py --label before --cases random

On a local SeaweedFS server, one ~96 MiB object, default 4 MiB blocks, a fresh cache directory (and, through
the mount, a fresh `pffs mount` process) per case:

    random       seeded random preads of 4 KiB (1000 of them), 64 KiB (200) and 1 MiB (24), at offsets that
                 are multiples of 4 KiB ("page": what the kernel's page cache reads anyway) and at any
                 offset ("any"). Mount: os.pread on one open file; SDK: seek + read on one fs.open() file.
                 Read is the bytes the reads cover (their union); fetched is the cache's `bytes_fetched`
                 (every byte S3 sent), GETs the backend's counted requests (mount: `user.pffs.stats`).
    sequential   the whole object, cold, in 1 MiB reads (mount) or 4 MiB reads (SDK): MB/s (median of
                 --repeats rounds), fetched/read and GETs.

Every read is compared with the source (exit 1 on a mismatch). Results accumulate in
bench/results/random_reads.json under --label (a run replaces only the cases it ran, of its own label);
bench/results/random_reads.png charts every label in the file.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import s3fs
from sparse_reads import commit  # bench/ is this script's folder: the commit and whether pffs changed

from pffs.config import parse_size
from pffs.testing.s3_server import SeaweedS3
from pffs.vfs.byte_ranges import covered_bytes

BUCKET = "bench-random"
OBJECT = "random.bin"
SEED = 20260734
PAGE = 4096
READS = {4 << 10: 1000, 64 << 10: 200, 1 << 20: 24}  # read size -> reads
ALIGNMENTS = {"page": PAGE, "any": 1}
RESULTS = Path(__file__).parent / "results"
PFFS = [sys.executable, "-m", "pffs.cli.main"]
Result = dict[str, Any]


def log(message: str) -> None:
    print(f"[random {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def offsets(size: int, length: int, reads: int, align: int) -> list[int]:
    rng = np.random.default_rng(SEED + length + align)
    return [int(o) // align * align for o in rng.integers(0, size - length, reads)]


@contextlib.contextmanager
def mounted(s3: SeaweedS3, work: Path, name: str) -> Iterator[Path]:
    mountpoint, cache = work / f"mnt-{name}", work / f"cache-mnt-{name}"
    mountpoint.mkdir()
    env = {**os.environ, "AWS_ACCESS_KEY_ID": s3.access_key, "AWS_SECRET_ACCESS_KEY": s3.secret_key}
    command = [*PFFS, "mount", f"s3://{BUCKET}", str(mountpoint), "--endpoint-url", s3.endpoint_url]
    command += ["--cache-dir", str(cache), "--read-only", "--log-file", str(work / f"mnt-{name}.log")]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        raise SystemExit(f"pffs mount failed: {result.stderr}")
    deadline = time.monotonic() + 30
    while not os.path.ismount(mountpoint):
        if time.monotonic() > deadline:
            raise SystemExit(f"{mountpoint} was not mounted in 30 s")
        time.sleep(0.05)
    try:
        yield mountpoint
    finally:
        subprocess.run(["fusermount3", "-u", str(mountpoint)], capture_output=True)
        if os.path.ismount(mountpoint):
            subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], capture_output=True)


def mount_counts(mountpoint: Path) -> Result:
    stats = json.loads(os.getxattr(mountpoint, "user.pffs.stats"))
    gets = stats["backend_requests"].get("get", {}).get("requests", 0)
    return {"bytes_fetched": stats["cache"]["bytes_fetched"], "gets": int(gets)}


def sdk_filesystem(s3: SeaweedS3, cache: Path) -> Any:
    return fsspec.filesystem(
        "pffs",
        target=f"s3://{BUCKET}",
        cache_dir=str(cache),
        skip_instance_cache=True,
        **s3.storage_options(),
    )


def sdk_counts(fs: Any) -> Result:
    gets = fs.vfs.backend.requests.snapshot().get("get", {}).get("requests", 0)
    return {"bytes_fetched": fs.cache_stats()["bytes_fetched"], "gets": int(gets)}


def grown(before: Result, after: Result) -> Result:
    return {k: after[k] - before[k] for k in before}


def measure_random(
    client: str, s3: SeaweedS3, work: Path, data: bytes, length: int, reads: int, alignment: str
) -> Result:
    name = f"{client}-{length}-{alignment}"
    where = offsets(len(data), length, reads, ALIGNMENTS[alignment])
    with contextlib.ExitStack() as stack:
        if client == "mount":
            mountpoint = stack.enter_context(mounted(s3, work, name))
            counts = lambda: mount_counts(mountpoint)  # noqa: E731
            fd = os.open(mountpoint / OBJECT, os.O_RDONLY)
            stack.callback(os.close, fd)
            read = lambda offset: os.pread(fd, length, offset)  # noqa: E731
        else:
            fs = sdk_filesystem(s3, work / f"cache-{name}")
            counts = lambda: sdk_counts(fs)  # noqa: E731
            f = stack.enter_context(fs.open(OBJECT, "rb"))

            def read(offset: int) -> bytes:
                f.seek(offset)
                return f.read(length)

        before = counts()
        started = time.perf_counter()
        for offset in where:
            if read(offset) != data[offset : offset + length]:
                raise SystemExit(f"{name}: the read at {offset} differs from the source")
        seconds = time.perf_counter() - started
        fetched = grown(before, counts())
    needed = covered_bytes([(o, o + length) for o in where])
    return {
        "case": "random",
        "client": client,
        "read_size": length,
        "alignment": alignment,
        "reads": reads,
        "read": needed,
        **fetched,
        "fetched_per_read": round(fetched["bytes_fetched"] / needed, 3),
        "reads_per_s": round(reads / seconds, 1),
    }


def measure_sequential(client: str, s3: SeaweedS3, work: Path, data: bytes, repeats: int) -> Result:
    expected = hashlib.sha256(data).hexdigest()
    speeds, fetched = [], []
    for round_ in range(repeats):
        name = f"{client}-seq-{round_}"
        digest = hashlib.sha256()
        with contextlib.ExitStack() as stack:
            if client == "mount":
                mountpoint = stack.enter_context(mounted(s3, work, name))
                before = mount_counts(mountpoint)
                started = time.perf_counter()
                with open(mountpoint / OBJECT, "rb", buffering=0) as f:
                    while chunk := f.read(1 << 20):
                        digest.update(chunk)
                seconds = time.perf_counter() - started
                fetched.append(grown(before, mount_counts(mountpoint)))
            else:
                fs = sdk_filesystem(s3, work / f"cache-{name}")
                before = sdk_counts(fs)
                started = time.perf_counter()
                with fs.open(OBJECT, "rb") as f:
                    while chunk := f.read(4 << 20):
                        digest.update(chunk)
                seconds = time.perf_counter() - started
                fetched.append(grown(before, sdk_counts(fs)))
        if digest.hexdigest() != expected:
            raise SystemExit(f"{name}: the sequential read differs from the source")
        speeds.append(len(data) / seconds / 1e6)
    return {
        "case": "sequential",
        "client": client,
        "read": len(data),
        "bytes_fetched": fetched[-1]["bytes_fetched"],
        "gets": fetched[-1]["gets"],
        "fetched_per_read": round(fetched[-1]["bytes_fetched"] / len(data), 3),
        "cold_mb_s": round(statistics.median(speeds), 1),
        "cold_mb_s_rounds": [round(s, 1) for s in speeds],
    }


def run(args: argparse.Namespace) -> list[Result]:
    results = []
    with tempfile.TemporaryDirectory(prefix="pffs-random-") as tmp:
        work = Path(tmp)
        with SeaweedS3(work / "seaweedfs") as s3:
            raw = s3fs.S3FileSystem(skip_instance_cache=True, **s3.storage_options())
            raw.mkdir(BUCKET)
            data = np.random.default_rng(SEED).bytes(args.size)
            raw.pipe(f"{BUCKET}/{OBJECT}", data)
            for client in args.clients:
                if "random" in args.cases:
                    for length, reads in READS.items():
                        for alignment in ALIGNMENTS:
                            row = measure_random(client, s3, work, data, length, reads, alignment)
                            log(describe(row))
                            results.append(row)
                if "sequential" in args.cases:
                    row = measure_sequential(client, s3, work, data, args.repeats)
                    log(describe(row))
                    results.append(row)
    return results


def key(row: Result) -> tuple[Any, ...]:
    return (row["case"], row["client"], row.get("read_size"), row.get("alignment"))


def describe(row: Result) -> str:
    mib = 1 << 20
    if row["case"] == "random":
        size = f"{row['read_size'] >> 10} KiB"
        return (
            f"{row['client']:<5} random {row['reads']:4d} x {size:>8} ({row['alignment']:>4} offsets): "
            f"read {row['read'] / mib:6.1f} MiB, fetched {row['bytes_fetched'] / mib:6.1f} MiB in "
            f"{row['gets']:5d} GETs = {row['fetched_per_read']:.2f}x ({row['reads_per_s']:,.0f} reads/s)"
        )
    return (
        f"{row['client']:<5} sequential {row['read'] / mib:.0f} MiB: {row['cold_mb_s']:,.0f} MB/s cold, "
        f"fetched {row['fetched_per_read']:.2f}x in {row['gets']} GETs"
    )


def plot(report: Result, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(report["runs"])
    rows = {label: {key(r): r for r in report["runs"][label]["results"]} for label in labels}
    cases = list(dict.fromkeys(k for label in labels for k in rows[label] if k[0] == "random"))
    seq = list(dict.fromkeys(k for label in labels for k in rows[label] if k[0] == "sequential"))
    fig, (ratio_ax, seq_ax) = plt.subplots(1, 2, figsize=(15, 5.5), gridspec_kw={"width_ratios": [4, 1]})
    width = 0.8 / max(1, len(labels))
    for n, label in enumerate(labels):
        ratios = [rows[label][c]["fetched_per_read"] if c in rows[label] else 0 for c in cases]
        bars = ratio_ax.bar([i + n * width for i in range(len(cases))], ratios, width, label=label)
        ratio_ax.bar_label(bars, fmt="%.2f", fontsize=7)
        speeds = [rows[label][c]["cold_mb_s"] if c in rows[label] else 0 for c in seq]
        bars = seq_ax.bar([i + n * width for i in range(len(seq))], speeds, width, label=label)
        seq_ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ratio_ax.axhline(1.25, color="red", linewidth=0.8, linestyle="--", label="target 1.25x")
    ratio_ax.axhline(1.0, color="gray", linewidth=0.8)
    ratio_ax.set_xticks([i + width * (len(labels) - 1) / 2 for i in range(len(cases))])
    ratio_ax.set_xticklabels([f"{c[1]}\n{c[2] >> 10} KiB\n{c[3]}" for c in cases], fontsize=7)
    ratio_ax.set_yscale("log")
    ratio_ax.set_ylabel("bytes fetched from S3 / bytes read (log)")
    ratio_ax.set_title("random preads of a 96 MiB object (lower is better, 1.0 = exact)")
    ratio_ax.legend()
    seq_ax.set_xticks([i + width * (len(labels) - 1) / 2 for i in range(len(seq))])
    seq_ax.set_xticklabels([c[1] for c in seq])
    seq_ax.set_ylabel("MB/s, cold")
    seq_ax.set_title("sequential read of the object")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--label", default="current", help="the name this run's results are kept under")
    parser.add_argument("--size", type=parse_size, default=96 << 20, help="the object's size")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of the sequential read")
    parser.add_argument(
        "--cases", type=lambda t: t.split(","), default=["random", "sequential"], help="random,sequential"
    )
    parser.add_argument("--clients", type=lambda t: t.split(","), default=["mount", "sdk"], help="mount,sdk")
    args = parser.parse_args()
    results = run(args)
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "random_reads.json"
    report = json.loads(out.read_text()) if out.exists() else {"runs": {}}
    measured = {key(row) for row in results}
    kept = report["runs"].get(args.label, {}).get("results", [])
    report["runs"][args.label] = {
        "commit": commit(),
        "date": datetime.date.today().isoformat(),
        "config": {
            "size": args.size,
            "repeats": args.repeats,
            "reads": {str(k): v for k, v in READS.items()},
        },
        "results": [row for row in kept if key(row) not in measured] + results,
    }
    out.write_text(json.dumps(report, indent=2) + "\n")
    plot(report, RESULTS / "random_reads.png")
    print(f"\n{args.label}:")
    for row in report["runs"][args.label]["results"]:
        print("  " + describe(row))
    log(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
