"""Whether a process is still running, for the mount commands and for staged files left by a process."""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable


def is_alive(pid: object) -> bool:
    """True while process `pid` runs; False once it exited (a zombie, our own unreaped child, has exited)."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, as another user's process
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def catches(pid: int, signum: int) -> bool:
    """True if process `pid` has a handler for signal `signum` (its SigCgt mask in /proc/PID/status)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError):
        pass
    return False


# What a mount's processes show in `ps` (pffs.cli.mount_daemon sets them; never a credential)
MOUNT_TITLE = "pffs mount"  # the serving process: "pffs mount SOURCE MOUNTPOINT"
SUPERVISOR_TITLE = "pffs mount-supervisor"  # its parent, which reports how it ended


def process_title(kind: str, source: str, mountpoint: object) -> str:
    return f"{kind} {public_url(source)} {mountpoint}"


def public_url(url: str) -> str:
    """The URL without a user:password@ in it, for titles and log lines."""
    scheme, found, rest = url.partition("://")
    if not found:
        return url
    authority, slash, path = rest.partition("/")
    return f"{scheme}://{authority.rpartition('@')[2]}{slash}{path}"


def is_mount_process(pid: object, supervisor_too: bool = False) -> bool:
    """True if `pid` runs and is a pffs mount's serving process (or, if asked, its supervisor); not another
    process that got the number since."""
    if not is_alive(pid):
        return False
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
    except OSError:
        return False
    titles = [MOUNT_TITLE + " "] + ([SUPERVISOR_TITLE + " "] if supervisor_too else [])
    # b"pffs.cli.mount_daemon": a mount started by a pffs that set no title (before an upgrade)
    return any(cmdline.startswith(t.encode()) for t in titles) or b"pffs.cli.mount_daemon" in cmdline


def until_stopped(what: str, every_second: Callable[[], object] = lambda: None) -> None:
    """Returns on SIGTERM or SIGINT, logging "SIGTERM: {what}"; calls every_second meanwhile (a timed wait
    also lets the signal handler run promptly)."""
    stopping = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        logging.getLogger(__name__).info("%s: %s", signal.Signals(signum).name, what)
        stopping.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    while not stopping.wait(1.0):
        every_second()
