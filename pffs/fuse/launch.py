"""Starting a mount in a process of its own (pffs.cli.mount_daemon), for `pffs mount` and the CSI node plugin.

The options travel as JSON on the child's stdin, credentials included: never in its argv or environment,
where `ps` and /proc/*/environ would show them. The child runs in its own session, so the process that
started it may exit or restart without taking the mount down. It answers one line on stdout: "ok PID" once
mounted (PID: the serving process; the one started is its supervisor), or the reason it could not mount.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
from dataclasses import dataclass

from pffs.fuse.options import MountOptions

SECRET_FIELDS = ("access_key_id", "secret_access_key", "session_token")


class MountStartError(Exception):
    """The mount process could not mount; the message is the reason it gave (one line, no secret)."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass(frozen=True)
class MountProcess:
    pid: int  # the serving process (`pffs umount` and the CSI plugin signal it)
    popen: subprocess.Popen[bytes]  # its supervisor, which exits with its status (pffs.fuse.ending)
    notices: tuple[str, ...] = ()  # what the user should know of the mount made (one line each)


def options_with_credentials(options: MountOptions, without_defaults: bool = False) -> bytes:
    """The options as the mount process reads them. pydantic prints SecretStr as stars; the child needs the
    values, so they are put back here, in the one message that goes through the pipe. `without_defaults`:
    only the options that differ from their defaults (what an older reader, which refuses options it does
    not know, can take as long as the newer ones are not used)."""
    data = options.model_dump(mode="json", exclude_defaults=without_defaults)
    # Only the cache settings given: one not given (--cache-size) means "the cache's own" (vfs.py).
    data["cache"] = options.cache.model_dump(mode="json", exclude_unset=True)
    for name in SECRET_FIELDS:
        value = getattr(options.backend, name)
        if value is not None:
            data.setdefault("backend", {})[name] = value.get_secret_value()
    return json.dumps(data).encode()


def start_mount_process(
    options: MountOptions, ready_timeout_s: float, env: dict[str, str] | None = None
) -> MountProcess:
    """Starts the mount process and waits until it is mounted; raises MountStartError with its reason.
    `env`: the child's environment (default: this one's, so `pffs mount` passes on AWS_* from the shell)."""
    assert options.log_file is not None
    options.log_file.parent.mkdir(parents=True, exist_ok=True)
    with open(options.log_file, "ab") as log:
        child = subprocess.Popen(
            [sys.executable, "-m", "pffs.cli.mount_daemon"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            start_new_session=True,  # not killed with the caller's session, nor by a signal to its group
            close_fds=True,
            env=env,
        )
    assert child.stdin is not None and child.stdout is not None
    child.stdin.write(options_with_credentials(options))
    child.stdin.close()
    readable, _, _ = select.select([child.stdout], [], [], ready_timeout_s)
    answer = child.stdout.readline().decode(errors="replace").strip() if readable else ""
    child.stdout.close()
    if answer.split()[:1] == ["ok"]:  # "ok PID": the serving process (its parent, `child`, supervises it)
        first, *notices = answer.split("\t")  # then the notices, a tab before each
        words = first.split()
        return MountProcess(int(words[1]) if len(words) > 1 else child.pid, child, tuple(notices))
    if not answer:
        child.kill()
        answer = f"the mount process did not answer within {ready_timeout_s:.0f} s (see {options.log_file})"
    code = child.wait()
    raise MountStartError(answer.removeprefix("error: "), code or 1)


def processes_of_mount(pid: int) -> list[int]:
    """The processes of the mount served by `pid`: itself, its supervisor (its parent, for a background
    mount) and its own children (helper processes). All of them hold files of the cache directory's file
    system (the log, the cache, staging), so an unmount is over only once all have exited."""
    from pffs.processes import is_mount_process

    found = [pid]
    parent = _parent_of(pid)
    if parent is not None and parent > 1 and is_mount_process(parent, supervisor_too=True):
        found.append(parent)
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for entry in entries:
        if entry.isdigit() and int(entry) not in found and _parent_of(int(entry)) == pid:
            found.append(int(entry))
    return found


def _parent_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None
