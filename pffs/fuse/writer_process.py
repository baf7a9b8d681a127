"""What the mount reads of the process writing a file while its FLUSH is answered: whether that process is
dying from a signal, and whether it still holds the file through another descriptor.

The kernel sends the same FLUSH and RELEASE for a file closed by its program and for one closed because its
process was killed (SIGKILL, the OOM killer, an unhandled SIGTERM). The difference is readable in /proc while
the FLUSH waits for its answer: the kernel sets a dying task's exit code (`/proc/PID/stat` field 52, waitpid's
form: the signal in its low 7 bits) before it closes the task's files, and every thread of a process has
passed that point before the last one drops the shared file table (which is what sends the FLUSH). A process
that exits normally, or closes its files itself (even while unwinding an exception), shows no signal there.

A FLUSH comes at every close(2), also of one of several descriptors of one open file (dd and shells open
the output, dup2 it to stdout and close the first one: right after an O_TRUNC open): a writer that still
holds the file (any descriptor open for writing on it) has not closed it yet.

Requests carry the thread id of their caller, so the writer is remembered as its process (the thread group)
at open: FileSystemWriter's threads open shards, then end, long before the process may be killed.
"""

from __future__ import annotations

import os
import re
import signal

# /proc/PID/stat fields, counted from 1 as proc(5) does; the command (field 2) may hold spaces and ')'.
_STATE, _FLAGS, _EXIT_CODE = 3, 9, 52
PF_EXITING = 0x4  # include/linux/sched.h: the task is in do_exit


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command, or None if the process is gone (or pid is 0)."""
    if pid <= 0:
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read()
    except OSError:
        return None
    return text.rsplit(b")", 1)[1].decode().split()


def process_of(tid: int) -> int | None:
    """The process (thread group id) of thread `tid`, or None if it is gone (or is the kernel's, tid 0)."""
    if tid <= 0:
        return None
    try:
        with open(f"/proc/{tid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Tgid:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def killing_signal(pid: int | None) -> int | None:
    """The signal that is ending process `pid` now, or None while it runs, exits normally or is gone."""
    if pid is None:
        return None
    fields = _stat_fields(pid)
    if fields is None or len(fields) < _EXIT_CODE - 2:
        return None
    state, flags, exit_code = fields[_STATE - 3], int(fields[_FLAGS - 3]), int(fields[_EXIT_CODE - 3])
    exiting = bool(flags & PF_EXITING) or state in ("Z", "X", "x")
    number = exit_code & 0x7F
    return number if exiting and number else None


def process_command(pid: int) -> str:
    """The process's command name (as `ps -o comm` shows it), for log lines; "?" if unreadable."""
    try:
        with open(f"/proc/{pid}/comm", "rb") as f:
            return f.read().decode(errors="replace").strip() or "?"
    except OSError:
        return "?"


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def device_of(mountpoint: str) -> str | None:
    """The "major:minor" of the file system mounted at `mountpoint` (this process's view), or None."""
    found = None
    try:
        with open("/proc/self/mountinfo") as f:
            for fields in map(str.split, f):
                if len(fields) > 4 and _unescape(fields[4]) == mountpoint:
                    found = fields[2]  # the last one mounted there is the one seen
    except OSError:
        return None
    return found


def _unescape(path: str) -> str:
    """mountinfo's octal escapes (\\040 for a space) undone."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), path)


def holds_for_writing(pid: int | None, device: str | None, inode: int, name: str) -> bool:
    """True if process `pid` has a descriptor open for writing on inode `inode` of the file system whose
    "major:minor" is `device` (its bind mounts included: one device, several mount ids). `name` is the
    file's last path component: only descriptors whose path ends with it are looked at closely (a link
    is read without opening anything; a process may hold thousands)."""
    if pid is None or device is None:
        return False
    try:
        with open(f"/proc/{pid}/mountinfo") as f:
            mounts = {fields[0] for fields in map(str.split, f) if len(fields) > 2 and fields[2] == device}
        descriptors = list(os.scandir(f"/proc/{pid}/fd"))
    except OSError:
        return False
    ending = "/" + name
    for descriptor in descriptors:
        try:
            if not os.readlink(descriptor.path).endswith(ending):
                continue
            with open(f"/proc/{pid}/fdinfo/{descriptor.name}") as f:
                info = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue  # closed meanwhile
        if (
            info.get("ino", "").strip() == str(inode)
            and info.get("mnt_id", "").strip() in mounts
            and int(info.get("flags", "0").strip(), 8) & os.O_ACCMODE != os.O_RDONLY
        ):
            return True
    return False
