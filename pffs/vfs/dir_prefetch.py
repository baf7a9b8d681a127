"""Read-ahead across the files of a directory: when its small files are being opened one after another (a
training epoch over a folder of samples, in any order), the rest are fetched ahead, several at a time.

Per-file read-ahead cannot help a folder of 128 KiB samples: each file is one block, read once, and every
open then waits for its own GET (or disk read) on a worker thread. Once TRIGGER_FILES distinct small files
(one block or less) of a directory have been opened within IDLE_S seconds of each other, its other small
files are fetched by all the fetch threads (16 by default) through the block cache (into memory, and onto
disk as any read), starting after the last file opened, in listing order, so a program reading in order
stays behind the prefetcher and one reading in a shuffled order finds more and more files ready. A file
whose block is in memory when it is opened is answered on the event loop, without a thread.

Bounded by what the readers show: at most AHEAD_FACTOR files are fetched ahead per file opened (plus
AHEAD_START), so reading 50 files of a folder of a million fetches a few hundred at most, while a whole
epoch keeps the prefetcher running ahead of it; a directory whose files stop being opened for IDLE_S
seconds stops being prefetched. Prefetched blocks are written to the disk tier like any other, so one that
the memory tier drops before it is opened is still a local read. A directory is listed once for this (a
LIST the mount usually made already). `--no-prefetch-dirs` turns it off.
"""

from __future__ import annotations

import logging
import posixpath
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from pffs.backends.backend import ObjectInfo
from pffs.vfs.reader import ObjectReader

log = logging.getLogger(__name__)

TRIGGER_FILES = 16
AHEAD_FACTOR = 2
AHEAD_START = 64
IDLE_S = 10.0
MAX_DIRECTORIES = 1024  # directories whose opens are being counted


@dataclass
class _Directory:
    path: str
    opened: set[str] = field(default_factory=set)
    last_open: float = 0.0
    last_name: str = ""
    running: bool = False
    done: bool = False  # every file was opened or fetched ahead (until the directory goes idle)
    fetched: int = 0  # files fetched ahead by this scan

    def allowance(self) -> int:
        return AHEAD_FACTOR * len(self.opened) + AHEAD_START - self.fetched


class DirectoryPrefetcher:
    def __init__(self, reader: ObjectReader, list_directory: Callable[[str], dict[str, ObjectInfo]]) -> None:
        self.reader = reader
        self.list_directory = list_directory  # path -> {name: entry}; may LIST (called from a thread)
        self._directories: dict[str, _Directory] = {}
        self._cond = threading.Condition()
        self._closed = False
        self.files_prefetched = 0

    def opened(self, path: str, info: ObjectInfo) -> None:
        """Records an open for reading. Cheap and never blocks: called on the event loop."""
        if not 0 < info.size <= self.reader.block_size or self._closed:
            return
        directory, name = posixpath.split(path)
        now = time.monotonic()
        with self._cond:
            scan = self._directories.get(directory)
            if scan is None:
                if len(self._directories) >= MAX_DIRECTORIES:
                    self._forget_idle(now)
                scan = self._directories[directory] = _Directory(directory)
            elif now - scan.last_open > IDLE_S and not scan.running:
                scan.opened.clear()  # a new pass over the directory (the next epoch, say)
                scan.done = False
            scan.opened.add(name)
            scan.last_open, scan.last_name = now, name
            if scan.running:
                self._cond.notify_all()  # more opened: more may be fetched ahead
                return
            if scan.done or len(scan.opened) < TRIGGER_FILES:
                return
            scan.running = True
        threading.Thread(target=self._run, args=(scan,), name="pffs-dir-prefetch", daemon=True).start()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _forget_idle(self, now: float) -> None:
        for path in [p for p, d in self._directories.items() if not d.running and now - d.last_open > IDLE_S]:
            del self._directories[path]
        if len(self._directories) >= MAX_DIRECTORIES:  # all busy: forget the oldest
            oldest = min(self._directories.values(), key=lambda d: d.last_open)
            if not oldest.running:
                del self._directories[oldest.path]

    def _run(self, scan: _Directory) -> None:
        in_flight = threading.Semaphore(self.reader.workers)  # as many as the fetch threads
        done = False
        try:
            entries = self.list_directory(scan.path)
            for name, info in self._order(scan, entries):
                if not self._wait_for_allowance(scan):
                    break
                if self.reader.cache.memory.get(self.reader.key(info, 0)) is not None:
                    continue
                in_flight.acquire()
                with self._cond:
                    if name in scan.opened:  # opened while we waited: its reader fetches it
                        in_flight.release()
                        continue
                    scan.fetched += 1
                future: Future[object] = self.reader.pool.submit(self.reader.block, info, 0, ahead=True)
                future.add_done_callback(lambda _: in_flight.release())
                self.files_prefetched += 1
            else:
                done = True
        except Exception as exc:  # prefetching is a guess: a failure only means reads fetch for themselves
            log.debug("prefetch of directory %s stopped: %s", scan.path, exc)
        finally:
            with self._cond:
                scan.running, scan.done, scan.fetched = False, done, 0

    def _order(self, scan: _Directory, entries: dict[str, ObjectInfo]) -> list[tuple[str, ObjectInfo]]:
        """The directory's small files not opened yet, in name order from after the last one opened."""
        small = range(1, self.reader.block_size + 1)
        names = sorted(n for n, i in entries.items() if not i.is_dir and i.size in small)
        start = next((i for i, n in enumerate(names) if n > scan.last_name), 0)
        ordered = names[start:] + names[:start]
        return [(n, entries[n]) for n in ordered if n not in scan.opened]

    def _wait_for_allowance(self, scan: _Directory) -> bool:
        """Waits until the readers have opened enough files for one more to be fetched ahead; False once
        the directory went idle (or the mount is closing)."""
        with self._cond:
            while True:
                if self._closed or time.monotonic() - scan.last_open > IDLE_S:
                    return False
                if scan.allowance() > 0:
                    return True
                self._cond.wait(timeout=1.0)
