"""`pffs stats` and `pffs cache clear|gc`: looking after the disk cache."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from pffs.cli.context import open_cache
from pffs.config import format_size


def add_parsers(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "stats",
        parents=[common],
        help="show cache statistics (of the cache directory, or of one mount)",
        description="Without MOUNTPOINT: the disk cache's size and the hit, miss and eviction counters "
        "added up over every process that read through this cache directory since it was made or "
        "cleared. With MOUNTPOINT: that mount's own counters, its backend requests with latency "
        "percentiles, and its pending uploads.",
    )
    p.add_argument("mountpoint", metavar="MOUNTPOINT", nargs="?", help="a pffs mount")
    p.add_argument("--json", action="store_true", help="print JSON for machines")
    p.set_defaults(run=stats)

    p = sub.add_parser("cache", parents=[common], help="clear or garbage-collect the disk cache")
    cache_sub = p.add_subparsers(dest="cache_command", metavar="ACTION", required=True)
    c = cache_sub.add_parser(
        "clear", parents=[common], help="remove every cached block and reset the counters"
    )
    c.set_defaults(run=clear)
    c = cache_sub.add_parser(
        "gc", parents=[common], help="evict down to --cache-size; with --verify, also drop corrupt blocks"
    )
    c.add_argument("--verify", action="store_true", help="read every block and check its checksum")
    c.add_argument("--json", action="store_true", help="print JSON for machines")
    c.set_defaults(run=gc)


def collect_stats(args: argparse.Namespace) -> dict[str, Any]:
    settings, cache = open_cache(args, must_exist=True)
    totals = cache.machine_totals()
    usage = cache.usage()
    lookups = totals["memory_hits"] + totals["disk_hits"] + totals["misses"]
    return {
        "cache_dir": str(settings.cache_dir),
        "disk_bytes": usage["disk_bytes"],
        "disk_blocks": usage["disk_blocks"],
        "disk_capacity_bytes": cache.disk.capacity_bytes if cache.disk is not None else settings.cache_size,
        "block_size": settings.block_size,
        "hit_ratio": round((totals["memory_hits"] + totals["disk_hits"]) / lookups, 4) if lookups else None,
        **totals,
    }


def stats(args: argparse.Namespace) -> int:
    if args.mountpoint:
        return mount_stats(args.mountpoint, args.json)
    report = collect_stats(args)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    used = report["disk_bytes"] / report["disk_capacity_bytes"] if report["disk_capacity_bytes"] else 0
    ratio = report["hit_ratio"]
    rows = [
        ("cache directory", report["cache_dir"]),
        (
            "disk used",
            f"{format_size(report['disk_bytes'])} of {format_size(report['disk_capacity_bytes'])} "
            f"({used:.0%}), {report['disk_blocks']:,} blocks",
        ),
        ("hit ratio", "-" if ratio is None else f"{ratio:.1%}"),
        ("memory hits", f"{report['memory_hits']:,}  ({format_size(report['bytes_from_memory'])})"),
        ("disk hits", f"{report['disk_hits']:,}  ({format_size(report['bytes_from_disk'])})"),
        ("misses (backend fetches)", f"{report['misses']:,}  ({format_size(report['bytes_fetched'])})"),
        ("evictions memory / disk", f"{report['memory_evictions']:,} / {report['disk_evictions']:,}"),
        ("corrupt blocks dropped", f"{report['corrupt_blocks']:,}"),
        ("disk write failures", f"{report['disk_write_failures']:,}"),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    return 0


def mount_stats(mountpoint: str, as_json: bool) -> int:
    try:
        report = json.loads(os.getxattr(mountpoint, "user.pffs.stats"))
    except OSError as exc:
        raise OSError(exc.errno, f"{mountpoint} is not a running pffs mount ({exc.strerror})") from None
    if as_json:
        print(json.dumps(report, indent=2))
        return 0
    cache, usage = report["cache"], report["cache_usage"]
    lookups = cache["memory_hits"] + cache["disk_hits"] + cache["misses"]
    hits = cache["memory_hits"] + cache["disk_hits"]
    rows = [
        ("mount", f"{report['source']} at {report['mountpoint']} (pid {report['pid']})"),
        ("hit ratio", f"{hits / lookups:.1%}" if lookups else "-"),
        ("memory hits", f"{cache['memory_hits']:,}  ({format_size(cache['bytes_from_memory'])})"),
        ("disk hits", f"{cache['disk_hits']:,}  ({format_size(cache['bytes_from_disk'])})"),
        ("misses (backend fetches)", f"{cache['misses']:,}  ({format_size(cache['bytes_fetched'])})"),
        (
            "memory tier",
            f"{format_size(usage['memory_bytes'])} of {format_size(usage['memory_capacity_bytes'])}",
        ),
        ("disk tier", f"{format_size(usage['disk_bytes'])} of {format_size(usage['disk_capacity_bytes'])}"),
        (
            "uploads pending / done / failed",
            f"{report['uploads_pending']} / {report['uploads_done']} / {report['upload_failures']}",
        ),
        ("files fetched ahead (directory prefetch)", f"{report.get('files_prefetched', 0):,}"),
        ("open files", f"{report['open_files']}"),
    ]
    if "peers" in report:
        peers = report["peers"]
        rows += [
            ("cache group: members", f"{report.get('peer_members', 0)}"),
            (
                "cache group: fetched from / served to members",
                f"{peers['fetched_blocks']:,} blocks ({format_size(peers['fetched_bytes'])}) / "
                f"{peers['served_blocks']:,} blocks ({format_size(peers['served_bytes'])})",
            ),
            (
                "cache group: failures (then from the backend) / refused",
                f"{peers['failures']} / {peers['refused']}",
            ),
        ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    print()
    print(f"{'backend requests':<16} {'count':>9} {'errors':>7} {'p50 ms':>9} {'p90 ms':>9} {'p99 ms':>9}")
    for kind, row in report["backend_requests"].items():
        print(
            f"{kind:<16} {row['requests']:>9,} {row['errors']:>7,} "
            f"{row['p50_ms']:>9.2f} {row['p90_ms']:>9.2f} {row['p99_ms']:>9.2f}"
        )
    return 0


def clear(args: argparse.Namespace) -> int:
    settings, cache = open_cache(args, must_exist=True)
    removed = cache.clear()
    print(f"removed {removed:,} blocks from {settings.cache_dir}")
    return 0


def gc(args: argparse.Namespace) -> int:
    settings, cache = open_cache(args, must_exist=True)
    if cache.disk is None:
        print(f"no usable disk cache at {settings.cache_dir}")
        return 1
    result = cache.disk.gc(verify=args.verify)
    if args.json:
        print(json.dumps({**result, "disk_bytes": cache.disk.used_bytes()}))
    else:
        print(
            f"evicted {result['evicted']:,} blocks, dropped {result['corrupt']:,} corrupt; "
            f"{format_size(cache.disk.used_bytes())} of {format_size(cache.disk.capacity_bytes)} in use"
        )
    return 0
