"""The objects a dataset reads (a prefix listed once, or a list of URLs) and how one is read: through a
pffs filesystem made once per process, so DataLoader workers, forked or spawned, share the disk cache.
"""

from __future__ import annotations

import functools
import hashlib
import io
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pffs.backends.backend import ObjectInfo
from pffs.backends.errors import ObjectChangedError
from pffs.sdk.filesystem import PffsFileSystem
from pffs.sdk.helpers import filesystem_for, parse_url

log = logging.getLogger(__name__)


class PffsObject(io.BytesIO):
    """One object, read whole through the pffs cache (in the DataLoader worker): a binary file over its
    bytes, with `.url` and `.key` (the key in its bucket on S3; the path elsewhere), as
    s3torchconnector's readers have. `getvalue()` gives the bytes without a copy."""

    def __init__(self, data: bytes, url: str, key: str) -> None:
        super().__init__(data)
        self.url = url
        self.key = key

    def __repr__(self) -> str:
        return f"PffsObject({self.url!r}, {len(self.getbuffer())} bytes)"


@dataclass(frozen=True, slots=True)
class Entry:
    """One object of a dataset: its backend path, and what the listing said of it (None for given URLs)."""

    path: str
    info: ObjectInfo | None = None


class ObjectSource:
    """The objects under a prefix (one LIST, here and now), or those of a list of URLs (stat'ed when read),
    and the filesystem they are read through. Pickles without the filesystem: each process makes its own."""

    def __init__(self, source: str | Sequence[str], options: dict[str, Any]) -> None:
        self._options = dict(options)
        self._fs: PffsFileSystem | None = None
        self._fs_pid = 0
        if isinstance(source, str):
            self._scheme, prefix = self._parse(source)
            listed = self.filesystem().vfs.find(prefix)
            if not listed:
                raise FileNotFoundError(f"{source}: no objects there (an empty or missing prefix)")
            self.entries = [Entry(info.path, info) for info in sorted(listed, key=lambda i: i.path)]
        else:
            urls = list(source)
            if not urls:
                raise ValueError("no URLs given: pass a prefix URL or a non-empty list of object URLs")
            parsed = [self._parse(url) for url in urls]
            schemes = sorted({scheme for scheme, _ in parsed})
            if len(schemes) > 1:
                raise ValueError(f"URLs of one scheme only, not {' and '.join(schemes)} together")
            self._scheme = schemes[0]
            self.entries = [Entry(path) for _, path in parsed]

    @staticmethod
    def _parse(url: object) -> tuple[str, str]:
        """(scheme as written, backend path) of a URL or local path."""
        if not isinstance(url, str):
            raise TypeError(f"a URL must be a string, not {url!r}")
        return parse_url(url)

    def filesystem(self) -> PffsFileSystem:
        """This process's pffs filesystem (a forked worker makes its own, as a spawned one does)."""
        if self._fs is None or self._fs_pid != os.getpid():
            self._fs, _ = filesystem_for(f"{self._scheme}://", **self._options)
            self._fs_pid = os.getpid()
        return self._fs

    @functools.cached_property
    def fingerprint(self) -> str:
        """A hash of the listing: each object's path and listed size (-1 for given URLs), in order. A state
        saved to resume a dataset carries it, so that one saved over other objects is refused."""
        digest = hashlib.blake2b(digest_size=16)
        for entry in self.entries:
            size = entry.info.size if entry.info is not None else -1
            digest.update(f"{entry.path}\0{size}\n".encode())
        return digest.hexdigest()

    def url(self, entry: Entry) -> str:
        return self.filesystem().vfs.backend.url(entry.path)

    def read(self, entry: Entry) -> PffsObject:
        """The whole object: the version listed (no HEAD per object), or the current one if it changed."""
        fs = self.filesystem()
        data = None
        if entry.info is not None:
            handle = fs.vfs.open_version(entry.info)
            try:
                data = handle.read(0, entry.info.size)
            except ObjectChangedError:
                log.debug("%s changed since it was listed: reading the current version", entry.path)
            finally:
                handle.close()
        if data is None:
            data = fs.vfs.read(entry.path)
        return PffsObject(data, fs.vfs.backend.url(entry.path), fs.vfs.backend.key_of(entry.path))

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fs": None, "_fs_pid": 0}
