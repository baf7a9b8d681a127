"""How a block is laid out on disk, and reading it: the native core's (native/core/src/cache/block_file.rs),
which holds the one implementation of the layout; this module is its Python face.

A header with the payload's length and one checksum per 32 KiB segment, padded with zeros to a multiple of
4 KiB, then the bytes. The padding puts the payload on a page boundary of the file, so a block whose
buffer is page-aligned can be written with O_DIRECT (see block_disk): straight from memory to the disk,
without first being copied into the kernel's page cache, which costs more CPU than the network transfer
that brought the block.

Per-segment checksums let a random read verify just the segments it needs (a 128 KiB pread of a 4 MiB
block reads and hashes 128-160 KiB, not 4 MiB). Reads either bypass the page cache (`direct`: O_DIRECT into
page-aligned buffers; the FUSE mount does, since the kernel already caches what it serves) or go through it
(the SDK: the page cache then keeps the disk tier hot for the next epoch); a range read through the page
cache tells the kernel not to read ahead (it would read up to the disk's read-ahead, 8 MiB here: a 256 KiB
random read took 0.53 ms instead of 0.30). A read opens, reads, verifies and closes in one native call
without the GIL, into a buffer Python allocated (its memory counted as before), and a whole block comes
back as a view of it (no copy).

A block that is truncated, bit-flipped, written by something else or in an older layout fails its check
and is never served.
"""

from __future__ import annotations

import mmap
import threading

from .aligned import ALIGN, aligned_buffer

try:
    from pffs import _core
except ImportError as exc:  # a checkout whose native core was never built (or built for another Python)
    raise ImportError(
        f"pffs's native core (pffs._core) is not built: {exc}. Build it with `make setup` or `pip install .` "
        "(both need Rust's cargo, from rustup, on PATH)"
    ) from exc

# Raised for a block file that is not one of ours, whole: a ValueError.
CorruptBlockError = _core.CorruptBlockError

# A block file's parsed header, as read_block_range returns it (pass it back to skip reading it again).
Header = _core.BlockHeader


def header_size(length: int) -> int:
    """Where the payload starts: the header, padded to a multiple of 4 KiB."""
    return int(_core.block_header_size(length))


def _bytes_view(data: bytes | memoryview) -> memoryview:
    return memoryview(data).cast("B")


def block_header(payload: bytes | memoryview) -> bytes:
    return _core.block_header(_bytes_view(payload))


def pack_block(payload: bytes | memoryview) -> bytes:
    return block_header(payload) + bytes(payload)


def parse_header(header: bytes) -> tuple[int, list[int]]:
    """(payload length, segment digests); CorruptBlockError if the header is not one of ours."""
    return _core.parse_block_header(bytes(header))


def check_segments(digests: list[int], first: int, data: bytes | memoryview) -> None:
    """Checks `data`, which holds whole segments from segment number `first` on."""
    _core.check_block_segments(digests, first, _bytes_view(data))


def check_block(header: bytes, payload: bytes | memoryview) -> None:
    """Raises CorruptBlockError unless `payload` is exactly what `header` describes."""
    length, digests = parse_header(header)
    if len(payload) != length:
        raise CorruptBlockError(f"block truncated: {len(payload)} of {length} bytes")
    check_segments(digests, 0, payload)


def unpack_block(stored: bytes) -> memoryview:
    length = parse_header(stored)[0]  # (a header followed by more is parsed as the header)
    size = header_size(length)
    check_block(stored[:size], memoryview(stored)[size:])
    return memoryview(stored)[size:]


def read_block_file(
    path: str, expected_length: int | None = None, direct: bool = False
) -> bytes | memoryview:
    """The verified payload of a block file (FileNotFoundError if there is none), read in one native call
    without the GIL into a buffer of ours (a view past the header: no copy): a bytes object, or a
    page-aligned buffer with `direct` (O_DIRECT, around the page cache). Its header is read first if the
    length is not given."""
    if expected_length is None:
        expected_length = _core.block_payload_length(path)
    size = header_size(expected_length)
    if not direct:  # into a bytes object not zeroed first, as os.pread's
        return memoryview(_core.read_block_bytes(path, expected_length))[size : size + expected_length]
    # Page-aligned for O_DIRECT, and one page more than the block: a longer file is corrupt too.
    whole = aligned_buffer(size + -(-expected_length // ALIGN) * ALIGN + ALIGN)
    _core.read_block_into(path, whole, expected_length, direct)
    return whole[size : size + expected_length]


def read_block_range(
    path: str, start: int, end: int, header: Header | None = None, direct: bool = False
) -> tuple[bytes, Header]:
    """Bytes [start, end) of a block file's payload, reading and verifying only the segments they lie in
    (into this thread's scratch buffer: no allocation per read), and the file's header (pass it back next
    time to skip reading it: a random read then costs one disk read, not two)."""
    scratch = _scratch(_core.block_range_room(start, end))
    offset, count, header = _core.read_block_range_into(path, start, end, scratch, header, direct)
    return bytes(scratch[offset : offset + count]), header


_local = threading.local()


def _scratch(size: int) -> memoryview:
    """This thread's page-aligned read buffer, at least `size` bytes."""
    buffer: mmap.mmap | None = getattr(_local, "buffer", None)
    if buffer is None or len(buffer) < size:
        buffer = _local.buffer = mmap.mmap(-1, max(1 << 20, -(-size // ALIGN) * ALIGN))
    return memoryview(buffer)


def is_intact(stored: bytes) -> bool:
    try:
        unpack_block(stored)
    except CorruptBlockError:
        return False
    return True
