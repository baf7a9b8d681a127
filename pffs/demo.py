"""`make demo`: a local S3 server, a small sample dataset, read through pffs cold and then warm.

Starts SeaweedFS on loopback, writes a sample dataset (many small files and one larger shard), reads it all
through the pffs SDK three times — cold (from S3), warm from the disk tier (a fresh reader with no memory
tier) and warm from memory — checks every byte against the source, prints the cache statistics and the
speed-ups, and stops the server and removes its files.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import fsspec

from pffs.config import format_size, parse_size
from pffs.testing.s3_server import SeaweedS3

BUCKET = "pffs-demo"


def read_all(fs: Any) -> tuple[float, dict[str, str]]:
    """Lists the dataset (one LIST fills sizes and ETags: no HEAD per file) and reads every object."""
    started = time.perf_counter()
    digests = {name: hashlib.sha256(fs.cat_file(name)).hexdigest() for name in fs.find("train")}
    return time.perf_counter() - started, digests


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pffs.demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--small-files", type=int, default=500, help="number of 128 KiB files (default 500)")
    parser.add_argument("--shard-size", default="256M", help="size of the large object (default 256M)")
    args = parser.parse_args(argv)
    shard_size = parse_size(args.shard_size)

    with tempfile.TemporaryDirectory(prefix="pffs-demo-") as tmp, SeaweedS3(Path(tmp) / "s3") as server:
        print(f"S3 server (SeaweedFS) on {server.endpoint_url}")
        import s3fs

        raw = s3fs.S3FileSystem(**server.storage_options())
        raw.mkdir(BUCKET)
        dataset = {f"train/img-{i:05d}.jpg": os.urandom(128 << 10) for i in range(args.small_files)}
        dataset["train/shard-0000.tar"] = os.urandom(shard_size)
        raw.pipe({f"{BUCKET}/{name}": data for name, data in dataset.items()})
        expected = {name: hashlib.sha256(data).hexdigest() for name, data in dataset.items()}
        total = sum(len(d) for d in dataset.values())
        print(f"sample dataset: {len(dataset)} objects, {format_size(total)} in s3://{BUCKET}/train")

        def pffs_fs(**cache: Any) -> Any:
            return fsspec.filesystem(
                "pffs",
                target=f"s3://{BUCKET}",
                cache_dir=str(Path(tmp) / "cache"),
                skip_instance_cache=True,
                endpoint_url=server.endpoint_url,
                key=server.access_key,
                secret=server.secret_key,
                **cache,
            )

        fs = pffs_fs()
        runs = {}
        runs["cold (from S3)"] = read_all(fs)
        # A reader with no memory tier, as a new process would be: blocks come from the disk tier.
        disk_reader = pffs_fs(memory_cache_size=0)
        runs["warm (disk tier)"] = read_all(disk_reader)
        runs["warm (memory tier)"] = read_all(fs)
        for label, (_, digests) in runs.items():
            if digests != expected:
                print(f"MISMATCH in the {label} read", file=sys.stderr)
                return 1

        cold = runs["cold (from S3)"][0]
        print(f"\n{'read':<20} {'seconds':>8} {'MB/s':>9} {'speed-up':>9}")
        for label, (seconds, _) in runs.items():
            print(f"{label:<20} {seconds:8.2f} {total / seconds / 1e6:9.0f} {cold / seconds:8.1f}x")
        print("every byte checked against the source (sha256): OK\n")

        stats = fs.vfs.cache.machine_totals()
        usage = fs.vfs.cache.usage()
        print("cache statistics (pffs stats):")
        for key in ("memory_hits", "disk_hits", "misses", "bytes_fetched", "corrupt_blocks"):
            print(f"  {key:<16} {stats[key]:,}")
        print(f"  {'disk used':<16} {format_size(usage['disk_bytes'])} in {usage['disk_blocks']:,} blocks")
    print("\nserver stopped, temporary files removed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
