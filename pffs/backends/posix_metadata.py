"""POSIX attributes stored as S3 user metadata, spelled exactly as s3fs-fuse spells them, so a bucket written
by either is read by the other: `mode` (the whole st_mode, decimal), `uid`, `gid`, `rdev`, and `mtime`,
`ctime`, `atime` as seconds since the epoch, with ".nnnnnnnnn" nanoseconds when there are any
("1614834367" or "1614834367.123456789"; checked against a real s3fs-fuse 1.90 mount).

A symlink is an object whose bytes are its target and whose mode says S_IFLNK; a FIFO or a device file is
an empty object with its mode (and `rdev`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

NS = 1_000_000_000


@dataclass(frozen=True, slots=True)
class PosixAttributes:
    """What an object's metadata says; None where it says nothing (the mount shows its own default)."""

    mode: int | None = None  # st_mode, file type bits included
    uid: int | None = None
    gid: int | None = None
    rdev: int | None = None
    mtime_ns: int | None = None
    ctime_ns: int | None = None
    atime_ns: int | None = None

    def replace(self, **changes: Any) -> PosixAttributes:
        return dataclasses.replace(self, **changes)

    def to_metadata(self) -> dict[str, str]:
        """The S3 user metadata (without the x-amz-meta- prefix) that stores these attributes."""
        out: dict[str, str] = {}
        for name, field, write, _ in METADATA_FIELDS:
            value = getattr(self, field)
            if value is not None:
                out[name] = write(value)
        return out

    @classmethod
    def from_metadata(cls, metadata: dict[str, str]) -> PosixAttributes:
        """Reads what any tool wrote; a value that does not parse is ignored (logged), never fatal."""
        lowered = {k.lower(): v for k, v in metadata.items()}
        values: dict[str, int] = {}
        for name, field, _, parse in METADATA_FIELDS:
            raw = lowered.get(name)
            if raw is not None:
                try:
                    values[field] = parse(raw)
                except ValueError:
                    log.debug("ignoring metadata %s=%r", name, raw)
        return cls(**values)


def format_time(ns: int) -> str:
    seconds, rest = divmod(ns, NS)
    return f"{seconds}.{rest:09d}" if rest else str(seconds)


def parse_time(raw: str) -> int:
    """Seconds, with an optional fraction (s3fs-fuse writes 9 digits; other tools fewer) -> nanoseconds."""
    text = raw.strip()
    whole, _, fraction = text.partition(".")
    if not whole.lstrip("-").isdigit() or (fraction and not fraction.isdigit()):
        raise ValueError(raw)
    return int(whole) * NS + int((fraction + "000000000")[:9] or 0)


def parse_int(raw: str) -> int:
    return int(raw.strip())


# Metadata name, PosixAttributes field, how the value is written, how it is read.
METADATA_FIELDS: tuple[tuple[str, str, Callable[[int], str], Callable[[str], int]], ...] = (
    ("mode", "mode", str, parse_int),
    ("uid", "uid", str, parse_int),
    ("gid", "gid", str, parse_int),
    ("rdev", "rdev", str, parse_int),
    ("mtime", "mtime_ns", format_time, parse_time),
    ("ctime", "ctime_ns", format_time, parse_time),
    ("atime", "atime_ns", format_time, parse_time),
)
