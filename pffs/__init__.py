"""pffs: a data-caching filesystem for AI training.

import pffs
with pffs.open("s3://bucket/train/0001.tar", endpoint_url="http://127.0.0.1:8333") as f:
    data = f.read()
"""

from __future__ import annotations

from typing import IO, Any

__version__ = "0.1.0"


def open(url: str, mode: str = "rb", **options: Any) -> IO[Any]:
    """Opens `url` through the pffs cache. See pffs.sdk.helpers.open."""
    from pffs.sdk.helpers import open as sdk_open

    return sdk_open(url, mode, **options)
