"""How a block is laid out on disk: a small header with its length and checksum, then the bytes.

A block that is truncated, bit-flipped or written by something else fails `check_block` and is never served.
"""

from __future__ import annotations

import os
import struct

import xxhash

MAGIC = b"PFB1"
HEADER = struct.Struct("<4sQQ")  # magic, payload length, xxh3-64 of the payload


class CorruptBlockError(ValueError):
    pass


def block_header(payload: bytes | memoryview) -> bytes:
    return HEADER.pack(MAGIC, len(payload), xxhash.xxh3_64_intdigest(payload))


def pack_block(payload: bytes | memoryview) -> bytes:
    return block_header(payload) + payload


def check_block(header: bytes, payload: bytes | memoryview) -> None:
    """Raises CorruptBlockError unless `payload` is exactly what `header` describes."""
    if len(header) < HEADER.size:
        raise CorruptBlockError(f"block shorter than its header ({len(header)} bytes)")
    magic, length, digest = HEADER.unpack_from(header)
    if magic != MAGIC:
        raise CorruptBlockError("bad block header")
    if len(payload) != length:
        raise CorruptBlockError(f"block truncated: {len(payload)} of {length} bytes")
    if xxhash.xxh3_64_intdigest(payload) != digest:
        raise CorruptBlockError("block checksum mismatch")


def unpack_block(stored: bytes) -> memoryview:
    check_block(stored[: HEADER.size], memoryview(stored)[HEADER.size :])
    return memoryview(stored)[HEADER.size :]


def read_block_file(path: str) -> bytes:
    """The verified payload of a block file, read straight into its own bytes object (no slicing copy)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        header = os.pread(fd, HEADER.size, 0)
        length = HEADER.unpack_from(header)[1] if len(header) == HEADER.size else 0
        payload = os.pread(fd, length + 1, HEADER.size)  # one byte more: a longer file is corrupt too
    finally:
        os.close(fd)
    check_block(header, payload)
    return payload


def is_intact(stored: bytes) -> bool:
    try:
        unpack_block(stored)
    except CorruptBlockError:
        return False
    return True
