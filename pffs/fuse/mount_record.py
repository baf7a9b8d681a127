"""A small record per mountpoint, next to the mount's log: who serves it (pid, since when) while it runs, and
how it ended. A mount killed with its supervisor (SIGKILL of both, a node's OOM kill of the container)
leaves "running" behind: the next mount at that mountpoint, and the CSI plugin, say what they found.

JSON, written whole and renamed into place. No pyfuse3 here: the CLI and the CSI plugin read it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from pffs.processes import is_mount_process

log = logging.getLogger(__name__)


def default_log_file(cache_dir: Path, mountpoint: Path) -> Path:
    """Where a background mount logs unless told (`pffs mount --log-file`)."""
    name = hashlib.blake2b(str(mountpoint).encode(), digest_size=4).hexdigest()
    return cache_dir / "logs" / f"mount-{mountpoint.name or 'root'}-{name}.log"


def record_path(log_file: Path | None, cache_dir: Path, mountpoint: Path) -> Path:
    """Next to the log; for a mount logging to a terminal, next to where its log would be."""
    log_file = log_file or default_log_file(cache_dir, mountpoint)
    return log_file.with_name(log_file.stem + ".state.json")


def record_path_for_log(log_file: Path) -> Path:
    return log_file.with_name(log_file.stem + ".state.json")


def read(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write(path: Path, **fields: Any) -> None:
    """Replaces the record (never fails the mount: a record not written is logged)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f".{path.name}.{os.getpid()}")
        temporary.write_text(json.dumps(fields, indent=1) + "\n")
        os.replace(temporary, path)
    except OSError as exc:
        log.warning("could not write the mount's record %s: %s", path, exc)


def update(path: Path, **fields: Any) -> None:
    write(path, **{**(read(path) or {}), **fields})


def running(path: Path, source: str, mountpoint: Path, log_file: Path | None, supervisor: int | None) -> None:
    write(
        path,
        state="running",
        source=source,
        mountpoint=str(mountpoint),
        pid=os.getpid(),
        supervisor=supervisor,
        started=time.strftime("%Y-%m-%d %H:%M:%S %z"),
        log=str(log_file) if log_file else None,
    )


def ended(path: Path, code: int, cause: str) -> None:
    update(path, state="ended", exit_code=code, cause=cause, ended=time.strftime("%Y-%m-%d %H:%M:%S %z"))


def ended_without_a_word(path: Path) -> str | None:
    """What to say when the record says "running" but neither its serving process nor its supervisor
    runs any more: it ended with no last line. None otherwise."""
    record = read(path)
    if record is None or record.get("state") != "running":
        return None
    if is_mount_process(record.get("pid")) or is_mount_process(record.get("supervisor"), supervisor_too=True):
        return None
    return (
        f"the previous mount at {record.get('mountpoint')} (pid {record.get('pid')}, started "
        f"{record.get('started')}) ended without a last word (killed by SIGKILL with its supervisor, or a "
        f"native crash); its log: {record.get('log') or 'stderr'}"
    )


def last_cause(path: Path, wait_s: float = 0.0) -> str | None:
    """How the mount recorded at `path` ended, in one line, if it ended. `wait_s`: how long to give its
    supervisor, still running, to write the cause (it does so just after the serving process died)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        current = read(path) or {}
        if current.get("state") != "running" or not is_mount_process(current.get("supervisor"), True):
            break
        time.sleep(0.02)
    found = ended_without_a_word(path)
    if found is not None:
        return found
    record = read(path)
    if record is None or record.get("state") != "ended":
        return None
    with contextlib.suppress(Exception):
        return f"{record['cause']} [exit {record['exit_code']}]"
    return None
