"""The objects a dataset reads (a prefix listed once, or a list of URLs) and how one is read: through a
pffs filesystem made once per process, so DataLoader workers, forked or spawned, share the disk cache.

A transform gets each object as a `PffsObject`: a read-only, seekable binary file that reads through the
cache as it is consumed. An object of one block or less is fetched whole when the item is made (one GET,
as before); a larger one block by block, with the reader's read-ahead, so a worker decoding a 10 GiB tar
shard holds the read-ahead window and the block it is in, not the shard.
"""

from __future__ import annotations

import functools
import hashlib
import io
import logging
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pffs.backends.backend import ObjectInfo
from pffs.backends.errors import ObjectChangedError
from pffs.sdk.filesystem import PffsFileSystem
from pffs.sdk.helpers import filesystem_for, parse_url
from pffs.vfs.vfs import OpenObject

log = logging.getLogger(__name__)

_NEWLINE = re.compile(b"\n")


class PerProcessFilesystem:
    """The pffs filesystem of one scheme and set of options, made once per process (a forked DataLoader
    worker makes its own, as a spawned one does). Pickles as the scheme and the options alone."""

    def __init__(self, scheme: str, options: dict[str, Any]) -> None:
        self.scheme = scheme
        self.options = dict(options)
        self._fs: PffsFileSystem | None = None
        self._fs_pid = 0

    def get(self) -> PffsFileSystem:
        if self._fs is None or self._fs_pid != os.getpid():
            self._fs, _ = filesystem_for(f"{self.scheme}://", **self.options)
            self._fs_pid = os.getpid()
        return self._fs

    def __getstate__(self) -> dict[str, Any]:
        return {"scheme": self.scheme, "options": self.options, "_fs": None, "_fs_pid": 0}


class PffsObject(io.BufferedIOBase):
    """One object, read through the pffs cache as it is consumed: a read-only, seekable binary file
    (`read`, `readinto`, `readline`, iteration, `seek`/`tell`, a context manager) with `.url`, `.key` (the
    key in its bucket on S3; the path elsewhere) and `.size`, as s3torchconnector's readers have.

    Every read is of the version the object had when the item was made: one overwritten meanwhile raises
    ObjectChangedError (an OSError) at the first block not yet read, never a mix of two versions' bytes.
    `getvalue()` returns the whole object (read in parallel, wherever the position is); `read()` the rest.

    An object of at most one block is held whole from the start (fetched in one GET when the item was
    made). A larger one holds the block being read; the blocks after it are fetched ahead (the cache's
    read-ahead window, `readahead_size`), so memory stays bounded however large the object.

    Pickled (an item leaving a DataLoader worker), a small object carries its bytes; a large one carries
    its version and position, and the process that unpickles it reads it through its own pffs filesystem
    (the blocks already read come from the disk cache). Not for several threads at once.
    """

    def __init__(
        self,
        info: ObjectInfo,
        url: str,
        key: str,
        *,
        whole: bytes | None = None,
        handle: OpenObject | None = None,
        filesystem: PerProcessFilesystem | None = None,
        position: int = 0,
    ) -> None:
        super().__init__()
        self.url = url
        self.key = key
        self.info = info
        self._filesystem = filesystem
        self._handle = handle
        self._position = position
        # The bytes [_start, _start + len(_buffer)) of the object: the whole object, or the block being read.
        self._start = 0
        self._buffer = memoryview(b"")
        self._whole = whole
        if whole is not None:
            self._buffer = memoryview(whole)
            if handle is not None:
                handle.close()
                self._handle = None

    @property
    def size(self) -> int:
        return self.info.size

    def __repr__(self) -> str:
        return f"PffsObject({self.url!r}, {self.size} bytes)"

    # -- io.BufferedIOBase --------------------------------------------------------------------------------
    def readable(self) -> bool:
        self._check_open()
        return True

    def seekable(self) -> bool:
        self._check_open()
        return True

    def tell(self) -> int:
        self._check_open()
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self._check_open()
        if whence == io.SEEK_SET:
            position = offset
        elif whence == io.SEEK_CUR:
            position = self._position + offset
        elif whence == io.SEEK_END:
            position = self.size + offset
        else:
            raise ValueError(f"invalid whence ({whence}, should be 0, 1 or 2)")
        if position < 0:
            raise ValueError(f"negative seek position {position}")
        self._position = position
        return position

    def read(self, size: int | None = -1) -> bytes:
        self._check_open()
        wanted = self.size - self._position if size is None or size < 0 else size
        if self._whole is not None and self._position == 0 and wanted >= self.size:
            self._position = self.size
            return self._whole  # the object whole: no copy
        parts = []
        while wanted > 0 and (view := self._view()) is not None:
            part = view[:wanted]
            parts.append(part)
            self._position += len(part)
            wanted -= len(part)
        return bytes(parts[0]) if len(parts) == 1 else b"".join(parts)

    def read1(self, size: int = -1) -> bytes:
        """At most `size` bytes (any number if negative) from the block the position is in."""
        self._check_open()
        view = self._view()
        if view is None:
            return b""
        part = view if size < 0 else view[:size]
        self._position += len(part)
        return bytes(part)

    def readinto(self, buffer: Any) -> int:
        self._check_open()
        target = memoryview(buffer).cast("B")
        filled = 0
        while filled < len(target) and (view := self._view()) is not None:
            count = min(len(view), len(target) - filled)
            target[filled : filled + count] = view[:count]
            filled += count
            self._position += count
        return filled

    def readinto1(self, buffer: Any) -> int:
        self._check_open()
        target = memoryview(buffer).cast("B")
        view = self._view()
        if view is None or not len(target):
            return 0
        count = min(len(view), len(target))
        target[:count] = view[:count]
        self._position += count
        return count

    def readline(self, size: int | None = -1) -> bytes:
        self._check_open()
        limit = -1 if size is None else size
        parts = []
        while limit != 0 and self._view() is not None:
            begin = self._position - self._start
            end = len(self._buffer) if limit < 0 else min(len(self._buffer), begin + limit)
            newline = _NEWLINE.search(self._buffer, begin, end)
            stop = end if newline is None else newline.end()
            parts.append(self._buffer[begin:stop])
            self._position += stop - begin
            limit = limit if limit < 0 else limit - (stop - begin)
            if newline is not None:
                break
        return bytes(parts[0]) if len(parts) == 1 else b"".join(parts)

    def getvalue(self) -> bytes:
        """The whole object (wherever the position is): the bytes held, or every block read in parallel."""
        self._check_open()
        if self._whole is not None:
            return self._whole
        handle = self._open_handle()
        return handle.reader.read(handle.info, 0, self.size)  # its own read, apart from the stream's

    def getbuffer(self) -> memoryview:
        """The whole object, as a read-only view (as BytesIO's getbuffer, for code that used it)."""
        return memoryview(self.getvalue())

    def close(self) -> None:
        """Drops the blocks held and those fetched ahead that were not read."""
        if self._handle is not None:
            self._handle.close()
            self._handle = None
        self._buffer = memoryview(b"")
        self._whole = None
        super().close()

    # -- pickling: a small object with its bytes, a large one by version and position ----------------------
    def __reduce__(self) -> tuple[Any, ...]:
        self._check_open()
        if self._whole is not None:
            return (_whole_object, (self.info, self.url, self.key, self._whole, self._position))
        return (_streamed_object, (self.info, self.url, self.key, self._filesystem, self._position))

    # -- the blocks ---------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self.closed:
            raise ValueError("I/O operation on closed file")

    def _view(self) -> memoryview | None:
        """The held bytes from the position on (the block the position is in, fetched if it is not held);
        None at or past the end."""
        position = self._position
        if position >= self.size:
            return None
        offset = position - self._start
        if not 0 <= offset < len(self._buffer):
            handle = self._open_handle()
            block_size = handle.reader.block_size
            self._start = position // block_size * block_size
            self._buffer = memoryview(b"")  # the old block is free while the next one comes
            self._buffer = memoryview(handle.read_view(self._start, block_size))
            offset = position - self._start
        return self._buffer[offset:]

    def _open_handle(self) -> OpenObject:
        if self._handle is None:
            if self._filesystem is None:
                raise ValueError(f"{self.url}: this object was made without a way to read it")
            self._handle = self._filesystem.get().vfs.open_version(self.info)
        return self._handle


def _whole_object(info: ObjectInfo, url: str, key: str, data: bytes, position: int) -> PffsObject:
    return PffsObject(info, url, key, whole=data, position=position)


def _streamed_object(
    info: ObjectInfo, url: str, key: str, filesystem: PerProcessFilesystem, position: int
) -> PffsObject:
    return PffsObject(info, url, key, filesystem=filesystem, position=position)


def open_object(filesystem: PerProcessFilesystem, path: str, info: ObjectInfo | None) -> PffsObject:
    """The object at backend path `path`, at the version `info` names (as listed: no HEAD), or at the
    current one if `info` is None or the object changed since. Its first block is fetched now (the whole
    object if it is no larger), so a changed object is seen before any of its bytes are handed out."""
    fs = filesystem.get()
    fresh = False
    if info is not None:
        try:
            return _open_version(filesystem, fs, info)
        except ObjectChangedError:
            log.debug("%s changed since it was listed: reading the current version", path)
            fresh = True  # what the metadata cache holds is the listing's
    for attempt in range(2):
        try:
            return _open_version(filesystem, fs, fs.vfs.stat(path, fresh=fresh or attempt > 0))
        except ObjectChangedError:
            if attempt:
                raise
    raise AssertionError("unreachable")


def _open_version(filesystem: PerProcessFilesystem, fs: PffsFileSystem, info: ObjectInfo) -> PffsObject:
    handle = fs.vfs.open_version(info)
    url, key = fs.vfs.backend.url(info.path), fs.vfs.backend.key_of(info.path)
    try:
        if info.size <= handle.reader.block_size:
            return PffsObject(info, url, key, whole=handle.read(0, info.size), handle=handle)
        obj = PffsObject(info, url, key, handle=handle, filesystem=filesystem)
        obj._view()  # the first block, and read-ahead started
        return obj
    except BaseException:
        handle.close()
        raise


@dataclass(frozen=True, slots=True)
class Entry:
    """One object of a dataset: its backend path, and what the listing said of it (None for given URLs)."""

    path: str
    info: ObjectInfo | None = None


class ObjectSource:
    """The objects under a prefix (one LIST, here and now), or those of a list of URLs (stat'ed when read),
    and the filesystem they are read through. Pickles without the filesystem: each process makes its own."""

    def __init__(self, source: str | Sequence[str], options: dict[str, Any]) -> None:
        if isinstance(source, str):
            scheme, prefix = self._parse(source)
            self._filesystem = PerProcessFilesystem(scheme, options)
            listed = self.filesystem().vfs.find(prefix)
            if not listed:
                raise FileNotFoundError(f"{source}: no objects there (an empty or missing prefix)")
            self.entries = [Entry(info.path, info) for info in sorted(listed, key=lambda i: i.path)]
        else:
            urls = list(source)
            if not urls:
                raise ValueError("no URLs given: pass a prefix URL or a non-empty list of object URLs")
            parsed = [self._parse(url) for url in urls]
            schemes = sorted({scheme for scheme, _ in parsed})
            if len(schemes) > 1:
                raise ValueError(f"URLs of one scheme only, not {' and '.join(schemes)} together")
            self._filesystem = PerProcessFilesystem(schemes[0], options)
            self.entries = [Entry(path) for _, path in parsed]

    @staticmethod
    def _parse(url: object) -> tuple[str, str]:
        """(scheme as written, backend path) of a URL or local path."""
        if not isinstance(url, str):
            raise TypeError(f"a URL must be a string, not {url!r}")
        return parse_url(url)

    def filesystem(self) -> PffsFileSystem:
        """This process's pffs filesystem (a forked worker makes its own, as a spawned one does)."""
        return self._filesystem.get()

    @functools.cached_property
    def fingerprint(self) -> str:
        """A hash of the listing: each object's path and listed size (-1 for given URLs), in order. A state
        saved to resume a dataset carries it, so that one saved over other objects is refused."""
        digest = hashlib.blake2b(digest_size=16)
        for entry in self.entries:
            size = entry.info.size if entry.info is not None else -1
            digest.update(f"{entry.path}\0{size}\n".encode())
        return digest.hexdigest()

    def url(self, entry: Entry) -> str:
        return self.filesystem().vfs.backend.url(entry.path)

    def read(self, entry: Entry) -> PffsObject:
        """The object, streaming from its first block: the version listed (no HEAD per object), or the
        current one if it changed since."""
        return open_object(self._filesystem, entry.path, entry.info)
