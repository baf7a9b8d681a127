"""Which processes use a mount (as `fuser -m` finds them): a working or root directory, the program, an open
or mapped file inside it. `pffs umount` names them instead of detaching the mount from under them.

Read from /proc by link text only (readlink), never by looking at the files: a mount that stopped
answering cannot hang the look. Processes in other mount namespaces (a container's) are not counted, nor
those whose /proc entries this user may not read.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

MOST_NAMED = 5  # holders named in a message; the rest are counted


@dataclass(frozen=True)
class Holder:
    pid: int
    command: str  # its command's name
    uses: str  # "its working directory", "2 open files", ...


def holders(mountpoint: Path, exclude: set[int]) -> list[Holder]:
    """The processes (but `exclude`) that use something inside `mountpoint`, lowest pid first."""
    inside = str(mountpoint).rstrip("/") or "/"
    own_namespace = _readlink("/proc/self/ns/mnt")
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) in exclude:
            continue
        pid = int(entry.name)
        if _readlink(f"/proc/{pid}/ns/mnt") != own_namespace:
            continue
        uses = _uses(pid, inside)
        if uses:
            found.append(Holder(pid, _command(pid), ", ".join(uses)))
    return sorted(found, key=lambda h: h.pid)


def describe(found: list[Holder]) -> str:
    """'pid 12 (bash: its working directory), pid 40 (python3: 2 open files)'"""
    named = [f"pid {h.pid} ({h.command}: {h.uses})" for h in found[:MOST_NAMED]]
    if len(found) > MOST_NAMED:
        named.append(f"{len(found) - MOST_NAMED} more")
    return ", ".join(named)


def _uses(pid: int, inside: str) -> list[str]:
    uses = []
    links = (("cwd", "its working directory"), ("root", "its root directory"), ("exe", "its program"))
    for link, what in links:
        target = _readlink(f"/proc/{pid}/{link}")
        if target is not None and _is_inside(target, inside):
            uses.append(what)
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        fds = []
    open_files = sum(1 for fd in fds if _is_inside(_readlink(f"/proc/{pid}/fd/{fd}"), inside))
    if open_files:
        uses.append(f"{open_files} open file{'s' if open_files > 1 else ''}")
    try:
        with open(f"/proc/{pid}/maps") as maps:
            mapped = {line.split(None, 5)[5].strip() for line in maps if line.count(" ") >= 5}
    except (OSError, IndexError):
        mapped = set()
    mapped_files = sum(1 for path in mapped if _is_inside(path, inside))
    if mapped_files:
        uses.append(f"{mapped_files} mapped file{'s' if mapped_files > 1 else ''}")
    return uses


def _is_inside(target: str | None, inside: str) -> bool:
    if target is None:
        return False
    target = target.removesuffix(" (deleted)")
    return target == inside or target.startswith(inside + "/") or inside == "/"


def _readlink(path: str) -> str | None:
    try:
        return os.readlink(path)
    except OSError:
        return None


def _command(pid: int) -> str:
    """Its command's name (as ps -o comm shows it): not its arguments, which may hold a secret."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip() or "?"
    except OSError:
        return "?"
