"""`pffs.open(url)`: one line from a URL to a file read through the cache."""

from __future__ import annotations

from typing import IO, TYPE_CHECKING, Any

import fsspec

from pffs.backends.urls import split_url

if TYPE_CHECKING:
    from pffs.sdk.filesystem import PffsFileSystem


def open(url: str, mode: str = "rb", **options: Any) -> IO[Any]:
    """Opens `url` (s3://..., a path, memory://..., hdfs://...) through pffs.

    Options are pffs cache settings (cache_dir, cache_size, block_size, ...) and backend options
    (endpoint_url, region, anonymous, ...), e.g. `pffs.open("s3://bkt/x.bin", endpoint_url="http://...")`;
    or, as `fsspec.open` takes them, per layer: `pffs.open(url, s3={...}, pffs={...})`.
    """
    fs, path = filesystem_for(url, **options)
    return fs.open(path, mode)


def filesystem_for(url: str, **options: Any) -> tuple[PffsFileSystem, str]:
    """The pffs filesystem (one per process for the same options) that reads `url`, and the path to give it.

    `url` is a backend URL or path, or the same chained behind pffs (`pffs::s3://bucket/key`); options are
    flat or per layer (`s3={...}, pffs={...}`), as `open` takes them.
    """
    scheme, path = parse_url(url)
    protocol = split_url(f"{scheme}://")[0]
    for layer in {"pffs", protocol, scheme}:  # s3a:// options come as s3a={...}
        nested = options.pop(layer, None)
        if isinstance(nested, dict):
            options = {**nested, **options}
    fs = fsspec.filesystem("pffs", target_protocol=protocol, **options)
    return fs, path


def parse_url(url: str) -> tuple[str, str]:
    """(the scheme as written, "file" for a path; the path the backend takes) of a backend URL, a local path,
    or either chained behind pffs (`pffs::s3://bucket/key`)."""
    url = url.removeprefix("pffs::")
    if url.lower().startswith("pffs://"):
        raise ValueError(f"{url}: name the backend, e.g. pffs::s3://bucket/key or s3://bucket/key")
    protocol, path = split_url(url)
    scheme = url.split("://", 1)[0].lower() if "://" in url else "file"
    return scheme, path if protocol == "file" else path.strip("/")
