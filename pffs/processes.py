"""Whether a process is still running, for the mount commands and for staged files left by a process."""

from __future__ import annotations

import os


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
