"""Mount options, typed: one clear message for a bad value. Sent as JSON from `pffs mount` to the mount
process it starts, so they hold no secret (credentials come from the environment or files)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from pffs.backends.options import BackendOptions
from pffs.config import CacheSettings
from pffs.peers.settings import PeerSettings


def _octal(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, str) and re.fullmatch(r"0?o?[0-7]{1,4}", value.strip()):
        number = int(value.strip().removeprefix("0o").removeprefix("o") or "0", 8)
    else:
        raise ValueError(f"not an octal mode: {value!r} (e.g. 644 or 0755)")
    if not 0 <= number <= 0o7777:
        raise ValueError(f"mode out of range: {value!r}")
    return number


Mode = Annotated[int, BeforeValidator(_octal)]


class MountOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    source: str = Field(description="backend URL or local path")
    mountpoint: Path
    cache: CacheSettings = Field(default_factory=CacheSettings)
    backend: BackendOptions = Field(default_factory=BackendOptions)
    attr_ttl: float = Field(1.0, ge=0, le=86400, description="seconds the kernel trusts attributes and names")
    read_only: bool = False
    # The native engine (pffs_core::fuse, issue 44): several threads answer the kernel without Python. So far
    # read-only mounts of S3 over http (pffs.fuse.native_engine, docs/guides/native-engine.md).
    engine: Literal["python", "native"] = Field(
        "python", description="what serves the mount: pffs's Python engine or the native one"
    )
    threads: int = Field(16, ge=1, le=256, description="native engine: threads answering the kernel")
    fixed_modes: bool = Field(
        False,
        description="show --uid/--gid/--file-mode/--dir-mode for everything instead of the attributes "
        "stored with each object (no HEAD per file; chmod and chown refused)",
    )
    allow_other: bool = False
    uid: int | None = Field(None, ge=0, description="owner shown for every file (default: the mounting user)")
    gid: int | None = Field(None, ge=0)
    file_mode: Mode = 0o644
    dir_mode: Mode = 0o755
    metrics_port: int | None = Field(None, ge=1, le=65535)
    metrics_address: str = "127.0.0.1"
    prefetch_dirs: bool = Field(True, description="fetch ahead the small files of a directory being read")
    peers: PeerSettings | None = Field(None, description="the cache group this mount joins (pffs.peers)")
    log_file: Path | None = None
    verbose: int = Field(0, ge=0, le=2)

    @model_validator(mode="after")
    def _engine_serves_it(self) -> MountOptions:
        if self.engine == "native" and not self.read_only:
            raise ValueError(
                "--engine native serves read-only mounts only so far: add --read-only (or mount with "
                "--engine python, the default)"
            )
        return self
