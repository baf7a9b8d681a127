"""Typed settings shared by the SDK, the CLI and (later) the mount: sizes, TTLs, where the cache lives."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator

from pffs.backends.errors import BadOptionError

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)


def parse_size(value: str | int | float) -> int:
    """'10G', '512M', '4MiB', '1.5G' or a byte count → bytes (binary units: 1K = 1024)."""
    if isinstance(value, bool):
        raise BadOptionError(f"not a size: {value!r}")
    if isinstance(value, int | float):
        if value < 0:
            raise BadOptionError(f"a size cannot be negative: {value!r}")
        return int(value)
    match = _SIZE.match(str(value))
    if not match:
        raise BadOptionError(
            f"not a size: {value!r} (use a byte count or a number with K, M, G or T, e.g. 512M)"
        )
    number, unit = match.groups()
    return int(float(number) * _UNITS[unit.upper()])


def format_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _size(value: Any) -> int:
    try:
        return parse_size(value)
    except BadOptionError as exc:
        raise ValueError(str(exc)) from None


Size = Annotated[int, BeforeValidator(_size)]


def default_cache_dir() -> Path:
    if env := os.environ.get("PFFS_CACHE_DIR"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(base) / "pffs"


class CacheSettings(BaseModel):
    """How reads are cached. Every process using the same cache_dir shares its disk tier."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    cache_dir: Path = Field(default_factory=default_cache_dir)
    cache_size: Size = Field(10 << 30, description="disk tier bound, bytes")
    memory_cache_size: Size = Field(512 << 20, description="memory tier bound per process, bytes")
    # As Mountpoint (5%) and JuiceFS (10%) do: the disk tier never fills its file system past this share,
    # whatever cache_size says, and evicts to stay there when others fill it.
    cache_free_space: float = Field(
        0.05, ge=0, lt=1, description="share of the cache's file system left free (0.05 or 5%)"
    )
    block_size: Size = Field(4 << 20, description="cache block size, bytes")
    metadata_ttl: float = Field(60.0, ge=0, description="seconds a stat or listing is trusted")
    # Stale-if-error (as HTTP caches, RFC 5861): while the backend cannot be reached, a stat or listing past
    # its TTL is served as last seen for this much longer, so cached data reads through an outage. 24 h: the
    # longest S3 regional outages on record lasted hours (us-east-1: ~4 h in 2017, ~7 h in 2021), and a day
    # covers a training run; past it, what was last seen is too old to stand for the store. 0: errors.
    stale_if_error: float = Field(
        86400.0,
        ge=0,
        description="seconds past its TTL a stat or listing is still served while the backend cannot be "
        "reached (0: never)",
    )
    readahead_size: Size = Field(64 << 20, description="bytes of read-ahead in flight per process")
    fetch_workers: int = Field(16, ge=1, le=256, description="parallel block fetches per process")
    # The FUSE mount sets this: the kernel caches the files it serves, so caching its disk tier's files too
    # would hold every byte twice (and copying blocks into the page cache costs more CPU here than the
    # network transfer). The SDK goes through the page cache, which keeps the disk tier hot.
    direct_io: bool = Field(False, description="write and read the disk tier with O_DIRECT")

    @field_validator("cache_free_space", mode="before")
    @classmethod
    def _percent(cls, value: object) -> object:
        if isinstance(value, str) and value.strip().endswith("%"):
            try:
                return float(value.strip()[:-1]) / 100
            except ValueError:
                raise ValueError(f"{value!r} is not a share (5% or 0.05)") from None
        return value

    @field_validator("block_size")
    @classmethod
    def _block_size_sane(cls, value: int) -> int:
        if not 64 << 10 <= value <= 256 << 20:
            raise ValueError("block_size must be between 64K and 256M")
        return value


def settings_error(exc: Exception) -> str:
    """One readable line from a pydantic ValidationError (or any error)."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        parts = []
        for err in errors():
            where = ".".join(str(p) for p in err.get("loc", ())) or "value"
            message = str(err.get("msg", "")).removeprefix("Value error, ")
            parts.append(f"{where}: {message}")
        return "; ".join(parts)
    return str(exc)
