"""Inode numbers for paths, with the kernel's lookup counts.

Object stores have no inodes: a path gets a number when the kernel first learns of it (lookup, create,
mkdir, a readdirplus entry) and keeps it until the kernel forgets it, so a file keeps its number across
stats while it is in use. Numbers are never reused in one mount.
"""

from __future__ import annotations

import errno
import threading

ROOT_INODE = 1


class InodeTable:
    def __init__(self, root_path: str) -> None:
        self._lock = threading.Lock()
        self._path_of: dict[int, str] = {ROOT_INODE: root_path}
        self._inode_of: dict[str, int] = {root_path: ROOT_INODE}
        self._lookups: dict[int, int] = {ROOT_INODE: 1}  # the root is never forgotten
        self._next = ROOT_INODE + 1

    def path(self, inode: int) -> str:
        try:
            return self._path_of[inode]
        except KeyError:
            raise OSError(errno.ESTALE, f"inode {inode} is no longer known") from None

    def inode(self, path: str) -> int:
        """The number of `path`, made now if it has none; does not count a lookup."""
        with self._lock:
            return self._number(path)

    def remember(self, path: str) -> int:
        """The number of `path`, with one more kernel lookup counted against it."""
        with self._lock:
            inode = self._number(path)
            self._lookups[inode] = self._lookups.get(inode, 0) + 1
            return inode

    def _number(self, path: str) -> int:
        inode = self._inode_of.get(path)
        if inode is None:
            inode = self._next
            self._next += 1
            self._inode_of[path] = inode
            self._path_of[inode] = path
        return inode

    def forget(self, inode: int, count: int) -> None:
        if inode == ROOT_INODE:
            return
        with self._lock:
            left = self._lookups.get(inode, 0) - count
            if left > 0:
                self._lookups[inode] = left
                return
            self._lookups.pop(inode, None)
            path = self._path_of.pop(inode, None)
            if path is not None and self._inode_of.get(path) == inode:
                del self._inode_of[path]

    def detach(self, path: str) -> None:
        """The path is gone (unlink, rmdir): a new file there gets a new number; the old one lives on
        (for open handles and the kernel's counts) until forgotten."""
        with self._lock:
            inode = self._inode_of.pop(path, None)
            if inode is not None and inode not in self._lookups:
                self._path_of.pop(inode, None)

    def rename(self, old: str, new: str) -> None:
        """Moves `old` and everything known under it to `new`; what was at `new` is detached."""
        with self._lock:
            replaced = self._inode_of.pop(new, None)
            if replaced is not None and replaced not in self._lookups:
                self._path_of.pop(replaced, None)
            prefix = old.rstrip("/") + "/"
            for path in [p for p in self._inode_of if p == old or p.startswith(prefix)]:
                inode = self._inode_of.pop(path)
                moved = new + path[len(old) :]
                self._inode_of[moved] = inode
                self._path_of[inode] = moved

    def __len__(self) -> int:
        return len(self._path_of)
