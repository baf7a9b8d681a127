"""Write-back staging: files being written live on local disk and are uploaded when closed or fsync'ed.

The upload is what makes a file visible to others. A failed upload is an error for close/fsync, and the
staged file stays (with a sidecar naming its URL) to be uploaded again on the next fsync, close or unmount:
nothing written is dropped silently. Files left by a process that died are reported at the next mount.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from pffs.backends.backend import Backend
from pffs.backends.posix_metadata import PosixAttributes
from pffs.backends.retry import describe
from pffs.processes import is_alive

log = logging.getLogger(__name__)

# How a file being written here is identified (ObjectInfo.identity) until it is uploaded.
STAGED_IDENTITY = "staged:"


class StagedFile:
    """The local copy of one file being written. Shared by every handle open on the path."""

    def __init__(self, path: str, url: str, data_path: Path) -> None:
        self.path = path
        self.url = url
        self.data_path = data_path
        self.fd = os.open(data_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        # Held around uses of `fd` that may race with discard(): a closed descriptor's number is reused
        # by the next open, whose size or bytes must never be taken for this file's.
        self._fd_lock = threading.Lock()
        self.lock = threading.Lock()
        self.opens = 0
        # Writes bump `generation`; an upload records the generation it carried, so a write that lands
        # during an upload leaves the file dirty (uploaded again) instead of being lost.
        self.generation = 0
        self.uploaded_generation = 0
        self.removed = False  # unlinked while open: never uploaded
        self.abandoned = False  # a writer died from a signal: never uploaded, its bytes kept aside
        self.mtime_ns: int | None = None  # the last write's, or what utimens set after it
        self.ctime_ns: int | None = None
        # Stored with the upload where the mount keeps POSIX attributes (None: it does not); its times
        # are the ones above.
        self.attributes: PosixAttributes | None = None

    @property
    def dirty(self) -> bool:
        return self.generation != self.uploaded_generation and not (self.removed or self.abandoned)

    @property
    def sidecar(self) -> Path:
        return self.data_path.with_suffix(".json")

    def size(self) -> int | None:
        """Bytes in the file; None once it is dropped (uploaded and closed, or unlinked): the stored
        object answers for it then."""
        with self._fd_lock:
            return None if self.fd < 0 else os.fstat(self.fd).st_size

    def read(self, offset: int, length: int) -> bytes:
        with self._fd_lock:
            if self.fd < 0:
                raise OSError(errno.EBADF, f"{self.url}: read after the staged copy was dropped")
            return os.pread(self.fd, length, offset)

    def write(self, offset: int, data: bytes) -> int:
        self._record_intent()
        written = os.pwrite(self.fd, data, offset)
        self.mtime_ns = self.ctime_ns = time.time_ns()
        self.generation += 1  # after the bytes are in the file: an upload that saw them may clear it
        return written

    def truncate(self, size: int) -> None:
        self._record_intent()
        os.ftruncate(self.fd, size)
        self.mtime_ns = self.ctime_ns = time.time_ns()
        self.generation += 1

    def set_attributes(self, attributes: PosixAttributes) -> None:
        """chmod, chown or utimens of a file being written: carried by its (next) upload."""
        self._record_intent()
        self.attributes = attributes.replace(mtime_ns=None, ctime_ns=None)
        if attributes.mtime_ns is not None:
            self.mtime_ns = attributes.mtime_ns
        self.ctime_ns = time.time_ns()
        self.generation += 1

    def stored_attributes(self) -> PosixAttributes | None:
        """What the upload stores: the attributes with the file's times."""
        if self.attributes is None:
            return None
        mtime = self.mtime_ns if self.mtime_ns is not None else time.time_ns()
        atime = self.attributes.atime_ns if self.attributes.atime_ns is not None else mtime
        return self.attributes.replace(mtime_ns=mtime, ctime_ns=self.ctime_ns or mtime, atime_ns=atime)

    def _record_intent(self) -> None:
        if not self.dirty:
            # Written once per dirty period, so the data can be found again if this process dies.
            self.sidecar.write_text(json.dumps({"url": self.url, "path": self.path, "pid": os.getpid()}))

    def discard(self) -> None:
        with self._fd_lock:
            if self.fd < 0:
                return
            os.close(self.fd)
            self.fd = -1
        if self.abandoned:
            return  # kept for inspection (Staging.abandon)
        for leftover in (self.data_path, self.sidecar):
            leftover.unlink(missing_ok=True)


class Staging:
    def __init__(self, directory: Path, backend: Backend) -> None:
        self.directory = directory
        self.backend = backend
        self.directory.mkdir(parents=True, exist_ok=True)
        self._files: dict[str, StagedFile] = {}
        self._lock = threading.Lock()
        self.uploads_done = 0
        self.upload_failures = 0
        self.killed_writes = 0  # files whose writer died from a signal: kept, not uploaded

    @property
    def killed_directory(self) -> Path:
        """Where the bytes of files whose writer was killed are kept, one .data and .json per file."""
        return self.directory / "killed"

    def leftovers(self) -> list[dict[str, str]]:
        """Staged files of earlier processes that were never uploaded: [{url, path, data}]."""
        found = []
        for sidecar in sorted(self.directory.glob("*.json")):
            data = sidecar.with_suffix(".data")
            if not data.exists():
                continue
            try:
                meta = json.loads(sidecar.read_text())
            except (OSError, ValueError):
                continue
            if not is_alive(meta.get("pid")):
                found.append({"url": str(meta.get("url")), "path": str(meta.get("path")), "data": str(data)})
        return found

    def get(self, path: str) -> StagedFile | None:
        return self._files.get(path)

    def open(self, path: str, fill: Callable[[int], None] | None = None) -> StagedFile:
        """The staged file of `path` with one more handle on it; a new one is filled by `fill(fd)`
        (the object's current bytes) or left empty (O_TRUNC, a new file)."""
        with self._lock:
            staged = self._files.get(path)
            if staged is None:
                data_path = self.directory / f"{uuid.uuid4().hex}.data"
                staged = StagedFile(path, self.backend.url(path), data_path)
                try:
                    if fill is not None:
                        fill(staged.fd)
                except BaseException:
                    staged.discard()
                    raise
                self._files[path] = staged
            staged.opens += 1
            return staged

    def create(self, path: str) -> StagedFile:
        """A new, empty file that exists (and is uploaded) even if nothing is written to it."""
        staged = self.open(path)
        with staged.lock:
            staged.truncate(0)
        return staged

    def upload(self, staged: StagedFile) -> None:
        """Uploads the file if it changed since its last upload. OSError(EIO) names the URL, the cause
        and where the data is kept."""
        with staged.lock:
            if not staged.dirty:
                return
            carried = staged.generation
            try:
                self.backend.upload(str(staged.data_path), staged.path, staged.stored_attributes())
            except Exception as exc:
                self.upload_failures += 1
                log.error(
                    "upload of %s failed (%s); its data is kept in %s and is uploaded again on the next "
                    "fsync, close or unmount",
                    staged.url,
                    describe(exc),
                    staged.data_path,
                )
                raise OSError(5, f"{staged.url}: upload failed: {describe(exc)}") from exc
            staged.uploaded_generation = carried
            if not staged.dirty:
                staged.sidecar.unlink(missing_ok=True)
            self.uploads_done += 1

    def release(self, staged: StagedFile) -> None:
        """One handle closed. The last one uploads what is left and drops the local copy once uploaded."""
        with self._lock:
            staged.opens -= 1
            if staged.opens > 0:
                return
        try:
            self.upload(staged)
        except OSError:
            return  # kept, still served to readers, retried on unmount
        with self._lock:
            if staged.opens == 0 and not staged.dirty:
                if self._files.get(staged.path) is staged:
                    del self._files[staged.path]
                staged.discard()

    def set_attributes(self, staged: StagedFile, attributes: PosixAttributes) -> bool:
        """New attributes for a file being written, uploaded with it. False if it was uploaded and dropped
        meanwhile (the caller then changes the stored object's). Uploaded now if no handle is left open on
        it (its last release may have uploaded it already)."""
        with self._lock:
            if self._files.get(staged.path) is not staged:
                return False
            with staged.lock:
                staged.set_attributes(attributes)
            closed = staged.opens == 0
        if closed:
            self.upload(staged)
        return True

    def abandon(self, staged: StagedFile, details: dict[str, object]) -> Path:
        """A writer of the file died from a signal before closing it: the file is never uploaded (the stored
        object stays as it was) and leaves the paths being written, so the next open reads the stored object.
        Its bytes move to `killed_directory` with a sidecar of `details`; returns the data's new place."""
        with self._lock:
            if self._files.get(staged.path) is staged:
                del self._files[staged.path]
        with staged.lock:
            if staged.abandoned:
                return staged.data_path
            self.killed_directory.mkdir(exist_ok=True)
            kept = self.killed_directory / staged.data_path.name
            os.rename(staged.data_path, kept)  # the open descriptor follows the file
            staged.sidecar.unlink(missing_ok=True)
            staged.data_path = kept
            staged.abandoned = True
            record = {"url": staged.url, "path": staged.path, "size": staged.size() or 0, **details}
            staged.sidecar.write_text(json.dumps(record))
        self.killed_writes += 1
        return kept

    def remove(self, path: str) -> None:
        """The path was unlinked: its staged data is never uploaded."""
        with self._lock:
            staged = self._files.pop(path, None)
        if staged is not None:
            with staged.lock:
                staged.removed = True
                staged.sidecar.unlink(missing_ok=True)
            if staged.opens == 0:
                staged.discard()

    def files(self) -> list[StagedFile]:
        with self._lock:
            return list(self._files.values())

    def rename(self, old: str, new: str) -> None:
        """The file was moved (after its upload): handles still open on it now write to the new path."""
        with self._lock:
            staged = self._files.pop(old, None)
            if staged is not None:
                staged.path = new
                staged.url = self.backend.url(new)
                self._files[new] = staged

    def pending(self) -> list[StagedFile]:
        """Files written and not uploaded yet."""
        with self._lock:
            return [s for s in self._files.values() if s.dirty]

    def upload_all(self) -> list[str]:
        """Uploads everything pending (at unmount); returns the URLs that failed."""
        failed = []
        for staged in self.pending():
            try:
                self.upload(staged)
            except OSError:
                failed.append(staged.url)
        return failed
