"""Distributed checkpoints (`torch.distributed.checkpoint`) through pffs: a storage `Writer` and `Reader`.

    import torch.distributed.checkpoint as dcp
    from pffs.torch.dcp import Reader, Writer

    dcp.save(state_dict, storage_writer=Writer("s3://runs/ckpt", endpoint_url="http://..."))
    dcp.load(state_dict, storage_reader=Reader("s3://runs/ckpt", endpoint_url="http://..."))

Options are pffs's (cache_dir, block_size, ...) and the backend's (endpoint_url, key, secret, ...), flat or
per layer, as `pffs.torch`'s datasets take them. The layout is torch's own (a pickled `.metadata` naming
`.distcp` shards, tensors saved with torch.save), so torch's `FileSystemReader`/`FsspecReader` read it too.
Loads read through the pffs cache: a checkpoint read again (by the ranks of one machine, or after a
restart) comes from local disk.

What a save guarantees, for one save at a time to a path (two at once to the same path are not supported):

* Each save writes its shards under names of its own, `__<save id>_<rank>_<n>.distcp`, the id chosen by
  the coordinator for every rank (`prepare_global_plan`): no save writes over a shard of another. A shard
  is written to local disk (the cache's), each part of it uploaded as soon as it is written (an S3
  multipart upload), and put in place in one step once the whole shard is written and uploaded (the
  upload's completion): so it is whole or absent.
* `.metadata` is written last, by the coordinator in `finish` — which torch calls only once every rank's
  `write_data` has returned — after it has checked that every shard it names is in the store and long
  enough for the bytes it names (one LIST of the folder, which S3 answers as consistently as a HEAD).
  It is one PUT (on local files: written beside and renamed), so a reader sees the previous `.metadata`
  or the new one, whole.
* So a save that fails anywhere (any rank, any step, up to and including that PUT) leaves the previous
  checkpoint at the path exactly as it was and loadable: its `.metadata` and every shard it names are
  untouched. At worst the failed save's own shards are left beside it, unnamed by any `.metadata`.
* Once the new `.metadata` is in place, the coordinator removes the `__*.distcp` shards it does not name
  (the previous save's, a failed save's, those of torch's own writer). A load that read the previous
  `.metadata` before then fails on the removed shard (ESTALE, never bytes of another save): load again.
  A failure to remove them is logged, and the save stands.

Only a save with collectives (torch's default) is supported: `use_collectives=False` writes one
`.metadata` per rank, which this writer refuses.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import pickle
import posixpath
import re
import uuid
from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

from torch.distributed.checkpoint.filesystem import (
    CURRENT_DCP_VERSION,
    FileSystemBase,
    FileSystemReader,
    FileSystemWriter,
    _StorageInfo,
    _StoragePrefix,
)
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.storage import WriteResult

from pffs.sdk.filesystem import PffsFileSystem
from pffs.sdk.helpers import filesystem_for, parse_url
from pffs.torch.uploads import uploading

log = logging.getLogger(__name__)

METADATA = ".metadata"
_SHARD = re.compile(r"__.*\.distcp")  # torch's shard names, and ours


class _PffsStorage(FileSystemBase):
    """torch's file-system interface on a pffs filesystem. Paths are the backend's own (bucket/key).
    Written files are staged on local disk, uploaded while they are written, and put in place in one
    piece when they close without an error (pffs.torch.uploads)."""

    def __init__(self, fs: PffsFileSystem, scheme: str) -> None:
        self.fs = fs
        self.scheme = scheme
        self.local = fs.vfs.backend.protocol == "file"

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[io.IOBase, None, None]:
        path = os.fspath(path)
        if "r" in mode and "+" not in mode:
            self.fs.invalidate_cache(path)  # another writer may have written it since pffs last looked
            with self.fs.open(path, "rb") as f:
                yield cast(io.IOBase, f)
            return
        with uploading(self.fs, path) as f:
            yield cast(io.IOBase, f)

    def concat_path(self, path: str | os.PathLike[str], suffix: str) -> str:
        return posixpath.join(os.fspath(path), suffix)

    def init_path(self, path: str | os.PathLike[str]) -> str:
        """The backend path of a URL of this writer's backend (s3://bucket/key, pffs::s3://...) or of a
        backend path (bucket/key)."""
        text = os.fspath(path)
        if "://" not in text:
            return text.rstrip("/") or text
        scheme, full = parse_url(text)
        if scheme != self.scheme:
            raise ValueError(f"{text}: not a {self.scheme}:// URL, the backend this reader or writer opened")
        return full.rstrip("/") or full

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        self.fs.mv(os.fspath(path), os.fspath(new_path))

    def mkdir(self, path: str | os.PathLike[str]) -> None:
        if self.local:
            Path(path).mkdir(parents=True, exist_ok=True)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return isinstance(checkpoint_id, str) and "://" in checkpoint_id

    def exists(self, path: str | os.PathLike[str]) -> bool:
        self.fs.invalidate_cache(os.fspath(path))
        return bool(self.fs.exists(os.fspath(path)))

    def rm_file(self, path: str | os.PathLike[str]) -> None:
        self.fs.rm_file(os.fspath(path))

    def ls(self, path: str | os.PathLike[str]) -> list[str]:
        self.fs.invalidate_cache(os.fspath(path))
        return [posixpath.basename(e["name"]) for e in self.fs.ls(os.fspath(path), detail=True)]


def _storage(url: str, options: dict[str, Any]) -> tuple[_PffsStorage, str]:
    fs, path = filesystem_for(url, **options)
    storage = _PffsStorage(fs, parse_url(url)[0])
    return storage, storage.init_path(path)


class Writer(FileSystemWriter):
    """A `torch.distributed.checkpoint` storage writer to `url` (s3://bucket/prefix, a path, ...) through
    pffs. See the module's docstring for what a save guarantees.

    thread_count: files written (and uploaded) at once per rank, each a shard of its own. overwrite=False:
    a save to a path that has a checkpoint fails before writing anything.
    """

    def __init__(
        self,
        url: str,
        *,
        thread_count: int = 1,
        per_thread_copy_ahead: int = 10_000_000,
        overwrite: bool = True,
        **options: Any,
    ) -> None:
        # sync_files off: a shard is durable once uploaded (an fsync of the staged file would add nothing).
        super().__init__(
            path=url,
            single_file_per_rank=True,
            sync_files=False,
            thread_count=thread_count,
            per_thread_copy_ahead=per_thread_copy_ahead,
            overwrite=overwrite,
        )
        self.storage, self.path = _storage(url, options)
        # torch types `fs` as its local FileSystem; its own FsspecWriter puts another FileSystemBase there too
        self.fs = self.storage  # type: ignore[assignment]

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)
        if not self.use_collectives:
            raise ValueError(
                "pffs.torch.dcp.Writer needs a save with collectives (use_collectives=True, the default): "
                "it names each save's shards from the coordinator's plan"
            )

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self.storage.mkdir(self.path)
        if not self.overwrite and self.storage.exists(self._metadata_path()):
            raise RuntimeError(f"{self.path}: a checkpoint is already there and overwrite=False")
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """On the coordinator: every rank's shards named after one new save id."""
        save = uuid.uuid4().hex[:16]
        return [
            dataclasses.replace(plan, storage_data=_StoragePrefix(f"__{save}_{rank}_"))
            for rank, plan in enumerate(plans)
        ]

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """On the coordinator, once every rank's shards are uploaded: checks them, puts `.metadata` in place
        in one piece, then removes the shards it does not name."""
        metadata.version = CURRENT_DCP_VERSION
        metadata.storage_data = {wr.index: wr.storage_data for wrs in results for wr in wrs}
        metadata.storage_meta = self.storage_meta()
        listed = self._listing()
        named = self._check_shards(metadata.storage_data, listed)
        with uploading(self.storage.fs, self._metadata_path()) as f:
            pickle.dump(metadata, f)
        self._remove_shards_but(named, listed)

    def _metadata_path(self) -> str:
        return self.storage.concat_path(self.path, METADATA)

    def _listing(self) -> dict[str, int]:
        """Name -> size of what is in the checkpoint's folder now: one LIST, which both checks the shards
        and finds the ones to remove."""
        return self.storage.fs.vfs.backend.sizes_under(os.fspath(self.path))

    def _check_shards(self, storage_data: dict[Any, _StorageInfo], listed: dict[str, int]) -> set[str]:
        """The shards the metadata names, each checked to be in the store and long enough (else OSError)."""
        needed: dict[str, int] = {}
        for info in storage_data.values():
            end = info.offset + info.length
            needed[info.relative_path] = max(end, needed.get(info.relative_path, 0))
        for name, end in needed.items():
            path = self.storage.concat_path(self.path, name)
            size = listed.get(name)
            if size is None:
                raise FileNotFoundError(
                    f"{path}: a shard of this save is not in the store; the checkpoint there is left as is"
                )
            if size < end:
                raise OSError(
                    f"{path}: {size} bytes in the store where this save wrote {end}; the checkpoint there is "
                    "left as it was"
                )
        return set(needed)

    def _remove_shards_but(self, named: set[str], listed: dict[str, int]) -> None:
        try:
            stale = [n for n in listed if _SHARD.fullmatch(n) and n not in named]
            for name in stale:
                path = self.storage.concat_path(self.path, name)
                self.storage.fs.vfs.backend.remove(path)  # no s3fs client made for it on S3
                self.storage.fs.invalidate_cache(path)
        except OSError as exc:
            log.warning("%s: the new checkpoint is in place, but not all older shards were removed: %s",
                        self.path, exc)  # fmt: skip

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return _PffsStorage.validate_checkpoint_id(checkpoint_id)


class Reader(FileSystemReader):
    """A `torch.distributed.checkpoint` storage reader of the checkpoint at `url`, through the pffs cache.
    Reads the `.metadata` there now (never one pffs knew of before) and the shards it names."""

    def __init__(self, url: str, **options: Any) -> None:
        super().__init__(url)
        storage, self.path = _storage(url, options)
        self.fs = storage  # type: ignore[assignment]  # as in Writer

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return _PffsStorage.validate_checkpoint_id(checkpoint_id)
