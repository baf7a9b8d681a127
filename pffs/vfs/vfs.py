"""The VFS: one backend seen through the metadata cache and the block cache. The SDK, the CLI and the FUSE
mount all read through this class."""

from __future__ import annotations

import errno
import logging
import os
import posixpath
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TypeVar

from pffs.backends.backend import Backend, ObjectInfo
from pffs.backends.errors import BadOptionError, ObjectChangedError
from pffs.backends.request_stats import NOT_FOUND, OK
from pffs.cache import Block, BlockCache
from pffs.cache.fork import after_fork_in_child
from pffs.cache.stats import CacheStats
from pffs.config import CacheSettings, format_size
from pffs.peers.group import PeerGroup
from pffs.peers.protocol import BlockRequest
from pffs.peers.server import PeerServer
from pffs.peers.settings import PeerSettings, split_address
from pffs.processes import public_url
from pffs.vfs.metadata import MetadataCache
from pffs.vfs.readahead import ReadAheadState
from pffs.vfs.reader import ObjectReader
from pffs.vfs.stale import MetadataStore, Outage, unreachable

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class OpenObject:
    """A version of an object pinned at open: every read returns bytes of that version or fails."""

    info: ObjectInfo
    reader: ObjectReader
    state: ReadAheadState

    def read(self, offset: int, length: int) -> bytes:
        return self.reader.read(self.info, offset, length, self.state)

    def read_view(self, offset: int, length: int) -> Block:
        """As read, but may return a memoryview of a cached block (no copy)."""
        return self.reader.read_view(self.info, offset, length, self.state)

    def read_now(self, offset: int, length: int) -> Block | None:
        """The read if it needs no waiting (blocks in memory or fetched ahead), else None."""
        return self.reader.read_now(self.info, offset, length, self.state)

    def close(self) -> None:
        """Drops the blocks fetched ahead that were not read."""
        self.state.close()


class Vfs:
    def __init__(self, backend: Backend, settings: CacheSettings, cache: BlockCache | None = None) -> None:
        self.backend = backend
        self.settings = settings
        self.cache = cache or shared_block_cache(settings)
        self.metadata = MetadataCache(settings.metadata_ttl, settings.stale_if_error)
        if backend.retry.timeout_s is not None:  # the longest deadline of the backends reading through it
            self.cache.lock_wait_s = max(self.cache.lock_wait_s or 0.0, backend.retry.timeout_s)
        where = public_url(backend.origin or backend.url(""))  # no user:password@ in a log line
        self.outage = Outage(settings.stale_if_error, self.cache.stats, where)
        # The last listings, on disk, for a process started while the backend is down (pffs.vfs.stale);
        # beside the disk cache, and not where there is none (pffs ls/du of a cache dir that does not exist).
        directory = self.cache.directory if self.cache.disk is not None else None
        self.kept = (
            MetadataStore(directory / "metadata.sqlite", backend.origin)
            if directory is not None and backend.origin is not None and settings.stale_if_error > 0
            else None
        )
        self.reader = ObjectReader(
            backend,
            self.cache,
            settings.block_size,
            settings.readahead_size,
            settings.fetch_workers,
        )
        after_fork_in_child(self.metadata.reset_after_fork)
        after_fork_in_child(self.outage.reset_after_fork)
        counter = RequestCounter(self.cache.stats)
        if counter not in backend.requests.listeners:  # one backend may serve several Vfs of one cache
            backend.requests.listeners.append(counter)

    # A cache group (pffs.peers)

    def join_group(self, settings: PeerSettings, root: str) -> PeerGroup:
        """Asks the group's members for blocks before the backend, and serves them the blocks of objects
        under `root` (this process's dataset) if it listens. The process keeps both for its life."""
        origin = self.backend.origin
        if origin is None:
            raise BadOptionError(f"{self.backend.url(root)}: local files are not shared with a cache group")
        try:
            group = PeerGroup(settings, origin)
        except ValueError as exc:
            raise BadOptionError(str(exc)) from None
        if settings.listen is not None:
            try:
                serve = partial(self._serve_block, root)
                address = split_address(settings.listen)
                PeerServer(address, group.token, serve, group.counts, group.tls_server).start()
            except OSError as exc:
                raise BadOptionError(
                    f"cannot serve the cache group on {settings.listen}: {exc.strerror}"
                ) from None
        self.reader.peers = group
        return group

    def _serve_block(self, root: str, request: BlockRequest) -> Block | None:
        """A member's request: the block, if it is of this backend, under `root`, and keyed as here."""
        inside = not root or request.path == root or request.path.startswith(root.rstrip("/") + "/")
        climbs = any(part in (".", "..") for part in request.path.split("/"))  # a way out of `root`
        if request.origin != self.backend.origin or not inside or climbs:
            return None
        info = request.object_info()
        index = request.start // self.reader.block_size
        if (request.start, request.end) != self.reader.block_range(info, index):
            return None  # another block size
        if self.reader.key(info, index) != request.key:
            return None
        return self.reader.block(info, index, ask_peers=False)

    def stat(self, path: str, *, fresh: bool = False) -> ObjectInfo:
        cached = None if fresh else self.metadata.get(path)
        if cached is not None:
            return cached
        answer: tuple[ObjectInfo, bool] = self._ask(
            lambda: self.backend.stat(path), lambda: self._stale_stat(path)
        )
        info, answered = answer
        if answered:
            self.metadata.put(info)
        return info

    def list_dir(self, path: str) -> list[ObjectInfo]:
        """One level, from one LIST; trusted for the metadata TTL."""
        return self._listing("dir", path, self.backend.list_dir)

    def find(self, path: str) -> list[ObjectInfo]:
        """Every object under path, from as few LISTs as the backend allows; trusted for the metadata TTL."""
        return self._listing("find", path, self.backend.find)

    def _listing(self, kind: str, path: str, ask: Callable[[str], list[ObjectInfo]]) -> list[ObjectInfo]:
        cached = self.metadata.get_listing(kind, path)
        if cached is not None:
            return cached
        answer: tuple[list[ObjectInfo], bool] = self._ask(
            lambda: ask(path), lambda: self._stale_listing(kind, path)
        )
        entries, answered = answer
        if answered:
            self.metadata.put_listing(kind, path, entries)
            if self.kept is not None:
                self.kept.save(kind, path, entries)
        return entries

    # Stale-if-error (pffs.vfs.stale)

    def _ask(self, ask: Callable[[], T], stale: Callable[[], T | None]) -> tuple[T, bool]:
        """(the backend's answer, True); while the backend cannot be reached, (what was last seen, False)
        where that is within --stale-if-error. `stale` may raise FileNotFoundError (a name the last
        listing of its folder did not hold)."""
        if self.outage.skip_backend():  # an outage, between probes: no waiting for the backend
            old = self._stale(stale, None)
            if old is not None:
                return old, False
        try:
            value = ask()
        except Exception as exc:
            if not unreachable(exc):
                self.outage.answered()  # an answer (a 404, a 403): the backend is there
                raise
            old = self._stale(stale, exc)
            if old is None:
                raise
            return old, False
        self.outage.answered()
        return value, True

    def _stale(self, stale: Callable[[], T | None], exc: BaseException | None) -> T | None:
        if self.settings.stale_if_error <= 0:
            return None
        try:
            old = stale()
        except FileNotFoundError:
            self.outage.served(exc)
            raise
        if old is not None:
            self.outage.served(exc)
        return old

    def _stale_stat(self, path: str) -> ObjectInfo | None:
        """The entry of `path` as last seen: its own, or from the last listing of it or of its folder."""
        info = self.metadata.get_stale(path)
        if info is not None:
            return info
        own = self._stale_listing("dir", path)
        if own is not None:
            named = [e for e in own if e.path.rstrip("/") == path.rstrip("/")]
            return named[0] if named else ObjectInfo(path=path, size=0, is_dir=True, identity="dir")
        kept = self._stale_listing("stat", path)  # a mount's root (keep)
        if kept:
            return kept[0]
        parent = posixpath.dirname(path.rstrip("/"))
        if parent == path or not path:
            return None
        listed = self._stale_listing("dir", parent)
        if listed is None:
            return None
        for entry in listed:
            if entry.path.rstrip("/") == path.rstrip("/"):
                return entry
        raise FileNotFoundError(
            errno.ENOENT,
            f"{self.backend.url(path)}: not in the last listing of its folder (the backend cannot be "
            "reached)",
        )

    def keep(self, info: ObjectInfo) -> None:
        """Keeps the entry on disk (a mount's root, as the backend gave it): a process started while the
        backend is down then knows it even if it was never listed."""
        if self.kept is not None:
            self.kept.save("stat", info.path, [info])

    def _stale_listing(self, kind: str, path: str) -> list[ObjectInfo] | None:
        entries = self.metadata.get_stale_listing(kind, path)
        if entries is None and self.kept is not None:
            entries = self.kept.listing(kind, path, self.settings.metadata_ttl + self.settings.stale_if_error)
        return entries

    def open(self, path: str) -> OpenObject:
        return self.open_version(self.stat(path))

    def open_version(self, info: ObjectInfo) -> OpenObject:
        """A handle pinned to the version `info` names."""
        if info.is_dir:
            raise IsADirectoryError(21, f"{self.backend.url(info.path)} is a directory")
        return OpenObject(info, self.reader, self.reader.new_state())

    def read(self, path: str, offset: int = 0, length: int = -1) -> bytes:
        """A range of the current version. If the object changes mid-read, starts over once on the new one."""
        for attempt in range(2):
            info = self.stat(path, fresh=attempt > 0)
            if info.is_dir:
                raise IsADirectoryError(21, f"{self.backend.url(path)} is a directory")
            state = self.reader.new_state()
            try:
                return self.reader.read(info, offset, length, state)
            except ObjectChangedError:
                self.metadata.invalidate(path)
                if attempt:
                    raise
            finally:
                state.close()
        raise AssertionError("unreachable")

    def walk_files(self, path: str) -> Iterator[ObjectInfo]:
        """The object at path, or every object under it."""
        info = self.stat(path)
        if info.is_dir:
            yield from self.find(path)
        else:
            yield info

    def invalidate(self, path: str) -> None:
        self.metadata.invalidate(path)
        self.backend.invalidate(path)
        if self.kept is not None:  # changed here: the folder's kept listing no longer holds
            self.kept.forget("dir", posixpath.dirname(path.rstrip("/")))


_shared_caches: dict[tuple[object, ...], BlockCache] = {}


class RequestCounter:
    """Counts each backend request into the cache directory's machine-wide totals (`pffs stats`); equal
    to another counter into the same totals."""

    def __init__(self, stats: CacheStats) -> None:
        self.stats = stats

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RequestCounter) and other.stats is self.stats

    def __hash__(self) -> int:
        return id(self.stats)

    def __call__(self, kind: str, seconds: float, outcome: str) -> None:
        self.stats.add(f"backend_{kind}_requests")
        if outcome != OK:
            self.stats.add(f"backend_{kind}_{'not_found' if outcome == NOT_FOUND else 'errors'}")


def shared_block_cache(settings: CacheSettings) -> BlockCache:
    """One BlockCache (and so one memory tier) per cache directory per process, whatever reads through it."""
    # The disk bound is the cache's: one given (--cache-size) is kept with the cache; without one, the
    # cache's own applies (10 GiB for a new cache), not the default of this command.
    bound_given = "cache_size" in settings.model_fields_set
    key = (
        os.getpid(),
        str(settings.cache_dir),
        settings.cache_size,
        bound_given,
        settings.memory_cache_size,
        settings.direct_io,
        settings.cache_free_space,
    )
    cache = _shared_caches.get(key)
    if cache is None:
        _warn_if_beyond_the_machine(settings, bound_given)
        cache = _shared_caches[key] = BlockCache(
            settings.cache_dir,
            settings.cache_size,
            settings.memory_cache_size,
            settings.direct_io,
            keep_stored_bound=not bound_given,
            free_space_ratio=settings.cache_free_space,
        )
    return cache


def _warn_if_beyond_the_machine(settings: CacheSettings, disk_bound_given: bool) -> None:
    """A bound this machine cannot give is likely a slip (100T for 100G): said once; the cache still runs,
    and then fills the disk or the memory before it evicts anything. (A disk bound not given is the
    cache's own, not settings.cache_size: nothing to say of it here.)"""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if settings.memory_cache_size > memory:
        log.warning(
            "memory cache size %s is more than this machine's memory (%s): reads will push other memory out",
            format_size(settings.memory_cache_size),
            format_size(memory),
        )
    if not disk_bound_given:
        return
    folder = Path(settings.cache_dir).absolute()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        disk = shutil.disk_usage(folder).total
    except OSError:
        return
    if settings.cache_size > disk:
        log.warning(
            "cache size %s is more than the whole disk under %s (%s): the cache will fill the disk before "
            "it evicts anything",
            format_size(settings.cache_size),
            settings.cache_dir,
            format_size(disk),
        )
