"""`pffs ls` and `pffs du`: what is under a URL, and how much of it this machine's disk cache holds.

Cached bytes are those of each object's current version (the one the listing names) that the disk cache at
--cache-dir holds, as the reader counts them (`ObjectReader.cached_bytes`); blocks of older versions do not
count. The cache is only looked at: where --cache-dir holds no pffs cache none is made, and everything shows
as 0 cached (with a note on stderr saying so).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pffs.backends.backend import ObjectInfo
    from pffs.vfs import Vfs


LS_EPILOG = """\
columns: SIZE, CACHED (bytes of the object's current version in the disk cache at --cache-dir), the
cached share, MODIFIED (local time) and NAME (relative to URL; prefixes end in /). With no pffs cache at
--cache-dir, nothing is cached: CACHED shows 0 and a note says so on stderr. Blocks of any block size
count (a mount or warm-up may have used another --block-size), each byte once.

examples:
  pffs ls s3://datasets/imagenet/                 one level: objects and prefixes
  pffs ls -r s3://datasets/imagenet/val           every object under a prefix
  pffs ls --json s3://datasets/imagenet/ | jq '.entries[] | select(.cached_bytes < .size) | .url'"""

DU_EPILOG = """\
columns: SIZE (all objects under the prefix), CACHED (bytes of their current versions in the disk cache
at --cache-dir), the cached share, OBJECTS and URL. Rows go by prefix; URL itself comes last, its total.
With no pffs cache at --cache-dir, CACHED shows 0 and a note says so on stderr.

examples:
  pffs du s3://datasets/imagenet                  the total, and how much of it is cached
  pffs du -d 1 s3://datasets/imagenet             also each prefix one level down (like du -d 1)
  pffs du -d 2 --json s3://datasets/imagenet      exact bytes for machines"""


def add_parsers(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "ls",
        parents=[common],
        help="list objects with their sizes and how much of each the cache holds",
        description="Lists the objects and prefixes under URL (one level; -r for everything under it), or\n"
        "the object URL names, with sizes, modified times and the bytes of each the disk cache holds.",
        epilog=LS_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("url", metavar="URL")
    p.add_argument("-r", "--recursive", action="store_true", help="every object under URL, not one level")
    add_output_options(p)
    p.set_defaults(run=ls)

    p = sub.add_parser(
        "du",
        parents=[common],
        help="total size under a URL (per prefix with -d) and how much of it the cache holds",
        description="Adds up the sizes of the objects under URL, and the bytes of them the disk cache\n"
        "holds; with -d N, also for each prefix down to N levels below URL.",
        epilog=DU_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("url", metavar="URL")
    p.add_argument(
        "-d",
        "--max-depth",
        type=depth,
        default=0,
        metavar="N",
        help="also show each prefix down to N levels below URL (default 0: the total only)",
    )
    add_output_options(p)
    p.set_defaults(run=du)


def depth(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {value}")
    return value


def add_output_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON for machines (sizes in exact bytes)")
    p.add_argument("--bytes", action="store_true", help="sizes in the table as exact byte counts")


# Looking: a VFS over the backend, with the disk cache at --cache-dir if there is one.


@dataclass
class Listing:
    vfs: Vfs
    root: str  # the backend path URL names, without a trailing /
    cache_dir: Path
    has_cache: bool

    def cached_bytes(self, info: ObjectInfo) -> int:
        return self.vfs.reader.cached_bytes(info) if self.has_cache else 0

    def relative(self, path: str) -> str:
        """The path below the root ("" for the root itself)."""
        if path == self.root:
            return ""
        prefix = self.root if self.root.endswith("/") else self.root + "/"
        return path[len(prefix) :] if path.startswith(prefix) else path

    def note_missing_cache(self) -> None:
        if not self.has_cache:
            print(
                f"pffs: note: no pffs cache at {self.cache_dir}, so nothing shows as cached "
                "(give the --cache-dir your mounts and programs use)",
                file=sys.stderr,
            )


@contextmanager
def open_listing(url: str, args: argparse.Namespace) -> Iterator[Listing]:
    from pffs.backends.urls import open_backend
    from pffs.cache import BlockCache
    from pffs.cli.context import backend_options, cache_settings, has_cache
    from pffs.vfs import Vfs

    backend, path = open_backend(url, backend_options(args))
    root = path.rstrip("/") or path
    settings = cache_settings(args)
    cache_here = has_cache(settings)
    # Opened as it is, bound included (not through shared_block_cache, which would store a --cache-size
    # given here as the cache's new bound); no memory tier, nothing is read. No directory: no cache made.
    cache = BlockCache(
        settings.cache_dir if cache_here else None,
        settings.cache_size,
        0,
        keep_stored_bound=True,
        free_space_ratio=settings.cache_free_space,
    )
    try:
        yield Listing(Vfs(backend, settings, cache), root, Path(settings.cache_dir), cache_here)
    finally:
        cache.close()


# pffs ls


def ls(args: argparse.Namespace) -> int:
    with open_listing(args.url, args) as listing:
        vfs = listing.vfs
        target = vfs.stat(listing.root)
        if not target.is_dir:
            entries = [target]
        elif args.recursive:
            entries = list(vfs.find(listing.root))
        else:
            entries = [e for e in vfs.list_dir(listing.root) if e.path.rstrip("/") != listing.root]
        rows = [entry_row(listing, e, single=not target.is_dir) for e in entries]
    rows.sort(key=lambda r: r["name"])
    files = [r for r in rows if r["type"] == "file"]
    total = {
        "objects": len(files),
        "prefixes": len(rows) - len(files),
        "size": sum(r["size"] for r in files),
        "cached_bytes": sum(r["cached_bytes"] for r in files),
    }
    listing.note_missing_cache()
    if args.json:
        report = {"url": args.url, "cache_dir": str(listing.cache_dir), "entries": rows, "total": total}
        print(json.dumps(report, indent=2))
        return 0
    size = size_formatter(args.bytes)
    table = [
        [
            size(r["size"]) if r["type"] == "file" else "-",
            size(r["cached_bytes"]) if r["type"] == "file" else "-",
            share(r["cached_bytes"], r["size"]) if r["type"] == "file" else "-",
            local_time(r["mtime"]),
            r["name"],
        ]
        for r in rows
    ]
    print_table(["SIZE", "CACHED", "%", "MODIFIED", "NAME"], table, right_aligned=3)
    counts = counted(total["objects"], "object")
    if total["prefixes"]:
        counts += ", " + counted(total["prefixes"], "prefix", "prefixes")
    cached = f"{size(total['cached_bytes'])} cached"
    if total["size"]:
        cached += f" ({share(total['cached_bytes'], total['size'])})"
    print(f"{counts}: {size(total['size'])}, {cached}")
    return 0


def entry_row(listing: Listing, info: ObjectInfo, single: bool) -> dict[str, Any]:
    url = listing.vfs.backend.url(info.path)
    if info.is_dir:
        name = listing.relative(info.path.rstrip("/")) + "/"
        return {
            "name": name,
            "url": url.rstrip("/") + "/",
            "type": "directory",
            "size": None,
            "cached_bytes": None,
            "modified": None,
            "mtime": None,
        }
    name = info.path.rsplit("/", 1)[-1] if single else listing.relative(info.path)
    return {
        "name": name,
        "url": url,
        "type": "file",
        "size": info.size,
        "cached_bytes": listing.cached_bytes(info),
        "modified": iso_time(info.mtime),
        "mtime": info.mtime or None,
    }


# pffs du


@dataclass
class Usage:
    """What is under one prefix, and under each of its prefixes (as far down as asked)."""

    objects: int = 0
    size: int = 0
    cached_bytes: int = 0
    children: dict[str, Usage] = field(default_factory=dict)

    def add(self, size: int, cached_bytes: int) -> None:
        self.objects += 1
        self.size += size
        self.cached_bytes += cached_bytes


def du(args: argparse.Namespace) -> int:
    tree = Usage()
    with open_listing(args.url, args) as listing:
        for info in listing.vfs.walk_files(listing.root):
            cached = listing.cached_bytes(info)
            node = tree
            node.add(info.size, cached)
            prefixes = listing.relative(info.path).split("/")[:-1]
            for name in prefixes[: args.max_depth]:
                node = node.children.setdefault(name, Usage())
                node.add(info.size, cached)
        base = listing.vfs.backend.url(listing.root)
    listing.note_missing_cache()
    rows = [*prefix_rows(tree, base, 1), {"url": base, "depth": 0, **totals(tree)}]  # the whole last, as du
    if args.json:
        print(json.dumps({"url": args.url, "cache_dir": str(listing.cache_dir), "prefixes": rows}, indent=2))
        return 0
    size = size_formatter(args.bytes)
    table = [
        [
            size(r["size"]),
            size(r["cached_bytes"]),
            share(r["cached_bytes"], r["size"]),
            f"{r['objects']:,}",
            r["url"],
        ]
        for r in rows
    ]
    print_table(["SIZE", "CACHED", "%", "OBJECTS", "URL"], table, right_aligned=4)
    return 0


def totals(usage: Usage) -> dict[str, Any]:
    return {"objects": usage.objects, "size": usage.size, "cached_bytes": usage.cached_bytes}


def prefix_rows(node: Usage, url: str, depth: int) -> list[dict[str, Any]]:
    """A row per prefix below node, each followed by its own prefixes, by name."""
    rows: list[dict[str, Any]] = []
    for name, child in sorted(node.children.items()):
        child_url = url + ("" if url.endswith("/") else "/") + name + "/"
        rows.append({"url": child_url, "depth": depth, **totals(child)})
        rows.extend(prefix_rows(child, child_url, depth + 1))
    return rows


# Formatting


def size_formatter(exact: bool) -> Callable[[int], str]:
    from pffs.config import format_size

    return (lambda n: f"{n:,}") if exact else format_size


def counted(n: int, one: str, many: str = "") -> str:
    return f"{n:,} {one if n == 1 else many or one + 's'}"


def share(part: int, whole: int) -> str:
    """The cached share, rounded down: only what is wholly cached shows as 100%."""
    if whole == 0:
        return "-"
    if part >= whole:
        return "100%"
    tenths = math.floor(part * 1000 / whole)
    return "<0.1%" if part and not tenths else f"{tenths / 10:.1f}%"


def iso_time(mtime: float) -> str | None:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(mtime)) if mtime else None


def local_time(mtime: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(mtime)) if mtime else "-"


def print_table(header: Sequence[str], rows: Iterable[Sequence[str]], right_aligned: int) -> None:
    """Columns padded to their widest cell; the first `right_aligned` (numbers) to the right."""
    lines = [list(header), *(list(r) for r in rows)]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    for line in lines:
        cells = [
            cell.rjust(width) if i < right_aligned else cell.ljust(width)
            for i, (cell, width) in enumerate(zip(line, widths, strict=True))
        ]
        print("  ".join(cells).rstrip())
