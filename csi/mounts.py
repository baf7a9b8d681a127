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

MNT_DETACH = 2

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)


def _check(result: int, what: str, path: str) -> None:
    if result != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{what} {path}: {os.strerror(code)}", path)


# The new mount API (Linux 5.12+): a bind made read-only before it is attached, so every copy that mount
# propagation makes of it (on the host, in each pod) is read-only too. A bind followed by a read-only
# remount is read-only only where the remount ran: a remount's flags never propagate.
SYS_OPEN_TREE = 428
SYS_MOVE_MOUNT = 429
SYS_MOUNT_SETATTR = 442
OPEN_TREE_CLONE = 1
OPEN_TREE_CLOEXEC = 0o2000000
AT_FDCWD = -100
AT_EMPTY_PATH = 0x1000
MOVE_MOUNT_F_EMPTY_PATH = 0x4
MOUNT_ATTR_RDONLY = 0x1
MS_PRIVATE = 1 << 18


class _MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


def bind_mount(source: str, target: str, read_only: bool) -> None:
    """Binds `source` at `target`; read-only from the moment it appears, in every mount namespace it
    propagates to."""
    tree = _libc.syscall(SYS_OPEN_TREE, AT_FDCWD, source.encode(), OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC)
    if tree < 0:
        code = ctypes.get_errno()
        raise OSError(code, f"bind mount of {source}: {os.strerror(code)}", source)
    try:
        # Private before it is attached: a clone would join its source's peer group (the kubelet dir's,
        # for an anchor), and mounts on it would echo back through that group. Attached under a shared
        # parent, it then gets a peer group of its own, which the pods' copies follow.
        attr = _MountAttr(attr_set=MOUNT_ATTR_RDONLY if read_only else 0, propagation=MS_PRIVATE)
        result = _libc.syscall(
            SYS_MOUNT_SETATTR, tree, b"", AT_EMPTY_PATH, ctypes.byref(attr), ctypes.sizeof(attr)
        )
        _check(result, "bind mount on", target)
        result = _libc.syscall(SYS_MOVE_MOUNT, tree, b"", AT_FDCWD, target.encode(), MOVE_MOUNT_F_EMPTY_PATH)
        _check(result, "bind mount on", target)
    finally:
        os.close(tree)


SYS_FSPICK = 433
SYS_FSCONFIG = 431
FSPICK_CLOEXEC = 1
FSCONFIG_SET_FLAG = 0
FSCONFIG_CMD_RECONFIGURE = 7


def set_file_system_read_only(path: str, read_only: bool) -> None:
    """Makes the file system mounted at `path` read-only or read-write for every mount of it, in every
    mount namespace: its superblock's flag (a FUSE mount's `mount -o remount,ro`), not one mount's. Only
    that flag changes (the new mount API, unlike mount(2)'s MS_REMOUNT, leaves nosuid and the rest be).
    EBUSY going read-only while a file is open for writing on it."""
    fd = _libc.syscall(SYS_FSPICK, AT_FDCWD, path.encode(), FSPICK_CLOEXEC)
    if fd < 0:
        _check(fd, "reconfigure", path)
    try:
        flag = b"ro" if read_only else b"rw"
        _check(_libc.syscall(SYS_FSCONFIG, fd, FSCONFIG_SET_FLAG, flag, None, 0), "reconfigure", path)
        _check(_libc.syscall(SYS_FSCONFIG, fd, FSCONFIG_CMD_RECONFIGURE, None, None, 0), "reconfigure", path)
    finally:
        os.close(fd)


def file_system_is_read_only(path: str) -> bool | None:
    """Whether the file system mounted at `path` (the topmost mount) is read-only as a whole: its
    superblock options in /proc/self/mountinfo, not the mount's own. None if nothing is mounted there."""
    options = None
    with open("/proc/self/mountinfo") as table:
        for line in table:
            fields = line.split()
            if _unescape(fields[4]) == path:
                options = fields[-1]  # the last line for a path is the topmost mount
    return None if options is None else "ro" in options.split(",")


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


def mounted_in_namespace_of(pid: int, path: str) -> bool:
    """Whether `path` is a mount point in the mount namespace of process `pid` (its /proc/PID/mountinfo;
    the mounter's container, for a mount process). True when that cannot be read: callers use it to
    decide not to stop a mount, and a mount that cannot be judged must be left alone."""
    try:
        with open(f"/proc/{pid}/mountinfo") as table:
            return any(_unescape(line.split()[4]) == path for line in table)
    except OSError:
        return True


def mount_pid(path: str) -> int | None:
    """The pid a live pffs mount at `path` reports (xattr user.pffs.pid); None if it does not answer.
    Touches the mount: call only where a hung mount cannot block anything else."""
    try:
        return int(os.getxattr(path, "user.pffs.pid"))
    except (OSError, ValueError):
        return None


def shares_mounts_with_host(path: str) -> bool:
    """Whether a mount made at `path` here reaches the host's mount namespace (and so the kubelet and the
    pods): we are in the host's namespace, or the mount holding `path` is shared with it (a hostPath
    volume with mountPropagation: Bidirectional). A plugin whose kubelet dir is not mounted at the host's
    path would mount inside its own container, where no pod ever sees it."""
    try:
        if os.readlink("/proc/self/ns/mnt") == os.readlink("/proc/1/ns/mnt"):
            return True
    except OSError:
        pass  # /proc/1 is not ours to read: judge by the mount
    holder, shared = "", False
    with open("/proc/self/mountinfo") as table:
        for line in table:
            fields = line.split()
            point = _unescape(fields[4])
            inside = path == point or path.startswith(point.rstrip("/") + "/")
            if inside and len(point) >= len(holder):  # the deepest, and the topmost of equals
                holder = point
                optional = fields[6 : fields.index("-")]
                shared = any(tag.startswith("shared:") for tag in optional)
    return shared


def mount_stack(path: str) -> list[str]:
    """The file system types mounted at `path`, bottom first (mountinfo lists mounts in the order made)."""
    return [fstype for fstype, _ in mount_table().get(path, [])]


def shows_mount_of(target: str, source: str, table: MountTable | None = None) -> bool:
    """Whether the top mount at `target` is of the same file system as the top mount at `source` (each
    FUSE connection is a device of its own: a dead pffs mount under a target is not the live one).
    `table`: a mount_table() read once for several questions."""
    table = mount_table() if table is None else table
    at_target, at_source = table.get(target, []), table.get(source, [])
    return bool(at_target and at_source) and at_target[-1][1] == at_source[-1][1]


# mount point → (file system type, device major:minor) of each mount there, bottom first
MountTable = dict[str, list[tuple[str, str]]]


def mount_table() -> MountTable:
    table: MountTable = {}
    with open("/proc/self/mountinfo") as lines:
        for line in lines:
            fields = line.split()
            table.setdefault(_unescape(fields[4]), []).append((fields[fields.index("-") + 1], fields[2]))
    return table
