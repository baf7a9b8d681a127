"""A backend: one fsspec filesystem plus what the cache needs from it: object identity, ranged reads that
refuse to mix versions, listings with sizes, and one retry policy.

The fsspec filesystem is made per process: s3fs runs its own event-loop thread, which a forked child (a
PyTorch DataLoader worker, say) does not have, so a child makes its own on first use.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import errno
import hashlib
import logging
import os
import posixpath
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import fsspec
from fsspec.asyn import AsyncFileSystem, sync

from pffs.backends.deadline import SharedCalls, timeout_left
from pffs.backends.errors import BadOptionError, ObjectChangedError
from pffs.backends.identity import identity_token, mtime_seconds
from pffs.backends.posix_metadata import PosixAttributes
from pffs.backends.request_stats import ERROR, NOT_FOUND, OK, RequestStats
from pffs.backends.retry import RetryPolicy, describe
from pffs.backends.s3_native import FileRange, NativeS3Getter, NotHandled, native_getter_for

T = TypeVar("T")
Block = bytes | memoryview
log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    """One listed or stat'ed entry. `path` is the backend's own path (no scheme)."""

    path: str
    size: int
    is_dir: bool
    identity: str  # see identity.identity_token
    etag: str | None = None  # S3's raw ETag, for If-Match
    version_id: str | None = None
    mtime: float = 0.0  # seconds since the epoch; 0 where the backend has none (S3 prefixes)
    # What the object's metadata says of its POSIX attributes; None where it was not read (a LIST carries
    # no metadata) or the backend keeps none.
    posix: PosixAttributes | None = None
    content_type: str | None = None  # S3's, kept when the metadata is rewritten

    @property
    def cache_id(self) -> str:
        """Prefix of every cache key for this version of this object."""
        raw = f"{self.path}\0{self.identity}\0{self.size}".encode()
        return hashlib.blake2b(raw, digest_size=16).hexdigest()


class Backend:
    """Any fsspec filesystem. Subclasses add what a protocol can do better (S3: If-Match reads)."""

    def __init__(
        self,
        protocol: str,
        make_fs: Callable[[], fsspec.AbstractFileSystem],
        retry: RetryPolicy | None = None,
    ) -> None:
        self.protocol = protocol
        self._make_fs = make_fs
        self.retry = retry or RetryPolicy()
        self._fs: fsspec.AbstractFileSystem | None = None
        self._fs_pid = 0
        self._lock = threading.Lock()
        self.requests = RequestStats()
        # Lookups and listings of one path share one call, and its deadline (deadline.SharedCalls).
        self._shared: SharedCalls[Any] = SharedCalls()
        _LIVE_BACKENDS.add(self)

    authority = ""  # host:port where the URL names one (hdfs://namenode:8020): shown in messages
    # Which store this is, the same on every node that reads it ("s3 http://10.0.0.5:8333"): members of a
    # cache group serve each other blocks of the same origin only. None: not shared (local files).
    origin: str | None = None

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        if self._fs is None or self._fs_pid != os.getpid():
            with self._lock:
                if self._fs is None or self._fs_pid != os.getpid():
                    try:
                        self._fs = self._make_fs()
                    except (RuntimeError, ValueError, TypeError) as exc:  # the client refused its settings
                        raise BadOptionError(
                            f"{self.url('')}: cannot set up the {self.protocol} client: {describe(exc)}"
                        ) from None
                    self._fs_pid = os.getpid()
        return self._fs

    def url(self, path: str) -> str:
        if self.protocol == "file":
            return path
        return f"{self.protocol}://{self.authority}{path}"

    def _strip_protocol(self, name: str) -> str:
        return str(self.fs._strip_protocol(name))

    def _to_info(self, raw: dict[str, Any]) -> ObjectInfo:
        path = self._strip_protocol(raw["name"])
        is_dir = raw.get("type") == "directory"
        return ObjectInfo(
            path=path,
            size=int(raw.get("size") or 0),
            is_dir=is_dir,
            identity="dir" if is_dir else identity_token(self.protocol, raw),
            etag=raw.get("ETag"),
            version_id=raw.get("VersionId") or None,
            mtime=mtime_seconds(raw),
        )

    def _wait(self) -> dict[str, Any]:
        """Keyword arguments that bound an fsspec call by the deadline: an async filesystem's calls run
        through fsspec's ``sync``, whose own ``timeout`` cancels the request."""
        if isinstance(self.fs, AsyncFileSystem):
            return {"timeout": timeout_left(BLOCKING_CALL_LIMIT_S)}
        return {}

    # Filesystems that block in their own code (no timeout to pass down: HDFS clients, WebHDFS): each
    # attempt runs on a thread of their own and is waited for only until the deadline.
    bound_blocking_calls = True

    def _attempt(self, fn: Callable[[], T]) -> Callable[[], T]:
        fs = self.fs
        if not self.bound_blocking_calls or isinstance(fs, AsyncFileSystem) or _bounds_its_own_calls(fs):
            return fn

        def bounded() -> T:
            future = _blocking_pool().submit(fn)
            try:
                return future.result(timeout=timeout_left(BLOCKING_CALL_LIMIT_S))
            except concurrent.futures.TimeoutError:
                future.cancel()  # if it has not started; a call in flight ends when its client gives up
                raise TimeoutError("no answer") from None

        return bounded

    def _call(self, kind: str, fn: Callable[[], T], path: str, transfer_bytes: int = 0) -> T:
        """One request (with its retries, within the deadline), counted and timed as `kind`. A request that
        sends `transfer_bytes` gets time for them beyond the deadline (SLOWEST_TRANSFER_RATE)."""
        started = time.perf_counter()
        outcome = ERROR
        try:
            extra_s = transfer_bytes / SLOWEST_TRANSFER_RATE
            result = self.retry.call(self._attempt(fn), self.url(path), extra_s, kind, self.requests)
            outcome = OK
            self._shared.answered()
            return result
        except FileNotFoundError:
            outcome = NOT_FOUND  # an answer (a lookup of a name that is not there), not a failure
            raise
        finally:
            self.requests.record(kind, time.perf_counter() - started, outcome)

    # stat, list_dir and find: callers of one path at once share one call (and its deadline); subclasses
    # override _stat, _list_dir and _find.

    def stat(self, path: str) -> ObjectInfo:
        info: ObjectInfo = self._shared.run(("stat", path), lambda: self._stat(path))
        return info

    def list_dir(self, path: str) -> list[ObjectInfo]:
        return list(self._shared.run(("list", path), lambda: self._list_dir(path)))

    def find(self, path: str) -> list[ObjectInfo]:
        """Every object under path (recursive), from as few listing requests as the backend allows."""
        return list(self._shared.run(("find", path), lambda: self._find(path)))

    def _stat(self, path: str) -> ObjectInfo:
        return self._to_info(self._call("head", lambda: self.fs.info(path, **self._wait()), path))

    def _list_dir(self, path: str) -> list[ObjectInfo]:
        entries = self._call("list", lambda: self.fs.ls(path, detail=True, **self._wait()), path)
        return [self._to_info(e) for e in entries if not _folder_marker(e)]

    def sizes_under(self, path: str) -> dict[str, int]:
        """Name -> size of the files right under the folder `path`, as the store has them now."""
        self.invalidate(path)
        return {posixpath.basename(e.path): e.size for e in self.list_dir(path) if not e.is_dir}

    def _find(self, path: str) -> list[ObjectInfo]:
        found = self._call("list", lambda: self.fs.find(path, detail=True, **self._wait()), path)
        return [
            self._to_info(e) for e in found.values() if e.get("type") != "directory" and not _folder_marker(e)
        ]

    # Writes. Each drops what fsspec's own caches knew of the path; callers drop their own.

    # Backends that store POSIX attributes with an object (S3 user metadata) take `attributes` in the
    # writes below and implement set_attributes; the others ignore them.
    stores_posix_metadata = False

    def upload(self, local_path: str, path: str, attributes: PosixAttributes | None = None) -> None:
        """Puts a local file at path (multipart where the backend does that for large files)."""
        extra = self._metadata_arguments(attributes)
        size = os.path.getsize(local_path)
        self._call("put", lambda: self.fs.put_file(local_path, path, **extra, **self._wait()), path, size)
        self.invalidate(path)

    def start_upload(self, local_path: str, path: str) -> GrowingUpload:
        """An upload of a local file that is still being written (only appended to): see GrowingUpload.
        Here, all at `finish` (upload); S3 sends each part as soon as it is written."""
        return GrowingUpload(self, local_path, path)

    def write_bytes(self, path: str, data: bytes, attributes: PosixAttributes | None = None) -> None:
        """Puts a small object (a marker, a record, a symlink) at path in one request."""
        extra = self._metadata_arguments(attributes)
        self._call("put", lambda: self.fs.pipe_file(path, data, **extra, **self._wait()), path)
        self.invalidate(path)

    def _metadata_arguments(self, attributes: PosixAttributes | None) -> dict[str, Any]:
        return {}

    def set_attributes(self, info: ObjectInfo, attributes: PosixAttributes) -> None:
        """Stores new attributes with the version `info` names, its bytes untouched."""
        raise OSError(errno.EPERM, f"{self.url(info.path)}: {self.protocol} stores no file attributes")

    def read_bytes(self, path: str) -> bytes:
        """The whole of a small object, in one request (FileNotFoundError if there is none)."""
        return bytes(self._call("get", lambda: self.fs.cat_file(path, **self._wait()), path))

    def remove(self, path: str) -> None:
        self._call("delete", lambda: self.fs.rm_file(path, **self._wait()), path)
        self.invalidate(path)

    def copy(self, source: str, target: str, size: int = 0) -> None:
        """A copy of the object at source, made by the store where it can (S3: CopyObject, the bytes never
        leave it), else read and written again in one piece. `size`: the source's, given time to copy."""
        try:
            self._call("copy", lambda: self.fs.cp_file(source, target, **self._wait()), target, size)
        except NotImplementedError:  # a filesystem with no copy of its own: through a local file
            with tempfile.TemporaryDirectory(prefix="pffs-copy-") as folder:
                local = os.path.join(folder, "object")
                self._call("get", lambda: self.fs.get_file(source, local), source, size)
                self._call("put", lambda: self.fs.put_file(local, target), target, size)
        self.invalidate(target)

    def move(self, source: str, target: str) -> None:
        """A rename where the backend has one; copy then delete elsewhere (S3: not atomic)."""
        self._call("copy", lambda: self.fs.mv(source, target, **self._wait()), target)
        self.invalidate(source)
        self.invalidate(target)

    def make_dir(self, path: str, attributes: PosixAttributes | None = None) -> None:
        self._call("put", lambda: self.fs.makedirs(path, exist_ok=True, **self._wait()), path)
        self.invalidate(path)

    def remove_dir(self, path: str) -> None:
        """Removes an empty directory (the caller checked it is empty)."""
        self._call("delete", lambda: self.fs.rmdir(path, **self._wait()), path)
        self.invalidate(path)

    # False for object stores, where a prefix exists only while an object is under it.
    has_real_directories = True

    NAME_MAX = 255  # bytes in one path component (POSIX file systems, HDFS, S3 tools' conventions)
    max_key_bytes: int | None = None  # bytes in a whole object key, where the store limits it

    def name_too_long(self, path: str) -> str | None:
        """Why `path` (the backend's own) cannot be stored under that name, or None if it can."""
        url = self.url(path)
        shown = url if len(url) <= 100 else f"{url[:97]}..."
        for part in path.split("/"):
            if len(part.encode()) > self.NAME_MAX:
                return (
                    f"{shown}: a name longer than {self.NAME_MAX} bytes, which {self.protocol} cannot store"
                )
        if self.max_key_bytes is not None and len(self.key_of(path).encode()) > self.max_key_bytes:
            return (
                f"{shown}: a key longer than {self.max_key_bytes} bytes, which {self.protocol} cannot store"
            )
        return None

    def key_of(self, path: str) -> str:
        """The object key of `path` where the store names objects so (S3: the path after the bucket)."""
        return path

    def read_range(self, info: ObjectInfo, start: int, end: int, into: memoryview | None = None) -> Block:
        """Bytes [start, end) of exactly the version `info` describes, or ObjectChangedError. A backend
        that can receive straight into `into` (end - start bytes) does, and returns it."""

        def read() -> Block:
            data = self.fs.cat_file(info.path, start=start, end=end, **self._wait())
            if len(data) != end - start or self.verify_after_read:
                self._check_unchanged(info)
            if len(data) != end - start:
                raise OSError(f"short read: {len(data)} of {end - start} bytes")
            if into is None:
                return data
            # Into the caller's (page-aligned) buffer: one copy here, and the disk tier then writes the
            # block with O_DIRECT instead of copying it into the page cache (which cost the mount more).
            into[:] = data
            return into

        with _gone_is_changed(self.url(info.path)):
            return self._call("get", read, info.path)

    # Reads by path cannot be pinned to a version: the object is stat'ed after every ranged read, so a file
    # rewritten meanwhile (HDFS, local files) is ObjectChangedError, never a mix of old and new blocks.
    # S3 pins each GET to the version read at open instead (If-Match, version id) and needs no stat.
    verify_after_read = True

    def _check_unchanged(self, info: ObjectInfo) -> None:
        self.fs.invalidate_cache(info.path)
        now = self._to_info(self.fs.info(info.path, **self._wait()))
        if (now.identity, now.size) != (info.identity, info.size):
            raise ObjectChangedError(self.url(info.path))

    def invalidate(self, path: str) -> None:
        self._forget_shared(path)
        self.fs.invalidate_cache(path)

    def _forget_shared(self, path: str) -> None:
        """Lookups of `path` and listings of the folders above it, in flight, answer for before a write:
        callers from now on make calls of their own."""
        path = path.rstrip("/")

        def above(key: Any) -> bool:
            other = str(key[1]).rstrip("/")
            return other == path or not other or path.startswith(other + "/")

        self._shared.forget(above)


def _bounds_its_own_calls(fs: Any) -> bool:
    return bool(getattr(fs, "bounds_its_own_calls", False))


class LocalBackend(Backend):
    bound_blocking_calls = False  # local files: no network to hang on


# Clients must not be freed in a forked child (a DataLoader worker): hdfs-native's client, dropped there,
# waits forever for its runtime's threads, which fork did not copy, and fsspec drops its cached file systems
# in every child. So each fork keeps a reference to every client the parent had, in the child for good (a
# child makes its own on first use: see Backend.fs, and helper_process.py for the HDFS client's), in the
# parent until the fork is done.
_LIVE_BACKENDS: weakref.WeakSet[Backend] = weakref.WeakSet()
_KEPT_ACROSS_FORK: list[Any] = []


def _keep_clients_before_fork() -> None:
    _KEPT_ACROSS_FORK.extend(b._fs for b in list(_LIVE_BACKENDS) if b._fs is not None)


os.register_at_fork(before=_keep_clients_before_fork, after_in_parent=_KEPT_ACROSS_FORK.clear)


def _folder_marker(entry: dict[str, Any]) -> bool:
    """The empty object `name/` that s3fs-fuse, the AWS console and pffs's mkdir make for a folder: listed
    as a 0-byte file under the folder's own name, it would turn the folder (a mount's root) into a file."""
    return str(entry.get("name", "")).endswith("/") and entry.get("type") != "directory"


# An upload is given the deadline plus the time to send its bytes at this rate: the deadline bounds a hung
# backend, not a large file on a slow link (a 5 GiB checkpoint needs more than 30 s at most link speeds).
SLOWEST_TRANSFER_RATE = 10 << 20  # bytes per second

# S3 uploads (S3Backend.upload): the part size of a multipart upload, and parts sent at once. Measured by
# bench/dcp.py against a local SeaweedFS: see docs/benchmarks.
UPLOAD_PART_SIZE = 8 << 20
UPLOAD_CONCURRENCY = 8
MIN_PART_SIZE = 5 << 20  # S3's least part size (but the last)

BLOCKING_CALL_LIMIT_S = 3600.0  # a call's timeout where no deadline is set (the deadline is always nearer)
_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _blocking_pool() -> concurrent.futures.ThreadPoolExecutor:
    """Threads for calls into blocking clients. Bounded: when a hung backend holds them all, later calls
    wait in its queue, and still only until their deadline."""
    global _pool
    with _pool_lock:
        if _pool is None or getattr(_pool, "_pffs_pid", 0) != os.getpid():  # not a parent's, after fork
            _pool = concurrent.futures.ThreadPoolExecutor(32, thread_name_prefix="pffs-backend-call")
            _pool._pffs_pid = os.getpid()  # type: ignore[attr-defined]
        return _pool


class S3Backend(Backend):
    """Ranged GETs pinned to the version read at open: If-Match on the ETag (or the version id). Block
    fetches go through the native client (pffs.backends.s3_native) where it applies, else through s3fs."""

    def __init__(
        self,
        *args: Any,
        native_gets: bool = True,
        head_every_file: bool = False,
        plain_native: Callable[[], NativeS3Getter | None] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.native_gets = native_gets
        self.head_every_file = head_every_file
        self._marked: set[str] = set()  # folders this process has put ATTRIBUTES_MARKER in
        self._native: NativeS3Getter | None = None
        self._native_pid = 0
        # Whether the native client can be made without s3fs (s3_native.plain_getter): then GETs and HEADs
        # (all a `pffs cat` of a cached object needs) import neither botocore nor aiohttp.
        self._make_plain = plain_native
        self._plain_ok = native_gets and plain_native is not None and plain_native() is not None
        self._parts_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._parts_pool_pid = 0

    def _attempt(self, fn: Callable[[], T]) -> Callable[[], T]:
        return fn  # s3fs's calls are async (bounded by their timeout) and the native client's by its own

    def _strip_protocol(self, name: str) -> str:
        if self._plain_ok and self._fs is None:  # as s3fs strips, without making its client
            for prefix in ("s3://", "s3a://"):
                name = name.removeprefix(prefix)
            return name.rstrip("/")
        return super()._strip_protocol(name)

    def _split(self, path: str) -> tuple[str, str]:
        """(bucket, key) of a backend path, without making s3fs's client where the native one does all."""
        if self._plain_ok and self._fs is None:
            bucket, _, key = self._strip_protocol(path).partition("/")
            return bucket, key
        fs: Any = self.fs
        bucket, key, _ = fs.split_path(path)
        return bucket, key

    def read_range(self, info: ObjectInfo, start: int, end: int, into: memoryview | None = None) -> Block:
        with _gone_is_changed(self.url(info.path)):
            return self._read_range(info, start, end, into)

    def _read_range(self, info: ObjectInfo, start: int, end: int, into: memoryview | None) -> Block:
        native = self._native_getter()
        if native is not None:
            bucket, key = self._split(info.path)

            def read_native() -> Block:
                try:
                    if into is None:
                        return native.get_bytes(bucket, key, start, end - start, info.etag, info.version_id)
                    native.get(bucket, key, start, into, etag=info.etag, version_id=info.version_id)
                except ObjectChangedError:
                    raise ObjectChangedError(self.url(info.path)) from None
                return into

            try:
                return self._call("get", read_native, info.path)
            except NotHandled as exc:
                log.info("S3 GETs of %s go through s3fs from now on (%s)", self.url(info.path), exc)
                self.native_gets = False
        return self._read_range_s3fs(info, start, end)

    def native_getter(self) -> NativeS3Getter | None:
        """The client that sends S3 GETs without botocore (and tells the native engine where the bucket is
        and who signs), or None: not S3, or set up in a way it does not handle (a proxy, `extra` options)."""
        return self._native_getter()

    def _native_getter(self) -> NativeS3Getter | None:
        if not self.native_gets:
            return None
        if self._native is None or self._native_pid != os.getpid():
            if self._plain_ok and self._make_plain is not None:
                with self._lock:
                    if self._native is None or self._native_pid != os.getpid():
                        self._native = self._make_plain()  # one per process: its locks are this process's
                        self._native_pid = os.getpid()
                return self._native
            fs = self.fs  # before the lock: making the fs takes it too
            with self._lock:
                if self._native is None or self._native_pid != os.getpid():
                    try:
                        self._native = native_getter_for(fs)
                    except NotHandled as exc:
                        log.info("S3 GETs go through s3fs (%s)", exc)
                        self.native_gets = False
                        return None
                    self._native_pid = os.getpid()
        return self._native

    def _read_range_s3fs(self, info: ObjectInfo, start: int, end: int) -> bytes:
        fs: Any = self.fs
        bucket, key, _ = fs.split_path(info.path)
        request: dict[str, Any] = {"Bucket": bucket, "Key": key, "Range": f"bytes={start}-{end - 1}"}
        if info.version_id:
            request["VersionId"] = info.version_id
        elif info.etag:
            request["IfMatch"] = info.etag

        async def get() -> bytes:
            response = await fs._call_s3("get_object", **request)
            body = response["Body"]
            try:
                data: bytes = await body.read()
            finally:
                body.close()
            if info.etag and response.get("ETag") not in (None, info.etag):
                raise ObjectChangedError(self.url(info.path))
            return data

        def read() -> bytes:
            with _changed_if_precondition_fails(self.url(info.path)):
                data = sync(fs.loop, get, timeout=timeout_left(BLOCKING_CALL_LIMIT_S))
            if len(data) != end - start:
                raise OSError(f"short read: {len(data)} of {end - start} bytes")
            return data

        return self._call("get", read, info.path)

    has_real_directories = False
    verify_after_read = False  # each GET is pinned (If-Match): see read_range
    max_key_bytes = 1024  # S3's limit on a key's UTF-8 bytes

    def key_of(self, path: str) -> str:
        return path.split("/", 1)[1] if "/" in path else ""

    stores_posix_metadata = True

    # Attributes stored with an object are invisible to a LIST, so a mount that shows them would HEAD every
    # listed file (as s3fs-fuse does): 2.3 ms a file here, for datasets that almost never carry any. pffs
    # puts an empty ATTRIBUTES_MARKER object in a folder before it stores attributes on an entry there;
    # a listed folder without one shows its entries with no stored attributes and no HEAD.

    def _list_dir(self, path: str) -> list[ObjectInfo]:
        """The folder's entries, without its attributes marker; where it has none (and not
        head_every_file), each entry says that it stores no attributes (posix=PosixAttributes())."""
        entries = super()._list_dir(path)
        listed = [e for e in entries if not _is_attributes_marker(e.path)]
        if len(listed) < len(entries) or self.head_every_file:
            return listed
        return [dataclasses.replace(e, posix=NO_STORED_ATTRIBUTES) for e in listed]

    def _find(self, path: str) -> list[ObjectInfo]:
        return [e for e in super()._find(path) if not _is_attributes_marker(e.path)]

    def remove(self, path: str) -> None:
        native = self._native_getter() if self.native_puts else None
        bucket, key = self._split(path)
        if native is None or not key:
            super().remove(path)
            return
        self._call("delete", lambda: native.delete_object(bucket, key), path)
        self.invalidate(path)

    def sizes_under(self, path: str) -> dict[str, int]:
        """One LIST (a page per 1,000 keys) through the native client where it applies: no s3fs client
        is made for it (a DCP save's finish)."""
        native = self._native_getter() if self.native_puts else None
        if native is None:
            return super().sizes_under(path)
        bucket, key = self._split(path)
        prefix = key.strip("/") + "/" if key.strip("/") else ""
        listed = self._call("list", lambda: native.list_sizes(bucket, prefix), path)
        return {
            name: size
            for full, size in listed.items()
            if (name := full[len(prefix) :]) and not _is_attributes_marker(name)
        }

    def _mark_folder_of(self, path: str, attributes: PosixAttributes | None) -> None:
        """Before attributes are stored on `path`: the marker in its folder, once per process."""
        folder = posixpath.dirname(path.rstrip("/"))
        if attributes is None or folder in self._marked:
            return
        # Not write_bytes, which also drops the folder's cached listing: a hidden marker need not.
        marker = posixpath.join(folder, ATTRIBUTES_MARKER)
        self._call("put", lambda: self.fs.pipe_file(marker, b"", **self._wait()), marker)
        self._marked.add(folder)

    # Uploads through the native client: one PUT up to UPLOAD_PART_SIZE, else a multipart upload of parts
    # of that size, UPLOAD_CONCURRENCY of them at once, each sent from the file by the kernel (sendfile)
    # and retried on its own; completed once every part is in, aborted on any failure. Until the
    # completion the object at the path is what it was: an upload is whole or absent.
    upload_part_size = UPLOAD_PART_SIZE
    upload_concurrency = UPLOAD_CONCURRENCY
    native_puts = True

    def invalidate(self, path: str) -> None:
        self._forget_shared(path)
        if self._fs is not None and self._fs_pid == os.getpid():  # else s3fs has cached nothing here
            self.fs.invalidate_cache(path)

    def upload(self, local_path: str, path: str, attributes: PosixAttributes | None = None) -> None:
        self._mark_folder_of(path, attributes)
        native = self._native_getter() if self.native_puts else None
        if native is not None:
            try:
                self._upload_native(native, local_path, path, attributes)
            except NotHandled as exc:
                log.info("S3 uploads to %s go through s3fs from now on (%s)", self.url(path), exc)
                self.native_puts = False
            else:
                self.invalidate(path)
                return
        super().upload(local_path, path, attributes)

    def _upload_native(
        self, native: NativeS3Getter, local_path: str, path: str, attributes: PosixAttributes | None
    ) -> None:
        bucket, key = self._split(path)
        size = os.path.getsize(local_path)
        headers = {}
        if attributes is not None:
            headers = {f"x-amz-meta-{k}": v for k, v in attributes.to_metadata().items()}
        part = max(MIN_PART_SIZE, self.upload_part_size)
        if size <= part:
            whole = FileRange(local_path, 0, size)
            self._call("put", lambda: native.put_object(bucket, key, whole, headers), path, size)
            return
        upload_id = self._call("put", lambda: native.create_multipart_upload(bucket, key, headers), path)
        futures: list[concurrent.futures.Future[str]] = []
        try:
            pool = self._upload_pool()
            for number, offset in enumerate(range(0, size, part), start=1):
                body = FileRange(local_path, offset, min(part, size - offset))
                send = partial(native.upload_part, bucket, key, upload_id, number, body)
                futures.append(pool.submit(self._call, "put", send, path, len(body)))
            etags = [future.result() for future in futures]  # the first failure ends the wait
            self._call("put", lambda: native.complete_multipart_upload(bucket, key, upload_id, etags), path)
        except BaseException:
            for future in futures:
                future.cancel()
            concurrent.futures.wait(futures)  # parts still being sent end (each within its deadline)
            self._abort(native, bucket, key, upload_id, path)
            raise

    def _abort(self, native: NativeS3Getter, bucket: str, key: str, upload_id: str, path: str) -> None:
        """Drops a multipart upload that will not be completed (the object at the path was never touched),
        or says so in the log: its parts then wait for the bucket's lifecycle rule."""
        try:
            self._call("delete", lambda: native.abort_multipart_upload(bucket, key, upload_id), path)
        except Exception as exc:  # the upload's own error is the one to raise
            log.warning("%s: could not abort the failed multipart upload %s: %s", self.url(path), upload_id,
                        describe(exc))  # fmt: skip

    def start_upload(self, local_path: str, path: str) -> GrowingUpload:
        native = self._native_getter() if self.native_puts else None
        if native is None:
            return GrowingUpload(self, local_path, path)
        return _S3GrowingUpload(self, native, local_path, path)

    def _upload_pool(self) -> concurrent.futures.ThreadPoolExecutor:
        """Threads sending parts, UPLOAD_CONCURRENCY per backend (each its own connection), shared by the
        uploads in flight; made again in a forked child."""
        with self._lock:
            pool = self._parts_pool
            if pool is None or self._parts_pool_pid != os.getpid():
                pool = concurrent.futures.ThreadPoolExecutor(
                    self.upload_concurrency, thread_name_prefix="pffs-upload-part"
                )
                self._parts_pool, self._parts_pool_pid = pool, os.getpid()
            return pool

    def write_bytes(self, path: str, data: bytes, attributes: PosixAttributes | None = None) -> None:
        self._mark_folder_of(path, attributes)
        super().write_bytes(path, data, attributes)

    def _s3(self, method: str, **request: Any) -> Any:
        """One call of the S3 API through s3fs's client, bounded by the deadline."""
        fs: Any = self.fs

        async def call() -> Any:
            return await fs._call_s3(method, fs.kwargs, **request)

        return sync(fs.loop, call, timeout=timeout_left(BLOCKING_CALL_LIMIT_S))

    def _stat(self, path: str) -> ObjectInfo:
        """One HEAD, which also reads the object's POSIX attributes; a prefix is recognised by one LIST
        (its marker object `name/`, where there is one, is HEADed for its attributes)."""
        bucket, key = self._split(path)
        if not key:  # a bucket: no attributes of its own
            return dataclasses.replace(super()._stat(path), posix=PosixAttributes())
        if _is_attributes_marker(path):
            raise FileNotFoundError(errno.ENOENT, f"{self.url(path)}: pffs's own marker, not shown")
        try:
            head = self._call("head", lambda: self._head_object(bucket, key), path)
            return self._head_info(path, head, is_dir=False)
        except FileNotFoundError:
            pass
        prefix = _marker_key(key)
        listed = self._call(
            "list",
            lambda: self._s3("list_objects_v2", Bucket=bucket, Prefix=prefix, Delimiter="/", MaxKeys=1),
            path,
        )
        first = listed.get("Contents") or []
        if not first and not listed.get("CommonPrefixes"):
            raise FileNotFoundError(errno.ENOENT, f"{self.url(path)}: no such file or object")
        if first and first[0].get("Key") == prefix:
            try:
                marker = self._call("head", lambda: self._head_object(bucket, prefix), path)
                return self._head_info(path, marker, is_dir=True)
            except FileNotFoundError:  # deleted since the LIST: still a prefix if anything is under it
                pass
        return ObjectInfo(path=path, size=0, is_dir=True, identity="dir", posix=PosixAttributes())

    def _head_object(self, bucket: str, key: str) -> dict[str, Any]:
        """A HEAD through the native client (a fraction of botocore's CPU: measured by
        bench/profile_mount.py) where it needs nothing of s3fs, or once a GET has made it in this process;
        else through s3fs's. One made from s3fs is not made for a HEAD alone: a process that only lists and
        stats, then forks readers (a DataLoader's), keeps s3fs's client to itself as before, whose session a
        forked child otherwise closes on the wrong loop."""
        if self._plain_ok:
            native = self._native_getter()  # made without s3fs: nothing of it to inherit in a fork
        else:
            native = self._native if self.native_gets and self._native_pid == os.getpid() else None
        if native is not None:
            try:
                return native.head(bucket, key)
            except NotHandled as exc:
                log.info("S3 requests of s3://%s go through s3fs from now on (%s)", bucket, exc)
                self.native_gets = False
        return dict(self._s3("head_object", Bucket=bucket, Key=key))

    def _head_info(self, path: str, head: dict[str, Any], *, is_dir: bool) -> ObjectInfo:
        posix = PosixAttributes.from_metadata(head.get("Metadata") or {})
        if is_dir:
            return ObjectInfo(path=path, size=0, is_dir=True, identity="dir", posix=posix)
        raw = {
            "name": path,
            "size": head.get("ContentLength", 0),
            "type": "file",
            "ETag": head.get("ETag"),
            "VersionId": head.get("VersionId"),
            "LastModified": head.get("LastModified"),
        }
        return dataclasses.replace(self._to_info(raw), posix=posix, content_type=head.get("ContentType"))

    def _metadata_arguments(self, attributes: PosixAttributes | None) -> dict[str, Any]:
        return {} if attributes is None else {"Metadata": attributes.to_metadata()}

    def set_attributes(self, info: ObjectInfo, attributes: PosixAttributes) -> None:
        """A CopyObject of the object onto itself with new metadata (MetadataDirective=REPLACE), pinned to
        the version `info` names (CopySourceIfMatch, or its version id): ObjectChangedError if it changed.
        The bytes are not sent again; a single-part object keeps its ETag (so its cached blocks stay valid;
        a store that gives the copy a new ETag gets new cache keys, never wrong bytes)."""
        fs: Any = self.fs
        bucket, key, _ = fs.split_path(info.path)
        source: dict[str, str] = {"Bucket": bucket, "Key": key}
        request: dict[str, Any] = {
            "Bucket": bucket,
            "Key": key,
            "CopySource": source,
            "MetadataDirective": "REPLACE",
            "Metadata": attributes.to_metadata(),
        }
        if info.version_id:
            source["VersionId"] = info.version_id
        elif info.etag:
            request["CopySourceIfMatch"] = info.etag
        if info.content_type:
            request["ContentType"] = info.content_type
        self._mark_folder_of(info.path, attributes)

        def copy() -> None:
            with _changed_if_precondition_fails(self.url(info.path)):
                self._s3("copy_object", **request)

        self._call("copy", copy, info.path)
        self.invalidate(info.path)

    def make_dir(self, path: str, attributes: PosixAttributes | None = None) -> None:
        """Without attributes, nothing to create: the VFS keeps a new directory until a file is written under
        it. With them, a marker object `name/` holding them, as s3fs-fuse makes (an empty directory then
        stays; SeaweedFS keeps the marker but drops its metadata)."""
        if attributes is None:
            return
        self._mark_folder_of(path, attributes)
        fs: Any = self.fs
        bucket, key, _ = fs.split_path(path)
        request = {
            "Bucket": bucket,
            "Key": _marker_key(key),
            "Body": b"",
            "ContentType": "application/x-directory",
        }
        self._call("put", lambda: self._s3("put_object", Metadata=attributes.to_metadata(), **request), path)
        self.invalidate(path)

    def remove_dir(self, path: str) -> None:
        """Deletes the directory's marker object `name/`, if it has one (the caller checked it is empty):
        an empty prefix does not exist on S3 otherwise (s3fs.rmdir would delete a bucket)."""
        fs: Any = self.fs
        bucket, key, _ = fs.split_path(path)
        if key:
            for marker in (_marker_key(key) + ATTRIBUTES_MARKER, _marker_key(key)):
                self._call("delete", partial(self._s3, "delete_object", Bucket=bucket, Key=marker), path)
        self._marked.discard(path)
        self.invalidate(path)


class GrowingUpload:
    """The upload of a local file while it is being written, for a writer that only appends to it (a
    checkpoint): `written(size)` after each write (the file then holds `size` bytes, flushed to the OS),
    then `finish()` once the file is closed, which puts it at `path` whole, or `abort()`, which leaves the
    object at `path` as it was. `rewritten()` says the writer went back into what it had written: what
    was sent is then dropped, and `finish` uploads the whole file."""

    def __init__(self, backend: Backend, local_path: str, path: str) -> None:
        self.backend, self.local_path, self.path = backend, local_path, path

    def written(self, size: int) -> None:
        pass

    def rewritten(self) -> None:
        pass

    def finish(self) -> None:
        self.backend.upload(self.local_path, self.path)

    def abort(self) -> None:
        pass


class _S3GrowingUpload(GrowingUpload):
    """Each part is sent as soon as the file holds it (on the backend's part threads), so the upload runs
    while the writer writes; `finish` sends the rest and completes the multipart upload. A file no larger
    than one part goes in one PUT at `finish`."""

    def __init__(self, backend: S3Backend, native: NativeS3Getter, local_path: str, path: str) -> None:
        super().__init__(backend, local_path, path)
        self.s3, self.native = backend, native
        self.bucket, self.key = backend._split(path)
        self.part = max(MIN_PART_SIZE, backend.upload_part_size)
        self.upload_id: str | None = None
        self.futures: list[concurrent.futures.Future[str]] = []
        self.sent = 0  # bytes handed to the part threads
        self.whole = False  # rewritten: upload the whole file at finish

    def written(self, size: int) -> None:
        if self.whole:
            return
        # A part is sent once the file holds more than it: the last part (maybe small) waits for finish.
        while size - self.sent > self.part:
            self._send(self.part)
        for future in self.futures:  # a part that failed for good fails the write now, not at the end
            if future.done() and future.exception() is not None:
                future.result()

    def _send(self, length: int) -> None:
        if self.upload_id is None:
            self.upload_id = self.s3._call(
                "put", lambda: self.native.create_multipart_upload(self.bucket, self.key, {}), self.path
            )
        body = FileRange(self.local_path, self.sent, length)
        number = len(self.futures) + 1
        send = partial(self.native.upload_part, self.bucket, self.key, self.upload_id, number, body)
        self.futures.append(self.s3._upload_pool().submit(self.s3._call, "put", send, self.path, length))
        self.sent += length

    def rewritten(self) -> None:
        self.abort()
        self.whole = True

    def finish(self) -> None:
        if self.whole or self.upload_id is None:  # nothing sent yet: as any upload
            self.s3.upload(self.local_path, self.path)
            return
        try:
            size = os.path.getsize(self.local_path)
            while size - self.sent > 0:
                self._send(min(self.part, size - self.sent))
            etags = [future.result() for future in self.futures]
            upload_id = self.upload_id
            self.s3._call(
                "put",
                lambda: self.native.complete_multipart_upload(self.bucket, self.key, upload_id, etags),
                self.path,
            )
        except BaseException:
            self.abort()
            raise
        self.s3.invalidate(self.path)

    def abort(self) -> None:
        for future in self.futures:
            future.cancel()
        concurrent.futures.wait(self.futures)
        upload_id, self.upload_id, self.futures, self.sent = self.upload_id, None, [], 0
        if upload_id is not None:
            self.s3._abort(self.native, self.bucket, self.key, upload_id, self.path)


ATTRIBUTES_MARKER = ".pffs-attributes"
NO_STORED_ATTRIBUTES = PosixAttributes()


def _is_attributes_marker(path: str) -> bool:
    return posixpath.basename(path) == ATTRIBUTES_MARKER


def _marker_key(key: str) -> str:
    """The key of a folder's marker object, `name/`."""
    return key.rstrip("/") + "/"


@contextlib.contextmanager
def _gone_is_changed(url: str) -> Iterator[None]:
    """A read pinned to a version, of an object no longer there: the version is gone (ESTALE, "open it
    again"), not "no such file" — the reader opened it while it was there."""
    try:
        yield
    except FileNotFoundError:
        raise ObjectChangedError(url) from None


@contextlib.contextmanager
def _changed_if_precondition_fails(url: str) -> Iterator[None]:
    """A request pinned to a version (If-Match) that S3 refuses as PreconditionFailed: the object changed."""
    try:
        yield
    except OSError as exc:
        if _s3_error_code(exc) == "PreconditionFailed":
            raise ObjectChangedError(url) from exc
        raise


def _s3_error_code(exc: BaseException) -> str | None:
    response = getattr(exc.__cause__, "response", None) or getattr(exc, "response", None)
    if isinstance(response, dict):
        code = response.get("Error", {}).get("Code")
        return str(code) if code else None
    return None
