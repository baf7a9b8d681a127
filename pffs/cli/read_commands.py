"""`pffs cat` and `pffs warmup`: reading through the cache."""

from __future__ import annotations

import argparse
import errno
import json
import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pffs.cli.errors import UsageError

if TYPE_CHECKING:
    from pffs.backends.backend import ObjectInfo


def add_parsers(sub: Any, common: argparse.ArgumentParser) -> None:
    from pffs.cli.peer_options import add_peer_options

    p = sub.add_parser(
        "cat",
        parents=[common],
        help="write an object to stdout, read through the cache",
        description="Writes the object at URL to standard output, reading it through the pffs cache.",
    )
    p.add_argument("url", metavar="URL")
    p.set_defaults(run=cat)

    p = sub.add_parser(
        "warmup",
        parents=[common],
        help="fill the disk cache with an object or everything under a prefix",
        description="Fetches every block of the object at URL, or of every object under it, into the disk "
        "cache, in parallel, so a job that starts later reads at local-disk speed. Blocks already cached "
        "are skipped. Shows a progress bar (files, bytes, rate) on a terminal.",
    )
    p.add_argument("url", metavar="URL-OR-PREFIX")
    p.add_argument("--workers", type=int, default=8, help="parallel block fetches (default 8)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    add_peer_options(p, serving=False)  # warm a node from its neighbours' caches, not the backend
    p.set_defaults(run=warmup)


def cat(args: argparse.Namespace) -> int:
    from pffs.cli.context import open_vfs

    vfs, path = open_vfs(args.url, args)
    handle = vfs.open(path)
    out = sys.stdout.buffer
    offset = 0
    try:
        while offset < handle.info.size:
            chunk = handle.read(offset, vfs.settings.block_size)
            out.write(chunk)
            offset += len(chunk)
        out.flush()
    finally:
        handle.close()
    return 0


@dataclass
class WarmupProgress:
    files_total: int
    bytes_total: int
    files_done: int = 0
    bytes_done: int = 0
    bytes_fetched: int = 0
    errors: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


def warmup(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from pffs.cli.context import open_vfs
    from pffs.cli.peer_options import peer_options
    from pffs.config import format_size

    if args.workers < 1:
        raise UsageError(f"--workers must be at least 1, not {args.workers}")
    # Warm-up fills the disk; keeping every block in this short-lived process's memory would only churn.
    vfs, path = open_vfs(args.url, args, memory_cache_size=0)
    group_options = peer_options(args)
    group = None
    if group_options is not None:
        from pffs.sdk.options import peer_settings_from

        group = vfs.join_group(peer_settings_from(group_options), path)
    if vfs.cache.disk is None:  # said as a warning by the cache; here it means nothing could be done
        raise OSError(
            errno.EACCES,
            f"{vfs.cache.directory}: not usable as a disk cache, so nothing would be warmed; "
            "give --cache-dir a writable folder",
        )
    started = time.monotonic()
    files = list(vfs.walk_files(path))
    progress = WarmupProgress(len(files), sum(f.size for f in files))
    tasks: queue.SimpleQueue[tuple[ObjectInfo, int, list[int]] | None] = queue.SimpleQueue()
    for info in files:
        blocks_left = [max(1, vfs.reader.block_count(info))]  # shared countdown: the file is done at 0
        for index in range(max(1, vfs.reader.block_count(info))):
            tasks.put((info, index, blocks_left))
    bar = tqdm(
        total=progress.bytes_total, unit="B", unit_scale=True, unit_divisor=1024, desc="warmup", disable=None
    )
    bar.set_postfix_str(f"files 0/{progress.files_total}")

    def worker() -> None:
        while (task := tasks.get()) is not None:
            info, index, blocks_left = task
            try:
                fetched = vfs.reader.warm_block(info, index)
            except OSError as exc:
                with progress.lock:
                    progress.errors.append(str(exc))
                fetched = 0
            size = max(0, min(vfs.reader.block_size, info.size - index * vfs.reader.block_size))
            with progress.lock:
                progress.bytes_done += size
                progress.bytes_fetched += fetched
                blocks_left[0] -= 1
                if blocks_left[0] == 0:
                    progress.files_done += 1
                bar.update(size)
                bar.set_postfix_str(f"files {progress.files_done}/{progress.files_total}", refresh=False)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(args.workers)]
    for _ in threads:
        tasks.put(None)
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    bar.close()
    elapsed = time.monotonic() - started
    summary = {
        "url": args.url,
        "files": progress.files_total,
        "bytes": progress.bytes_total,
        "bytes_fetched": progress.bytes_fetched,
        "bytes_already_cached": progress.bytes_done - progress.bytes_fetched,
        "seconds": round(elapsed, 3),
        "bytes_per_second": round(progress.bytes_done / elapsed) if elapsed > 0 else 0,
        "errors": len(progress.errors),
    }
    if group is not None:
        summary["bytes_from_group"] = group.counts.snapshot()["fetched_bytes"]
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        from_group = f", {format_size(summary['bytes_from_group'])} of it from the group" if group else ""
        print(
            f"warmed {summary['files']} files, {format_size(summary['bytes'])} "
            f"(fetched {format_size(summary['bytes_fetched'])}{from_group}, "
            f"already cached {format_size(summary['bytes_already_cached'])}) "
            f"in {elapsed:.1f}s, {format_size(summary['bytes_per_second'])}/s"
        )
    for message in progress.errors[:5]:
        print(f"pffs: error: {message}", file=sys.stderr)
    if len(progress.errors) > 5:
        print(f"pffs: error: ... and {len(progress.errors) - 5} more", file=sys.stderr)
    return 1 if progress.errors else 0
