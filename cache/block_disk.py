"""The disk tier's files and index: diskcache's SQLite index (sizes, access times, least-recently-used
eviction, cross-process transactions) over block files whose names follow from their keys.

Because a block's file name is a hash of its key, a read needs no index lookup: it opens the file (a miss
is ENOENT) and reads header and payload in one pread. The index is written (one transaction per batch of
blocks, by the disk writer) and read only to account and evict. A block file is written under a temporary
name and renamed into place, so a reader finds a whole file or none; the checksums catch anything else.
Two processes writing the same key write the same bytes (keys name a version of an object), so whichever
rename lands last is as good as the first.

In a store set for direct I/O (the FUSE mount's), a payload in a page-aligned buffer (the S3 client reads
blocks into such buffers) is written with O_DIRECT: the disk reads it from our memory, and the kernel does
not first copy it into fresh page-cache pages (that copy cost 2 CPU-seconds per GiB here, twice the network
receive). The block's last partial page is written through the page cache. Where O_DIRECT is refused
(tmpfs, some network file systems), writes are buffered.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import hashlib
import mmap
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import diskcache
from diskcache.core import MODE_BINARY, UNKNOWN

from .block_format import Header, block_header, read_block_file, read_block_range
from .fork import sqlite_fork_gate


class BlockPayload:
    """What DiskTier hands to diskcache.set: the block's bytes, to be stored with a checksummed header."""

    __slots__ = ("data",)

    def __init__(self, data: bytes | memoryview) -> None:
        self.data = data


class BlockDisk(diskcache.Disk):
    def store(self, value: Any, read: bool, key: Any = UNKNOWN) -> tuple[int, int, str | None, Any]:
        if not isinstance(value, BlockPayload):
            return super().store(value, read, key=key)
        filename = block_filename(key)
        full_path = os.path.join(self._directory, filename)
        temporary = f"{full_path}.{os.getpid()}.{threading.get_ident()}.tmp"
        header = block_header(value.data)
        payload = memoryview(value.data).cast("B")
        direct = self.direct_io and _direct_supported and len(payload) >= PAGE and _page_aligned(payload)
        fd = _create(temporary, os.O_DIRECT if direct else 0)
        try:
            if direct:
                direct = self._write_direct(fd, header, payload)
            if not direct:
                _write_all(fd, [memoryview(header), payload], 0)
            os.close(fd)
            fd = -1
            os.rename(temporary, full_path)
        except BaseException:
            if fd >= 0:
                os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise
        return len(header) + len(value.data), MODE_BINARY, filename, None

    direct_io = False  # write with O_DIRECT (from page-aligned buffers); set by the store

    def _write_direct(self, fd: int, header: bytes, payload: memoryview) -> bool:
        """Header and the payload's whole pages with O_DIRECT, the rest buffered. False (nothing written
        that matters: the caller writes everything again, buffered) if O_DIRECT was refused."""
        global _direct_supported
        bulk = len(payload) - len(payload) % PAGE
        aligned_header = _aligned_copy(header)
        try:
            _write_all(fd, [aligned_header, payload[:bulk]], 0)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            _direct_supported = False
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
            os.ftruncate(fd, 0)
            return False
        if bulk < len(payload):
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
            _write_all(fd, [payload[bulk:]], len(header) + bulk)
        return True


PAGE = 4096
_direct_supported = True  # off for good after the first refusal (EINVAL: not supported here)


def _page_aligned(view: memoryview) -> bool:
    if view.readonly:
        return False  # bytes objects: never page-aligned, and ctypes cannot take their address
    return ctypes.addressof(ctypes.c_char.from_buffer(view)) % PAGE == 0


def _aligned_copy(data: bytes) -> memoryview:
    """`data` (a multiple of PAGE long) in a page-aligned buffer: an anonymous mapping is one."""
    buffer = mmap.mmap(-1, len(data))
    buffer.write(data)
    return memoryview(buffer)


def _create(path: str, extra_flags: int) -> int:
    """Creates (or truncates) a file for writing, making its folder if needed. diskcache removes folders
    that an eviction left empty, so a folder made here may vanish before the file is made: try again."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | extra_flags
    for _ in range(5):
        try:
            return os.open(path, flags, 0o644)
        except FileNotFoundError:
            os.makedirs(os.path.dirname(path), exist_ok=True)
    return os.open(path, flags, 0o644)


def _write_all(fd: int, parts: list[memoryview], offset: int) -> None:
    """Writes the parts one after the other from `offset`, however the kernel splits the writes."""
    for part in parts:
        while part:
            written = os.pwrite(fd, part, offset)
            part = part[written:]
            offset += written


def block_filename(key: str) -> str:
    """Where a block lives, relative to the store's directory: one of 4096 folders (a million blocks make
    250 files a folder; two levels would cost a mkdir for almost every block of a new cache)."""
    digest = hashlib.blake2b(key.encode(), digest_size=16).hexdigest()
    return f"{digest[:3]}/{digest}.blk"


class BlockStore(diskcache.Cache):
    """diskcache.Cache whose blocks are read without touching SQLite.

    get_block() opens the block's file by name (see block_filename) and records the access; access times
    are written in one batched UPDATE at most every TOUCH_FLUSH_S seconds (and before every cull), so
    eviction order is least-recently-used to within that interval. A file that has no row (its process
    died between the rename and the commit) is still a correct block; `pffs cache gc` removes such files.
    """

    TOUCH_FLUSH_S = 2.0
    HEADERS_KEPT = 4096  # parsed headers of recently range-read blocks (a block's header never changes)

    @property
    def direct_io(self) -> bool:
        """Write and read block files with O_DIRECT (see block_format)."""
        return bool(self._disk.direct_io)

    @direct_io.setter
    def direct_io(self, value: bool) -> None:
        self._disk.direct_io = value

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._touched: dict[str, float] = {}
        self._headers: OrderedDict[str, Header] = OrderedDict()
        self._next_touch_flush = time.monotonic() + self.TOUCH_FLUSH_S
        super().__init__(*args, **kwargs)

    @contextlib.contextmanager
    def _transact(self, retry: bool = False, filename: str | None = None) -> Iterator[Any]:
        with sqlite_fork_gate, super()._transact(retry, filename) as transaction:
            yield transaction

    def block_path(self, key: str) -> str:
        return os.path.join(self.directory, block_filename(key))

    def get_block(
        self, key: str, start: int = 0, end: int | None = None, length: int | None = None
    ) -> bytes | memoryview | None:
        """The block's verified payload (or bytes [start, end) of it, verifying only the segments read),
        None if absent; CorruptBlockError if its file is damaged."""
        path = self.block_path(key)
        data: bytes | memoryview
        try:
            if end is None:
                data = read_block_file(path, length, self.direct_io)
            else:
                header = self._headers.pop(key, None)
                data, header = read_block_range(path, start, end, header, self.direct_io)
                self._headers[key] = header  # a key names its bytes: the header stays true
                if len(self._headers) > self.HEADERS_KEPT:
                    self._headers.popitem(last=False)
        except FileNotFoundError:
            return None
        self._touched[key] = time.time()
        if time.monotonic() >= self._next_touch_flush:
            self.flush_touches()
        return data

    def has_block(self, key: str) -> bool:
        return os.path.exists(self.block_path(key))

    def delete_block(self, key: str) -> None:
        """Drops the block: its row (and file), and its file even if it has no row."""
        self.delete(key, retry=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.block_path(key))

    def put_blocks(self, blocks: list[tuple[str, BlockPayload]]) -> int:
        """Stores the blocks (replacing any under the same keys): their files first, then one transaction
        for all their rows and the evictions they make necessary, so the SQLite write lock is taken once
        per batch and the store is never over its size limit, even if the process dies next. Returns the
        number of blocks evicted."""
        now = time.time()
        rows = []
        for key, payload in blocks:
            db_key, raw = self._disk.put(key)
            size, mode, filename, value = self._disk.store(payload, False, key=key)
            rows.append((db_key, raw, (None, None, size, mode, filename, value)))
        try:
            with self._transact(retry=True) as (sql, _):
                for db_key, raw, columns in rows:
                    found = sql("SELECT rowid FROM Cache WHERE key = ? AND raw = ?", (db_key, raw)).fetchall()
                    if found:  # the same key: the same file name, just written again
                        self._row_update(found[0][0], now, columns)
                    else:
                        self._row_insert(db_key, raw, now, columns)
                return self.cull(retry=True) if self.volume() > self.size_limit else 0
        except BaseException:
            for _, _, columns in rows:
                self._disk.remove(columns[4])  # no file without a row
            raise

    def flush_touches(self) -> None:
        touched, self._touched = self._touched, {}
        self._next_touch_flush = time.monotonic() + self.TOUCH_FLUSH_S
        if not touched:
            return
        with self._transact(retry=True) as (sql, _):
            for key, when in touched.items():
                db_key, raw = self._disk.put(key)
                sql("UPDATE Cache SET access_time = ? WHERE key = ? AND raw = ?", (when, db_key, raw))

    def cull(self, retry: bool = False) -> int:
        self.flush_touches()
        return int(super().cull(retry=retry))
