"""`torch.save` and `torch.load` through pffs.

A checkpoint is written to local disk, each part uploaded as soon as it is written (an S3 multipart
upload: the upload runs while torch.save writes), and put in place in one step once torch.save has
returned and every part is in (pffs.torch.uploads). So a save that fails (an object that does not pickle,
a full disk, a lost connection, a killed process) leaves the checkpoint already there whole. A load
stats the object again before reading: another writer's newer checkpoint is read, never an older one that
pffs still knew of (its blocks stay cached, keyed by their version).
"""

from __future__ import annotations

from typing import Any

import torch

from pffs.sdk.helpers import filesystem_for
from pffs.torch.uploads import uploading


def save(obj: Any, url: str, **options: Any) -> None:
    """`torch.save(obj)` to `url` (s3://..., pffs::s3://..., a path); options as `pffs.open` takes them."""
    fs, path = filesystem_for(url, **options)
    with uploading(fs, path, prefix="checkpoint") as f:
        torch.save(obj, f)


def load(url: str, *, map_location: Any = None, weights_only: bool | None = None, **options: Any) -> Any:
    """`torch.load` of the checkpoint now at `url`. weights_only: torch's default unless given."""
    fs, path = filesystem_for(url, **options)
    fs.invalidate_cache(path)  # another writer may have replaced it since pffs last looked
    kwargs = {} if weights_only is None else {"weights_only": weights_only}
    with fs.open(path, "rb") as f:
        return torch.load(f, map_location=map_location, **kwargs)
