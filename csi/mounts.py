"""The node's mounts, by system call: bind mounts of a staged pffs mount into pods' target paths, unmounts,
and what is mounted where.

Health is judged without touching the FUSE mount itself: a stat of a mount whose process hangs would hang
the caller. A staged volume is alive while its mount process runs and its path is in the mount table;
`/proc/self/mountinfo` and `/proc/PID` never block.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os
import re
import signal
import time

from pffs.processes import is_alive, is_mount_process

log = logging.getLogger(__name__)

__all__ = ["is_mount_process"]  # the plugin's modules import it from here

MS_RDONLY = 1
MS_REMOUNT = 32
MS_BIND = 4096
MNT_DETACH = 2

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)


def _check(result: int, what: str, path: str) -> None:
    if result != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{what} {path}: {os.strerror(code)}", path)


def bind_mount(source: str, target: str, read_only: bool) -> None:
    """Binds `source` at `target` (read-only when asked: a bind is read-write until remounted)."""
    _check(_libc.mount(source.encode(), target.encode(), None, MS_BIND, None), "bind mount on", target)
    if read_only:
        flags = MS_BIND | MS_REMOUNT | MS_RDONLY
        result = _libc.mount(None, target.encode(), None, flags, None)
        if result != 0:
            code = ctypes.get_errno()
            unmount(target, lazy=True)
            raise OSError(code, f"read-only remount of {target}: {os.strerror(code)}", target)


def unmount(path: str, lazy: bool = False) -> bool:
    """Unmounts `path`; True if something was mounted there. Lazy (MNT_DETACH) for a dead mount, or one a
    process still holds: it goes from the namespace now and from the kernel when the last user leaves."""
    result = _libc.umount2(path.encode(), MNT_DETACH if lazy else 0)
    if result == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOENT):  # not a mount point, or nothing there
        return False
    if code == errno.EBUSY and not lazy:
        return unmount(path, lazy=True)
    raise OSError(code, f"unmount {path}: {os.strerror(code)}", path)


def unmount_all(path: str) -> None:
    """Unmounts every mount stacked at `path` (a repair binds over a dead bind: each leaves one more)."""
    for _ in range(256):
        if not unmount(path, lazy=True):
            return


def mounted_paths() -> dict[str, str]:
    """Mount point → file system type, from /proc/self/mountinfo (octal escapes decoded)."""
    mounts: dict[str, str] = {}
    with open("/proc/self/mountinfo") as table:
        for line in table:
            fields = line.split()
            dash = fields.index("-")
            mounts[_unescape(fields[4])] = fields[dash + 1]
    return mounts


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash as \\ooo; every other byte is itself."""
    if "\\" not in field:
        return field
    raw = re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m.group(1), 8)]), os.fsencode(field))
    return os.fsdecode(raw)


def is_mounted(path: str) -> bool:
    return path in mounted_paths()


def stop_mount_process(pid: int | None, path: str, timeout_s: float) -> None:
    """Asks the mount process to upload what is pending and unmount (SIGTERM), waits for it, then
    detaches whatever is left at `path`."""
    if is_mount_process(pid):
        assert pid is not None
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while is_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if is_alive(pid):
            log.warning("mount process %d did not stop within %.0f s; killing it", pid, timeout_s)
            os.kill(pid, signal.SIGKILL)
    unmount_all(path)


def mount_pid(path: str) -> int | None:
    """The pid a live pffs mount at `path` reports (xattr user.pffs.pid); None if it does not answer.
    Touches the mount: call only where a hung mount cannot block anything else."""
    try:
        return int(os.getxattr(path, "user.pffs.pid"))
    except (OSError, ValueError):
        return None
