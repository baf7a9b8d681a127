"""Byte ranges of an object: how many bytes a set of [start, end) ranges covers, overlaps counted once."""

from __future__ import annotations

from collections.abc import Iterable


def covered_bytes(ranges: Iterable[tuple[int, int]]) -> int:
    """Bytes covered by the [start, end) ranges (start >= 0), each byte once however many ranges hold it."""
    total, reach = 0, 0
    for start, end in sorted(ranges):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total
