"""`torch.save` and `torch.load` through pffs.

A checkpoint is written to local disk first and uploaded in one piece, so a save that fails (an object
that does not pickle, a full disk, a lost connection) leaves the checkpoint already there whole. A load
stats the object again before reading: another writer's newer checkpoint is read, never an older one that
pffs still knew of (its blocks stay cached, keyed by their version).
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

import torch

from pffs.sdk.helpers import filesystem_for


def save(obj: Any, url: str, **options: Any) -> None:
    """`torch.save(obj)` to `url` (s3://..., pffs::s3://..., a path); options as `pffs.open` takes them."""
    fs, path = filesystem_for(url, **options)
    local = fs.vfs.backend.protocol == "file"
    # A local target: beside it, then renamed over it (a rename is atomic where a copy is not); else on the
    # cache's disk, sized for large files.
    staging = Path(path).parent if local else Path(fs.vfs.settings.cache_dir) / "staging"
    staging.mkdir(parents=True, exist_ok=True)
    staged = str(staging / f".checkpoint-{uuid.uuid4().hex}.tmp")
    fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask's mode, as torch.save's
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
        if local:
            os.replace(staged, path)
        else:
            fs.put_file(staged, path)  # given time for its size beyond the backend deadline
        fs.invalidate_cache(path)
    finally:
        if os.path.exists(staged):
            os.unlink(staged)


def load(url: str, *, map_location: Any = None, weights_only: bool | None = None, **options: Any) -> Any:
    """`torch.load` of the checkpoint now at `url`. weights_only: torch's default unless given."""
    fs, path = filesystem_for(url, **options)
    fs.invalidate_cache(path)  # another writer may have replaced it since pffs last looked
    kwargs = {} if weights_only is None else {"weights_only": weights_only}
    with fs.open(path, "rb") as f:
        return torch.load(f, map_location=map_location, **kwargs)
