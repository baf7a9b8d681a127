"""Block buffers aligned to the page size, so the disk tier can write and read them with O_DIRECT (no copy
through the kernel's page cache). Fetchers fill them (see ObjectReader.block), the disk tier reads into
them."""

from __future__ import annotations

import numpy as np

ALIGN = 4096


def aligned_buffer(size: int) -> memoryview:
    """A writable, uninitialised buffer of `size` bytes starting on a 4 KiB boundary."""
    raw = np.empty(size + ALIGN, dtype=np.uint8)
    offset = -raw.ctypes.data % ALIGN
    return memoryview(raw[offset : offset + size].data)


def aligned_copy(data: bytes | memoryview) -> memoryview:
    """A copy of `data` in a buffer of its own, starting on a 4 KiB boundary."""
    copy = aligned_buffer(len(data))
    copy[:] = data
    return copy
