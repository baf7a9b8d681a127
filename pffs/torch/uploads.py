"""Checkpoint files written through pffs: staged on local disk and uploaded while they are written.

A checkpoint is written in order, start to end (torch.save's zip writer, torch.distributed.checkpoint's
shards), so what the file already holds never changes: each part of it is sent as soon as it is written
(the backend's GrowingUpload, a multipart upload on S3), and the upload ends soon after the file closes
instead of starting then. The object at the path is replaced only when the block ends without an error,
in one step (the multipart upload's completion; on local files a rename), so a failed or interrupted
write leaves it as it was. A writer that seeks back into what it wrote is served too: what was sent is
dropped, and the whole file is uploaded when it closes.
"""

from __future__ import annotations

import io
import os
import posixpath
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pffs.backends.backend import GrowingUpload
    from pffs.sdk.filesystem import PffsFileSystem

NOTIFY_EVERY = 4 << 20  # bytes written between two looks for whole parts to send
BUFFER_SIZE = 1 << 20


class UploadingFile(io.BufferedWriter):
    """A buffered file on local disk whose written bytes are handed to a GrowingUpload as they reach
    the OS."""

    def __init__(self, raw: io.FileIO, upload: GrowingUpload) -> None:
        super().__init__(raw, BUFFER_SIZE)
        self._upload = upload
        self._told = 0  # the size the upload was last told of
        self._rewound = False

    def write(self, data: Any) -> int:
        written = super().write(data)
        end = self.tell()
        if not self._rewound and end - self._told >= NOTIFY_EVERY:
            self.flush()  # the upload reads the file itself: the bytes must be in it
            self._upload.written(end)
            self._told = end
        return written

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        here = self.tell()
        target = super().seek(offset, whence)
        if target != here:
            self._went_back()
        return target

    def truncate(self, size: int | None = None) -> int:
        self._went_back()
        return super().truncate(size)

    def _went_back(self) -> None:
        if not self._rewound:
            self._rewound = True
            self._upload.rewritten()


def staging_folder(fs: PffsFileSystem, path: str) -> Path:
    """Where a file to put at `path` is staged: beside it for a local target (a rename is atomic where a
    copy is not), else on the cache's disk, sized for large files."""
    if fs.vfs.backend.protocol == "file":
        return Path(posixpath.dirname(path))
    return Path(fs.vfs.settings.cache_dir) / "staging"


@contextmanager
def uploading(fs: PffsFileSystem, path: str, prefix: str = "") -> Iterator[io.BufferedWriter]:
    """A new local file to write, put at `path` (the backend's own path) in one piece if the block ends
    without an error, and removed in any case. Created with the umask's mode, as torch.save's files."""
    backend = fs.vfs.backend
    local = backend.protocol == "file"
    folder = staging_folder(fs, path)
    folder.mkdir(parents=True, exist_ok=True)
    staged = str(folder / f".{prefix or posixpath.basename(path)}.{uuid.uuid4().hex}.tmp")
    fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
    upload = None if local else backend.start_upload(staged, path)
    try:
        if upload is None:
            with os.fdopen(fd, "wb") as plain:
                yield plain  # a local target: renamed, nothing to stream
            os.replace(staged, path)
        else:
            with UploadingFile(io.FileIO(fd, "wb"), upload) as f:
                yield f
            upload.finish()
        fs.invalidate_cache(path)
    except BaseException:
        if upload is not None:
            upload.abort()
        raise
    finally:
        if os.path.exists(staged):
            os.unlink(staged)
