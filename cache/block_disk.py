"""diskcache's Disk, taught to write a block file in place: header and payload go to the file with two
write calls, without first joining them into one buffer and copying that through a BytesIO (which halved
write throughput for 4 MiB blocks). Everything else — names, the SQLite row, reads — is diskcache's own.

A payload in a page-aligned buffer (the S3 client reads blocks into such buffers) is written with O_DIRECT:
the disk reads it from our memory, and the kernel does not first copy it into fresh page-cache pages (that
copy cost 2 CPU-seconds per GiB here, twice the network receive). The block's last partial page is
written through the page cache. Where O_DIRECT is refused (tmpfs, some network file systems), writes are
buffered, as before.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import mmap
import os
import time
from typing import Any

import diskcache
from diskcache.core import MODE_BINARY, UNKNOWN

from .block_format import CorruptBlockError, block_header, read_block_file, read_block_range


class BlockPayload:
    """What DiskTier hands to diskcache.set: the block's bytes, to be stored with a checksummed header."""

    __slots__ = ("data",)

    def __init__(self, data: bytes | memoryview) -> None:
        self.data = data


class BlockDisk(diskcache.Disk):
    def store(self, value: Any, read: bool, key: Any = UNKNOWN) -> tuple[int, int, str | None, Any]:
        if not isinstance(value, BlockPayload):
            return super().store(value, read, key=key)
        filename, full_path = self.filename(key, value)
        os.makedirs(os.path.dirname(full_path), exist_ok=True)
        header = block_header(value.data)
        payload = memoryview(value.data).cast("B")
        direct = self.direct_io and len(payload) >= PAGE and _page_aligned(payload)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        fd = os.open(full_path, flags | (os.O_DIRECT if direct else 0), 0o644)
        try:
            if direct:
                direct = self._write_direct(fd, header, payload)
            if not direct:
                _write_all(fd, [memoryview(header), payload], 0)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(full_path)  # no orphan half-file: diskcache never learned its name
            raise
        os.close(fd)
        return len(header) + len(value.data), MODE_BINARY, filename, None

    # Whether to try O_DIRECT; switched off for good by the first refusal (EINVAL: not supported here).
    direct_io = True

    def _write_direct(self, fd: int, header: bytes, payload: memoryview) -> bool:
        """Header and the payload's whole pages with O_DIRECT, the rest buffered. False (nothing written
        that matters: the caller writes everything again, buffered) if O_DIRECT was refused."""
        bulk = len(payload) - len(payload) % PAGE
        aligned_header = _aligned_copy(header)
        try:
            _write_all(fd, [aligned_header, payload[:bulk]], 0)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            type(self).direct_io = False
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
            os.ftruncate(fd, 0)
            return False
        if bulk < len(payload):
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
            _write_all(fd, [payload[bulk:]], len(header) + bulk)
        return True


PAGE = 4096


def _page_aligned(view: memoryview) -> bool:
    if view.readonly:
        return False  # bytes objects: never page-aligned, and ctypes cannot take their address
    return ctypes.addressof(ctypes.c_char.from_buffer(view)) % PAGE == 0


def _aligned_copy(data: bytes) -> memoryview:
    """`data` (a multiple of PAGE long) in a page-aligned buffer: an anonymous mapping is one."""
    buffer = mmap.mmap(-1, len(data))
    buffer.write(data)
    return memoryview(buffer)


def _write_all(fd: int, parts: list[memoryview], offset: int) -> None:
    """Writes the parts one after the other from `offset`, however the kernel splits the writes."""
    for part in parts:
        while part:
            written = os.pwrite(fd, part, offset)
            part = part[written:]
            offset += written


class BlockStore(diskcache.Cache):
    """diskcache.Cache with a read path that does not take SQLite's write lock.

    With the least-recently-used policy, diskcache's own get() updates the row's access time in a write
    transaction and reads the value file while holding it, so parallel readers (read-ahead threads, other
    processes) queue behind each other: 8 threads read cold blocks at half the speed of one. get_block()
    instead looks the row up without a transaction and records the access; the access times are written
    in one batched UPDATE at most every TOUCH_FLUSH_S seconds (and before every cull), so eviction order
    is least-recently-used to within that interval.
    """

    TOUCH_FLUSH_S = 2.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._touched: dict[int, float] = {}
        self._next_touch_flush = time.monotonic() + self.TOUCH_FLUSH_S
        super().__init__(*args, **kwargs)

    def get_block(self, key: str, start: int = 0, end: int | None = None) -> bytes | None:
        """The block's verified payload (or bytes [start, end) of it, verifying only the segments read),
        None if absent; CorruptBlockError if its file is damaged."""
        db_key, raw = self._disk.put(key)
        select = "SELECT rowid, filename FROM Cache WHERE key = ? AND raw = ?"
        rows = self._sql(select, (db_key, raw)).fetchall()
        if not rows:
            return None
        ((rowid, filename),) = rows
        if filename is None:
            raise CorruptBlockError("block stored without a file")
        path = os.path.join(self.directory, filename)
        try:
            data = read_block_file(path) if end is None else read_block_range(path, start, end)
        except FileNotFoundError:
            return None  # evicted between the lookup and the read
        self._touched[rowid] = time.time()
        if time.monotonic() >= self._next_touch_flush:
            self.flush_touches()
        return data

    def flush_touches(self) -> None:
        touched, self._touched = self._touched, {}
        self._next_touch_flush = time.monotonic() + self.TOUCH_FLUSH_S
        if not touched:
            return
        with self._transact(retry=True) as (sql, _):
            for rowid, when in touched.items():
                sql("UPDATE Cache SET access_time = ? WHERE rowid = ?", (when, rowid))

    def cull(self, retry: bool = False) -> int:
        self.flush_touches()
        return int(super().cull(retry=retry))
