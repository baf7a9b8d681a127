"""What is at a mountpoint (free, mounted, a dead FUSE mount) and how to detach a dead one. No pyfuse3 here:
the CLI and the CSI plugin use it without loading the FUSE stack."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

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
