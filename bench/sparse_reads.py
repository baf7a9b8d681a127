"""How many bytes sparse and random reads through the pffs SDK fetch, against how many they need (issue 15).

    .venv/bin/python bench/sparse_reads.py --label after          # about a minute
    .venv/bin/python bench/sparse_reads.py --label before --seq-size 64M

On a local SeaweedFS server, with a fresh cache directory per case, at 1 MiB and 4 MiB blocks:

    projection   pandas.read_parquet of 2 of 6 columns (uncompressed float64, row groups of 1 MiB column
                 chunks, the two columns 2 MiB apart) through a pffs filesystem. Needed: the two columns'
                 chunks, as the file's parquet metadata gives them (the footer is not counted).
    random       300 reads of 64 KiB at seeded random offsets of a 96 MiB object. Needed: the bytes the
                 reads cover (their union).
    sequential   a cold read (empty cache) and a warm one (the same process, again) of a 256 MiB object in
                 4 MiB reads: MB/s, the median of --repeats rounds, to check that nothing else got slower.

Fetched is the cache's `bytes_fetched` (every byte the backend sent); GETs are the backend's counted
requests. Every read is compared with the source (exit 1 on a mismatch).

Results accumulate in bench/results/sparse_reads.json under --label (a run replaces only the cases it ran,
of its own label), and bench/results/sparse_reads.png charts every label in the file.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import io
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import s3fs

from pffs.config import parse_size
from pffs.testing.s3_server import SeaweedS3
from pffs.vfs.byte_ranges import covered_bytes

BUCKET = "bench-sparse"
COLUMNS = [f"c{i}" for i in range(6)]
PROJECTED = ["c0", "c3"]  # 1 MiB chunks, 2 MiB apart in each row group
ROWS_PER_GROUP = 131072  # x 8 bytes: 1 MiB column chunks
READ = 64 << 10
CHUNK = 4 << 20
SEED = 20261126
BLOCK_SIZES = ("1M", "4M")
RESULTS = Path(__file__).parent / "results"
Result = dict[str, Any]


def log(message: str) -> None:
    print(f"[sparse {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def parquet_table(row_groups: int) -> tuple[bytes, pa.Table]:
    rng = np.random.default_rng(SEED)
    table = pa.table({name: rng.random(ROWS_PER_GROUP * row_groups) for name in COLUMNS})
    buffer = io.BytesIO()
    pq.write_table(table, buffer, row_group_size=ROWS_PER_GROUP, compression="none", use_dictionary=False)
    return buffer.getvalue(), table


def column_chunk_bytes(data: bytes, columns: list[str]) -> int:
    """The projected columns' chunks, as the file's own metadata gives them."""
    meta = pq.ParquetFile(io.BytesIO(data)).metadata
    wanted = {meta.schema.column(i).name: i for i in range(meta.num_columns)}
    return sum(
        meta.row_group(rg).column(wanted[name]).total_compressed_size
        for rg in range(meta.num_row_groups)
        for name in columns
    )


def pffs_filesystem(s3: SeaweedS3, cache_dir: Path, block_size: str) -> Any:
    return fsspec.filesystem(
        "pffs",
        target=f"s3://{BUCKET}",
        cache_dir=str(cache_dir),
        block_size=block_size,
        skip_instance_cache=True,
        **s3.storage_options(),
    )


def fetch_counts(fs: Any) -> Result:
    stats = fs.cache_stats()
    return {
        "bytes_fetched": stats["bytes_fetched"],
        "gets": int(fs.vfs.backend.requests.snapshot()["get"]["requests"]),
        "misses": stats["misses"],
    }


def measure_projection(s3: SeaweedS3, work: Path, block_size: str, data: bytes, table: pa.Table) -> Result:
    fs = pffs_filesystem(s3, work / f"cache-projection-{block_size}", block_size)
    frame = pd.read_parquet("table.parquet", columns=PROJECTED, filesystem=fs)
    for name in PROJECTED:
        if not np.array_equal(frame[name].to_numpy(), table[name].to_numpy()):
            raise SystemExit(f"projection at {block_size} blocks: column {name} differs from the source")
    needed = column_chunk_bytes(data, PROJECTED)
    counts = fetch_counts(fs)
    return {"case": "projection", "block_size": block_size, "needed": needed, **counts}


def measure_random(s3: SeaweedS3, work: Path, block_size: str, data: bytes, reads: int) -> Result:
    fs = pffs_filesystem(s3, work / f"cache-random-{block_size}", block_size)
    rng = np.random.default_rng(SEED)
    offsets = [int(o) for o in rng.integers(0, len(data) - READ, reads)]
    with fs.open("random.bin", "rb") as f:
        for offset in offsets:
            f.seek(offset)
            if f.read(READ) != data[offset : offset + READ]:
                raise SystemExit(f"random read at {offset} ({block_size} blocks) differs from the source")
    needed = covered_bytes([(o, o + READ) for o in offsets])
    counts = fetch_counts(fs)
    return {"case": f"random {reads} x 64 KiB", "block_size": block_size, "needed": needed, **counts}


def read_all(fs: Any, path: str) -> tuple[float, str]:
    digest = hashlib.sha256()
    started = time.perf_counter()
    with fs.open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return time.perf_counter() - started, digest.hexdigest()


def measure_sequential(s3: SeaweedS3, work: Path, size: int, expected: str, repeats: int) -> Result:
    cold, warm = [], []
    for round_ in range(repeats):
        fs = pffs_filesystem(s3, work / f"cache-sequential-{round_}", "4M")
        for times in (cold, warm):
            seconds, digest = read_all(fs, "sequential.bin")
            if digest != expected:
                raise SystemExit("sequential read differs from the source")
            times.append(size / seconds / 1e6)
    return {
        "case": "sequential",
        "block_size": "4M",
        "size": size,
        "cold_mb_s": round(statistics.median(cold), 1),
        "warm_mb_s": round(statistics.median(warm), 1),
        "rounds": repeats,
    }


def run(args: argparse.Namespace) -> list[Result]:
    with tempfile.TemporaryDirectory(prefix="pffs-sparse-") as tmp:
        work = Path(tmp)
        with SeaweedS3(work / "seaweedfs") as s3:
            raw = s3fs.S3FileSystem(skip_instance_cache=True, **s3.storage_options())
            raw.mkdir(BUCKET)
            table_bytes, table = parquet_table(args.row_groups)
            random_bytes = np.random.default_rng(SEED + 1).bytes(args.random_size)
            sequential = np.random.default_rng(SEED + 2).bytes(args.seq_size)
            raw.pipe(f"{BUCKET}/table.parquet", table_bytes)
            raw.pipe(f"{BUCKET}/random.bin", random_bytes)
            raw.pipe(f"{BUCKET}/sequential.bin", sequential)
            log(f"parquet {len(table_bytes) >> 20} MiB, random object {args.random_size >> 20} MiB")
            results = []
            if "sparse" in args.cases:
                for block_size in BLOCK_SIZES:
                    results.append(measure_projection(s3, work, block_size, table_bytes, table))
                    results.append(measure_random(s3, work, block_size, random_bytes, args.reads))
            if "sequential" in args.cases:
                expected = hashlib.sha256(sequential).hexdigest()
                results.append(measure_sequential(s3, work, args.seq_size, expected, args.repeats))
    for row in results:
        if "needed" in row:
            row["fetched_per_needed"] = round(row["bytes_fetched"] / row["needed"], 2)
    return results


def commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "pffs", "cache"], capture_output=True, text=True
        )
        return out.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def print_table(label: str, results: list[Result]) -> None:
    print(f"\n{label}:")
    for row in results:
        if "needed" in row:
            print(
                f"  {row['case']:<22} {row['block_size']} blocks: needed {row['needed'] / 2**20:7.1f} MiB, "
                f"fetched {row['bytes_fetched'] / 2**20:7.1f} MiB in {row['gets']:4d} GETs "
                f"= {row['fetched_per_needed']:.2f}x"
            )
        else:
            print(
                f"  sequential {row['size'] >> 20} MiB, 4M blocks: cold {row['cold_mb_s']:,.0f} MB/s, "
                f"warm {row['warm_mb_s']:,.0f} MB/s (median of {row['rounds']})"
            )


def plot(report: Result, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(report["runs"])
    cases = list(
        dict.fromkeys(
            (row["case"], row["block_size"])
            for label in labels
            for row in report["runs"][label]["results"]
            if "needed" in row
        )
    )
    fig, (ratio_ax, seq_ax) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [3, 1]})
    width = 0.8 / len(labels)
    for n, label in enumerate(labels):
        rows = {(r["case"], r["block_size"]): r for r in report["runs"][label]["results"]}
        ratios = [rows[c]["fetched_per_needed"] if c in rows else 0 for c in cases]
        xs = [i + n * width for i in range(len(cases))]
        bars = ratio_ax.bar(xs, ratios, width, label=label)
        ratio_ax.bar_label(bars, fmt="%.2f", fontsize=8)
        seq = rows.get(("sequential", "4M"))
        if seq is not None:
            bars = seq_ax.bar([n * 2, n * 2 + 0.8], [seq["cold_mb_s"], seq["warm_mb_s"]], 0.8, label=label)
            seq_ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ratio_ax.axhline(1.0, color="gray", linewidth=0.8)
    ratio_ax.set_xticks([i + width * (len(labels) - 1) / 2 for i in range(len(cases))])
    ratio_ax.set_xticklabels([f"{c}\n{b} blocks" for c, b in cases], fontsize=8)
    ratio_ax.set_ylabel("bytes fetched / bytes needed")
    ratio_ax.set_title("sparse reads through the pffs SDK (lower is better, 1.0 = exact)")
    ratio_ax.legend()
    seq_ax.set_xticks([n * 2 + 0.4 for n in range(len(labels))])
    seq_ax.set_xticklabels([f"{label}\ncold | warm" for label in labels], fontsize=8)
    seq_ax.set_ylabel("MB/s")
    seq_ax.set_title("sequential read, 4 MiB blocks")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--label", default="current", help="the name this run's results are kept under")
    parser.add_argument(
        "--row-groups", type=int, default=16, help="row groups of the parquet file (6 MiB each)"
    )
    parser.add_argument("--reads", type=int, default=300, help="random 64 KiB reads")
    parser.add_argument("--random-size", type=parse_size, default=96 << 20, help="the random-read object")
    parser.add_argument("--seq-size", type=parse_size, default=256 << 20, help="the sequential-read object")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of the sequential read")
    parser.add_argument(
        "--cases",
        type=lambda text: set(text.split(",")),
        default={"sparse", "sequential"},
        help="which to run: sparse, sequential or both (sparse,sequential)",
    )
    args = parser.parse_args()
    results = run(args)
    print_table(args.label, results)
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "sparse_reads.json"
    report = json.loads(out.read_text()) if out.exists() else {"runs": {}}
    # A run of some cases replaces only those of its label.
    measured = {(row["case"], row["block_size"]) for row in results}
    kept = report["runs"].get(args.label, {}).get("results", [])
    results = [row for row in kept if (row["case"], row["block_size"]) not in measured] + results
    report["runs"][args.label] = {
        "commit": commit(),
        "date": datetime.date.today().isoformat(),
        "config": {k: sorted(v) if isinstance(v, set) else v for k, v in vars(args).items() if k != "label"},
        "results": results,
    }
    out.write_text(json.dumps(report, indent=2) + "\n")
    plot(report, RESULTS / "sparse_reads.png")
    log(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
