"""PffsFileSystem: an fsspec filesystem that reads any backend through the pffs cache.

    fs = fsspec.filesystem("pffs", target="s3://bucket/prefix", endpoint_url=...)   # paths relative to prefix
    fsspec.open("pffs::s3://bucket/key", s3={"endpoint_url": ...})                  # chained, full paths

Reads go through the VFS (metadata TTL, block cache, read-ahead); writes, copies and moves go straight to
the backend (a copy made by the store where it can: S3 CopyObject) and invalidate what pffs knew of the
paths they change. Safe in forked workers (PyTorch DataLoader): everything that belongs
to a process — threads, locks, the s3fs event loop — is made again in the child.
"""

from __future__ import annotations

import posixpath
from glob import has_magic
from typing import Any

from fsspec.implementations.chained import ChainedFileSystem
from fsspec.spec import AbstractBufferedFile, _Cached

from pffs.backends.backend import ObjectInfo
from pffs.backends.urls import open_backend, split_url
from pffs.sdk.hugging_face import chained_options_from_datasets, refuse_chained_streaming
from pffs.sdk.options import (
    CACHE_FIELDS,
    backend_options,
    cache_settings,
    check_passed_through,
    own_layer_options,
    peer_settings,
)
from pffs.vfs.vfs import OpenObject, Vfs


def _unwrap_chained(
    target_options: dict[str, Any] | None, target_protocol: str | None
) -> tuple[dict[str, Any] | None, str | None]:
    """The backend's own options. Hugging Face `datasets` passes a chained filesystem's storage options on
    as the next layer's (`pffs::s3://...` becomes `{"target_protocol": "s3", "fo": ..., "target_options":
    {<s3's options>}}` inside target_options): the backend's options are the innermost ones."""
    while target_options and {"target_protocol", "target_options", "fo"} & target_options.keys():
        outer = dict(target_options)
        target_protocol = outer.pop("target_protocol", None) or target_protocol
        outer.pop("fo", None)
        inner = outer.pop("target_options", None) or {}
        target_options = {**outer, **inner}
    return target_options, target_protocol


class _MadeWithOptionsFromDatasets(_Cached):
    """fsspec's instance-caching metaclass, which first gives a pffs layer made for a chained URL the pffs
    options Hugging Face `datasets` dropped on the way (see pffs.sdk.hugging_face): added to the arguments
    here, before fsspec's cache key is computed, so two loads with other options get two filesystems."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if "fo" in kwargs:
            kwargs = {**chained_options_from_datasets(), **kwargs}  # what the layer was given wins
        return super().__call__(*args, **kwargs)


class PffsFileSystem(ChainedFileSystem, metaclass=_MadeWithOptionsFromDatasets):
    protocol = "pffs"
    root_marker = ""

    def __init__(
        self,
        target: str | None = None,
        target_protocol: str | None = None,
        target_options: dict[str, Any] | None = None,
        fo: str | None = None,
        **options: Any,
    ) -> None:
        self.chained_url = fo is not None  # made for "pffs::s3://..." (fsspec passes the inner URL as fo)
        target_options, target_protocol = _unwrap_chained(target_options, target_protocol)
        scheme = target.split("://", 1)[0].lower() if target and "://" in target else target_protocol or ""
        options = own_layer_options(options, split_url(f"{scheme}://")[0] if scheme else "", scheme)
        cache_opts = {k: options.pop(k) for k in list(options) if k in CACHE_FIELDS}
        group = peer_settings(options)
        backend_opts = backend_options({**(target_options or {}), **options})
        super().__init__()
        check_passed_through(split_url(target)[0] if target else target_protocol or "", backend_opts)
        if target is not None:  # fsspec.filesystem("pffs", target=URL): paths are relative to URL's path
            backend, root = open_backend(target, backend_opts)
            self.root = root.rstrip("/") or root
        elif target_protocol is not None:  # chained, "pffs::s3://bucket/key": paths are the backend's own
            backend, _ = open_backend(f"{target_protocol}://", backend_opts)
            self.root = ""
        else:
            raise ValueError(
                "pffs needs a target: target='s3://bucket/prefix' or a chained URL 'pffs::s3://...'"
            )
        self.vfs = Vfs(backend, cache_settings(cache_opts))
        self.peers = None if group is None else self.vfs.join_group(group, self.root)

    # -- paths ---------------------------------------------------------------------------------------------
    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        if isinstance(path, list):
            return [cls._strip_protocol(p) for p in path]
        path = str(path)
        for prefix in ("pffs::", "pffs://"):
            path = path.removeprefix(prefix)
        return path.rstrip("/") if path not in ("/", "") else path

    def _full(self, path: str) -> str:
        path = self._strip_protocol(path)
        if "://" in path:  # an explicit backend URL wins over the root
            protocol, rest = split_url(path)
            return rest if protocol == "file" else rest.strip("/")
        if not self.root:
            return path
        if self.root == "/":
            return "/" + path.lstrip("/")
        return f"{self.root}/{path.lstrip('/')}" if path.strip("/") else self.root

    def _relative(self, full: str) -> str:
        if not self.root:
            return full
        if full == self.root:
            return ""
        prefix = self.root.rstrip("/") + "/"
        return full[len(prefix) :] if full.startswith(prefix) else full

    def _entry(self, info: ObjectInfo) -> dict[str, Any]:
        return {
            "name": self._relative(info.path),
            "size": info.size,
            "type": "directory" if info.is_dir else "file",
            "identity": info.identity,
        }

    # -- metadata -----------------------------------------------------------------------------------------
    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        return self._entry(self.vfs.stat(self._full(path)))

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> list[Any]:
        entries = [self._entry(e) for e in self.vfs.list_dir(self._full(path))]
        return entries if detail else [e["name"] for e in entries]

    def glob(self, path: str, maxdepth: int | None = None, **kwargs: Any) -> Any:
        if self.chained_url:  # the one caller that cannot use this form is told which one it can
            refuse_chained_streaming()
        return super().glob(path, maxdepth=maxdepth, **kwargs)

    def find(
        self,
        path: str,
        maxdepth: int | None = None,
        withdirs: bool = False,
        detail: bool = False,
        **kwargs: Any,
    ) -> Any:
        if maxdepth is not None or withdirs:
            return super().find(path, maxdepth=maxdepth, withdirs=withdirs, detail=detail, **kwargs)
        found = {e["name"]: e for e in (self._entry(i) for i in self.vfs.walk_files(self._full(path)))}
        found = dict(sorted(found.items()))
        return found if detail else list(found)

    # -- reads --------------------------------------------------------------------------------------------
    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
        full = self._full(path)
        if start is None and end is None:
            return self.vfs.read(full)
        size = self.vfs.stat(full).size
        start = 0 if start is None else (start if start >= 0 else max(0, size + start))
        end = size if end is None else (end if end >= 0 else max(0, size + end))
        return self.vfs.read(full, start, max(0, end - start))

    def _open(
        self,
        path: str,
        mode: str = "rb",
        block_size: int | None = None,
        autocommit: bool = True,
        cache_options: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> Any:
        full = self._full(path)
        if "r" in mode and "+" not in mode:
            return PffsReadFile(self, path, self.vfs.open(full))
        # Writes go to the backend; what we knew of the path is stale from now on.
        self.vfs.invalidate(full)
        return _InvalidateOnClose(self.vfs.backend.fs.open(full, mode, **kwargs), self, full)

    # -- writes, passed through ---------------------------------------------------------------------------
    def pipe_file(self, path: str, value: bytes, mode: str = "overwrite", **kwargs: Any) -> None:
        full = self._full(path)
        try:
            self.vfs.backend.fs.pipe_file(full, value, **kwargs)
        finally:
            self.vfs.invalidate(full)

    def put_file(
        self, lpath: str, rpath: str, callback: Any = None, mode: str = "overwrite", **kwargs: Any
    ) -> None:
        """Uploads a local file in one piece (multipart for large ones, completed only once all is sent), so
        a failed upload leaves whatever was at `rpath` whole (fsspec's default writes through an open file,
        whose close on an error would publish part of it)."""
        full = self._full(rpath)
        try:
            self.vfs.backend.upload(lpath, full)
        finally:
            self.vfs.invalidate(full)

    def invalidate_cache(self, path: str | None = None) -> None:
        """Forgets pffs's metadata of `path`: its next open stats it again, so sees another writer's version
        (cached blocks stay, keyed by their version). Without a path, nothing: metadata expires by its TTL."""
        if path is not None:
            self.vfs.invalidate(self._full(path))

    def rm_file(self, path: str) -> None:
        full = self._full(path)
        try:
            self.vfs.backend.fs.rm_file(full)
        finally:
            self.vfs.invalidate(full)

    def _rm(self, path: str) -> None:
        self.rm_file(path)

    # -- copies and moves, inside the backend -------------------------------------------------------------
    def cp_file(self, path1: str, path2: str, **kwargs: Any) -> None:
        """Copies one object inside the backend: by the store where it can (S3: CopyObject, the bytes never
        leave it; a destination already there is replaced whole, never half-written), else read and written
        again. What pffs knew of the destination is dropped, so its next read sees the copy."""
        source, target = self._full(path1), self._full(path2)
        try:
            self.vfs.backend.copy(source, target, self.vfs.stat(source).size)
        finally:
            self.vfs.invalidate(target)

    def mv(
        self, path1: Any, path2: Any, recursive: bool = False, maxdepth: int | None = None, **kwargs: Any
    ) -> None:
        """Moves one object with the backend's own rename (local files, HDFS: atomic) or, on object stores,
        a copy then a delete of the source (the destination is replaced whole; for a moment both exist).
        Several objects, a directory or a glob: one by one, as fsspec does. `rename` is this too."""
        if not (isinstance(path1, str) and isinstance(path2, str)) or recursive or has_magic(path1):
            super().mv(path1, path2, recursive=recursive, maxdepth=maxdepth, **kwargs)
            return
        source = self._full(path1)
        if self.vfs.stat(source).is_dir:
            super().mv(path1, path2, recursive=recursive, maxdepth=maxdepth, **kwargs)
            return
        target = self._full(path2)
        if path2.endswith("/") or self._is_dir(target):  # into a directory, under the source's name
            target = posixpath.join(target, posixpath.basename(source))
        if target == source:
            return
        try:
            self.vfs.backend.move(source, target)
        finally:
            self.vfs.invalidate(source)
            self.vfs.invalidate(target)

    def _is_dir(self, full: str) -> bool:
        try:
            return self.vfs.stat(full).is_dir
        except FileNotFoundError:
            return False

    def mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> None:
        self.vfs.backend.fs.mkdir(self._full(path), create_parents=create_parents, **kwargs)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        self.vfs.backend.fs.makedirs(self._full(path), exist_ok=exist_ok)

    def rmdir(self, path: str) -> None:
        self.vfs.backend.fs.rmdir(self._full(path))

    # -- pffs extras --------------------------------------------------------------------------------------
    def cached_fraction(self, path: str) -> float:
        """Share of the object's blocks in the disk cache (0.0 to 1.0)."""
        return self.vfs.reader.cached_fraction(self.vfs.stat(self._full(path)))

    def cache_stats(self) -> dict[str, int]:
        return self.vfs.cache.stats.snapshot()


class PffsReadFile(AbstractBufferedFile):
    """A read-only file of one pinned object version; fsspec's buffering off, pffs's cache underneath."""

    def __init__(self, fs: PffsFileSystem, path: str, handle: OpenObject) -> None:
        self.handle = handle
        super().__init__(
            fs, path, mode="rb", block_size=handle.reader.block_size, cache_type="none", size=handle.info.size
        )

    def close(self) -> None:
        self.handle.close()
        super().close()

    def _fetch_range(self, start: int, end: int) -> bytes:
        return self.handle.read(start, end - start)

    def read(self, length: int = -1) -> bytes:
        # Read straight through pffs (no copy into fsspec's buffer), keeping fsspec's position semantics.
        if self.closed:
            raise ValueError("I/O operation on closed file")
        if length is None or length < 0:
            length = self.size - self.loc
        data = self.handle.read(self.loc, length)
        self.loc += len(data)
        return data


class _InvalidateOnClose:
    """A backend file being written; when it closes, pffs forgets what it knew of the path."""

    def __init__(self, f: Any, fs: PffsFileSystem, full: str) -> None:
        self._f, self._fs, self._full = f, fs, full

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)

    def __enter__(self) -> _InvalidateOnClose:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __iter__(self) -> Any:
        return iter(self._f)

    def close(self) -> None:
        try:
            self._f.close()
        finally:
            self._fs.vfs.invalidate(self._full)
