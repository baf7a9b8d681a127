"""The `pffs` command."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from pffs import __version__
from pffs.cli import (
    cache_commands,
    csi_commands,
    list_commands,
    mount_commands,
    read_commands,
    sched_commands,
    scheduler_commands,
    uninstall_commands,
)
from pffs.cli.errors import EXIT_USAGE, run_reporting_errors
from pffs.cli.logs import configure_logging
from pffs.cli.usage import CommandLineParser

DESCRIPTION = """\
pffs: a data-caching filesystem for AI training. Reads S3, HDFS or any fsspec backend through a
two-level (memory, disk) block cache shared by every process on this machine.

URLs: s3://bucket/prefix, a local path or file:///path, memory://..., hdfs://host:port/path,
webhdfs://host:port/path. S3 credentials come from the standard AWS environment variables
(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN), AWS_PROFILE / --profile, or a
credentials file (AWS_SHARED_CREDENTIALS_FILE / --credentials-file); never from the command line.
Sizes accept plain bytes or K, M, G, T suffixes (binary: 1K = 1024), e.g. 10G, 512M.
"""

EPILOG = """\
examples:
  pffs mount s3://datasets/imagenet /mnt/imagenet --endpoint-url http://127.0.0.1:8333
  pffs stats /mnt/imagenet && pffs umount /mnt/imagenet
  pffs --endpoint-url http://127.0.0.1:8333 warmup s3://datasets/imagenet/train --workers 16
  pffs cat s3://datasets/labels.csv | head
  pffs ls s3://datasets/imagenet/ && pffs du -d 1 s3://datasets/imagenet
  pffs stats --json
  pffs cache gc --verify
  pffs extender --port 8888
  pffs csi --endpoint unix:///csi/csi.sock --node-id $NODE_ID --mode node
  pffs sched simulate --nodes NODES.csv --pods PODS.csv --policy pffs --seed 42

exit codes: 0 success, 1 the command failed (missing object, access denied, backend down),
2 the command line is wrong (bad option, unknown URL scheme)."""


def global_options() -> argparse.ArgumentParser:
    """Options every subcommand takes, before or after its name (defaults are applied later)."""
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("cache and backend options")
    s = argparse.SUPPRESS
    g.add_argument(
        "--cache-dir",
        default=s,
        help="disk cache directory, shared by all processes (default: $PFFS_CACHE_DIR or ~/.cache/pffs)",
    )
    g.add_argument("--cache-size", default=s, help="disk cache bound (default 10G)")
    g.add_argument(
        "--cache-free-space",
        default=s,
        help="share of the cache's file system kept free: the cache evicts to keep it, whatever "
        "--cache-size says (default 5%%; 0 turns it off)",
    )
    g.add_argument("--memory-cache-size", default=s, help="memory cache bound per process (default 512M)")
    g.add_argument("--block-size", default=s, help="cache block size (default 4M)")
    g.add_argument(
        "--metadata-ttl", default=s, type=float, help="seconds a stat or listing is trusted (default 60)"
    )
    g.add_argument(
        "--stale-if-error",
        default=s,
        type=float,
        metavar="SECONDS",
        help="while the backend cannot be reached, serve stats and listings past their TTL as last seen for "
        "this long, so cached data keeps reading (default 86400: a day; 0: fail instead)",
    )
    g.add_argument("--endpoint-url", default=s, help="S3 endpoint, e.g. http://127.0.0.1:8333 (default: AWS)")
    g.add_argument("--region", default=s, help="S3 region")
    g.add_argument("--profile", default=s, help="AWS profile for credentials")
    g.add_argument("--credentials-file", default=s, help="AWS shared credentials file")
    g.add_argument("--anonymous", action="store_true", default=s, help="no credentials (public buckets)")
    g.add_argument(
        "--backend-timeout",
        default=s,
        type=float,
        help="seconds a backend request may take, retries included, before the read fails with ETIMEDOUT "
        "(default 30); cached data is served meanwhile",
    )
    g.add_argument("-v", "--verbose", action="count", default=s, help="more logging (-vv for debug)")
    return p


def verbosity_option() -> argparse.ArgumentParser:
    """-v alone, for commands that take none of the cache and backend options (scheduler tools)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument(
        "-v", "--verbose", action="count", default=argparse.SUPPRESS, help="more logging (-vv for debug)"
    )
    return p


def build_parser() -> argparse.ArgumentParser:
    common = global_options()
    parser = CommandLineParser(
        prog="pffs",
        description=DESCRIPTION,
        epilog=EPILOG,
        parents=[common],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"pffs {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    read_commands.add_parsers(sub, common)
    list_commands.add_parsers(sub, common)
    mount_commands.add_parsers(sub, common)
    cache_commands.add_parsers(sub, common)
    verbosity = verbosity_option()
    scheduler_commands.add_parsers(sub, verbosity)
    sched_commands.add_parsers(sub, verbosity)
    csi_commands.add_parsers(sub, verbosity)
    uninstall_commands.add_parsers(sub, verbosity)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    configure_logging(getattr(args, "verbose", 0) or 0, log_format=getattr(args, "log_format", "text"))
    return run_reporting_errors(lambda: args.run(args))


if __name__ == "__main__":
    sys.exit(main())
