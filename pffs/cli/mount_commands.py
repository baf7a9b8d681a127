"""`pffs mount` and `pffs umount`.

`pffs mount` checks the options and the mountpoint, then starts the mount process (pffs.cli.mount_daemon)
in its own session and waits until it says the mount is ready (exit 0) or why it is not (exit 1 or 2).
With --foreground it serves in this process instead. The options travel as JSON on the child's stdin, so
nothing about the mount (and never a credential) appears in its argv.
"""

from __future__ import annotations

import argparse
import errno
import os
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pffs.cli.errors import EXIT_FAILURE, EXIT_OK, UsageError
from pffs.cli.holders import describe, holders
from pffs.fuse.ending import exit_code_table

if TYPE_CHECKING:
    from pffs.fuse.options import MountOptions


READY_TIMEOUT_S = 120.0
DETACH_WAIT_S = 30.0  # for a mount asked to detach itself (pffs umount --lazy)
PROCESSES_EXIT_S = 30.0  # for a mount's supervisor and helpers to exit after it (they hold cache files)
MOUNT_HELP = """\
Mounts SOURCE (s3://bucket/prefix, a local path, hdfs://..., any fsspec URL) at MOUNTPOINT and returns
once the mount is ready; the mount keeps serving in the background until `pffs umount MOUNTPOINT` (or
SIGTERM to its process). Reads go through the shared block cache; files written are staged on local disk
and uploaded when closed or fsync'ed (close reports a failed upload; the data is kept for a retry).
"""
MOUNT_ENDINGS = f"""\
how a mount ends: its last log line says how and what to do; its process (`pffs mount --foreground`, or the
background mount's supervisor) exits with:
{exit_code_table()}
A mount that failed (abort, crash, kill) is left in place, dead (ENOTCONN): `pffs umount MOUNTPOINT`
detaches it. A mount killed with its supervisor is reported by the next `pffs mount` there.
"""


def add_parsers(sub: Any, common: argparse.ArgumentParser) -> None:
    from pffs.cli.peer_options import add_peer_options

    p = sub.add_parser(
        "mount",
        parents=[common],
        help="mount a backend URL as a local folder",
        description=MOUNT_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example:\n  pffs mount s3://datasets/imagenet /mnt/imagenet --endpoint-url http://10.0.0.5:8333\n\n"
        + MOUNT_ENDINGS,
    )
    p.add_argument("source", metavar="SOURCE")
    p.add_argument("mountpoint", metavar="MOUNTPOINT")
    p.add_argument(
        "--attr-ttl",
        type=float,
        default=1.0,
        help="seconds the kernel trusts file attributes and names, and a missing name (default 1)",
    )
    p.add_argument(
        "--dir-ttl",
        type=float,
        help="seconds a directory listing or a stat from the backend is trusted (default 60; "
        "same as --metadata-ttl)",
    )
    p.add_argument(
        "--read-only",
        action="store_true",
        help="refuse every change (EROFS); shows the fixed owner and modes below, as --fixed-modes",
    )
    p.add_argument(
        "--engine",
        choices=("python", "native"),
        default="python",
        help="what serves the mount: python (default; every feature) or native (several threads, no "
        "Python per request; so far read-only S3 over http: needs --read-only; docs/guides/native-engine.md)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=16,
        help="--engine native: threads answering the kernel, one request each at a time (default 16)",
    )
    p.add_argument(
        "--fixed-modes",
        action="store_true",
        help="show the owner and modes below for every file instead of those stored with each object "
        "(S3: modes, owners and times kept as s3fs-fuse keeps them, read with a HEAD per listed file in "
        "folders where pffs stored some); no "
        "chmod, chown, symlinks or FIFOs. For read-only datasets: listings alone show them",
    )
    p.add_argument(
        "--head-every-file",
        action="store_true",
        default=None,
        help="S3, read-write: HEAD every listed file for the modes, owners and times stored with it, as "
        "s3fs-fuse does (for folders s3fs-fuse wrote). Without it, only folders where pffs stored "
        "attributes (marked by a .pffs-attributes object) pay a HEAD per file; others show the defaults",
    )
    add_peer_options(p, serving=True)
    p.add_argument("--allow-other", action="store_true", help="let other users see the mount")
    p.add_argument(
        "--uid", type=int, help="owner of files that have none stored (default: the mounting user)"
    )
    p.add_argument("--gid", type=int, help="group of files that have none stored (default: the user's)")
    p.add_argument(
        "--file-mode", default="644", help="permission bits of files that have none stored, octal (644)"
    )
    p.add_argument(
        "--dir-mode", default="755", help="permission bits of directories that have none stored (755)"
    )
    p.add_argument(
        "--no-prefetch-dirs",
        dest="prefetch_dirs",
        action="store_false",
        help="do not fetch ahead the other small files of a directory whose small files are being read "
        "one after another (on by default: 16 files opened start it; at most 2 files are fetched ahead "
        "per file opened, plus 64)",
    )
    p.add_argument("--metrics-port", type=int, help="serve Prometheus /metrics on this port")
    p.add_argument("--metrics-address", default="127.0.0.1", help="address for /metrics (default 127.0.0.1)")
    p.add_argument(
        "--log-file",
        help="where the mount process logs (default: CACHE_DIR/logs/mount-<name>.log in the "
        "background, stderr in the foreground)",
    )
    p.add_argument("--foreground", "-f", action="store_true", help="serve in this process until unmounted")
    p.set_defaults(run=mount)

    p = sub.add_parser(
        "umount",
        parents=[common],
        help="unmount a pffs mount (uploads what is pending first)",
        description="Asks the mount process to upload every file still pending and unmount, and waits "
        "for it. A mount that processes still use (a working directory, open or mapped files inside) is "
        'left mounted, and they are named (pid and command), as umount says "target is busy"; '
        "--lazy detaches it anyway. A dead (stale) mount, whose process is gone, is detached. It returns "
        "once every process of the mount (its supervisor too) has exited, so the cache's file system can "
        "be unmounted straight after.",
    )
    p.add_argument("mountpoint", metavar="MOUNTPOINT")
    p.add_argument(
        "--timeout", type=float, default=600.0, help="seconds to wait for pending uploads (default 600)"
    )
    p.add_argument(
        "--lazy",
        "-l",
        action="store_true",
        help="if processes still use the mount, detach it now anyway (as umount -l): it is gone from the "
        "folder tree at once, and serves them until they let go; then it uploads what is pending and ends",
    )
    p.set_defaults(run=umount)


def mount_options(args: argparse.Namespace) -> MountOptions:
    from pydantic import ValidationError

    from pffs.backends.errors import BadOptionError
    from pffs.cli.context import backend_options, cache_settings
    from pffs.cli.peer_options import peer_options
    from pffs.config import settings_error
    from pffs.fuse.mount_record import default_log_file
    from pffs.fuse.options import MountOptions

    overrides = {"metadata_ttl": args.dir_ttl} if args.dir_ttl is not None else {}
    mountpoint = Path(os.path.realpath(os.path.expanduser(args.mountpoint)))
    settings = cache_settings(args, **overrides)
    log_file = args.log_file
    if log_file is None and not args.foreground:
        log_file = default_log_file(settings.cache_dir, mountpoint)
    try:
        return MountOptions(
            source=args.source,
            mountpoint=mountpoint,
            cache=settings,
            backend=backend_options(args),
            attr_ttl=args.attr_ttl,
            read_only=args.read_only,
            engine=args.engine,
            threads=args.threads,
            fixed_modes=args.fixed_modes,
            allow_other=args.allow_other,
            uid=args.uid,
            gid=args.gid,
            file_mode=args.file_mode,
            dir_mode=args.dir_mode,
            metrics_port=args.metrics_port,
            metrics_address=args.metrics_address,
            prefetch_dirs=args.prefetch_dirs,
            peers=peer_options(args),
            log_file=Path(log_file) if log_file else None,
            verbose=min(2, getattr(args, "verbose", 0) or 0),
        )
    except ValidationError as exc:
        raise BadOptionError(settings_error(exc).replace("_", "-")) from None


def prepare_mountpoint(path: Path) -> None:
    from pffs.fuse.mountpoint import force_unmount, mountpoint_state

    state = mountpoint_state(path)
    if state == "missing":
        raise FileNotFoundError(2, f"mountpoint {path} does not exist (create it with mkdir -p)")
    if state == "not-a-directory":
        raise NotADirectoryError(20, f"mountpoint {path} is not a directory")
    if state == "mounted":
        raise OSError(16, f"mountpoint {path} is busy: something is mounted there (pffs umount {path})")
    if state == "stale":
        print(f"pffs: {path} was a dead mount; detaching it", file=sys.stderr)
        force_unmount(path)
        if mountpoint_state(path) != "free":
            raise OSError(16, f"mountpoint {path} is a dead mount that could not be detached")
    with os.scandir(path) as entries:
        hidden = sum(1 for _ in entries)
    if hidden:  # as mount(8) does it: allowed, but the files there are out of sight until unmount
        print(
            f"pffs: warning: {path} is not empty: its {hidden} entries are hidden while pffs is mounted "
            "there",
            file=sys.stderr,
        )


def mount(args: argparse.Namespace) -> int:
    from pffs.fuse import mount_record

    options = mount_options(args)
    if not os.path.exists("/dev/fuse"):
        raise OSError(19, "/dev/fuse is missing: this machine cannot mount FUSE file systems")
    record = mount_record.record_path(options.log_file, options.cache.cache_dir, options.mountpoint)
    previous = mount_record.ended_without_a_word(record)
    if previous:  # the new mount's log says it too
        print(f"pffs: {previous}", file=sys.stderr)
    prepare_mountpoint(options.mountpoint)
    if args.foreground:
        from pffs.fuse.mount import serve

        # (what the user should know of the mount is on stderr already: the foreground mount logs there)
        return serve(
            options, ready=lambda _: print(f"pffs: mounted at {options.mountpoint}", file=sys.stderr)
        )
    return start_in_background(options)


def start_in_background(options: MountOptions) -> int:
    from pffs.fuse.launch import MountStartError, start_mount_process

    try:
        child = start_mount_process(options, READY_TIMEOUT_S)
    except MountStartError as exc:
        print(f"pffs: error: {exc}", file=sys.stderr)
        return exc.exit_code or EXIT_FAILURE
    print(
        f"pffs: mounted {options.source} at {options.mountpoint} (pid {child.pid}, log {options.log_file})",
        file=sys.stderr,
    )
    for notice in child.notices:
        print(f"pffs: warning: {notice}", file=sys.stderr)
    return EXIT_OK


def umount(args: argparse.Namespace) -> int:
    from pffs.fuse.mountpoint import force_unmount, mountpoint_state
    from pffs.processes import is_alive

    path = Path(os.path.abspath(os.path.expanduser(args.mountpoint)))
    state = mountpoint_state(path)
    if state == "stale":
        force_unmount(path)
        print(f"pffs: detached the dead mount at {path}", file=sys.stderr)
        return EXIT_OK
    if state != "mounted":
        raise UsageError(f"{path} is not a mount point")
    try:
        pid = int(os.getxattr(path, "user.pffs.pid"))
    except OSError:
        raise OSError(22, f"{path} is not a pffs mount (use umount or fusermount3 -u)") from None
    real = Path(os.path.realpath(path.parent)) / path.name  # as /proc names what is inside it
    used_by = holders(real, exclude={os.getpid(), pid})
    if used_by and not args.lazy:
        raise OSError(
            errno.EBUSY,
            f"{path} is busy, still used by {describe(used_by)}: end them or move them out of it (cd "
            f"elsewhere, close the files), then pffs umount again; or pffs umount --lazy {path} detaches "
            "it now and serves them until they let go",
        )
    if used_by:
        return detach_lazily(real, pid, describe(used_by))
    from pffs.fuse.launch import processes_of_mount

    processes = processes_of_mount(pid)  # known before it ends: its supervisor is its parent
    os.kill(pid, signal.SIGTERM)  # the mount uploads what is pending, then unmounts itself
    deadline = time.monotonic() + args.timeout
    while is_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if is_alive(pid):
        raise TimeoutError(
            f"the mount process {pid} is still uploading after {args.timeout:.0f} s; it goes on in the "
            f"background (see its log), or stop it with kill {pid}"
        )
    if mountpoint_state(path) in ("mounted", "stale"):
        force_unmount(path)
    # Returns once nothing of the mount holds files of the cache's file system (its log, its cache): its
    # supervisor writes the last record and exits just after it, helper processes with it.
    deadline = time.monotonic() + min(args.timeout, PROCESSES_EXIT_S)
    while (left := [p for p in processes if is_alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.02)
    if left:
        raise TimeoutError(
            f"unmounted {path}, but the mount's other processes ({', '.join(map(str, left))}: its "
            f"supervisor or helpers) have not exited {PROCESSES_EXIT_S:.0f} s after it, and still hold "
            f"files of its cache directory's file system; stop them with kill {' '.join(map(str, left))}"
        )
    return EXIT_OK


def detach_lazily(path: Path, pid: int, used_by: str) -> int:
    """Has the mount detach itself (umount -l) and serve the processes that use it until they let go."""
    from pffs.fuse.ending import DETACH_SIGNAL
    from pffs.fuse.mountpoint import force_unmount, in_mount_table
    from pffs.processes import catches

    if catches(pid, DETACH_SIGNAL):
        os.kill(pid, DETACH_SIGNAL)
    else:  # a mount started by an earlier pffs, which this signal would end: the kernel detaches it
        force_unmount(path)
    deadline = time.monotonic() + DETACH_WAIT_S
    while in_mount_table(path) and time.monotonic() < deadline:
        time.sleep(0.05)
    if in_mount_table(path):
        raise TimeoutError(f"the mount process {pid} did not detach {path} within {DETACH_WAIT_S:.0f} s")
    print(
        f"pffs: detached {path}; still used by {used_by}: the mount (pid {pid}) serves them until they "
        "let go, then uploads what is pending and ends",
        file=sys.stderr,
    )
    return EXIT_OK
