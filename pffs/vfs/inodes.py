"""Inode numbers for paths, with the kernel's lookup counts, and the version each number stands for.

Object stores have no inodes: a path gets a number when the kernel first learns of it (lookup, create,
mkdir, a readdirplus entry) and keeps it until the kernel forgets it, so a file keeps its number across
stats while it is in use. Numbers are never reused in one mount.

A number stands for one version of an object. When another writer replaces the object (a new ETag, version
id or mtime), the path gets a new number, as a file replaced by rename(2) does on a local disk. The kernel
keeps its page cache per inode: were the number kept, a handle opened on the old version would read pages
that a newer handle filled with the new version's bytes, one file made of two versions. With a number per
version, the old handles keep their inode, its page cache holds only the old bytes, and what they read that
is not cached comes from their pinned version (or fails with ESTALE once it is gone from the store).
Changes made through this mount (writes, truncates, chmod, renames) keep the number, as on a local disk:
`changed_here` says the next version seen is this mount's own. Either way an open checks the version it
pins against the one the kernel was last told of for the number (`stale`): where they differ, the open is
refused with ESTALE, and the kernel looks the name up again (a new number, or fresh attributes for this one)
and retries, so a handle's size and bytes are always of one version.
"""

from __future__ import annotations

import errno
import threading

from pffs.backends.backend import ObjectInfo
from pffs.vfs.staging import STAGED_IDENTITY

ROOT_INODE = 1


def same_version(a: ObjectInfo, b: ObjectInfo) -> bool:
    """True if `a` and `b` describe the same stored bytes. A LIST gives an S3 object's ETag, a HEAD of a
    versioned bucket its version id: either matching is enough."""
    if a.identity == b.identity:
        return True
    if a.is_dir or b.is_dir or a.size != b.size:
        return False
    if a.version_id and b.version_id:
        return a.version_id == b.version_id
    return bool(a.etag) and a.etag == b.etag


def made_here(info: ObjectInfo) -> bool:
    """A file being written through this mount (not a stored version yet)."""
    return info.identity.startswith(STAGED_IDENTITY)


class InodeTable:
    def __init__(self, root_path: str) -> None:
        self._lock = threading.Lock()
        self._path_of: dict[int, str] = {ROOT_INODE: root_path}
        self._inode_of: dict[str, int] = {root_path: ROOT_INODE}
        self._lookups: dict[int, int] = {ROOT_INODE: 1}  # the root is never forgotten
        # The version a number stands for: the one the kernel was last told of.
        self._version_of: dict[int, ObjectInfo] = {}
        self._changed_here: set[int] = set()  # numbers whose next version is this mount's own
        self._next = ROOT_INODE + 1

    def path(self, inode: int) -> str:
        try:
            return self._path_of[inode]
        except KeyError:
            raise OSError(errno.ESTALE, f"inode {inode} is no longer known") from None

    def version(self, inode: int) -> ObjectInfo | None:
        """The version `inode` stands for, if one is known."""
        return self._version_of.get(inode)

    def replaced(self, inode: int, info: ObjectInfo) -> bool:
        """True if `info` (what the path shows now) is another writer's replacement of the version
        `inode` stands for: the path has a new number for it, or gets one at its next lookup."""
        return inode not in self._changed_here and self.stale(inode, info)

    def stale(self, inode: int, info: ObjectInfo) -> bool:
        """True if the kernel was last told of another version for `inode` than `info`."""
        bound = self._version_of.get(inode)
        return bound is not None and _replaces(bound, info)

    def shown(self, inode: int, info: ObjectInfo) -> None:
        """The kernel was told of `info` for `inode` (getattr of a number this mount changed)."""
        with self._lock:
            if inode in self._path_of:
                self._version_of[inode] = info
                self._changed_here.discard(inode)

    def inode(self, path: str, info: ObjectInfo | None = None) -> int:
        """The number of `path` as `info` shows it, made now if it has none; does not count a lookup."""
        with self._lock:
            return self._number(path, info)

    def remember(self, path: str, info: ObjectInfo | None = None) -> int:
        """The number of `path` as `info` shows it, with one more kernel lookup counted against it."""
        with self._lock:
            inode = self._number(path, info)
            self._lookups[inode] = self._lookups.get(inode, 0) + 1
            return inode

    def _number(self, path: str, info: ObjectInfo | None) -> int:
        inode = self._inode_of.get(path)
        if inode is not None and info is not None and self.replaced(inode, info):
            self._detach(path)  # the old number lives on for its handles until the kernel forgets it
            inode = None
        if inode is None:
            inode = self._next
            self._next += 1
            self._inode_of[path] = inode
            self._path_of[inode] = path
        if info is not None:
            self._version_of[inode] = info
            self._changed_here.discard(inode)
        return inode

    def changed_here(self, path: str) -> None:
        """This mount changed `path` (an upload, truncate, chmod, rename): its number stays, and stands
        for the next version seen."""
        with self._lock:
            inode = self._inode_of.get(path)
            if inode is not None:
                self._changed_here.add(inode)

    def forget(self, inode: int, count: int) -> None:
        if inode == ROOT_INODE:
            return
        with self._lock:
            left = self._lookups.get(inode, 0) - count
            if left > 0:
                self._lookups[inode] = left
                return
            self._lookups.pop(inode, None)
            self._version_of.pop(inode, None)
            self._changed_here.discard(inode)
            path = self._path_of.pop(inode, None)
            if path is not None and self._inode_of.get(path) == inode:
                del self._inode_of[path]

    def detach(self, path: str) -> None:
        """The path is gone (unlink, rmdir): a new file there gets a new number; the old one lives on
        (for open handles and the kernel's counts) until forgotten."""
        with self._lock:
            self._detach(path)

    def _detach(self, path: str) -> None:
        inode = self._inode_of.pop(path, None)
        if inode is not None and inode not in self._lookups:
            self._path_of.pop(inode, None)
            self._version_of.pop(inode, None)
            self._changed_here.discard(inode)

    def rename(self, old: str, new: str) -> None:
        """Moves `old` and everything known under it to `new`; what was at `new` is detached. The moved
        numbers stand for the next version seen at their new paths (the store copied them)."""
        with self._lock:
            self._detach(new)
            prefix = old.rstrip("/") + "/"
            for path in [p for p in self._inode_of if p == old or p.startswith(prefix)]:
                inode = self._inode_of.pop(path)
                moved = new + path[len(old) :]
                self._inode_of[moved] = inode
                self._path_of[inode] = moved
                self._changed_here.add(inode)

    def __len__(self) -> int:
        return len(self._path_of)


def _replaces(bound: ObjectInfo, seen: ObjectInfo) -> bool:
    if made_here(bound) or made_here(seen):
        return False  # this mount's own writing: the same file, as on a local disk
    if bound.is_dir or seen.is_dir:
        return bound.is_dir != seen.is_dir
    return not same_version(bound, seen)
