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
import sqlite3
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import diskcache
from diskcache.core import MODE_BINARY, UNKNOWN

from .block_format import Header, block_header, header_size, read_block_file, read_block_range
from .fork import sqlite_fork_gate


class BlockPayload:
    """What DiskTier hands to diskcache.set: the block's bytes, to be stored with a checksummed header."""

    __slots__ = ("data",)

    def __init__(self, data: bytes | memoryview) -> None:
        self.data = data

    @property
    def length(self) -> int:
        return len(self.data)


class WrittenBlock:
    """A block whose file someone else wrote whole (the native engine: header and payload, in this block's
    layout) under a temporary name beside its place: put_blocks reserves its row and renames it into place,
    or removes it if the block is stored already or gets no room."""

    __slots__ = ("length", "temporary")

    def __init__(self, temporary: str, length: int) -> None:
        self.temporary = temporary
        self.length = length


class BlockDisk(diskcache.Disk):
    def store(self, value: Any, read: bool, key: Any = UNKNOWN) -> tuple[int, int, str | None, Any]:
        if not isinstance(value, BlockPayload):
            return super().store(value, read, key=key)
        filename = block_filename(key)
        temporary, size = self.write_temporary(filename, value.data)
        try:
            os.rename(temporary, os.path.join(self._directory, filename))
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise
        return size, MODE_BINARY, filename, None

    def write_temporary(self, filename: str, data: bytes | memoryview) -> tuple[str, int]:
        """The block (header and payload) in a temporary file next to where `filename` goes: its path and
        size. The caller renames it into place, or removes it."""
        full_path = os.path.join(self._directory, filename)
        temporary = f"{full_path}.{os.getpid()}.{threading.get_ident()}.tmp"
        header = block_header(data)
        payload = memoryview(data).cast("B")
        direct = self.direct_io and _direct_supported and len(payload) >= PAGE and _page_aligned(payload)
        fd = _create(temporary, os.O_DIRECT if direct else 0)
        try:
            if direct:
                direct = self._write_direct(fd, header, payload)
            if not direct:
                _write_all(fd, [memoryview(header), payload], 0)
            os.close(fd)
            fd = -1
        except BaseException:
            if fd >= 0:
                os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise
        return temporary, len(header) + len(payload)

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


def _remove_all(paths: list[str]) -> None:
    for path in paths:
        with contextlib.suppress(OSError):
            os.unlink(path)


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


# A reserved row's access time: RESERVED + when it was reserved. Least-recently-used eviction takes rows in
# access-time order, so reservations come last, and one older than STALE_RESERVATION_S is a dead writer's.
RESERVED = 1e12
STALE_RESERVATION_S = 600.0


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
    # Share of the file system the store keeps free, whatever its size limit: it evicts to stay there
    # (set by the owner; as Mountpoint keeps 5% and JuiceFS 10% by default).
    free_space_ratio = 0.0

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
            # A full disk (or a locked index) must not cost the block just read: access times are a
            # hint for eviction order, and the next flush carries on.
            with contextlib.suppress(OSError, sqlite3.Error):
                self.flush_touches()
        return data

    def bound(self) -> int:
        """The bytes the store may hold now: its size limit, or less where the file system it lives on
        would otherwise have less than `free_space_ratio` of itself free (filled by others, or small)."""
        limit = int(self.size_limit)
        if self.free_space_ratio <= 0:
            return limit
        try:
            fs = os.statvfs(self.directory)
        except OSError:
            return limit
        room = fs.f_bavail * fs.f_frsize - int(self.free_space_ratio * fs.f_blocks * fs.f_frsize)
        return max(0, min(limit, int(self.volume()) + room))

    def has_block(self, key: str) -> bool:
        return os.path.exists(self.block_path(key))

    def stored_keys(self, prefix: str) -> set[str]:
        """Keys with a row (reserved ones, being written, left out) that start with `prefix`: a range scan
        of the key index, so asking about one object costs no file lookups however many blocks it has."""
        if not prefix:
            raise ValueError("a key prefix is needed")
        upper = prefix[:-1] + chr(ord(prefix[-1]) + 1)
        with sqlite_fork_gate:  # a read: no write lock, as diskcache's own __contains__
            rows = self._sql(
                "SELECT key FROM Cache WHERE key >= ? AND key < ? AND raw = 1 AND access_time < ?",
                (prefix, upper, RESERVED),
            ).fetchall()
        return {key for (key,) in rows}

    def delete_block(self, key: str) -> None:
        """Drops the block: its row (and file), and its file even if it has no row."""
        self.delete(key, retry=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.block_path(key))

    def put_blocks(self, blocks: list[tuple[str, BlockPayload | WrittenBlock]]) -> int:
        """Stores the blocks that are not stored yet, never holding more bytes than the size limit, whatever
        the number of processes writing: room is reserved first (a row of the block's size, evicting the
        least recently used blocks, their files removed in the same transaction), then the file is written
        under a temporary name, then renamed into place if its row is still there. A block that cannot get
        room (the limit is smaller than the blocks being written at once) is not kept. Returns the number
        of blocks evicted."""
        now = time.time()
        # One entry per key: a block queued twice (fetched twice) would be written twice to one temporary
        # file, and the second rename would fail (ENOENT), which turned the disk tier off for a minute.
        unique = {key: payload for key, payload in reversed(blocks)}
        wanted = [(key, unique.pop(key), block_filename(key)) for key, _ in blocks if key in unique]
        # Files written by someone else that will not be published: the duplicates dropped above, and
        # below those not reserved (stored already, no room) or left by a failure.
        kept = {id(payload) for _, payload, _ in wanted}
        unused = [p.temporary for _, p in blocks if isinstance(p, WrittenBlock) and id(p) not in kept]
        try:
            evicted, reserved = self._reserve(wanted, now)
        except BaseException:
            unused += [p.temporary for _, p, _ in wanted if isinstance(p, WrittenBlock)]
            _remove_all(unused)
            raise
        written: list[tuple[str, str, str]] = []  # key, filename, temporary path
        try:
            for key, payload, filename in wanted:
                if key not in reserved:
                    if isinstance(payload, WrittenBlock):
                        unused.append(payload.temporary)
                elif isinstance(payload, WrittenBlock):
                    written.append((key, filename, payload.temporary))
                else:
                    temporary, _ = self._disk.write_temporary(filename, payload.data)
                    written.append((key, filename, temporary))
            self._publish(written)
        except BaseException:
            unused += [temporary for _, _, temporary in written]
            unused += [p.temporary for k, p, _ in wanted if isinstance(p, WrittenBlock) and k in reserved]
            with contextlib.suppress(Exception):
                self._release(list(reserved))
            raise
        finally:
            _remove_all(unused)
        return evicted

    def _reserve(
        self, wanted: list[tuple[str, BlockPayload | WrittenBlock, str]], now: float
    ) -> tuple[int, set[str]]:
        """Rows for the blocks not stored yet, marked reserved (access time RESERVED + now), and room for
        them; returns (blocks evicted, keys reserved)."""
        reserved: set[str] = set()
        with self._transact(retry=True) as (sql, _):
            bound = self.bound()  # before the reservations: the disk holds what the index counts now
            for key, payload, filename in wanted:
                db_key, raw = self._disk.put(key)
                found = sql(
                    "SELECT rowid, access_time FROM Cache WHERE key = ? AND raw = ?", (db_key, raw)
                ).fetchall()
                if found:
                    rowid, access_time = found[0]
                    if access_time >= RESERVED + now - STALE_RESERVATION_S:
                        continue  # being written by another process: the same bytes
                    if access_time < RESERVED and os.path.exists(os.path.join(self.directory, filename)):
                        continue  # stored
                    sql("DELETE FROM Cache WHERE rowid = ?", (rowid,))  # a dead writer's, or its file lost
                size = header_size(payload.length) + payload.length
                sql(
                    "INSERT INTO Cache(key, raw, store_time, expire_time, access_time, access_count, tag, "
                    "size, mode, filename, value) VALUES (?, ?, ?, NULL, ?, 0, NULL, ?, ?, ?, NULL)",
                    (db_key, raw, now, RESERVED + now, size, MODE_BINARY, filename),
                )
                reserved.add(key)
            evicted = self._make_room(sql, now, bound)
            # Still over (blocks reserved at once outgrow the limit): the last of ours go unkept.
            for key, _, _ in reversed(wanted):
                if self.volume() <= bound or not reserved:
                    break
                if key in reserved:
                    db_key, raw = self._disk.put(key)
                    sql("DELETE FROM Cache WHERE key = ? AND raw = ?", (db_key, raw))
                    reserved.discard(key)
        return evicted, reserved

    def _make_room(self, sql: Any, now: float, bound: int) -> int:
        """Evicts least recently used blocks until the store holds at most `bound` bytes, removing their
        files before the transaction ends (so no file outlives the row that counts it); then reservations
        left by a process that died while writing (older than STALE_RESERVATION_S)."""
        self._flush_touches_in(sql)
        evicted = 0
        for limit in (RESERVED, RESERVED + now - STALE_RESERVATION_S):
            while self.volume() > bound:
                rows = sql(
                    "SELECT rowid, filename FROM Cache WHERE access_time < ? ORDER BY access_time LIMIT 16",
                    (limit,),
                ).fetchall()
                if not rows:
                    break
                for rowid, filename in rows:
                    sql("DELETE FROM Cache WHERE rowid = ?", (rowid,))
                    if filename:
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(os.path.join(self.directory, filename))
                    evicted += 1
        return evicted

    def _publish(self, written: list[tuple[str, str, str]]) -> None:
        """Renames each written block into place while its reservation stands (under the write lock, so no
        eviction runs between the check and the rename), and marks it used now."""
        if not written:
            return
        now = time.time()
        with self._transact(retry=True) as (sql, _):
            for key, filename, temporary in written:
                db_key, raw = self._disk.put(key)
                if sql("SELECT 1 FROM Cache WHERE key = ? AND raw = ?", (db_key, raw)).fetchall():
                    os.rename(temporary, os.path.join(self.directory, filename))
                    sql("UPDATE Cache SET access_time = ? WHERE key = ? AND raw = ?", (now, db_key, raw))
                else:  # evicted meanwhile (cleared, or a stale reservation): not kept
                    os.unlink(temporary)

    def _release(self, keys: list[str]) -> None:
        with self._transact(retry=True) as (sql, _):
            for key in keys:
                db_key, raw = self._disk.put(key)
                sql(
                    "DELETE FROM Cache WHERE key = ? AND raw = ? AND access_time >= ?",
                    (db_key, raw, RESERVED),
                )

    def flush_touches(self) -> None:
        if not self._touched:
            self._next_touch_flush = time.monotonic() + self.TOUCH_FLUSH_S
            return
        with self._transact(retry=True) as (sql, _):
            self._flush_touches_in(sql)

    def _flush_touches_in(self, sql: Any) -> None:
        touched, self._touched = self._touched, {}
        self._next_touch_flush = time.monotonic() + self.TOUCH_FLUSH_S
        for key, when in touched.items():
            db_key, raw = self._disk.put(key)
            sql(
                "UPDATE Cache SET access_time = ? WHERE key = ? AND raw = ? AND access_time < ?",
                (when, db_key, raw, RESERVED),  # a reservation stays one until its file is in place
            )

    def cull(self, retry: bool = False) -> int:
        """Evicts down to the bound in force (see bound); returns the number of blocks evicted."""
        with self._transact(retry=True) as (sql, _):
            return self._make_room(sql, time.time(), self.bound())
