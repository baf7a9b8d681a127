"""How a block is laid out on disk: a header with its length and one checksum per 32 KiB segment, padded
with zeros to a multiple of 4 KiB, then the bytes.

The padding puts the payload on a page boundary of the file, so a block whose buffer is page-aligned can be
written with O_DIRECT (see block_disk): straight from memory to the disk, without first being copied into
the kernel's page cache, which costs more CPU than the network transfer that brought the block.

Per-segment checksums let a random read verify just the segments it needs (a 128 KiB pread of a 4 MiB
block reads and hashes 128-160 KiB, not 4 MiB). Reads either bypass the page cache (`direct`: O_DIRECT into
page-aligned buffers; the FUSE mount does, since the kernel already caches what it serves) or go through it
(the SDK: the page cache then keeps the disk tier hot for the next epoch); a range read through the page
cache tells the kernel not to read ahead (it would read up to the disk's read-ahead, 8 MiB here: a 256 KiB
random read took 0.53 ms instead of 0.30).

A block that is truncated, bit-flipped, written by something else or in an older layout fails its check
and is never served.
"""

from __future__ import annotations

import errno
import mmap
import os
import struct
import threading

from .aligned import aligned_buffer

try:
    from pffs import _core
except ImportError as exc:  # a checkout whose native core was never built (or built for another Python)
    raise ImportError(
        f"pffs's native core (pffs._core) is not built: {exc}. Build it with `make setup` or `pip install .` "
        "(both need Rust's cargo, from rustup, on PATH)"
    ) from exc

MAGIC = b"PFB3"
FIXED = struct.Struct("<4sQI")  # magic, payload length, segment count
DIGEST = struct.Struct("<Q")  # xxh3-64 of one segment (pffs._core: native, the GIL released)
SEGMENT = 32 << 10
HEADER_ALIGN = 4096
FIRST_READ = 8192  # one pread gets the header of any block up to 32 MiB


class CorruptBlockError(ValueError):
    pass


def _segments(length: int) -> int:
    return -(-length // SEGMENT)


def header_size(length: int) -> int:
    """Where the payload starts: the header, padded to a multiple of HEADER_ALIGN."""
    return -(-(FIXED.size + DIGEST.size * _segments(length)) // HEADER_ALIGN) * HEADER_ALIGN


def block_header(payload: bytes | memoryview) -> bytes:
    view = memoryview(payload).cast("B")
    count = _segments(len(view))
    digests = _core.xxh3_64_segments(view, SEGMENT)
    header = FIXED.pack(MAGIC, len(view), count) + struct.pack(f"<{count}Q", *digests)
    return header.ljust(header_size(len(view)), b"\0")


def pack_block(payload: bytes | memoryview) -> bytes:
    return block_header(payload) + bytes(payload)


def parse_header(header: bytes) -> tuple[int, list[int]]:
    """(payload length, segment digests); CorruptBlockError if the header is not one of ours."""
    if len(header) < FIXED.size:
        raise CorruptBlockError(f"block shorter than its header ({len(header)} bytes)")
    magic, length, count = FIXED.unpack_from(header)
    if magic != MAGIC or count != _segments(length):
        raise CorruptBlockError("bad block header")
    if len(header) < header_size(length):
        raise CorruptBlockError("block header truncated")
    return length, list(struct.unpack_from(f"<{count}Q", header, FIXED.size))


def check_segments(digests: list[int], first: int, data: bytes | memoryview) -> None:
    """Checks `data`, which holds whole segments from segment number `first` on."""
    view = memoryview(data).cast("B")
    got = _core.xxh3_64_segments(view, SEGMENT)
    if got != digests[first : first + len(got)]:
        raise CorruptBlockError("block checksum mismatch")


def check_block(header: bytes, payload: bytes | memoryview) -> None:
    """Raises CorruptBlockError unless `payload` is exactly what `header` describes."""
    length, digests = parse_header(header)
    if len(payload) != length:
        raise CorruptBlockError(f"block truncated: {len(payload)} of {length} bytes")
    check_segments(digests, 0, payload)


def unpack_block(stored: bytes) -> memoryview:
    length = parse_header(stored[:FIRST_READ])[0] if len(stored) >= FIXED.size else 0
    size = header_size(length)
    check_block(stored[:size], memoryview(stored)[size:])
    return memoryview(stored)[size:]


def _read_header(fd: int) -> tuple[int, list[int], int]:
    """Works on a file opened with O_DIRECT too: reads whole pages into an aligned buffer."""
    head = _pread_aligned(fd, FIRST_READ)
    length = FIXED.unpack_from(head)[1] if len(head) >= FIXED.size else 0
    size = header_size(length)
    if size > len(head) and len(head) == FIRST_READ:
        head = _pread_aligned(fd, size)
    length, digests = parse_header(head[:size])
    return length, digests, size


def _pread_aligned(fd: int, size: int) -> bytes:
    """The first `size` bytes of the file (fewer if it is shorter); `size` a multiple of ALIGN."""
    buffer = _scratch(size)[:size]
    return bytes(buffer[: os.preadv(fd, [buffer], 0)])


def read_block_file(
    path: str, expected_length: int | None = None, direct: bool = False
) -> bytes | memoryview:
    """The verified payload of a block file. With its expected length, header and payload come in one
    pread (a view past the header: no copy); else the header first, then the payload into its own bytes."""
    payload: bytes | memoryview
    direct = direct and expected_length is not None
    fd = _open_for_read(path, direct)
    whole: bytes | memoryview
    try:
        if expected_length is not None:
            size = header_size(expected_length)
            if direct:  # into a page-aligned buffer; one page more: a longer file is corrupt too
                whole = aligned_buffer(size + -(-expected_length // ALIGN) * ALIGN + ALIGN)
                whole = whole[: os.preadv(fd, [whole], 0)]
            else:  # one byte more: a longer file is corrupt too
                whole = os.pread(fd, size + expected_length + 1, 0)
        else:
            length, digests, size = _read_header(fd)
            payload = os.pread(fd, length + 1, size)
    finally:
        os.close(fd)
    if expected_length is not None:
        length, digests = parse_header(bytes(whole[:size]))
        if length != expected_length:
            raise CorruptBlockError(f"block of {length} bytes where {expected_length} were expected")
        payload = memoryview(whole)[size:]
    if len(payload) != length:
        raise CorruptBlockError(f"block truncated or too long: {len(payload)} bytes, header says {length}")
    check_segments(digests, 0, payload)
    return payload


Header = tuple[int, list[int], int]  # payload length, segment digests, payload offset


def read_block_range(
    path: str, start: int, end: int, header: Header | None = None, direct: bool = False
) -> tuple[bytes, Header]:
    """Bytes [start, end) of a block file's payload, reading and verifying only the segments they lie in,
    and the file's header (pass it back next time to skip reading it: a random read then costs one disk
    read, not two)."""
    fd = _open_for_read(path, direct, random=True)
    try:
        length, digests, size = header = header or _read_header(fd)
        end = min(end, length)
        if start >= end:
            return b"", header
        first, last = start // SEGMENT, (end - 1) // SEGMENT
        want = min(length, (last + 1) * SEGMENT) - first * SEGMENT
        data = _scratch(want)
        got = os.preadv(fd, [data[: -(-want // ALIGN) * ALIGN]], size + first * SEGMENT)
    finally:
        os.close(fd)
    if got < want:
        raise CorruptBlockError(f"block truncated: {got} of {want} bytes")
    check_segments(digests, first, data[:want])
    offset = start - first * SEGMENT
    return bytes(data[offset : offset + end - start]), header


ALIGN = 4096
_local = threading.local()


def _scratch(size: int) -> memoryview:
    """This thread's page-aligned read buffer, at least `size` bytes rounded up to a page."""
    buffer: mmap.mmap | None = getattr(_local, "buffer", None)
    if buffer is None or len(buffer) < size + ALIGN:
        buffer = _local.buffer = mmap.mmap(-1, max(1 << 20, -(-(size + ALIGN) // ALIGN) * ALIGN))
    return memoryview(buffer)


_direct_supported = True  # off for good once the file system refuses O_DIRECT


def _open_for_read(path: str, direct: bool, random: bool = False) -> int:
    global _direct_supported
    if direct and _direct_supported:
        try:
            return os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECT)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            _direct_supported = False
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    if random:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    return fd


def is_intact(stored: bytes) -> bool:
    try:
        unpack_block(stored)
    except (CorruptBlockError, struct.error):
        return False
    return True
