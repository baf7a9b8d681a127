"""The background mount that `pffs mount` (and the CSI plugin) starts: options as JSON on stdin; one line on
stdout, "ok PID" once mounted (PID: the serving process; then, each after a tab, what the user should know
of the mount made, as a source that did not exist) or "error: ..." (then exit non-zero); logs to the log
file (stderr).

Two processes: this one reads the options, then forks before loading pyfuse3 or trio or starting a thread.
The child serves (pffs.fuse.mount.serve) and logs its own last line when it ends in any way it can see.
The parent, a supervisor of a few MiB titled "pffs mount-supervisor SOURCE MOUNTPOINT", answers `pffs mount`,
passes SIGTERM/SIGINT/SIGHUP on to the child, waits for it and, when a signal killed it (SIGKILL, the
out-of-memory killer, a native crash), writes the last line the child could not: the signal, whether the
OOM killer sent it, and what to do. It exits with the child's status, or 128+signal (pffs.fuse.ending).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from types import FrameType

from pffs.cli.errors import EXIT_FAILURE, describe_failure
from pffs.cli.logs import configure_logging
from pffs.fuse import mount_record
from pffs.fuse.ending import OomWatch, describe_wait_status
from pffs.fuse.options import MountOptions
from pffs.processes import MOUNT_TITLE, SUPERVISOR_TITLE, process_title, public_url

log = logging.getLogger("pffs.mount")

FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def main() -> int:
    options = MountOptions.model_validate_json(sys.stdin.buffer.read())
    configure_logging(max(1, options.verbose), options.log_file)
    answer_read, answer_write = os.pipe()  # the child's "ok"/"error: ..." line, to the supervisor
    oom = OomWatch()
    pid = os.fork()
    if pid == 0:
        os.close(answer_read)
        _stdout_to_devnull()  # the supervisor answers `pffs mount`
        set_title(process_title(MOUNT_TITLE, options.source, options.mountpoint))
        return serve_in_child(options, answer_write)
    os.close(answer_write)
    set_title(process_title(SUPERVISOR_TITLE, options.source, options.mountpoint))
    return supervise(options, pid, answer_read, oom)


def serve_in_child(options: MountOptions, answer_fd: int) -> int:
    answered = False

    def ready(notices: tuple[str, ...]) -> None:
        nonlocal answered
        said = "".join("\t" + " ".join(notice.split()) for notice in notices)  # one line, tabs between
        os.write(answer_fd, f"ok{said}\n".encode())
        os.close(answer_fd)
        answered = True

    from pffs.fuse.mount import serve

    try:
        return serve(options, ready, supervisor=os.getppid())
    except Exception as exc:
        message, code = describe_failure(exc)
        log.error("%s", message, exc_info=not isinstance(exc, OSError | ValueError))
        if not answered:
            os.write(answer_fd, (message.replace("\n", " ") + "\n").encode())
        return code or EXIT_FAILURE


def supervise(options: MountOptions, pid: int, answer_fd: int, oom: OomWatch) -> int:
    reaped = False

    def forward(signum: int, frame: FrameType | None) -> None:
        if not reaped:
            os.kill(pid, signum)

    for signum in FORWARDED_SIGNALS:
        signal.signal(signum, forward)
    answer = _read_line(answer_fd)
    os.close(answer_fd)
    if answer.startswith(b"ok"):
        _answer(f"ok {pid}".encode() + answer[2:])  # and the notices after it
    elif answer:
        _answer(answer)
    if answer:
        _stdout_to_devnull()  # nothing else is written there: `pffs mount` sees end-of-file and returns
    _, status = os.waitpid(pid, 0)
    reaped = True
    ending = describe_wait_status(status, pid, options.mountpoint, oom)
    if not answer:  # it died before mounting, with no word of its own
        reason = f"the mount process {pid} ended before it mounted: {ending.cause.split(';')[0]}"
        log.critical("%s", reason)
        _answer(f"error: {reason} (see {options.log_file})\n".encode())
    elif os.WIFSIGNALED(status):
        log.critical("%s", ending.last_line(public_url(options.source), options.mountpoint, pid))
        record = mount_record.record_path(options.log_file, options.cache.cache_dir, options.mountpoint)
        mount_record.ended(record, ending.code, ending.cause)
    return ending.code


def _answer(line: bytes) -> None:
    with contextlib.suppress(OSError):  # `pffs mount` gave up waiting
        os.write(1, line)


def _read_line(fd: int) -> bytes:
    """One line from the child, or what it wrote before it closed the pipe (exited or died)."""
    data = b""
    while not data.endswith(b"\n"):
        chunk = os.read(fd, 4096)  # a forwarded signal interrupts it, and it goes on (PEP 475)
        if not chunk:
            break
        data += chunk
    return data


def _stdout_to_devnull() -> None:
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)


def set_title(title: str) -> None:
    """What `ps` and /proc/PID/cmdline show for this process."""
    try:
        import setproctitle
    except ImportError:  # pragma: no cover - a dependency; without it `ps` shows python -m ...
        return
    setproctitle.setproctitle(title)


if __name__ == "__main__":
    sys.exit(main())
