"""`pffs.open(url)`: one line from a URL to a file read through the cache."""

from __future__ import annotations

from typing import IO, Any

import fsspec

from pffs.backends.urls import split_url


def open(url: str, mode: str = "rb", **options: Any) -> IO[Any]:
    """Opens `url` (s3://..., a path, memory://..., hdfs://...) through pffs.

    Options are pffs cache settings (cache_dir, cache_size, block_size, ...) and backend options
    (endpoint_url, region, anonymous, ...), e.g. `pffs.open("s3://bkt/x.bin", endpoint_url="http://...")`;
    or, as `fsspec.open` takes them, per layer: `pffs.open(url, s3={...}, pffs={...})`.
    """
    protocol, path = split_url(url)
    for layer in {"pffs", protocol, url.split("://", 1)[0].lower()}:  # s3a:// options come as s3a={...}
        nested = options.pop(layer, None)
        if isinstance(nested, dict):
            options = {**nested, **options}
    fs = fsspec.filesystem("pffs", target_protocol=protocol, **options)
    return fs.open(path if protocol == "file" else path.strip("/"), mode)
