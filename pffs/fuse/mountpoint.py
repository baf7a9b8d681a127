"""What is at a mountpoint (free, mounted, a dead FUSE mount) and how to detach a dead one. No pyfuse3 here:
the CLI and the CSI plugin use it without loading the FUSE stack."""

from __future__ import annotations

import logging
import os
import re
import subprocess
from pathlib import Path

log = logging.getLogger(__name__)

DEAD_MOUNT_ERRNOS = (107, 103, 5)  # ENOTCONN, ECONNABORTED (just aborted), or EIO from some dead mounts


def mountpoint_state(path: Path) -> str:
    """'missing', 'not-a-directory', 'stale' (a dead FUSE mount: ENOTCONN), 'mounted' or 'free'."""
    try:
        os.stat(path)
    except FileNotFoundError:
        return "missing"
    except OSError as exc:
        if exc.errno in DEAD_MOUNT_ERRNOS:
            return "stale"
        raise
    try:
        # A FUSE mount's root attributes may come from the kernel's cache (attr TTL) after its process
        # died; statfs is never cached: it asks the mount, and a dead one answers ENOTCONN.
        os.statvfs(path)
    except OSError as exc:
        if exc.errno in DEAD_MOUNT_ERRNOS:
            return "stale"
        if not (os.path.ismount(path) or is_listed_mount(path)):
            raise
        return "mounted"  # a live mount that answered statfs with an error of its own
    if not os.path.isdir(path):
        return "not-a-directory"
    if os.path.ismount(path) or is_listed_mount(path):
        return "mounted"
    return "free"


def is_listed_mount(path: Path) -> bool:
    target = os.path.realpath(path)
    try:
        with open("/proc/self/mounts") as mounts:
            return any(line.split()[1] == target for line in mounts if len(line.split()) > 1)
    except OSError:
        return False


def in_mount_table(path: Path) -> bool:
    """Whether the absolute `path` is a mount point in /proc/self/mountinfo, without touching the path:
    the serving process must never stat its own mountpoint once it stopped answering (it would wait for
    itself for ever)."""
    wanted = os.fsencode(str(path))
    try:
        with open("/proc/self/mountinfo", "rb") as table:
            for line in table:
                field = line.split()[4]
                unescaped = re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m.group(1), 8)]), field)
                if unescaped == wanted:
                    return True
    except (OSError, IndexError):
        return False
    return False


def force_unmount(path: Path) -> None:
    """Detaches a (stale) mount: fusermount3 -uz, falling back to umount -l."""
    for command in (["fusermount3", "-u", "-z", str(path)], ["umount", "-l", str(path)]):
        try:
            if subprocess.run(command, capture_output=True, timeout=30).returncode == 0:
                return
        except (OSError, subprocess.TimeoutExpired):
            continue


# The kernel's read-ahead of a mount, raised after INIT (raise_read_ahead). 4 MiB, not 1 MiB: the kernel
# takes a read longer than its read-ahead (an unaligned random 1 MiB read is 257 pages) for the start of a
# stream and reads 2-3 MiB ahead of it (issue 34: random 1 MiB reads fetched 4.8x their bytes); reads up to
# 4 MiB are read as they are. Requests stay at most 1 MiB (FUSE's max_pages), several in flight.
READ_AHEAD_KB = 4096


def raise_read_ahead(mountpoint: Path) -> None:
    """Raises the mount's read-ahead to READ_AHEAD_KB, once the kernel has the mount's INIT answer. The
    default keeps one 128 KiB request in flight; this makes the kernel send 1 MiB read requests (8 times
    fewer handler calls per byte), several at once, and read random reads of up to 4 MiB as they are. The
    stat of the mountpoint needs the mount's server answering: call it from outside its serving loop."""
    try:
        device = os.stat(mountpoint).st_dev
        bdi = Path(f"/sys/class/bdi/{os.major(device)}:{os.minor(device)}/read_ahead_kb")
        bdi.write_text(str(READ_AHEAD_KB))
    except OSError as exc:
        log.info("could not raise the read-ahead of %s (%s): sequential reads are slower", mountpoint, exc)
