"""The pyfuse3 Operations: thin async handlers over the namespace, the VFS and staging.

Every handler goes through `fuse_errors`, so only FUSEError leaves it (anything else would end the mount).
Work that may wait on the backend or the disk cache runs in worker threads (pffs.fuse.workers, one set per
resource); reads and lookups that the caches answer at once stay on the event loop, since a thread hop
costs more than the read itself.
"""

from __future__ import annotations

import errno
import functools
import itertools
import json
import logging
import os
import posixpath
import stat
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, ParamSpec, TypeVar

import pyfuse3
import trio

from pffs.backends.backend import ObjectInfo
from pffs.backends.errors import ObjectChangedError
from pffs.backends.posix_metadata import PosixAttributes
from pffs.backends.retry import describe
from pffs.fuse.options import MountOptions
from pffs.fuse.workers import WorkerThreads
from pffs.fuse.writer_process import (
    device_of,
    holds_for_writing,
    killing_signal,
    process_command,
    process_of,
    signal_name,
)
from pffs.vfs import OpenObject
from pffs.vfs.dir_prefetch import DirectoryPrefetcher
from pffs.vfs.inodes import ROOT_INODE, InodeTable
from pffs.vfs.namespace import UNKNOWN, Namespace, staged_info
from pffs.vfs.staging import StagedFile

log = logging.getLogger(__name__)
P = ParamSpec("P")
T = TypeVar("T")

XATTR_PREFIX = "user.pffs."
NOMINAL_CAPACITY = 1 << 50  # the backend has no size: report 1 PiB
STATFS_BLOCK = 4096
SPECIAL_FILE_TYPES = (stat.S_IFREG, stat.S_IFIFO, stat.S_IFCHR, stat.S_IFBLK, stat.S_IFSOCK)
# Reads that wait for the disk or the backend, at once. More threads fight more for the GIL: 8 keep the
# disk and the network busy for 8 parallel readers of small files.
READ_THREADS = 8


def fuse_errors(handler: Callable[P, Coroutine[Any, Any, T]]) -> Callable[P, Coroutine[Any, Any, T]]:
    """Maps what a handler raises to an errno: FUSEError passes; OSError gives its errno (EIO if none);
    NotImplementedError ENOSYS; anything else is a bug, logged with its traceback once, and EIO."""

    @functools.wraps(handler)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return await handler(*args, **kwargs)
        except pyfuse3.FUSEError:
            raise
        except OSError as exc:
            code = exc.errno if isinstance(exc.errno, int) and exc.errno > 0 else errno.EIO
            if code in (errno.ENOENT, errno.EEXIST, errno.ENOTEMPTY, errno.ENODATA, errno.ENAMETOOLONG):
                log.debug("%s: %s", handler.__name__, describe(exc))
            else:
                log.warning("%s: %s", handler.__name__, describe(exc))
            raise pyfuse3.FUSEError(code) from None
        except NotImplementedError:
            raise pyfuse3.FUSEError(errno.ENOSYS) from None
        except Exception as exc:
            _log_bug_once(handler.__name__, exc)
            raise pyfuse3.FUSEError(errno.EIO) from None

    return wrapper


_bugs_seen: set[tuple[str, type]] = set()


def _log_bug_once(where: str, exc: Exception) -> None:
    key = (where, type(exc))
    if key in _bugs_seen:
        log.error("%s failed: %s: %s", where, type(exc).__name__, exc)
        return
    _bugs_seen.add(key)
    log.error("%s failed (a bug; traceback logged once)", where, exc_info=exc)


@dataclass
class FileHandle:
    path: str
    inode: int
    reader: OpenObject | None = None  # reading a stored version
    staged: StagedFile | None = None  # writing, or reading a file being written
    writable: bool = False
    # The process that opened it for writing (its thread group): if that process is dying from a signal
    # when a FLUSH comes, what it wrote is kept aside, not uploaded (pffs.fuse.writer_fate).
    writer: int | None = None
    # Opened for writing without O_TRUNC: the stored bytes are copied into staging at the first write,
    # not at open (a program that opens r+ and only reads never pays for the copy).
    staging_lock: trio.Lock = field(default_factory=trio.Lock)


class Operations(pyfuse3.Operations):
    def __init__(self, namespace: Namespace, root: str, options: MountOptions) -> None:
        super().__init__()
        self.ns = namespace
        self.vfs = namespace.vfs
        self.staging = namespace.staging
        self.options = options
        self.inodes = InodeTable(root)
        self.uid = options.uid if options.uid is not None else os.getuid()
        self.gid = options.gid if options.gid is not None else os.getgid()
        self.files: dict[int, FileHandle] = {}
        self.dirs: dict[int, tuple[str, list[tuple[str, ObjectInfo]]]] = {}
        self._handles = itertools.count(1)
        self._opened_version: dict[int, str] = {}  # inode -> identity at its last open (keep_cache)
        self._mtime_set: dict[str, int] = {}  # utimens on stored objects (S3 cannot store it)
        # What an entry without a time of its own (an S3 prefix) shows, rather than 1970-01-01.
        self._mounted_ns = time.time_ns()
        self._mount_device: str | None = None
        # Two sets of threads, so reads never queue behind slow backend calls (uploads, listings).
        self.backend_threads = WorkerThreads("pffs-backend", max(4, options.cache.fetch_workers))
        self.read_threads = WorkerThreads("pffs-read", READ_THREADS)
        self.prefetcher = (
            DirectoryPrefetcher(self.vfs.reader, self.ns.children) if options.prefetch_dirs else None
        )
        # Makes the cache directory again if it was deleted under the mount (pffs.fuse.mount); True if so
        self.cache_dir_check: Callable[[], bool] = lambda: False

    async def _backend(self, fn: Callable[..., T], *args: Any) -> T:
        return await self.backend_threads.run(fn, *args)

    # Attributes

    def attributes(self, inode: int, info: ObjectInfo) -> pyfuse3.EntryAttributes:
        """What the kernel is told of an entry: its stored POSIX attributes where the mount keeps them,
        the mount's own (--uid/--gid/--file-mode/--dir-mode, the object's time) for what they leave out."""
        posix = self._posix_of(info) or PosixAttributes()
        attr = pyfuse3.EntryAttributes()
        attr.st_ino = inode
        attr.generation = 1
        attr.entry_timeout = self.options.attr_ttl
        attr.attr_timeout = self.options.attr_ttl
        attr.st_mode = self._mode(info, posix.mode)
        attr.st_nlink = 2 if info.is_dir else 1
        attr.st_uid = self.uid if posix.uid is None else posix.uid
        attr.st_gid = self.gid if posix.gid is None else posix.gid
        attr.st_rdev = posix.rdev or 0
        attr.st_size = info.size
        attr.st_blksize = 128 << 10  # what the kernel asks per read; `cp` sizes its buffer from it
        attr.st_blocks = -(-info.size // 512)
        mtime_ns = (
            posix.mtime_ns or self._mtime_set.get(info.path) or int(info.mtime * 1e9) or self._mounted_ns
        )
        attr.st_mtime_ns = mtime_ns
        attr.st_ctime_ns = posix.ctime_ns or mtime_ns
        attr.st_atime_ns = posix.atime_ns or mtime_ns
        return attr

    def _posix_of(self, info: ObjectInfo) -> PosixAttributes | None:
        if not self.ns.posix:
            return None
        if info.is_dir:
            return self.ns.dir_attributes.get(info.path) or info.posix
        return info.posix

    def _mode(self, info: ObjectInfo, stored: int | None) -> int:
        """The stored mode, its file type kept where it agrees with the entry (a directory is one; an object
        is anything but one); the mount's mode where none is stored."""
        if info.is_dir:
            bits = self.options.dir_mode if stored is None else stat.S_IMODE(stored)
            return stat.S_IFDIR | bits
        if stored is None:
            return stat.S_IFREG | self.options.file_mode
        kind = stat.S_IFMT(stored)
        return (kind if kind and kind != stat.S_IFDIR else stat.S_IFREG) | stat.S_IMODE(stored)

    def _shown(self, inode: int, info: ObjectInfo) -> PosixAttributes:
        """The attributes as the kernel sees them now (defaults filled in)."""
        attr = self.attributes(inode, info)
        return PosixAttributes(
            mode=attr.st_mode,
            uid=attr.st_uid,
            gid=attr.st_gid,
            rdev=attr.st_rdev or None,
            mtime_ns=attr.st_mtime_ns,
            ctime_ns=attr.st_ctime_ns,
            atime_ns=attr.st_atime_ns,
        )

    async def _new_entry(self, parent_inode: int, mode: int, ctx: pyfuse3.RequestContext) -> PosixAttributes:
        """Attributes of an entry made now by the caller: its mode (umask applied by the kernel), its
        owner, and its group: the directory's own where the directory is set-group-ID (as POSIX file
        systems do; a new directory inherits the bit too)."""
        gid = ctx.gid
        parent = self.attributes(parent_inode, await self._stat(self.inodes.path(parent_inode)))
        if parent.st_mode & stat.S_ISGID:
            gid = parent.st_gid
            if stat.S_ISDIR(mode):
                mode |= stat.S_ISGID
        now = time.time_ns()
        return PosixAttributes(mode=mode, uid=ctx.uid, gid=gid, mtime_ns=now, ctime_ns=now, atime_ns=now)

    def _negative(self) -> pyfuse3.EntryAttributes:
        attr = pyfuse3.EntryAttributes()
        attr.st_ino = 0  # "no such entry", cached by the kernel for entry_timeout
        attr.entry_timeout = self.options.attr_ttl
        return attr

    async def _stat(self, path: str) -> ObjectInfo:
        info = self.ns.stat_now(path)
        if info is UNKNOWN:
            return await self._backend(self.ns.stat, path)
        assert isinstance(info, ObjectInfo)
        return info

    def _shown_now(self, inode: int, info: ObjectInfo) -> pyfuse3.EntryAttributes:
        """The attributes of `info` for the kernel, after a change made here: `inode` now stands for it."""
        self.inodes.shown(inode, info)
        return self.attributes(inode, info)

    def _check_writable(self) -> None:
        if self.options.read_only:
            raise pyfuse3.FUSEError(errno.EROFS)

    def _child(self, parent_inode: int, name: bytes) -> str:
        path = self.ns.join(self.inodes.path(parent_inode), os.fsdecode(name))
        self._check_name(path)
        return path

    def _check_name(self, path: str) -> None:
        """ENAMETOOLONG for a name the backend cannot store: refused here, never accepted and lost later."""
        why = self.vfs.backend.name_too_long(path)
        if why is not None:
            raise OSError(errno.ENAMETOOLONG, why)

    # Names

    @fuse_errors
    async def lookup(
        self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        parent = self.inodes.path(parent_inode)
        text = os.fsdecode(name)
        if text in (".", ".."):
            path = parent if text == "." or parent_inode == ROOT_INODE else posixpath.dirname(parent)
            found = await self._stat(path)
            return self.attributes(self.inodes.remember(path, found), found)
        self._check_name(self.ns.join(parent, text))
        info = self.ns.lookup_now(parent, text)
        if info is UNKNOWN:
            info = await self._backend(self.ns.lookup, parent, text)
        if info is None:
            return self._negative()
        assert isinstance(info, ObjectInfo)
        # A version written by someone else gets a new number (see pffs.vfs.inodes).
        return self.attributes(self.inodes.remember(self.ns.join(parent, text), info), info)

    @fuse_errors
    async def forget(self, inode_list: Sequence[tuple[int, int]]) -> None:
        for inode, count in inode_list:
            self.inodes.forget(inode, count)
            self._opened_version.pop(inode, None)

    @fuse_errors
    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        try:
            info = await self._stat(self.inodes.path(inode))
            if self.inodes.replaced(inode, info):
                # The path holds another writer's version now, under a new number; this one is still
                # the file its handles read (its size is theirs), until the kernel forgets it.
                info = self.inodes.version(inode) or info
            else:
                self.inodes.shown(inode, info)
            return self.attributes(inode, info)
        except FileNotFoundError:
            # Unlinked while open (fstat on the handle): the version the handle holds, with no links.
            held = self._held_by_handle(inode)
            if held is None:
                raise
            attr = self.attributes(inode, held)
            attr.st_nlink = 0
            return attr

    def _held_by_handle(self, inode: int) -> ObjectInfo | None:
        for handle in list(self.files.values()):
            if handle.inode != inode:
                continue
            held = staged_info(handle.staged) if handle.staged is not None else None
            if held is not None:
                return held
            if handle.reader is not None:
                return handle.reader.info
        return None

    @fuse_errors
    async def setattr(
        self,
        inode: int,
        attr: pyfuse3.EntryAttributes,
        fields: pyfuse3.SetattrFields,
        fh: int | None,
        ctx: pyfuse3.RequestContext,
    ) -> pyfuse3.EntryAttributes:
        path = self.inodes.path(inode)
        info = await self._stat(path)
        if self.ns.posix:
            return await self._set_posix_attributes(inode, path, info, attr, fields, fh)
        if (fields.update_uid and attr.st_uid != self.uid) or (fields.update_gid and attr.st_gid != self.gid):
            raise OSError(errno.EPERM, f"{path}: owners are set by the mount (--uid/--gid)")
        if fields.update_mode:
            shown = self.options.dir_mode if info.is_dir else self.options.file_mode
            if stat.S_IMODE(attr.st_mode) != shown:
                raise OSError(errno.EPERM, f"{path}: modes are set by the mount (--file-mode/--dir-mode)")
        if fields.update_size:
            self._check_writable()
            await self._truncate(path, attr.st_size, self.files.get(fh) if fh is not None else None)
        if fields.update_mtime:
            staged = self.staging.get(path)
            if staged is not None:
                staged.mtime_ns = attr.st_mtime_ns
            else:
                self._mtime_set[path] = attr.st_mtime_ns
        return self._shown_now(inode, await self._stat(path))

    async def _set_posix_attributes(
        self,
        inode: int,
        path: str,
        info: ObjectInfo,
        attr: pyfuse3.EntryAttributes,
        fields: pyfuse3.SetattrFields,
        fh: int | None,
    ) -> pyfuse3.EntryAttributes:
        """chmod, chown, utimens and truncate where the mount stores attributes. Who may do which the
        kernel has checked (default_permissions) against the attributes shown."""
        self._check_writable()
        if fields.update_size:
            await self._truncate(path, attr.st_size, self.files.get(fh) if fh is not None else None)
            info = await self._stat(path)
        shown = self._shown(inode, info)
        change: dict[str, int] = {}
        if fields.update_mode:
            assert shown.mode is not None  # _shown fills every field the kernel is told
            change["mode"] = stat.S_IFMT(shown.mode) | stat.S_IMODE(attr.st_mode)
        if fields.update_uid:
            change["uid"] = attr.st_uid
        if fields.update_gid:
            change["gid"] = attr.st_gid
        if fields.update_mtime:
            change["mtime_ns"] = attr.st_mtime_ns
        if fields.update_atime:
            change["atime_ns"] = attr.st_atime_ns
        if change:
            await self._backend(self.ns.set_attributes, path, change, shown)
            self.inodes.changed_here(path)
        return self._shown_now(inode, await self._stat(path))

    async def _truncate(self, path: str, size: int, handle: FileHandle | None) -> None:
        if handle is not None and handle.writable:
            (await self._staged(handle)).truncate(size)
            return
        staged = await self._backend(self._open_staged, path, size == 0)
        try:
            staged.truncate(size)
            await self._backend(self.staging.upload, staged)
        finally:
            await self._backend(self.staging.release, staged)
        self._changed_here(path)

    def _changed_here(self, path: str) -> None:
        """This mount stored a new version of `path`: forget what was known of it; its number stays."""
        self.ns.forget(path)
        self.inodes.changed_here(path)

    def _open_staged(self, path: str, empty: bool) -> StagedFile:
        """The staged copy of path: emptied (O_TRUNC: the stored bytes go at the next upload, even if
        nothing is written), or filled with the stored bytes (read through the cache). Where the mount
        keeps attributes, the upload carries the object's."""
        try:
            info = self.ns.stat(path)
        except FileNotFoundError:
            if not empty:
                raise
            info = ObjectInfo(path=path, size=0, is_dir=False, identity="")  # gone: written anew
        if empty:
            staged = self.staging.open(path, None)
            with staged.lock:
                staged.truncate(0)
        else:
            staged = self._open_filled(info)
        if self.ns.posix and staged.attributes is None:
            staged.attributes = info.posix or PosixAttributes()
        return staged

    def _open_filled(self, info: ObjectInfo) -> StagedFile:
        path = info.path

        def fill(fd: int) -> None:
            handle = self.vfs.open_version(info)
            try:
                offset, step = 0, self.vfs.settings.block_size
                while offset < info.size:
                    chunk = handle.read(offset, step)
                    os.pwrite(fd, chunk, offset)
                    offset += len(chunk)
            finally:
                handle.close()

        return self.staging.open(path, fill if info.size else None)

    # Directories

    @fuse_errors
    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        path = self.inodes.path(inode)
        children = self.ns.children_now(path)
        if children is None:
            children = await self._backend(self.ns.children, path)
        if self.ns.posix:
            children = await self._with_attributes(path, children)
        fh = next(self._handles)
        self.dirs[fh] = (path, sorted(children.items()))  # a snapshot: readdir resumes by position
        return fh

    async def _with_attributes(self, path: str, children: dict[str, ObjectInfo]) -> dict[str, ObjectInfo]:
        """The entries, each with its attributes: a listed entry has none (a LIST carries no metadata) and
        is HEADed, in parallel. The kernel takes each entry's type from readdir: it must be the real one."""
        missing = [name for name, info in children.items() if not self.ns.complete(info)]
        if not missing:
            return children
        completed = dict(children)

        async def fetch(name: str) -> None:
            try:
                completed[name] = await self._backend(self.ns.stat, self.ns.join(path, name))
            except FileNotFoundError:  # gone since the listing
                completed.pop(name, None)

        async with trio.open_nursery() as nursery:
            for name in missing:
                nursery.start_soon(fetch, name)
        return completed

    @fuse_errors
    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        path, entries = self.dirs[fh]
        for position in range(start_id, len(entries)):
            name, info = entries[position]
            child = self.ns.join(path, name)
            attr = self.attributes(self.inodes.inode(child, info), info)
            if not pyfuse3.readdir_reply(token, os.fsencode(name), attr, position + 1):
                return
            self.inodes.remember(child, info)  # readdirplus: an accepted entry counts as a lookup

    @fuse_errors
    async def releasedir(self, fh: int) -> None:
        self.dirs.pop(fh, None)

    @fuse_errors
    async def mkdir(
        self, parent_inode: int, name: bytes, mode: int, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        self._check_writable()
        path = self._child(parent_inode, name)
        made = await self._new_entry(parent_inode, stat.S_IFDIR | mode, ctx) if self.ns.posix else None
        info = await self._backend(self.ns.mkdir, path, made)
        return self.attributes(self.inodes.remember(path, info), info)

    @fuse_errors
    async def rmdir(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        self._check_writable()
        path = self._child(parent_inode, name)
        await self._backend(self.ns.rmdir, path)
        self.inodes.detach(path)

    @fuse_errors
    async def unlink(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        self._check_writable()
        path = self._child(parent_inode, name)
        await self._backend(self.ns.unlink, path)
        self.inodes.detach(path)
        self._mtime_set.pop(path, None)

    @fuse_errors
    async def rename(
        self,
        parent_inode_old: int,
        name_old: bytes,
        parent_inode_new: int,
        name_new: bytes,
        flags: int,
        ctx: pyfuse3.RequestContext,
    ) -> None:
        self._check_writable()
        if flags & pyfuse3.RENAME_EXCHANGE:
            raise OSError(errno.EINVAL, "RENAME_EXCHANGE is not supported (object stores cannot swap)")
        old = self._child(parent_inode_old, name_old)
        new = self._child(parent_inode_new, name_new)
        replace = not flags & pyfuse3.RENAME_NOREPLACE
        await self._backend(functools.partial(self.ns.rename, old, new, replace=replace))
        self.inodes.rename(old, new)

    @fuse_errors
    async def link(
        self, inode: int, new_parent_inode: int, new_name: bytes, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        raise OSError(errno.ENOTSUP, "hard links are not supported")

    @fuse_errors
    async def symlink(
        self, parent_inode: int, name: bytes, target: bytes, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        if not self.ns.posix:
            raise OSError(errno.ENOTSUP, "symbolic links need a mount that keeps file attributes")
        self._check_writable()
        path = self._child(parent_inode, name)
        made = await self._new_entry(parent_inode, stat.S_IFLNK | 0o777, ctx)
        info = await self._backend(self.ns.make_special, path, made, target)
        return self.attributes(self.inodes.remember(path, info), info)

    @fuse_errors
    async def readlink(self, inode: int, ctx: pyfuse3.RequestContext) -> bytes:
        return await self._backend(self.ns.read_link, self.inodes.path(inode))

    @fuse_errors
    async def mknod(
        self, parent_inode: int, name: bytes, mode: int, rdev: int, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        """FIFOs, device files and sockets: empty objects whose stored mode (and rdev) say what they are;
        the kernel serves their opens itself. An empty regular file, too."""
        if not self.ns.posix:
            raise OSError(errno.ENOTSUP, "only regular files and directories are supported")
        self._check_writable()
        if stat.S_IFMT(mode) not in SPECIAL_FILE_TYPES:
            raise OSError(errno.EINVAL, f"mknod of an unknown file type {stat.S_IFMT(mode):o}")
        path = self._child(parent_inode, name)
        made = await self._new_entry(parent_inode, mode, ctx)
        if rdev and (stat.S_ISCHR(mode) or stat.S_ISBLK(mode)):
            made = made.replace(rdev=rdev)
        info = await self._backend(self.ns.make_special, path, made, b"")
        return self.attributes(self.inodes.remember(path, info), info)

    # Files

    @fuse_errors
    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        path = self.inodes.path(inode)
        fh = next(self._handles)
        if flags & os.O_ACCMODE != os.O_RDONLY:
            self._check_writable()
            try:
                await self._check_current(inode, path)
            except FileNotFoundError:
                # Deleted by someone else while the kernel still knew the name: `> file` (O_CREAT |
                # O_TRUNC) makes it anew, as on a local disk; without O_TRUNC there is nothing to open.
                if not flags & os.O_TRUNC:
                    raise
            self._opened_version.pop(inode, None)
            writer = process_of(ctx.pid)
            if flags & os.O_TRUNC or self.staging.get(path) is not None:
                staged = await self._backend(self._open_staged, path, bool(flags & os.O_TRUNC))
                self.files[fh] = FileHandle(path, inode, staged=staged, writable=True, writer=writer)
            else:
                reader = self.vfs.open_version(await self._stat(path))
                self.files[fh] = FileHandle(path, inode, reader=reader, writable=True, writer=writer)
            return pyfuse3.FileInfo(fh=fh, keep_cache=False)
        if self.staging.get(path) is not None:  # being written here: read what was written
            self.files[fh] = FileHandle(path, inode, staged=self.staging.open(path))
            return pyfuse3.FileInfo(fh=fh, keep_cache=False)
        info = await self._check_current(inode, path)
        self.files[fh] = FileHandle(path, inode, reader=self.vfs.open_version(info))
        if self.prefetcher is not None:
            self.prefetcher.opened(path, info)
        # The kernel keeps its page cache of this file only while the stored version is unchanged.
        keep = self._opened_version.get(inode) == info.identity
        self._opened_version[inode] = info.identity
        return pyfuse3.FileInfo(fh=fh, keep_cache=keep)

    async def _check_current(self, inode: int, path: str) -> ObjectInfo:
        """What `path` holds now, if the kernel was told of that version for `inode`. If not, ESTALE: the
        kernel then looks the name up again (getting the new version's number, or this number's fresh
        attributes after a change made here) and retries the open once, so the open reads the version its
        size is of, and an old number's page cache stays the old version's."""
        info = await self._stat(path)
        if self.inodes.stale(inode, info):
            raise OSError(errno.ESTALE, f"{path} changed in the store; open it again")
        return info

    @fuse_errors
    async def create(
        self, parent_inode: int, name: bytes, mode: int, flags: int, ctx: pyfuse3.RequestContext
    ) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        self._check_writable()
        path = self._child(parent_inode, name)
        made = (
            await self._new_entry(parent_inode, stat.S_IFREG | stat.S_IMODE(mode), ctx)
            if self.ns.posix
            else None
        )
        staged = await self._backend(self.staging.create, path)
        if made is not None:
            staged.attributes = made
        self.ns.forget(path)
        self.ns.entries_changed(posixpath.dirname(path))
        fh = next(self._handles)
        self.inodes.detach(path)  # a new file, whatever the kernel knew there: a new number
        info = self.ns.stat(path)
        inode = self.inodes.remember(path, info)
        self.files[fh] = FileHandle(path, inode, staged=staged, writable=True, writer=process_of(ctx.pid))
        return pyfuse3.FileInfo(fh=fh), self.attributes(inode, info)

    @fuse_errors
    async def read(self, fh: int, off: int, size: int) -> bytes:  # or any buffer: pyfuse3 takes views
        handle = self.files[fh]
        if handle.staged is not None:
            return handle.staged.read(off, size)
        assert handle.reader is not None
        data = handle.reader.read_now(off, size)
        if data is None:
            try:
                data = await self.read_threads.run(handle.reader.read_view, off, size)
            except ObjectChangedError:
                # This handle stays pinned to its version (ESTALE); the next open sees the new one.
                self.ns.forget(handle.path)
                raise
        return data  # type: ignore[return-value]

    @fuse_errors
    async def write(self, fh: int, off: int, buf: bytes) -> int:
        handle = self.files[fh]
        if not handle.writable:
            raise OSError(errno.EBADF, "file not open for writing")
        return (await self._staged(handle)).write(off, buf)

    async def _staged(self, handle: FileHandle) -> StagedFile:
        """The handle's staged file, made (filled with the stored bytes) at its first write."""
        if handle.staged is None:
            async with handle.staging_lock:
                if handle.staged is None:
                    handle.staged = await self._backend(self._open_staged, handle.path, False)
        return handle.staged

    @fuse_errors
    async def flush(self, fh: int) -> None:
        # close(2) of a written file returns after its upload, and reports an upload failure. A close
        # because the writer is dying from a signal publishes nothing, and the close of one of several
        # descriptors of the file waits for the last (pffs.fuse.writer_process).
        handle = self.files.get(fh)
        staged = self._written(handle)
        if handle is None or staged is None:
            return
        killed_by, held = await self._backend(self._writer_state, handle)
        if killed_by is not None:
            await self._abandon(handle, staged, killed_by)
        elif not held:
            await self._publish(staged)

    @fuse_errors
    async def fsync(self, fh: int, datasync: bool) -> None:
        staged = self._written(self.files.get(fh))
        if staged is not None:
            await self._publish(staged)

    def _written(self, handle: FileHandle | None) -> StagedFile | None:
        """The handle's staged file if it holds writes not uploaded yet; OSError if it cannot be uploaded."""
        if handle is None or not handle.writable or handle.staged is None:
            return None
        staged = handle.staged
        if staged.abandoned:
            raise OSError(
                errno.EIO,
                f"{staged.url} was not uploaded: a process writing it was killed; what was written is "
                f"kept in {staged.data_path}; write the file again",
            )
        return staged if staged.dirty else None

    async def _publish(self, staged: StagedFile) -> None:
        await self._backend(self.staging.upload, staged)
        self._changed_here(staged.path)

    def _writer_state(self, handle: FileHandle) -> tuple[int | None, bool]:
        """(the signal its writer is dying from, or None; whether the writer still holds the file open for
        writing through another descriptor), read from /proc in a worker thread."""
        killed_by = killing_signal(handle.writer)
        if killed_by is not None:
            return killed_by, False
        name = posixpath.basename(handle.path)
        return None, holds_for_writing(handle.writer, self._device(), handle.inode, name)

    def _device(self) -> str | None:
        """This mount's "major:minor" (known once mounted), to find its files among a process's."""
        if self._mount_device is None:
            self._mount_device = device_of(str(self.options.mountpoint))
        return self._mount_device

    async def _abandon(self, handle: FileHandle, staged: StagedFile, killed_by: int) -> None:
        """The writer is dying from a signal: its partial file must not replace the stored object."""
        assert handle.writer is not None
        command = process_command(handle.writer)
        details = {"pid": handle.writer, "command": command, "signal": signal_name(killed_by)}
        kept = await self._backend(self.staging.abandon, staged, details)
        self._changed_here(staged.path)  # the kernel was shown the staged size: look again
        log.warning(
            "%s was not uploaded: its writer (pid %d, %s) was killed by %s before closing it, so the stored "
            "object is unchanged; the %d bytes written are kept in %s (delete them when done)",
            staged.url,
            handle.writer,
            command,
            signal_name(killed_by),
            os.path.getsize(kept),
            kept,
        )

    @fuse_errors
    async def release(self, fh: int) -> None:
        handle = self.files.pop(fh, None)
        if handle is None:
            return
        if handle.reader is not None:
            handle.reader.close()
        if handle.staged is not None:
            await self._backend(self.staging.release, handle.staged)
            self._changed_here(handle.staged.path)

    # The file system

    @fuse_errors
    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        result = pyfuse3.StatvfsData()
        result.f_bsize = result.f_frsize = STATFS_BLOCK
        result.f_blocks = NOMINAL_CAPACITY // STATFS_BLOCK
        # What can be written now: the staging area's disk (the cache disk), really.
        try:
            disk = os.statvfs(self.staging.directory)
        except FileNotFoundError:  # the cache directory was deleted: made again, then asked again
            if not await self._backend(self.cache_dir_check):
                raise
            disk = os.statvfs(self.staging.directory)
        result.f_bfree = result.f_bavail = disk.f_bavail * disk.f_frsize // STATFS_BLOCK
        result.f_files = result.f_ffree = result.f_favail = 1 << 32
        result.f_namemax = self.vfs.backend.NAME_MAX  # what a component may hold; whole keys are checked too
        return result

    @fuse_errors
    async def getxattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> bytes:
        key = os.fsdecode(name)
        if not key.startswith(XATTR_PREFIX):
            raise pyfuse3.FUSEError(pyfuse3.ENOATTR)
        field = key[len(XATTR_PREFIX) :]
        path = self.inodes.path(inode)
        if inode == ROOT_INODE and field in ("stats", "pid"):
            value = json.dumps(self.report()) if field == "stats" else str(os.getpid())
            return value.encode()
        info = await self._stat(path)
        values = {"url": self.vfs.backend.url(path), "identity": info.identity}
        if info.etag:
            values["etag"] = info.etag.strip('"')
        if not info.is_dir:
            staged = self.staging.get(path)
            fraction = (
                1.0 if staged is not None else await self._backend(self.vfs.reader.cached_fraction, info)
            )
            values["cached"] = f"{fraction:.4f}"
        if field not in values:
            raise pyfuse3.FUSEError(pyfuse3.ENOATTR)
        return values[field].encode()

    @fuse_errors
    async def listxattr(self, inode: int, ctx: pyfuse3.RequestContext) -> list[bytes]:
        info = await self._stat(self.inodes.path(inode))
        names = ["url", "identity"]
        if info.etag:
            names.append("etag")
        if not info.is_dir:
            names.append("cached")
        if inode == ROOT_INODE:
            names += ["stats", "pid"]
        return [(XATTR_PREFIX + n).encode() for n in names]

    @fuse_errors
    async def setxattr(self, inode: int, name: bytes, value: bytes, ctx: pyfuse3.RequestContext) -> None:
        raise OSError(errno.ENOTSUP, "extended attributes cannot be set")

    @fuse_errors
    async def removexattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        raise OSError(errno.ENOTSUP, "extended attributes cannot be removed")

    def close(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.close()
        self.read_threads.close()
        self.backend_threads.close()

    def report(self) -> dict[str, Any]:
        """What `pffs stats MOUNTPOINT` and /metrics show."""
        cache = self.vfs.cache
        return {
            "pid": os.getpid(),
            "source": self.options.source,
            "mountpoint": str(self.options.mountpoint),
            "cache": cache.stats.snapshot(),
            "cache_usage": cache.usage(),
            "backend_requests": self.vfs.backend.requests.snapshot(),
            "uploads_pending": len(self.staging.pending()),
            "uploads_done": self.staging.uploads_done,
            "upload_failures": self.staging.upload_failures,
            "killed_writes": self.staging.killed_writes,
            "open_files": len(self.files),
            "files_prefetched": self.prefetcher.files_prefetched if self.prefetcher else 0,
            "inodes": len(self.inodes),
            **(
                {"peers": peers.counts.snapshot(), "peer_members": len(peers.members())}
                if (peers := self.vfs.reader.peers)
                else {}
            ),
        }
