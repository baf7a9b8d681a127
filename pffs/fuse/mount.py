"""A mount's life, in one place: open the backend and the cache, check the source, mount, serve until
unmounted or signalled, upload what is pending, unmount, close.

`serve` runs in the foreground (`pffs mount --foreground`) or in the background process that `pffs mount`
starts (pffs.cli.mount_daemon); `ready` tells the caller the mount is up, or why it could not be. However
the mount ends, its last log line says how, and the exit status says it too (pffs.fuse.ending); a mount
that failed is left in place, dead, rather than unmounted.
"""

from __future__ import annotations

import contextlib
import ctypes
import difflib
import errno
import faulthandler
import logging
import os
import posixpath
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

import pyfuse3
import trio

from pffs.backends.backend import Backend
from pffs.backends.deadline import FAILURE_SHARED_S, share_failures
from pffs.backends.urls import open_backend
from pffs.cache.single_flight import share_failures as share_block_failures
from pffs.fuse import mount_record
from pffs.fuse.ending import (
    DETACH_SIGNAL,
    EXIT_UNMOUNTED,
    EXIT_UNMOUNTED_OUTSIDE,
    EXIT_UPLOADS_FAILED,
    Ending,
    how_serving_ended,
    serving_failed,
)
from pffs.fuse.metrics import start_metrics_server
from pffs.fuse.mountpoint import force_unmount, in_mount_table, raise_read_ahead
from pffs.fuse.operations import Operations
from pffs.fuse.options import MountOptions
from pffs.processes import public_url
from pffs.vfs import Vfs
from pffs.vfs.namespace import Namespace, directory_info, keys_under
from pffs.vfs.staging import Staging

log = logging.getLogger(__name__)

CACHE_DIR_CHECK_S = 2.0  # how often the mount checks that its cache directory is still there


def serve(
    options: MountOptions, ready: Callable[[tuple[str, ...]], None], supervisor: int | None = None
) -> int:
    """Mounts and serves until unmounted, then returns the exit status of the way it ended (ending.py) after
    logging it as its last line. Raises before `ready` if the mount cannot be made (bad source,
    credentials, mountpoint); `ready` gets what the user should know of the mount made (a source that did
    not exist: one line each, logged too). `supervisor`: the pid of the process that waits for this one
    (mount_daemon)."""
    enable_faulthandler()
    keep_freed_memory()
    signal.signal(DETACH_SIGNAL, signal.SIG_IGN)  # until the serving loop handles it
    record = mount_record.record_path(options.log_file, options.cache.cache_dir, options.mountpoint)
    previous = mount_record.ended_without_a_word(record)
    if previous:
        log.warning("%s", previous)
    answered = False

    def answer(notices: tuple[str, ...]) -> None:
        nonlocal answered
        ready(notices)
        answered = True

    try:
        ending = _mount_and_serve(options, answer, record, supervisor)
    except Exception as exc:
        if not answered:
            raise  # could not mount: the caller says why
        log.critical("the mount failed while unmounting", exc_info=True)
        ending = serving_failed(exc, options.mountpoint)
    source = public_url(options.source)
    line = ending.last_line(source, options.mountpoint, os.getpid())
    level = {EXIT_UNMOUNTED: logging.INFO, EXIT_UNMOUNTED_OUTSIDE: logging.WARNING}.get(
        ending.code, logging.ERROR
    )
    log.log(level, "%s", line)
    mount_record.ended(record, ending.code, ending.cause)
    return ending.code


def _missing_root(backend: Backend, root: str, options: MountOptions) -> tuple[bool, str]:
    """A source that does not exist: a missing bucket fails either way (pffs does not create buckets); a
    missing prefix or folder fails a read-only mount (nothing to show) and starts a read-write one empty
    (the first file written makes the prefix, as with Mountpoint; a file system's folder is made now).
    Returns whether the root is to be shown as a new, empty directory, and the one line that says so to
    the user, naming the existing names nearest to the missing one (a typo is the likely cause)."""
    url = public_url(options.source)
    if not backend.has_real_directories:
        bucket = root.split("/", 1)[0]
        try:
            backend.stat(bucket)
        except FileNotFoundError:
            endpoint = options.backend.endpoint_url
            where = f" at {public_url(endpoint)}" if endpoint else ""
            raise FileNotFoundError(
                errno.ENOENT,
                f"{url}: the bucket {bucket} does not exist{where}; pffs does not create buckets, so "
                "neither a read-only nor a read-write mount can use it: check the bucket's name "
                "(and --endpoint-url), or create the bucket first",
            ) from None
    nearest = _nearest_names(backend, root)
    meant = f"did you mean {' or '.join(nearest)}?" if nearest else ""
    if options.read_only:
        raise FileNotFoundError(
            errno.ENOENT,
            f"{url} does not exist (nothing to read; a read-write mount of it starts empty)"
            + (f"; {meant}" if nearest else ""),
        )
    if backend.has_real_directories:
        backend.make_dir(root)
        notice = f"{url} did not exist: made it, empty"
        is_new = False
    else:
        notice = f"{url} does not exist yet: mounted empty, and the first file written creates it"
        is_new = True
    if nearest:
        notice += f"; {meant} (then pffs umount {options.mountpoint} and mount that)"
    return is_new, notice


def _nearest_names(backend: Backend, root: str, levels: int = 3) -> list[str]:
    """URLs of existing folders whose names are closest to the missing part of `root` (s3://b/imagnet/train
    -> s3://b/imagenet/train), from one listing of the nearest existing parent; none if it has no close
    name, or cannot be listed."""
    missing = root.rstrip("/")
    for _ in range(levels):
        parent, name = posixpath.split(missing)
        if not name or not parent:
            return []
        try:
            entries = backend.list_dir(parent)
        except FileNotFoundError:
            missing = parent  # its parent is missing too: the typo may be higher up
            continue
        except Exception as exc:  # a guess only: no suggestion
            log.debug("could not list %s for names like %s: %s", parent, name, exc)
            return []
        folders = {posixpath.basename(e.path.rstrip("/")) for e in entries if e.is_dir}
        close = difflib.get_close_matches(name, sorted(folders), n=2, cutoff=0.6)
        rest = root.rstrip("/")[len(missing) :]
        return [public_url(backend.url(posixpath.join(parent, c) + rest)) for c in close]
    return []


def _mount_and_serve(
    options: MountOptions, ready: Callable[[tuple[str, ...]], None], record: Path, supervisor: int | None
) -> Ending:
    leave_dead = False  # a mount that fails stays in place, dead: ENOTCONN, not an empty folder
    notices: list[str] = []  # for the user at mount time (also logged): one line each
    with contextlib.ExitStack() as stack:
        backend, root = open_backend(options.source, options.backend)
        if options.engine == "native":
            return _serve_natively(options, backend, root, ready, record, supervisor)
        # The kernel sends waiting lookups and page reads again, one by one, when the one it sent fails:
        # they share its failure, and its deadline, rather than each starting a deadline of its own.
        share_failures(FAILURE_SHARED_S)
        share_block_failures(FAILURE_SHARED_S)
        # The kernel keeps what the mount serves in its page cache: the disk tier is read around it.
        vfs = Vfs(backend, options.cache.model_copy(update={"direct_io": True}))
        stack.callback(vfs.cache.close)
        try:
            root_info = vfs.stat(root)  # the backend answers, the credentials work, the source exists
        except FileNotFoundError:
            root_is_new, notice = _missing_root(backend, root, options)
            log.warning("%s", notice)
            notices.append(notice)
        else:
            root_is_new = False
            if not root_info.is_dir:
                if backend.has_real_directories or not keys_under(backend, root):
                    raise NotADirectoryError(20, f"{options.source} is an object, not a directory or prefix")
                # an object beside keys under `root/`: the directory hides it (pffs.vfs.namespace)
                root_info = directory_info(root)
                vfs.metadata.put(root_info)
            if not vfs.outage.active:
                vfs.keep(root_info)  # for a mount started while the backend is down
        if vfs.outage.active:  # the root as last seen (stale-if-error): a warm cache, the store down
            notice = (
                f"{public_url(options.source)}: the backend cannot be reached ({vfs.outage.reason}); "
                "mounted from what this node last saw of it (--stale-if-error): cached data reads, the "
                "rest fails until the backend answers"
            )
            log.warning("%s", notice)
            notices.append(notice)
        if options.peers is not None:
            vfs.join_group(options.peers, root)
        staging = Staging(options.cache.cache_dir / "staging", backend)
        for left in staging.leftovers():
            log.warning(
                "a file written through an earlier mount was never uploaded: %s (its data: %s)",
                left["url"],
                left["data"],
            )
        posix = keeps_posix_attributes(options, backend.stores_posix_metadata)
        namespace = Namespace(vfs, staging, negative_ttl_s=options.attr_ttl, posix=posix)
        if root_is_new:
            namespace.new_dirs.add(root)  # shown (empty) until a file is written: that makes the prefix
        operations = Operations(namespace, root, options)
        stack.callback(operations.close)
        watch = CacheDirectoryWatch(options.cache.cache_dir, vfs, staging)
        operations.cache_dir_check = watch.check

        pyfuse3.init(operations, str(options.mountpoint), fuse_options(options, posix))
        stack.callback(lambda: pyfuse3.close(unmount=not leave_dead))
        if options.metrics_port:
            start_metrics_server(operations.report, options.metrics_address, options.metrics_port)
        log.info("mounted %s at %s (pid %d)", public_url(options.source), options.mountpoint, os.getpid())
        ready(tuple(notices))
        mount_record.running(
            record, public_url(options.source), options.mountpoint, options.log_file, supervisor
        )
        try:
            signalled, detached = trio.run(_serve_until_unmounted, options.mountpoint, watch)
            # Still mounted after a signal: never stat it here (nobody answers now), read the table only.
            listed = not signalled and in_mount_table(options.mountpoint)
            ending = how_serving_ended(signalled, listed, options.mountpoint, detached)
        except Exception as exc:
            log.critical("the mount's serving loop failed", exc_info=True)
            ending = serving_failed(exc, options.mountpoint)
        leave_dead = ending.code != EXIT_UNMOUNTED and ending.code != EXIT_UNMOUNTED_OUTSIDE
        failed = staging.upload_all()
        for url in failed:
            log.error("could not upload %s before unmounting; its data stays in %s", url, staging.directory)
        if failed:
            ending = Ending(
                EXIT_UPLOADS_FAILED
                if ending.code in (EXIT_UNMOUNTED, EXIT_UNMOUNTED_OUTSIDE)
                else ending.code,
                f"{ending.cause}; {len(failed)} file(s) could not be uploaded, their data stays in "
                f"{staging.directory} (the next mount uploads them)",
            )
    return ending


def _serve_natively(
    options: MountOptions,
    backend: Backend,
    root: str,
    ready: Callable[[tuple[str, ...]], None],
    record: Path,
    supervisor: int | None,
) -> Ending:
    """--engine native: the source checked as for the Python engine (same messages), then served by the
    native core (pffs.fuse.native_engine)."""
    from pffs.fuse.native_engine import check_supported, serve_native

    check_supported(options, backend)
    try:
        info = backend.stat(root)  # the backend answers, the credentials work, the source exists
    except FileNotFoundError:
        _missing_root(backend, root, options)  # read-only: raises, naming the nearest names
        raise
    if not info.is_dir and not keys_under(backend, root):
        raise NotADirectoryError(20, f"{options.source} is an object, not a directory or prefix")
    return serve_native(options, backend, root, [], ready, record, supervisor)


async def _serve_until_unmounted(
    mountpoint: Path, watch: CacheDirectoryWatch | None = None
) -> tuple[str | None, bool]:
    """Serves until pyfuse3.main returns; the name of the signal that ended it, if one did, and whether the
    mount detached itself on request (DETACH_SIGNAL) before the kernel ended it."""
    signalled: list[str] = []
    detached: list[bool] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_terminate_on_signal, signalled)
        nursery.start_soon(_detach_on_signal, mountpoint, detached)
        nursery.start_soon(_tune_kernel_after_init, mountpoint)
        if watch is not None:
            nursery.start_soon(_watch_cache_directory, watch)
        await pyfuse3.main(min_tasks=4, max_tasks=64)
        nursery.cancel_scope.cancel()
    return (signalled[0] if signalled else None), bool(detached)


class CacheDirectoryWatch:
    """The cache directory deleted under the running mount (`rm -rf` of it, a cleanup script): said once in
    the log, and the mount goes on. Its disk cache is off from then on (its index went with the folder;
    blocks written now would be in no index once the mount ends): reads come from the memory cache and the
    backend. The folder is made again with an empty staging area, so files written from then on are staged
    and uploaded as before, statfs (df) answers, and the next mount starts a fresh cache there. Files being
    written when it went are lost with it (their close fails)."""

    def __init__(self, directory: Path, vfs: Vfs, staging: Staging) -> None:
        self.directory = directory
        self.vfs = vfs
        self.staging = staging
        self._lock = threading.Lock()
        self._identity = _identity(directory)

    def check(self) -> bool:
        """True if the directory had vanished (now made again). Blocks on the disk: call from a thread."""
        with self._lock:
            if self._identity is None or _identity(self.directory) == self._identity:
                return False
            disk = self.vfs.cache.disk
            if disk is not None:
                disk.turn_off()
            try:
                self.staging.directory.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                log.error(
                    "the cache directory %s was deleted under the mount, and cannot be made again (%s): "
                    "reads go on from memory and the backend; writes fail",
                    self.directory,
                    exc,
                )
                self._identity = None  # said once
                return True
            self._identity = _identity(self.directory)
        log.warning(
            "the cache directory %s was deleted under the mount: made it again, empty; the disk cache is off "
            "until the next mount (reads come from memory and the backend); files being written when it went "
            "are lost, files written from now on are uploaded as before",
            self.directory,
        )
        return True


def _identity(directory: Path) -> tuple[int, int] | None:
    try:
        found = os.stat(directory)
    except OSError:
        return None
    return found.st_dev, found.st_ino


async def _watch_cache_directory(watch: CacheDirectoryWatch) -> None:
    while True:
        await trio.sleep(CACHE_DIR_CHECK_S)
        await trio.to_thread.run_sync(watch.check)


async def _detach_on_signal(mountpoint: Path, detached: list[bool]) -> None:
    """DETACH_SIGNAL: the mount detaches itself (umount -l) and goes on serving the processes that use it
    until they let go; then the kernel ends the session. (Ignored outside the serving loop: see serve.)"""
    with trio.open_signal_receiver(DETACH_SIGNAL) as signals:
        async for _ in signals:
            log.info(
                "%s (pffs umount --lazy): detaching %s now; serving the processes that still use it until "
                "they let go",
                DETACH_SIGNAL.name,
                mountpoint,
            )
            detached.append(True)
            await trio.to_thread.run_sync(force_unmount, mountpoint)  # the loop answers its lookups
            return


async def _terminate_on_signal(signalled: list[str]) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        async for signum in signals:
            name = signal.Signals(signum).name
            log.info("%s: uploading what is pending, then unmounting", name)
            signalled.append(name)
            pyfuse3.terminate()
            return


def enable_faulthandler() -> None:
    """A fatal signal (SIGSEGV, SIGABRT, SIGBUS...) writes every thread's Python stack to the log before the
    process dies; SIGUSR1 writes them and goes on."""
    stream = log_stream()
    faulthandler.enable(file=stream, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=stream, all_threads=True)


def log_stream() -> TextIO:
    """The open log file (the root logger's file handler), or stderr."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler) and handler.stream is not None:
            return handler.stream
    return sys.stderr


def keep_freed_memory() -> None:
    """Has glibc's malloc keep freed memory for reuse instead of handing it back to the kernel at once.
    Block buffers (128 KiB to 4 MiB) come and go all the time; by default each thread's arena grows and
    shrinks with them (an mprotect or mmap/munmap per read, and fresh pages to fault in). The memory tier
    and the read-ahead budget bound what is live, so what is kept is bounded too."""
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(M_MMAP_THRESHOLD, 32 << 20)
        libc.mallopt(M_TRIM_THRESHOLD, 64 << 20)  # part of MEMORY_OVERHEAD_BYTES
        libc.mallopt(M_ARENA_MAX, 4)
    except (OSError, AttributeError) as exc:  # not glibc
        log.debug("malloc tuning not available: %s", exc)


# The mount's resident memory stays within --memory-cache-size plus this: about 90 MiB of interpreter and
# libraries, the read-ahead budget (64 MiB), the disk tier's write-behind queue (64 MiB), freed memory
# malloc keeps for reuse (the trim threshold below, 64 MiB) and the blocks of reads in flight. Measured peak
# 222 MiB over the memory cache for a 512 MiB cold read and 1,000 small files (tests/test_mount_memory.py
# checks it under a cgroup limit of twice the sum; bench/mounts.py reports the peak per phase).
MEMORY_OVERHEAD_BYTES = 320 << 20

# mallopt(3) parameters
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8


def keeps_posix_attributes(options: MountOptions, backend_can: bool) -> bool:
    """Modes, owners and times stored with each object (chmod, chown, utimens, symlinks, FIFOs): on for a
    read-write mount of a backend that can store them, unless --fixed-modes (or --read-only) keeps the
    mount's fixed ones, which need no HEAD per file."""
    return backend_can and not options.read_only and not options.fixed_modes


def fuse_options(options: MountOptions, posix: bool = False) -> set[str]:
    fsname = options.source.replace(",", "_")
    chosen = set(pyfuse3.default_options) | {f"fsname={fsname}", "subtype=pffs", "noatime"}
    if posix:
        chosen.add("default_permissions")  # the kernel checks access against the stored modes
    if options.read_only:
        chosen.add("ro")
    if options.allow_other:
        chosen.add("allow_other")
    return chosen


async def _tune_kernel_after_init(mountpoint: Path) -> None:
    """Raises the mount's read-ahead once the kernel has its INIT answer (which would lower a value set
    earlier to the 128 KiB the kernel proposed at mount time): pffs.fuse.mountpoint.raise_read_ahead, in a
    thread (its stat of the mountpoint is answered by this loop)."""
    await trio.to_thread.run_sync(raise_read_ahead, mountpoint)
