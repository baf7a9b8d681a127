"""How a mount ends: the exit status of each way, its meaning in one line, and the words for a process's end
as its parent sees it (a waitpid status), the kernel's out-of-memory killer included.

No pyfuse3 or trio here: the mount's supervisor (pffs.cli.mount_daemon) loads this before it forks the
serving process, and the CLI and the CSI plugin read it to describe an exit status.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import signal
from dataclasses import dataclass
from pathlib import Path

# `pffs umount --lazy` of a mount some process still uses: this signal to the serving process has it detach
# itself from the folder tree (as umount -l) and serve those processes until they let go (pffs.fuse.mount).
DETACH_SIGNAL = signal.SIGUSR2

# 1 and 2 are every pffs command's (pffs.cli.errors): the mount never served.
EXIT_UNMOUNTED = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_UPLOADS_FAILED = 3
EXIT_UNMOUNTED_OUTSIDE = 4
EXIT_CONNECTION_ABORTED = 5
EXIT_INTERNAL_ERROR = 6
EXIT_SIGNAL_BASE = 128  # 128+N: killed by signal N (as a shell reports it), written by the supervisor

MEANINGS = {
    EXIT_UNMOUNTED: "unmounted on request (SIGTERM, SIGINT, SIGHUP, pffs umount); every file uploaded",
    EXIT_FAILURE: "could not mount (the reason is its one line on stderr and in the log)",
    EXIT_USAGE: "bad options",
    EXIT_UPLOADS_FAILED: "unmounted, but files could not be uploaded; their data stays in CACHE_DIR/staging",
    EXIT_UNMOUNTED_OUTSIDE: "unmounted from outside (umount, fusermount3 -u); every file uploaded",
    EXIT_CONNECTION_ABORTED: "the kernel's FUSE connection was aborted (/sys/fs/fuse/connections/N/abort)",
    EXIT_INTERNAL_ERROR: "an unexpected error in the mount (a bug: the traceback is in the log)",
}
SIGNAL_MEANING = (
    "killed by signal N: 137 SIGKILL (kill -9, the out-of-memory killer), 139 SIGSEGV, 134 SIGABRT"
)

# What to do about a mount left dead (listed, answering ENOTCONN): it is left in place, since an empty
# folder where the data was would fool a reader that an error does not.
DEAD_MOUNT_ADVICE = "`pffs umount {mountpoint}` detaches the dead mount; then mount again"


@dataclass(frozen=True)
class Ending:
    code: int
    cause: str  # one line: how it ended, and what to do where something should be done

    def last_line(self, source: str, mountpoint: object, pid: int) -> str:
        return f"mount of {source} at {mountpoint} (pid {pid}) ended: {self.cause} [exit {self.code}]"


def exit_code_table() -> str:
    """The table for `pffs mount --help` and the README."""
    rows = [f"  {code:<5}{meaning}" for code, meaning in MEANINGS.items()]
    return "\n".join([*rows, f"  128+N {SIGNAL_MEANING}"])


def describe_exit_code(code: int | None) -> str:
    """A mount process's exit code (or Popen's -N for a signal) in words."""
    if code is None:
        return "still running"
    if code < 0:
        code = EXIT_SIGNAL_BASE - code
    if code in MEANINGS:
        return MEANINGS[code]
    if code > EXIT_SIGNAL_BASE:
        return f"killed by {signal_name(code - EXIT_SIGNAL_BASE)}"
    return f"exit status {code}"


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def describe_wait_status(status: int, pid: int, mountpoint: object, oom: OomWatch | None = None) -> Ending:
    """A waitpid status of the serving process, as the supervisor reports it."""
    if os.WIFEXITED(status):
        code = os.WEXITSTATUS(status)
        return Ending(code, describe_exit_code(code))
    number = os.WTERMSIG(status)
    name = signal_name(number)
    advice = DEAD_MOUNT_ADVICE.format(mountpoint=mountpoint)
    if number == signal.SIGKILL:
        verdict = oom.verdict(pid) if oom is not None else None
        what = (
            f"killed by SIGKILL ({verdict})" if verdict else "killed by SIGKILL (kill -9, or the OOM killer)"
        )
    elif number in (signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT, signal.SIGILL, signal.SIGFPE):
        what = f"killed by {name}: a native crash (a Python traceback of every thread is above, if any)"
    else:
        what = f"killed by {name}"
    return Ending(EXIT_SIGNAL_BASE + number, f"{what}; {advice}")


class OomWatch:
    """The kernel's count of out-of-memory kills, system-wide and in this process's memory cgroup, at
    start; `verdict` tells after a SIGKILL whether the OOM killer did it."""

    def __init__(self) -> None:
        self.cgroup = memory_cgroup()
        self.system_kills = _vmstat_oom_kills()
        self.cgroup_kills = _cgroup_oom_kills(self.cgroup)

    def verdict(self, pid: int) -> str | None:
        cgroup_kills = _cgroup_oom_kills(self.cgroup)
        in_cgroup = cgroup_kills is not None and cgroup_kills > (self.cgroup_kills or 0)
        logged = _kernel_log_says_oom_killed(pid)
        killed = (_vmstat_oom_kills() or 0) - (self.system_kills or 0)
        if not (in_cgroup or logged or killed > 0):
            return None
        if in_cgroup or logged:
            found = "out of memory: the kernel's OOM killer ended it"
        else:  # another process may have been the one killed: say what is known
            found = (
                f"likely out of memory: the kernel's OOM killer killed {killed} process(es) meanwhile "
                "(oom_kill in /proc/vmstat)"
            )
        return f"{found}{self._limits()}; see dmesg; give it more memory or a smaller --memory-cache-size"

    def _limits(self) -> str:
        if self.cgroup is None:
            return ""
        limit = _read_int(self.cgroup / "memory.limit_in_bytes")
        peak = _read_int(self.cgroup / "memory.max_usage_in_bytes")
        if limit is None or peak is None:
            return ""
        shown_limit = "none" if limit >= 1 << 60 else f"{limit >> 20} MiB"
        return (
            f" (memory cgroup {self.cgroup}: limit {shown_limit}, memory.max_usage_in_bytes {peak >> 20} MiB)"
        )


def memory_cgroup(pid: int | str = "self") -> Path | None:
    """The cgroup v1 memory folder of a process, if this machine has one."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            folder = Path("/sys/fs/cgroup/memory") / path.lstrip("/")
            return folder if folder.is_dir() else Path("/sys/fs/cgroup/memory")
    return None


def _vmstat_oom_kills() -> int | None:
    with contextlib.suppress(OSError):
        found = re.search(r"^oom_kill (\d+)", Path("/proc/vmstat").read_text(), re.M)
        return int(found.group(1)) if found else None
    return None


def _cgroup_oom_kills(cgroup: Path | None) -> int | None:
    if cgroup is None:
        return None
    with contextlib.suppress(OSError):
        found = re.search(r"^oom_kill (\d+)", (cgroup / "memory.oom_control").read_text(), re.M)
        return int(found.group(1)) if found else None
    return None


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _kernel_log_says_oom_killed(pid: int, max_records: int = 100_000) -> bool:
    """Whether the kernel's log (/dev/kmsg: root, where it is readable) holds the OOM killer's
    "Killed process PID" for this pid."""
    wanted = f"Killed process {pid} (".encode()
    try:
        fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        for _ in range(max_records):
            try:
                record = os.read(fd, 8192)
            except OSError as exc:
                if exc.errno == errno.EPIPE:  # records overwritten while reading: go on with the next
                    continue
                return False  # EAGAIN: the end
            if wanted in record:
                return True
        return False
    finally:
        os.close(fd)


def how_serving_ended(
    signalled: str | None, still_listed: bool, mountpoint: Path, detached: bool = False
) -> Ending:
    """pyfuse3.main returned: on our pyfuse3.terminate() (a signal), or when the kernel ended the session
    (libfuse takes ENODEV from /dev/fuse as the end): unmounted from outside, or after the mount detached
    itself on request (`pffs umount --lazy`) and the last process using it let go, or the connection
    aborted (the mount stays listed, dead)."""
    if signalled:
        return Ending(EXIT_UNMOUNTED, f"{signalled}: unmounted on request")
    if detached and not still_listed:
        return Ending(
            EXIT_UNMOUNTED,
            f"{DETACH_SIGNAL.name} (pffs umount --lazy): detached on request, and the last process using "
            "it let go",
        )
    if still_listed:
        return Ending(
            EXIT_CONNECTION_ABORTED,
            "the kernel's FUSE connection was aborted (/sys/fs/fuse/connections/N/abort, or the kernel "
            f"gave up on it); {DEAD_MOUNT_ADVICE.format(mountpoint=mountpoint)}",
        )
    return Ending(EXIT_UNMOUNTED_OUTSIDE, "unmounted from outside (umount or fusermount3 -u)")


def serving_failed(exc: BaseException, mountpoint: Path) -> Ending:
    """An exception out of the serving loop: a bug. The mount is left dead in place."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:  # a trio nursery's
        exc = exc.exceptions[0]
    return Ending(
        EXIT_INTERNAL_ERROR,
        f"internal error: {type(exc).__name__}: {exc} (the traceback is above); "
        f"{DEAD_MOUNT_ADVICE.format(mountpoint=mountpoint)}",
    )
