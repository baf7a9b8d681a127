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
