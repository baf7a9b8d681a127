"""How a block is laid out on disk: a small header with its length and checksum, then the bytes.

A block that is truncated, bit-flipped or written by something else fails `unpack_block` and is never served.
"""

from __future__ import annotations

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


def unpack_block(stored: bytes) -> memoryview:
    if len(stored) < HEADER.size:
        raise CorruptBlockError(f"block shorter than its header ({len(stored)} bytes)")
    magic, length, digest = HEADER.unpack_from(stored)
    if magic != MAGIC:
        raise CorruptBlockError("bad block header")
    payload = memoryview(stored)[HEADER.size :]
    if len(payload) != length:
        raise CorruptBlockError(f"block truncated: {len(payload)} of {length} bytes")
    if xxhash.xxh3_64_intdigest(payload) != digest:
        raise CorruptBlockError("block checksum mismatch")
    return payload


def is_intact(stored: bytes) -> bool:
    try:
        unpack_block(stored)
    except CorruptBlockError:
        return False
    return True
