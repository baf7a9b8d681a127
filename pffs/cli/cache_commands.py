"""`pffs stats` and `pffs cache clear|gc`: looking after the disk cache."""

from __future__ import annotations

import argparse
import json
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    pass


def add_parsers(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "stats",
        parents=[common],
        help="show cache statistics (of the cache directory, or of one mount)",
        description="Without MOUNTPOINT: the disk cache's size, its block reads (hits: cached before the "
        "run asked; prefetch hits: fetched ahead, then served from the cache; misses: fetched while the "
        "reader waited) and evictions, added up over every process that read through this cache directory "
        "since it was made or cleared. With MOUNTPOINT: that mount's own counters, its backend requests "
        "with latency percentiles and their retries (throttled, timed out, reset, 5xx), and its pending "
        "uploads.",
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


BACKEND_KINDS = ("get", "head", "list", "put", "delete", "copy")


def collect_stats(args: argparse.Namespace) -> dict[str, Any]:
    """The cache directory's statistics (every process that read through it), in a mount's shape."""
    from pffs.cli.context import open_cache

    settings, cache = open_cache(args, must_exist=True)
    totals = cache.machine_totals()
    usage = cache.usage()
    backend = {
        kind: {what: totals[f"backend_{kind}_{what}"] for what in ("requests", "errors", "not_found")}
        for kind in BACKEND_KINDS
    }
    return {
        "scope": "cache_dir",
        "cache_dir": str(settings.cache_dir),
        "block_size": settings.block_size,
        "cache": _with_hit_ratio({k: v for k, v in totals.items() if not k.startswith("backend_")}),
        "cache_usage": {
            "disk_bytes": usage["disk_bytes"],
            "disk_blocks": usage["disk_blocks"],
            "disk_capacity_bytes": (
                cache.disk.capacity_bytes if cache.disk is not None else settings.cache_size
            ),
            "disk_bound_bytes": cache.disk.bound_bytes() if cache.disk is not None else settings.cache_size,
        },
        "backend_requests": backend,
    }


def _with_hit_ratio(counters: dict[str, Any]) -> dict[str, Any]:
    """The counters, the block reads they add up to, and two shares of those reads (None before any): the
    hit ratio, reads served by what was cached before anything of this run asked for it, and the prefetch
    hit ratio, reads served by a block fetched ahead for them. A block fetched ahead of its reader is a
    prefetch (a backend fetch), and the read that finds it a prefetch hit, not a hit: a cold epoch shows a
    hit ratio of 0 however well the prefetch served it, and its prefetch hit ratio says how well."""
    hits = counters["memory_hits"] + counters["disk_hits"]
    prefetch_hits = counters.get("prefetch_hits", 0)
    reads = hits + counters["misses"] + prefetch_hits
    return {
        **counters,
        "block_reads": reads,
        "hit_ratio": round(hits / reads, 4) if reads else None,
        "prefetch_hit_ratio": round(prefetch_hits / reads, 4) if reads else None,
    }


def _reads_rows(cache: dict[str, Any]) -> list[tuple[str, str]]:
    """What the block reads were, in words: a cold epoch served by the prefetch reads as that."""
    from pffs.config import format_size

    ratio, ahead = cache["hit_ratio"], cache.get("prefetch_hit_ratio")
    hits = cache["memory_hits"] + cache["disk_hits"]
    prefetch_hits = cache.get("prefetch_hits", 0)
    return [
        (
            "block reads",
            f"{cache.get('block_reads', 0):,}: {hits:,} hits, {prefetch_hits:,} prefetch hits, "
            f"{cache['misses']:,} misses",
        ),
        (
            "hit ratio",
            "-" if ratio is None else f"{ratio:.1%} (hits: blocks cached before this run asked for them)",
        ),
        (
            "prefetch hit ratio",
            "-"
            if ahead is None
            else f"{ahead:.1%} (prefetch hits: blocks fetched ahead of their reader, then served from the "
            "cache)",
        ),
        ("hits memory / disk", f"{cache['memory_hits']:,} / {cache['disk_hits']:,}"),
        ("prefetches (blocks fetched ahead)", f"{cache.get('prefetches', 0):,}"),
        ("misses (fetched for a waiting reader)", f"{cache['misses']:,}"),
        (
            "bytes served from memory / disk",
            f"{format_size(cache['bytes_from_memory'])} / {format_size(cache['bytes_from_disk'])} "
            "(hits and prefetch hits)",
        ),
    ]


def stats(args: argparse.Namespace) -> int:
    from pffs.config import format_size

    report = read_mount_stats(args.mountpoint) if args.mountpoint else collect_stats(args)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    cache, usage = report["cache"], report["cache_usage"]
    if report["scope"] == "mount":
        rows = [("mount", f"{report['source']} at {report['mountpoint']} (pid {report['pid']})")]
    else:
        rows = [("cache directory", report["cache_dir"])]
    # The bound in force: --cache-size, or less where the cache's file system keeps its free share.
    bound = min(usage["disk_capacity_bytes"], usage.get("disk_bound_bytes", usage["disk_capacity_bytes"]))
    used = usage["disk_bytes"] / bound if bound else 0
    held_back = (
        f" (--cache-size {format_size(usage['disk_capacity_bytes'])}; the file system keeps its free share)"
        if bound < usage["disk_capacity_bytes"]
        else ""
    )
    rows += _reads_rows(cache)
    rows += [
        ("bytes fetched from the backend", format_size(cache["bytes_fetched"])),
        ("evictions memory / disk", f"{cache['memory_evictions']:,} / {cache['disk_evictions']:,}"),
        (
            "stale metadata served",
            f"{cache.get('stale_metadata_served', 0):,} (stats and listings answered as last seen while "
            "the backend could not be reached: --stale-if-error)",
        ),
        (
            "disk used",
            f"{format_size(usage['disk_bytes'])} of {format_size(bound)} ({used:.0%})"
            + (f", {usage['disk_blocks']:,} blocks" if "disk_blocks" in usage else "")
            + held_back,
        ),
    ]
    if report["scope"] == "mount":
        rows += _mount_rows(report)
    else:
        rows += [
            ("corrupt blocks dropped", f"{cache['corrupt_blocks']:,}"),
            ("disk write failures", f"{cache['disk_write_failures']:,}"),
        ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    print()
    timed = report["scope"] == "mount"
    header = f"{'backend requests':<16} {'count':>9} {'errors':>7} {'not found':>10}"
    print(header + (f" {'p50 ms':>9} {'p90 ms':>9} {'p99 ms':>9}" if timed else ""))
    for kind, row in report["backend_requests"].items():
        line = f"{kind:<16} {row['requests']:>9,} {row['errors']:>7,} {row.get('not_found', 0):>10,}"
        if timed:  # (the native engine does not measure latencies yet: "-")
            line += "".join(
                f" {row[field]:>9.2f}" if field in row else f" {'-':>9}"
                for field in ("p50_ms", "p90_ms", "p99_ms")
            )
        print(line)
    if timed:
        print()
        print(
            f"{'backend retries':<16} {'retries':>9} {'throttled':>10} {'timeouts':>9} {'resets':>7} "
            f"{'5xx':>7}"
        )
        for kind, row in report["backend_requests"].items():
            print(
                f"{kind:<16} {row.get('retries', 0):>9,} {row.get('throttled', 0):>10,} "
                f"{row.get('timeouts', 0):>9,} {row.get('resets', 0):>7,} {row.get('server_errors', 0):>7,}"
            )
    return 0


def read_mount_stats(mountpoint: str) -> dict[str, Any]:
    """A running mount's statistics (its own process's), in the cache directory's shape plus its own."""
    try:
        report = json.loads(os.getxattr(mountpoint, "user.pffs.stats"))
    except OSError as exc:
        raise OSError(exc.errno, f"{mountpoint} is not a running pffs mount ({exc.strerror})") from None
    counters = {k: v for k, v in report["cache"].items() if not k.startswith("backend_")}
    return {"scope": "mount", **report, "cache": _with_hit_ratio(counters)}


def _mount_rows(report: dict[str, Any]) -> list[tuple[str, str]]:
    from pffs.config import format_size

    usage = report["cache_usage"]
    rows = [
        (
            "memory tier",
            f"{format_size(usage['memory_bytes'])} of {format_size(usage['memory_capacity_bytes'])}",
        ),
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
    return rows


def clear(args: argparse.Namespace) -> int:
    from pffs.cli.context import open_cache

    settings, cache = open_cache(args, must_exist=True)
    removed = cache.clear()
    print(f"removed {removed:,} blocks from {settings.cache_dir}")
    return 0


def gc(args: argparse.Namespace) -> int:
    from pffs.cli.context import open_cache
    from pffs.config import format_size

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
