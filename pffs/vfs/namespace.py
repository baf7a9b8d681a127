"""What a mount shows: the backend's objects and directories, plus directories made here that hold no
object yet (object stores have no empty directories) and files being written here (not uploaded yet).

Lookups are answered from a cached listing of the parent when there is one (no request at all); else one
HEAD; and once a directory has needed several HEADs within the metadata TTL, it is listed once (one LIST
gives names, sizes and ETags of everything in it), which turns a walk over many files into a few LISTs.

Where the mount keeps POSIX attributes (`posix`: modes, owners and times stored with each object, see
pffs.backends.posix_metadata), a LIST is not enough to show an entry of a folder where attributes are
stored, since it carries no metadata: such an entry is HEADed once (then trusted for the metadata TTL like
any stat). The backend says which listed entries store none (S3: a folder without pffs's attributes
marker), and those need no HEAD.

A key `a` beside keys under `a/` (an object and a prefix of one name, which a folder tree cannot hold) is
shown as the directory `a`; the object `a` is hidden while anything is stored under `a/` (Mountpoint for
S3's rule: "directories shadow files"). Listings, lookups and stats all answer so. A lookup answered by a
HEAD that finds an object asks once more whether `a/` holds keys: the cached listing of the parent answers
that without a request, else one LIST of the prefix `a/`. So a file looked up outside a listed folder costs
a HEAD and a LIST: the first LIST_AFTER_HEADS files of a folder per metadata TTL (every lookup with a TTL of
0). The SDK reads keys, not a folder tree: it reads both `a` and `a/b`.
"""

from __future__ import annotations

import dataclasses
import errno
import posixpath
import stat
import threading
import time

from pffs.backends.backend import Backend, ObjectInfo
from pffs.backends.deadline import timeout_left
from pffs.backends.errors import ObjectChangedError
from pffs.backends.posix_metadata import PosixAttributes
from pffs.backends.request_stats import ERROR, OK
from pffs.vfs.staging import STAGED_IDENTITY, StagedFile, Staging
from pffs.vfs.stale import unreachable
from pffs.vfs.vfs import Vfs

LIST_AFTER_HEADS = 8  # lookups that missed the listing cache in one directory before it is listed
PROBE_LIMIT_S = 60.0  # a LIST for keys under a name, where no deadline is set (--backend-timeout is nearer)


class Unknown:
    """Not known without asking the backend (the `*_now` methods, which never wait)."""


UNKNOWN = Unknown()


def keys_under(backend: Backend, path: str) -> bool:
    """Whether the store holds keys under `path/` (a marker `path/` counts): one LIST of the prefix (more
    pages only where it holds more than 1,000 names), counted as a LIST. Not a HEAD of `path/` first:
    SeaweedFS answers it with the object `path`."""
    started, outcome = time.perf_counter(), ERROR
    try:
        found = backend.retry.call(
            lambda: bool(backend.fs.isdir(path, timeout=timeout_left(PROBE_LIMIT_S))), backend.url(path)
        )
        outcome = OK
        return found
    finally:
        backend.requests.record("list", time.perf_counter() - started, outcome)


def directory_info(path: str) -> ObjectInfo:
    return ObjectInfo(path=path, size=0, is_dir=True, identity="dir")


def staged_info(staged: StagedFile) -> ObjectInfo | None:
    """What a file being written shows; None if it was dropped meanwhile (its upload answers)."""
    size = staged.size()
    if size is None:
        return None
    mtime_ns = staged.mtime_ns if staged.mtime_ns is not None else time.time_ns()
    return ObjectInfo(
        path=staged.path,
        size=size,
        is_dir=False,
        identity=f"{STAGED_IDENTITY}{staged.data_path.name}",
        mtime=mtime_ns / 1e9,
        posix=staged.stored_attributes(),
    )


class Namespace:
    def __init__(self, vfs: Vfs, staging: Staging, negative_ttl_s: float, *, posix: bool = False) -> None:
        self.vfs = vfs
        self.staging = staging
        self.negative_ttl_s = negative_ttl_s
        self.posix = posix
        self.new_dirs: set[str] = set()  # changed from worker threads: iterate over a copy
        # Attributes of directories set through this mount. They are stored on the directory's marker
        # object too, but some stores (SeaweedFS) drop a marker's metadata: this mount still shows them.
        self.dir_attributes: dict[str, PosixAttributes] = {}
        self._lock = threading.Lock()
        self._missing: dict[str, float] = {}  # path -> until when it is known not to exist
        self._heads: dict[str, tuple[float, int]] = {}  # directory -> (window end, HEADs in it)
        self._by_name: dict[str, tuple[list[ObjectInfo], dict[str, ObjectInfo]]] = {}

    @staticmethod
    def join(parent: str, name: str) -> str:
        return posixpath.join(parent, name) if parent else name

    # Reading the tree

    def _made_here(self, path: str) -> ObjectInfo | None:
        """A file being written here, or a directory made here; None for anything else."""
        staged = self.staging.get(path)
        info = staged_info(staged) if staged is not None else None
        if info is not None:
            return info
        return directory_info(path) if path in self.new_dirs else None

    def complete(self, info: ObjectInfo) -> bool:
        """True if `info` shows all the mount shows of the entry (a listed one lacks its attributes)."""
        return not self.posix or info.posix is not None

    def _cached(self, path: str) -> ObjectInfo | None:
        info = self.vfs.metadata.get(path)
        if info is not None and not info.is_dir:
            # The object `a` as a HEAD or a listing left it; a cached listing of its folder that shows a
            # directory there hides it.
            listed = self._listed_names(posixpath.dirname(path))
            shadow = listed.get(posixpath.basename(path)) if listed is not None else None
            if shadow is not None and shadow.is_dir:
                info = dataclasses.replace(shadow, path=path)
        return info if info is not None and self.complete(info) else None

    def stat_now(self, path: str) -> ObjectInfo | Unknown:
        return self._made_here(path) or self._cached(path) or UNKNOWN

    def stat(self, path: str) -> ObjectInfo:
        info = self.stat_now(path)
        # A cached entry that lacks its attributes (from a LIST) is asked for again: one HEAD.
        return self._from_backend(path) if isinstance(info, Unknown) else info

    def _from_backend(self, path: str) -> ObjectInfo:
        """The entry at `path` as the backend has it (one HEAD): an object there that a directory of the
        same name hides is shown as that directory (see the module's doc)."""
        info = self.vfs.stat(path, fresh=self.posix)
        if info.is_dir or self.vfs.backend.has_real_directories:
            return info
        directory = self._directory_over(info)
        if directory is None:
            return info
        self.vfs.metadata.put(directory)  # what the next stat of `path` finds
        return directory

    def _directory_over(self, info: ObjectInfo) -> ObjectInfo | None:
        """The directory that hides the object `info` (keys are stored under `path/`), or None."""
        path = info.path
        listed = self._listed_names(posixpath.dirname(path))
        if listed is not None:  # the folder's listing shows both: it says which wins, no request
            found = listed.get(posixpath.basename(path))
            if found is None or not found.is_dir:
                return None
            if self.complete(found):
                return dataclasses.replace(found, path=path)
        own = self.vfs.metadata.get_listing("dir", path) or []
        if not self.posix and any(e.path.rstrip("/") != path for e in own):  # keys listed under it
            return directory_info(path)
        if self.vfs.outage.active:  # the backend cannot be reached: the object as last seen
            return None
        try:
            if not self._keys_under(path):
                return None
        except Exception as exc:
            if unreachable(exc):
                return None
            raise
        if not self.posix:
            return directory_info(path)
        # Its attributes: on its marker `path/` where there is one (a HEAD; else the defaults)
        marker = self.vfs.backend.stat(path + "/")
        return dataclasses.replace(directory_info(path), posix=marker.posix or PosixAttributes())

    def _keys_under(self, path: str) -> bool:
        return keys_under(self.vfs.backend, path)

    def lookup_now(self, parent: str, name: str) -> ObjectInfo | Unknown | None:
        path = self.join(parent, name)
        local = self._made_here(path)
        if local is not None:
            return local
        listed = self._listed_names(parent)
        if listed is not None:
            found = listed.get(name)
            if found is None or self.complete(found):
                return found
            return self._cached(path) or UNKNOWN
        if self._known_missing(path):
            return None
        return self._cached(path) or UNKNOWN

    def lookup(self, parent: str, name: str) -> ObjectInfo | None:
        """The entry `name` in directory `parent`, or None if there is none."""
        known = self.lookup_now(parent, name)
        if not isinstance(known, Unknown):
            return known
        path = self.join(parent, name)
        if self._count_head(parent):
            found = self.children(parent).get(name)
            if found is None or self.complete(found):
                return found
        try:
            return self._from_backend(path)
        except FileNotFoundError:
            self._remember_missing(path)
            return None

    def children_now(self, path: str) -> dict[str, ObjectInfo] | None:
        entries = self.vfs.metadata.get_listing("dir", path)
        return None if entries is None else self._with_local(path, self._names(path, entries))

    def children(self, path: str) -> dict[str, ObjectInfo]:
        """name -> entry of one directory: one LIST (cached for the metadata TTL), plus what was made here."""
        try:
            entries = self.vfs.list_dir(path)
        except FileNotFoundError:
            if path not in self.new_dirs:
                raise
            entries = []  # made here, nothing written under it yet
        return self._with_local(path, self._names(path, entries))

    def _with_local(self, path: str, names: dict[str, ObjectInfo]) -> dict[str, ObjectInfo]:
        extra = {
            posixpath.basename(p): directory_info(p)
            for p in list(self.new_dirs)
            if posixpath.dirname(p) == path
        }
        for staged in self.staging.files():
            info = staged_info(staged) if posixpath.dirname(staged.path) == path else None
            if info is not None:
                extra[posixpath.basename(staged.path)] = info
        if not extra:
            return names
        return {**names, **extra}

    def _names(self, path: str, entries: list[ObjectInfo]) -> dict[str, ObjectInfo]:
        """The listing as a name map, made once per listing (lookups in a 10,000-entry directory are O(1))."""
        with self._lock:
            made = self._by_name.get(path)
            if made is not None and made[0] is entries:
                return made[1]
        names: dict[str, ObjectInfo] = {}
        for info in entries:
            name = posixpath.basename(info.path.rstrip("/"))
            if info.path.rstrip("/") == path or name in ("", ".", ".."):
                continue  # the folder itself (a marker); names a folder tree cannot show
            known = names.get(name)
            if known is None or (info.is_dir and not known.is_dir):  # a directory hides a file
                names[name] = info
        with self._lock:
            self._by_name[path] = (entries, names)
        return names

    def _listed_names(self, parent: str) -> dict[str, ObjectInfo] | None:
        entries = self.vfs.metadata.get_listing("dir", parent)
        return None if entries is None else self._names(parent, entries)

    def _count_head(self, parent: str) -> bool:
        """Counts a HEAD in `parent`; True when it is time to list the directory instead."""
        now = time.monotonic()
        with self._lock:
            until, count = self._heads.get(parent, (now + max(self.vfs.metadata.ttl_s, 1.0), 0))
            if now >= until:
                until, count = now + max(self.vfs.metadata.ttl_s, 1.0), 0
            count += 1
            self._heads[parent] = (until, count)
            if len(self._heads) > 100_000:
                self._heads.clear()
        return count > LIST_AFTER_HEADS and self.vfs.metadata.ttl_s > 0

    def _known_missing(self, path: str) -> bool:
        with self._lock:
            until = self._missing.get(path)
        return until is not None and time.monotonic() < until

    def _remember_missing(self, path: str) -> None:
        if self.negative_ttl_s <= 0:
            return
        with self._lock:
            if len(self._missing) > 100_000:
                self._missing.clear()
            self._missing[path] = time.monotonic() + self.negative_ttl_s

    def entries_changed(self, directory: str) -> None:
        """An entry was made, removed or renamed in `directory`: its mtime and ctime are now (shown by this
        mount; a marker object is not rewritten for each entry)."""
        if not self.posix:
            return
        now = time.time_ns()
        base = self.dir_attributes.get(directory)
        if base is None:
            cached = self.vfs.metadata.get(directory)
            base = cached.posix if cached is not None and cached.posix is not None else PosixAttributes()
        self.dir_attributes[directory] = base.replace(mtime_ns=now, ctime_ns=now)

    def forget(self, path: str) -> None:
        """Drops everything known of `path` (and every listing) after a change made here."""
        with self._lock:
            self._missing.pop(path, None)
            self._by_name.clear()
        self.vfs.invalidate(path)

    # Changing the tree

    def _must_not_exist(self, path: str) -> None:
        if self.lookup(posixpath.dirname(path), posixpath.basename(path)) is not None:
            raise FileExistsError(errno.EEXIST, f"{self.vfs.backend.url(path)} exists")

    def mkdir(self, path: str, attributes: PosixAttributes | None = None) -> ObjectInfo:
        """A new directory; with attributes (a mount that keeps them), a marker object holding them."""
        self._must_not_exist(path)
        self.vfs.backend.make_dir(path, attributes)
        if attributes is not None:
            self.dir_attributes[path] = attributes
        if not self.vfs.backend.has_real_directories:
            self.new_dirs.add(path)
        self.forget(path)
        self.entries_changed(posixpath.dirname(path))
        return dataclasses.replace(directory_info(path), posix=attributes)

    def make_special(self, path: str, attributes: PosixAttributes, content: bytes = b"") -> ObjectInfo:
        """A symlink (content: its target), a FIFO or a device file: an object whose mode says which."""
        self._must_not_exist(path)
        self.vfs.backend.write_bytes(path, content, attributes)
        self.forget(path)
        self.entries_changed(posixpath.dirname(path))
        return self.stat(path)

    def read_link(self, path: str) -> bytes:
        info = self.stat(path)
        if info.posix is None or info.posix.mode is None or not stat.S_ISLNK(info.posix.mode):
            raise OSError(errno.EINVAL, f"{self.vfs.backend.url(path)} is not a symbolic link")
        return self.vfs.read(path)

    def set_attributes(self, path: str, change: dict[str, int], shown: PosixAttributes) -> None:
        """chmod, chown, utimens (`change`: PosixAttributes fields) of the entry at path, whose attributes as
        shown now are `shown` (defaults filled in). A file being written carries them in its upload; a
        directory's go on its marker object; a stored object's metadata is rewritten (bytes untouched)."""
        changed = shown.replace(**change, ctime_ns=time.time_ns())
        staged = self.staging.get(path)
        if staged is not None and self.staging.set_attributes(staged, changed):
            return
        info = self.stat(path)
        if info.is_dir:
            self.dir_attributes[path] = changed
            self.vfs.backend.make_dir(path, changed)
            self.forget(path)
            return
        for attempt in range(2):  # the object changed since it was stat'ed: once more on its new version
            try:
                self.vfs.backend.set_attributes(info, changed)
                break
            except ObjectChangedError:
                if attempt:
                    raise
                self.forget(path)
                info = self.vfs.stat(path, fresh=True)
        self.forget(path)

    def rmdir(self, path: str) -> None:
        self.forget(path)
        if self.children(path):
            raise OSError(errno.ENOTEMPTY, f"{self.vfs.backend.url(path)} is not empty")
        if path in self.new_dirs:
            self.new_dirs.discard(path)
        self.dir_attributes.pop(path, None)
        self.vfs.backend.remove_dir(path)
        self.forget(path)
        self.entries_changed(posixpath.dirname(path))

    def unlink(self, path: str) -> None:
        was_staged = self.staging.get(path) is not None
        self.staging.remove(path)
        try:
            self.vfs.backend.remove(path)
        except FileNotFoundError:
            if not was_staged:
                raise
        self.forget(path)
        self._remember_missing(path)
        self.entries_changed(posixpath.dirname(path))

    def rename(self, old: str, new: str, *, replace: bool = True) -> None:
        """Files: a backend rename (S3: copy then delete, not atomic). Directories: where the backend has
        real ones, or made here and still empty; else EXDEV, so `mv` copies and deletes file by file."""
        info = self.stat(old)
        target = self.lookup(posixpath.dirname(new), posixpath.basename(new))
        if target is not None and not replace:
            raise FileExistsError(errno.EEXIST, f"{self.vfs.backend.url(new)} exists")
        if info.is_dir:
            self._rename_dir(old, new, target)
        else:
            if target is not None and target.is_dir:
                raise IsADirectoryError(errno.EISDIR, f"{self.vfs.backend.url(new)} is a directory")
            staged = self.staging.get(old)
            if staged is not None:
                self.staging.upload(staged)  # the move below then carries the written bytes
                self.staging.rename(old, new)
            self.vfs.backend.move(old, new)
        self.forget(old)
        self.forget(new)
        self._remember_missing(old)
        self.entries_changed(posixpath.dirname(old))
        self.entries_changed(posixpath.dirname(new))

    def _rename_dir(self, old: str, new: str, target: ObjectInfo | None) -> None:
        if target is not None and (not target.is_dir or self.children(new)):
            raise OSError(errno.ENOTEMPTY, f"{self.vfs.backend.url(new)} exists and is not empty")
        if self.vfs.backend.has_real_directories:
            self.vfs.backend.move(old, new)
            return
        if old in self.new_dirs and not self.children(old):
            self.new_dirs.discard(old)
            self.new_dirs.add(new)
            attributes = self.dir_attributes.pop(old, None)
            if self.posix:  # its marker object moves too
                attributes = attributes or PosixAttributes()
                self.vfs.backend.make_dir(new, attributes)
                self.vfs.backend.remove_dir(old)
            if attributes is not None:
                self.dir_attributes[new] = attributes
            return
        raise OSError(
            errno.EXDEV,
            f"{self.vfs.backend.url(old)}: renaming a directory that holds objects is not supported on an "
            "object store (it would copy every object); mv falls back to copying file by file",
        )
