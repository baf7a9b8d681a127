"""Helpers shared by the tests: reference bytes, hashes, a pffs filesystem on a test cache."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import fsspec
import numpy as np


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def pattern(size: int, seed: int = 0) -> bytes:
    """Deterministic bytes where every 8-byte word differs, so a misplaced block cannot match by chance."""
    words = (size + 7) // 8
    data = (np.arange(words, dtype=np.uint64) * np.uint64(2654435761) + np.uint64(seed * 97 + 1)).tobytes()
    return data[:size]


def pffs_fs(target: str, cache_dir: Path, **options: Any) -> Any:
    options.setdefault("block_size", "256K")
    return fsspec.filesystem(
        "pffs", target=target, cache_dir=str(cache_dir), skip_instance_cache=True, **options
    )


def server_options(server: Any) -> dict[str, Any]:
    """pffs keyword arguments that reach a SeaweedS3 server."""
    return {"endpoint_url": server.endpoint_url, "key": server.access_key, "secret": server.secret_key}
