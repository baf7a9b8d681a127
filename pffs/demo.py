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


class Run:
    """One pass over the dataset: its time, what it read, and what it cost the backend."""

    def __init__(self, fs: Any) -> None:
        requests_before = backend_requests(fs)
        fetched_before = fs.vfs.cache.machine_totals()["bytes_fetched"]
        started = time.perf_counter()
        # One LIST fills sizes and ETags: no HEAD per file.
        self.digests = {name: hashlib.sha256(fs.cat_file(name)).hexdigest() for name in fs.find("train")}
        self.seconds = time.perf_counter() - started
        self.requests = backend_requests(fs) - requests_before
        self.bytes_fetched = fs.vfs.cache.machine_totals()["bytes_fetched"] - fetched_before


def backend_requests(fs: Any) -> int:
    """Requests this filesystem's backend has sent so far (GETs, HEADs, LISTs)."""
    return int(sum(row["requests"] for row in fs.vfs.backend.requests.snapshot().values()))


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
        runs["cold (from S3)"] = Run(fs)
        # A reader with no memory tier, as a new process would be: blocks come from the disk tier.
        disk_reader = pffs_fs(memory_cache_size=0)
        runs["warm (disk tier)"] = Run(disk_reader)
        runs["warm (memory tier)"] = Run(fs)
        for label, run in runs.items():
            if run.digests != expected:
                print(f"MISMATCH in the {label} read", file=sys.stderr)
                return 1

        cold = runs["cold (from S3)"]
        print("\n" + "read".ljust(20) + "  seconds      MB/s  speed-up  S3 requests   S3 bytes")
        for label, run in runs.items():
            speed = f"{total / run.seconds / 1e6:9.0f} {cold.seconds / run.seconds:8.1f}x"
            cost = f"{run.requests:12,} {format_size(run.bytes_fetched):>10}"
            print(f"{label:<20} {run.seconds:8.2f} {speed} {cost}")
        print("every byte checked against the source (sha256): OK")
        warm = [run for run in runs.values() if run is not cold]
        saved_requests = sum(cold.requests - run.requests for run in warm)
        saved = format_size(sum(cold.bytes_fetched - run.bytes_fetched for run in warm))
        print(f"the two warm passes saved {saved_requests:,} S3 requests and {saved} of transfer.")
        print(
            "The 'remote' S3 server of this demo runs on this machine and reads the same disk as the\n"
            "cache, so the speed-ups above understate a real remote store; the requests and bytes\n"
            "saved are what carry over.\n"
        )

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
